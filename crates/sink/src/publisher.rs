//! Publishing to JetStream under a bounded in-flight window, and turning the acks into the
//! watermark the replication stream may confirm.
//!
//! ```text
//!  input (bounded) ─► publisher ──(future, permit)──► acker ─► AckTracker ─► watermark (watch)
//!                       │   send_publish: written          awaits acks in order,
//!                       │   to the connection              one task of its own
//!                       └── window: a semaphore of max_in_flight permits, released by the acker
//! ```
//! Two tasks, because async-nats releases a publish's in-flight slot only once its ack
//! future is resolved or dropped: a single task that both publishes and holds the futures
//! can stall itself.
//!
//! # Invariants
//! - P1 The watermark only moves through [`AckTracker`] (see its A1–A4): a publish that
//!   errors, times out or is dropped never counts as stored; `duplicate: true` does (the
//!   stream already holds the message).
//! - P2 At most `max_in_flight` publishes are unacknowledged at any time; the input channel
//!   is bounded too, so memory is bounded whatever the size of a transaction or backlog.
//! - P3 Any publish or ack error ends [`run`] with that error; nothing after it is
//!   confirmed. Recovery (reconnect, rewind to the confirmed position) is the caller's.
//! - P4 When the input closes, [`run`] drains: it awaits the acks still in flight and
//!   publishes the final watermark before returning.
//! - P5 Strict mode ([`SinkOptions::fence`]): every publish carries
//!   `Nats-Expected-Last-Sequence`, the stream's last sequence plus the publishes before it
//!   in this session. If one publish is lost or refused, the server refuses every later one,
//!   so no gap and no reordering can enter the stream; the refusal ends [`run`] and the
//!   caller re-syncs from the stream's tail.
//! - P6 Events at or before [`SinkOptions::resume_after`] (the position of the stream's last
//!   message) are already stored: they are counted as acknowledged without being published.
//! - P7 An event JetStream can never accept (larger than the server's `max_payload` or the
//!   stream's `max_msg_size`) is never dropped silently: under [`PoisonPolicy::Halt`] [`run`]
//!   awaits the acks of everything published before it, then ends with
//!   [`SinkError::Poison`] naming it, and nothing after it is confirmed; under
//!   [`PoisonPolicy::DeadLetter`] a small record with its id, keys and the reason takes its
//!   place in the stream, in order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_nats::jetstream::context::{Context, PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use outbox::headers;
use outbox::{OutboxEvent, Position};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::task::AbortOnDropHandle;
use tracing::debug;

use crate::tracker::{AckTracker, Ticket, TrackerError};

/// What the sink consumes, in replication order.
// Events dominate the stream and travel in batches (`Vec<SinkItem>`); boxing them would add
// an allocation per event on the hot path to shrink the rare marker variants.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum SinkItem<P> {
    /// A transaction starts.
    Begin,
    /// An outbox row of the open transaction.
    Event(OutboxEvent),
    /// The open transaction committed; `P` is its end position.
    Commit(P),
    /// A position reached with no transaction open (a keepalive's WAL end).
    Idle(P),
}

/// What to do with an event JetStream can never accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoisonPolicy {
    /// Stop with an error naming the event; nothing after it is confirmed.
    Halt,
    /// Publish a dead-letter record in its place and go on.
    DeadLetter,
}

/// How one session of [`run`] publishes.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Publishes awaiting their ack at most.
    pub max_in_flight: usize,
    /// Strict mode: the stream's last sequence when the session starts (the relay must be
    /// the stream's only writer). `None`: shared mode, de-duplication only.
    pub fence: Option<u64>,
    /// The position of the stream's last message, when it could be read (P6).
    pub resume_after: Option<Position>,
    /// The largest message JetStream accepts: `min(max_payload, max_msg_size)`, in bytes of
    /// headers plus payload.
    pub max_message_bytes: usize,
    /// What to do with an event larger than that, or refused for good.
    pub poison: PoisonPolicy,
    /// Where dead-letter records go (`{prefix}.dlq`).
    pub dead_letter_subject: String,
    /// The `Outbox-Source` header value every message carries.
    pub source: String,
}

