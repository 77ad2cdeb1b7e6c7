//! The shard workers: one durable pull consumer, one Postgres connection and one task per
//! shard. See the crate docs for the invariants C1–C8 they keep, and [`park`] for what
//! happens to an event whose handler keeps failing (PK1–PK4).
//!
//! Inside: the workers, their sessions and connections are here; `batch.rs` takes a batch
//! through a worker, `park.rs` parks what keeps failing.

mod batch;
mod park;

pub use park::PARKED_POLL;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Socket, Statement};
use tracing::{debug, info, warn, Instrument as _};

use crate::config::{Config, OnFailure};
use crate::error::{Error, HandlerFailed, Problem, SetupError, Unavailable};
use crate::event::{Event, MessageError};
use crate::metrics::{Failed, Metrics, Parked, Retry};
use crate::order::{EntityOrder, Mark};
use crate::trace::{batch_span, handle_span};
use crate::transaction::{Statements, Transaction};
use crate::{BatchHandler, Handler};

use batch::*;

type Connect = dyn Fn() -> Pin<Box<dyn Future<Output = Result<Client, tokio_postgres::Error>> + Send>>
    + Send
    + Sync;

/// How the consumer connects to Postgres: a `tokio_postgres::Config` and a TLS connector
/// (`tokio_postgres::NoTls`, or e.g. a rustls connector). Each shard worker opens its own
/// connection and reopens it after a failure.
#[derive(Clone)]
pub struct Postgres {
    connect: Arc<Connect>,
}

impl fmt::Debug for Postgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Postgres { .. }")
    }
}

impl Postgres {
    /// Connects with `config` through `tls`.
    pub fn new<T>(config: tokio_postgres::Config, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let config = Arc::new(config);
        Postgres {
            connect: Arc::new(move || {
                let config = Arc::clone(&config);
                let tls = tls.clone();
                Box::pin(async move {
                    let (client, connection) = config.connect(tls).await?;
                    tokio::spawn(async move {
                        // A failed connection shows as an error on the client's next call.
                        let _ = connection.await;
                    });
                    Ok(client)
                })
            }),
        }
    }
}

/// What a consumer has done so far (all shards together), readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    processed: AtomicU64,
    duplicates: AtomicU64,
    handler_failures: AtomicU64,
    out_of_order: AtomicU64,
    retries: AtomicU64,
    parked: AtomicU64,
}

impl Stats {
    /// Events whose handler ran and committed (then were acknowledged).
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Deliveries of an event already recorded: acknowledged without running the handler.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Handler errors and panics (rolled back, redelivered after `retry_delay`).
    pub fn handler_failures(&self) -> u64 {
        self.handler_failures.load(Ordering::Relaxed)
    }

    /// Processed events whose ordering key did not increase for their entity.
    pub fn out_of_order(&self) -> u64 {
        self.out_of_order.load(Ordering::Relaxed)
    }

    /// Shard sessions restarted after Postgres or NATS failed.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Events parked: their handler failed `max_attempts` times, or an earlier event of
    /// their entity is parked (acknowledged, not processed).
    pub fn parked(&self) -> u64 {
        self.parked.load(Ordering::Relaxed)
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

type AfterCommit = dyn Fn(&Event) + Send + Sync;

/// Consumes the relay's stream: see the crate docs.
pub struct Consumer {
    config: Config,
    nats: async_nats::Client,
    postgres: Postgres,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    after_commit: Option<Arc<AfterCommit>>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer of `config`'s shards through `nats`, recording into `postgres`.
    pub fn new(config: Config, nats: async_nats::Client, postgres: Postgres) -> Self {
        Consumer {
            config,
            nats,
            postgres,
            stats: Arc::default(),
            metrics: Arc::default(),
            after_commit: None,
        }
    }

    /// Its Prometheus metrics and readiness, shared: keep a clone to serve them while
    /// [`Consumer::run`] runs.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Its counters, shared: keep a clone to read them while [`Consumer::run`] runs.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// Calls `hook` after an event's transaction committed and before its ack is sent (for
    /// observation and fault-injection tests; it runs on the shard's task and must be quick).
    pub fn after_commit(mut self, hook: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.after_commit = Some(Arc::new(hook));
        self
    }

    /// Consumes until `shutdown` completes or a permanent error occurs (returned; the other
    /// shards then stop too), calling `handler` for each new event. Transient failures are
    /// retried with backoff. On shutdown each shard finishes the messages in hand (commit and
    /// ack, or roll back and release them) and confirms its last ack before this returns.
    pub async fn run<H: Handler>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        self.run_with(PerEvent(handler), shutdown).await
    }

    /// [`Consumer::run`] with a handler of several events at once.
    pub async fn run_batch<H: BatchHandler>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        self.run_with(Batched(handler), shutdown).await
    }

