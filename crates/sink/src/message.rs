//! What goes on the wire for an event: its headers (the frozen names of
//! [`outbox::headers`]), payload and subject, the dead-letter record that may take its place,
//! and the sizes the server checks, computed before publishing.
//!
//! # Invariants
//! - M1 No row value can hide one of the relay's `Nats-*` headers: a header-hostile row's
//!   values are percent-encoded and the message says `Outbox-Encoding: percent`
//!   ([`outbox::encoding`]); every other row's values are written verbatim. This holds for
//!   dead-letter records too.
//! - M2 The size the sink checks is the size of the header block it sends plus the payload,
//!   which equals [`wire_size`] of the same headers as a map (plus the fence's; a proptest
//!   locks it, hostile rows included); [`control_line_len`] is at least the `HPUB` line
//!   the sink writes for it.
//! - M3 A dead-letter record is cut to what fits (`fit_dead_letter`): its long text
//!   fields are truncated, then dropped, and the record says `"truncated": true`; if even
//!   the smallest record does not fit, the caller gets an error, never a record the server
//!   would refuse. Its `Nats-Msg-Id` depends on the event alone (not on the cut), so every
//!   replay de-duplicates.
//! - M4 The sink writes each header block itself: `NATS/1.0`, the relay's `Nats-*` headers
//!   (the fence's, then `Nats-Msg-Id`), then the `Outbox-*` ones, one line each. The
//!   server finds the relay's own `Nats-*` headers before any other line, whatever a
//!   header value holds (with M1, a belt and braces).

use std::fmt::Write as _;

use async_nats::{HeaderMap, Subject};
use bytes::{Bytes, BytesMut};
use outbox::{encoding, EventId, OutboxEvent};
use sha2::{Digest, Sha256};

use crate::wire;

/// nats-server's default `max_control_line`. The server does not announce its configured
/// value (its INFO has no such field), so the relay budgets the default.
pub const DEFAULT_MAX_CONTROL_LINE: usize = 4096;

/// The longest reply subject the sink puts on a publish, for the control-line budget. The
/// sink's is `_INBOX.{token}.{n}` (the default inbox prefix, a 22-character NUID per
/// session, the publish's number in the session: at most 20 digits), 50 bytes at most;
/// the budget keeps the 52 bytes of async-nats's JetStream reply subjects
/// (`_INBOX.{id}.{token}`), which the sink used before, so what counts as poison did not
/// change. `tests/jetstream.rs` checks the sink's on the real server. A session whose
/// reply subjects are longer (a custom inbox prefix) budgets the difference (P7).
pub const REPLY_SUBJECT_LEN: usize = "_INBOX.".len() + 22 + 1 + 22;

/// A dead-letter record's `Nats-Msg-Id` longer than this uses a digest of the dedupe key.
const DEAD_LETTER_ID_MAX: usize = 256;

/// Text fields of a truncated dead-letter record keep at most this many bytes.
const TRUNCATED_FIELD_MAX: usize = 64;

/// Header names, built once (`HeaderName::from_static` is free; parsing a `&str` name per
/// message showed in the profile).
pub(crate) mod name {
    use async_nats::HeaderName;
    use outbox::headers as h;

    pub const NATS_MSG_ID: HeaderName = HeaderName::from_static(h::NATS_MSG_ID);
    pub const OUTBOX_ID: HeaderName = HeaderName::from_static(h::OUTBOX_ID);
    pub const OUTBOX_COMMIT_LSN: HeaderName = HeaderName::from_static(h::OUTBOX_COMMIT_LSN);
    pub const OUTBOX_TX_INDEX: HeaderName = HeaderName::from_static(h::OUTBOX_TX_INDEX);
    pub const OUTBOX_SOURCE: HeaderName = HeaderName::from_static(h::OUTBOX_SOURCE);
    pub const OUTBOX_ENCODING: HeaderName = HeaderName::from_static(h::OUTBOX_ENCODING);
    pub const OUTBOX_DEAD_LETTER_REASON: HeaderName =
        HeaderName::from_static(h::OUTBOX_DEAD_LETTER_REASON);
    pub const EXPECTED_LAST_SEQUENCE_STR: &str = "Nats-Expected-Last-Sequence";
    pub const EXPECTED_LAST_MSG_ID_STR: &str = "Nats-Expected-Last-Msg-Id";
    pub const BATCH_ID_STR: &str = h::NATS_BATCH_ID;
    pub const BATCH_SEQUENCE_STR: &str = h::NATS_BATCH_SEQUENCE;
    pub const BATCH_COMMIT_STR: &str = h::NATS_BATCH_COMMIT;
}