/// Counters the sink keeps; shared so metrics can read them while it runs.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Publishes acknowledged as newly stored.
    pub stored: AtomicU64,
    /// Publishes acknowledged as duplicates (JetStream already held the message id).
    pub duplicates: AtomicU64,
    /// Replayed events skipped because the stream's tail showed them stored (P6).
    pub skipped: AtomicU64,
    /// Dead-letter records published in place of an event.
    pub dead_lettered: AtomicU64,
    /// The position through which the stream is known to hold every event: the newest
    /// event acknowledged (stored or duplicate) with every earlier one of its session
    /// acknowledged too (P6). Outlives a session, so the next one skips what this one
    /// learned is stored even when the stream's tail cannot tell (a duplicate consumes no
    /// sequence, so re-publishing it would break the fence of everything behind it). Kept
    /// with the source it was learned from: positions of another source (another timeline
    /// after a fail-over) say nothing about this one.
    stored_through: std::sync::Mutex<Option<(String, Position)>>,
}

impl SinkStats {
    /// Publishes acknowledged so far, stored or duplicate.
    pub fn acked(&self) -> u64 {
        self.stored.load(Ordering::Relaxed) + self.duplicates.load(Ordering::Relaxed)
    }

    /// See the field's docs: the position through which the stream holds every event of
    /// `source`, as far as this process saw acknowledged.
    pub fn stored_through(&self, source: &str) -> Option<Position> {
        match &*self.through_lock() {
            Some((seen, position)) if seen == source => Some(*position),
            _ => None,
        }
    }

    fn through_lock(&self) -> std::sync::MutexGuard<'_, Option<(String, Position)>> {
        self.stored_through
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn note_stored(&self, source: &str, position: Position) {
        let mut through = self.through_lock();
        match &mut *through {
            Some((seen, through)) if seen == source => *through = (*through).max(position),
            other => *other = Some((source.to_owned(), position)),
        }
    }
}

/// Why the sink stopped.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The publish could not be sent.
    #[error("publishing outbox event id={id} failed: {source}")]
    Publish {
        /// The outbox row id.
        id: i64,
        /// What async-nats reported.
        source: async_nats::jetstream::context::PublishError,
    },
    /// JetStream refused the message, or no ack came in time.
    #[error("JetStream did not store outbox event id={id}: {source}")]
    Ack {
        /// The outbox row id.
        id: i64,
        /// What async-nats reported.
        source: async_nats::jetstream::context::PublishError,
    },
    /// An event JetStream can never accept, under [`PoisonPolicy::Halt`].
    #[error("outbox event id={id} cannot be stored: {reason}")]
    Poison {
        /// The outbox row id.
        id: i64,
        /// Why.
        reason: String,
    },
    /// A bug: the items violated the Begin/Event/Commit protocol.
    #[error("replication items out of protocol: {0}")]
    Protocol(#[from] TrackerError),
}

impl SinkError {
    /// The outbox id of an event JetStream will never accept, whatever we retry (an
    /// oversized payload): the caller must stop or dead-letter it, not retry forever.
    pub fn poison_id(&self) -> Option<i64> {
        match self {
            SinkError::Poison { id, .. } => Some(*id),
            SinkError::Publish { id, source }
                if source.kind() == PublishErrorKind::MaxPayloadExceeded =>
            {
                Some(*id)
            }
            SinkError::Ack { id, source } if is_size_refusal(source) => Some(*id),
            _ => None,
        }
    }
}

