//! The running relay: one replication session and one JetStream sink at a time, restarted
//! from the slot's confirmed position after any transient failure.
//!
//! ```text
//!  Postgres walsender ══ CopyBoth ══► reader task ──Vec<Item>──► publisher ──► acker
//!        ▲                          (decode, batch,   bounded mpsc       │ window     │
//!        │ StandbyStatusUpdate       backpressure)                       │ semaphore  ▼
//!        └──────────── flush = watermark ◄──────── watch<Lsn> ◄─────── AckTracker (sink)
//! ```
//!
//! The first session of a process creates what is missing ([`init`]); a slot it creates is
//! backfilled first ([`crate::setup::backfill`], BF1–BF5) under the lease, before streaming starts.
//!
//! # Invariants
//! The architecture's invariants this module keeps, by their numbers in
//! docs/architecture.md (the code cites them the same way):
//! - I1 The flush LSN sent to Postgres is the sink's watermark and nothing else: the end of
//!   the newest transaction whose events, and all earlier ones', JetStream acknowledged
//!   (with `--mark-published`, the lower of that and the position through which every
//!   acknowledged row is marked published: [`crate::process::mark`] U2), capped by the LSN the
//!   table's identity checks vouched for ([`crate::process::identity`] TI2; a drain waits for them
//!   to vouch for its watermark, up to the drain deadline). On
//!   any transient failure the whole session (replication stream, sink, in-flight window)
//!   is dropped and a new one starts from the slot's `confirmed_flush_lsn`.
//! - I3 Status goes out at least every `min(10 s, wal_sender_timeout / 2)` whatever the
//!   pipeline's backpressure: the reader waits for channel capacity inside the same `select!`
//!   as its status timer, never blocking on the sink. A keepalive that asks for a reply is
//!   answered the moment it is read; while backpressured the reader takes no new data (memory
//!   stays bounded), so such a keepalive may wait behind data, but the scheduled status keeps
//!   the walsender's timer fresh (the walsender reads replies while its send is blocked), so
//!   the server never times the relay out. The status timer is one sleep, always reset to the
//!   next due time: a fixed ticker beside a "due?" check once skipped every other period.
//!   Tested: `outages.rs` (4 × `wal_sender_timeout` of held acks, update spacing).
//! - I6 Replayed events are skipped only by a position of the session's own `Outbox-Source`
//!   (or of an ancestor timeline below its switch point: sink::resume S5)
//!   (cluster, timeline, database, slot) that lies below the server's WAL end
//!   ([`sink::resume`] S1–S3). Tested: `history.rs`.
//! - I7 Memory is bounded: at most one batch waits in the reader, `CHANNEL_BATCHES` batches
//!   in the channel, and `max_in_flight` publishes in the sink. Tested: `outages.rs`
//!   (a 200 MiB backlog behind held acks).
//! - I9 Set-up races the lease and shutdown; streaming races the lease, and on its loss the
//!   sink task is aborted and awaited before the session returns, so nothing is published
//!   after the loss is noticed ([`crate::postgres::lease`] LS1). The sink task is aborted whenever
//!   its session ends, however it ends. Tested: `standby.rs`.
//! - I10 Shutdown is a drain, never a confirm: intake stops, in-flight acks are awaited up
//!   to the deadline, and the final status carries the watermark only. A shutdown during a
//!   session's set-up (lease, connections, bootstrap, tail) is immediate: nothing was
//!   published; every connect is bounded besides (Postgres `connect_timeout`, 10 s by
//!   default; NATS 5 s). Tested: `relay.rs` (SIGTERM), `connect.rs` (hanging connects).
//! - I13 A session opens every connection it needs, the sink's publishing connection too,
//!   before it logs `streaming outbox events`: what follows that line needs no new handshake.
//!   Tested: `faults.rs` (acks held from that line on).
//!
//! Inside: the sessions and their steps are here; `reader.rs` is the reader task.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox::{Framer, Item, Notice};
use pgoutput::{Lsn, ReplicationMessage};
use rand::Rng;
use replication::{quote_identifier, Feedback, ReplicationConnection, ReplicationStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant as TokioInstant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::connect::{connect_nats, jetstream_context, max_message_bytes, sink_options, source};
use crate::error::{RelayError, Result, Target};
use crate::observe::metrics::{Event, Metrics, Phase};
use crate::postgres::checks;
use crate::postgres::lease::{Lease, RetryMarker};
use crate::process::heartbeat;
use crate::process::identity;
use crate::process::monitor;

mod reader;
use reader::*;

/// Items per batch handed from the reader to the sink at most.
const MAX_BATCH: usize = 512;
/// Batches the reader→sink channel holds.
const CHANNEL_BATCHES: usize = 4;
/// How long a session waits for its sink after the reader stopped cleanly.
const SINK_GRACE: Duration = Duration::from_secs(1);

/// How a session ended.
#[derive(Debug)]
enum SessionEnd {
    /// Shutdown before the session streamed: nothing was published, nothing to drain.
    ShutdownDuringSetUp,
    /// Shutdown while streaming: every in-flight ack arrived and was confirmed (I10).
    Drained,
    /// Shutdown while streaming: the drain deadline passed first; what was not acknowledged
    /// was not confirmed and will be replayed.
    DrainDeadlinePassed,
    /// The session failed; the error says whether another may be tried.
    Failed(RelayError),
}

/// Runs the relay until `shutdown` fires (returns `Ok`) or a permanent error occurs; serves
/// metrics and health meanwhile when `metrics.addr` is set ([`crate::observe::http`]).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<()> {
    let metrics = Arc::new(Metrics::new(&config));
    let _server = match config.metrics.addr {
        Some(addr) => Some(crate::observe::http::start(addr, metrics.clone()).await?),
        None => None,
    };
    let result = sessions(&config, &shutdown, &metrics).await;
    if result.is_ok() {
        if metrics.confirmed() == Lsn(0) {
            info!("stopped; this relay confirmed no position");
        } else {
            info!(confirmed_flush_lsn = %metrics.confirmed(), "stopped; the slot's confirmed position is the last one this relay sent");
        }
    }
    result
}

