//! `outbox-relay verify`: reconciles the outbox table with the stream and reports, by outbox
//! id, every event that is missing, duplicated, mismatched, out of order or on the stream
//! without a row.
//!
//! How ([`run`]):
//! 1. Postgres: the id bounds of the rows in range (`--from-id`, `--to-id`, `--since`,
//!    `--until`, `--entity`, on the columns the mapping names), read once before anything
//!    else. Rows committed after that are not expected. Id bounds compare as the id column's
//!    type: integers and uuids by value, text ids by their bytes (`COLLATE "C"`, whatever
//!    the column's collation), the order `outbox::EventId` sorts them in (`stored` ROW2).
//! 2. NATS: one ephemeral pull consumer over `{prefix}.>` (`DeliverPolicy::All`, no acks,
//!    large batches), read to the end, on a thread of its own with its own connection and a
//!    single-threaded runtime (no thread wake-up per message; the table's side runs beside
//!    it). Each message's headers are read in one pass (no lookup by name, which allocates
//!    and hashes the name). Per outbox id in the bounds (`Outbox-Id` read back by its
//!    `Outbox-Id-Kind` and `Outbox-Encoding`), a compact `Entry`
//!    (24 bytes: first sequence, digest of the first copy, copies, dead-letter records) —
//!    1 000 000 integer ids take 24 MB. The commit order is checked on the way: per entity (a hash of
//!    the entity id and the last position), and globally in strict mode (each event's
//!    `Outbox-Commit-Lsn`/`Outbox-Tx-Index` position after the previous one).
//! 3. Postgres, at the same time as 2 (a task of its own): the rows in id order through one
//!    streaming query (`query_raw`, never the whole result in memory). Each row's event is
//!    built by the builder streaming uses (`outbox` E4, through
//!    `crate::postgres::rows::RowReader`: the mapping's columns, keys, shard, subject
//!    template and header columns, exactly as the relay builds them) and only its digest
//!    kept, then compared with the stream's first copy. A row of an event type the mapping's
//!    filter excludes is neither expected nor reported missing; the report counts them on
//!    one line.
//! 4. Mismatches only: the row and the stored message (by sequence) are read again and
//!    compared field by field, so the report says which field differs.
//!
//! Which rows are the relay's: every row, except those the slot's creation left out by
//! design (with `--backfill pending`, the rows already `published` in the slot's snapshot),
//! which [`crate::postgres::boundary`] recorded then. Those are neither expected nor checked; the
//! report says how many and which ids, on one line. A slot without a record (created before
//! the boundary was recorded, with `--backfill none`, or by hand) has every row expected, as
//! before, and the report says once why rows may then be reported missing.
//!
//! # Invariants
//! - VER1 Read-only: verify creates nothing but an ephemeral consumer that acknowledges nothing
//!   and is deleted by the server when idle; it publishes, changes and locks nothing.
//! - VER2 Keys are never re-derived: the expected message is the one builder's (`outbox` E4);
//!   the stream's header values are decoded with `outbox::encoding::decode` when the message
//!   says `Outbox-Encoding: percent` before they are compared: the row's values, every
//!   header a column gave (any header not `Nats-*` or `Outbox-*`), and for uuid and text
//!   ids (`Outbox-Id-Kind`) `Outbox-Id` and `Outbox-Ordering-Key` too. The headers columns
//!   gave are compared as a set (a digest independent of their order).
//! - VER3 A dead-letter record (`{prefix}.dlq`) in an event's place is reported as
//!   dead-lettered, not missing, and is not a discrepancy (the operator chose
//!   `--on-poison dead-letter`).
//! - VER4 Memory is bounded by the id span of the range (a dense `Vec` of `Entry`, integer
//!   ids), or by the ids present when the ids are sparse or not integers (a map keyed by
//!   the id: for a uuid or text id its text plus about 80 bytes), plus one `Expected` per
//!   row (40 bytes, and a uuid or text id's text), never by payloads: payloads are compared
//!   through a digest.
//! - VER5 Exit status: 0 consistent (dead-lettered rows allowed), 5 discrepancies found,
//!   1 the table or the stream could not be read, 2 invalid arguments or configuration.
//! - VER6 Exactly the relay's rows are expected: a row is left out only when the slot's
//!   recorded boundary names its id (`boundary` BD1), never by a guess from its status or id;
//!   every other row in range is checked. The real problems come first in the report, each
//!   by outbox id, then what is informational (dead-lettered rows, the left-out rows'
//!   count and id range, one line), then the summary.
//! - VER7 Outbox tables are emptied by design (Debezium's remove-after-insert, a poller's
//!   clean-up, retention, TRUNCATE, dropped partitions): over the whole table, an event
//!   message of this database's relay (its `Outbox-Source` names this database and slot) whose
//!   row is gone is counted on one line, "rows deleted after relaying", never a discrepancy;
//!   one without a row that is not ours is `unexpected`.
//!
//! Inside: the range, the expected messages and their digests are here with [`run`];
//! `read.rs` reads the stream and the table, `judge.rs` compares them, `report.rs` tells
//! what was found.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull};
use async_nats::HeaderMap;
use futures::StreamExt as _;
use std::sync::Arc;