fn is_size_refusal(error: &async_nats::jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    let code = error
        .source()
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .map(|e| e.error_code());
    code == Some(async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}

/// Whether the ack error is strict mode's fence refusing a publish out of sequence.
pub fn is_fence_refusal(error: &SinkError) -> bool {
    matches!(error, SinkError::Ack { source, .. } if source.kind() == PublishErrorKind::WrongLastSequence)
}

/// The JetStream message for an event: its subject's payload and the frozen headers.
pub fn publish_message(event: &OutboxEvent) -> PublishMessage {
    let commit_lsn = event.position.commit_lsn.to_string();
    let (_, map, payload) = into_message(event.clone(), &commit_lsn, None);
    PublishMessage::build().headers(map).payload(payload)
}

/// The bytes JetStream counts against `max_payload` and `max_msg_size`: the serialised
/// headers (`NATS/1.0\r\n`, `Name: value\r\n` each, `\r\n`) plus the payload.
pub fn wire_size(headers: &HeaderMap, payload_len: usize) -> usize {
    let mut len = b"NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        for value in values {
            len += <async_nats::HeaderName as AsRef<str>>::as_ref(name).len()
                + 2
                + value.as_str().len()
                + 2;
        }
    }
    len + payload_len
}

/// The dead-letter record published in place of `event` (P7): headers and a JSON body with
/// the event's identity, keys and position and the reason; not the payload.
pub fn dead_letter_record(event: &OutboxEvent, reason: &str) -> (HeaderMap, Bytes) {
    let mut map = HeaderMap::new();
    map.insert(
        headers::NATS_MSG_ID,
        format!("dead-letter:{}", event.keys.dedupe_key),
    );
    map.insert(headers::OUTBOX_ID, event.id.to_string());
    map.insert(
        headers::OUTBOX_COMMIT_LSN,
        event.position.commit_lsn.to_string(),
    );
    map.insert(headers::OUTBOX_TX_INDEX, event.position.index.to_string());
    map.insert(
        headers::OUTBOX_DEAD_LETTER_REASON,
        reason.replace(['\r', '\n'], " "),
    );
    let record = serde_json::json!({
        "outbox_id": event.id,
        "entity_id": event.entity_id,
        "event_type": event.event_type,
        "dedupe_key": event.keys.dedupe_key,
        "partition_key": event.keys.partition_key,
        "ordering_key": event.keys.ordering_key,
        "shard": event.shard,
        "subject": event.subject,
        "commit_lsn": event.position.commit_lsn.to_string(),
        "tx_index": event.position.index,
        "payload_bytes": event.payload.len(),
        "reason": reason,
    });
    (map, record.to_string().into())
}

/// Header names, built once (`HeaderName::from_static` is free; parsing a `&str` name per
/// message showed in the profile).
mod name {
    use async_nats::HeaderName;
    use outbox::headers as h;

    pub const NATS_MSG_ID: HeaderName = HeaderName::from_static(h::NATS_MSG_ID);
    pub const OUTBOX_ID: HeaderName = HeaderName::from_static(h::OUTBOX_ID);
    pub const OUTBOX_ENTITY_ID: HeaderName = HeaderName::from_static(h::OUTBOX_ENTITY_ID);
    pub const OUTBOX_EVENT_TYPE: HeaderName = HeaderName::from_static(h::OUTBOX_EVENT_TYPE);
    pub const OUTBOX_PARTITION_KEY: HeaderName = HeaderName::from_static(h::OUTBOX_PARTITION_KEY);
    pub const OUTBOX_ORDERING_KEY: HeaderName = HeaderName::from_static(h::OUTBOX_ORDERING_KEY);
    pub const OUTBOX_SHARD: HeaderName = HeaderName::from_static(h::OUTBOX_SHARD);
    pub const OUTBOX_COMMIT_LSN: HeaderName = HeaderName::from_static(h::OUTBOX_COMMIT_LSN);
    pub const OUTBOX_TX_INDEX: HeaderName = HeaderName::from_static(h::OUTBOX_TX_INDEX);
    pub const OUTBOX_SOURCE: HeaderName = HeaderName::from_static(h::OUTBOX_SOURCE);
    pub const EXPECTED_LAST_SEQUENCE: HeaderName =
        HeaderName::from_static("Nats-Expected-Last-Sequence");
}

fn int(value: impl itoa::Integer) -> String {
    itoa::Buffer::new().format(value).to_owned()
}

fn digits(value: impl itoa::Integer) -> usize {
    itoa::Buffer::new().format(value).len()
}