/// Strict mode's fence for the next publish (P5): the sequence the stream's last message
/// must have, and, from a session's second publish on, the `Nats-Msg-Id` it must have: the
/// previous publish's. The sequence alone does not hold when another writer slips k
/// messages in: the session's first k publishes are refused, but the later ones line up
/// with the shifted sequence again and would be stored behind a gap. Chained by message id,
/// every publish after a refused one is refused too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fence {
    /// `Nats-Expected-Last-Sequence`.
    pub sequence: u64,
    /// `Nats-Expected-Last-Msg-Id`: the previous publish's `Nats-Msg-Id`, if this session
    /// published before and the fence is chained.
    pub last_msg_id: Option<String>,
    /// Whether the fence chains publishes by message id (`SinkOptions::id_chain`).
    pub chained: bool,
    /// The atomic batch the next publish belongs to (`crate::batch` B1–B6), if any: then the
    /// block carries the batch's headers instead of the chain, and the expected sequence
    /// only on the batch's first message (all nats-server accepts in a batch).
    pub batch: Option<crate::batch::Batch>,
    /// The next publish is its transaction's last event, published by an atomic
    /// transaction's batches (`crate::batch` B7): the block ends with `Outbox-Tx-End: 1`.
    pub tx_end: bool,
    /// The next publish's sequence in its fast-ingest batch (`crate::batch` F2), if it is in
    /// one: the id chain only on the batch's first message, the expected sequence on all.
    pub fast: Option<u64>,
}

impl Fence {
    /// Starts a session's fence at the stream's last sequence.
    pub fn at(sequence: u64) -> Fence {
        Fence {
            sequence,
            last_msg_id: None,
            chained: true,
            batch: None,
            tx_end: false,
            fast: None,
        }
    }

    /// The fence, chained by message id or not (`SinkOptions::id_chain`).
    pub fn chained(self, chained: bool) -> Fence {
        Fence { chained, ..self }
    }

    /// Writes the fence's header lines (`Nats-Expected-Last-Sequence`, and
    /// `Nats-Expected-Last-Msg-Id` from the session's second publish on) into a header block.
    pub(crate) fn write(&self, block: &mut BytesMut) {
        if let Some(batch) = &self.batch {
            self.write_batch(batch, block);
            return;
        }
        wire::header_line(
            block,
            name::EXPECTED_LAST_SEQUENCE_STR,
            itoa::Buffer::new().format(self.sequence).as_bytes(),
        );
        if let Some(last) = self.chain() {
            wire::header_line(block, name::EXPECTED_LAST_MSG_ID_STR, last.as_bytes());
        }
    }

    /// The id chain the next publish carries, if any (F2: in a fast batch, its first
    /// message only).
    fn chain(&self) -> Option<&String> {
        self.last_msg_id
            .as_ref()
            .filter(|_| self.fast.is_none_or(|sequence| sequence == 1))
    }

    /// [`Fence::write`] for a message of an atomic batch (B2): the batch's id and sequence,
    /// the commit on its last message, the expected sequence on its first only.
    fn write_batch(&self, batch: &crate::batch::Batch, block: &mut BytesMut) {
        let mut number = itoa::Buffer::new();
        wire::header_line(block, name::BATCH_ID_STR, batch.id.as_bytes());
        wire::header_line(
            block,
            name::BATCH_SEQUENCE_STR,
            number.format(batch.sequence).as_bytes(),
        );
        if batch.commit {
            wire::header_line(block, name::BATCH_COMMIT_STR, b"1");
        }
        if batch.sequence == 1 {
            wire::header_line(
                block,
                name::EXPECTED_LAST_SEQUENCE_STR,
                number.format(self.sequence).as_bytes(),
            );
        }
    }

    /// Moves the fence past a publish whose `Nats-Msg-Id` is `msg_id`.
    pub(crate) fn advance(&mut self, msg_id: &[u8]) {
        self.sequence += 1;
        if !self.chained {
            return;
        }
        let last = self.last_msg_id.get_or_insert_with(String::new);
        last.clear();
        last.push_str(&String::from_utf8_lossy(msg_id));
    }
}

pub(crate) fn int(value: impl itoa::Integer) -> String {
    itoa::Buffer::new().format(value).to_owned()
}

fn digits(value: impl itoa::Integer) -> usize {
    itoa::Buffer::new().format(value).len()
}

/// One serialised header line, `Name: value\r\n`.
fn line(name: &str, value_len: usize) -> usize {
    name.len() + 2 + value_len + 2
}