    async fn run_with<A: Apply>(
        self,
        handler: A,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        self.config.validate()?;
        let shards = self.config.shard_list()?;
        let handler = Arc::new(handler);
        let config = Arc::new(self.config.clone());
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut workers = JoinSet::new();
        for &shard in &shards {
            let worker = Worker::new(
                shard,
                Arc::clone(&config),
                &self,
                Arc::clone(&handler),
                stop_rx.clone(),
            );
            workers.spawn(worker.run());
        }
        info!(
            stream = %config.stream,
            consumer = %config.name,
            shards = ?shards,
            partitions = config.partitions.get(),
            batch_size = config.batch_size,
            "consuming shards"
        );
        let result = supervise(&mut workers, shutdown, &stop_tx).await;
        if let Err(error) = self.nats.flush().await {
            warn!(%error, "could not flush the last acks: their messages will be redelivered and recognised as duplicates");
        }
        let stats = &self.stats;
        info!(
            processed = stats.processed(),
            duplicates = stats.duplicates(),
            handler_failures = stats.handler_failures(),
            out_of_order = stats.out_of_order(),
            "stopped"
        );
        result
    }
}

/// Waits for the shard workers: on `shutdown` or the first error every worker is told to
/// stop; returns that error once all stopped.
async fn supervise(
    workers: &mut JoinSet<Result<(), Error>>,
    shutdown: impl Future<Output = ()> + Send,
    stop_tx: &watch::Sender<bool>,
) -> Result<(), Error> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut stopping = false;
    let mut result = Ok(());
    loop {
        tokio::select! {
            () = &mut shutdown, if !stopping => {
                info!("stopping: each shard finishes the messages in hand");
                stopping = true;
                let _ = stop_tx.send(true);
            }
            joined = workers.join_next() => match joined {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(error))) => {
                    if result.is_ok() {
                        result = Err(error);
                    }
                    stopping = true;
                    let _ = stop_tx.send(true);
                }
                Some(Err(join)) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
                Some(Err(_)) => {}
            }
        }
    }
    result
}

/// How long a stopping shard waits for the server to confirm its last ack (C7).
pub const STOP_CONFIRM: Duration = Duration::from_secs(5);

/// Why the handler did not handle all events of a transaction.
pub(crate) enum Failure {
    /// It failed (or panicked) on the event at `index`, when known.
    Handler { index: Option<usize>, error: String },
    /// The consumer is stopping: the events from `index` on were not handled.
    Stopped { index: usize },
}

/// How a shard runs the application's handler on the new events of a transaction.
pub(crate) trait Apply: Send + Sync + 'static {
    fn apply(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
        stop: &watch::Receiver<bool>,
    ) -> impl Future<Output = Result<(), Failure>> + Send;
}

/// A [`Handler`], called for each event in turn: a failure names its event, and a stop
/// ends the batch after the event in hand.
struct PerEvent<H>(H);