/// One serialised header line, `Name: value\r\n`.
fn line(name: &str, value_len: usize) -> usize {
    name.len() + 2 + value_len + 2
}

/// [`wire_size`] of the message [`into_message`] builds, from the lengths alone.
fn event_wire_size(
    event: &OutboxEvent,
    commit_lsn: &str,
    source: Option<&str>,
    fence: Option<u64>,
) -> usize {
    use outbox::headers as h;
    let k = &event.keys;
    b"NATS/1.0\r\n\r\n".len()
        + line(h::NATS_MSG_ID, k.dedupe_key.len())
        + line(h::OUTBOX_ID, digits(event.id))
        + line(h::OUTBOX_ENTITY_ID, event.entity_id.len())
        + line(h::OUTBOX_EVENT_TYPE, event.event_type.len())
        + line(h::OUTBOX_PARTITION_KEY, k.partition_key.len())
        + line(h::OUTBOX_ORDERING_KEY, k.ordering_key.len())
        + line(h::OUTBOX_SHARD, digits(event.shard))
        + line(h::OUTBOX_COMMIT_LSN, commit_lsn.len())
        + line(h::OUTBOX_TX_INDEX, digits(event.position.index))
        + source.map_or(0, |s| line(h::OUTBOX_SOURCE, s.len()))
        + fence.map_or(0, |f| line("Nats-Expected-Last-Sequence", digits(f)))
        + event.payload.len()
}

/// The subject, headers and payload for `event`, moving its strings into the header values
/// instead of copying them.
fn into_message(
    event: OutboxEvent,
    commit_lsn: &str,
    source: Option<&str>,
) -> (Subject, HeaderMap, Bytes) {
    let OutboxEvent {
        id,
        entity_id,
        event_type,
        keys,
        shard,
        subject,
        payload,
        position,
    } = event;
    let mut map = HeaderMap::new();
    map.insert(name::NATS_MSG_ID, keys.dedupe_key);
    map.insert(name::OUTBOX_ID, int(id));
    map.insert(name::OUTBOX_ENTITY_ID, entity_id);
    map.insert(name::OUTBOX_EVENT_TYPE, event_type);
    map.insert(name::OUTBOX_PARTITION_KEY, keys.partition_key);
    map.insert(name::OUTBOX_ORDERING_KEY, keys.ordering_key);
    map.insert(name::OUTBOX_SHARD, int(shard));
    map.insert(name::OUTBOX_COMMIT_LSN, commit_lsn);
    map.insert(name::OUTBOX_TX_INDEX, int(position.index));
    if let Some(source) = source {
        map.insert(name::OUTBOX_SOURCE, source);
    }
    (Subject::from(subject), map, payload)
}

enum AckItem<P> {
    Begin,
    /// Already in the stream (P6): counts as acknowledged.
    Stored,
    Publish {
        id: i64,
        position: Position,
        ack: PublishAckFuture,
        _permit: OwnedSemaphorePermit,
    },
    Commit(P),
    Idle(P),
}

