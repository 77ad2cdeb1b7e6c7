//! The running relay: one replication session and one JetStream sink at a time, restarted
//! from the slot's confirmed position after any transient failure.
//!
//! ```text
//!  Postgres walsender ══ CopyBoth ══► reader task ──Vec<SinkItem>──► publisher ──► acker
//!        ▲                          (decode, batch,   bounded mpsc       │ window     │
//!        │ StandbyStatusUpdate       backpressure)                       │ semaphore  ▼
//!        └──────────── flush = watermark ◄──────── watch<Lsn> ◄─────── AckTracker (sink)
//! ```
//!
//! # Invariants (numbered as in docs/architecture.md)
//! - I1 The flush LSN sent to Postgres is the sink's watermark and nothing else: the end of
//!   the newest transaction whose events, and all earlier ones', JetStream acknowledged.
//! - I2 Status goes out at least every `min(10 s, wal_sender_timeout / 2)` whatever the
//!   pipeline's backpressure: the reader waits for channel capacity inside the same `select!`
//!   as its status timer, never blocking on the sink. A keepalive that asks for a reply is
//!   answered the moment it is read; while backpressured the reader takes no new data (memory
//!   stays bounded), so such a keepalive may wait behind data, but the scheduled status keeps
//!   the walsender's timer fresh (the walsender reads replies while its send is blocked), so
//!   the server never times the relay out (tested: `outages.rs`, 4 × `wal_sender_timeout` of
//!   held acks).
//! - I3 Memory is bounded: at most one batch waits in the reader, a few batches in the
//!   channel, and `max_in_flight` publishes in the sink.
//! - I4 On any transient failure the whole session (replication stream, sink, in-flight
//!   window) is dropped and a new one starts from the slot's `confirmed_flush_lsn`;
//!   replayed events carry the same `Nats-Msg-Id`, which JetStream de-duplicates.
//! - I5 Shutdown is a drain, never a confirm: intake stops, in-flight acks are awaited up to
//!   the deadline, and the final status carries the watermark only.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox::Position;
use pgoutput::{Lsn, ReplicationMessage};
use rand::Rng;
use replication::{quote_identifier, Feedback, ReplicationConnection, ReplicationStream};
use sink::{SinkItem, SinkOptions, SinkStats};
use tokio::sync::{mpsc, watch};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::bootstrap;
use crate::config::Config;
use crate::decode::Decoder;
use crate::error::{RelayError, Result};
use crate::lease::Lease;
use crate::metrics;

/// Items per batch handed from the reader to the sink at most.
const MAX_BATCH: usize = 512;
/// Batches the reader→sink channel holds.
const CHANNEL_BATCHES: usize = 4;
/// How long a session waits for its sink after the reader stopped cleanly.
const SINK_GRACE: Duration = Duration::from_secs(1);
/// The reader's timer period: the status interval, but at least this often so confirmed
/// progress reaches Postgres promptly.
const MAX_TICK: Duration = Duration::from_secs(1);

/// Runs the relay until `shutdown` fires (returns `Ok`) or a permanent error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<()> {
    let stats = Arc::new(SinkStats::default());
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    let mut bootstrapped = false;
    loop {
        let started = Instant::now();
        let acked_before = stats.acked();
        let result = async {
            let Some(lease) = Lease::acquire(&config, &shutdown).await? else { return Ok(()) };
            tokio::select! {
                result = session(&config, &shutdown, &mut bootstrapped, &stats, &lease) => result,
                // L1: stop publishing the moment the lease is gone.
                () = lease.lost() => Err(RelayError::transient(anyhow::anyhow!("lost the lease for slot {}", config.slot))),
            }
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(error) if !error.is_transient() => return Err(error),
            Err(error) => {
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                // A session that got acknowledgements through, or ran a while, was healthy:
                // the next failure starts the backoff over.
                if stats.acked() != acked_before || started.elapsed() > Duration::from_secs(30) {
                    backoff.reset();
                }
                let delay = backoff.next_delay();
                warn!(error = %error, retry_in = ?delay, "relay session ended; resuming from the slot's confirmed position");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    }
}

/// Capped exponential backoff with full jitter.
#[derive(Debug)]
struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            attempt: 0,
        }
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1 << self.attempt.min(16))
            .min(self.cap);
        self.attempt += 1;
        let jitter = rand::rng().random_range(0.5..=1.0);
        ceiling.mul_f64(jitter)
    }
}