/// The serialised length of the strict-mode fence headers for `fence`, if any.
pub(crate) fn fence_len(fence: Option<&Fence>) -> usize {
    let tx_end = fence
        .filter(|f| f.tx_end)
        .map_or(0, |_| line(outbox::headers::OUTBOX_TX_END, 1));
    if let Some(fence) = fence.filter(|f| f.batch.is_some()) {
        // Only dead-letter records get here: writing the lines is exact and cheap enough.
        let mut block = BytesMut::new();
        fence.write(&mut block);
        return block.len() + tx_end;
    }
    tx_end
        + fence.map_or(0, |f| {
            line(name::EXPECTED_LAST_SEQUENCE_STR, digits(f.sequence))
                + f.chain()
                    .map_or(0, |id| line(name::EXPECTED_LAST_MSG_ID_STR, id.len()))
        })
}

/// A row value as its header carries it (M1).
fn value(text: String, hostile: bool) -> String {
    if hostile {
        encoding::encode(&text)
    } else {
        text
    }
}

/// The bytes JetStream counts against `max_payload` and `max_msg_size`: the serialised
/// headers (`NATS/1.0\r\n`, `Name: value\r\n` each, `\r\n`) plus the payload.
pub fn wire_size(headers: &HeaderMap, payload_len: usize) -> usize {
    let mut len = b"NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        for value in values {
            len += line(
                <async_nats::HeaderName as AsRef<str>>::as_ref(name),
                value.as_str().len(),
            );
        }
    }
    len + payload_len
}

/// The length of the `HPUB {subject} {reply} {header bytes} {total bytes}\r\n` line
/// the sink writes for a publish ([`crate::wire::hpub_line`]), which nats-server checks against its
/// `max_control_line`. Conservative by the 7 bytes of `HPUB ` and `\r\n`, which the
/// server does not count.
pub fn control_line_len(subject_len: usize, headers_len: usize, total_len: usize) -> usize {
    "HPUB ".len()
        + subject_len
        + 1
        + REPLY_SUBJECT_LEN
        + 1
        + digits(headers_len)
        + 1
        + digits(total_len)
        + 2
}

/// The JetStream message for an event: its subject's payload and the frozen headers.
pub fn publish_message(event: &OutboxEvent) -> async_nats::jetstream::message::PublishMessage {
    let commit_lsn = event.position.commit_lsn.to_string();
    let hostile = event.is_hostile();
    let (_, map, payload) = into_message(event.clone(), hostile, &commit_lsn, None);
    async_nats::jetstream::message::PublishMessage::build()
        .headers(map)
        .payload(payload)
}

/// Calls `put` with each of `event`'s headers in the order they go on the wire, its
/// `Nats-Msg-Id` first (M1, M4). `hostile` is [`OutboxEvent::is_hostile`].
fn event_headers(
    event: &OutboxEvent,
    hostile: bool,
    commit_lsn: &str,
    source: Option<&str>,
    mut put: impl FnMut(&str, &str),
) {
    use outbox::headers as h;
    fn cow(text: &str, hostile: bool) -> std::borrow::Cow<'_, str> {
        if hostile {
            encoding::encode(text).into()
        } else {
            text.into()
        }
    }
    let row = |text| cow(text, hostile);
    let k = &event.keys;
    put(h::NATS_MSG_ID, &row(&k.dedupe_key));
    match &event.id {
        EventId::Int(id) => {
            put(h::OUTBOX_ID, itoa::Buffer::new().format(*id));
            put(h::OUTBOX_ENTITY_ID, &row(&event.entity_id));
            put(h::OUTBOX_EVENT_TYPE, &row(&event.event_type));
            put(h::OUTBOX_PARTITION_KEY, &row(&k.partition_key));
            put(h::OUTBOX_ORDERING_KEY, &k.ordering_key);
        }
        EventId::Text(id) => {
            put(h::OUTBOX_ID, &row(id));
            put(h::OUTBOX_ENTITY_ID, &row(&event.entity_id));
            put(h::OUTBOX_EVENT_TYPE, &row(&event.event_type));
            put(h::OUTBOX_PARTITION_KEY, &row(&k.partition_key));
            put(h::OUTBOX_ORDERING_KEY, &row(&k.ordering_key));
        }
    }
    put(h::OUTBOX_SHARD, itoa::Buffer::new().format(event.shard));
    put(h::OUTBOX_COMMIT_LSN, commit_lsn);
    put(
        h::OUTBOX_TX_INDEX,
        itoa::Buffer::new().format(event.position.index),
    );
    if let Some(kind) = id_kind(&event.id) {
        put(h::OUTBOX_ID_KIND, kind);
    }
    if hostile {
        put(h::OUTBOX_ENCODING, encoding::PERCENT);
    }
    if let Some(source) = source {
        put(h::OUTBOX_SOURCE, source);
    }
    for (name, value) in &event.headers {
        put(name, &row(value));
    }
}

