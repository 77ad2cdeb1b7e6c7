//! From a decoded outbox INSERT to the event the relay publishes.
//!
//! # Invariants
//! - E1 Only the columns the [`Mapping`] names are read: the seed's `id`, `entity_id`,
//!   `event_type`, `created_at` and `payload` by default, plus the subject template's, the
//!   header columns and the trace context's when configured. The table's own
//!   `dedupe_key`, `partition_key` and `ordering_key` columns are never trusted:
//!   applications fill them with placeholders (the seed's `seed.py` does).
//! - E2 The payload is the column's text exactly as pgoutput sent it, a zero-copy slice
//!   (a `bytea` payload: its bytes, decoded from the hex output).
//! - E4 A replication tuple and a query's row go through one builder
//!   ([`EventBuilder::build_values`]), so backfill, verify and replay derive exactly the
//!   event streaming derives.
//! - E3 A row from which no faithful event can be built (a NULL key column, `infinity`) is
//!   an [`EventError`] naming the outbox id and the column: never a silently altered or
//!   dropped event. Values a header cannot carry verbatim (a line break, a header name) are
//!   not refused: the sink percent-encodes them ([`crate::encoding`]).

use std::fmt;
use std::num::NonZeroU64;

use bytes::Bytes;
use pgoutput::{ColumnRef, Lsn, Relation, TupleData};

use std::sync::Arc;

use crate::cloudevents::CloudEvents;
use crate::encoding;
use crate::id::EventId;
use crate::keys::{shard_for_key, Keys};
use crate::mapping::{
    trace_context, EventTypeFilter, IdKind, Mapping, PayloadKind, Role, TimeKind, TRACEPARENT,
    TRACESTATE,
};
use crate::subject::subject;
use crate::template::SubjectTemplate;
use crate::timestamp::{epoch_millis, parse_timestamptz, TimestampError};

pub use crate::mapping::oid;

/// The seed's columns and the types each may have (`sql/schema.sql`).
pub const REQUIRED_COLUMNS: [(&str, &[u32]); 5] = [
    ("id", &[oid::INT8, oid::INT4, oid::INT2]),
    (
        "entity_id",
        &[oid::TEXT, oid::VARCHAR, oid::NAME, oid::UUID],
    ),
    ("event_type", &[oid::TEXT, oid::VARCHAR, oid::NAME]),
    ("payload", &[oid::JSONB, oid::JSON]),
    ("created_at", &[oid::TIMESTAMPTZ]),
];

/// The table lacks a column the relay reads, or a column has a type it cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The table, as `schema.name`.
    pub table: String,
    /// Columns the mapping names that do not exist.
    pub missing: Vec<String>,
    /// `(column, found type, accepted types)`.
    pub wrong_type: Vec<(String, String, String)>,
    /// Whether the mapping is the seed's (the advice differs).
    pub seed: bool,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "table {} cannot be relayed:", self.table)?;
        if !self.missing.is_empty() {
            write!(f, " missing column(s) {}", self.missing.join(", "))?;
        }
        for (i, (column, found, accepted)) in self.wrong_type.iter().enumerate() {
            let sep = if i == 0 && self.missing.is_empty() {
                " "
            } else {
                "; "
            };
            write!(f, "{sep}column {column} is {found}, expected {accepted}")?;
        }
        if self.seed {
            write!(
                f,
                " (the relay reads id bigint, entity_id text, event_type text, payload jsonb and \
                 created_at timestamptz; see sql/schema.sql, or map your own columns with \
                 OUTBOX_RELAY_TABLE_PRESET or the OUTBOX_RELAY_*_COLUMN settings, docs/own-table.md)"
            )
        } else {
            write!(
                f,
                " (name the table's columns with the OUTBOX_RELAY_*_COLUMN settings or the \
                 preset OUTBOX_RELAY_TABLE_PRESET; docs/own-table.md)"
            )
        }
    }
}

impl std::error::Error for SchemaError {}