/// Connects to NATS.
pub async fn connect_nats(config: &Config) -> Result<async_nats::Client> {
    // NATS_URL may list several servers, comma-separated (validated in config): async-nats
    // parses a single string as one URL, so hand it the list.
    let servers: Vec<&str> = config.nats_url.expose().split(',').map(str::trim).collect();
    async_nats::ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(Duration::from_secs(5))
        .connect(servers)
        .await
        .map_err(|e| {
            let message = format!("cannot connect to NATS at {}: {e}", config.nats_url);
            match e.kind() {
                async_nats::ConnectErrorKind::Authentication
                | async_nats::ConnectErrorKind::AuthorizationViolation => RelayError::permanent(
                    anyhow::anyhow!("{message}: check the credentials in NATS_URL"),
                ),
                _ => RelayError::transient(anyhow::anyhow!(message)),
            }
        })
}

/// A JetStream context for the relay's publishing.
pub fn jetstream_context(client: async_nats::Client, config: &Config) -> jetstream::Context {
    jetstream::context::ContextBuilder::new()
        .timeout(config.ack_timeout)
        .max_ack_inflight(config.max_in_flight + 1)
        .build(client)
}

/// Checks and creates everything the relay needs (`outbox-relay init`, and the first
/// session of `run`).
///
/// With `guard_history`, a missing slot is created only if the stream holds no relayed
/// event: a stream with events but no slot means the slot was dropped or invalidated, and a
/// new one would silently skip everything committed since. `outbox-relay init` (an
/// operator's deliberate act) passes `false`.
pub async fn init(config: &Config, guard_history: bool) -> Result<bootstrap::SlotState> {
    let client = replication::connect_sql(&config.database).await?;
    let jetstream = jetstream_context(connect_nats(config).await?, config);
    ensure(&client, &jetstream, config, guard_history).await
}

/// [`init`]'s checks and creations on connections the caller already has.
async fn ensure(
    client: &tokio_postgres::Client,
    jetstream: &jetstream::Context,
    config: &Config,
    guard_history: bool,
) -> Result<bootstrap::SlotState> {
    if guard_history && config.create && !bootstrap::slot_exists(client, &config.slot).await? {
        if let Ok(tail) = read_tail(jetstream, config, None).await {
            if let Some(position) = tail.position {
                return Err(RelayError::permanent(anyhow::anyhow!(
                    "replication slot {:?} does not exist, but stream {} already holds relayed events (the last at commit LSN {}): \
                     the slot was dropped or invalidated, so events committed since may be missing from the stream. \
                     Create the slot deliberately with `outbox-relay init`, then reconcile the table and the stream",
                    config.slot,
                    config.stream,
                    position.commit_lsn
                )));
            }
        }
    }
    let slot = bootstrap::postgres(client, config).await?;
    bootstrap::stream(jetstream, config).await?;
    Ok(slot)
}