use outbox::{encoding, headers as h, EventId, IdKind, OutboxEvent, Position, Role};
use tokio_postgres::types::ToSql;

use crate::config::Config;
use crate::error::{RelayError, Result};
// A row read back as the relay reads it: the process's (`stored`), and replay's through here.
pub use crate::postgres::rows::{check_id_bound, RowReader};

mod judge;
mod read;
mod report;
use judge::*;
pub(crate) use read::scan_stream;
use read::*;
pub use report::*;

/// The exit status when verify found discrepancies (VER5).
pub const DISCREPANCIES_EXIT: u8 = 5;

/// How long the stream may stay silent before verify gives up reading it.
const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Messages per pull request.
const BATCH: usize = 20_000;

/// What to check: the rows whose id and creation time fall in these bounds (all inclusive
/// but `until`). Ids are compared as the id column's type: integers and uuids by value,
/// text ids by their bytes (`COLLATE "C"`, `stored` ROW2).
#[derive(Debug, Clone, Default)]
pub struct Range {
    /// Lowest id, as text (an integer, a uuid or any text, as the id column holds).
    pub from_id: Option<String>,
    /// Highest id, as text.
    pub to_id: Option<String>,
    /// `created_at >= since` (a timestamp Postgres reads, or a duration ago: `1h`).
    pub since: Option<String>,
    /// `created_at < until`.
    pub until: Option<String>,
    /// `entity_id = entity`.
    pub entity: Option<String>,
}

impl Range {
    /// The SQL condition on the mapped id, creation-time and entity columns with its
    /// parameters (all text, cast in the SQL), numbered from `$1`.
    pub fn condition(&self, config: &Config, reader: &RowReader) -> (String, Vec<Param>) {
        let column = |role| replication::quote_identifier(config.mapping.column(role));
        let id = reader.id_ordered();
        let cast = match reader.id_kind() {
            IdKind::Integer => "::text::int8",
            IdKind::Uuid => "::text::uuid",
            IdKind::Text => "::text COLLATE \"C\"",
        };
        let mut parts = vec![];
        let mut params = vec![];
        for (bound, op) in [(&self.from_id, ">="), (&self.to_id, "<=")] {
            if let Some(value) = bound {
                params.push(Param::Text(value.clone()));
                parts.push(format!("{id} {op} ${}{cast}", params.len()));
            }
        }
        let created_at = column(Role::CreatedAt);
        for (bound, op) in [(&self.since, ">="), (&self.until, "<")] {
            if let Some(time) = bound {
                params.push(Param::Time(time.clone()));
                parts.push(format!("{created_at} {op} ${}", params.len()));
            }
        }
        if let Some(entity) = &self.entity {
            params.push(Param::Text(entity.clone()));
            parts.push(format!(
                "{}::text = ${}",
                column(Role::EntityId),
                params.len()
            ));
        }
        if parts.is_empty() {
            ("true".to_owned(), params)
        } else {
            (parts.join(" AND "), params)
        }
    }

    /// Turns durations (`--since 1h`) into timestamps Postgres reads; checks the others, and
    /// the id bounds against the id column's kind, with Postgres. An invalid value is an
    /// argument error (exit 2).
    pub async fn resolve(&mut self, client: &tokio_postgres::Client, kind: IdKind) -> Result<()> {
        for (flag, bound) in [("--from-id", &self.from_id), ("--to-id", &self.to_id)] {
            if let Some(text) = bound {
                check_id_bound(client, kind, flag, text).await?;
            }
        }
        for (flag, bound) in [("--since", &mut self.since), ("--until", &mut self.until)] {
            let Some(text) = bound.as_mut() else { continue };
            if let Ok(ago) = crate::config::parse_duration(text) {
                let row = client
                    .query_one(
                        "SELECT (now() - $1::text::interval)::text",
                        &[&format!("{} seconds", ago.as_secs_f64())],
                    )
                    .await
                    .map_err(read_error("cannot read the time"))?;
                *text = row.get(0);
                continue;
            }
            if let Err(e) = client
                .query_one("SELECT $1::text::timestamptz", &[&*text])
                .await
            {
                return Err(RelayError::setup(anyhow::anyhow!(
                    "{flag} {text:?} is neither a timestamp nor a duration ({}): give e.g. \
                     2026-01-31T12:00:00Z or 6h",
                    crate::postgres::error::describe(&e)
                )));
            }
        }
        Ok(())
    }
}

/// A query parameter of [`Range::condition`].
#[derive(Debug, Clone)]
pub enum Param {
    /// A timestamp, as text Postgres casts.
    Time(String),
    /// A text value (an id bound, cast in the SQL).
    Text(String),
}

