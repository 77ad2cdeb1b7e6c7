//! What the relay counts and shows: one [`Metrics`] per [`crate::run`], shared by the
//! session's steps, the slot monitor ([`crate::process::monitor`]) and the HTTP endpoint
//! ([`crate::observe::http`]), which renders it in the Prometheus text format (prometheus-client).
//!
//! Nothing here is on the per-event path: the sink counts events and times transactions in
//! its own atomics ([`sink::SinkStats`]), the reader stores its positions once per batch or
//! status update, and everything else changes once per session or poll. Values are read
//! when scraped. docs/operations.md explains every metric.
//!
//! # Invariants
//! - MET1 Where the relay both logs and counts something, [`Metrics::record`] does both, so a
//!   log line that carries `metric = …` and the counter it names never disagree.
//! - MET2 The slot's gauges (lag, `wal_status`, `safe_wal_size`) come from this relay's own
//!   polls, made while it holds the lease (one before every session, so that a relay whose
//!   sessions keep failing still measures the lag it leaves), and keep their last value
//!   while it reconnects; a standby shows none, so the maximum over several relays is the
//!   active one's.
//! - MET3 `/readyz` is ready only while this relay holds the lease, streams, is connected to
//!   NATS and the slot lag is at most `max_lag_bytes`; otherwise its body says which
//!   ([`Readiness`]), a standby answering `standby`.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pgoutput::Lsn;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use sink::SinkStats;
use tracing::{info, warn};

use crate::config::Config;
use crate::error::{RelayError, Target};

/// The metric counting sessions that could not read a position from the stream's tail.
pub const TAIL_UNREADABLE_NAME: &str = "outbox_relay_tail_unreadable_total";
/// The metric counting stored positions rejected for lying beyond the server's WAL end.
pub const TAIL_REJECTED_NAME: &str = "outbox_relay_tail_rejected_total";
/// The metric counting shared-mode sessions whose replay reached past the duplicate window.
pub const DEDUPE_WINDOW_EXCEEDED_NAME: &str = "outbox_relay_dedupe_window_exceeded_total";
/// The metric counting sessions ended by a failure, by the side that failed.
pub const RECONNECTS_NAME: &str = "outbox_relay_reconnects_total";
/// The metric counting strict mode's re-syncs (the fence refused a publish).
pub const RESYNCS_NAME: &str = "outbox_relay_resyncs_total";

/// What the relay is doing, for `/readyz` and `outbox_relay_streaming`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Connecting for the lease, the first time.
    Starting = 0,
    /// Another relay holds the lease.
    Standby = 1,
    /// Holding the lease; connecting, checking and reading the stream's tail.
    SettingUp = 2,
    /// Relaying events.
    Streaming = 3,
    /// A session failed; the next one starts after a backoff.
    Reconnecting = 4,
    /// Draining after SIGTERM/SIGINT.
    ShuttingDown = 5,
}

impl Phase {
    fn from_u8(value: u8) -> Phase {
        match value {
            1 => Phase::Standby,
            2 => Phase::SettingUp,
            3 => Phase::Streaming,
            4 => Phase::Reconnecting,
            5 => Phase::ShuttingDown,
            _ => Phase::Starting,
        }
    }
}

/// How a session publishes streamed events (`crate::stream::atomic` AT1, AT3), for
/// `outbox_relay_publish_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PublishMode {
    /// One acknowledged publish per event.
    PerMessage = 1,
    /// Fast-ingest batches (`--fast-ingest`, nats-server 2.14+).
    FastBatches = 2,
    /// One atomic batch per transaction (`--atomic-transactions`).
    AtomicBatches = 3,
}

impl PublishMode {
    const ALL: [PublishMode; 3] = [
        PublishMode::PerMessage,
        PublishMode::FastBatches,
        PublishMode::AtomicBatches,
    ];

    /// The metric's label.
    fn label(self) -> &'static str {
        match self {
            PublishMode::PerMessage => "per_message",
            PublishMode::FastBatches => "fast_batches",
            PublishMode::AtomicBatches => "atomic_batches",
        }
    }

    /// For a log line: "publishing {}".
    pub fn describe(self) -> &'static str {
        match self {
            PublishMode::PerMessage => "one acknowledged message per event",
            PublishMode::FastBatches => "fast-ingest batches",
            PublishMode::AtomicBatches => "each transaction as atomic batches",
        }
    }
}