async fn session(
    config: &Config,
    shutdown: &CancellationToken,
    bootstrapped: &mut bool,
    stats: &Arc<SinkStats>,
    lease: &Lease,
) -> Result<()> {
    let nats = connect_nats(config).await?;
    let max_payload = nats.server_info().max_payload;
    let jetstream = jetstream_context(nats, config);
    // The checks run on the lease's control connection.
    let slot = if *bootstrapped {
        // The slot must still exist: recreating it would silently skip what was committed
        // while it was gone.
        let mut checking = config.clone();
        checking.create = false;
        bootstrap::postgres(lease.client(), &checking).await?
    } else {
        ensure(lease.client(), &jetstream, config, true).await?
    };
    *bootstrapped = true;
    let mut connection = ReplicationConnection::connect(&config.database).await?;
    let system = connection.identify_system().await?;
    let source = format!(
        "{}/{}/{}",
        system.systemid,
        system.dbname.as_deref().unwrap_or(config.database.dbname()),
        config.slot
    );
    let tail = read_tail(&jetstream, config, Some(&source)).await?;
    let max_message_bytes = match tail.max_msg_size {
        Some(limit) => limit.min(max_payload),
        None => max_payload,
    };

    let wal_sender_timeout = connection.wal_sender_timeout().await?;
    let status_interval = replication::status_interval(wal_sender_timeout);
    let options = [
        ("proto_version", "1"),
        ("publication_names", &quote_identifier(&config.publication)),
    ];
    let mut stream = match connection
        .start_logical_replication(&config.slot, Lsn::ZERO, &options)
        .await
    {
        Ok(stream) => stream,
        Err(error) if error.sqlstate() == Some("55006") => {
            // "replication slot is active for PID …": we hold the lease, so that walsender
            // belongs to a relay that no longer does (L2).
            lease.end_lingering_walsender(&config.slot).await?;
            return Err(error.into());
        }
        Err(error) => return Err(error.into()),
    };
    if let Some(timeout) = wal_sender_timeout {
        // A server that vanishes without closing the connection becomes a transient error.
        stream.set_idle_timeout(Some(timeout));
    }
    // P6: skip what the tail shows stored, or what an earlier session of this process saw
    // acknowledged, whichever is further.
    let resume_after = if config.shared_stream {
        None
    } else {
        tail.position.max(stats.stored_through())
    };
    info!(
        slot = %config.slot,
        confirmed_flush_lsn = %slot.confirmed_flush_lsn,
        stream = %config.stream,
        mode = if config.shared_stream { "shared" } else { "strict" },
        last_sequence = tail.last_sequence,
        resume_after = ?resume_after,
        "streaming outbox events"
    );

    let (items_tx, items_rx) = mpsc::channel(CHANNEL_BATCHES);
    let (watermark_tx, watermark_rx) = watch::channel(slot.confirmed_flush_lsn);
    let decoder = Decoder::new(
        config.table.clone(),
        config.subject_prefix.clone(),
        config.partitions,
    )
    .with_relations(slot.relations);
    let options = SinkOptions {
        max_in_flight: config.max_in_flight,
        fence: (!config.shared_stream).then_some(tail.last_sequence),
        resume_after,
        max_message_bytes,
        poison: config.on_poison,
        dead_letter_subject: format!("{}.dlq", config.subject_prefix),
        source,
    };
    let guard = config.shared_stream.then_some(tail.duplicate_window);
    let sink = tokio::spawn(sink::run(
        jetstream,
        options,
        items_rx,
        watermark_tx,
        stats.clone(),
    ));
    let reader = Reader {
        stream,
        decoder,
        items: Some(items_tx),
        confirmed: watermark_rx,
        feedback: Feedback::new(status_interval),
        dedupe_guard: guard,
    };
    let drain_deadline = config.shutdown_timeout;
    let mut sink = sink;
    let read_result = reader.run(shutdown.clone(), drain_deadline).await;
    if let Err(error) = read_result {
        // The replication stream is gone, so nothing the sink still awaits could be
        // confirmed: drop the window now (I4) rather than drain it.
        sink.abort();
        return Err(error);
    }
    // The reader returns Ok once the sink has ended (drained, or failed), or when the drain
    // deadline passed: a short grace, then the window is dropped.
    let sink_result = match tokio::time::timeout(SINK_GRACE, &mut sink).await {
        Ok(Ok(result)) => result,
        Ok(Err(join)) => {
            return Err(RelayError::permanent(anyhow::anyhow!(
                "the sink task failed: {join}"
            )))
        }
        Err(_) => {
            sink.abort();
            Ok(())
        }
    };
    if let Err(error) = sink_result {
        let poison = error.poison_id().is_some();
        let fenced = sink::is_fence_refusal(&error);
        let error = anyhow::Error::new(error);
        return Err(if poison {
            RelayError::permanent(error.context(
                "JetStream refuses this event for good; nothing after it is confirmed (raise the stream's max_msg_size or the server's max_payload, or run with OUTBOX_RELAY_ON_POISON=dead-letter; see docs/guarantees.md)",
            ))
        } else if fenced {
            RelayError::transient(error.context(
                "the stream's last sequence is not what this relay published last (a publish was lost, or another writer uses the stream: then set OUTBOX_RELAY_SHARED_STREAM=true); re-syncing from the stream's tail",
            ))
        } else {
            RelayError::transient(error)
        });
    }
    read_result
}

/// What a session learns about the stream before publishing.
#[derive(Debug)]
struct Tail {
    /// The stream's last sequence: strict mode's fence starts here.
    last_sequence: u64,
    /// The position of the stream's last message, if it carries one.
    position: Option<Position>,
    /// The stream's `max_msg_size`, if limited.
    max_msg_size: Option<usize>,
    /// The stream's duplicate window.
    duplicate_window: Duration,
}