impl Param {
    pub(crate) fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Param::Time(v) | Param::Text(v) => v,
        }
    }
}

/// Rewrites `created_at {op} $n` into a cast of the text parameter.
fn cast_times(condition: &str, params: &[Param]) -> String {
    let mut out = condition.to_owned();
    for (i, param) in params.iter().enumerate().rev() {
        if let Param::Time(_) = param {
            let n = i + 1;
            out = out.replace(&format!("${n}"), &format!("${n}::text::timestamptz"));
        }
    }
    out
}

/// What verify keeps per outbox id (VER4).
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// Stream sequence of the first event message.
    seq: u64,
    /// [`digest`] of the first event message.
    digest: u64,
    /// Event messages.
    count: u32,
    /// Dead-letter records.
    dead_letters: u16,
    /// [`ROW`], [`IN_RANGE`], [`OURS`].
    flags: u8,
}

/// A row as verify expects its message: its digest, or why there is none.
#[derive(Debug, Clone)]
struct Expected {
    id: EventId,
    /// [`event_digest`] of the row's event.
    digest: u64,
    state: u8,
}

impl Expected {
    /// The row is outside the range (`--since`/`--until`/`--entity`): not checked.
    const OUT_OF_RANGE: u8 = 0;
    /// The row's event is `digest`.
    const PUBLISHABLE: u8 = 1;
    /// The relay cannot publish the row.
    const UNPUBLISHABLE: u8 = 2;
    /// Left out by design when the slot was created (VER6): not checked.
    const LEFT_OUT: u8 = 3;
    /// Of an event type the mapping's filter excludes: never published, not checked.
    const EXCLUDED: u8 = 4;
}

/// The position given to events built for comparison: positions are not compared.
const NO_POSITION: Position = Position {
    commit_lsn: outbox::Lsn::ZERO,
    index: 0,
};

/// The table has a row with this id.
const ROW: u8 = 1;
/// The row is in the range checked.
const IN_RANGE: u8 = 2;
/// The first event message carries this database's and slot's `Outbox-Source` (any cluster
/// or timeline): a relay streaming this table published it.
const OURS: u8 = 4;

/// The lowest and highest id of a range and its row count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    /// The lowest id (in the id column's order, `stored` ROW2).
    pub low: EventId,
    /// The highest id.
    pub high: EventId,
    /// Rows in the range.
    pub rows: u64,
}

impl Bounds {
    /// Whether `id` lies within the bounds (`EventId`'s order is the column's, `stored` ROW2).
    pub fn contains(&self, id: &EventId) -> bool {
        self.low <= *id && *id <= self.high
    }
}

/// Entries by id: dense over the id span of integer ids, or a map when the ids are sparse
/// or not integers (VER4).
enum Index {
    Dense { low: i64, entries: Vec<Entry> },
    Sparse(HashMap<EventId, Entry>),
}

impl Index {
    fn new(bounds: &Bounds) -> Index {
        let rows = bounds.rows;
        if let (EventId::Int(low), EventId::Int(high)) = (&bounds.low, &bounds.high) {
            let span = u64::try_from(high.saturating_sub(*low)).unwrap_or(0) + 1;
            if span <= rows.saturating_mul(4).max(1 << 20) {
                return Index::Dense {
                    low: *low,
                    entries: vec![Entry::default(); usize::try_from(span).unwrap_or(0)],
                };
            }
        }
        Index::Sparse(HashMap::with_capacity(usize::try_from(rows).unwrap_or(0)))
    }

    /// The entry of `id`, which lies within the bounds.
    fn get(&mut self, id: &EventId) -> &mut Entry {
        match (self, id) {
            (Index::Dense { low, entries }, EventId::Int(id)) => {
                &mut entries[usize::try_from(id - *low).expect("id within the bounds")]
            }
            (Index::Dense { .. }, EventId::Text(_)) => {
                unreachable!(
                    "a dense index holds integer bounds only, and a text id is not within them"
                )
            }
            (Index::Sparse(map), id) => map.entry(id.clone()).or_default(),
        }
    }

    fn peek(&self, id: &EventId) -> Entry {
        match (self, id) {
            (Index::Dense { low, entries }, EventId::Int(id)) => usize::try_from(id - *low)
                .ok()
                .and_then(|i| entries.get(i).copied())
                .unwrap_or_default(),
            (Index::Dense { .. }, EventId::Text(_)) => Entry::default(),
            (Index::Sparse(map), id) => map.get(id).copied().unwrap_or_default(),
        }
    }

    fn for_each(&self, mut f: impl FnMut(EventId, &Entry)) {
        match self {
            Index::Dense { low, entries } => {
                for (i, entry) in entries.iter().enumerate() {
                    f(EventId::Int(*low + i as i64), entry);
                }
            }
            Index::Sparse(map) => {
                let mut ids: Vec<&EventId> = map.keys().collect();
                ids.sort_unstable();
                for id in ids {
                    f(id.clone(), &map[id]);
                }
            }
        }
    }
}