/// `Outbox-Id-Kind` for a uuid or text id: `uuid` when it has a uuid's shape (a text column
/// holding uuids says `uuid` too; either way the id is its text).
fn id_kind(id: &EventId) -> Option<&'static str> {
    let text = id.as_text()?;
    Some(
        if outbox::EventId::parse(outbox::IdKind::Uuid, text).is_some() {
            "uuid"
        } else {
            "text"
        },
    )
}

/// The subject, headers and payload for `event`, for publishing through async-nats
/// (`publish_message`: replay, tests). `hostile` is [`OutboxEvent::is_hostile`] of the
/// event (M1).
pub(crate) fn into_message(
    event: OutboxEvent,
    hostile: bool,
    commit_lsn: &str,
    source: Option<&str>,
) -> (Subject, HeaderMap, Bytes) {
    let mut map = HeaderMap::new();
    event_headers(&event, hostile, commit_lsn, source, |name, value| {
        map.insert(name, value);
    });
    (Subject::from(event.subject), map, event.payload)
}

/// Writes `event`'s header block (`NATS/1.0`, the fence's lines, then [`event_headers`],
/// then the blank line) into `block`, which the sink publishes as is (M4). Returns where
/// the `Nats-Msg-Id` value lies in `block`, for the fence's chain.
pub(crate) fn write_event_block(
    block: &mut BytesMut,
    event: &OutboxEvent,
    hostile: bool,
    commit_lsn: &str,
    source: Option<&str>,
    fence: Option<&Fence>,
) -> std::ops::Range<usize> {
    write_block(block, fence, |lines| {
        event_headers(event, hostile, commit_lsn, source, |name, value| {
            lines.put(name, value);
        });
    })
}

/// The header block the relay publishes for `event` (without a fence or a source): for
/// writing the relay's message byte for byte elsewhere, as a test does on a raw connection.
pub fn event_block(event: &OutboxEvent) -> BytesMut {
    let mut block = BytesMut::new();
    let commit_lsn = event.position.commit_lsn.to_string();
    write_event_block(
        &mut block,
        event,
        event.is_hostile(),
        &commit_lsn,
        None,
        None,
    );
    block
}

/// Writes a header block for `map` (a dead-letter record): `NATS/1.0`, the fence's lines,
/// the map's `Nats-*` headers, then the others, then the blank line (M4). Returns where the
/// `Nats-Msg-Id` value lies in `block`.
pub(crate) fn write_map_block(
    block: &mut BytesMut,
    map: &HeaderMap,
    fence: Option<&Fence>,
) -> std::ops::Range<usize> {
    write_block(block, fence, |lines| {
        for nats_first in [true, false] {
            for (name, values) in map.iter() {
                let name: &str = name.as_ref();
                if name
                    .get(..5)
                    .is_some_and(|p| p.eq_ignore_ascii_case("nats-"))
                    == nats_first
                {
                    for value in values {
                        lines.put(name, value.as_str());
                    }
                }
            }
        }
    })
}

/// A header block being written: its lines, and where its `Nats-Msg-Id` value lies.
struct Lines<'a> {
    block: &'a mut BytesMut,
    msg_id: std::ops::Range<usize>,
}

impl Lines<'_> {
    fn put(&mut self, name: &str, value: &str) {
        if name == outbox::headers::NATS_MSG_ID {
            let at = self.block.len() + name.len() + 2;
            self.msg_id = at..at + value.len();
        }
        wire::header_line(self.block, name, value.as_bytes());
    }
}

/// `NATS/1.0`, the fence's lines, what `lines` puts, the fence's `Outbox-Tx-End` (B7), the
/// blank line (M4).
fn write_block(
    block: &mut BytesMut,
    fence: Option<&Fence>,
    lines: impl FnOnce(&mut Lines<'_>),
) -> std::ops::Range<usize> {
    block.extend_from_slice(wire::HEADER_START);
    if let Some(fence) = fence {
        fence.write(block);
    }
    let mut writing = Lines {
        block,
        msg_id: 0..0,
    };
    lines(&mut writing);
    let msg_id = writing.msg_id;
    if fence.is_some_and(|f| f.tx_end) {
        wire::header_line(block, outbox::headers::OUTBOX_TX_END, b"1");
    }
    block.extend_from_slice(wire::HEADER_END);
    msg_id
}

/// How much of a dead-letter record is kept (M3), fullest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Every field.
    Full,
    /// The event's text fields (entity id, event type, keys, subject) cut to
    /// [`TRUNCATED_FIELD_MAX`] bytes.
    Truncated,
    /// The event's text fields and the body's copy of the reason dropped.
    Minimal,
}