impl<H: Handler> Apply for PerEvent<H> {
    async fn apply(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
        stop: &watch::Receiver<bool>,
    ) -> Result<(), Failure> {
        for (index, event) in events.iter().enumerate() {
            if index > 0 && *stop.borrow() {
                return Err(Failure::Stopped { index });
            }
            let handled = self.0.handle(tx, event).instrument(handle_span(event));
            if let Err(error) = handled.await {
                return Err(Failure::Handler {
                    index: Some(index),
                    error: error.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// A [`BatchHandler`]: a failure names no event.
struct Batched<H>(H);

impl<H: BatchHandler> Apply for Batched<H> {
    async fn apply(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
        _stop: &watch::Receiver<bool>,
    ) -> Result<(), Failure> {
        self.0
            .handle_batch(tx, events)
            .instrument(batch_span(events))
            .await
            .map_err(|error| Failure::Handler {
                index: None,
                error: error.to_string(),
            })
    }
}

/// One shard: its consumer, its connection, its ordering marks and the messages it holds.
struct Worker<A> {
    shard: u64,
    config: Arc<Config>,
    nats: async_nats::Client,
    jetstream: jetstream::Context,
    postgres: Postgres,
    handler: Arc<A>,
    stats: Arc<Stats>,
    metrics: Arc<Metrics>,
    after_commit: Option<Arc<AfterCommit>>,
    stop: watch::Receiver<bool>,
    /// The Postgres connection and its statements.
    client: Option<Connection>,
    order: EntityOrder,
    /// Delivered and neither acknowledged nor released, by stream sequence (C8).
    held: BTreeMap<u64, jetstream::Message>,
    /// The stream sequence of a message released for redelivery after its handler failed:
    /// nothing after it is handled before it is back (C3).
    waiting_for: Option<u64>,
    /// That message once back: handled in a transaction of its own.
    retry_alone: Option<u64>,
    /// The last message acknowledged without confirmation, confirmed on stop (C7).
    last_acked: Option<jetstream::Message>,
    /// Whether messages delivered to this shard may have been lost on their way (a process
    /// start, a session ended by NATS): the next session checks before it pulls (C8).
    unsettled: bool,
    /// While messages delivered before this session are still to come back (C8).
    recovery: Option<Recovery>,
    /// The event whose handler failed last and is to be tried again, and how often it
    /// failed (the retry delay doubles; at `max_attempts` its policy decides).
    failing: Option<Failing>,
    /// The entities of this shard with parked events (PK2, PK3).
    parked: HashSet<String>,
    /// When the shard reads the parked table next (PK3).
    next_poll: tokio::time::Instant,
    /// Whether `parked` was read through the current connection: no batch is handled
    /// before it was (PK3).
    parked_loaded: bool,
    /// Whether the parked table has `outbox_id_text`, for uuid and text ids (PK1).
    parked_text_ids: bool,
}

/// An event whose handler failed `attempts` times in a row.
#[derive(Debug, Clone, Copy)]
struct Failing {
    stream_sequence: u64,
    attempts: u32,
}

/// A shard's Postgres connection, its own statements and those its handler prepared (T2).
struct Connection {
    client: Client,
    /// Records dedupe keys, returning those that were not recorded before.
    insert: Statement,
    /// Removes dedupe keys (of events a stop left unhandled).
    remove: Statement,
    statements: Statements,
}

/// C8: the shard consumer had `remaining` messages delivered and not acknowledged when the
/// session started, all at or below stream sequence `floor`. Nothing is handled before
/// they came back, or until `until` (when every one of them was due again).
struct Recovery {
    floor: u64,
    remaining: u64,
    seen: HashSet<u64>,
    until: tokio::time::Instant,
}

/// Delivered messages of a batch and their events, in stream order.
#[derive(Default)]
struct Batch {
    messages: Vec<jetstream::Message>,
    events: Vec<Event>,
}

/// How a batch ended, after its first `settled` deliveries committed or were duplicates.
enum End {
    /// All of them.
    All,
    /// The handler failed on the delivery at `at` (found by bisection when the handler did
    /// not say): it was not committed, nor anything after it.
    Failed { at: usize, error: String },
    /// Postgres failed or the outcome of a commit is unknown: the rest is to be tried again.
    Postgres(tokio_postgres::Error),
    /// The consumer is stopping: the rest was not handled.
    Stopped,
}

/// What a committed transaction did with a slice's new events (indexes into the slice);
/// the slice's other events were duplicates.
#[derive(Debug, Default)]
struct Done {
    /// Their handler ran.
    handled: Vec<usize>,
    /// Parked behind an earlier event of their entity (PK2).
    parked: Vec<usize>,
}

impl Done {
    fn handled(handled: Vec<usize>) -> Done {
        Done {
            handled,
            parked: Vec::new(),
        }
    }
}

/// What a transaction over a slice of a batch did.
enum Tx {
    /// Committed.
    Committed(Done),
    /// Committed up to the slice's index `handled` (excluded), the rest not handled because
    /// the consumer is stopping.
    Stopped { handled: usize, done: Done },
    /// The handler failed or panicked on the slice's index `index`, when known: rolled back.
    Failed { index: Option<usize>, error: String },
}

impl<A: Apply> Worker<A> {
    fn new(
        shard: u64,
        config: Arc<Config>,
        consumer: &Consumer,
        handler: Arc<A>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Worker {
            shard,
            order: EntityOrder::new(config.order_capacity),
            config,
            nats: consumer.nats.clone(),
            jetstream: jetstream::new(consumer.nats.clone()),
            postgres: consumer.postgres.clone(),
            handler,
            stats: Arc::clone(&consumer.stats),
            metrics: Arc::clone(&consumer.metrics),
            after_commit: consumer.after_commit.clone(),
            stop,
            client: None,
            held: BTreeMap::new(),
            waiting_for: None,
            retry_alone: None,
            last_acked: None,
            unsettled: true,
            recovery: None,
            failing: None,
            parked: HashSet::new(),
            next_poll: tokio::time::Instant::now(),
            parked_loaded: false,
            parked_text_ids: true,
        }
    }

    async fn run(mut self) -> Result<(), Error> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let result = self.session(&mut backoff).await;
            self.metrics.up(self.shard, false);
            let error = match result {
                Ok(()) => return Ok(()),
                Err(Error::Unavailable(error)) => error,
                Err(error) => {
                    if matches!(error, Error::Message(_)) {
                        self.metrics.failed(Failed::Message);
                    }
                    return Err(error);
                }
            };
            self.metrics.failed(match error {
                Unavailable::Postgres(_) => Failed::Postgres,
                Unavailable::Nats { .. } => Failed::Nats,
            });
            self.metrics.retried(Retry::Session);
            // What this session held may come again, and what was on its way may be lost.
            self.held.clear();
            self.waiting_for = None;
            self.retry_alone = None;
            self.last_acked = None;
            self.unsettled = true;
            self.recovery = None;
            bump(&self.stats.retries);
            warn!(shard = self.shard, %error, retry_in = ?backoff, "shard session failed; retrying");
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = self.stop.wait_for(|stop| *stop) => return Ok(()),
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Consumes until stopped or an error.
    async fn session(&mut self, backoff: &mut Duration) -> Result<(), Error> {
        let mut stop = self.stop.clone();
        let started = tokio::select! {
            started = self.start_session() => Some(started?),
            _ = stop.wait_for(|stop| *stop) => None,
        };
        let Some(messages) = started else {
            // Stopped while connecting: nothing was delivered yet.
            return Ok(());
        };
        let mut messages = Some(messages);
        let connects = self.connects();
        self.metrics.up(self.shard, true);
        debug!(shard = self.shard, "shard session started");
        loop {
            if !self.wait_ready(&mut messages).await? {
                return self.finish(&mut messages).await;
            }
            if let Some(pull) = messages.as_mut() {
                self.gather(pull).await?;
            }
            if self.connects() != connects {
                return Err(Unavailable::nats(
                    "pull messages",
                    "the connection to NATS was re-established: messages delivered meanwhile may be lost",
                )
                .into());
            }
            let failed = match self.before_batch().await? {
                None => self.handle_batch(&mut messages).await?,
                failed => failed,
            };
            match failed {
                None => *backoff = Duration::from_millis(100),
                Some(error) => self.postgres_failed(&error, backoff).await,
            }
            if *self.stop.borrow() {
                return self.finish(&mut messages).await;
            }
        }
    }

    /// Waits until the shard holds a message it may handle (`true`), or is to finish:
    /// stopped, or the pull subscription ended (`false`). Reads the parked table when due
    /// meanwhile (PK3).
    async fn wait_ready(&mut self, messages: &mut Option<pull::Stream>) -> Result<bool, Error> {
        enum Next {
            Stop,
            Recovered,
            Poll,
            Message(Box<Option<Result<jetstream::Message, pull::MessagesError>>>),
        }
        while !self.ready() {
            let Some(pull) = messages.as_mut() else {
                return Ok(false);
            };
            let until = self.recovery.as_ref().map(|r| r.until);
            let parks = self.parks();
            let next = tokio::select! {
                biased;
                _ = self.stop.wait_for(|stop| *stop) => Next::Stop,
                () = tokio::time::sleep_until(until.unwrap_or_else(tokio::time::Instant::now)), if until.is_some() => Next::Recovered,
                () = tokio::time::sleep_until(self.next_poll), if parks => Next::Poll,
                next = pull.next() => Next::Message(Box::new(next)),
            };
            match next {
                Next::Stop => return Ok(false),
                Next::Recovered => {
                    if let Some(recovery) = self.recovery.take() {
                        warn!(shard = self.shard, missing = recovery.remaining, "messages delivered before this session did not all come back in time; going on (they were acknowledged meanwhile, or come later and are recognised by their dedupe keys)");
                    }
                }
                Next::Poll => {
                    if let Err(error) = self.poll_parked().await {
                        let error = replication::describe(&error);
                        warn!(shard = self.shard, %error, retry_in = ?PARKED_POLL, "could not read the parked table");
                    }
                }
                Next::Message(next) => self.hold(*next)?,
            }
        }
        Ok(true)
    }

    /// Connects to Postgres if needed and reads the parked table when due (PK3). Returns the
    /// Postgres error that keeps the batch from being handled now.
    async fn before_batch(&mut self) -> Result<Option<tokio_postgres::Error>, Error> {
        match self.connect_postgres().await {
            Ok(()) => Ok(self.poll_parked().await.err()),
            Err(Error::Unavailable(Unavailable::Postgres(error))) => Ok(Some(error)),
            Err(error) => Err(error),
        }
    }

    /// After Postgres failed: counted, logged, and waited for with `backoff` (doubled).
    async fn postgres_failed(&mut self, error: &tokio_postgres::Error, backoff: &mut Duration) {
        bump(&self.stats.retries);
        self.metrics.failed(Failed::Postgres);
        self.metrics.retried(Retry::Batch);
        let error = replication::describe(error);
        warn!(shard = self.shard, %error, retry_in = ?*backoff, "postgres failed; the batch will be tried again");
        let mut stop = self.stop.clone();
        tokio::select! {
            () = tokio::time::sleep(*backoff) => {}
            _ = stop.wait_for(|stop| *stop) => {}
        }
        *backoff = (*backoff * 2).min(Duration::from_secs(5));
    }

    fn connects(&self) -> u64 {
        self.nats.statistics().connects.load(Ordering::Relaxed)
    }

    /// Whether the shard holds a message it may handle now.
    fn ready(&self) -> bool {
        match self.waiting_for {
            Some(sequence) => self.held.contains_key(&sequence),
            // C8: nothing while messages delivered before this session are to come back,
            // also those at or below its floor (JetStream redelivers a released message at
            // once, one stuck on a pull request that went away only after `ack_wait`).
            None => !self.held.is_empty() && self.recovery.is_none(),
        }
    }

    /// Keeps a delivered message (a redelivery replaces the delivery it repeats).
    fn hold(
        &mut self,
        next: Option<Result<jetstream::Message, pull::MessagesError>>,
    ) -> Result<(), Error> {
        let message = match next {
            None => {
                return Err(Unavailable::nats("pull messages", "the message stream ended").into())
            }
            Some(Err(error)) => return Err(Unavailable::nats("pull messages", error).into()),
            Some(Ok(message)) => message,
        };
        let info = message
            .info()
            .map_err(|error| Unavailable::nats("read the message's ack subject", error))?;
        let sequence = info.stream_sequence;
        self.metrics.pending(self.shard, info.pending);
        self.held.insert(sequence, message);
        if let Some(recovery) = self.recovery.as_mut() {
            if sequence <= recovery.floor && recovery.seen.insert(sequence) {
                recovery.remaining = recovery.remaining.saturating_sub(1);
                if recovery.remaining == 0 {
                    debug!(
                        shard = self.shard,
                        "messages delivered before this session are back"
                    );
                    self.recovery = None;
                }
            }
        }
        Ok(())
    }

    /// Connects to Postgres if needed, creates the durable consumer, waits if messages
    /// delivered before may be lost (C8), and starts pulling.
    async fn start_session(&mut self) -> Result<pull::Stream, Error> {
        self.connect_postgres().await?;
        let consumer = self.consumer().await?;
        if self.unsettled && self.config.batch_size > 1 {
            self.recovery = self.recovery(&consumer).await?;
        }
        self.unsettled = false;
        Ok(consumer
            .stream()
            .max_messages_per_batch(self.config.batch_size)
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| Unavailable::nats("pull messages", e))?)
    }

    /// C8: messages of the shard delivered and not acknowledged before this session may
    /// have been lost on their way, and JetStream would deliver later ones before it
    /// redelivers them (after `ack_wait`): those later ones wait for them.
    async fn recovery(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
    ) -> Result<Option<Recovery>, Error> {
        let mut consumer = consumer.clone();
        let info = consumer
            .info()
            .await
            .map_err(|e| Unavailable::nats("read the durable consumer", e))?;
        if info.num_ack_pending == 0 {
            return Ok(None);
        }
        let wait = self.config.ack_wait.max(self.config.retry_delay) + SETTLE_MARGIN;
        info!(
            shard = self.shard,
            unacknowledged = info.num_ack_pending,
            up_to_stream_sequence = info.delivered.stream_sequence,
            at_most = ?wait,
            "messages delivered before were not acknowledged; later ones wait until they are back"
        );
        Ok(Some(Recovery {
            floor: info.delivered.stream_sequence,
            remaining: info.num_ack_pending as u64,
            seen: HashSet::new(),
            until: tokio::time::Instant::now() + wait,
        }))
    }

    /// Ends the pull subscription, keeping what it had delivered.
    fn end_pull(&mut self, messages: &mut Option<pull::Stream>) {
        if let Some(mut pull) = messages.take() {
            while let Some(Some(Ok(message))) = pull.next().now_or_never() {
                if let Ok(info) = message.info() {
                    let sequence = info.stream_sequence;
                    self.held.insert(sequence, message);
                }
            }
        }
    }

    /// On stop (C7), once the batch in hand is over: ends the pull subscription, releases
    /// what the shard holds and confirms its last ack.
    async fn finish(&mut self, messages: &mut Option<pull::Stream>) -> Result<(), Error> {
        self.end_pull(messages);
        // In stream order, and after a failed message with its delay: they come back after
        // it. While messages delivered before are still to come back, nothing is released:
        // all come back after `ack_wait`, in stream order.
        if self.recovery.is_none() {
            let delay = self.waiting_for.map(|_| self.config.retry_delay);
            for message in std::mem::take(&mut self.held).into_values() {
                self.release(&message, delay).await;
            }
        }
        if let Some(message) = self.last_acked.take() {
            self.confirm_ack(&message).await;
        }
        Ok(())
    }

    async fn connect_postgres(&mut self) -> Result<(), Error> {
        if self
            .client
            .as_ref()
            .is_some_and(|connection| !connection.client.is_closed())
        {
            return Ok(());
        }
        self.client = None;
        let client = (self.postgres.connect)()
            .await
            .map_err(Unavailable::Postgres)?;
        let table = &self.config.processed_table;
        let insert = client
            .prepare(&format!(
                "insert into {table} (dedupe_key) select unnest($1::text[]) \
                 on conflict do nothing returning dedupe_key"
            ))
            .await
            .map_err(|error| classify_prepare(table, error))?;
        let remove = client
            .prepare(&format!(
                "delete from {table} where dedupe_key = any($1::text[])"
            ))
            .await
            .map_err(|error| classify_prepare(table, error))?;
        if self.parks() {
            self.check_parked_table(&client).await?;
            // PK3: a new connection reads the parked entities before its first batch.
            self.parked_loaded = false;
        }
        self.client = Some(Connection {
            client,
            insert,
            remove,
            statements: Statements::default(),
        });
        Ok(())
    }

    /// Creates (or updates) the shard's durable consumer.
    async fn consumer(&self) -> Result<jetstream::consumer::PullConsumer, Error> {
        let config = &self.config;
        let stream = match self.jetstream.get_stream(&config.stream).await {
            Ok(stream) => stream,
            Err(error) => {
                use jetstream::context::GetStreamErrorKind;
                return Err(match error.kind() {
                    GetStreamErrorKind::JetStream(e)
                        if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        SetupError::StreamMissing(config.stream.clone()).into()
                    }
                    _ => Unavailable::nats("look up the stream", error).into(),
                });
            }
        };
        let durable = config.durable(self.shard);
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(durable.clone()),
                description: Some(format!(
                    "outbox-consumer {}: shard {} of {}",
                    config.name,
                    self.shard,
                    config.partitions.get()
                )),
                filter_subject: config.filter_subject(self.shard),
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                max_deliver: -1,
                // C4, C8: at most a batch of the shard delivered and not acknowledged.
                max_ack_pending: i64::try_from(config.batch_size).unwrap_or(1),
                ..Default::default()
            })
            .await;
        match consumer {
            Ok(consumer) => Ok(consumer),
            Err(error) => {
                use jetstream::stream::ConsumerErrorKind;
                Err(match error.kind() {
                    // 5xx: the server or its cluster is not ready; anything else is a refusal.
                    ConsumerErrorKind::JetStream(e) if e.code() < 500 => {
                        SetupError::ConsumerRefused {
                            stream: config.stream.clone(),
                            durable,
                            reason: e.to_string(),
                        }
                        .into()
                    }
                    _ => Unavailable::nats("create the durable consumer", error).into(),
                })
            }
        }
    }

    /// On stop (C7): acknowledges `message` again as a double ack and waits, at most
    /// [`STOP_CONFIRM`], for the server to answer it, which it does once it processed this
    /// ack and so every earlier one of the shard. Acknowledging a message twice is harmless.
    async fn confirm_ack(&self, message: &jetstream::Message) {
        match tokio::time::timeout(STOP_CONFIRM, message.double_ack()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                debug!(shard = self.shard, %error, "the last ack was not confirmed; if it was lost, the redelivery is recognised by its dedupe key");
            }
            Err(_) => {
                debug!(shard = self.shard, "the last ack was not confirmed in time; if it was lost, the redelivery is recognised by its dedupe key");
            }
        }
    }

    /// Negatively acknowledges `message`: redelivered after `delay` (at once with `None`).
    async fn release(&self, message: &jetstream::Message, delay: Option<Duration>) {
        if let Err(error) = message.ack_with(AckKind::Nak(delay)).await {
            warn!(shard = self.shard, %error, "could not release a message; it is redelivered after ack_wait");
        }
    }
}

/// How much longer than `ack_wait` a new session waits at most for unacknowledged
/// messages (C8).
const SETTLE_MARGIN: Duration = Duration::from_millis(500);

fn classify_prepare(table: &str, error: tokio_postgres::Error) -> Error {
    if is_schema_error(&error) {
        SetupError::ProcessedTable {
            table: table.to_owned(),
            reason: replication::describe(&error),
        }
        .into()
    } else {
        Unavailable::Postgres(error).into()
    }
}

/// Class 42 (undefined table or column, insufficient privilege, ...) and 3F (invalid
/// schema name): a table is not usable as it is.
fn is_schema_error(error: &tokio_postgres::Error) -> bool {
    error
        .code()
        .is_some_and(|code| code.code().starts_with("42") || *code == SqlState::INVALID_SCHEMA_NAME)
}