/// The fields verify compares, as the consumer reads them (decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fields {
    subject: String,
    dedupe_key: String,
    entity_id: String,
    event_type: String,
    partition_key: String,
    ordering_key: String,
    shard: String,
    /// The headers columns gave (the mapping's header columns, the trace context), as one
    /// sorted line.
    headers: String,
}

impl Fields {
    fn of_event(event: &OutboxEvent) -> Fields {
        Fields {
            subject: event.subject.clone(),
            dedupe_key: event.keys.dedupe_key.clone(),
            entity_id: event.entity_id.clone(),
            event_type: event.event_type.clone(),
            partition_key: event.keys.partition_key.clone(),
            ordering_key: event.keys.ordering_key.clone(),
            shard: event.shard.to_string(),
            headers: headers_line(column_headers(event).into_iter()),
        }
    }

    /// The stream's values, percent-decoded when the message says so (VER2); `None` for a
    /// value that does not decode.
    fn of_message(subject: &str, headers: &HeaderMap) -> Fields {
        let seen = Seen::of(headers);
        let get = |name: &str| headers.get(name).map_or("", |v| v.as_str()).to_owned();
        let encoded = seen.encoded;
        let row = |name: &str| row_value(headers, name, encoded).into_owned();
        let extra: Vec<(&str, Cow<'_, str>)> = seen
            .extra
            .iter()
            .map(|(n, v)| (*n, seen.row_value(v)))
            .collect();
        Fields {
            subject: subject.to_owned(),
            dedupe_key: row(h::NATS_MSG_ID),
            entity_id: row(h::OUTBOX_ENTITY_ID),
            event_type: row(h::OUTBOX_EVENT_TYPE),
            partition_key: row(h::OUTBOX_PARTITION_KEY),
            ordering_key: seen.ordering_key().into_owned(),
            shard: get(h::OUTBOX_SHARD),
            headers: headers_line(extra.iter().map(|(n, v)| (*n, &**v))),
        }
    }

    fn named(&self) -> [(&'static str, &str); 8] {
        [
            ("subject", &self.subject),
            (h::NATS_MSG_ID, &self.dedupe_key),
            (h::OUTBOX_ENTITY_ID, &self.entity_id),
            (h::OUTBOX_EVENT_TYPE, &self.event_type),
            (h::OUTBOX_PARTITION_KEY, &self.partition_key),
            (h::OUTBOX_ORDERING_KEY, &self.ordering_key),
            (h::OUTBOX_SHARD, &self.shard),
            ("the headers from columns", &self.headers),
        ]
    }
}

/// The headers `event`'s columns gave: its headers without the CloudEvents attributes, which
/// are derived from the fields compared (their source is the configuration's).
fn column_headers(event: &OutboxEvent) -> Vec<(&str, &str)> {
    let mut headers: Vec<(&str, &str)> = event
        .headers
        .iter()
        .map(|(n, v)| (&**n, v.as_str()))
        .collect();
    outbox::cloudevents::without_attributes(&mut headers);
    headers
}

/// The headers columns gave, as one line in name order: `name: value; ...`.
fn headers_line<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut pairs: Vec<String> = headers.map(|(n, v)| format!("{n}: {v}")).collect();
    pairs.sort_unstable();
    pairs.join("; ")
}

/// A digest of the headers columns gave, whatever their order (a message's header map has
/// its own).
fn headers_digest<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>) -> u64 {
    headers.fold(0u64, |sum, (name, value)| {
        let mut hasher = DefaultHasher::new();
        name.hash(&mut hasher);
        value.hash(&mut hasher);
        sum.wrapping_add(hasher.finish())
    })
}

/// A digest of the compared fields (in [`Fields::named`]'s order, the headers from columns
/// as their [`headers_digest`]) and the payload.
fn digest(fields: [&str; 7], headers: u64, payload: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    for value in fields {
        value.hash(&mut hasher);
    }
    headers.hash(&mut hasher);
    payload.hash(&mut hasher);
    hasher.finish()
}

/// [`digest`] of an event, without copying its strings.
fn event_digest(event: &OutboxEvent) -> u64 {
    let shard = event.shard.to_string();
    digest(
        [
            &event.subject,
            &event.keys.dedupe_key,
            &event.entity_id,
            &event.event_type,
            &event.keys.partition_key,
            &event.keys.ordering_key,
            &shard,
        ],
        headers_digest(column_headers(event).into_iter()),
        &event.payload,
    )
}

/// A header value as the row had it: percent-decoded when the message is `encoded` (VER2).
fn row_value<'a>(headers: &'a HeaderMap, name: &str, encoded: bool) -> Cow<'a, str> {
    let v = headers.get(name).map_or("", |v| v.as_str());
    if encoded {
        Cow::Owned(encoding::decode(v).unwrap_or_else(|| format!("<undecodable {v:?}>")))
    } else {
        Cow::Borrowed(v)
    }
}

