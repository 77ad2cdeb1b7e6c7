//! Publishing to JetStream under a bounded in-flight window, and turning the acks into the
//! watermark the replication stream may confirm.
//!
//! ```text
//!  input (bounded) ─► publisher ──(sequence n, permit)──► acker ─► AckTracker ─► watermark (watch)
//!                       │  HPUB subject {inbox}.n frames        ▲ awaits acks in order,
//!                       │  (crate::conn's writer task)          │ one task of its own
//!                       │                  nats-server ─► SUB {inbox}.>  (crate::conn's reader)
//!                       └── window: a semaphore of max_in_flight permits, released by the acker
//! ```
//! Publishes are frames the publisher writes itself ([`crate::message`] M4, [`crate::wire`])
//! on the session's own connection ([`crate::conn`]), not async-nats's publishing API, whose
//! header map and command per message were a quarter of the relay's CPU, nor its JetStream
//! request machinery (a random inbox, a oneshot channel, a timer and a serde parse per
//! publish): the acker matches the answers by their sequence (P10), read with [`crate::ack`].
//! Frames gather in a buffer handed to the connection's writer at the end of each input
//! batch, every [`FLUSH_BYTES`], and before the publisher would wait (for room in the window,
//! in the acker's queue), so no publish waits on one the connection has not been given.
//!
//! # Invariants
//! - P1 The watermark only moves through [`AckTracker`] (see its A1–A4): a publish that
//!   errors, times out or is dropped never counts as stored; `duplicate: true` does (the
//!   stream already holds the message) once P8 found the original to be the same event.
//! - P2 At most `max_in_flight` publishes are unacknowledged at any time; the input channel
//!   is bounded too, so memory is bounded whatever the size of a transaction or backlog.
//! - P3 Any publish or ack error ends [`run`] with that error; nothing after it is
//!   confirmed. Recovery (reconnect, rewind to the confirmed position) is the caller's.
//! - P4 When the input closes, [`run`] drains: it awaits the acks still in flight and
//!   publishes the final watermark before returning.
//! - P5 Strict mode ([`SinkOptions::fence`]): every publish carries
//!   `Nats-Expected-Last-Sequence`, the stream's last sequence plus the publishes before it
//!   in this session, and from the session's second publish on
//!   `Nats-Expected-Last-Msg-Id`, the previous publish's `Nats-Msg-Id` ([`Fence`]). If one
//!   publish is lost or refused, or another writer slips a message in, the server refuses
//!   every later one (the id chain holds where a shifted sequence would line up again), so
//!   no gap and no reordering can enter the stream; the refusal ends [`run`] and the caller
//!   re-syncs from the stream's tail. The id chain only with [`SinkOptions::id_chain`] (a
//!   one-replica stream): see there why not on a replicated one.
//! - P6 A replayed event the stream holds at its place ([`SinkOptions::compare`],
//!   `crate::resume` S4, [`crate::vouch`]) is already stored: it is counted as acknowledged
//!   without being published. Nothing else is skipped.
//! - P15 The fence counts only what the stream stores (`crate::resume` S6): while an event may
//!   be in the stream already (at or before the tail's position and not vouched for by P6,
//!   at or before the newest event a failed session of the process published, or any event
//!   while the tail gave no position of the session's history, until the session's first
//!   publish stored as new), it is published alone, never in a batch: the
//!   publisher first awaits every earlier answer, then sets the fence to the stream's last
//!   sequence as the answers left it (a duplicate consumes none) with the id chain started
//!   again.
//! - P7 An event JetStream can never accept (larger than the server's `max_payload` or the
//!   stream's `max_msg_size`, or a publish line longer than the server's
//!   `max_control_line`: [`Limits`], checked before publishing), or that no consumer could
//!   decode (a payload that is not valid UTF-8), is never dropped silently:
//!   under [`PoisonPolicy::Halt`] [`run`] awaits the acks of everything published before it
//!   (ending an open fast batch for that, [`crate::batch`] F6), then ends with
//!   [`SinkError::Poison`] naming it, and nothing after it is confirmed; under
//!   [`PoisonPolicy::DeadLetter`] a small record with its id, keys and the reason takes its
//!   place in the stream, in order, cut to what fits (M3); if even that cannot fit, [`run`]
//!   halts.
//! - P8 A `duplicate: true` ack is checked against the stream: the original (at the ack's
//!   sequence) must be this row's event, the same `Outbox-Id` and ordering key
//!   ([`crate::resume::Claim::is_row`]; its position may differ: `outbox-relay replay` and
//!   `backfill` publish a row before the relay streams it). Another row's means the outbox id
//!   was reused (`TRUNCATE … RESTART IDENTITY`, a restored sequence), and in strict mode a
//!   message without a row identity means another writer took the id; either way the event
//!   would be lost: strict mode stops ([`PoisonPolicy::Halt`]) or ends the session so that
//!   the next one publishes a dead-letter record in its place ([`PoisonPolicy::DeadLetter`]);
//!   shared mode counts another row's ([`SinkStats::reused_ids`]) and warns, and takes an
//!   identity-less original as another writer's copy of the event. Never confirmed as
//!   stored. Only duplicates pay for the check.
//! - P9 [`SinkStats`] counts each acknowledged event under one outcome (stored, duplicate,
//!   dead-lettered; skipped when P6 skips it), when its ack arrives: an event published
//!   again after a failed session is counted once per ack. With [`SinkStats::timed`] the
//!   acker also times commit → stored and created → stored ([`crate::latency`] L1–L3).
//! - P10 An answer counts only for the publish it answers. A session subscribes once to
//!   `{inbox}.>` on its connection, `inbox` a fresh inbox under the client's inbox prefix
//!   (so NATS permissions that allow the client's inboxes allow it), and publishes its n-th message
//!   (n from 1) with the reply subject `{inbox}.n`. The acker awaits the answer for the
//!   oldest unacknowledged publish by its n: an answer that arrives early (within the
//!   window) is kept for its publish, any other (no publish of this session awaits it) is
//!   ignored, and when none came [`SinkOptions::ack_timeout`] after the acker started
//!   waiting for it, the publish timed out (one deadline, for the oldest publish only). The
//!   connection's answers wait in a channel of the window's size and a little more (P2);
//!   when the connection fails, the publishes still awaited fail with its reason (CN3),
//!   which P1 and P3 make safe.
//! - P11 A publish the server denies (`Permissions Violation for Publish to <subject>`,
//!   [`crate::conn`] CN7: the server drops it and keeps the connection) is never taken for
//!   slow: the acker honours every answer read before it, and when the oldest
//!   unacknowledged publish is to a denied subject and no answer for it was read, it is the
//!   denied one (permissions go by subject). Under [`PoisonPolicy::Halt`] the run ends with
//!   [`SinkError::Poison`] naming its id and subject; under [`PoisonPolicy::DeadLetter`]
//!   the subject is remembered (in [`SinkStats`], for the process's life: a permission
//!   granted later takes a restart) and the session ends ([`SinkError::Denied`]); from the
//!   next session on, every event to that subject is a dead-letter record in its place
//!   (P7), and if the record's own subject is denied, the run halts. In strict mode the
//!   fence refuses every publish after the denied one, so the record lands in its place; in
//!   shared mode the events published behind it in the same window are stored before it.
//! - P12 [`crate::conn`]'s CN6: the session checks events against the lowest `max_payload`
//!   the server announced (the account's), and when the server goes into lame-duck mode
//!   the publisher takes no further input, what it published is acknowledged, and [`run`]
//!   ends with [`SinkError::LameDuck`]. The flag is read once per input batch.
//! - P13 With [`SinkOptions::atomic`] (strict mode), each transaction's events are
//!   published as JetStream atomic batches ([`crate::batch`] B1–B6): P5's fence is the
//!   batch's first message's expected sequence, P10's answer is the commit's, for every
//!   event of the batch, and P1 counts none of them stored before it; a batch of one is a
//!   plain, fully fenced publish (B6). A batch refused as holding a stored message id is
//!   republished one message at a time by later sessions.
//! - P14 With [`SinkOptions::fast`] (strict mode, not atomic), consecutive events are
//!   published as fast-ingest batches ([`crate::batch`] F1–F6): every message has a reply
//!   subject naming its batch and place (so its publish number, P10), the commit's answer
//!   acknowledges the batch's events only when it is the sequence the fence predicts (F3),
//!   any other answer to a message of the batch ends the session, and the sessions after a
//!   failed one publish one message at a time up to the newest event it batched (F4).

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use async_nats::jetstream::context::{Context, PublishError, PublishErrorKind};
use async_nats::jetstream::message::StreamMessage;
use bytes::{Bytes, BytesMut};
use outbox::{EventId, Item, OutboxEvent, Position};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

use crate::batch::{self, Batch, Batches};
use crate::conn::{Acked, Answer, Connection};
use crate::error::{PoisonKind, SinkError};
use crate::latency::{Latency, TxnClock};
use crate::message::{fit_dead_letter, write_event_block, write_map_block, Fence, Limits};
use crate::resume::Doubt;
use crate::tracker::{AckTracker, Ticket};
use crate::wire;