/// Reads the stream's state and its last message's position (resume from the tail). With
/// `source`, a tail published from another source (another database or slot) gives no
/// position: skipping by it could skip events this source never stored.
async fn read_tail(
    jetstream: &jetstream::Context,
    config: &Config,
    source: Option<&str>,
) -> Result<Tail> {
    let transient = |what: &str, e: &dyn std::fmt::Display| {
        RelayError::transient(anyhow::anyhow!(
            "cannot read {what} of stream {}: {e}",
            config.stream
        ))
    };
    let mut stream = jetstream
        .get_stream(&config.stream)
        .await
        .map_err(|e| transient("the state", &e))?;
    let info = stream
        .info()
        .await
        .map_err(|e| transient("the state", &e))?;
    let last_sequence = info.state.last_sequence;
    let max_msg_size = usize::try_from(info.config.max_message_size)
        .ok()
        .filter(|&n| n > 0);
    let duplicate_window = info.config.duplicate_window;
    let mut tail = Tail {
        last_sequence,
        position: None,
        max_msg_size,
        duplicate_window,
    };
    if config.shared_stream || last_sequence == 0 {
        return Ok(tail);
    }
    let message = match stream.get_raw_message(last_sequence).await {
        Ok(message) => message,
        Err(error) => {
            metrics::TAIL_UNREADABLE.fetch_add(1, Ordering::Relaxed);
            warn!(
                last_sequence,
                error = %error,
                metric = metrics::TAIL_UNREADABLE_NAME,
                "cannot read the stream's last message (purged or aged out?); replayed events are de-duplicated by Nats-Msg-Id only, within the duplicate window"
            );
            return Ok(tail);
        }
    };
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    tail.position = match (
        header(outbox::headers::OUTBOX_COMMIT_LSN),
        header(outbox::headers::OUTBOX_TX_INDEX),
    ) {
        (Some(lsn), Some(index)) => Position::from_headers(&lsn, &index),
        _ => None,
    };
    let tail_source = header(outbox::headers::OUTBOX_SOURCE);
    if let (Some(ours), Some(position)) = (source, tail.position) {
        if tail_source.as_deref() != Some(ours) {
            tail.position = None;
            metrics::TAIL_UNREADABLE.fetch_add(1, Ordering::Relaxed);
            warn!(
                last_sequence,
                ?position,
                tail_source = tail_source.as_deref().unwrap_or("none"),
                source = ours,
                metric = metrics::TAIL_UNREADABLE_NAME,
                "the stream's last message was published from another source (another database or slot writes to this stream: give each its own stream, or set OUTBOX_RELAY_SHARED_STREAM=true); not skipping by its position"
            );
            return Ok(tail);
        }
    }
    if tail.position.is_none() {
        metrics::TAIL_UNREADABLE.fetch_add(1, Ordering::Relaxed);
        warn!(
            last_sequence,
            subject = %message.subject,
            metric = metrics::TAIL_UNREADABLE_NAME,
            "the stream's last message carries no outbox position (another writer? then set OUTBOX_RELAY_SHARED_STREAM=true); replayed events are de-duplicated by Nats-Msg-Id only"
        );
    }
    Ok(tail)
}

/// What one turn of the reader's loop saw.
enum Step {
    Shutdown,
    Watermark { sink_running: bool },
    Tick,
    Handed,
    Message(std::result::Result<ReplicationMessage, replication::Error>),
}

struct Reader {
    stream: ReplicationStream,
    decoder: Decoder,
    items: Option<mpsc::Sender<Vec<SinkItem<Lsn>>>>,
    confirmed: watch::Receiver<Lsn>,
    feedback: Feedback,
    /// Shared mode: the stream's duplicate window, until the first replayed transaction was
    /// checked against it.
    dedupe_guard: Option<Duration>,
}