impl SchemaError {
    /// Adds each role column found (`read`, of `types`) whose type cannot play its role; the
    /// seed's table keeps its narrower types (its messages are frozen).
    fn check_role_types(&mut self, mapping: &Mapping, read: &[(Arc<str>, usize)], types: &[u32]) {
        let names = |oids: &[u32]| {
            oids.iter()
                .map(|&o| oid::name(o))
                .collect::<Vec<_>>()
                .join(" or ")
        };
        for role in Role::ALL {
            let name = mapping.column(role);
            let Some(i) = read.iter().position(|(n, _)| &**n == name) else {
                continue;
            };
            let seed_types = REQUIRED_COLUMNS[role as usize].1;
            let (ok, accepted) = if self.seed {
                (seed_types.contains(&types[i]), names(seed_types))
            } else {
                (role.accepts(types[i]), role.accepted().to_owned())
            };
            if !ok {
                self.wrong_type
                    .push((name.to_owned(), oid::name(types[i]), accepted));
            }
        }
    }
}

/// Where the columns the relay reads sit in a tuple of the outbox table, and what they hold:
/// the mapping resolved against the table's columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxColumns {
    /// The columns read, in [`Mapping::read_columns`] order: `(name, index in the table)`.
    read: Vec<(Arc<str>, usize)>,
    /// The role columns' places in `read` (the first five, in [`Role::ALL`] order).
    id_kind: IdKind,
    payload_kind: PayloadKind,
    time_kind: TimeKind,
    /// The template's columns' places in `read`, in template order.
    template: Vec<usize>,
    /// Header columns: place in `read`, header name.
    headers: Vec<(usize, Arc<str>)>,
    /// The trace-context column's place in `read`.
    trace: Option<usize>,
    /// For each column of the table up to the last read, its place in `read` ([`NO_SLOT`]:
    /// not read).
    slot_of: Vec<u8>,
    /// The last table column read.
    need: usize,
}

/// [`OutboxColumns`]'s mark of a table column the relay does not read.
const NO_SLOT: u8 = u8::MAX;

impl OutboxColumns {
    /// Locates and type-checks the seed's columns, from `(name, type oid)` pairs in table
    /// order (a pgoutput `Relation`, or `pg_attribute` at bootstrap).
    pub fn resolve<'a>(
        table: &str,
        columns: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<Self, SchemaError> {
        Self::resolve_mapped(table, &Mapping::default(), columns)
    }

    /// Locates and type-checks the columns `mapping` reads.
    pub fn resolve_mapped<'a>(
        table: &str,
        mapping: &Mapping,
        columns: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<Self, SchemaError> {
        let columns: Vec<(&str, u32)> = columns.into_iter().collect();
        let seed = mapping.is_default();
        let mut error = SchemaError {
            table: table.to_owned(),
            missing: vec![],
            wrong_type: vec![],
            seed,
        };
        let find = |name: &str| columns.iter().position(|(column, _)| *column == name);
        let trace_column = mapping
            .trace_context
            .as_ref()
            .and_then(|t| (t.required || find(&t.column).is_some()).then_some(t.column.as_str()));
        let mut read: Vec<(Arc<str>, usize)> = Vec::new();
        let mut types: Vec<u32> = Vec::new();
        for name in mapping.read_columns() {
            let optional_trace = mapping
                .trace_context
                .as_ref()
                .is_some_and(|t| t.column == name && trace_column.is_none());
            if optional_trace {
                continue;
            }
            match find(name) {
                None => error.missing.push(name.to_owned()),
                Some(index) => {
                    read.push((name.into(), index));
                    types.push(columns[index].1);
                }
            }
        }
        error.check_role_types(mapping, &read, &types);
        if !error.missing.is_empty() || !error.wrong_type.is_empty() {
            return Err(error);
        }
        let place = |name: &str| {
            read.iter()
                .position(|(n, _)| &**n == name)
                .expect("every read column was found")
        };
        let [id, _, _, payload, created_at] = Role::ALL.map(|r| types[place(mapping.column(r))]);
        Ok(Self {
            id_kind: IdKind::of(id).expect("type checked"),
            payload_kind: PayloadKind::of(payload).expect("type checked"),
            time_kind: TimeKind::of(created_at).expect("type checked"),
            template: mapping.template.columns().map(place).collect(),
            headers: mapping
                .headers
                .iter()
                .map(|h| (place(&h.column), Arc::from(h.header.as_str())))
                .collect(),
            trace: trace_column.map(place),
            slot_of: slots(&read),
            need: read.iter().map(|(_, at)| *at).max().unwrap_or(0),
            read,
        })
    }