/// Publishes `input` until it closes or an error occurs, publishing the confirmable
/// position to `watermark` as acks arrive. See the module docs for the invariants.
pub async fn run<P>(
    jetstream: Context,
    options: SinkOptions,
    mut input: mpsc::Receiver<Vec<SinkItem<P>>>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
) -> Result<(), SinkError>
where
    P: Ord + Copy + Send + Sync + std::fmt::Debug + 'static,
{
    let window = Arc::new(Semaphore::new(options.max_in_flight.max(1)));
    let (ack_tx, ack_rx) = mpsc::channel::<AckItem<P>>(options.max_in_flight.max(1));
    let start = *watermark.borrow();
    // Aborted with `run`: a dropped sink leaves no task behind (the caller's L1).
    let mut acker = AbortOnDropHandle::new(tokio::spawn(acker(
        ack_rx,
        AckTracker::new(start),
        watermark,
        stats.clone(),
        options.source.clone(),
    )));
    let mut fence = options.fence;
    // The commit LSN's text, formatted once per transaction.
    let mut commit_lsn = (pgoutput::Lsn::ZERO, String::new());

    let publishing = async {
        while let Some(batch) = input.recv().await {
            for item in batch {
                let item = match item {
                    SinkItem::Begin => AckItem::Begin,
                    SinkItem::Commit(p) => AckItem::Commit(p),
                    SinkItem::Idle(p) => AckItem::Idle(p),
                    SinkItem::Event(event) => {
                        if options
                            .resume_after
                            .is_some_and(|tail| event.position <= tail)
                        {
                            stats.skipped.fetch_add(1, Ordering::Relaxed);
                            AckItem::Stored
                        } else {
                            // The semaphore is never closed, so acquire cannot fail.
                            let Ok(permit) = window.clone().acquire_owned().await else {
                                return Ok(());
                            };
                            let (id, position) = (event.id, event.position);
                            if commit_lsn.0 != position.commit_lsn {
                                commit_lsn = (position.commit_lsn, position.commit_lsn.to_string());
                            }
                            let (subject, message) =
                                prepare(event, &commit_lsn.1, &options, &mut fence, &stats)?;
                            let ack = jetstream
                                .send_publish(subject, message)
                                .await
                                .map_err(|source| SinkError::Publish { id, source })?;
                            AckItem::Publish {
                                id,
                                position,
                                ack,
                                _permit: permit,
                            }
                        }
                    }
                };
                if ack_tx.send(item).await.is_err() {
                    // The acker stopped: its result says why.
                    return Ok(());
                }
            }
        }
        Ok::<(), SinkError>(())
    };

    let published = tokio::select! {
        result = publishing => result,
        // The acker only ends early on an error; stop publishing at once.
        result = &mut acker => return flatten(result),
    };
    drop(ack_tx);
    match published {
        Ok(()) => flatten(acker.await),
        // P7 halt stops *at* the poison event: the publishes before it are awaited (stored,
        // and confirmed as far as whole transactions go) before the error ends the run.
        // Aborting the acker here would drop them unflushed, and a relay halting on every
        // restart would never deliver the events before the poison one.
        Err(error) if error.poison_id().is_some() => flatten(acker.await).and(Err(error)),
        Err(error) => {
            acker.abort();
            Err(error)
        }
    }
}

/// The subject and message for `event`: the event itself, or its dead-letter record when it
/// is too large (P7); fenced in strict mode (P5). `commit_lsn` is the event's commit LSN,
/// formatted once per transaction by the caller.
fn prepare(
    event: OutboxEvent,
    commit_lsn: &str,
    options: &SinkOptions,
    fence: &mut Option<u64>,
    stats: &SinkStats,
) -> Result<(Subject, PublishMessage), SinkError> {
    let source = options.source.as_str();
    // Room for the fence header too, so the size check covers what is actually sent.
    let size = event_wire_size(&event, commit_lsn, Some(source), *fence);
    let (subject, mut map, payload) = if size > options.max_message_bytes {
        let reason = format!(
            "the message is {size} bytes (headers and payload), over the {} bytes JetStream accepts (the server's max_payload or the stream's max_msg_size)",
            options.max_message_bytes
        );
        match options.poison {
            PoisonPolicy::Halt => {
                return Err(SinkError::Poison {
                    id: event.id,
                    reason,
                })
            }
            PoisonPolicy::DeadLetter => {
                tracing::warn!(outbox_id = event.id, reason = %reason, "publishing a dead-letter record in place of the event");
                stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                let (mut map, payload) = dead_letter_record(&event, &reason);
                map.insert(name::OUTBOX_SOURCE, source);
                (
                    Subject::from(options.dead_letter_subject.clone()),
                    map,
                    payload,
                )
            }
        }
    } else {
        into_message(event, commit_lsn, Some(source))
    };
    if let Some(next) = fence.as_mut() {
        map.insert(name::EXPECTED_LAST_SEQUENCE, int(*next));
        *next += 1;
    }
    Ok((
        subject,
        PublishMessage::build().headers(map).payload(payload),
    ))
}

