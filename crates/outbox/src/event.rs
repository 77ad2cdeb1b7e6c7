//! From a decoded outbox INSERT to the event the relay publishes.
//!
//! # Invariants
//! - E1 Only the row's `id`, `entity_id`, `event_type`, `created_at` and `payload` are read.
//!   The table's own `dedupe_key`, `partition_key` and `ordering_key` columns are never
//!   trusted: applications fill them with placeholders (the seed's `seed.py` does).
//! - E2 The payload is the column's text exactly as pgoutput sent it, a zero-copy slice.
//! - E3 A row from which no faithful event can be built (a NULL key column, `infinity`) is
//!   an [`EventError`] naming the outbox id and the column: never a silently altered or
//!   dropped event. Values a header cannot carry verbatim (a line break, a header name) are
//!   not refused: the sink percent-encodes them ([`crate::encoding`]).

use std::fmt;
use std::num::NonZeroU64;

use bytes::Bytes;
use pgoutput::{ColumnValue, Lsn, Relation, TupleData};

use crate::keys::{compute_keys, shard_for_key, Keys};
use crate::subject::subject;
use crate::timestamp::{epoch_millis, parse_timestamptz, TimestampError};

/// Type OIDs the relay understands (`pg_type.oid`; stable across Postgres versions).
pub mod oid {
    /// `smallint`.
    pub const INT2: u32 = 21;
    /// `integer`.
    pub const INT4: u32 = 23;
    /// `bigint`.
    pub const INT8: u32 = 20;
    /// `text`.
    pub const TEXT: u32 = 25;
    /// `character varying`.
    pub const VARCHAR: u32 = 1043;
    /// `name`.
    pub const NAME: u32 = 19;
    /// `uuid`.
    pub const UUID: u32 = 2950;
    /// `json`.
    pub const JSON: u32 = 114;
    /// `jsonb`.
    pub const JSONB: u32 = 3802;
    /// `timestamp with time zone`.
    pub const TIMESTAMPTZ: u32 = 1184;

    /// A readable name for the types above.
    pub fn name(oid: u32) -> String {
        match oid {
            INT2 => "smallint".into(),
            INT4 => "integer".into(),
            INT8 => "bigint".into(),
            TEXT => "text".into(),
            VARCHAR => "varchar".into(),
            NAME => "name".into(),
            UUID => "uuid".into(),
            JSON => "json".into(),
            JSONB => "jsonb".into(),
            TIMESTAMPTZ => "timestamptz".into(),
            1114 => "timestamp (without time zone)".into(),
            1042 => "char(n)".into(),
            other => format!("type oid {other}"),
        }
    }
}

/// The columns the relay reads, and the types each may have.
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
    /// Required columns that do not exist.
    pub missing: Vec<&'static str>,
    /// `(column, found type, accepted types)`.
    pub wrong_type: Vec<(&'static str, String, String)>,
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
        write!(
            f,
            " (the relay reads id bigint, entity_id text, event_type text, payload jsonb and \
             created_at timestamptz; see sql/schema.sql)"
        )
    }
}

impl std::error::Error for SchemaError {}

/// Where the columns the relay reads sit in a tuple of the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxColumns {
    id: usize,
    entity_id: usize,
    event_type: usize,
    payload: usize,
    created_at: usize,
}

impl OutboxColumns {
    /// Locates and type-checks the columns, from `(name, type oid)` pairs in table order
    /// (a pgoutput `Relation`, or `pg_attribute` at bootstrap).
    pub fn resolve<'a>(
        table: &str,
        columns: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<Self, SchemaError> {
        let columns: Vec<(&str, u32)> = columns.into_iter().collect();
        let mut found = [usize::MAX; 5];
        let mut error = SchemaError {
            table: table.to_owned(),
            missing: vec![],
            wrong_type: vec![],
        };
        for (slot, (name, accepted)) in REQUIRED_COLUMNS.iter().enumerate() {
            match columns.iter().position(|(column, _)| column == name) {
                None => error.missing.push(name),
                Some(index) if accepted.contains(&columns[index].1) => found[slot] = index,
                Some(index) => error.wrong_type.push((
                    name,
                    oid::name(columns[index].1),
                    accepted
                        .iter()
                        .map(|&o| oid::name(o))
                        .collect::<Vec<_>>()
                        .join(" or "),
                )),
            }
        }
        if !error.missing.is_empty() || !error.wrong_type.is_empty() {
            return Err(error);
        }
        let [id, entity_id, event_type, payload, created_at] = found;
        Ok(Self {
            id,
            entity_id,
            event_type,
            payload,
            created_at,
        })
    }

    /// [`Self::resolve`] for a pgoutput `Relation` message.
    pub fn from_relation(relation: &Relation) -> Result<Self, SchemaError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        Self::resolve(
            &table,
            relation
                .columns
                .iter()
                .map(|c| (c.name.as_str(), c.type_oid)),
        )
    }
}

/// The columns of an outbox row the relay reads (E1), decoded: everything an event is
/// derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// `id`.
    pub id: i64,
    /// `entity_id`, as text.
    pub entity_id: String,
    /// `event_type`, exactly.
    pub event_type: String,
    /// `payload`, its text unchanged.
    pub payload: Bytes,
    /// `created_at` in epoch milliseconds (floor, [`crate::timestamp::epoch_millis`]).
    pub created_at_ms: i64,
}

