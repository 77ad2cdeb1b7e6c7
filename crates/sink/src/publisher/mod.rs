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
//!   publish stored as new), it is published alone, never in a fast-ingest batch (an atomic
//!   transaction's event stays in its batch, stored whole or refused whole, B4): the
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
//!
//! Inside: the options, figures and [`run`] are here; `publish.rs` is the publisher,
//! `answers.rs` what it awaits, `acker.rs` the acker and `duplicates.rs` the judgement of a
//! duplicate answer.

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

mod acker;
mod answers;
mod duplicates;
mod publish;
use acker::*;
use answers::*;
use duplicates::*;
use publish::*;

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
        read(&self.fast_paused_through)
    }

    /// F4: a session that batched up to `position` failed.
    fn pause_fast_through(&self, position: Position) {
        raise(&self.fast_paused_through, position);
    }

    /// P15: the newest event a failed session of the process published.
    fn failed_through(&self) -> Option<Position> {
        read(&self.failed_through)
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

/// What `slot` holds now.
fn read(slot: &Mutex<Option<Position>>) -> Option<Position> {
    *slot.lock().unwrap_or_else(PoisonError::into_inner)
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
    // P10, CN2: the session's own connection, subscribed to `{inbox}.>` before any publish;
    // its tasks live as long as this function.
    let (lame_duck, server, _tasks) = (connection.lame_duck, connection.server, connection.tasks);
    let (fast, reply_prefix) = (fast_limit(&options, &stats), connection.reply_prefix);
    let limits = session_limits(options.limits, connection.max_payload, &reply_prefix, fast);
    let acks = Acks::new(connection.answers, &options, server.clone());
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
    let frames = connection.frames;
    let mut publisher = Publisher::new(&options, limits, frames, reply_prefix, &stats, fast);
    publisher.vouching = vouching(&options, &jetstream);
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
    if result.is_err() {
        stats.session_failed(last_fast, last_framed);
    }
    result
}

/// The replay's comparison with the stream (`crate::vouch`), in strict mode when asked.
fn vouching(options: &SinkOptions, jetstream: &Context) -> Option<crate::vouch::Vouching> {
    options
        .compare
        .clone()
        .filter(|_| options.fence.is_some())
        .map(|compare| crate::vouch::Vouching::new(compare, jetstream.clone()))
}

impl SinkStats {
    /// A session failed: the next sessions publish what it batched one message at a time
    /// (F4), and what it published may be in the stream without its answer (P15).
    fn session_failed(&self, last_fast: Option<Position>, last_framed: Option<Position>) {
        if let Some(position) = last_fast {
            self.pause_fast_through(position);
        }
        if let Some(position) = last_framed {
            self.fail_through(position);
        }
    }
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
/// is `{reply_prefix}{u64::MAX}`, or a fast batch's when `fast` gives a batch limit, F5).
fn session_limits(
    mut limits: Limits,
    max_payload: usize,
    reply_prefix: &str,
    fast: Option<usize>,
) -> Limits {
    if max_payload > 0 {
        limits.max_message_bytes = limits.max_message_bytes.min(max_payload);
    }
    let numbered = u64::MAX.to_string().len();
    let longest = match fast {
        Some(_) => numbered.max(batch::FastReply::max_len(batch::token(reply_prefix).len())),
        None => numbered,
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