    /// [`Self::resolve`] for a pgoutput `Relation` message.
    pub fn from_relation(relation: &Relation) -> Result<Self, SchemaError> {
        Self::from_relation_mapped(relation, &Mapping::default())
    }

    /// [`Self::resolve_mapped`] for a pgoutput `Relation` message.
    pub fn from_relation_mapped(
        relation: &Relation,
        mapping: &Mapping,
    ) -> Result<Self, SchemaError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        Self::resolve_mapped(
            &table,
            mapping,
            relation
                .columns
                .iter()
                .map(|c| (c.name.as_str(), c.type_oid)),
        )
    }

    /// The columns read, in the order [`EventBuilder::build_values`] takes their values:
    /// a query selects them in this order (each as text, [`Self::select_list`]).
    pub fn read_columns(&self) -> impl Iterator<Item = &str> {
        self.read.iter().map(|(name, _)| &**name)
    }

    /// The id column's kind.
    pub fn id_kind(&self) -> IdKind {
        self.id_kind
    }

    /// The payload column's kind.
    pub fn payload_kind(&self) -> PayloadKind {
        self.payload_kind
    }
}

/// Each table column's place among the read columns (`NO_SLOT`: not read). A mapping reads
/// far fewer than 255 columns (each is named by a setting).
fn slots(read: &[(Arc<str>, usize)]) -> Vec<u8> {
    let need = read.iter().map(|(_, at)| *at).max().unwrap_or(0);
    let mut slot_of = vec![NO_SLOT; need + 1];
    for (slot, (_, at)) in read.iter().enumerate() {
        slot_of[*at] = u8::try_from(slot).unwrap_or(NO_SLOT);
    }
    slot_of
}

/// The columns of an outbox row the relay reads (E1), decoded: everything an event is
/// derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// `id`.
    pub id: EventId,
    /// `entity_id`, as text.
    pub entity_id: String,
    /// `event_type`, exactly.
    pub event_type: String,
    /// `payload`, its text unchanged (or a `bytea`'s bytes).
    pub payload: Bytes,
    /// `created_at` in epoch milliseconds (floor, [`crate::timestamp::epoch_millis`]).
    pub created_at_ms: i64,
    /// The texts of the subject template's columns, in template order.
    pub subject_values: Vec<String>,
    /// Headers from columns (NULL columns give none), the trace context's included.
    pub headers: Vec<(Arc<str>, String)>,
    /// The payload is a `bytea`'s bytes.
    pub binary: bool,
}

/// What shapes every event of a session beside its row: the subject prefix and template,
/// the shard count, the id kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// The subject prefix.
    pub prefix: String,
    /// The shard count.
    pub partitions: NonZeroU64,
    /// The subject template.
    pub template: SubjectTemplate,
    /// CloudEvents attributes every event carries as headers ([`crate::cloudevents`]), if
    /// asked for.
    pub cloudevents: Option<CloudEvents>,
}

impl Shape {
    /// The seed's subjects under `prefix`, `partitions` shards.
    pub fn new(prefix: impl Into<String>, partitions: NonZeroU64) -> Shape {
        Shape {
            prefix: prefix.into(),
            partitions,
            template: SubjectTemplate::default(),
            cloudevents: None,
        }
    }
}

impl OutboxRow {
    /// A row of the seed's table (no subject columns, no extra headers).
    pub fn seed(
        id: i64,
        entity_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<Bytes>,
        created_at_ms: i64,
    ) -> OutboxRow {
        OutboxRow {
            id: EventId::Int(id),
            entity_id: entity_id.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            created_at_ms,
            subject_values: Vec::new(),
            headers: Vec::new(),
            binary: false,
        }
    }

    /// The event the relay publishes for this row at `position` under the seed's subjects.
    pub fn into_event(
        self,
        prefix: &str,
        partitions: NonZeroU64,
        position: Position,
    ) -> OutboxEvent {
        self.into_shaped_event(&Shape::new(prefix, partitions), position)
    }