/// One session after another (each under the lease), with a backoff between failures.
async fn sessions(
    config: &Config,
    shutdown: &CancellationToken,
    metrics: &Arc<Metrics>,
) -> Result<()> {
    let mut progress = monitor::Progress::default();
    // TI1: the identity the process streams, kept across its sessions.
    let identity = identity::Watch::default();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    let mut bootstrapped = false;
    loop {
        let started = Instant::now();
        let acked_before = metrics.sink().acked();
        let end = tokio::select! {
            // A SIGTERM while the lease's connect hangs ends the process at once.
            () = shutdown.cancelled() => SessionEnd::ShutdownDuringSetUp,
            lease = Lease::acquire(config, shutdown, metrics) => match lease {
                Ok(Some(lease)) => holding(config, shutdown, &mut bootstrapped, metrics, &lease, &mut progress, &identity).await,
                Ok(None) => SessionEnd::ShutdownDuringSetUp,
                Err(error) => SessionEnd::Failed(error),
            },
        };
        let error = match end {
            SessionEnd::ShutdownDuringSetUp => {
                info!("shut down before streaming; nothing to drain");
                return Ok(());
            }
            SessionEnd::Drained | SessionEnd::DrainDeadlinePassed => return Ok(()),
            SessionEnd::Failed(error) if !error.is_transient() => return Err(error),
            SessionEnd::Failed(error) => error,
        };
        if shutdown.is_cancelled() {
            return Ok(());
        }
        // sink P12: the server went into lame-duck mode and the session ended cleanly; the
        // next one starts at once, on another server. Not a failure.
        if error.is_lame_duck() {
            info!(reason = %error, "NATS server in lame-duck mode: starting the next session on another server");
            backoff.reset();
            continue;
        }
        // A session that got acknowledgements through, or ran a while, was healthy: the next
        // failure starts the backoff over.
        if metrics.sink().acked() != acked_before || started.elapsed() > Duration::from_secs(30) {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        if !between_sessions(config, shutdown, metrics, &error, delay, bootstrapped).await {
            return Ok(());
        }
    }
}

/// The wait after a failed session: the failure recorded (`set_up`: whether a session of
/// this process set the slot up), this relay seen retrying by `status` (lease LS3), then
/// `delay`. `false` when `shutdown` fired meanwhile.
async fn between_sessions(
    config: &Config,
    shutdown: &CancellationToken,
    metrics: &Metrics,
    error: &RelayError,
    delay: Duration,
    set_up: bool,
) -> bool {
    metrics.set_phase(Phase::Reconnecting);
    metrics.record(Event::SessionFailed {
        error,
        retry_in: delay,
        set_up,
    });
    let attempt_at = tokio::time::Instant::now() + delay;
    let next_attempt =
        humantime::format_rfc3339_seconds(std::time::SystemTime::now() + delay).to_string();
    let error_text = crate::observe::logging::scrub(&error.to_string()).into_owned();
    let _marker = tokio::select! {
        marker = RetryMarker::leave(config, &next_attempt, &error_text) => marker,
        _ = shutdown.cancelled() => return false,
    };
    tokio::select! {
        _ = tokio::time::sleep_until(attempt_at) => true,
        _ = shutdown.cancelled() => false,
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

/// LS1 with several hosts: the replication connection and the lease's control connection each
/// took the first suitable host of the list; unless they reached the same server (the same
/// postmaster start time), the lease would not guard the stream. A transient error: the next
/// session connects again.
async fn same_server(
    connection: &mut ReplicationConnection,
    lease: &Lease,
    config: &Config,
) -> Result<()> {
    if config.database.hosts().len() < 2 {
        return Ok(());
    }
    const STARTED: &str = "SELECT pg_catalog.pg_postmaster_start_time()::text";
    let rows = connection.simple_query(STARTED).await?;
    let streaming = rows.first().and_then(|row| row.first().cloned().flatten());
    let leasing: Option<String> = lease
        .client()
        .query_one(STARTED, &[])
        .await
        .map_err(|e| RelayError::transient(anyhow::anyhow!("{STARTED}: {e}")))?
        .get(0);
    if streaming.is_some() && streaming == leasing {
        return Ok(());
    }
    Err(RelayError::transient(anyhow::anyhow!(
        "the replication connection and the lease's control connection reached different \
         servers of {} (target_session_attrs={}): the lease would not guard the stream; \
         connecting again (use target_session_attrs=read-write)",
        config.database.redacted(),
        config.database.target_session_attrs()
    )))
}

/// The slot is gone from the server a session reconnected to: after a fail-over (or a
/// restore), a slot that is not a fail-over slot stays behind on the old primary. A new slot
/// would start at the WAL end now and silently skip what was committed meanwhile, so the relay
/// refuses and says how to recover.
fn slot_left_behind(config: &Config) -> RelayError {
    RelayError::setup(anyhow::anyhow!(
        "replication slot {:?} does not exist on the server the relay reconnected to: after a \
         fail-over (or a restore) a slot that is not a fail-over slot stays behind on the old \
         primary, and the relay does not invent a position on the new one (a new slot starts at \
         the WAL end now, so events committed meanwhile would be skipped silently). To recover: \
         `outbox-relay init` creates the slot here; `outbox-relay verify --from-id <the stream's \
         last outbox id, from outbox-relay status>` names the rows missing from the stream; \
         `outbox-relay backfill --from-id <the first missing id> --force` publishes them. On \
         Postgres 17 or newer run with --failover-slot and slot synchronization so that a \
         fail-over keeps the slot (docs/operations.md, \"Fail-over\")",
        config.slot
    ))
}

/// The history of the server's current timeline (sink::resume S5). One the relay cannot read
/// as Postgres writes it trusts no ancestor timeline (S1 alone), and says so.
async fn timeline_history(
    connection: &mut ReplicationConnection,
    timeline: u32,
) -> Result<Vec<sink::resume::Switch>> {
    let content = connection.timeline_history(timeline).await?;
    Ok(
        sink::resume::parse_timeline_history(&content).unwrap_or_else(|why| {
            warn!(timeline, reason = %why,
                "cannot read the server's timeline history; positions stored from earlier timelines are not used to skip");
            Vec::new()
        }),
    )
}

/// What a session set up before streaming.
struct Prepared {
    jetstream: jetstream::Context,
    slot: checks::SlotState,
    stream: ReplicationStream,
    status_interval: Duration,
    tail: sink::resume::Tail,
    resume: sink::resume::Resume,
    source: String,
    /// The session's history (`sink::resume` S1, S5).
    lineage: sink::resume::Lineage,
    max_message_bytes: usize,
    /// `--fast-ingest`'s batch limit, when this session publishes fast batches (AT3).
    fast: Option<usize>,
    /// The sink's publishing connection, opened with the files read for this session (NATS4).
    publishing: sink::Connection,
}

/// While this relay holds the lease: one session, with the slot monitor beside it.
async fn holding(
    config: &Config,
    shutdown: &CancellationToken,
    bootstrapped: &mut bool,
    metrics: &Arc<Metrics>,
    lease: &Lease,
    progress: &mut monitor::Progress,
    identity: &identity::Watch,
) -> SessionEnd {
    metrics.set_phase(Phase::SettingUp);
    // MET2: one sample before the session, however soon it fails.
    monitor::sample(lease.client(), &config.slot, metrics, progress).await;
    let end = tokio::select! {
        end = session(config, shutdown, bootstrapped, metrics, lease, identity) => end,
        // TI3: the table's identity changed: the session ends, nothing more is confirmed.
        refusal = monitor::watch(lease.client(), config, identity, metrics, progress) => SessionEnd::Failed(refusal),
    };
    metrics.session_ended();
    end
}

/// One session, step by step: set up (racing the lease and shutdown), then stream.
async fn session(
    config: &Config,
    shutdown: &CancellationToken,
    bootstrapped: &mut bool,
    metrics: &Arc<Metrics>,
    lease: &Lease,
    identity: &identity::Watch,
) -> SessionEnd {
    let prepared = tokio::select! {
        biased;
        // A SIGTERM while a connect or a check hangs ends the process at once: nothing has
        // been published yet, so there is nothing to drain.
        () = shutdown.cancelled() => return SessionEnd::ShutdownDuringSetUp,
        // I9: no session without the lease.
        () = lease.lost() => return SessionEnd::Failed(lease_lost(config)),
        prepared = prepare(config, bootstrapped, metrics, lease, identity) => prepared,
    };
    match prepared {
        Ok(prepared) => stream_events(config, shutdown, metrics, lease, prepared, identity).await,
        Err(error) => SessionEnd::Failed(error),
    }
}

fn lease_lost(config: &Config) -> RelayError {
    warn!(slot = %config.slot, "lost the lease: stopping before anything else is published");
    RelayError::transient(anyhow::anyhow!("lost the lease for slot {}", config.slot))
}

/// Connects, checks, reads the stream's tail and starts replication.
async fn prepare(
    config: &Config,
    bootstrapped: &mut bool,
    metrics: &Metrics,
    lease: &Lease,
    identity: &identity::Watch,
) -> Result<Prepared> {
    let nats = connect_nats(config).await?;
    let server = nats.server_info();
    info!(server = %server.server_name, version = %server.version, max_payload = server.max_payload, "connected to NATS");
    let max_payload = server.max_payload;
    let connector = crate::connect::nats::connector(&config.nats)?;
    metrics.set_nats(nats.clone());
    let jetstream = jetstream_context(nats, config);
    // I13: open before the session says it streams, so a session that streams can publish;
    // first, so that a subscription the server forbids is named before any request of
    // async-nats's waits for its reply in vain.
    let publishing = crate::connect::nats::open_publishing(&connector, &jetstream, config).await?;
    let slot = check_postgres(config, bootstrapped, lease, identity, &jetstream).await?;
    // TI2: the reader's cap starts at the slot's position.
    identity.resume_from(slot.confirmed_flush_lsn);
    let mut connection = ReplicationConnection::connect(&config.database).await?;
    let system = connection.identify_system().await?;
    info!(system_id = %system.systemid, timeline = system.timeline, wal_end = %system.xlogpos, "connected to Postgres for replication");
    let source = source(&system, config);
    // S5: positions of an ancestor timeline count below where this timeline's history left it.
    let history = timeline_history(&mut connection, system.timeline).await?;
    let lineage = sink::resume::Lineage {
        source: source.clone(),
        history,
    };
    let session = sink::resume::Session {
        lineage: &lineage,
        wal_end: system.xlogpos,
        strict: !config.shared_stream,
    };
    let (tail, resume) = plan_resume(config, metrics, &jetstream, session).await?;
    let max_message_bytes = max_message_bytes(&tail, max_payload);
    let fast = crate::stream::atomic::fast_limit(&jetstream, config, tail.replicas, metrics)
        .await
        .map_err(|e| e.at(Target::Nats))?;
    let (stream, status_interval) = start_replication(connection, lease, config).await?;
    Ok(Prepared {
        jetstream,
        slot,
        stream,
        status_interval,
        tail,
        resume,
        source,
        lineage,
        max_message_bytes,
        fast,
        publishing,
    })
}

/// The checks, on the lease's control connection: the first session sets everything up
/// ([`ensure`]); later ones check that nothing changed under them (TI1, PG3), creating
/// nothing. Returns the slot's state.
async fn check_postgres(
    config: &Config,
    bootstrapped: &mut bool,
    lease: &Lease,
    identity: &identity::Watch,
    jetstream: &jetstream::Context,
) -> Result<checks::SlotState> {
    let slot = if *bootstrapped {
        // PG4: after a fail-over the URL may reach the old primary, now a standby, for a
        // while: retried, where at start it is refused.
        if config.primary.is_none() && checks::in_recovery(lease.client()).await? {
            return Err(RelayError::transient(anyhow::anyhow!(
                "{}; retrying",
                checks::standby_refused()
            )));
        }
        // TI1: the table the process streamed, checked first, so that a table created again
        // is named as such rather than as one the publication does not cover (PG3).
        identity.begin(lease.client(), config).await?;
        // The slot must still exist: recreating it would silently skip what was committed
        // while it was gone.
        if !checks::slot_exists(lease.client(), &config.slot).await? {
            return Err(slot_left_behind(config));
        }
        let mut checking = config.clone();
        checking.create = false;
        checks::postgres(lease.client(), &checking).await?
    } else {
        let slot = crate::setup::ensure(lease.client(), jetstream, config, true).await?;
        // TI1: the first session's identity, once the publication exists.
        identity.begin(lease.client(), config).await?;
        slot
    };
    *bootstrapped = true;
    Ok(slot)
}

/// The stream's tail and the resume plan for `session`, each distrust of the tail recorded.
/// Nothing is checked against the table (`sink::resume` S2): the replay itself is compared
/// with the stream (S4).
async fn plan_resume(
    config: &Config,
    metrics: &Metrics,
    jetstream: &jetstream::Context,
    session: sink::resume::Session<'_>,
) -> Result<(sink::resume::Tail, sink::resume::Resume)> {
    let tail = sink::resume::read_tail(jetstream, &config.stream, !config.shared_stream)
        .await
        .map_err(|e| RelayError::transient(anyhow::Error::new(e)).at(Target::Nats))?;
    let resume = sink::resume::plan(&tail, &session);
    for why in &resume.distrust {
        metrics.record(Event::TailDistrusted {
            why,
            last_sequence: tail.last_sequence,
            source: &session.lineage.source,
        });
    }
    Ok((tail, resume))
}

/// Starts replication from the slot (on the lease's server, LS2), with the walsender's
/// timeout as the idle timeout; returns the stream and the status interval.
async fn start_replication(
    mut connection: ReplicationConnection,
    lease: &Lease,
    config: &Config,
) -> Result<(ReplicationStream, Duration)> {
    same_server(&mut connection, lease, config).await?;
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
            // belongs to a relay that no longer does (LS2).
            lease.end_lingering_walsender(&config.slot).await?;
            return Err(error.into());
        }
        Err(error) => return Err(error.into()),
    };
    if let Some(timeout) = wal_sender_timeout {
        // A server that vanishes without closing the connection becomes a transient error.
        stream.set_idle_timeout(Some(timeout));
    }
    Ok((stream, status_interval))
}

/// Aborts `task` and waits until it is gone: nothing it does happens after this returns.
async fn stop<T>(mut task: AbortOnDropHandle<T>) {
    task.abort();
    let _ = (&mut task).await;
}

/// Streams until shutdown, an error, or the loss of the lease.
async fn stream_events(
    config: &Config,
    shutdown: &CancellationToken,
    metrics: &Arc<Metrics>,
    lease: &Lease,
    prepared: Prepared,
    identity: &identity::Watch,
) -> SessionEnd {
    info!(
        slot = %config.slot,
        confirmed_flush_lsn = %prepared.slot.confirmed_flush_lsn,
        stream = %config.stream,
        mode = if config.shared_stream { "shared" } else { "strict" },
        last_sequence = prepared.tail.last_sequence,
        compare_through = ?prepared.resume.compare_through,
        "streaming outbox events"
    );
    let (reader, sink) = start(config, metrics, prepared, identity.vouched());
    // HB1: the session's heartbeat task, aborted when the session ends (dropped here).
    let _heartbeat = match (&config.primary, config.heartbeat_interval) {
        (None, interval) => heartbeat::start(lease.shared_client(), interval),
        (Some(_), None) => None,
        // SB1: decoding on a standby, heartbeats are written on the primary.
        (Some(_), interval) => match crate::postgres::standby::connect_primary(config).await {
            Ok(primary) => heartbeat::start(std::sync::Arc::new(primary), interval),
            Err(error) => {
                warn!("no heartbeats this session: {error}");
                None
            }
        },
    };
    // PW1: fail-over protection watched by the lease holder while the session streams.
    let _protection =
        crate::process::protection::start(config, lease.shared_client(), metrics.clone());
    // RET2: retention deletes only while this session streams under the lease.
    // RET7: only from the table this session streams.
    let _retention = identity
        .table_oid()
        .and_then(|table_oid| crate::process::retention::start(config, metrics.clone(), table_oid));
    metrics.set_phase(Phase::Streaming);
    let reader_end = tokio::select! {
        biased;
        // I9: the lease is gone: stop the sink before anything else is published.
        () = lease.lost() => {
            stop(sink).await;
            return SessionEnd::Failed(lease_lost(config));
        }
        end = reader.run(shutdown.clone(), config.shutdown_timeout) => end,
    };
    finish(reader_end, sink).await
}

/// The session's sink task.
type SinkTask = AbortOnDropHandle<std::result::Result<(), sink::SinkError>>;

/// The session's sink options: the configured ones, the resume plan's fence and comparison,
/// the session's largest message and source, atomic and fast-ingest batches.
fn session_options(config: &Config, prepared: &Prepared) -> sink::SinkOptions {
    let mut options = sink_options(
        config,
        prepared.resume.fence,
        prepared.max_message_bytes,
        prepared.source.clone(),
        prepared.tail.replicas,
    );
    // --atomic-transactions: streamed transactions only (a backfill publishes per message),
    // checked against the server and the stream by setup (`crate::stream::policy::stream`, AT1).
    options.atomic = config
        .atomic_transactions
        .then_some(sink::batch::DEFAULT_BATCH_LIMIT);
    // --fast-ingest, where the server and the stream allow it (AT3).
    options.fast = prepared.fast;
    // P6: replayed events at or before the tail's position are compared with the stream.
    options.compare = prepared
        .resume
        .compare_through
        .map(|through| sink::vouch::Compare {
            stream: config.stream.clone(),
            through,
            last_sequence: prepared.tail.last_sequence,
            lineage: prepared.lineage.clone(),
        });
    options
}

/// Wires the reader to a new sink task over a bounded channel (I7) and a watermark (I1).
fn start(
    config: &Config,
    metrics: &Arc<Metrics>,
    prepared: Prepared,
    vouched: watch::Receiver<Lsn>,
) -> (Reader, SinkTask) {
    let (items_tx, items_rx) = mpsc::channel(CHANNEL_BATCHES);
    let (watermark_tx, watermark_rx) = watch::channel(prepared.slot.confirmed_flush_lsn);
    let options = session_options(config, &prepared);
    // I9: the sink task ends with the session, however the session ends (aborted on drop).
    let sink = AbortOnDropHandle::new(tokio::spawn(sink::run(
        prepared.jetstream,
        prepared.publishing,
        options,
        items_rx,
        watermark_tx,
        metrics.sink().clone(),
    )));
    let framer = Framer::new(
        config.table.name().clone(),
        config.subject_prefix.clone(),
        config.partitions,
    )
    .with_mapping(config.mapping.clone())
    .with_cloudevents(config.cloudevents.clone())
    .with_relations(prepared.slot.relations);
    let marking = config.mark_published.then(|| {
        crate::process::mark::Marking::start(
            config,
            prepared.slot.confirmed_flush_lsn,
            metrics.clone(),
        )
    });
    let reader = Reader {
        marking,
        vouched,
        stream: prepared.stream,
        framer,
        items: Some(items_tx),
        confirmed: watermark_rx,
        feedback: Feedback::new(prepared.status_interval),
        pending: Vec::with_capacity(MAX_BATCH),
        drain_until: None,
        dedupe_guard: config
            .shared_stream
            .then_some(prepared.tail.duplicate_window),
        metrics: metrics.clone(),
    };
    (reader, sink)
}

/// How the session ended, from how the reader stopped and what the sink says.
async fn finish(reader_end: Result<ReaderEnd>, mut sink: SinkTask) -> SessionEnd {
    let intake_open = match reader_end {
        Err(error) => {
            // The replication stream is gone, so nothing the sink still awaits could be
            // confirmed: drop the window now (I1) rather than drain it.
            stop(sink).await;
            return SessionEnd::Failed(error);
        }
        Ok(ReaderEnd::DrainDeadlinePassed) => {
            stop(sink).await;
            return SessionEnd::DrainDeadlinePassed;
        }
        Ok(ReaderEnd::SinkEnded { intake_open }) => intake_open,
    };
    // The sink's watermark closed: its task is ending; its result says how.
    match tokio::time::timeout(SINK_GRACE, &mut sink).await {
        Ok(Ok(Ok(()))) if !intake_open => SessionEnd::Drained,
        Ok(Ok(Ok(()))) => SessionEnd::Failed(
            RelayError::transient(anyhow::anyhow!(
                "the sink stopped while events were still flowing"
            ))
            .at(Target::Nats),
        ),
        Ok(Ok(Err(error))) => SessionEnd::Failed(error.into()),
        Ok(Err(join)) => SessionEnd::Failed(RelayError::permanent(anyhow::anyhow!(
            "the sink task failed: {join}"
        ))),
        Err(_) => {
            stop(sink).await;
            SessionEnd::Failed(
                RelayError::transient(anyhow::anyhow!(
                    "the sink did not end within {SINK_GRACE:?} of closing its watermark"
                ))
                .at(Target::Nats),
            )
        }
    }
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