fn flatten(result: Result<Result<(), SinkError>, tokio::task::JoinError>) -> Result<(), SinkError> {
    match result {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Ok(()),
    }
}

async fn acker<P: Ord + Copy + std::fmt::Debug>(
    mut items: mpsc::Receiver<AckItem<P>>,
    mut tracker: AckTracker<P>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
    source: String,
) -> Result<(), SinkError> {
    while let Some(item) = items.recv().await {
        let moved = match item {
            AckItem::Begin => {
                tracker.begin()?;
                None
            }
            AckItem::Stored => {
                let ticket = tracker.publish()?;
                tracker.ack(ticket)?
            }
            AckItem::Commit(end) => tracker.commit(end)?,
            AckItem::Idle(position) => tracker.idle(position),
            AckItem::Publish {
                id,
                position,
                ack,
                _permit,
            } => {
                let ticket: Ticket = tracker.publish()?;
                let ack = ack.await.map_err(|source| SinkError::Ack { id, source })?;
                if ack.duplicate {
                    debug!(
                        outbox_id = id,
                        sequence = ack.sequence,
                        "JetStream already held this message id"
                    );
                    stats.duplicates.fetch_add(1, Ordering::Relaxed);
                } else {
                    stats.stored.fetch_add(1, Ordering::Relaxed);
                }
                // Acks are awaited in publish order, so every earlier publish of this
                // session is acknowledged too.
                stats.note_stored(&source, position);
                tracker.ack(ticket)?
            }
        };
        if let Some(position) = moved {
            watermark.send_replace(position);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event(
        entity_id: &str,
        event_type: &str,
        id: i64,
        index: u32,
        payload_len: usize,
    ) -> OutboxEvent {
        let keys = outbox::compute_keys(id, entity_id, event_type, 1_700_000_000_000);
        OutboxEvent {
            id,
            entity_id: entity_id.to_owned(),
            event_type: event_type.to_owned(),
            shard: outbox::shard_for_key(std::num::NonZeroU64::new(12).unwrap(), entity_id),
            subject: outbox::subject::subject("outbox", 3, event_type),
            keys,
            payload: Bytes::from(vec![b'x'; payload_len]),
            position: Position {
                commit_lsn: pgoutput::Lsn(0x16_B374_D848),
                index,
            },
        }
    }

    proptest! {
        /// The size check, computed from lengths, equals the serialised size of what is sent.
        #[test]
        fn size_from_lengths_equals_the_serialised_size(
            entity_id in "[a-zA-Z0-9:ü -]{0,40}",
            event_type in "[a-zA-Z.* ]{0,20}",
            id in any::<i64>(),
            index in any::<u32>(),
            payload_len in 0usize..2000,
            fence in proptest::option::of(any::<u64>()),
        ) {
            let event = event(&entity_id, &event_type, id, index, payload_len);
            let commit_lsn = event.position.commit_lsn.to_string();
            let computed = event_wire_size(&event, &commit_lsn, Some("7713/db/slot"), fence);
            let (_, mut map, payload) = into_message(event, &commit_lsn, Some("7713/db/slot"));
            if let Some(f) = fence {
                map.insert(name::EXPECTED_LAST_SEQUENCE, int(f));
            }
            prop_assert_eq!(computed, wire_size(&map, payload.len()));
        }
    }

    #[test]
    fn headers_carry_the_events_values() {
        let (subject, map, payload) = into_message(
            event("order:A-1", "OrderPaid", 42, 7, 3),
            "16/B374D848",
            Some("src"),
        );
        let get = |name: &str| map.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(subject.as_str(), "outbox.3.OrderPaid");
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("OrderPaid:order:A-1:42")
        );
        assert_eq!(get("Outbox-Id").as_deref(), Some("42"));
        assert_eq!(get("Outbox-Tx-Index").as_deref(), Some("7"));
        assert_eq!(get("Outbox-Commit-Lsn").as_deref(), Some("16/B374D848"));
        assert_eq!(get("Outbox-Source").as_deref(), Some("src"));
        assert_eq!(payload.len(), 3);
    }
}