impl Cut {
    pub(crate) const ALL: [Cut; 3] = [Cut::Full, Cut::Truncated, Cut::Minimal];
}

/// The dead-letter record's `Nats-Msg-Id`: `dead-letter:{dedupe_key}` (the key encoded when
/// the row is hostile), or `dead-letter:sha256:{hex}` of the key when that would be longer
/// than [`DEAD_LETTER_ID_MAX`] bytes. A function of the event alone (M3).
/// The `Nats-Msg-Id` the relay writes for `event` (M1: percent-encoded for a header-hostile
/// row).
pub fn msg_id(event: &OutboxEvent) -> String {
    value(event.keys.dedupe_key.clone(), event.is_hostile())
}

/// The `Nats-Msg-Id` of `event`'s dead-letter record.
pub fn dead_letter_msg_id(event: &OutboxEvent) -> String {
    dead_letter_id(event, event.is_hostile())
}

fn dead_letter_id(event: &OutboxEvent, hostile: bool) -> String {
    let key = &event.keys.dedupe_key;
    let id = format!("dead-letter:{}", value(key.clone(), hostile));
    if id.len() <= DEAD_LETTER_ID_MAX {
        return id;
    }
    let mut digest = String::from("dead-letter:sha256:");
    for byte in Sha256::digest(key.as_bytes()) {
        let _ = write!(digest, "{byte:02x}");
    }
    digest
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The dead-letter record published in place of `event` (P7): headers and a JSON body with
/// the event's identity, keys and position and the reason; not the payload. `reason` is the
/// relay's own text: it never contains a header name, nor a line break.
pub(crate) fn dead_letter_record(
    event: &OutboxEvent,
    hostile: bool,
    reason: &str,
    cut: Cut,
) -> (HeaderMap, Bytes) {
    debug_assert!(!encoding::is_hostile(reason), "{reason:?}");
    let mut map = HeaderMap::new();
    map.insert(name::NATS_MSG_ID, dead_letter_id(event, hostile));
    map.insert(name::OUTBOX_ID, event.id.to_string());
    map.insert(
        name::OUTBOX_COMMIT_LSN,
        event.position.commit_lsn.to_string(),
    );
    map.insert(name::OUTBOX_TX_INDEX, int(event.position.index));
    map.insert(
        name::OUTBOX_DEAD_LETTER_REASON,
        reason.replace(['\r', '\n'], " "),
    );
    if hostile {
        map.insert(name::OUTBOX_ENCODING, encoding::PERCENT);
    }
    let mut record = serde_json::json!({
        "outbox_id": match &event.id {
            EventId::Int(id) => serde_json::json!(id),
            EventId::Text(id) => serde_json::json!(id),
        },
        "ordering_key": event.keys.ordering_key,
        "shard": event.shard,
        "commit_lsn": event.position.commit_lsn.to_string(),
        "tx_index": event.position.index,
        "payload_bytes": event.payload.len(),
        "truncated": cut != Cut::Full,
    });
    let texts = [
        ("entity_id", &event.entity_id),
        ("event_type", &event.event_type),
        ("dedupe_key", &event.keys.dedupe_key),
        ("partition_key", &event.keys.partition_key),
        ("subject", &event.subject),
    ];
    for (field, text) in texts {
        let kept = match cut {
            Cut::Full => text.as_str(),
            Cut::Truncated => prefix(text, TRUNCATED_FIELD_MAX),
            Cut::Minimal => continue,
        };
        record[field] = kept.into();
    }
    if cut != Cut::Minimal {
        record["reason"] = reason.into();
    }
    (map, record.to_string().into())
}

/// What the server accepts: the message (headers and payload) and the `HPUB` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `min(max_payload, max_msg_size)`, in bytes of headers plus payload.
    pub max_message_bytes: usize,
    /// The server's `max_control_line` ([`DEFAULT_MAX_CONTROL_LINE`]).
    pub max_control_line: usize,
}

/// What exceeds a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excess {
    /// The message is larger than `max_message_bytes`.
    Size,
    /// The `HPUB` line is longer than `max_control_line`.
    ControlLine,
}

