//! The shard workers: one durable pull consumer, one Postgres connection and one task per
//! shard. See the crate docs for the invariants C1–C7 they keep.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Socket, Statement};
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::error::{Error, Problem, SetupError, Unavailable};
use crate::event::{Event, MessageError};
use crate::order::{ordering_key, EntityOrder};
use crate::Handler;

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
            after_commit: None,
        }
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
    /// shards then stop too). Transient failures are retried with backoff. On shutdown each
    /// shard finishes the message in hand (commit and ack, or roll back and nak) and the
    /// acks are flushed before this returns.
    pub async fn run<H: Handler>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        self.config.validate()?;
        let shards = self.config.shard_list()?;
        let handler = Arc::new(handler);
        let config = Arc::new(self.config);
        let (stop_tx, stop_rx) = watch::channel(false);
        let jetstream = jetstream::new(self.nats.clone());
        let mut workers = JoinSet::new();
        for &shard in &shards {
            let worker = Worker {
                shard,
                config: Arc::clone(&config),
                jetstream: jetstream.clone(),
                postgres: self.postgres.clone(),
                handler: Arc::clone(&handler),
                stats: Arc::clone(&self.stats),
                after_commit: self.after_commit.clone(),
                stop: stop_rx.clone(),
                client: None,
                order: EntityOrder::new(config.order_capacity),
            };
            workers.spawn(worker.run());
        }
        info!(
            stream = %config.stream,
            consumer = %config.name,
            shards = ?shards,
            partitions = config.partitions.get(),
            "consuming shards"
        );
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stopping = false;
        let mut result = Ok(());
        loop {
            tokio::select! {
                () = &mut shutdown, if !stopping => {
                    info!("stopping: each shard finishes the message in hand");
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

/// How long a stopping shard waits for the server to confirm its last ack (C7).
pub const STOP_CONFIRM: Duration = Duration::from_secs(5);

/// One shard: its consumer, its connection, its ordering marks.
struct Worker<H> {
    shard: u64,
    config: Arc<Config>,
    jetstream: jetstream::Context,
    postgres: Postgres,
    handler: Arc<H>,
    stats: Arc<Stats>,
    after_commit: Option<Arc<AfterCommit>>,
    stop: watch::Receiver<bool>,
    client: Option<(Client, Statement)>,
    order: EntityOrder,
}

/// The answer to a delivery: an ack after commit (or for a duplicate), a nak with the retry
/// delay after a handler failure.
struct Reply {
    message: jetstream::Message,
    kind: AckKind,
    outbox_id: i64,
}

impl Reply {
    fn ack(message: jetstream::Message, event: &Event) -> Reply {
        Reply {
            message,
            kind: AckKind::Ack,
            outbox_id: event.id,
        }
    }
}

/// How one delivery's transaction ended.
enum Outcome {
    /// The dedupe key was already recorded: nothing ran.
    Duplicate,
    /// The handler ran and its transaction committed.
    Committed,
    /// The handler failed or panicked: rolled back.
    HandlerFailed(String),
}

impl<H: Handler> Worker<H> {
    async fn run(mut self) -> Result<(), Error> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match self.session(&mut backoff).await {
                Ok(()) => return Ok(()),
                Err(Error::Unavailable(error)) => error,
                Err(error) => return Err(error),
            };
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
        let Some(mut messages) = started else {
            // Stopped while connecting: nothing was delivered yet.
            return Ok(());
        };
        debug!(shard = self.shard, "shard session started");
        // C7: the last message acknowledged without confirmation, confirmed on stop.
        let mut last_acked: Option<jetstream::Message> = None;
        loop {
            let next = tokio::select! {
                biased;
                _ = self.stop.wait_for(|stop| *stop) => None,
                next = messages.next() => Some(next),
            };
            let Some(next) = next else {
                self.hand_back(messages).await;
                if let Some(message) = last_acked {
                    self.confirm_ack(&message).await;
                }
                return Ok(());
            };
            let message = match next {
                None => {
                    return Err(
                        Unavailable::nats("pull messages", "the message stream ended").into(),
                    )
                }
                Some(Err(error)) => return Err(Unavailable::nats("pull messages", error).into()),
                Some(Ok(message)) => message,
            };
            let reply = self.handle(message).await?;
            *backoff = Duration::from_millis(100);
            if *self.stop.borrow() {
                // Unsubscribe before the ack, so that JetStream has nowhere to deliver the
                // shard's next message once it sees the ack.
                self.hand_back(messages).await;
                if matches!(reply.kind, AckKind::Ack) {
                    self.confirm_ack(&reply.message).await;
                } else {
                    self.reply(&reply).await;
                    if let Some(message) = last_acked {
                        self.confirm_ack(&message).await;
                    }
                }
                return Ok(());
            }
            self.reply(&reply).await;
            if matches!(reply.kind, AckKind::Ack) {
                last_acked = Some(reply.message);
            }
        }
    }

    /// Connects to Postgres if needed, creates the durable consumer and starts pulling.
    async fn start_session(&mut self) -> Result<pull::Stream, Error> {
        self.connect_postgres().await?;
        let consumer = self.consumer().await?;
        Ok(consumer
            .stream()
            .max_messages_per_batch(64)
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| Unavailable::nats("pull messages", e))?)
    }

    /// On stop: ends the pull subscription, then releases the messages already delivered but
    /// not handled for immediate redelivery (to the next consumer of the shard) rather than
    /// leaving them to wait for `ack_wait`. Best effort: a message still on the wire waits
    /// for `ack_wait`.
    async fn hand_back(&self, mut messages: pull::Stream) {
        let mut unhandled = Vec::new();
        while let Some(Some(Ok(message))) = messages.next().now_or_never() {
            unhandled.push(message);
        }
        drop(messages);
        for message in unhandled {
            if let Err(error) = message.ack_with(AckKind::Nak(None)).await {
                debug!(shard = self.shard, %error, "could not release an unhandled message; it is redelivered after ack_wait");
            }
        }
    }

    async fn connect_postgres(&mut self) -> Result<(), Error> {
        if self
            .client
            .as_ref()
            .is_some_and(|(client, _)| !client.is_closed())
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
                "insert into {table} (dedupe_key) values ($1) on conflict do nothing"
            ))
            .await
            .map_err(|error| classify_prepare(table, error))?;
        self.client = Some((client, insert));
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
                // C4: one message of the shard at a time, redeliveries before later ones.
                max_ack_pending: 1,
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

    /// One delivery (C1–C6): what to answer JetStream, once the transaction is over.
    async fn handle(&mut self, message: jetstream::Message) -> Result<Reply, Error> {
        let (stream_sequence, delivered) = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                u64::try_from(info.delivered).unwrap_or(0),
            ),
            Err(error) => {
                return Err(Unavailable::nats("read the message's ack subject", error).into())
            }
        };
        let event = Event::decode(
            message.subject.as_str(),
            message.headers.as_ref(),
            message.payload.clone(),
            stream_sequence,
            delivered,
        )?;
        let computed = outbox::shard_for_key(self.config.partitions, &event.keys.partition_key);
        if event.shard != self.shard || computed != self.shard {
            return Err(MessageError {
                stream_sequence,
                subject: event.subject,
                problem: Problem::WrongShard {
                    published: event.shard,
                    computed,
                    partitions: self.config.partitions.get(),
                },
            }
            .into());
        }

        // Reconnects if the connection was lost (a handler's failure may have been its).
        if let Err(error) = self.connect_postgres().await {
            self.nak(&message).await;
            return Err(error);
        }
        let outcome = self.transact(&event).await;
        let retry_delay = self.config.retry_delay;
        match outcome {
            Ok(Outcome::Duplicate) => {
                bump(&self.stats.duplicates);
                debug!(
                    shard = self.shard,
                    outbox_id = event.id,
                    stream_sequence,
                    delivered,
                    "already processed; acknowledging"
                );
                Ok(Reply::ack(message, &event))
            }
            Ok(Outcome::Committed) => {
                if let Some(hook) = &self.after_commit {
                    hook(&event);
                }
                bump(&self.stats.processed);
                let order = event.order();
                if let Some(mark) = self.order.regression(&event.entity_id, order) {
                    bump(&self.stats.out_of_order);
                    warn!(
                        shard = self.shard,
                        outbox_id = event.id,
                        stream_sequence,
                        ordering_key = %event.keys.ordering_key,
                        processed_before = %ordering_key(mark),
                        "out of order: this event's ordering key is not above one its entity already processed"
                    );
                }
                self.order.record(&event.entity_id, order);
                Ok(Reply::ack(message, &event))
            }
            Ok(Outcome::HandlerFailed(error)) => {
                bump(&self.stats.handler_failures);
                warn!(
                    shard = self.shard,
                    outbox_id = event.id,
                    stream_sequence,
                    delivered,
                    %error,
                    retry_in = ?retry_delay,
                    "handler failed; rolled back, the message will be redelivered"
                );
                Ok(Reply {
                    message,
                    kind: AckKind::Nak(Some(retry_delay)),
                    outbox_id: event.id,
                })
            }
            Err(error) => {
                // The transaction did not commit, or its commit's outcome is unknown: the
                // redelivery finds out through the dedupe key (C3).
                self.nak(&message).await;
                Err(Unavailable::Postgres(error).into())
            }
        }
    }

    /// The transaction: dedupe key first, then the handler, then commit (C1–C3).
    async fn transact(&mut self, event: &Event) -> Result<Outcome, tokio_postgres::Error> {
        let Some((client, insert)) = self.client.as_mut() else {
            unreachable!("a session connects before it reads messages");
        };
        let mut tx = client.transaction().await?;
        if tx.execute(&*insert, &[&event.keys.dedupe_key]).await? == 0 {
            tx.rollback().await?;
            return Ok(Outcome::Duplicate);
        }
        let result = AssertUnwindSafe(self.handler.handle(&mut tx, event))
            .catch_unwind()
            .await;
        let failure = match result {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(panic) => Some(format!("handler panicked: {}", panic_message(&*panic))),
        };
        if let Some(failure) = failure {
            // A failed rollback leaves nothing committed either.
            let _ = tx.rollback().await;
            return Ok(Outcome::HandlerFailed(failure));
        }
        tx.commit().await?;
        Ok(Outcome::Committed)
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

    async fn reply(&self, reply: &Reply) {
        if let Err(error) = reply.message.ack_with(reply.kind).await {
            // C1 holds either way: a redelivery finds out through the dedupe key.
            warn!(shard = self.shard, outbox_id = reply.outbox_id, %error, "could not answer JetStream; the message will be redelivered after ack_wait");
        }
    }

    async fn nak(&self, message: &jetstream::Message) {
        if let Err(error) = message
            .ack_with(AckKind::Nak(Some(self.config.retry_delay)))
            .await
        {
            warn!(shard = self.shard, %error, "nak failed; the message will be redelivered after ack_wait");
        }
    }
}

fn classify_prepare(table: &str, error: tokio_postgres::Error) -> Error {
    // Class 42 (undefined table or column, insufficient privilege, ...) and 3F (invalid
    // schema name): the table is not usable as it is.
    let permanent = error.code().is_some_and(|code| {
        code.code().starts_with("42") || *code == SqlState::INVALID_SCHEMA_NAME
    });
    if permanent {
        SetupError::ProcessedTable {
            table: table.to_owned(),
            reason: error
                .as_db_error()
                .map_or_else(|| error.to_string(), |db| db.message().to_owned()),
        }
        .into()
    } else {
        Unavailable::Postgres(error).into()
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