/// The metric counting events acknowledged as duplicates of another event (P8).
pub const REUSED_ID_METRIC: &str = "outbox_relay_reused_id_total";

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
    /// Strict mode: where replayed events are compared with the stream (P6), when the
    /// stream's tail is of the session's history.
    pub compare: Option<crate::vouch::Compare>,
    /// What the server accepts (P7).
    pub limits: Limits,
    /// What to do with an event beyond the limits, or refused for good.
    pub poison: PoisonPolicy,
    /// Where dead-letter records go (`{prefix}.dlq`).
    pub dead_letter_subject: String,
    /// The `Outbox-Source` header value every message carries.
    pub source: String,
    /// How long the acker waits for the oldest publish's answer (P10), and the longest a
    /// publish may wait for room in the connection's queue.
    pub ack_timeout: Duration,
    /// Atomic transactions (P13, [`crate::batch`]): each transaction's events as atomic
    /// batches of at most this many (and at most `max_in_flight`, B3); `None`: one
    /// acknowledged publish per event. Strict mode only: ignored without a fence.
    pub atomic: Option<usize>,
    /// Fast-ingest batches (P14, [`crate::batch`] F1–F6) of at most this many events (and
    /// at most half the window); `None`: one acknowledged publish per event. Strict mode
    /// only, and not with [`SinkOptions::atomic`]: ignored there. The caller selects it
    /// (nats-server 2.14+, the stream's `allow_batched`, one replica).
    pub fast: Option<usize>,
    /// P5's id chain (`Nats-Expected-Last-Msg-Id`): for a stream of one replica. Not on a
    /// replicated stream: nats-server (read at v2.14.0-585, `processCatchupMsg` in
    /// `server/jetstream_cluster.go`; seen on 2.15.1) does not update a replica's last
    /// message id when the replica catches up from the leader, and checks the header again
    /// when it applies a message, so the first chained message after a catch-up fails on
    /// that replica for good ("stream write error: last msgid mismatch"): it never becomes
    /// current again. `Nats-Expected-Last-Sequence` stays on every publish.
    pub id_chain: bool,
}

/// Counters the sink keeps; shared so metrics can read them while it runs (P9).
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Events acknowledged as newly stored (themselves, not a dead-letter record).
    pub stored: AtomicU64,
    /// Publishes acknowledged as duplicates (JetStream already held the message id).
    pub duplicates: AtomicU64,
    /// Replayed events skipped because the stream's tail showed them stored (P6).
    pub skipped: AtomicU64,
    /// Events whose dead-letter record JetStream acknowledged in their place.
    pub dead_lettered: AtomicU64,
    /// Events acknowledged as duplicates of another event: their outbox id was reused (P8).
    pub reused_ids: AtomicU64,
    /// Events JetStream can never accept (P7, P8): each dead-letter record acknowledged in
    /// place of one, and each run that halted on one.
    pub poison: AtomicU64,
    /// Commit → stored, once per transaction with events this session published
    /// (filled only when [`SinkStats::timed`]).
    pub commit_to_ack: Latency,
    /// `created_at` → stored, per event this session published (only when timed).
    pub created_to_ack: Latency,
    /// Whether the acker times transactions (the latencies and the oldest unconfirmed one).
    timing: bool,
    /// The commit time (µs since the Unix epoch) of the transaction whose acks the acker
    /// awaits, 0 when none (`crate::latency` L3).
    oldest_unconfirmed_us: AtomicI64,
    /// The running session's window and its size, for [`SinkStats::in_flight`].
    window: Mutex<Option<(Weak<Semaphore>, usize)>>,
    /// Strict mode under [`PoisonPolicy::DeadLetter`]: events a later session publishes as
    /// dead-letter records, with the reason (P8). Outlives a session.
    dead_letter_instead: Mutex<HashMap<Position, String>>,
    /// Subjects the server denied a publish to, with its words (P11). Outlives a session.
    denied_subjects: Mutex<HashMap<String, String>>,
    /// Transactions (by commit LSN) a batch of which JetStream refused for holding a message
    /// id the stream already has: published one message at a time from then on (B4).
    /// Outlives a session.
    per_message: Mutex<std::collections::HashSet<outbox::Lsn>>,
    /// Fast-ingest batches committed and acknowledged (P14).
    pub fast_batches: AtomicU64,
    /// F4: the newest event a session that failed had put into a fast batch; sessions
    /// publish one message at a time up to it. Outlives a session.
    fast_paused_through: Mutex<Option<Position>>,
    /// P15: the newest event a failed session published; the next sessions publish alone
    /// what lies at or before it (`crate::resume::Doubt`). Outlives a session.
    failed_through: Mutex<Option<Position>>,
    /// F4: why the server refuses fast batches, once it did: the mode is off for the
    /// process's life.
    fast_off: Mutex<Option<String>>,
}

/// An event the acker awaits the answer for: its position, and the row it was (P8, P9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acknowledged {
    /// The event's position.
    pub position: Position,
    /// Its outbox id.
    pub id: EventId,
    /// Its row's `created_at` in milliseconds (the ordering key's first part).
    pub created_at_ms: i64,
}

impl SinkStats {
    /// Counters whose acker also times what it acknowledges (the latency histograms and the
    /// oldest unconfirmed transaction): for a process that exposes metrics.
    pub fn timed() -> Self {
        SinkStats {
            timing: true,
            ..SinkStats::default()
        }
    }

    /// Publishes acknowledged so far: stored, duplicate or dead-lettered.
    pub fn acked(&self) -> u64 {
        self.stored.load(Ordering::Relaxed)
            + self.duplicates.load(Ordering::Relaxed)
            + self.dead_lettered.load(Ordering::Relaxed)
    }

    /// Publishes of the running session awaiting their ack (0 between sessions).
    pub fn in_flight(&self) -> u64 {
        let window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        match &*window {
            Some((semaphore, size)) => semaphore.upgrade().map_or(0, |semaphore| {
                size.saturating_sub(semaphore.available_permits()) as u64
            }),
            None => 0,
        }
    }

    /// The commit time (µs since the Unix epoch) of the oldest transaction with events
    /// that was read but not yet confirmed, when timed (`crate::latency` L3).
    pub fn oldest_unconfirmed_us(&self) -> Option<i64> {
        Some(self.oldest_unconfirmed_us.load(Ordering::Relaxed)).filter(|&us| us != 0)
    }

    /// Forgets the oldest unconfirmed transaction: this process no longer streams the slot
    /// (it lost the lease; whoever holds it now confirms it).
    pub fn forget_unconfirmed(&self) {
        self.oldest_unconfirmed_us.store(0, Ordering::Relaxed);
    }