/// The headers verify reads from every stored message, found in one pass over its header
/// map: `HeaderMap::get` builds (for a custom name, allocates) and SipHashes a name per call,
/// which cost more than the rest of the comparison at a million messages. Matching on the
/// names' text is what `get` does (names are case-sensitive; standard ones canonical). The
/// first value of each name, like `get`.
#[derive(Debug, Default)]
struct Seen<'a> {
    outbox_id: Option<&'a str>,
    dedupe_key: &'a str,
    entity_id: &'a str,
    event_type: &'a str,
    partition_key: &'a str,
    ordering_key: &'a str,
    shard: &'a str,
    commit_lsn: &'a str,
    tx_index: &'a str,
    /// `Outbox-Source`: the WAL history the position belongs to.
    source: &'a str,
    /// `Outbox-Encoding: percent`: the row's values are percent-encoded (VER2).
    encoded: bool,
    /// `Outbox-Id-Kind`: a uuid or text id (its `Outbox-Id` and ordering key are encoded
    /// with the rest).
    id_kind: Option<&'a str>,
    /// Every header that is not the relay's (`Nats-*`, `Outbox-*`) nor a CloudEvents
    /// attribute: the columns gave them.
    extra: Vec<(&'a str, &'a str)>,
}

impl<'a> Seen<'a> {
    fn of(headers: &'a HeaderMap) -> Seen<'a> {
        let mut seen = Seen::default();
        for (name, values) in headers.iter() {
            let Some(value) = values.first().map(|v| v.as_str()) else {
                continue;
            };
            let name: &str = name.as_ref();
            match name {
                h::OUTBOX_ID => seen.outbox_id = Some(value),
                h::NATS_MSG_ID => seen.dedupe_key = value,
                h::OUTBOX_ENTITY_ID => seen.entity_id = value,
                h::OUTBOX_EVENT_TYPE => seen.event_type = value,
                h::OUTBOX_PARTITION_KEY => seen.partition_key = value,
                h::OUTBOX_ORDERING_KEY => seen.ordering_key = value,
                h::OUTBOX_SHARD => seen.shard = value,
                h::OUTBOX_COMMIT_LSN => seen.commit_lsn = value,
                h::OUTBOX_SOURCE => seen.source = value,
                h::OUTBOX_TX_INDEX => seen.tx_index = value,
                h::OUTBOX_ENCODING => seen.encoded = value == encoding::PERCENT,
                h::OUTBOX_ID_KIND => seen.id_kind = Some(value),
                _ if !h::is_relay_header(name) => seen.extra.push((name, value)),
                _ => {}
            }
        }
        outbox::cloudevents::without_attributes(&mut seen.extra);
        seen
    }

    /// The outbox id, as the row had it (`None`: no `Outbox-Id`, or one that is no id).
    fn id(&self) -> Option<EventId> {
        EventId::from_header(self.outbox_id?, self.id_kind, self.encoded)
    }

    /// The ordering key, decoded when the message is encoded and its id is not an integer.
    fn ordering_key(&self) -> Cow<'a, str> {
        if self.id_kind.is_some() {
            self.row_value(self.ordering_key)
        } else {
            Cow::Borrowed(self.ordering_key)
        }
    }

    /// The headers columns gave, decoded, as their [`headers_digest`].
    fn extra_digest(&self) -> u64 {
        if self.extra.is_empty() {
            return headers_digest(std::iter::empty());
        }
        let decoded: Vec<(&str, Cow<'_, str>)> = self
            .extra
            .iter()
            .map(|(n, v)| (*n, self.row_value(v)))
            .collect();
        headers_digest(decoded.iter().map(|(n, v)| (*n, &**v)))
    }

    /// A value as the row had it: percent-decoded when the message is encoded (VER2).
    fn row_value(&self, v: &'a str) -> Cow<'a, str> {
        if self.encoded {
            Cow::Owned(encoding::decode(v).unwrap_or_else(|| format!("<undecodable {v:?}>")))
        } else {
            Cow::Borrowed(v)
        }
    }
}

/// [`digest`] of a stored message and its entity id, without copying what needs no decoding.
#[cfg(test)]
fn message_digest(subject: &str, headers: &HeaderMap, payload: &[u8]) -> (u64, u64) {
    seen_digest(subject, &Seen::of(headers), payload)
}

/// [`message_digest`] of headers already read.
fn seen_digest(subject: &str, seen: &Seen<'_>, payload: &[u8]) -> (u64, u64) {
    let entity_id = seen.row_value(seen.entity_id);
    let digest = digest(
        [
            subject,
            &seen.row_value(seen.dedupe_key),
            &entity_id,
            &seen.row_value(seen.event_type),
            &seen.row_value(seen.partition_key),
            &seen.ordering_key(),
            seen.shard,
        ],
        seen.extra_digest(),
        payload,
    );
    (digest, entity_hash(&entity_id))
}

fn entity_hash(entity_id: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    entity_id.hash(&mut hasher);
    hasher.finish()
}

/// An id as the report shows it: an integer or a uuid as it is; a text id as it is when
/// it holds only letters, digits and `-_.:~`, else quoted with escapes, so that no row value
/// can forge a report line.
pub fn shown_id(id: &EventId) -> Cow<'_, str> {
    match id {
        EventId::Int(id) => Cow::Owned(id.to_string()),
        EventId::Text(text)
            if !text.is_empty()
                && text
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:~".contains(&b)) =>
        {
            Cow::Borrowed(text)
        }
        EventId::Text(text) => Cow::Owned(format!("{text:?}")),
    }
}

fn read_error(what: &str) -> impl Fn(tokio_postgres::Error) -> RelayError + '_ {
    move |e| {
        let text = crate::postgres::error::describe(&e);
        RelayError::permanent(anyhow::anyhow!("{what}: {text}"))
    }
}