    /// The event the relay publishes for this row at `position`: the keys (ID1, ID2), the
    /// shard of the partition key, the subject of the template (TPL2).
    pub fn into_shaped_event(self, shape: &Shape, position: Position) -> OutboxEvent {
        let keys = self
            .id
            .keys(&self.entity_id, &self.event_type, self.created_at_ms);
        let shard = shard_for_key(shape.partitions, &keys.partition_key);
        let subject = if shape.template.is_default() {
            subject(&shape.prefix, shard, &self.event_type)
        } else {
            let mut out = String::with_capacity(shape.prefix.len() + 48);
            let names: Vec<&str> = shape.template.columns().collect();
            let values = &self.subject_values;
            shape
                .template
                .render(&mut out, &shape.prefix, shard, &self.event_type, |name| {
                    names
                        .iter()
                        .position(|n| *n == name)
                        .and_then(|i| values.get(i))
                        .map_or("", String::as_str)
                });
            out
        };
        let mut headers = self.headers;
        if let Some(cloudevents) = &shape.cloudevents {
            cloudevents.push_headers(
                &mut headers,
                &keys,
                &self.entity_id,
                &self.event_type,
                self.created_at_ms,
                self.binary,
            );
        }
        OutboxEvent {
            subject,
            id: self.id,
            entity_id: self.entity_id,
            event_type: self.event_type,
            keys,
            shard,
            payload: self.payload,
            position,
            created_at_ms: self.created_at_ms,
            headers,
            binary: self.binary,
        }
    }
}

/// One event, ready to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The outbox row's id.
    pub id: EventId,
    /// The row's `entity_id`, as text.
    pub entity_id: String,
    /// The row's `event_type`, exactly.
    pub event_type: String,
    /// The seed's keys.
    pub keys: Keys,
    /// `shard_for_key(partitions, partition_key)`.
    pub shard: u64,
    /// The subject: `{prefix}.{shard}.{event_type_token}` or the template's.
    pub subject: String,
    /// The row's `payload` text, unchanged (a `bytea`'s bytes).
    pub payload: Bytes,
    /// Where the event stands in the commit order; stable across replays.
    pub position: Position,
    /// The row's `created_at` in exact milliseconds since the Unix epoch (the ordering key's
    /// first part), for the created → stored latency the relay measures.
    pub created_at_ms: i64,
    /// Headers from the row's columns (the mapping's), in mapping order, then the
    /// CloudEvents attributes when the shape asks for them.
    pub headers: Vec<(Arc<str>, String)>,
    /// The payload is a `bytea`'s bytes, published as they are (a text payload must be
    /// UTF-8: the sink refuses one that is not).
    pub binary: bool,
}

impl OutboxEvent {
    /// Whether a header cannot carry one of the row's values verbatim
    /// ([`crate::encoding`]): its entity id, event type, a text id or a header column's.
    pub fn is_hostile(&self) -> bool {
        encoding::row_is_hostile(&self.entity_id, &self.event_type)
            || self.id.as_text().is_some_and(encoding::is_hostile)
            || self.headers.iter().any(|(_, v)| encoding::is_hostile(v))
    }
}

/// An event's place in the commit order: its transaction's commit LSN, then its index
/// among that transaction's outbox inserts. Stable across replays (a replay decodes the
/// same transactions in the same order), so the relay can compare what it is about to
/// publish with what the stream already holds.
///
/// Ordered by `commit_lsn`, then `index` (the field order; a test locks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// The commit LSN of the event's transaction (`Begin.final_lsn`).
    pub commit_lsn: Lsn,
    /// 0-based index among the transaction's outbox inserts.
    pub index: u32,
}

impl Position {
    /// Reads a position back from the `Outbox-Commit-Lsn` and `Outbox-Tx-Index` header values.
    pub fn from_headers(commit_lsn: &str, index: &str) -> Option<Position> {
        Some(Position {
            commit_lsn: commit_lsn.parse().ok()?,
            index: index.parse().ok()?,
        })
    }
}

/// Why no event could be built from a row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("outbox row {}: {kind}", id.as_ref().map_or_else(|| "with unreadable id".to_owned(), |id| format!("id={}", shown_id(id))))]
pub struct EventError {
    /// The row's id, when it could be read.
    pub id: Option<EventId>,
    /// What is wrong.
    pub kind: EventErrorKind,
}

/// An id as an error message shows it: a text id quoted and cut, so that no row value
/// can forge a log line.
fn shown_id(id: &EventId) -> String {
    match id {
        EventId::Int(id) => id.to_string(),
        EventId::Text(text) => {
            let cut: String = text.chars().take(80).collect();
            format!("{cut:?}")
        }
    }
}