impl Reader {
    /// Reads until shutdown (then drains) or an error. See I2, I3, I5.
    async fn run(mut self, shutdown: CancellationToken, drain_deadline: Duration) -> Result<()> {
        self.feedback.update(*self.confirmed.borrow_and_update());
        let mut tick = tokio::time::interval(self.feedback.interval().min(MAX_TICK));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pending: Vec<SinkItem<Lsn>> = Vec::with_capacity(MAX_BATCH);
        let mut drain_until: Option<tokio::time::Instant> = None;
        loop {
            let intake_open = self.items.is_some();
            // Each branch only yields a step; the steps are handled below, once the branch
            // futures (which borrow parts of `self`) are dropped.
            let step = tokio::select! {
                biased;
                // PRIORITY 1: shutdown stops intake (cancel-safe: a token wait).
                _ = shutdown.cancelled(), if intake_open => Step::Shutdown,
                // PRIORITY 2: the watermark moved, or the sink ended (drained or failed).
                changed = self.confirmed.changed() => Step::Watermark { sink_running: changed.is_ok() },
                // PRIORITY 3: status on schedule (cancel-safe: interval tick).
                _ = tick.tick() => Step::Tick,
                // PRIORITY 4: hand the pending batch to the sink (cancel-safe: reserve).
                permit = reserve(&self.items), if intake_open && !pending.is_empty() => match permit {
                    Some(permit) => {
                        // Size the next batch like this one: a live trickle should not
                        // allocate a 512-item vector per event.
                        let capacity = pending.len().clamp(16, MAX_BATCH);
                        permit.send(std::mem::replace(&mut pending, Vec::with_capacity(capacity)));
                        Step::Handed
                    }
                    // The sink ended; PRIORITY 2 reports why.
                    None => Step::Handed,
                },
                // PRIORITY 5: new WAL, only while nothing is pending (cancel-safe: recv).
                message = self.stream.recv(), if intake_open && pending.is_empty() => Step::Message(message),
            };
            match step {
                Step::Shutdown => {
                    // What is pending was never published: dropping it leaves it unconfirmed.
                    info!("shutting down: waiting for in-flight acks");
                    self.items = None;
                    pending.clear();
                    drain_until = Some(tokio::time::Instant::now() + drain_deadline);
                }
                Step::Watermark { sink_running: true } => {
                    self.feedback.update(*self.confirmed.borrow_and_update());
                }
                Step::Watermark {
                    sink_running: false,
                } => {
                    // The sink is gone: report its final watermark and stop.
                    self.feedback.update(*self.confirmed.borrow());
                    self.send_status().await?;
                    if intake_open {
                        // The sink failed; its error is the session's result.
                        return Ok(());
                    }
                    info!(confirmed_flush_lsn = %self.feedback.flush_lsn(), "drained; final position confirmed");
                    if let Err(error) = self.stream.finish().await {
                        debug!(error = %error, "closing the replication stream");
                    }
                    return Ok(());
                }
                Step::Tick => {
                    if drain_until.is_some_and(|deadline| tokio::time::Instant::now() >= deadline) {
                        warn!("in-flight acks did not all arrive before the shutdown deadline; they will be replayed");
                        self.send_status().await?;
                        return Ok(());
                    }
                    if self.feedback.due(tokio::time::Instant::now()) {
                        self.send_status().await?;
                    }
                }
                Step::Handed => {}
                Step::Message(message) => {
                    self.on_message(message?, &mut pending).await?;
                    while pending.len() < MAX_BATCH {
                        match self.stream.try_recv_buffered() {
                            Some(message) => self.on_message(message?, &mut pending).await?,
                            None => break,
                        }
                    }
                }
            }
        }
    }

    async fn on_message(
        &mut self,
        message: ReplicationMessage,
        pending: &mut Vec<SinkItem<Lsn>>,
    ) -> Result<()> {
        if let ReplicationMessage::PrimaryKeepalive(keepalive) = &message {
            if keepalive.reply_requested {
                self.send_status().await?;
            }
        }
        self.decoder.on_message(message, pending).inspect_err(|e| {
            if !e.is_transient() {
                error!(error = %e, "cannot relay");
            }
        })?;
        if let (Some(window), Some(commit_time)) =
            (self.dedupe_guard, self.decoder.first_commit_time)
        {
            self.dedupe_guard = None;
            check_dedupe_window(window, commit_time);
        }
        Ok(())
    }

    async fn send_status(&mut self) -> Result<()> {
        self.stream.send_feedback(&mut self.feedback).await?;
        Ok(())
    }
}

/// Shared mode's guard: the oldest event a session may replay is its first transaction; if
/// it committed longer ago than the stream's duplicate window, replays of events published
/// before the restart are no longer recognised as duplicates.
fn check_dedupe_window(window: Duration, commit_time: pgoutput::copy_data::PgTimestamp) {
    let now = replication::pg_timestamp(std::time::SystemTime::now());
    let age = Duration::from_micros(u64::try_from(now.saturating_sub(commit_time)).unwrap_or(0));
    if age > window {
        metrics::DEDUPE_WINDOW_EXCEEDED.fetch_add(1, Ordering::Relaxed);
        warn!(
            age = ?age,
            duplicate_window = ?window,
            metric = metrics::DEDUPE_WINDOW_EXCEEDED_NAME,
            "the oldest event this session may replay committed longer ago than the stream's duplicate window: events published before the restart but not yet confirmed may be stored twice (strict mode does not have this limit)"
        );
    }
}

async fn reserve<T>(sender: &Option<mpsc::Sender<T>>) -> Option<mpsc::Permit<'_, T>> {
    sender.as_ref()?.reserve().await.ok()
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process can still be stopped; it just cannot drain.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