impl Limits {
    /// Checks a message of `size` bytes (headers, fence and payload; `payload_len` of them
    /// payload) on a subject of `subject_len` bytes. `Err` names what exceeds which limit,
    /// in words fit for a dead-letter reason (no header name, no line break).
    pub(crate) fn check(
        &self,
        size: usize,
        payload_len: usize,
        subject_len: usize,
    ) -> Result<(), (Excess, String)> {
        if size > self.max_message_bytes {
            return Err((
                Excess::Size,
                format!(
                    "the message is {size} bytes (headers and payload), over the {} bytes JetStream accepts (the server's max_payload or the stream's max_msg_size)",
                    self.max_message_bytes
                ),
            ));
        }
        let control_line = control_line_len(subject_len, size - payload_len, size);
        if control_line > self.max_control_line {
            return Err((
                Excess::ControlLine,
                format!(
                    "its publish line is {control_line} bytes (the subject carries the event type), over the {} bytes of the NATS server's max_control_line",
                    self.max_control_line
                ),
            ));
        }
        Ok(())
    }
}

/// The largest dead-letter record for `event` that fits `limits` (M3): its headers (with
/// `source` and room for the fence) and body, and its `HPUB` line on `subject`. `Err` says
/// why the smallest record does not fit.
pub(crate) fn fit_dead_letter(
    event: &OutboxEvent,
    hostile: bool,
    reason: &str,
    source: &str,
    subject: &str,
    fence: Option<&Fence>,
    limits: Limits,
) -> Result<(HeaderMap, Bytes, Cut), String> {
    let mut why = String::new();
    for cut in Cut::ALL {
        let (mut map, payload) = dead_letter_record(event, hostile, reason, cut);
        map.insert(name::OUTBOX_SOURCE, source);
        let size = wire_size(&map, payload.len()) + fence_len(fence);
        match limits.check(size, payload.len(), subject.len()) {
            Ok(()) => return Ok((map, payload, cut)),
            Err((_, excess)) => why = excess,
        }
    }
    Err(format!(
        "the dead-letter record in its place does not fit either, even cut to its minimum: {why}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox::{headers, Position};
    use proptest::prelude::*;

    pub(crate) fn event(
        entity_id: &str,
        event_type: &str,
        id: i64,
        index: u32,
        payload_len: usize,
    ) -> OutboxEvent {
        let keys = outbox::compute_keys(id, entity_id, event_type, 1_700_000_000_000);
        OutboxEvent {
            id: EventId::Int(id),
            headers: Vec::new(),
            binary: false,
            entity_id: entity_id.to_owned(),
            event_type: event_type.to_owned(),
            shard: outbox::shard_for_key(std::num::NonZeroU64::new(12).unwrap(), entity_id),
            subject: outbox::subject::subject("outbox", 3, event_type),
            keys,
            payload: Bytes::from(vec![b'x'; payload_len]),
            position: Position {
                commit_lsn: outbox::Lsn(0x16_B374_D848),
                index,
            },
            created_at_ms: 1_700_000_000_000,
        }
    }

    fn get(map: &HeaderMap, name: &str) -> Option<String> {
        map.get(name).map(|v| v.as_str().to_owned())
    }

    proptest! {
        /// M2, M4: the header block the sink writes holds exactly the headers of
        /// `into_message` (and the fence's), the relay's `Nats-*` ones first, and its size is
        /// what `wire_size` counts; the range it returns is the `Nats-Msg-Id` value.
        #[test]
        fn the_written_block_is_the_messages_headers_nats_first(
            entity_id in "[a-zA-Z0-9:ü \r\n-]{0,40}|(?i)[a-z ]{0,5}nats-msg-id[:a-z ]{0,5}",
            event_type in "[a-zA-Z.* ]{0,20}|(?i)nats-expected-last-sequence[a-z\0]{0,3}",
            id in any::<i64>(),
            index in any::<u32>(),
            payload_len in 0usize..2000,
            fence in proptest::option::of((any::<u64>(), proptest::option::of("[a-zA-Z0-9:%]{0,60}"), any::<bool>())),
        ) {
            let event = event(&entity_id, &event_type, id, index, payload_len);
            let commit_lsn = event.position.commit_lsn.to_string();
            let hostile = encoding::row_is_hostile(&entity_id, &event_type);
            let fence = fence.map(|(sequence, last_msg_id, tx_end)| Fence { sequence, last_msg_id, chained: true, batch: None, tx_end, fast: None });
            let mut block = BytesMut::new();
            let msg_id = write_event_block(&mut block, &event, hostile, &commit_lsn, Some("7713/db/slot"), fence.as_ref());
            let (_, map, _) = into_message(event, hostile, &commit_lsn, Some("7713/db/slot"));
            prop_assert_eq!(block.len(), wire_size(&map, 0) + fence_len(fence.as_ref()));
            let id = get(&map, headers::NATS_MSG_ID).unwrap();
            prop_assert_eq!(&block[msg_id], id.as_bytes());
            let text = std::str::from_utf8(&block).unwrap();
            let inner = text.strip_prefix("NATS/1.0\r\n").and_then(|t| t.strip_suffix("\r\n\r\n")).unwrap();
            let lines: Vec<(&str, &str)> = inner.split("\r\n").map(|l| l.split_once(": ").unwrap()).collect();
            let nats = lines.iter().take_while(|(name, _)| name.starts_with("Nats-")).count();
            prop_assert!(lines[nats..].iter().all(|(name, _)| !name.starts_with("Nats-")), "{:?}", lines);
            for (name, value) in &lines {
                let expected = match *name {
                    name::EXPECTED_LAST_SEQUENCE_STR => fence.as_ref().map(|f| f.sequence.to_string()),
                    name::EXPECTED_LAST_MSG_ID_STR => fence.as_ref().and_then(|f| f.last_msg_id.clone()),
                    headers::OUTBOX_TX_END => fence.as_ref().filter(|f| f.tx_end).map(|_| "1".to_owned()),
                    name => get(&map, name),
                };
                prop_assert_eq!(Some(*value), expected.as_deref());
            }
            let fence_lines = fence.as_ref().map_or(0, |f| 1 + usize::from(f.last_msg_id.is_some()) + usize::from(f.tx_end));
            prop_assert_eq!(lines.len(), map.iter().count() + fence_lines);
        }

        /// M1: whatever the row, no header value contains `nats-` in any case, and the
        /// encoded values decode to the row's.
        #[test]
        fn no_row_value_carries_a_header_name(
            entity_id in any::<String>(),
            event_type in "(?i)[a-z]{0,3}(nats-msg-id|nats-expected-last-sequence)?[\r\n ]{0,2}",
        ) {
            let event = event(&entity_id, &event_type, 7, 0, 1);
            let hostile = encoding::row_is_hostile(&entity_id, &event_type);
            let keys = event.keys.clone();
            let (_, map, _) = into_message(event.clone(), hostile, "0/1", Some("src"));
            let (dead_letter, _) = dead_letter_record(&event, hostile, "too large", Cut::Full);
            for map in [&map, &dead_letter] {
                for (_, values) in map.iter() {
                    for v in values {
                        prop_assert!(!encoding::is_hostile(v.as_str()), "{:?}", v.as_str());
                    }
                }
            }
            let decoded = |name: &str| {
                let raw = get(&map, name).unwrap_or_default();
                if get(&map, headers::OUTBOX_ENCODING).is_some() {
                    encoding::decode(&raw)
                } else {
                    Some(raw)
                }
            };
            prop_assert_eq!(decoded(headers::OUTBOX_ENTITY_ID), Some(entity_id.clone()));
            prop_assert_eq!(decoded(headers::OUTBOX_EVENT_TYPE), Some(event_type.clone()));
            prop_assert_eq!(decoded(headers::OUTBOX_PARTITION_KEY), Some(keys.partition_key));
            prop_assert_eq!(decoded(headers::NATS_MSG_ID), Some(keys.dedupe_key));
            prop_assert_eq!(hostile, get(&map, headers::OUTBOX_ENCODING).is_some());
        }
    }

    #[test]
    fn headers_carry_the_events_values() {
        let (subject, map, payload) = into_message(
            event("order:A-1", "OrderPaid", 42, 7, 3),
            false,
            "16/B374D848",
            Some("src"),
        );
        let get = |name: &str| get(&map, name);
        assert_eq!(subject.as_str(), "outbox.3.OrderPaid");
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("OrderPaid:order:A-1:42")
        );
        assert_eq!(get("Outbox-Id").as_deref(), Some("42"));
        assert_eq!(get("Outbox-Tx-Index").as_deref(), Some("7"));
        assert_eq!(get("Outbox-Commit-Lsn").as_deref(), Some("16/B374D848"));
        assert_eq!(get("Outbox-Source").as_deref(), Some("src"));
        assert_eq!(get("Outbox-Encoding"), None);
        assert_eq!(payload.len(), 3);
    }

    #[test]
    fn a_hostile_rows_values_are_percent_encoded() {
        let (_, map, _) = into_message(
            event(
                "order Nats-Msg-Id: x",
                "Nats-Expected-Last-Sequence",
                42,
                0,
                3,
            ),
            true,
            "16/B374D848",
            None,
        );
        let get = |name: &str| get(&map, name);
        assert_eq!(get("Outbox-Encoding").as_deref(), Some("percent"));
        assert_eq!(
            get("Outbox-Entity-Id").as_deref(),
            Some("order%20Nats%2DMsg%2DId:%20x")
        );
        assert_eq!(
            get("Outbox-Event-Type").as_deref(),
            Some("Nats%2DExpected%2DLast%2DSequence")
        );
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("Nats%2DExpected%2DLast%2DSequence:order%20Nats%2DMsg%2DId:%20x:42")
        );
        assert_eq!(get("Outbox-Id").as_deref(), Some("42"));
    }

    /// The `HPUB` line of a publish, measured on the protocol's serialisation rules: exactly
    /// for the budgeted reply subject, at most for the sink's longest one (P10).
    #[test]
    fn control_line_counts_the_hpub_line() {
        let reply = format!("_INBOX.{}.{}", "a".repeat(22), "b".repeat(22));
        let written = format!("HPUB {} {reply} {} {}\r\n", "outbox.3.X", 120, 4120);
        assert_eq!(
            control_line_len("outbox.3.X".len(), 120, 4120),
            written.len()
        );
        let longest = format!("_INBOX.{}.{}", "a".repeat(22), u64::MAX);
        let written = format!("HPUB {} {longest} {} {}\r\n", "outbox.3.X", 120, 4120);
        assert!(written.len() <= control_line_len("outbox.3.X".len(), 120, 4120));
    }

    #[test]
    fn a_dead_letter_record_is_cut_to_what_fits() {
        let long = "x".repeat(5000);
        let event = event(&long, &long, 9, 2, 10);
        let fit = |max_message_bytes| {
            let limits = Limits {
                max_message_bytes,
                max_control_line: DEFAULT_MAX_CONTROL_LINE,
            };
            fit_dead_letter(
                &event,
                false,
                "too large",
                "src",
                "outbox.dlq",
                Some(&Fence::at(1)),
                limits,
            )
        };
        let (map, body, cut) = fit(100_000).unwrap();
        assert_eq!(cut, Cut::Full);
        assert!(get(&map, "Nats-Msg-Id")
            .unwrap()
            .starts_with("dead-letter:sha256:"));
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["truncated"], false);
        assert_eq!(json["entity_id"], serde_json::json!(long));

        let (map_cut, body, cut) = fit(1000).unwrap();
        assert_eq!(cut, Cut::Truncated);
        assert!(wire_size(&map_cut, body.len()) + fence_len(Some(&Fence::at(1))) <= 1000);
        assert_eq!(
            get(&map, "Nats-Msg-Id"),
            get(&map_cut, "Nats-Msg-Id"),
            "the record's id does not depend on the cut"
        );
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["truncated"], true);
        assert_eq!(json["entity_id"], serde_json::json!("x".repeat(64)));
        assert_eq!(json["outbox_id"], 9);

        let (_, body, cut) = fit(500).unwrap();
        assert_eq!(cut, Cut::Minimal);
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json.get("entity_id"), None);
        assert_eq!(json["tx_index"], 2);

        let error = fit(200).unwrap_err();
        assert!(error.contains("does not fit"), "{error}");
        assert!(error.contains("over the 200 bytes"), "{error}");
    }

    /// Every reason the sink writes into a dead-letter header is header-safe.
    #[test]
    fn limit_reasons_are_header_safe() {
        let limits = Limits {
            max_message_bytes: 100,
            max_control_line: DEFAULT_MAX_CONTROL_LINE,
        };
        let (excess, reason) = limits.check(101, 0, 1).unwrap_err();
        assert_eq!(excess, Excess::Size);
        assert!(!encoding::is_hostile(&reason), "{reason}");
        let (excess, reason) = limits.check(100, 0, 4050).unwrap_err();
        assert_eq!(excess, Excess::ControlLine);
        assert!(!encoding::is_hostile(&reason), "{reason}");
        assert!(limits.check(100, 0, 3900).is_ok());
    }

    #[test]
    fn an_unchained_fence_carries_the_sequence_only() {
        let written = |fence: &Fence| {
            let mut block = BytesMut::new();
            fence.write(&mut block);
            String::from_utf8(block.to_vec()).unwrap()
        };
        for chained in [true, false] {
            let mut fence = Fence::at(7).chained(chained);
            fence.advance(b"T:e:1");
            let block = written(&fence);
            assert!(
                block.contains("Nats-Expected-Last-Sequence: 8\r\n"),
                "{block}"
            );
            assert_eq!(
                block.contains("Nats-Expected-Last-Msg-Id: T:e:1"),
                chained,
                "{block}"
            );
            assert_eq!(block.len(), fence_len(Some(&fence)), "{block}");
        }
    }

    #[test]
    fn truncation_keeps_whole_characters() {
        assert_eq!(prefix("üüü", 3), "ü");
        assert_eq!(prefix("abc", 64), "abc");
    }
}