/// What is wrong with a row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventErrorKind {
    /// The tuple has fewer columns than the relation.
    #[error("the tuple has {have} columns, fewer than the table's column {need}")]
    ShortTuple {
        /// Columns needed.
        need: usize,
        /// Columns present.
        have: usize,
    },
    /// A column the keys need is NULL.
    #[error("column {0} is NULL")]
    Null(Arc<str>),
    /// The value was not sent (unchanged TOAST; impossible for an INSERT).
    #[error("column {0} was not sent by the server")]
    Unsent(Arc<str>),
    /// The value came in binary format (the relay asks for text).
    #[error("column {0} arrived in binary format")]
    Binary(Arc<str>),
    /// Not UTF-8.
    #[error("column {0} is not valid UTF-8")]
    Utf8(Arc<str>),
    /// `id` is not what its column's type prints.
    #[error("column {0} is not an id of its type")]
    Id(Arc<str>),
    /// A `bytea` payload that is not in hex output.
    #[error("column {0} is not bytea hex output (\\x...)")]
    Bytea(Arc<str>),
    /// `created_at` cannot give epoch milliseconds.
    #[error(transparent)]
    CreatedAt(#[from] TimestampError),
}

/// Builds events from outbox INSERT tuples.
#[derive(Debug, Clone)]
pub struct EventBuilder {
    columns: OutboxColumns,
    shape: Shape,
    filter: EventTypeFilter,
    /// The filter admits every event type (asked once, not per event).
    admits_all: bool,
}

/// A column's value as the builder takes it: its text (or `None` for NULL), or what else
/// the server sent.
pub type Value = Result<Option<Bytes>, fn(Arc<str>) -> EventErrorKind>;

impl EventBuilder {
    /// A builder for a table whose columns were resolved, under the seed's subjects.
    pub fn new(columns: OutboxColumns, prefix: impl Into<String>, partitions: NonZeroU64) -> Self {
        Self::shaped(
            columns,
            Shape::new(prefix, partitions),
            EventTypeFilter::default(),
        )
    }

    /// A builder with a subject template and an event-type filter.
    pub fn shaped(columns: OutboxColumns, shape: Shape, filter: EventTypeFilter) -> Self {
        Self {
            columns,
            shape,
            admits_all: filter.admits_all(),
            filter,
        }
    }

    /// Derives the event for one inserted row at `position` in the commit order; `None`
    /// when the filter excludes its event type.
    pub fn build(
        &self,
        tuple: &TupleData,
        position: Position,
    ) -> Result<Option<OutboxEvent>, EventError> {
        let c = &self.columns;
        if tuple.len() <= c.need {
            return Err(EventError {
                id: None,
                kind: EventErrorKind::ShortTuple {
                    need: c.need + 1,
                    have: tuple.len(),
                },
            });
        }
        // One walk over the tuple, each read value borrowed into its slot (no reference
        // count touched: only the payload is kept, shared by `share`); on the stack for any
        // usual mapping.
        let mut small: [Option<&[u8]>; 8] = [None; 8];
        let mut large: Vec<Option<&[u8]>>;
        let values: &mut [Option<&[u8]>] = if c.read.len() <= small.len() {
            &mut small[..c.read.len()]
        } else {
            large = vec![None; c.read.len()];
            &mut large
        };
        let mut columns = tuple.iter();
        for index in 0..=c.need {
            let Some(value) = columns.next_ref() else {
                break;
            };
            if let Some(&slot) = c.slot_of.get(index).filter(|&&s| s != NO_SLOT) {
                let slot = usize::from(slot);
                values[slot] = match value {
                    ColumnRef::Text(bytes) => Some(bytes),
                    ColumnRef::Null => None,
                    // Neither happens to an INSERT's new tuple in text format.
                    ColumnRef::UnchangedToast => {
                        return Err(self.unreadable(slot, EventErrorKind::Unsent))
                    }
                    ColumnRef::Binary(_) => {
                        return Err(self.unreadable(slot, EventErrorKind::Binary))
                    }
                };
            }
        }
        let share = |part: &[u8]| {
            tuple
                .share(part)
                .unwrap_or_else(|| Bytes::copy_from_slice(part))
        };
        self.build_slots(values, share, position)
    }