impl OutboxRow {
    /// The event the relay publishes for this row at `position`: the seed's keys, the shard
    /// of the partition key among `partitions`, the subject under `prefix`.
    pub fn into_event(
        self,
        prefix: &str,
        partitions: NonZeroU64,
        position: Position,
    ) -> OutboxEvent {
        let keys = compute_keys(
            self.id,
            &self.entity_id,
            &self.event_type,
            self.created_at_ms,
        );
        let shard = shard_for_key(partitions, &keys.partition_key);
        OutboxEvent {
            subject: subject(prefix, shard, &self.event_type),
            id: self.id,
            entity_id: self.entity_id,
            event_type: self.event_type,
            keys,
            shard,
            payload: self.payload,
            position,
            created_at_ms: self.created_at_ms,
        }
    }
}

/// One event, ready to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The outbox row's `id`.
    pub id: i64,
    /// The row's `entity_id`, as text.
    pub entity_id: String,
    /// The row's `event_type`, exactly.
    pub event_type: String,
    /// The seed's keys.
    pub keys: Keys,
    /// `shard_for_key(partitions, partition_key)`.
    pub shard: u64,
    /// `{prefix}.{shard}.{event_type_token}`.
    pub subject: String,
    /// The row's `payload` text, unchanged.
    pub payload: Bytes,
    /// Where the event stands in the commit order; stable across replays.
    pub position: Position,
    /// The row's `created_at` in exact milliseconds since the Unix epoch (the ordering key's
    /// first part), for the created → stored latency the relay measures.
    pub created_at_ms: i64,
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
#[error("outbox row {}: {kind}", id.map_or_else(|| "with unreadable id".to_owned(), |id| format!("id={id}")))]
pub struct EventError {
    /// The row's id, when it could be read.
    pub id: Option<i64>,
    /// What is wrong.
    pub kind: EventErrorKind,
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
    Null(&'static str),
    /// The value was not sent (unchanged TOAST; impossible for an INSERT).
    #[error("column {0} was not sent by the server")]
    Unsent(&'static str),
    /// The value came in binary format (the relay asks for text).
    #[error("column {0} arrived in binary format")]
    Binary(&'static str),
    /// Not UTF-8.
    #[error("column {0} is not valid UTF-8")]
    Utf8(&'static str),
    /// `id` is not an integer.
    #[error("column id is not an integer")]
    Id,
    /// `created_at` cannot give epoch milliseconds.
    #[error(transparent)]
    CreatedAt(#[from] TimestampError),
}

/// Builds events from outbox INSERT tuples.
#[derive(Debug, Clone)]
pub struct EventBuilder {
    columns: OutboxColumns,
    prefix: String,
    partitions: NonZeroU64,
}

impl EventBuilder {
    /// A builder for a table whose columns were resolved.
    pub fn new(columns: OutboxColumns, prefix: impl Into<String>, partitions: NonZeroU64) -> Self {
        Self {
            columns,
            prefix: prefix.into(),
            partitions,
        }
    }

    /// Derives the event for one inserted row at `position` in the commit order.
    pub fn build(&self, tuple: &TupleData, position: Position) -> Result<OutboxEvent, EventError> {
        let c = &self.columns;
        let need = [c.id, c.entity_id, c.event_type, c.payload, c.created_at]
            .into_iter()
            .max()
            .unwrap_or(0);
        if tuple.len() <= need {
            return Err(EventError {
                id: None,
                kind: EventErrorKind::ShortTuple {
                    need: need + 1,
                    have: tuple.len(),
                },
            });
        }
        let mut values: [Option<ColumnValue>; 5] = Default::default();
        for (index, value) in tuple.iter().enumerate().take(need + 1) {
            for (slot, wanted) in [c.id, c.entity_id, c.event_type, c.payload, c.created_at]
                .into_iter()
                .enumerate()
            {
                if index == wanted {
                    values[slot] = Some(value.clone());
                }
            }
        }
        let [id, entity_id, event_type, payload, created_at] = values;

        let id_text = text("id", id).map_err(|kind| EventError { id: None, kind })?;
        let id: i64 = std::str::from_utf8(&id_text)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or(EventError {
                id: None,
                kind: EventErrorKind::Id,
            })?;
        let fail = |kind| EventError { id: Some(id), kind };

        let entity_id =
            utf8("entity_id", text("entity_id", entity_id).map_err(fail)?).map_err(fail)?;
        let event_type =
            utf8("event_type", text("event_type", event_type).map_err(fail)?).map_err(fail)?;
        let payload = text("payload", payload).map_err(fail)?;
        let created_at = text("created_at", created_at).map_err(fail)?;
        let created_at_ms =
            epoch_millis(parse_timestamptz(&created_at).map_err(|e| fail(e.into()))?);

        let row = OutboxRow {
            id,
            entity_id,
            event_type,
            payload,
            created_at_ms,
        };
        Ok(row.into_event(&self.prefix, self.partitions, position))
    }
}

fn text(column: &'static str, value: Option<ColumnValue>) -> Result<Bytes, EventErrorKind> {
    match value {
        Some(ColumnValue::Text(bytes)) => Ok(bytes),
        Some(ColumnValue::Null) | None => Err(EventErrorKind::Null(column)),
        Some(ColumnValue::UnchangedToast) => Err(EventErrorKind::Unsent(column)),
        Some(ColumnValue::Binary(_)) => Err(EventErrorKind::Binary(column)),
    }
}

fn utf8(column: &'static str, bytes: Bytes) -> Result<String, EventErrorKind> {
    String::from_utf8(bytes.to_vec()).map_err(|_| EventErrorKind::Utf8(column))
}

#[cfg(test)]
mod tests {
    use super::*;

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