    fn denied_subjects(&self) -> HashMap<String, String> {
        self.denied_subjects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn per_message(&self) -> std::collections::HashSet<outbox::Lsn> {
        self.per_message
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// F4: why the mode is off, when the server refused fast batches themselves.
    pub fn fast_off(&self) -> Option<String> {
        self.fast_off
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn fast_paused_through(&self) -> Option<Position> {
        *self
            .fast_paused_through
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// F4: a session that batched up to `position` failed.
    fn pause_fast_through(&self, position: Position) {
        raise(&self.fast_paused_through, position);
    }

    /// P15: the newest event a failed session of the process published.
    fn failed_through(&self) -> Option<Position> {
        *self
            .failed_through
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// P15: a session that published up to `position` failed.
    fn fail_through(&self, position: Position) {
        raise(&self.failed_through, position);
    }

    /// F4: the server refused a fast batch itself (`why`): off for the process's life.
    fn turn_fast_off(&self, why: String) {
        let mut off = self.fast_off.lock().unwrap_or_else(PoisonError::into_inner);
        if off.is_none() {
            warn!(reason = %why, "the server refuses fast-ingest batches: publishing one acknowledged message at a time from now on (restart the relay once the stream allows batch publish)");
            *off = Some(why);
        }
    }

    fn dead_letter_instead(&self) -> HashMap<Position, String> {
        self.dead_letter_instead
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Raises the position in `slot` to `position`.
fn raise(slot: &Mutex<Option<Position>>, position: Position) {
    let mut held = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if held.is_none_or(|p| p < position) {
        *held = Some(position);
    }
}

/// P15: what the acker's answers left of the stream, for the publisher.
#[derive(Debug, Default)]
struct Answered {
    /// The stream sequence of the session's newest publish stored as new.
    last_stored: AtomicU64,
    /// Whether the session stored any publish as new.
    any: AtomicBool,
}

impl Answered {
    fn stored(&self, sequence: u64) {
        self.last_stored.store(sequence, Ordering::Release);
        self.any.store(true, Ordering::Release);
    }
}

enum AckItem<P> {
    Begin {
        commit_time_us: i64,
    },
    /// Already in the stream (P6): counts as acknowledged.
    Stored,
    Publish {
        /// The event published (or whose dead-letter record is).
        event: Acknowledged,
        /// A dead-letter record in the event's place (P7).
        dead_letter: bool,
        /// Its number in the session: its reply subject is `{inbox}.{sequence}` (P10).
        sequence: u64,
        /// A fast batch's commit (P14): the number of the batch's first message (its
        /// answers are the batch's, F3) and the stream sequence the commit must be stored
        /// at. `None`: a publish of its own.
        fast: Option<(u64, u64)>,
        /// The subject it was published to (P11), moved here after its frame was written.
        subject: String,
        _permit: OwnedSemaphorePermit,
    },
    /// A message of an atomic batch before its commit (B3): answered by nothing, stored
    /// with the commit.
    Staged {
        event: Acknowledged,
        dead_letter: bool,
        subject: String,
        permit: OwnedSemaphorePermit,
    },
    /// F6: an open fast batch's end-of-batch commit, publish `sequence` of the batch whose
    /// first message is publish `first`: its PubAck, at stream sequence `expect`, is every
    /// staged message's.
    FastEnd {
        sequence: u64,
        first: u64,
        expect: u64,
    },
    Commit(P),
    Idle(P),
}

/// An empty header block: an end-of-batch commit's (F6).
const EMPTY_HEADERS: &[u8] = b"NATS/1.0\r\n\r\n";

/// Publishes `input` on `connection` until it closes or an error occurs, publishing the
/// confirmable position to `watermark` as acks arrive. See the module docs for the
/// invariants.
pub async fn run<P>(
    jetstream: Context,
    connection: Connection,
    options: SinkOptions,
    input: mpsc::Receiver<Vec<Item<P>>>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
) -> Result<(), SinkError>
where
    P: Ord + Copy + Send + Sync + std::fmt::Debug + 'static,
{
    let result = publish(
        jetstream,
        connection,
        options,
        input,
        watermark,
        stats.clone(),
    )
    .await;
    if result
        .as_ref()
        .is_err_and(|error| error.poison_id().is_some())
    {
        stats.poison.fetch_add(1, Ordering::Relaxed);
    }
    result
}

/// [`run`], but for counting a halt on poison: sets up the session (its window, the acker
/// task, the publisher's state), publishes the input, then ends the session
/// ([`Publisher::finish`]).
async fn publish<P>(
    jetstream: Context,
    connection: Connection,
    options: SinkOptions,
    mut input: mpsc::Receiver<Vec<Item<P>>>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
) -> Result<(), SinkError>
where
    P: Ord + Copy + Send + Sync + std::fmt::Debug + 'static,
{
    let (window, window_size) = stats.open_window(options.max_in_flight);
    let (ack_tx, ack_rx) = mpsc::channel::<AckItem<P>>(window_size);
    let start = *watermark.borrow();
    // P10, CN2: the session's own connection, subscribed to `{inbox}.>` before any publish.
    let Connection {
        frames,
        answers,
        max_payload,
        lame_duck,
        server,
        reply_prefix,
        tasks: _tasks,
    } = connection;
    let fast = fast_limit(&options, &stats);
    let limits = session_limits(options.limits, max_payload, &reply_prefix, fast.is_some());
    let acks = Acks::new(answers, &options, server.clone());
    let answered = Arc::new(Answered::default());
    // Aborted with `run`: a dropped sink leaves no task behind (the caller's L1).
    let mut acker = AbortOnDropHandle::new(tokio::spawn(acker(
        ack_rx,
        acks,
        AckTracker::new(start),
        watermark,
        stats.clone(),
        answered.clone(),
        Duplicates::of(&jetstream, &options),
    )));
    let mut publisher = Publisher::new(&options, limits, frames, reply_prefix, &stats, fast);
    publisher.vouching = options
        .compare
        .clone()
        .filter(|_| options.fence.is_some())
        .map(|compare| crate::vouch::Vouching::new(compare, jetstream.clone()));
    publisher.answered = answered;
    let publishing = publisher.publish_input(&mut input, &ack_tx, &window, &lame_duck);
    let published = tokio::select! {
        result = publishing => Ok(result),
        // The acker only ends early on an error; stop publishing at once.
        result = &mut acker => Err(flatten(result)),
    };
    let (last_fast, last_framed) = (publisher.last_fast, publisher.last_framed);
    let result = match published {
        Ok(published) => {
            publisher
                .finish(published, ack_tx, acker, &lame_duck, server)
                .await
        }
        Err(ended) => ended,
    };
    // F4: the next sessions publish what this one batched one message at a time.
    if let (Err(_), Some(position)) = (&result, last_fast) {
        stats.pause_fast_through(position);
    }
    // P15: what this session published may be in the stream without its answer.
    if let (Err(_), Some(position)) = (&result, last_framed) {
        stats.fail_through(position);
    }
    result
}

impl SinkStats {
    /// A session's window of `max_in_flight` permits (P2), registered for
    /// [`SinkStats::in_flight`].
    fn open_window(&self, max_in_flight: usize) -> (Arc<Semaphore>, usize) {
        let size = max_in_flight.max(1);
        let window = Arc::new(Semaphore::new(size));
        *self.window.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((Arc::downgrade(&window), size));
        (window, size)
    }
}

/// The session's limits: `limits` with the account's `max_payload` when the server
/// announced one (P12), and the control line's budget less what a reply subject longer
/// than the budget's takes (P7: a custom inbox prefix; the session's longest reply subject
/// is `{reply_prefix}{u64::MAX}`, or a fast batch's when `fast`, F5).
fn session_limits(
    mut limits: Limits,
    max_payload: usize,
    reply_prefix: &str,
    fast: bool,
) -> Limits {
    if max_payload > 0 {
        limits.max_message_bytes = limits.max_message_bytes.min(max_payload);
    }
    let numbered = u64::MAX.to_string().len();
    let longest = match fast {
        true => numbered.max(batch::FastReply::max_len(batch::token(reply_prefix).len())),
        false => numbered,
    };
    let reply_len = reply_prefix.len() + longest;
    limits.max_control_line = limits
        .max_control_line
        .saturating_sub(reply_len.saturating_sub(crate::REPLY_SUBJECT_LEN));
    limits
}

/// P14: the session's fast batch limit, if it publishes fast batches: asked for, in strict
/// mode, not atomic, not turned off (F4); at most half the window (F1).
fn fast_limit(options: &SinkOptions, stats: &SinkStats) -> Option<usize> {
    let limit = options
        .fast
        .filter(|_| options.fence.is_some() && options.atomic.is_none())?;
    if stats.fast_off().is_some() {
        return None;
    }
    Some(
        limit
            .min(batch::FAST_BATCH_LIMIT)
            .min(options.max_in_flight / 2)
            .max(1),
    )
}

/// The publisher's state for one session: what it checks events against, the fence, the
/// frames not yet handed to the writer and the publishes' numbers (P10).
struct Publisher<'s, P> {
    options: &'s SinkOptions,
    stats: &'s SinkStats,
    limits: Limits,
    fence: Option<Fence>,
    /// P8: events an earlier session found to reuse another event's id.
    dead_letter_instead: HashMap<Position, String>,
    /// P11: subjects an earlier session was denied.
    denied_subjects: HashMap<String, String>,
    /// The commit LSN's text, formatted once per transaction (none yet: a backfilled row's
    /// commit LSN is 0/0 too).
    commit_lsn: (Option<outbox::Lsn>, String),
    /// Frames not yet handed to the writer.
    out: Frames,
    /// One message's header block.
    block: BytesMut,
    /// The newest publish's number in the session (P10).
    sequence: u64,
    reply_prefix: String,
    /// P13: the session's atomic batches, in strict mode with [`SinkOptions::atomic`];
    /// P14: its fast batches instead, when `fast`.
    batches: Option<Batches<(OutboxEvent, OwnedSemaphorePermit)>>,
    /// B4: transactions to publish one message at a time.
    per_message: std::collections::HashSet<outbox::Lsn>,
    /// P14: the batches are fast-ingest ones.
    fast: Option<Fast<P>>,
    /// F4: the newest event this session put into a fast batch.
    last_fast: Option<Position>,
    /// P15: the newest event this session published.
    last_framed: Option<Position>,
    /// P6: the comparison of replayed events with the stream, in strict mode.
    vouching: Option<crate::vouch::Vouching>,
    /// P15: which events may be in the stream already.
    doubt: Doubt,
    /// P15: the newest publish was in doubt: the next one waits for its answer.
    settling: bool,
    /// P15: what the acker's answers left of the stream.
    answered: Arc<Answered>,
    /// P2: the window's size.
    window_size: usize,
}

/// A session's fast-ingest state (P14).
struct Fast<P> {
    /// F4: events up to this one are published one message at a time.
    paused_through: Option<Position>,
    /// The session number of the open batch's first message (F5).
    first: u64,
    /// The flow the reply subjects ask for.
    flow: u64,
    /// F1: the items after the held-back event, handed to the acker after it.
    deferred: Vec<AckItem<P>>,
    /// One reply subject.
    reply: BytesMut,
    /// The session's batch token (F5), taken from the reply prefix once.
    token: String,
    /// F6: while a batch is open, the sequence in it of its newest message sent and the
    /// subject of its first.
    open: Option<(u64, String)>,
}

impl<P> Fast<P> {
    /// Writes the reply subject of message `sequence` of the open batch (F5; its commit,
    /// an end-of-batch one, F6) into `reply`, after the session's `prefix`.
    fn write_reply(&mut self, prefix: &str, sequence: u64, commit: bool, end_of_batch: bool) {
        self.reply.clear();
        self.reply.extend_from_slice(prefix.as_bytes());
        batch::FastReply {
            token: &self.token,
            first: self.first,
            flow: self.flow,
            sequence,
            commit,
            end_of_batch,
        }
        .write(&mut self.reply);
    }
}

impl<'s, P> Publisher<'s, P> {
    fn new(
        options: &'s SinkOptions,
        limits: Limits,
        frames: mpsc::Sender<Bytes>,
        reply_prefix: String,
        stats: &'s SinkStats,
        fast: Option<usize>,
    ) -> Self {
        let atomic = options.atomic.filter(|_| options.fence.is_some());
        Publisher {
            options,
            stats,
            limits,
            fence: options
                .fence
                .map(|sequence| Fence::at(sequence).chained(options.id_chain)),
            dead_letter_instead: stats.dead_letter_instead(),
            denied_subjects: stats.denied_subjects(),
            commit_lsn: (None, String::new()),
            out: Frames {
                buffer: BytesMut::with_capacity(FLUSH_BYTES * 2),
                frames,
                timeout: options.ack_timeout,
                last_id: EventId::Int(0),
            },
            block: BytesMut::with_capacity(1024),
            sequence: 0,
            batches: atomic
                .map(|limit| limit.min(options.max_in_flight))
                .or(fast)
                .map(|limit| Batches::new(limit, batch::token(&reply_prefix))),
            per_message: stats.per_message(),
            fast: fast.map(|limit| Fast {
                paused_through: stats.fast_paused_through(),
                first: 0,
                flow: limit.min(usize::from(u16::MAX)) as u64,
                deferred: Vec::new(),
                reply: BytesMut::with_capacity(128),
                token: batch::token(&reply_prefix).to_owned(),
                open: None,
            }),
            last_fast: None,
            last_framed: None,
            reply_prefix,
            vouching: None,
            doubt: Doubt::at_start(
                options.fence,
                options.compare.as_ref().map(|c| c.through),
                stats.failed_through(),
            ),
            settling: false,
            answered: Arc::default(),
            window_size: options.max_in_flight.max(1),
        }
    }

    /// Publishes the input's batches, handing each item to the acker in order, until the
    /// input closes, the server goes into lame-duck mode (P12) or the acker stops (then its
    /// result says why). Frames are handed to the writer after each batch, every
    /// [`FLUSH_BYTES`] and before any wait. F1: a fast batch is committed when the input
    /// has nothing more ready, and when the session stops taking input.
    async fn publish_input(
        &mut self,
        input: &mut mpsc::Receiver<Vec<Item<P>>>,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
        lame_duck: &AtomicBool,
    ) -> Result<(), SinkError> {
        while let Some(batch) = input.recv().await {
            // P12: a server in lame-duck mode takes nothing more; what is in flight is
            // acknowledged (the batch is taken again by the next session).
            if lame_duck.load(Ordering::Relaxed) {
                break;
            }
            for item in batch {
                if !self.publish_item(item, ack_tx, window).await? {
                    return Ok(());
                }
            }
            if self.fast.is_some() && input.is_empty() && !self.close_batch(ack_tx).await? {
                return Ok(());
            }
            self.out.flush().await?;
        }
        if self.fast.is_some() {
            self.close_batch(ack_tx).await?;
        }
        Ok(())
    }

    /// Publishes one input item (P13: into the open batch, or closing it first) and hands
    /// what it makes to the acker; `false` when the acker stopped.
    async fn publish_item(
        &mut self,
        item: Item<P>,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if let Item::Event(event) = &item {
            // P6: already stored.
            if self.vouched(event).await {
                if !self.close_batch(ack_tx).await? {
                    return Ok(false);
                }
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                return self.hand(ack_tx, AckItem::Stored).await;
            }
            // P15: alone, once every earlier answer is in; and the first publish after one
            // in doubt too, so that its fence counts only what the stream stored.
            if (self.settling || self.in_doubt(event)) && !self.settle(ack_tx, window).await? {
                return Ok(false);
            }
            self.settling = self.in_doubt(event);
        }
        let item = match item {
            Item::Event(event) if self.batched(&event) => {
                return self.publish_batched(event, ack_tx, window).await;
            }
            Item::Event(event) => Item::Event(event),
            // F1: a fast batch goes on across transactions; what comes between two of its
            // events reaches the acker after the event before it.
            marker if self.batch_open() && self.fast.is_some() => {
                if let Some(fast) = self.fast.as_mut() {
                    fast.deferred.push(marker_item(marker));
                }
                return Ok(true);
            }
            marker => marker,
        };
        // B1: anything but the next event of the open batch ends it.
        if !self.close_batch(ack_tx).await? {
            return Ok(false);
        }
        let item = match item {
            Item::Event(event) => {
                let Some(permit) = self.permit(window).await? else {
                    return Ok(false);
                };
                self.frame(event, permit, None, false)?
            }
            marker => marker_item(marker),
        };
        self.hand(ack_tx, item).await
    }

    /// Publishes an event into the open batch (P13, P14), committing the batch first when
    /// it is full or, for a fast one, when the window has no room (F1); `false` when the
    /// acker stopped.
    async fn publish_batched(
        &mut self,
        event: OutboxEvent,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if self.fast.is_some() {
            self.last_fast = Some(event.position);
        }
        // A batch full at the limit commits before its next event waits for room.
        if let Some(((held, permit), batch)) = self.batches.as_mut().and_then(Batches::full) {
            let publish = self.frame(held, permit, batch, false)?;
            if !self.hand_held(ack_tx, publish).await? {
                return Ok(false);
            }
        }
        // F1: a fast batch commits before its next event waits for room, so that every
        // event holding a permit is published (its held-back one too).
        if self.fast.is_some()
            && window.available_permits() == 0
            && !self.close_batch(ack_tx).await?
        {
            return Ok(false);
        }
        let Some(permit) = self.permit(window).await? else {
            return Ok(false);
        };
        let staged = self.batches.as_mut().and_then(|b| b.event((event, permit)));
        if let Some(((event, permit), batch)) = staged {
            let publish = self.frame(event, permit, batch, false)?;
            if !self.hand_held(ack_tx, publish).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether a batch is open (an event is held back).
    #[inline]
    fn batch_open(&self) -> bool {
        self.batches.as_ref().is_some_and(Batches::is_open)
    }

    /// Commits the open batch, if any: frames its held-back event as its commit (B7: the
    /// transaction's end, for an atomic one) and hands it to the acker; `false` when the
    /// acker stopped.
    async fn close_batch(&mut self, ack_tx: &mpsc::Sender<AckItem<P>>) -> Result<bool, SinkError> {
        let Some(((event, permit), batch)) = self.batches.as_mut().and_then(Batches::close) else {
            return Ok(true);
        };
        let tx_end = self.fast.is_none();
        let publish = self.frame(event, permit, batch, tx_end)?;
        self.hand_held(ack_tx, publish).await
    }

    /// Hands a batch's event to the acker, then what waited for it (F1).
    async fn hand_held(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        publish: AckItem<P>,
    ) -> Result<bool, SinkError> {
        if !self.hand(ack_tx, publish).await? {
            return Ok(false);
        }
        let deferred = match self.fast.as_mut() {
            Some(fast) if !fast.deferred.is_empty() => std::mem::take(&mut fast.deferred),
            _ => return Ok(true),
        };
        for item in deferred {
            if !self.hand(ack_tx, item).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A permit of the window (P2): at once when there is room, else once a publish is
    /// acknowledged ([`Publisher::wait_for_room`]).
    #[inline]
    async fn permit(
        &mut self,
        window: &Arc<Semaphore>,
    ) -> Result<Option<OwnedSemaphorePermit>, SinkError> {
        match window.clone().try_acquire_owned() {
            Ok(permit) => Ok(Some(permit)),
            Err(_) => self.wait_for_room(window).await,
        }
    }

    /// Hands `item` to the acker (after a publish, the frames to the writer once they fill
    /// [`FLUSH_BYTES`]); `false` when the acker stopped (its result says why).
    #[inline]
    async fn hand(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        item: AckItem<P>,
    ) -> Result<bool, SinkError> {
        if self.out.buffer.len() >= FLUSH_BYTES {
            self.out.flush().await?;
        }
        match ack_tx.try_send(item) {
            Ok(()) => Ok(true),
            Err(mpsc::error::TrySendError::Full(item)) => self.wait_for_acker(ack_tx, item).await,
            Err(mpsc::error::TrySendError::Closed(_)) => Ok(false),
        }
    }

    /// P13, P14: whether `event` goes into a batch (not one the stream may hold already,
    /// P15; not of a transaction to publish one message at a time, B4; not at or before where
    /// a failed fast session got to, F4).
    #[inline]
    fn batched(&self, event: &OutboxEvent) -> bool {
        if self.batches.is_none() || self.in_doubt(event) {
            return false;
        }
        match &self.fast {
            Some(fast) => fast
                .paused_through
                .is_none_or(|paused| event.position > paused),
            None => {
                self.per_message.is_empty()
                    || !self.per_message.contains(&event.position.commit_lsn)
            }
        }
    }

    /// P6: whether the stream holds `event` at its place (`crate::resume` S4).
    #[inline]
    async fn vouched(&mut self, event: &OutboxEvent) -> bool {
        let Some(vouching) = &mut self.vouching else {
            return false;
        };
        let holds = vouching.holds(event).await;
        if vouching.ended() {
            self.vouching = None;
        }
        holds
    }

    /// P15: whether the stream may hold `event` already.
    #[inline]
    fn in_doubt(&self, event: &OutboxEvent) -> bool {
        self.doubt.covers(event.position)
    }

    /// P15: awaits every earlier answer (the frames handed to the writer, the whole window
    /// back), then sets the fence to the stream's last sequence as the answers left it (a
    /// duplicate consumes none), the id chain started again; once the session stored a
    /// publish as new, nothing is in doubt any more. `false` when the acker stopped.
    async fn settle(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if !self.close_batch(ack_tx).await? {
            return Ok(false);
        }
        self.out.flush().await?;
        let size = u32::try_from(self.window_size).unwrap_or(u32::MAX);
        let Ok(all) = window.acquire_many(size).await else {
            return Ok(false);
        };
        drop(all);
        if ack_tx.is_closed() {
            return Ok(false);
        }
        let Some(fence) = self.fence.as_mut() else {
            return Ok(true);
        };
        let stored = self
            .answered
            .any
            .load(Ordering::Acquire)
            .then(|| self.answered.last_stored.load(Ordering::Acquire));
        let start = self.options.fence.unwrap_or(0);
        let settled = self.doubt.settle(start, fence.sequence, stored);
        self.doubt = settled.doubt;
        if let Some(sequence) = settled.fence {
            fence.sequence = sequence;
            fence.last_msg_id = None;
        }
        Ok(true)
    }

    /// P2: a permit of the full window, once a publish is acknowledged; `None` never (the
    /// semaphore is never closed). Nothing waits on a frame still in `out`: they are handed
    /// to the writer first.
    async fn wait_for_room(
        &mut self,
        window: &Arc<Semaphore>,
    ) -> Result<Option<OwnedSemaphorePermit>, SinkError> {
        self.out.flush().await?;
        Ok(window.clone().acquire_owned().await.ok())
    }

    /// Hands `item` to the acker, whose queue is full; `false` when the acker stopped. The
    /// acker may be awaiting a frame still in `out`: they are handed to the writer first.
    async fn wait_for_acker(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        item: AckItem<P>,
    ) -> Result<bool, SinkError> {
        self.out.flush().await?;
        Ok(ack_tx.send(item).await.is_ok())
    }

    /// Writes `event`'s frame (or its dead-letter record's, P7, P8, P11) into `out` as the
    /// session's next publish, holding a permit of the window (P2), as a message of `batch`
    /// when given (P13: only a batch's commit has a reply subject, B3; P14: every message of
    /// a fast batch has one, F5), marked as its transaction's last event when `tx_end` (B7).
    #[inline]
    fn frame(
        &mut self,
        event: OutboxEvent,
        permit: OwnedSemaphorePermit,
        batch: Option<Batch>,
        tx_end: bool,
    ) -> Result<AckItem<P>, SinkError> {
        // P14: a fast batch's place goes into the reply subject, not the headers.
        let (batch, fast) = match (&self.fast, batch) {
            (Some(_), Some(batch)) => (None, Some((batch.sequence, batch.commit))),
            (_, batch) => (batch, None),
        };
        let replied = batch.as_ref().is_none_or(|batch| batch.commit);
        if let Some(fence) = self.fence.as_mut() {
            fence.batch = batch;
            fence.tx_end = tx_end;
            fence.fast = fast.map(|(sequence, _)| sequence);
        }
        let (id, position, created_at_ms) = (event.id.clone(), event.position, event.created_at_ms);
        self.last_framed = Some(position);
        if self.commit_lsn.0 != Some(position.commit_lsn) {
            self.commit_lsn = (Some(position.commit_lsn), position.commit_lsn.to_string());
        }
        // An empty map answers without hashing.
        let instead = match self.dead_letter_instead.get(&position) {
            Some(reason) => Some((PoisonKind::ReusedId, reason.as_str())),
            None => self
                .denied_subjects
                .get(&event.subject)
                .map(|why| (PoisonKind::Denied, why.as_str())),
        };
        let (subject, payload, dead_letter) = prepare(
            event,
            &self.commit_lsn.1,
            self.options,
            self.limits,
            &mut self.fence,
            instead,
            &mut self.block,
        )?;
        let event = Acknowledged {
            position,
            id,
            created_at_ms,
        };
        if let Some((sequence, commit)) = fast {
            return Ok(self.frame_fast(
                event,
                subject,
                &payload,
                dead_letter,
                permit,
                sequence,
                commit,
            ));
        }
        if !replied {
            self.out
                .push(&event.id, &subject, None, &self.block, &payload);
            return Ok(AckItem::Staged {
                event,
                dead_letter,
                subject,
                permit,
            });
        }
        self.sequence += 1;
        let sequence = self.sequence;
        self.out.push(
            &event.id,
            &subject,
            Some((&self.reply_prefix, sequence)),
            &self.block,
            &payload,
        );
        Ok(AckItem::Publish {
            event,
            dead_letter,
            sequence,
            fast: None,
            subject,
            _permit: permit,
        })
    }

    /// [`Publisher::frame`]'s end for a message of a fast batch (F1–F6): its reply subject
    /// names the batch and its place; the commit is awaited with the stream sequence the
    /// fence predicts for it (F3), the others are staged.
    #[allow(clippy::too_many_arguments)]
    fn frame_fast(
        &mut self,
        event: Acknowledged,
        subject: String,
        payload: &[u8],
        dead_letter: bool,
        permit: OwnedSemaphorePermit,
        sequence_in_batch: u64,
        commit: bool,
    ) -> AckItem<P> {
        self.sequence += 1;
        let sequence = self.sequence;
        let Some(fast) = self.fast.as_mut() else {
            unreachable!("frame_fast is called in fast mode only");
        };
        if sequence_in_batch == 1 {
            fast.first = sequence;
        }
        fast.write_reply(&self.reply_prefix, sequence_in_batch, commit, false);
        match (&mut fast.open, commit) {
            (_, true) => fast.open = None,
            (None, false) => fast.open = Some((sequence_in_batch, subject.clone())),
            (Some(open), false) => open.0 = sequence_in_batch,
        }
        self.out
            .push_reply(&event.id, &subject, &fast.reply, &self.block, payload);
        if !commit {
            return AckItem::Staged {
                event,
                dead_letter,
                subject,
                permit,
            };
        }
        // After `prepare`, the fence's sequence is this message's own.
        let expect = self.fence.as_ref().map_or(0, |fence| fence.sequence);
        AckItem::Publish {
            event,
            dead_letter,
            sequence,
            fast: Some((fast.first, expect)),
            subject,
            _permit: permit,
        }
    }

    /// F6: ends the open fast batch, if any, with an end-of-batch commit (a message the
    /// server does not store) to the subject of its first message, and hands its awaited
    /// PubAck to the acker.
    async fn end_fast_batch(&mut self, ack_tx: &mpsc::Sender<AckItem<P>>) -> Result<(), SinkError> {
        let Some(fast) = self.fast.as_mut() else {
            return Ok(());
        };
        let Some((newest, subject)) = fast.open.take() else {
            return Ok(());
        };
        self.sequence += 1;
        fast.write_reply(&self.reply_prefix, newest + 1, true, true);
        let id = self.out.last_id.clone();
        self.out
            .push_reply(&id, &subject, &fast.reply, EMPTY_HEADERS, b"");
        let item = AckItem::FastEnd {
            sequence: self.sequence,
            first: fast.first,
            // The fence's sequence is the newest message's own.
            expect: self.fence.as_ref().map_or(0, |fence| fence.sequence),
        };
        self.hand(ack_tx, item).await.map(drop)
    }

    /// The session's end once the input is published (`published`) or failed: P4, the acker
    /// drains what is in flight (its queue, `ack_tx`, closed); P12, lame-duck mode ends the
    /// session after that.
    async fn finish(
        mut self,
        published: Result<(), SinkError>,
        ack_tx: mpsc::Sender<AckItem<P>>,
        acker: AbortOnDropHandle<Result<(), SinkError>>,
        lame_duck: &AtomicBool,
        server: String,
    ) -> Result<(), SinkError> {
        match published {
            Ok(()) => {
                drop(ack_tx);
                flatten(acker.await).and_then(|()| match lame_duck.load(Ordering::Relaxed) {
                    // P12: everything published is acknowledged; the rest is the next session's.
                    true => Err(SinkError::LameDuck { server }),
                    false => Ok(()),
                })
            }
            // P7 halt stops *at* the poison event: the publishes before it are awaited
            // (stored, and confirmed as far as whole transactions go) before the error ends
            // the run, an open fast batch ended for that (F6). Aborting the acker here would
            // drop them unflushed, and a relay halting on every restart would never deliver
            // the events before the poison one.
            Err(error) if error.poison_id().is_some() => {
                let ended = self.end_fast_batch(&ack_tx).await;
                drop(ack_tx);
                let flushed = self.out.flush().await;
                flatten(acker.await).and(ended).and(flushed).and(Err(error))
            }
            Err(error) => {
                acker.abort();
                Err(error)
            }
        }
    }
}

/// The acker's item for an input item that is not an event.
fn marker_item<P>(item: Item<P>) -> AckItem<P> {
    match item {
        Item::Begin { commit_time_us } => AckItem::Begin { commit_time_us },
        Item::Commit(p) => AckItem::Commit(p),
        Item::Idle(p) => AckItem::Idle(p),
        Item::Event(_) => unreachable!("events are published, not marked"),
    }
}

/// Why a session's publishing connection failed, when it did not say.
const CONNECTION_CLOSED: &str = "the connection is closed";

/// Bytes of frames the publisher gathers before handing them to the writer, unless it
/// would wait first (then it hands them over at once).
const FLUSH_BYTES: usize = 64 * 1024;

/// The publisher's frames not yet handed to the connection's writer (M4).
struct Frames {
    buffer: BytesMut,
    frames: mpsc::Sender<Bytes>,
    timeout: Duration,
    /// The newest event in `buffer`, to name in an error.
    last_id: EventId,
}

impl Frames {
    /// Appends one `HPUB` frame: its line (with the reply subject `{prefix}{sequence}`, if
    /// any), the header block, the payload.
    fn push(
        &mut self,
        id: &EventId,
        subject: &str,
        reply: Option<(&str, u64)>,
        block: &[u8],
        payload: &[u8],
    ) {
        wire::hpub_line_to(&mut self.buffer, subject, reply, block.len(), payload.len());
        self.body(id, block, payload);
    }

    /// [`Frames::push`] with a reply subject written whole (a fast batch's, F5).
    fn push_reply(
        &mut self,
        id: &EventId,
        subject: &str,
        reply: &[u8],
        block: &[u8],
        payload: &[u8],
    ) {
        wire::hpub_line_reply(&mut self.buffer, subject, reply, block.len(), payload.len());
        self.body(id, block, payload);
    }

    /// A frame's header block, payload and end, after its line.
    #[inline]
    fn body(&mut self, id: &EventId, block: &[u8], payload: &[u8]) {
        self.buffer.extend_from_slice(block);
        self.buffer.extend_from_slice(payload);
        self.buffer.extend_from_slice(b"\r\n");
        self.last_id.clone_from(id);
    }

    /// Hands the frames to the writer. Its queue takes them at once unless it is full (the
    /// connection is behind): only then is a timer armed, bounded by the ack timeout.
    async fn flush(&mut self) -> Result<(), SinkError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = self.buffer.split().freeze();
        let id = &self.last_id;
        let closed = || SinkError::Closed {
            id: id.clone(),
            why: CONNECTION_CLOSED.into(),
        };
        match self.frames.try_send(chunk) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(closed()),
            Err(mpsc::error::TrySendError::Full(chunk)) => {
                match tokio::time::timeout(self.timeout, self.frames.send(chunk)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(_)) => Err(closed()),
                    Err(_) => Err(SinkError::Publish {
                        id: id.clone(),
                        source: PublishError::new(PublishErrorKind::TimedOut),
                    }),
                }
            }
        }
    }
}

/// The acker's side of P10: the connection's answers and what it holds back.
#[derive(Debug)]
struct Acks {
    answers: mpsc::Receiver<Answer>,
    /// `max_in_flight`: an answer for a sequence this far or further ahead of the oldest
    /// unacknowledged publish answers nothing in flight.
    window: u64,
    timeout: Duration,
    /// The oldest unacknowledged publish's deadline, armed when the acker starts waiting
    /// for its answer.
    deadline: Pin<Box<Sleep>>,
    /// Answers that came before an older publish's (not expected from one stream, which
    /// answers in order; kept, never dropped, should a server do otherwise).
    early: BTreeMap<u64, Result<Acked, PublishError>>,
    /// The newest publish whose answer the acker awaited (0: none yet); answers read while
    /// it awaits none are for publishes after it.
    awaited: u64,
    /// Why the connection closed, once it did (CN3).
    closed: Option<String>,
    /// Subjects the server denied a publish to in this session, with its words (P11).
    denied: Vec<(String, String)>,
    /// Set once the server announced lame-duck mode (P12).
    lame_duck: Option<()>,
    /// The server, `host:port`.
    server: String,
}

impl Acks {
    /// The acker's side of a session's connection, `answers`, awaiting nothing yet.
    fn new(answers: mpsc::Receiver<Answer>, options: &SinkOptions, server: String) -> Self {
        Acks {
            answers,
            window: options.max_in_flight.max(1) as u64,
            timeout: options.ack_timeout,
            deadline: Box::pin(tokio::time::sleep(options.ack_timeout)),
            early: BTreeMap::new(),
            awaited: 0,
            closed: None,
            denied: Vec::new(),
            lame_duck: None,
            server,
        }
    }

    /// The answer to publish `sequence` (outbox row `id`, to `subject`), the oldest
    /// unacknowledged one (P10); `Ok(Err(why))` when the server denied it (P11). A fast
    /// batch's commit (P14) is answered by the first answer to any publish of its batch,
    /// `first` to `sequence` (F3): one before the commit's ends the batch early, an error.
    async fn next(
        &mut self,
        first: u64,
        sequence: u64,
        id: &EventId,
        subject: &str,
    ) -> Result<Result<Acked, String>, SinkError> {
        self.awaited = sequence;
        let answered = |answer_to: u64, ack: Result<Acked, PublishError>| {
            let ack = match ack {
                Ok(ack) if answer_to != sequence => Err(ended_early(answer_to - first + 1, &ack)),
                ack => ack,
            };
            ack.map(Ok).map_err(|source| SinkError::Ack {
                id: id.clone(),
                source,
            })
        };
        if !self.early.is_empty() {
            // Answers to publishes before this batch answer nothing awaited.
            self.early = self.early.split_off(&first);
            if let Some((&answer_to, _)) = self.early.range(first..=sequence).next() {
                if let Some(answer) = self.early.remove(&answer_to) {
                    return answered(answer_to, answer);
                }
            }
        }
        let mut armed = false;
        loop {
            if let Some(why) = &self.closed {
                return Err(SinkError::Closed {
                    id: id.clone(),
                    why: why.clone(),
                });
            }
            let polled = std::future::poll_fn(|cx| Poll::Ready(self.answers.poll_recv(cx))).await;
            let answer = match polled {
                Poll::Ready(answer) => answer,
                // P11: every answer read is honoured; none is for this publish, to a subject
                // the server denies: it was dropped.
                Poll::Pending if !self.denied.is_empty() => {
                    if let Some((_, why)) = self.denied.iter().find(|(s, _)| s == subject) {
                        return Ok(Err(why.clone()));
                    }
                    self.wait(&mut armed, id).await?
                }
                Poll::Pending => self.wait(&mut armed, id).await?,
            };
            let Some((answer_to, ack)) = self.note(answer) else {
                continue;
            };
            if (first..=sequence).contains(&answer_to) {
                return answered(answer_to, ack);
            }
            self.keep_early(sequence, answer_to, ack);
        }
    }

    /// What the connection said (`None`: it is gone), kept for the session (a denied
    /// subject, P11; lame-duck mode, P12; why it closed, CN3), or, for an ack, the publish
    /// it answers and the ack.
    #[inline]
    fn note(&mut self, answer: Option<Answer>) -> Option<(u64, Result<Acked, PublishError>)> {
        match answer {
            Some(Answer::Ack { sequence, ack }) => return Some((sequence, ack)),
            Some(Answer::Denied { subject, why }) => self.denied.push((subject, why)),
            Some(Answer::LameDuck) => self.lame_duck = Some(()),
            Some(Answer::Closed(why)) => self.closed = Some(why),
            None => self.closed = Some(CONNECTION_CLOSED.into()),
        }
        None
    }

    /// Waits for the next answer, arming the oldest publish's deadline first (P10).
    async fn wait(&mut self, armed: &mut bool, id: &EventId) -> Result<Option<Answer>, SinkError> {
        if !*armed {
            self.deadline.as_mut().reset(Instant::now() + self.timeout);
            *armed = true;
        }
        tokio::select! {
            biased;
            answer = self.answers.recv() => Ok(answer),
            () = self.deadline.as_mut() => Err(SinkError::Ack {
                id: id.clone(),
                source: PublishError::new(PublishErrorKind::TimedOut),
            }),
        }
    }

    /// Keeps an answer to a publish in flight (`oldest`, the oldest unacknowledged one, and
    /// the window after it) for its turn and ignores any other: no publish of this session
    /// awaits it.
    fn keep_early(&mut self, oldest: u64, answer_to: u64, ack: Result<Acked, PublishError>) {
        if answer_to >= oldest && answer_to - oldest < self.window {
            // The first answer counts (a fast batch's message can be answered twice: a
            // refusal, then the batch's PubAck, F3).
            self.early.entry(answer_to).or_insert(ack);
        } else {
            debug!(
                oldest,
                answered = answer_to,
                "ignoring an answer no publish of this session awaits"
            );
        }
    }

    /// Reads the connection while the acker awaits no answer, keeping what comes early for
    /// the publishes after [`Acks::awaited`], until the connection closes (CN3) or the server
    /// goes into lame-duck mode (P12; nothing is in flight): returns the session's end.
    /// Cancel-safe: an answer is kept as soon as it is read.
    async fn closed(&mut self) -> SinkError {
        loop {
            if self.lame_duck.is_some() {
                return SinkError::LameDuck {
                    server: self.server.clone(),
                };
            }
            if let Some(why) = &self.closed {
                return SinkError::Disconnected(why.clone());
            }
            let answer = self.answers.recv().await;
            if let Some((sequence, ack)) = self.note(answer) {
                // Every publish up to `awaited` is answered: the oldest in flight, if any,
                // is the next one.
                self.keep_early(self.awaited + 1, sequence, ack);
            }
        }
    }
}

/// F3: a fast batch counts only when its commit (`fast`: the batch's first publish and the
/// stream sequence the fence predicts) is stored where the fence predicts; F4: a server
/// that refuses fast batches themselves turns the mode off.
fn fast_checked(
    answer: Result<Result<Acked, String>, SinkError>,
    fast: Option<(u64, u64)>,
    id: &EventId,
    stats: &SinkStats,
) -> Result<Result<Acked, String>, SinkError> {
    let Some((_, expect)) = fast else {
        return answer;
    };
    let answer = match answer {
        Ok(Ok(ack)) if ack.duplicate || ack.sequence != expect => Err(SinkError::Ack {
            id: id.clone(),
            source: PublishError::with_source(
                PublishErrorKind::Other,
                format!(
                    "the fast batch's commit was stored at stream sequence {}{}, not {expect}: a message of the batch was already in the stream or not stored",
                    ack.sequence,
                    if ack.duplicate { " as a duplicate" } else { "" }
                ),
            ),
        }),
        answer => answer,
    };
    if let Err(error) = &answer {
        if error
            .jetstream_code()
            .is_some_and(|code| batch::FAST_REFUSED.contains(&code))
        {
            stats.turn_fast_off(error.to_string());
        }
    }
    answer
}

/// F3: a fast batch answered by a PubAck before its commit, on its message `place`: the
/// batch ended there (a message refused, missing or a duplicate).
fn ended_early(place: u64, ack: &Acked) -> PublishError {
    PublishError::with_source(
        PublishErrorKind::Other,
        format!(
            "the fast batch ended at its message {place} (stream sequence {}{}), before its commit: a message of it was refused, lost or already in the stream",
            ack.sequence,
            if ack.duplicate { ", a duplicate" } else { "" }
        ),
    )
}

/// Writes `event`'s header block into `block` (the event's own, or its dead-letter record's
/// when it is beyond the limits or `instead` gives a reason to (P7, P8; then `true`)),
/// fenced in strict mode (P5), and returns the subject and payload to publish it with.
/// `commit_lsn` is the event's commit LSN, formatted once per transaction by the caller.
fn prepare(
    event: OutboxEvent,
    commit_lsn: &str,
    options: &SinkOptions,
    limits: Limits,
    fence: &mut Option<Fence>,
    instead: Option<(PoisonKind, &str)>,
    block: &mut BytesMut,
) -> Result<(String, Bytes, bool), SinkError> {
    let source = options.source.as_str();
    let hostile = event.is_hostile();
    block.clear();
    let problem = match instead {
        Some((kind, reason)) => Err((kind, reason.to_owned())),
        None => event_block(
            block,
            &event,
            hostile,
            commit_lsn,
            source,
            fence.as_ref(),
            limits,
        ),
    };
    let (subject, payload, msg_id, dead_letter) = match problem {
        Ok(msg_id) => (event.subject, event.payload, msg_id, false),
        Err((kind, reason)) if options.poison == PoisonPolicy::Halt => {
            return Err(SinkError::Poison {
                id: event.id.clone(),
                kind,
                reason,
            })
        }
        Err((_, reason)) => {
            let (payload, msg_id) = dead_letter_block(
                block,
                &event,
                hostile,
                &reason,
                options,
                fence.as_ref(),
                limits,
            )?;
            (options.dead_letter_subject.clone(), payload, msg_id, true)
        }
    };
    if let Some(fence) = fence.as_mut() {
        fence.advance(block.get(msg_id).unwrap_or_default());
    }
    Ok((subject, payload, dead_letter))
}

/// Writes `event`'s own header block into `block` (empty) and returns where its
/// `Nats-Msg-Id` is, or why the event cannot be published as is (P7): a payload that is not
/// UTF-8, or a message beyond the limits.
#[inline]
fn event_block(
    block: &mut BytesMut,
    event: &OutboxEvent,
    hostile: bool,
    commit_lsn: &str,
    source: &str,
    fence: Option<&Fence>,
    limits: Limits,
) -> Result<std::ops::Range<usize>, (PoisonKind, String)> {
    // P7: published as is, a text payload must be what consumers can decode (a SQL_ASCII
    // database stores any bytes); a bytea's bytes are published as they are.
    let text = if event.binary {
        Ok("")
    } else {
        std::str::from_utf8(&event.payload)
    };
    if let Err(error) = text {
        return Err((
            PoisonKind::NotUtf8,
            format!(
                "its payload is not valid UTF-8 (from byte {}), so no consumer could decode it",
                error.valid_up_to()
            ),
        ));
    }
    let msg_id = write_event_block(block, event, hostile, commit_lsn, Some(source), fence);
    // M2: the size checked is the size of what is sent.
    limits
        .check(
            block.len() + event.payload.len(),
            event.payload.len(),
            event.subject.len(),
        )
        .map(|()| msg_id)
        .map_err(|(excess, reason)| (PoisonKind::from(excess), reason))
}

/// P7 under [`PoisonPolicy::DeadLetter`]: writes the header block of the dead-letter record
/// in `event`'s place (for `reason`) into `block`, cut to what fits (M3), and returns its
/// payload and where its `Nats-Msg-Id` is; poison when even the record cannot fit.
fn dead_letter_block(
    block: &mut BytesMut,
    event: &OutboxEvent,
    hostile: bool,
    reason: &str,
    options: &SinkOptions,
    fence: Option<&Fence>,
    limits: Limits,
) -> Result<(Bytes, std::ops::Range<usize>), SinkError> {
    let subject = options.dead_letter_subject.as_str();
    let (map, payload, cut) = fit_dead_letter(
        event,
        hostile,
        reason,
        &options.source,
        subject,
        fence,
        limits,
    )
    .map_err(|why| SinkError::Poison {
        id: event.id.clone(),
        kind: PoisonKind::DeadLetterTooLarge,
        reason: format!("{reason}; {why}"),
    })?;
    warn!(outbox_id = %event.id, reason = %reason, ?cut, "publishing a dead-letter record in place of the event");
    block.clear();
    Ok((payload, write_map_block(block, &map, fence)))
}

fn flatten(result: Result<Result<(), SinkError>, tokio::task::JoinError>) -> Result<(), SinkError> {
    match result {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Ok(()),
    }
}

async fn acker<P: Ord + Copy + std::fmt::Debug>(
    items: mpsc::Receiver<AckItem<P>>,
    acks: Acks,
    tracker: AckTracker<P>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
    answered: Arc<Answered>,
    duplicates: Duplicates,
) -> Result<(), SinkError> {
    let clock = stats.timing.then(|| {
        TxnClock::new(
            &stats.commit_to_ack,
            &stats.created_to_ack,
            &stats.oldest_unconfirmed_us,
        )
    });
    let acker = Acker {
        acks,
        tracker,
        watermark,
        stats: &stats,
        answered,
        duplicates,
        clock,
        staged: Vec::new(),
    };
    acker.run(items).await
}

/// The acker task's state: the answers (P10), the tracker the watermark moves through (P1),
/// the counters (P9) and the transactions' clock when timed.
struct Acker<'s, P> {
    acks: Acks,
    tracker: AckTracker<P>,
    watermark: watch::Sender<P>,
    stats: &'s SinkStats,
    /// P15: the stream's last sequence as the answers left it.
    answered: Arc<Answered>,
    duplicates: Duplicates,
    clock: Option<TxnClock<'s>>,
    /// The open atomic batch's messages before its commit, with their tickets (B3).
    staged: Vec<StagedEvent>,
}

/// A message of an atomic batch awaiting its commit's answer (B3).
struct StagedEvent {
    ticket: Ticket,
    event: Acknowledged,
    dead_letter: bool,
    subject: String,
    /// Released with the commit's answer (P2).
    _permit: OwnedSemaphorePermit,
}

impl<P: Ord + Copy + std::fmt::Debug> Acker<'_, P> {
    /// Takes the publisher's items in order, awaiting each publish's ack, and publishes the
    /// watermark whenever the tracker moves it, until the publisher is done (P4) or an
    /// error ends the session (P3).
    async fn run(mut self, mut items: mpsc::Receiver<AckItem<P>>) -> Result<(), SinkError> {
        loop {
            let item = match items.try_recv() {
                Ok(item) => item,
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => tokio::select! {
                    biased;
                    item = items.recv() => match item {
                        Some(item) => item,
                        None => break,
                    },
                    // CN3: a connection that closes while the session is idle ends it now.
                    end = self.acks.closed() => return Err(end),
                },
            };
            let moved = match item {
                AckItem::Publish {
                    event,
                    dead_letter,
                    sequence,
                    fast,
                    subject,
                    // Released once the ack is in (P2).
                    _permit,
                } => {
                    self.acknowledge(event, dead_letter, sequence, fast, subject)
                        .await?
                }
                AckItem::Staged {
                    event,
                    dead_letter,
                    subject,
                    permit,
                } => self.stage(event, dead_letter, subject, permit)?,
                AckItem::FastEnd {
                    sequence,
                    first,
                    expect,
                } => self.fast_end(sequence, first, expect).await?,
                AckItem::Begin { commit_time_us } => self.begin(commit_time_us)?,
                AckItem::Stored => self.stored()?,
                AckItem::Commit(end) => self.commit(end)?,
                AckItem::Idle(position) => self.tracker.idle(position),
            };
            if let Some(position) = moved {
                self.watermark.send_replace(position);
            }
        }
        Ok(())
    }

    /// A transaction's start (with events, P9's clock).
    #[inline]
    fn begin(&mut self, commit_time_us: i64) -> Result<Option<P>, SinkError> {
        self.tracker.begin()?;
        if let Some(clock) = &mut self.clock {
            clock.begin(commit_time_us);
        }
        Ok(None)
    }

    /// A message of an atomic batch (B3): registered, acknowledged with its commit.
    #[inline]
    fn stage(
        &mut self,
        event: Acknowledged,
        dead_letter: bool,
        subject: String,
        permit: OwnedSemaphorePermit,
    ) -> Result<Option<P>, SinkError> {
        let ticket = self.tracker.publish()?;
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        self.staged.push(StagedEvent {
            ticket,
            event,
            dead_letter,
            subject,
            _permit: permit,
        });
        Ok(None)
    }

    /// The batch whose commit (outbox row `id`) JetStream refused (`error`): a message of it
    /// to a denied subject is P11's denial; a stored message id makes its transaction one to
    /// publish message by message (B4). Either way nothing of the batch counts as stored.
    fn refused(&mut self, id: EventId, error: SinkError) -> SinkError {
        let staged = std::mem::take(&mut self.staged);
        let denied = staged.iter().find_map(|message| {
            self.acks
                .denied
                .iter()
                .find(|(subject, _)| *subject == message.subject)
                .map(|(_, why)| (message, why.clone()))
        });
        if let Some((message, why)) = denied {
            return self.duplicates.denied(
                message.event.id.clone(),
                message.subject.clone(),
                why,
                message.dead_letter,
                self.stats,
            );
        }
        if error.jetstream_code() == Some(batch::DUPLICATE_IN_BATCH) {
            if let Some(first) = staged.first() {
                warn!(
                    outbox_id = %id,
                    commit_lsn = %first.event.position.commit_lsn,
                    "JetStream refused an atomic batch of this transaction: the stream already holds one of its message ids; the next session publishes the transaction one message at a time, where each duplicate is checked"
                );
                self.stats
                    .per_message
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(first.event.position.commit_lsn);
            }
        }
        error
    }

    /// The commit's answer came: every message of its batch is stored (B3); counted (P9)
    /// and acknowledged (P1).
    fn stored_with_commit(&mut self) -> Result<Option<P>, SinkError> {
        let mut moved = None;
        for message in std::mem::take(&mut self.staged) {
            let counter = if message.dead_letter {
                self.stats.poison.fetch_add(1, Ordering::Relaxed);
                &self.stats.dead_lettered
            } else {
                &self.stats.stored
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if let Some(clock) = &mut self.clock {
                clock.acked(message.event.created_at_ms);
            }
            moved = self.tracker.ack(message.ticket)?.or(moved);
        }
        Ok(moved)
    }

    /// F6: awaits the answer to an end-of-batch commit (publish `sequence`, of the batch
    /// whose first message is publish `first`), which must be at stream sequence `expect`
    /// (F3); then every staged message is stored.
    async fn fast_end(
        &mut self,
        sequence: u64,
        first: u64,
        expect: u64,
    ) -> Result<Option<P>, SinkError> {
        let Some((newest, subject)) = self
            .staged
            .last()
            .map(|message| (message.event.clone(), message.subject.clone()))
        else {
            return Ok(None);
        };
        let answer = self.answer(sequence, Some((first, expect)), &newest.id, &subject);
        if let Err(why) = answer.await? {
            let source = PublishError::with_source(PublishErrorKind::Other, why);
            return Err(self.refused(
                newest.id.clone(),
                SinkError::Ack {
                    id: newest.id,
                    source,
                },
            ));
        }
        let moved = self.stored_with_commit()?;
        self.answered.stored(expect);
        Ok(moved)
    }

    /// The answer to publish `sequence` (outbox row `id`, to `subject`; a fast batch's
    /// commit when `fast`, checked by F3 and counted); an error while a batch's messages
    /// are staged refuses them all. `Ok(Err(why))`: the server denied it (P11).
    async fn answer(
        &mut self,
        sequence: u64,
        fast: Option<(u64, u64)>,
        id: &EventId,
        subject: &str,
    ) -> Result<Result<Acked, String>, SinkError> {
        let first = fast.map_or(sequence, |(first, _)| first);
        let answer = self.acks.next(first, sequence, id, subject).await;
        let answer = match fast_checked(answer, fast, id, self.stats) {
            Err(error) if !self.staged.is_empty() => return Err(self.refused(id.clone(), error)),
            answer => answer?,
        };
        if fast.is_some() {
            self.stats.fast_batches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(answer)
    }

    /// An event already stored (P6): acknowledged without a publish.
    #[inline]
    fn stored(&mut self) -> Result<Option<P>, SinkError> {
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        let ticket = self.tracker.publish()?;
        Ok(self.tracker.ack(ticket)?)
    }

    /// A transaction's end, at `end`.
    #[inline]
    fn commit(&mut self, end: P) -> Result<Option<P>, SinkError> {
        if let Some(clock) = &mut self.clock {
            clock.commit();
        }
        Ok(self.tracker.commit(end)?)
    }

    /// Awaits the ack of publish `sequence` (`event`'s, or its dead-letter record's), checks
    /// a duplicate (P8), counts it (P9) and hands it to the tracker (P1).
    #[inline]
    async fn acknowledge(
        &mut self,
        event: Acknowledged,
        dead_letter: bool,
        sequence: u64,
        fast: Option<(u64, u64)>,
        subject: String,
    ) -> Result<Option<P>, SinkError> {
        let stats = self.stats;
        let ticket: Ticket = self.tracker.publish()?;
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        let answer = self.answer(sequence, fast, &event.id, &subject).await?;
        // B3: the commit's answer is every staged message's (a denied commit is P11's below).
        let earlier = match self.staged.is_empty() || answer.is_err() {
            true => None,
            false => self.stored_with_commit()?,
        };
        let ack = match answer {
            Ok(ack) => ack,
            Err(why) => {
                let denied =
                    self.duplicates
                        .denied(event.id.clone(), subject, why, dead_letter, stats);
                return Err(denied);
            }
        };
        if ack.duplicate {
            stats.duplicates.fetch_add(1, Ordering::Relaxed);
            self.duplicates
                .check(&ack.stream, ack.sequence, &event, stats)
                .await?;
        } else if dead_letter {
            stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            stats.poison.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.stored.fetch_add(1, Ordering::Relaxed);
        }
        if !ack.duplicate {
            // P15: before the permit is released, so a publisher awaiting every answer sees
            // it.
            self.answered.stored(ack.sequence);
        }
        if let Some(clock) = &mut self.clock {
            clock.acked(event.created_at_ms);
        }
        Ok(self.tracker.ack(ticket)?.or(earlier))
    }
}

/// P8: what the acker needs to check a duplicate's original.
struct Duplicates {
    jetstream: Context,
    strict: bool,
    poison: PoisonPolicy,
}

impl Duplicates {
    fn of(jetstream: &Context, options: &SinkOptions) -> Self {
        Duplicates {
            jetstream: jetstream.clone(),
            strict: options.fence.is_some(),
            poison: options.poison,
        }
    }
}

impl Duplicates {
    /// P11: the server denied publish `id` to `subject` (`why`, its words): the session's
    /// end, by the poison policy; the subject is remembered for the next sessions. A
    /// dead-letter record it denies halts.
    fn denied(
        &self,
        id: EventId,
        subject: String,
        why: String,
        dead_letter: bool,
        stats: &SinkStats,
    ) -> SinkError {
        stats
            .denied_subjects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(subject.clone(), why.clone());
        let reason = if dead_letter {
            format!("the NATS server denies publishing its dead-letter record to {subject}: {why}")
        } else {
            format!("the NATS server denies publishing it to {subject}: {why}")
        };
        match self.poison {
            PoisonPolicy::DeadLetter if !dead_letter => SinkError::Denied { id, subject, why },
            _ => SinkError::Poison {
                id,
                kind: PoisonKind::Denied,
                reason,
            },
        }
    }

    /// Checks that the message JetStream holds under the event's id (`stream`'s message
    /// `sequence`, as the duplicate ack names it) is the same event: the row with the same
    /// id and ordering key (`crate::resume::Claim::is_row`), whatever position it carries
    /// (a replay or a backfill of the row published it without the streamed position).
    /// `Err` when it is another one and strict mode must not go on (P8), or when it cannot
    /// be read.
    async fn check(
        &self,
        stream: &str,
        sequence: u64,
        event: &Acknowledged,
        stats: &SinkStats,
    ) -> Result<(), SinkError> {
        let Some(original) = self.original(stream, sequence, &event.id).await? else {
            return Ok(());
        };
        let mark = crate::resume::Mark::of(&original);
        match self.other_event(&mark, sequence, event) {
            None => Ok(()),
            Some((kind, reason)) => self.lost(kind, reason, sequence, event, stats),
        }
    }

    /// Reads `stream`'s message `sequence`, the original of a duplicate of outbox row `id`:
    /// `None` when it is no longer in the stream (deleted or aged out), which leaves nothing
    /// to check.
    async fn original(
        &self,
        stream: &str,
        sequence: u64,
        id: &EventId,
    ) -> Result<Option<StreamMessage>, SinkError> {
        let stream = self
            .jetstream
            .get_stream_no_info(stream)
            .await
            .map_err(|e| SinkError::Verify {
                id: id.clone(),
                source: async_nats::jetstream::stream::RawMessageError::with_source(
                    async_nats::jetstream::stream::RawMessageErrorKind::Other,
                    e,
                ),
            })?;
        match stream.get_raw_message(sequence).await {
            Ok(original) => Ok(Some(original)),
            Err(error)
                if error.kind()
                    == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
            {
                warn!(
                    outbox_id = %id,
                    sequence,
                    "JetStream acknowledged this event as a duplicate of a message no longer in the stream (deleted or aged out), so whether it was the same event cannot be checked"
                );
                Ok(None)
            }
            Err(source) => Err(SinkError::Verify {
                id: id.clone(),
                source,
            }),
        }
    }

    /// P8's judgement of the original's `mark` (stream sequence `sequence`): `None` when it
    /// is this row's event, or, in shared mode, another writer's copy of it (no row
    /// identity); otherwise what the event would be lost as, and why.
    fn other_event(
        &self,
        mark: &crate::resume::Mark,
        sequence: u64,
        event: &Acknowledged,
    ) -> Option<(PoisonKind, String)> {
        let id = &event.id;
        if mark.claim.is_row(id, event.created_at_ms) {
            // The same row's event: a replay of the relay's own publish, or of `outbox-relay
            // replay`/`backfill`'s.
            debug!(
                outbox_id = %id,
                sequence, "JetStream already held this event"
            );
            return None;
        }
        if !mark.claim.is_anonymous() {
            return Some((PoisonKind::ReusedId, reused_reason(mark, sequence, event)));
        }
        if !self.strict {
            // Shared mode: another writer (e.g. a polling publisher during a migration)
            // published it under the same id; that is what shared mode allows.
            debug!(
                outbox_id = %id,
                sequence,
                "JetStream already held a message with this event's id from another writer"
            );
            return None;
        }
        Some((
            PoisonKind::ForeignDuplicate,
            format!(
                "JetStream acknowledged it as a duplicate of stream sequence {sequence}, a message the relay did not write for it (no Outbox-Id or ordering key): another writer published a message under this event's id within the duplicate window"
            ),
        ))
    }

    /// The event would be lost as `kind` (P8): counted; shared mode warns and goes on,
    /// strict mode halts or, under [`PoisonPolicy::DeadLetter`], ends the session so that
    /// the next one publishes a dead-letter record in its place.
    fn lost(
        &self,
        kind: PoisonKind,
        reason: String,
        sequence: u64,
        event: &Acknowledged,
        stats: &SinkStats,
    ) -> Result<(), SinkError> {
        let id = event.id.clone();
        stats.reused_ids.fetch_add(1, Ordering::Relaxed);
        if !self.strict {
            warn!(
                outbox_id = %id,
                sequence,
                metric = REUSED_ID_METRIC,
                reason = %reason,
                "this event is not in the stream: outbox ids were reused (TRUNCATE ... RESTART IDENTITY, or a restored sequence?); move the id sequence past every id relayed"
            );
            return Ok(());
        }
        match self.poison {
            PoisonPolicy::Halt => Err(SinkError::Poison { id, kind, reason }),
            PoisonPolicy::DeadLetter => {
                stats
                    .dead_letter_instead
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(event.position, reason.clone());
                Err(SinkError::ReusedId { id, reason })
            }
        }
    }
}

/// Why a duplicate of another row's message (`mark`, at stream sequence `sequence`) means
/// `event`'s outbox id was reused (P8).
fn reused_reason(mark: &crate::resume::Mark, sequence: u64, event: &Acknowledged) -> String {
    let theirs = match mark.position {
        Some(p) => format!("commit LSN {}, index {}", p.commit_lsn, p.index),
        None => "no position".to_owned(),
    };
    let here = event.position;
    format!(
        "JetStream acknowledged it as a duplicate of stream sequence {}, another event (outbox id {}, ordering key {}, {theirs}; this one is at commit LSN {}, index {}, ordering key {}): its outbox id was reused within the duplicate window",
        sequence,
        mark.claim.id.as_ref().map_or_else(|| "none".to_owned(), |i| i.to_string()),
        mark.claim.ordering_key.as_deref().unwrap_or("none"),
        here.commit_lsn,
        here.index,
        event.id.ordering_key(event.created_at_ms),
    )
}

#[cfg(test)]
mod fence_tests {
    use super::*;
    use async_nats::jetstream::context::PublishError;

    /// Both halves of strict mode's fence count as its refusal (re-sync, advice); other
    /// refusals do not.
    #[test]
    fn both_halves_of_the_fence_are_fence_refusals() {
        let ack = |kind| SinkError::Ack {
            id: EventId::Int(7),
            source: PublishError::new(kind),
        };
        assert!(ack(PublishErrorKind::WrongLastSequence).is_fence_refusal());
        assert!(ack(PublishErrorKind::WrongLastMessageId).is_fence_refusal());
        assert!(ack(PublishErrorKind::WrongLastMessageId).advice().is_some());
        assert!(!ack(PublishErrorKind::StreamNotFound).is_fence_refusal());
        assert!(!ack(PublishErrorKind::TimedOut).is_fence_refusal());
    }
}