fn nats_error(what: &str) -> impl Fn(Box<dyn std::fmt::Display>) -> RelayError + '_ {
    move |e| RelayError::permanent(anyhow::anyhow!("{what}: {e}"))
}

/// The connections and the rows of a range: what verify and replay start from.
pub(crate) struct Opened {
    /// The control connection.
    pub client: tokio_postgres::Client,
    /// A JetStream context.
    pub js: jetstream::Context,
    /// The stream.
    pub stream: jetstream::stream::Stream,
    /// The range's SQL condition on the table, and its parameters.
    pub condition: String,
    /// The parameters of `condition`.
    pub params: Vec<Param>,
    /// The lowest and highest id in range and how many rows, if any.
    pub bounds: Option<Bounds>,
    /// Reads the table's rows as the relay does (the mapping resolved, payload included).
    pub reader: Arc<RowReader>,
}

/// Connects to both sides, checks the table and reads the range's id bounds.
pub(crate) async fn open(config: &Config, range: &mut Range) -> Result<Opened> {
    let client = replication::connect_sql(&config.database)
        .await
        .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot connect to Postgres: {e}")))?;
    let columns = crate::postgres::checks::check_table(&client, config).await?;
    let reader = Arc::new(RowReader::with_payload(config, columns));
    range.resolve(&client, reader.id_kind()).await?;
    let (condition, params) = range.condition(config, &reader);
    let condition = cast_times(&condition, &params);
    let bounds = read_bounds(&client, config, &reader, &condition, &params).await?;
    let client_nats = crate::connect::nats::connect(&config.nats)
        .await
        .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot connect to NATS: {e}")))?;
    let js = jetstream::new(client_nats);
    let stream = js
        .get_stream(&config.stream)
        .await
        .map_err(|e| nats_error("cannot read the stream")(Box::new(e)))?;
    Ok(Opened {
        client,
        js,
        stream,
        condition,
        params,
        bounds,
        reader,
    })
}

/// VER7: the end of the `Outbox-Source` of every message a relay streaming this database's
/// slot writes (`/{database}/{slot}`, `outbox::source_id`), whatever the cluster or timeline.
async fn our_source_suffix(client: &tokio_postgres::Client, config: &Config) -> Result<String> {
    let row = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map_err(read_error("cannot read the database's name"))?;
    let database: String = row.get(0);
    let source = outbox::source::source_id("", 0, &database, &config.slot);
    Ok(source.trim_start_matches("/0").to_owned())
}

/// The lowest and highest id of the rows `condition` selects, and their count: one query;
/// the ids as text, in the id column's order (`stored` ROW2).
async fn read_bounds(
    client: &tokio_postgres::Client,
    config: &Config,
    reader: &RowReader,
    condition: &str,
    params: &[Param],
) -> Result<Option<Bounds>> {
    let table = &config.table;
    let (id, ordered) = (reader.id_column(), reader.order_by());
    let end = |direction: &str| {
        format!(
            "(SELECT {id}::text AS bound FROM {table} WHERE {condition} ORDER BY {ordered} {direction} LIMIT 1)"
        )
    };
    let sql = format!(
        "SELECT {}, {}, (SELECT count(*)::int8 FROM {table} WHERE {condition})",
        end("ASC"),
        end("DESC")
    );
    let row = client
        .query_one(&sql, &params.iter().map(Param::sql).collect::<Vec<_>>())
        .await
        .map_err(read_error("cannot read the outbox table's id range"))?;
    let id = |i: usize| {
        row.get::<_, Option<String>>(i)
            .and_then(|text| EventId::parse(reader.id_kind(), &text))
    };
    Ok(match (id(0), id(1)) {
        (Some(low), Some(high)) => Some(Bounds {
            low,
            high,
            rows: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
        }),
        _ => None,
    })
}