    /// [`Self::build`] from the read columns' values (`value(i)` for the `i`-th of
    /// [`OutboxColumns::read_columns`]): a replication tuple's, or a query's that selected
    /// them as text.
    pub fn build_values(
        &self,
        value: impl Fn(usize) -> Value,
        position: Position,
    ) -> Result<Option<OutboxEvent>, EventError> {
        let mut values = Vec::with_capacity(self.columns.read.len());
        for i in 0..self.columns.read.len() {
            values.push(value(i).map_err(|kind| self.unreadable(i, kind))?);
        }
        self.build_slots(&mut values, |payload| payload, position)
    }

    /// The error of a read column whose value did not come as text.
    fn unreadable(&self, slot: usize, kind: fn(Arc<str>) -> EventErrorKind) -> EventError {
        EventError {
            id: None,
            kind: kind(self.columns.read[slot].0.clone()),
        }
    }

    /// The event of the read columns' values (E4): the one path of [`Self::build`] and
    /// [`Self::build_values`].
    fn build_slots<V: AsRef<[u8]>>(
        &self,
        values: &mut [Option<V>],
        share: impl FnOnce(V) -> Bytes,
        position: Position,
    ) -> Result<Option<OutboxEvent>, EventError> {
        let row = self.row(values, share)?;
        if !self.admits_all && !self.filter.admits(&row.event_type) {
            return Ok(None);
        }
        Ok(Some(row.into_shaped_event(&self.shape, position)))
    }

    /// The row's decoded columns. The template's and headers' columns are read first (a
    /// role's column may be one of them), then the roles' values are moved out; `share`
    /// makes the payload's `Bytes`.
    fn row<V: AsRef<[u8]>>(
        &self,
        values: &mut [Option<V>],
        share: impl FnOnce(V) -> Bytes,
    ) -> Result<OutboxRow, EventError> {
        let c = &self.columns;
        let name = |i: usize| c.read[i].0.clone();
        // Read in place: a header column may be the id column.
        let id = match &values[0] {
            Some(text) => std::str::from_utf8(text.as_ref())
                .ok()
                .and_then(|t| EventId::parse(c.id_kind, t))
                .ok_or(EventErrorKind::Id(name(0))),
            None => Err(EventErrorKind::Null(name(0))),
        }
        .map_err(|kind| EventError { id: None, kind })?;
        let fail = |kind| EventError {
            id: Some(id.clone()),
            kind,
        };
        let utf8 = |i: usize, bytes: &[u8]| {
            std::str::from_utf8(bytes)
                .map(str::to_owned)
                .map_err(|_| fail(EventErrorKind::Utf8(name(i))))
        };
        // The seed's table has neither: no call, no allocation.
        let subject_values = if c.template.is_empty() {
            Vec::new()
        } else {
            c.template
                .iter()
                .map(|&i| match &values[i] {
                    Some(bytes) => utf8(i, bytes.as_ref()),
                    None => Err(fail(EventErrorKind::Null(name(i)))),
                })
                .collect::<Result<_, _>>()?
        };
        let headers = if c.headers.is_empty() && c.trace.is_none() {
            Vec::new()
        } else {
            self.column_headers(values).map_err(fail)?
        };
        let mut role = |i: usize| {
            values[i]
                .take()
                .ok_or_else(|| fail(EventErrorKind::Null(name(i))))
        };
        let entity_id = role(1).and_then(|b| utf8(1, b.as_ref()))?;
        let event_type = role(2).and_then(|b| utf8(2, b.as_ref()))?;
        let payload = role(3)?;
        let created_at = role(4)?;
        let payload = match c.payload_kind {
            PayloadKind::Text => share(payload),
            PayloadKind::Bytes => {
                bytea_hex(payload.as_ref()).ok_or_else(|| fail(EventErrorKind::Bytea(name(3))))?
            }
        };
        let created_at_ms = created_at_ms(c.time_kind, created_at.as_ref()).map_err(fail)?;
        Ok(OutboxRow {
            id,
            entity_id,
            event_type,
            payload,
            created_at_ms,
            subject_values,
            headers,
            binary: c.payload_kind == PayloadKind::Bytes,
        })
    }