/// The slot as the server sees it, polled on the lease's connection ([`crate::process::monitor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSample {
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`, bytes.
    pub lag_bytes: u64,
    /// `wal_status` (Postgres 13+): reserved, extended, unreserved or lost.
    pub wal_status: Option<String>,
    /// `safe_wal_size` (Postgres 13+): bytes that can still be written before the slot is
    /// at risk; `None` when `max_slot_wal_keep_size` is -1 (no limit).
    pub safe_wal_size: Option<i64>,
}

/// The values of `wal_status`, one gauge each.
const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

/// Something the relay both logs and counts (MET1).
#[derive(Debug)]
pub enum Event<'a> {
    /// A stored position is not used to skip replayed events (I6).
    TailDistrusted {
        /// Why.
        why: &'a sink::resume::Distrust,
        /// The stream's last sequence.
        last_sequence: u64,
        /// This session's `Outbox-Source`.
        source: &'a str,
    },
    /// Shared mode: the oldest event this session may replay committed longer ago than the
    /// stream's duplicate window.
    DedupeWindowExceeded {
        /// How long ago it committed.
        age: Duration,
        /// The stream's duplicate window.
        window: Duration,
    },
    /// A session failed; the next starts after `retry_in`.
    SessionFailed {
        /// Why.
        error: &'a RelayError,
        /// The backoff.
        retry_in: Duration,
        /// Whether a session of this process set the slot up: the next one resumes from its
        /// confirmed position; before, it starts over (the slot may not exist yet).
        set_up: bool,
    },
}

/// The relay's counters, kept in the registry.
#[derive(Debug, Default)]
struct Counters {
    tail_unreadable: Counter,
    tail_rejected: Counter,
    dedupe_window_exceeded: Counter,
    reconnects: Family<Vec<(&'static str, &'static str)>, Counter>,
    resyncs: Counter,
    marked: Counter,
    mark_failures: Counter,
    retention_deleted: Counter,
    excluded: Counter,
}

/// The relay's state, read when scraped.
#[derive(Debug)]
struct State {
    sink: Arc<SinkStats>,
    phase: AtomicU8,
    /// The current or last session's [`PublishMode`]; 0 before the first.
    publish_mode: AtomicU8,
    received_lsn: AtomicU64,
    confirmed_lsn: AtomicU64,
    slot: Mutex<Option<SlotSample>>,
    nats: Mutex<Option<async_nats::Client>>,
    /// Fail-over protection as last checked: `(state, lag)`, `None` before the first check of
    /// a relay with `--failover-slot` (and on a standby relay).
    failover: Mutex<Option<(FailoverState, Option<u64>)>>,
}

/// Fail-over protection's state, as `outbox_relay_failover_protection{state}` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailoverState {
    /// No `--failover-slot`: nothing to protect.
    Off,
    /// `DATABASE_URL` names no standby: nothing is checked.
    Unwatched,
    /// No standby holds a copy a promotion would keep.
    Missing,
    /// A standby holds one.
    Protected,
}

impl FailoverState {
    const ALL: [FailoverState; 4] = [
        FailoverState::Off,
        FailoverState::Unwatched,
        FailoverState::Missing,
        FailoverState::Protected,
    ];

    fn label(self) -> &'static str {
        match self {
            FailoverState::Off => "off",
            FailoverState::Unwatched => "unwatched",
            FailoverState::Missing => "missing",
            FailoverState::Protected => "protected",
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    counters: Counters,
    state: Arc<State>,
    max_lag_bytes: u64,
}

/// Why `/readyz` is not ready (MET3); its `Display` is the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Ready.
    Ready,
    /// Another relay holds the lease.
    Standby,
    /// Holding the lease or trying to, but not relaying events.
    NotStreaming(Phase),
    /// Streaming, but the NATS connection is down.
    NatsDisconnected,
    /// Streaming, but the slot retains more than `max_lag_bytes`.
    Stalled {
        /// The lag.
        lag_bytes: u64,
        /// The threshold.
        max_lag_bytes: u64,
    },
}

impl fmt::Display for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Readiness::Ready => f.write_str("ready"),
            Readiness::Standby => f.write_str("standby: another relay holds the lease"),
            Readiness::NotStreaming(phase) => {
                let what = match phase {
                    Phase::Starting => "starting",
                    Phase::SettingUp => "setting up a session",
                    Phase::Reconnecting => "reconnecting after a failure",
                    Phase::ShuttingDown => "shutting down",
                    Phase::Standby | Phase::Streaming => "between sessions",
                };
                write!(f, "not streaming: {what}")
            }
            Readiness::NatsDisconnected => f.write_str("not streaming: disconnected from NATS"),
            Readiness::Stalled {
                lag_bytes,
                max_lag_bytes,
            } => write!(
                f,
                "stalled: the slot retains {lag_bytes} bytes of WAL, more than max_lag_bytes ({max_lag_bytes})"
            ),
        }
    }
}

impl Metrics {
    /// The metrics of one `run`: the sink times what it acknowledges only when they are
    /// served (`metrics_addr`).
    pub fn new(config: &Config) -> Metrics {
        let sink = Arc::new(if config.metrics.addr.is_some() {
            SinkStats::timed()
        } else {
            SinkStats::default()
        });
        let state = Arc::new(State {
            sink,
            phase: AtomicU8::new(Phase::Starting as u8),
            publish_mode: AtomicU8::new(0),
            received_lsn: AtomicU64::new(0),
            confirmed_lsn: AtomicU64::new(0),
            slot: Mutex::new(None),
            nats: Mutex::new(None),
            failover: Mutex::new((!config.failover_slot).then_some((FailoverState::Off, None))),
        });
        let counters = Counters::default();
        // Both series exist from the start, at 0, so that rate() and increase() see the first.
        for target in ["postgres", "nats"] {
            let _ = counters.reconnects.get_or_create(&vec![("target", target)]);
        }
        let mut registry = Registry::with_prefix("outbox_relay");
        registry.register(
            "build",
            "The relay's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        for (name, help, counter) in [
            (
                "tail_unreadable",
                "Sessions that could not use the stream's last message to skip replayed events (unreadable, no position, another source): they fall back to Nats-Msg-Id de-duplication",
                &counters.tail_unreadable,
            ),
            (
                "tail_rejected",
                "Stream tails beyond the server's WAL end (a restored database, or a message the relay did not write; the replay is still compared with the stream) or past an earlier timeline's switch point (not used)",
                &counters.tail_rejected,
            ),
            (
                "excluded_events",
                "Outbox rows whose event type the include/exclude lists keep from publishing: confirmed with their transactions, never published",
                &counters.excluded,
            ),
            (
                "dedupe_window_exceeded",
                "Shared-mode sessions whose oldest replayable event committed longer ago than the stream's duplicate window",
                &counters.dedupe_window_exceeded,
            ),
            (
                "resyncs",
                "Strict mode's re-syncs: the stream's last sequence was not what this relay published last (a lost publish, or another writer)",
                &counters.resyncs,
            ),
            (
                "marked",
                "Rows set to status 'published' after JetStream acknowledged them (--mark-published; rows already published are not counted again)",
                &counters.marked,
            ),
            (
                "mark_failures",
                "Failed marking UPDATEs (--mark-published): each is retried; meanwhile the slot is not confirmed past the unmarked rows",
                &counters.mark_failures,
            ),
            (
                "retention_deleted",
                "Rows deleted by retention (--retention-grace): older than the grace period and confirmed by the slot",
                &counters.retention_deleted,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "reconnects",
            "Sessions ended by a failure and started again, by the side that failed (postgres, nats)",
            counters.reconnects.clone(),
        );
        registry.register_collector(Box::new(state.clone()));
        Metrics {
            registry,
            counters,
            state,
            max_lag_bytes: config.max_lag_bytes,
        }
    }

    /// Records a session's publish mode; whether it differs from the previous session's.
    pub fn set_publish_mode(&self, mode: PublishMode) -> bool {
        self.state.publish_mode.swap(mode as u8, Ordering::Relaxed) != mode as u8
    }

    /// The sink's counters, kept across sessions.
    pub fn sink(&self) -> &Arc<SinkStats> {
        &self.state.sink
    }

    /// Logs and counts `event` (MET1).
    pub fn record(&self, event: Event<'_>) {
        match event {
            Event::TailDistrusted {
                why,
                last_sequence,
                source,
            } => self.tail_distrusted(why, last_sequence, source),
            Event::DedupeWindowExceeded { age, window } => {
                self.counters.dedupe_window_exceeded.inc();
                warn!(
                    age = ?age,
                    duplicate_window = ?window,
                    metric = DEDUPE_WINDOW_EXCEEDED_NAME,
                    "the oldest event this session may replay committed longer ago than the stream's duplicate window: events published before the restart but not yet confirmed may be stored twice (strict mode does not have this limit)"
                );
            }
            Event::SessionFailed {
                error,
                retry_in,
                set_up,
            } => {
                let target = match error.target {
                    Target::Postgres => "postgres",
                    Target::Nats => "nats",
                };
                self.counters
                    .reconnects
                    .get_or_create(&vec![("target", target)])
                    .inc();
                if error.is_resync() {
                    self.counters.resyncs.inc();
                    info!(
                        metric = RESYNCS_NAME,
                        "re-syncing from the stream's tail: strict mode's fence refused a publish"
                    );
                }
                if set_up {
                    warn!(error = %error, retry_in = ?retry_in, target, metric = RECONNECTS_NAME,
                        "relay session ended; resuming from the slot's confirmed position");
                } else {
                    warn!(error = %error, retry_in = ?retry_in, target, metric = RECONNECTS_NAME,
                        "relay session ended before it was set up; starting over");
                }
            }
        }
    }

    /// Says why a stored position is not used to skip, and counts it (I6): the session then
    /// relies on `Nats-Msg-Id` de-duplication, within the duplicate window, for what it
    /// replays.
    fn tail_distrusted(&self, why: &sink::resume::Distrust, last_sequence: u64, source: &str) {
        use sink::resume::Distrust;
        const FALLBACK: &str =
            "replayed events are de-duplicated by Nats-Msg-Id only, within the duplicate window";
        match why {
            Distrust::Unreadable { error } => {
                self.counters.tail_unreadable.inc();
                warn!(last_sequence, error = %error, metric = TAIL_UNREADABLE_NAME,
                    "cannot read the stream's last message (purged or aged out?); {FALLBACK}");
            }
            Distrust::NoPosition => {
                self.counters.tail_unreadable.inc();
                warn!(last_sequence, metric = TAIL_UNREADABLE_NAME,
                    "the stream's last message carries no outbox position (another writer? then set OUTBOX_RELAY_SHARED_STREAM=true); {FALLBACK}");
            }
            Distrust::OtherSource { theirs } => {
                self.counters.tail_unreadable.inc();
                warn!(last_sequence, tail_source = theirs.as_deref().unwrap_or("none"), source,
                    metric = TAIL_UNREADABLE_NAME,
                    "the stream's last message was published from another source: another timeline of this database (after a fail-over or a point-in-time restore, LSNs are reused), or another database or slot writing to this stream (give each its own stream, or set OUTBOX_RELAY_SHARED_STREAM=true); not skipping by its position: {FALLBACK}");
            }
            Distrust::PastSwitchPoint {
                theirs,
                commit_lsn,
                switch_point,
            } => {
                self.counters.tail_rejected.inc();
                warn!(last_sequence, tail_source = %theirs, source, commit_lsn = %commit_lsn,
                    switch_point = %switch_point, metric = TAIL_REJECTED_NAME,
                    "the stream's last message was published from an earlier timeline at or past the point where this server's history left it (WAL the old primary wrote that the promoted server never received); not skipping by it: {FALLBACK}. Check with `outbox-relay verify` (docs/guarantees.md)");
            }
            Distrust::BeyondWalEnd { commit_lsn } => {
                self.counters.tail_rejected.inc();
                warn!(commit_lsn = %commit_lsn, metric = TAIL_REJECTED_NAME,
                    "the stream's last message claims a commit beyond the server's WAL end (restored from an older backup, or a message not written by this relay?): the replay is compared with the stream's messages, and only the events it holds at their place are skipped; check with `outbox-relay verify` (docs/guarantees.md)");
            }
        }
    }

    /// `n` rows were marked published ([`crate::process::mark`]).
    pub fn marked(&self, n: u64) {
        self.counters.marked.inc_by(n);
    }

    /// A marking UPDATE failed; it is retried ([`crate::process::mark`]).
    pub fn mark_failed(&self) {
        self.counters.mark_failures.inc();
    }

    /// Retention deleted `n` rows ([`crate::process::retention`]).
    pub fn retention_deleted(&self, n: u64) {
        self.counters.retention_deleted.inc_by(n);
    }

    /// What the relay is doing now.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.state.phase.load(Ordering::Relaxed))
    }

    /// Records what the relay is doing. A standby forgets the slot's sample (MET2) and the
    /// oldest unconfirmed transaction: the relay holding the lease confirms it.
    pub fn set_phase(&self, phase: Phase) {
        self.state.phase.store(phase as u8, Ordering::Relaxed);
        if phase == Phase::Standby {
            *lock(&self.state.slot) = None;
            let mut failover = lock(&self.state.failover);
            if failover.is_some_and(|(state, _)| state != FailoverState::Off) {
                *failover = None;
            }
            self.state.sink.forget_unconfirmed();
        }
    }

    /// A session ended: its NATS connection is gone.
    pub fn session_ended(&self) {
        *lock(&self.state.nats) = None;
    }

    /// The session's NATS connection, watched by `/readyz`.
    pub fn set_nats(&self, client: async_nats::Client) {
        *lock(&self.state.nats) = Some(client);
    }

    /// The slot as just polled (MET2).
    pub fn set_slot(&self, sample: SlotSample) {
        *lock(&self.state.slot) = Some(sample);
    }

    /// Fail-over protection as just checked (`crate::postgres::failover`), with the lag of
    /// the closest protecting copy.
    pub fn set_failover(&self, state: FailoverState, lag_bytes: Option<u64>) {
        *lock(&self.state.failover) = Some((state, lag_bytes));
    }

    /// The slot as last polled, while this relay holds the lease.
    pub fn slot(&self) -> Option<SlotSample> {
        lock(&self.state.slot).clone()
    }

    /// Rows the event-type filter kept from publishing (MAP4).
    pub fn excluded(&self, rows: u64) {
        self.counters.excluded.inc_by(rows);
    }

    /// How far the reader has read: the end of the last transaction or idle position.
    pub fn set_received(&self, lsn: Lsn) {
        self.state.received_lsn.store(lsn.0, Ordering::Relaxed);
    }

    /// What the reader last confirmed to Postgres.
    pub fn set_confirmed(&self, lsn: Lsn) {
        self.state.confirmed_lsn.store(lsn.0, Ordering::Relaxed);
    }

    /// What the reader last confirmed to Postgres, `0/0` before the first status update.
    pub fn confirmed(&self) -> Lsn {
        Lsn(self.state.confirmed_lsn.load(Ordering::Relaxed))
    }

    /// Whether `/readyz` answers ready, and if not why (MET3).
    pub fn readiness(&self) -> Readiness {
        match self.phase() {
            Phase::Streaming => {}
            Phase::Standby => return Readiness::Standby,
            other => return Readiness::NotStreaming(other),
        }
        let connected = lock(&self.state.nats).as_ref().is_some_and(|client| {
            client.connection_state() == async_nats::connection::State::Connected
        });
        if !connected {
            return Readiness::NatsDisconnected;
        }
        match self.slot() {
            Some(slot) if slot.lag_bytes > self.max_lag_bytes => Readiness::Stalled {
                lag_bytes: slot.lag_bytes,
                max_lag_bytes: self.max_lag_bytes,
            },
            _ => Readiness::Ready,
        }
    }

    /// Every metric, in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut text = String::new();
        if let Err(error) =
            prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
        {
            warn!(error = %error, "cannot render the metrics");
        }
        text
    }
}

/// The `Content-Type` of [`Metrics::render`].
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes one metric of `kind` named `name` with one value per label set (or none).
fn emit<V: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: &[(Option<(&'static str, &'static str)>, V)],
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    if let [(None, value)] = values {
        return value.encode(metric);
    }
    for (label, value) in values {
        let labels: &[(&str, &str)] = label.as_slice();
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for State {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        self.encode_sink(&mut encoder)?;
        self.encode_session(&mut encoder)?;
        self.encode_mode(&mut encoder)?;
        self.encode_slot(&mut encoder)?;
        self.encode_failover(&mut encoder)?;
        self.encode_nats(&mut encoder)
    }
}

impl State {
    /// The sink's counters and latency histograms.
    fn encode_sink(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let sink = &self.sink;
        let load = |counter: &AtomicU64| ConstCounter::new(counter.load(Ordering::Relaxed));
        emit(
            encoder,
            "events",
            "Events acknowledged by JetStream, by outcome: stored (as themselves), duplicate (JetStream already held their Nats-Msg-Id), dead_lettered (a dead-letter record stored in their place), skipped (replayed after a restart, already in the stream by its tail)",
            MetricType::Counter,
            &[
                (Some(("outcome", "stored")), load(&sink.stored)),
                (Some(("outcome", "duplicate")), load(&sink.duplicates)),
                (Some(("outcome", "dead_lettered")), load(&sink.dead_lettered)),
                (Some(("outcome", "skipped")), load(&sink.skipped)),
            ],
        )?;
        emit(
            encoder,
            "poison_events",
            "Events JetStream can never accept (too large, a publish line too long, a reused outbox id): dead-lettered, or halting the relay",
            MetricType::Counter,
            &[(None, load(&sink.poison))],
        )?;
        emit(
            encoder,
            "reused_id",
            "Events JetStream acknowledged as duplicates of another event: their outbox id was reused (TRUNCATE ... RESTART IDENTITY, a restored sequence)",
            MetricType::Counter,
            &[(None, load(&sink.reused_ids))],
        )?;
        emit(
            encoder,
            "fast_batches",
            "Fast-ingest batches JetStream committed and acknowledged (--fast-ingest, nats-server 2.14+), each up to 1000 events",
            MetricType::Counter,
            &[(None, load(&sink.fast_batches))],
        )?;
        for (name, help, latency) in [
            (
                "commit_to_ack_seconds",
                "From a transaction's commit (the server's clock) to JetStream's ack of its last event, once per transaction with events",
                &sink.commit_to_ack,
            ),
            (
                "created_to_ack_seconds",
                "From an event's created_at (the server's clock, whole milliseconds) to JetStream's ack, per event",
                &sink.created_to_ack,
            ),
        ] {
            let snapshot = latency.snapshot();
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            metric.encode_histogram::<NoLabelSet>(
                snapshot.sum_seconds,
                snapshot.count,
                &snapshot.buckets,
                None,
            )?;
        }
        Ok(())
    }

    /// The lease, streaming, in-flight and position gauges.
    fn encode_session(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let sink = &self.sink;
        let gauge = |value: f64| ConstGauge::new(value);
        let phase = Phase::from_u8(self.phase.load(Ordering::Relaxed));
        let held = matches!(
            phase,
            Phase::SettingUp | Phase::Streaming | Phase::ShuttingDown
        );
        emit(
            encoder,
            "lease_held",
            "1 while this relay holds the slot's lease (the active relay), 0 on a standby",
            MetricType::Gauge,
            &[(None, gauge(f64::from(u8::from(held))))],
        )?;
        emit(
            encoder,
            "streaming",
            "1 while this relay relays events (holding the lease, its session set up)",
            MetricType::Gauge,
            &[(None, gauge(f64::from(u8::from(phase == Phase::Streaming))))],
        )?;
        emit(
            encoder,
            "in_flight_events",
            "Publishes awaiting JetStream's ack",
            MetricType::Gauge,
            &[(None, gauge(sink.in_flight() as f64))],
        )?;
        let age = sink.oldest_unconfirmed_us().map_or(0.0, |commit_us| {
            (sink::latency::unix_micros_now() - commit_us).max(0) as f64 / 1e6
        });
        emit(
            encoder,
            "oldest_unconfirmed_event_age_seconds",
            "Age (since its commit) of the oldest transaction with events that the relay read but JetStream has not stored yet; 0 when none",
            MetricType::Gauge,
            &[(None, gauge(age))],
        )?;
        for (name, help, lsn) in [
            (
                "received_lsn",
                "How far the relay has read the slot: the end of the last transaction or idle position (a WAL byte position)",
                &self.received_lsn,
            ),
            (
                "confirmed_lsn",
                "The position the relay last confirmed to Postgres (a WAL byte position): everything before it is in JetStream",
                &self.confirmed_lsn,
            ),
        ] {
            let lsn = lsn.load(Ordering::Relaxed);
            if lsn != 0 {
                emit(encoder, name, help, MetricType::Gauge, &[(None, gauge(lsn as f64))])?;
            }
        }
        Ok(())
    }

    /// The session's publish mode, once a session chose one.
    fn encode_mode(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let gauge = |value: f64| ConstGauge::new(value);
        let mode = self.publish_mode.load(Ordering::Relaxed);
        if mode != 0 {
            let values: Vec<_> = PublishMode::ALL
                .iter()
                .map(|m| {
                    (
                        Some(("mode", m.label())),
                        gauge(f64::from(u8::from(*m as u8 == mode))),
                    )
                })
                .collect();
            emit(
                encoder,
                "publish_mode",
                "1 for how the current (or last) session publishes streamed events: per_message (one acknowledged publish per event), fast_batches (--fast-ingest on nats-server 2.14+), atomic_batches (--atomic-transactions)",
                MetricType::Gauge,
                &values,
            )?;
        }
        Ok(())
    }

    /// The slot's gauges, from the lease holder's poll only (MET2).
    fn encode_slot(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let gauge = |value: f64| ConstGauge::new(value);
        // MET2: the slot's gauges only from the lease holder's poll.
        let slot = lock(&self.slot).clone();
        if let Some(slot) = slot {
            emit(
                encoder,
                "slot_lag_bytes",
                "WAL the slot retains past its confirmed position, as the server sees it: pg_current_wal_lsn() - confirmed_flush_lsn (polled every few seconds)",
                MetricType::Gauge,
                &[(None, gauge(slot.lag_bytes as f64))],
            )?;
            if let Some(status) = &slot.wal_status {
                let values: Vec<_> = WAL_STATUSES
                    .iter()
                    .map(|s| {
                        (
                            Some(("status", *s)),
                            gauge(f64::from(u8::from(status == s))),
                        )
                    })
                    .collect();
                emit(
                    encoder,
                    "slot_wal_status",
                    "The slot's wal_status, 1 for the current one: reserved (within max_wal_size), extended (beyond it, kept for the slot), unreserved (beyond max_slot_wal_keep_size: at risk), lost (invalidated)",
                    MetricType::Gauge,
                    &values,
                )?;
                let safe = match (slot.safe_wal_size, status.as_str()) {
                    (Some(bytes), _) => bytes as f64,
                    (None, "lost") => 0.0,
                    (None, _) => f64::INFINITY,
                };
                emit(
                    encoder,
                    "slot_safe_wal_size_bytes",
                    "WAL that can still be written before the slot is at risk of invalidation (safe_wal_size); +Inf when max_slot_wal_keep_size is -1 (no limit: the disk is the limit)",
                    MetricType::Gauge,
                    &[(None, gauge(safe))],
                )?;
            }
        }
        Ok(())
    }

    /// Fail-over protection, once checked (always `off` without `--failover-slot`).
    fn encode_failover(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let gauge = |value: f64| ConstGauge::new(value);
        let Some((state, lag)) = *lock(&self.failover) else {
            return Ok(());
        };
        let values: Vec<_> = FailoverState::ALL
            .iter()
            .map(|s| {
                (
                    Some(("state", s.label())),
                    gauge(f64::from(u8::from(*s == state))),
                )
            })
            .collect();
        emit(
            encoder,
            "failover_protection",
            "1 for whether a promotion now would keep the fail-over slot: off (no --failover-slot), unwatched (DATABASE_URL names no standby to check), missing (no standby holds a synced, persistent, valid copy), protected (one does); checked every few seconds by the lease holder",
            MetricType::Gauge,
            &values,
        )?;
        if let Some(lag) = lag {
            emit(
                encoder,
                "failover_copy_lag_bytes",
                "How far the closest protecting standby's copy of the slot trails the primary's (confirmed_flush_lsn), while protected",
                MetricType::Gauge,
                &[(None, gauge(lag as f64))],
            )?;
        }
        Ok(())
    }

    /// The session's NATS connection, during a session.
    fn encode_nats(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let gauge = |value: f64| ConstGauge::new(value);
        let nats = lock(&self.nats)
            .as_ref()
            .map(|client| client.connection_state() == async_nats::connection::State::Connected);
        if let Some(connected) = nats {
            emit(
                encoder,
                "nats_connected",
                "1 while the session's NATS connection is up (shown during a session)",
                MetricType::Gauge,
                &[(None, gauge(f64::from(u8::from(connected))))],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn metrics() -> Metrics {
        let config = crate::config::tests::load(
            &[("metrics_addr", "127.0.0.1:0"), ("max_lag_bytes", "1MiB")],
            &[("DATABASE_URL", "postgres://relay@db/app")],
            None,
        )
        .unwrap();
        Metrics::new(&config)
    }

    /// Every metric renders under its documented name, in the Prometheus text format; the
    /// slot's gauges only once polled (MET2); counters named in logs are the registry's (MET1).
    #[test]
    fn renders_every_metric_under_its_name() {
        let metrics = metrics();
        let text = metrics.render();
        assert!(
            !text.contains("slot_lag_bytes"),
            "MET2: not polled yet\n{text}"
        );
        metrics.sink().stored.fetch_add(7, Ordering::Relaxed);
        metrics.sink().commit_to_ack.observe(1500, 2);
        metrics.set_slot(SlotSample {
            lag_bytes: 4096,
            wal_status: Some("extended".into()),
            safe_wal_size: None,
        });
        metrics.set_received(Lsn(0x2000));
        metrics.set_confirmed(Lsn(0x1000));
        let error = RelayError::transient(anyhow::anyhow!("gone")).at(Target::Nats);
        metrics.record(Event::SessionFailed {
            error: &error,
            retry_in: Duration::from_millis(1),
            set_up: true,
        });
        let text = metrics.render();
        if std::env::var_os("SHOW_METRICS").is_some() {
            eprintln!("{text}");
        }
        for line in [
            "outbox_relay_events_total{outcome=\"stored\"} 7",
            "outbox_relay_events_total{outcome=\"skipped\"} 0",
            "outbox_relay_commit_to_ack_seconds_bucket{le=\"0.0025\"} 2",
            "outbox_relay_commit_to_ack_seconds_count 2",
            "outbox_relay_created_to_ack_seconds_count 0",
            "outbox_relay_slot_lag_bytes 4096",
            "outbox_relay_slot_wal_status{status=\"extended\"} 1",
            "outbox_relay_slot_wal_status{status=\"reserved\"} 0",
            "outbox_relay_slot_safe_wal_size_bytes +Inf",
            "outbox_relay_received_lsn 8192",
            "outbox_relay_confirmed_lsn 4096",
            "outbox_relay_reconnects_total{target=\"nats\"} 1",
            "outbox_relay_reconnects_total{target=\"postgres\"} 0",
            "outbox_relay_resyncs_total 0",
            "outbox_relay_lease_held 0",
            "outbox_relay_in_flight_events 0",
            "outbox_relay_oldest_unconfirmed_event_age_seconds 0",
            "outbox_relay_build_info{version=\"",
            "# TYPE outbox_relay_poison_events_total counter",
            "# TYPE outbox_relay_reused_id_total counter",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
        for name in [
            TAIL_UNREADABLE_NAME,
            TAIL_REJECTED_NAME,
            DEDUPE_WINDOW_EXCEEDED_NAME,
            RECONNECTS_NAME,
            RESYNCS_NAME,
            sink::REUSED_ID_METRIC,
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} counter")),
                "{name}\n{text}"
            );
        }
    }

    /// MET3: ready only when streaming, connected to NATS and not lagging; a standby says so.
    #[test]
    fn readiness_says_why_not() {
        let metrics = metrics();
        assert_eq!(
            metrics.readiness(),
            Readiness::NotStreaming(Phase::Starting)
        );
        metrics.set_phase(Phase::Standby);
        assert_eq!(
            metrics.readiness().to_string(),
            "standby: another relay holds the lease"
        );
        metrics.set_phase(Phase::Streaming);
        assert_eq!(metrics.readiness(), Readiness::NatsDisconnected);
        metrics.set_phase(Phase::Reconnecting);
        assert!(metrics.readiness().to_string().starts_with("not streaming"));
        let stalled = Readiness::Stalled {
            lag_bytes: 2 << 20,
            max_lag_bytes: 1 << 20,
        };
        assert!(stalled.to_string().starts_with("stalled: "), "{stalled}");
    }
}