/// How many messages of ours (relayed events of this database and slot, `ours`: the end of
/// their `Outbox-Source`) the stream holds outside its dead-letter subjects (VER7).
async fn count_ours(opened: &Opened, config: &Config, ours: &str) -> Result<u64> {
    let mut count = 0;
    scan_stream(&opened.stream, &config.subject_prefix, |_, message| {
        let of_ours = message.headers.as_ref().is_some_and(|headers| {
            let seen = Seen::of(headers);
            seen.id().is_some() && seen.source.ends_with(ours)
        });
        if of_ours && !message.subject.as_str().ends_with(".dlq") {
            count += 1;
        }
    })
    .await?;
    Ok(count)
}

/// Reconciles the rows in `range` with the stream (see the module docs).
pub async fn run(config: &Config, mut range: Range) -> Result<Report> {
    let started = Instant::now();
    let opened = open(config, &mut range).await?;
    let ours = our_source_suffix(&opened.client, config).await?;
    let whole_table = range.since.is_none() && range.until.is_none();
    // VER7: messages outside the table's id bounds count as deleted only when the range is the
    // whole table.
    let unrestricted =
        whole_table && range.from_id.is_none() && range.to_id.is_none() && range.entity.is_none();
    let Some(bounds) = opened.bounds.clone() else {
        // VER7: an emptied table; what the stream holds of ours was deleted after relaying.
        let deleted = if unrestricted {
            count_ours(&opened, config, &ours).await?
        } else {
            0
        };
        return Ok(Report {
            deleted_outside: deleted,
            elapsed: started.elapsed(),
            ..Report::default()
        });
    };
    // VER6: what the slot's creation left out.
    let boundary = crate::postgres::boundary::read(&opened.client, config).await;
    let runs = match &boundary {
        crate::postgres::boundary::Read::Recorded(boundary) => boundary.clone(),
        crate::postgres::boundary::Read::Absent(_) => Default::default(),
    };
    let mut report = Report {
        ids: Some((bounds.low.clone(), bounds.high.clone())),
        boundary: Some(boundary),
        slot: config.slot.clone(),
        ..Report::default()
    };
    // 2. and 3., side by side.
    let stream_side = spawn_stream_side(config, bounds.clone(), ours, started)?;
    let table_side = spawn_table_side(&opened, config, &bounds, runs, started).await?;
    let (read, table_read) = tokio::join!(stream_side, table_side);
    let side = read?;
    let mut index = side.index;
    report.messages = side.read;
    if unrestricted {
        report.deleted_outside = side.ours_outside;
    }
    let (mut problems, mismatched) = judge_rows(table_read?, &mut index, &mut report);
    judge_stream(
        &index,
        side.duplicates,
        side.out_of_order,
        whole_table,
        &mut report,
        &mut problems,
    );
    problems.extend(explain_mismatches(&opened, config, mismatched).await?);
    problems.sort_by(|a, b| rank(a.kind).cmp(&rank(b.kind)).then(a.id.cmp(&b.id)));
    report.problems = problems;
    report.elapsed = started.elapsed();
    Ok(report)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::num::NonZeroU64;

    use bytes::Bytes;
    use outbox::OutboxRow;

    use super::*;

    #[test]
    fn the_range_is_one_sql_condition_with_numbered_parameters() {
        let config = crate::config::tests::load_url("postgres://u@h/db").unwrap();
        let seed = crate::postgres::rows::test_reader(&config, outbox::event::oid::INT8);
        assert_eq!(Range::default().condition(&config, &seed).0, "true");
        let range = Range {
            from_id: Some("5".into()),
            to_id: Some("9".into()),
            since: Some("2026-01-01T00:00:00Z".into()),
            until: None,
            entity: Some("order:A-1".into()),
        };
        let (condition, params) = range.condition(&config, &seed);
        assert_eq!(
            condition,
            "\"id\" >= $1::text::int8 AND \"id\" <= $2::text::int8 AND \"created_at\" >= $3 AND \"entity_id\"::text = $4"
        );
        assert_eq!(params.len(), 4);
        assert_eq!(
            cast_times(&condition, &params),
            "\"id\" >= $1::text::int8 AND \"id\" <= $2::text::int8 AND \"created_at\" >= $3::text::timestamptz AND \"entity_id\"::text = $4"
        );
        // Text ids compare by their bytes, uuids by value (stored ROW2).
        let text = crate::postgres::rows::test_reader(&config, outbox::event::oid::TEXT);
        assert_eq!(
            range.condition(&config, &text).0,
            "\"id\" COLLATE \"C\" >= $1::text COLLATE \"C\" AND \"id\" COLLATE \"C\" <= $2::text COLLATE \"C\" AND \"created_at\" >= $3 AND \"entity_id\"::text = $4"
        );
        let uuid = crate::postgres::rows::test_reader(&config, outbox::event::oid::UUID);
        assert!(range
            .condition(&config, &uuid)
            .0
            .starts_with("\"id\" >= $1::text::uuid AND"));
    }

    #[test]
    fn a_text_id_is_shown_quoted_unless_plain() {
        assert_eq!(shown_id(&EventId::Int(-3)), "-3");
        assert_eq!(shown_id(&EventId::Text("evt_01:a-b".into())), "evt_01:a-b");
        assert_eq!(
            shown_id(&EventId::Text("a\nverify: OK".into())),
            "\"a\\nverify: OK\""
        );
    }

    #[test]
    fn headers_from_columns_digest_alike_in_any_order() {
        let a = headers_digest([("X-A", "1"), ("X-B", "2")].into_iter());
        let b = headers_digest([("X-B", "2"), ("X-A", "1")].into_iter());
        assert_eq!(a, b);
        assert_ne!(a, headers_digest([("X-A", "2"), ("X-B", "1")].into_iter()));
        assert_eq!(
            headers_line([("X-B", "2"), ("X-A", "1")].into_iter()),
            "X-A: 1; X-B: 2"
        );
    }

    fn event(entity_id: &str, event_type: &str) -> OutboxEvent {
        OutboxRow::seed(
            7,
            entity_id,
            event_type,
            Bytes::from_static(b"{\"a\": 1}"),
            1_700_000_000_000,
        )
        .into_event("outbox", NonZeroU64::new(12).unwrap(), NO_POSITION)
    }

    /// The compared headers of the message the relay stores for an event (M1: the row's
    /// values percent-encoded for a hostile row). `sink::publish_message`'s own headers are
    /// not readable outside async-nats; tests/verify.rs checks verify against the real relay's
    /// messages, hostile rows included.
    fn stored(event: &OutboxEvent) -> (String, HeaderMap, Bytes) {
        let hostile = encoding::row_is_hostile(&event.entity_id, &event.event_type);
        let value = |v: &str| {
            if hostile {
                encoding::encode(v)
            } else {
                v.to_owned()
            }
        };
        let mut headers = HeaderMap::new();
        headers.insert(h::NATS_MSG_ID, value(&event.keys.dedupe_key).as_str());
        headers.insert(h::OUTBOX_ENTITY_ID, value(&event.entity_id).as_str());
        headers.insert(h::OUTBOX_EVENT_TYPE, value(&event.event_type).as_str());
        headers.insert(
            h::OUTBOX_PARTITION_KEY,
            value(&event.keys.partition_key).as_str(),
        );
        headers.insert(h::OUTBOX_ORDERING_KEY, event.keys.ordering_key.as_str());
        headers.insert(h::OUTBOX_SHARD, event.shard.to_string().as_str());
        if hostile {
            headers.insert(h::OUTBOX_ENCODING, encoding::PERCENT);
        }
        (event.subject.clone(), headers, event.payload.clone())
    }

    #[test]
    fn a_stored_message_and_its_row_have_the_same_digest_hostile_or_not() {
        for event in [
            event("order:A-1", "OrderPaid"),
            event("a\r\nNats-Msg-Id: x", "Paid %"),
        ] {
            let (subject, headers, payload) = stored(&event);
            assert_eq!(
                message_digest(&subject, &headers, &payload).0,
                event_digest(&event)
            );
            assert_eq!(
                describe_mismatch(&event, &subject, &headers, &payload, 3),
                "at sequence 3: differs from the row"
            );
        }
    }

    #[test]
    fn a_mismatch_names_the_field_and_never_prints_the_payload() {
        let event = event("order:A-1", "OrderPaid");
        let (subject, mut headers, _) = stored(&event);
        headers.insert(h::OUTBOX_SHARD, "99");
        let (digest, _) = message_digest(&subject, &headers, b"{\"secret\": 2}");
        assert_ne!(digest, event_digest(&event));
        let text = describe_mismatch(&event, &subject, &headers, b"{\"secret\": 2}", 4);
        assert!(
            text.contains(&format!(
                "Outbox-Shard is \"99\", the row gives \"{}\"",
                event.shard
            )),
            "{text}"
        );
        assert!(
            text.contains("the payload differs (13 bytes stored, 8 in the row)"),
            "{text}"
        );
        assert!(!text.contains("secret"), "{text}");
    }

    #[test]
    fn dead_letters_alone_exit_0_and_anything_else_exits_5() {
        let mut report = Report {
            rows: 2,
            ids: Some((EventId::Int(1), EventId::Int(2))),
            ..Report::default()
        };
        report.problems.push(Problem {
            kind: "dead-lettered",
            id: EventId::Int(1),
            detail: "a dead-letter record at sequence 1 in its place".into(),
        });
        assert_eq!(report.exit_code(), 0);
        assert!(report.render(10).contains("verify: OK: 2 rows (ids 1..=2)"));
        report.problems.push(Problem {
            kind: "missing",
            id: EventId::Int(2),
            detail: "no message on the stream".into(),
        });
        assert_eq!(report.exit_code(), DISCREPANCIES_EXIT);
        let text = report.render(0);
        assert!(text.contains("missing: ... and 1 more"), "{text}");
        assert!(
            text.contains("DISCREPANCIES (exit 5)") && text.contains("1 missing"),
            "{text}"
        );
    }
}