    /// The headers the row's header columns and trace-context column give (NULLs none).
    fn column_headers<V: AsRef<[u8]>>(
        &self,
        values: &[Option<V>],
    ) -> Result<Vec<(Arc<str>, String)>, EventErrorKind> {
        let c = &self.columns;
        let mut headers = Vec::new();
        for (i, header) in &c.headers {
            if let Some(bytes) = &values[*i] {
                let text = std::str::from_utf8(bytes.as_ref())
                    .map(str::to_owned)
                    .map_err(|_| EventErrorKind::Utf8(c.read[*i].0.clone()))?;
                headers.push((header.clone(), text));
            }
        }
        if let Some(Some(bytes)) = c.trace.map(|i| &values[i]) {
            let text = std::str::from_utf8(bytes.as_ref()).ok();
            if let Some((parent, state)) = text.and_then(trace_context) {
                headers.push((Arc::from(TRACEPARENT), parent));
                if let Some(state) = state {
                    headers.push((Arc::from(TRACESTATE), state));
                }
            }
        }
        Ok(headers)
    }
}

/// A creation time's exact milliseconds (TS1): `timestamptz` text, or `timestamp` text read
/// as UTC.
fn created_at_ms(kind: TimeKind, text: &[u8]) -> Result<i64, EventErrorKind> {
    let micros = match (kind, text) {
        (TimeKind::WithZone, _) | (TimeKind::Utc, b"infinity" | b"-infinity") => {
            parse_timestamptz(text)
        }
        (TimeKind::Utc, _) => {
            let mut utc = text.to_vec();
            utc.extend_from_slice(b"+00");
            parse_timestamptz(&utc)
        }
    };
    Ok(epoch_millis(micros?))
}

/// `\x` followed by hex digit pairs (Postgres' `bytea_output = hex`, which the relay's
/// sessions pin) → the bytes.
pub fn bytea_hex(text: &[u8]) -> Option<Bytes> {
    let hex = text.strip_prefix(b"\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    hex.chunks(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header or template column may be a role's column: each reads the same value.
    #[test]
    fn a_column_may_serve_a_role_a_header_and_the_template() {
        let mut mapping = Mapping {
            headers: crate::mapping::parse_header_columns("id:X-Id,entity_id:X-Entity").unwrap(),
            template: SubjectTemplate::parse("{prefix}.{entity_id}.{shard}").unwrap(),
            ..Mapping::default()
        };
        mapping.columns[0] = "id".into();
        let columns = OutboxColumns::resolve_mapped(
            "public.t",
            &mapping,
            [
                ("id", oid::TEXT),
                ("entity_id", oid::TEXT),
                ("event_type", oid::TEXT),
                ("payload", oid::BYTEA),
                ("created_at", oid::TIMESTAMP),
            ],
        )
        .unwrap();
        let shape = Shape {
            template: mapping.template.clone(),
            ..Shape::new("p", NonZeroU64::new(4).unwrap())
        };
        let builder = EventBuilder::shaped(columns, shape, EventTypeFilter::default());
        let texts = ["e.1", "a.b", "T", "\\x00ff", "2024-01-01 00:00:00.5"];
        let position = Position {
            commit_lsn: Lsn(1),
            index: 0,
        };
        let event = builder
            .build_values(|i| Ok(Some(Bytes::from(texts[i]))), position)
            .unwrap()
            .unwrap();
        assert_eq!(event.id, EventId::Text("e.1".into()));
        assert_eq!(event.entity_id, "a.b");
        assert_eq!(event.payload.as_ref(), &[0x00, 0xff]);
        assert!(event.binary);
        assert_eq!(event.created_at_ms, 1_704_067_200_500);
        assert_eq!(event.subject, format!("p.a%2Eb.{}", event.shard));
        let headers: Vec<(&str, &str)> = event
            .headers
            .iter()
            .map(|(n, v)| (&**n, v.as_str()))
            .collect();
        assert_eq!(headers, [("X-Id", "e.1"), ("X-Entity", "a.b")]);
        assert_eq!(event.keys.ordering_key, "1704067200500:e.1");
    }

    #[test]
    fn positions_order_by_commit_lsn_then_index() {
        let p = |lsn, index| Position {
            commit_lsn: Lsn(lsn),
            index,
        };
        assert!(p(1, 9) < p(2, 0), "commit LSN first");
        assert!(p(2, 0) < p(2, 1), "then the index within the transaction");
        assert_eq!(Position::from_headers("0/2", "1"), Some(p(2, 1)));
        assert_eq!(Position::from_headers("2", "1"), None);
        assert_eq!(Position::from_headers("0/2", "-1"), None);
    }
}
