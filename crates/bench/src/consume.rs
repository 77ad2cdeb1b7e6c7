//! **Consumer throughput and latency**: `outbox-consumer` applying the relay's events, one
//! side effect per event, in the Postgres transaction that records its `dedupe_key`; once
//! with `batch_size = 1` (one transaction and one ack per event) and once with the default
//! batch size.
//!
//! - The events are those the relay publishes for the seed-like rows of [`crate::load`]
//!   (1 000 entities, `OrderPaid`, the relay's headers).
//! - The consumer runs in this process on the relay's 12 shards (12 durable consumers,
//!   tasks and Postgres connections), with a handler like the README's: one `INSERT` into a
//!   ledger table through the transaction. Per batch: `BEGIN`, one dedupe insert for the
//!   batch, the handler's insert per event, `COMMIT`, then an ack per event.
//! - [`consume`]: a backlog published pipelined to a fresh stream before the consumer
//!   starts ([`crate::ceilings::publish_pipelined`]). events/s: the backlog divided by the
//!   time from starting the consumer to the last event processed (start-up, creating the
//!   durable consumers, included); CPU µs/event: this process (the consumer; nothing else
//!   runs in it meanwhile), the consumer's Postgres backends (reaped by the postmaster once
//!   its connections closed) and nats-server, over the same time.
//! - [`live`]: events published at a fixed rate while the consumer runs; latency from the
//!   publish ack (the event is stored) to the commit of its transaction (the consumer's
//!   `after_commit` hook), p50 and p99.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use outbox::{OutboxEvent, OutboxRow, Position};
use outbox_consumer::{BoxError, Config, Consumer, Event, Handler, Postgres, Transaction};
use pgoutput::Lsn;

use crate::ceilings;
use crate::harness::{Bench, Case};
use crate::load;
use crate::procfs;
use crate::report::{Results, Unit};

/// How long applying a backlog may take before the benchmark gives up.
const TIMEOUT: Duration = Duration::from_secs(900);

/// What one pass cost.
#[derive(Debug, Clone, Copy)]
pub struct Consumed {
    pub seconds: f64,
    pub consumer_cpu: f64,
    pub backends_cpu: f64,
    pub server_cpu: f64,
}

/// The side effect: the example binary's, the README's handler (one statement per batch).
#[path = "../../consumer/src/bin/example/ledger.rs"]
mod ledger;

use ledger::Ledger;

/// How the ledger rows are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handling {
    /// A [`Handler`]: one `INSERT` per event (docs/consumers.md), its text prepared once
    /// per connection by the library's [`Transaction`].
    PerEvent,
    /// A [`BatchHandler`]: one `INSERT … SELECT unnest(…)` per transaction (the README's).
    Batch,
}

/// Runs `consumer` with the ledger handler written as `handling`.
pub fn run(
    consumer: Consumer,
    handling: Handling,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<(), outbox_consumer::Error>> {
    let shutdown = async {
        let _ = stopped.await;
    };
    match handling {
        Handling::PerEvent => tokio::spawn(consumer.run(Ledger, shutdown)),
        Handling::Batch => tokio::spawn(consumer.run_batch(Ledger, shutdown)),
    }
}

/// The per-event handler of docs/consumers.md: one statement per event, its text prepared
/// once per connection by the library's [`Transaction`].
impl Handler for Ledger {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), BoxError> {
        tx.execute(
            "insert into ledger (outbox_id, entity_id, event_type, payload) \
             values ($1, $2, $3, $4::text::jsonb)",
            &[
                &event.id.to_string(),
                &event.entity_id,
                &event.event_type,
                &event.payload_str()?,
            ],
        )
        .await?;
        Ok(())
    }
}

/// `processed_events` and the example's ledger table in `case`'s database.
pub async fn ledger(case: &Case) -> Result<()> {
    case.sql
        .batch_execute(outbox_consumer::SCHEMA_SQL)
        .await
        .context("apply sql/consumer.sql")?;
    case.sql.batch_execute(ledger::LEDGER_SQL).await?;
    Ok(())
}

/// The ledger table, `processed_events` and a fresh stream for `case`.
async fn prepare(bench: &Bench, case: &Case) -> Result<()> {
    ledger(case).await?;
    bench.create_stream(&case.stream, &case.prefix).await
}

/// The events the relay publishes for outbox ids `1..=n`.
pub fn relay_events(case: &Case, n: u64) -> Vec<OutboxEvent> {
    (1..=n as i64)
        .map(|id| {
            OutboxRow::seed(
                id,
                format!("entity-{}", id % 1000),
                "OrderPaid",
                format!("{{\"amount\": 10, \"order_id\": {id}}}"),
                1_700_000_000_000 + id,
            )
            .into_event(
                &case.prefix,
                load::PARTITIONS,
                Position {
                    commit_lsn: Lsn(id as u64),
                    index: 0,
                },
            )
        })
        .collect()
}

/// The consumer of `case`'s stream, `batch_size` messages per transaction.
pub async fn consumer(bench: &Bench, case: &Case, batch_size: usize) -> Result<Consumer> {
    consumer_of(bench, case, &case.stream, &case.prefix, batch_size).await
}

/// The consumer of `stream` (subjects `{prefix}.{shard}.>`) into `case`'s database,
/// `batch_size` messages per transaction.
pub async fn consumer_of(
    bench: &Bench,
    case: &Case,
    stream: &str,
    prefix: &str,
    batch_size: usize,
) -> Result<Consumer> {
    let mut config = Config::new("bench");
    config.stream = stream.to_owned();
    config.subject_prefix = prefix.to_owned();
    config.partitions = load::PARTITIONS;
    config.batch_size = batch_size;
    let nats = async_nats::connect(bench.nats.url()).await?;
    let postgres = Postgres::new(case.pg_url.parse()?, tokio_postgres::NoTls);
    Ok(Consumer::new(config, nats, postgres))
}

/// Waits until `stats` counts `events` processed, or the consumer stopped, or [`TIMEOUT`].
pub async fn wait_processed(
    stats: &outbox_consumer::Stats,
    running: &tokio::task::JoinHandle<Result<(), outbox_consumer::Error>>,
    events: u64,
) -> Result<()> {
    wait_counted(|| stats.processed(), || running.is_finished(), events).await
}

/// Waits until `count()` reaches `events`; fails once `stopped()` (the applier ended early)
/// or after [`TIMEOUT`].
pub async fn wait_counted(
    count: impl Fn() -> u64,
    stopped: impl Fn() -> bool,
    events: u64,
) -> Result<()> {
    let start = Instant::now();
    while count() < events {
        if stopped() {
            bail!("the consumer stopped early");
        }
        if start.elapsed() > TIMEOUT {
            bail!(
                "the consumer applied {} of {events} events in {TIMEOUT:?}",
                count()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Checks that every event was applied once.
pub async fn check_applied(case: &Case, events: u64, duplicates: u64) -> Result<()> {
    let applied: i64 = case
        .sql
        .query_one("select count(distinct outbox_id) from ledger", &[])
        .await?
        .get(0);
    if applied != events as i64 || duplicates != 0 {
        bail!("consumer: {applied} of {events} events applied, {duplicates} duplicates");
    }
    Ok(())
}

/// Publishes `events` relay events to a fresh stream of `case` and applies them with the
/// consumer, `batch_size` per transaction.
pub async fn consume(
    bench: &Bench,
    case: &Case,
    events: u64,
    batch_size: usize,
    handling: Handling,
) -> Result<Consumed> {
    prepare(bench, case).await?;
    let backlog = relay_events(case, events);
    let js = ceilings::pipelined_context(bench).await?;
    let stored = ceilings::publish_pipelined(&js, &backlog).await?;
    if stored != events {
        bail!("consumer: {stored} of {events} events were stored");
    }
    drop(backlog);

    let consumer = consumer(bench, case, batch_size).await?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();

    let postmaster = bench.pg.pid();
    let me = std::process::id();
    let before = [
        procfs::cpu_seconds(me)?,
        procfs::reaped_children_cpu_seconds(postmaster)?,
        procfs::cpu_seconds(bench.nats.pid())?,
    ];
    let start = Instant::now();
    let running = run(consumer, handling, stopped);
    wait_processed(&stats, &running, events).await?;
    let seconds = start.elapsed().as_secs_f64();
    let consumer_cpu = procfs::cpu_seconds(me)? - before[0];
    let server_cpu = procfs::cpu_seconds(bench.nats.pid())? - before[2];
    let _ = stop.send(());
    running.await??;
    // The consumer's connections are closed: once their backends exited, the postmaster
    // has reaped their CPU time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let backends_cpu = procfs::reaped_children_cpu_seconds(postmaster)? - before[1];
    check_applied(case, events, stats.duplicates()).await?;
    Ok(Consumed {
        seconds,
        consumer_cpu,
        backends_cpu,
        server_cpu,
    })
}

/// A latency at a fixed rate: the rate achieved, p50 and p99.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    pub achieved_rate: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Live {
    /// The quantiles of `latencies` (milliseconds, not empty).
    pub fn of(achieved_rate: f64, mut latencies: Vec<f64>) -> Live {
        latencies.sort_by(f64::total_cmp);
        let quantile = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
        Live {
            achieved_rate,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
        }
    }
}

/// Publishes relay events at `rate` for `duration` while the consumer (`batch_size` per
/// transaction) applies them: the time from each publish ack to its commit.
pub async fn live(
    bench: &Bench,
    case: &Case,
    rate: f64,
    duration: Duration,
    batch_size: usize,
    handling: Handling,
) -> Result<Live> {
    prepare(bench, case).await?;
    let n = (rate * duration.as_secs_f64()).max(1.0) as u64;
    let events = relay_events(case, n);
    let committed: Arc<Mutex<Vec<Option<Instant>>>> =
        Arc::new(Mutex::new(vec![None; n as usize + 1]));
    let marks = Arc::clone(&committed);
    let consumer = consumer(bench, case, batch_size)
        .await?
        .after_commit(move |event| {
            if let Ok(mut marks) = marks.lock() {
                if let Some(mark) = marks.get_mut(event.id.as_int().unwrap_or(-1) as usize) {
                    *mark = Some(Instant::now());
                }
            }
        });
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = run(consumer, handling, stopped);
    // Publish once every shard's durable consumer exists.
    let js = ceilings::pipelined_context(bench).await?;
    let ready = Instant::now();
    loop {
        let mut stream = js.get_stream(&case.stream).await?;
        if stream.info().await?.state.consumer_count >= load::PARTITIONS.get() as usize {
            break;
        }
        if ready.elapsed() > Duration::from_secs(30) || running.is_finished() {
            bail!("the consumer did not create its durable consumers");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let (acks_tx, mut acks_rx) =
        tokio::sync::mpsc::channel::<jetstream::context::PublishAckFuture>(ceilings::WINDOW);
    let acker = tokio::spawn(async move {
        let mut stored = Vec::with_capacity(n as usize);
        while let Some(ack) = acks_rx.recv().await {
            ack.await.context("publish ack")?;
            stored.push(Instant::now());
        }
        anyhow::Ok(stored)
    });
    let start = tokio::time::Instant::now();
    for (i, event) in events.iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let ack = js
            .send_publish(event.subject.clone(), sink::publish_message(event))
            .await
            .context("publish")?;
        if acks_tx.send(ack).await.is_err() {
            break;
        }
    }
    let achieved_rate = n as f64 / start.elapsed().as_secs_f64();
    drop(acks_tx);
    let stored = acker.await??;
    wait_processed(&stats, &running, n).await?;
    let _ = stop.send(());
    running.await??;
    check_applied(case, n, stats.duplicates()).await?;

    let marks = committed
        .lock()
        .map_err(|_| anyhow::anyhow!("a commit hook panicked"))?;
    let latencies: Vec<f64> = stored
        .iter()
        .enumerate()
        .filter_map(|(i, stored)| {
            marks[i + 1].map(|commit| commit.saturating_duration_since(*stored).as_secs_f64() * 1e3)
        })
        .collect();
    if latencies.len() as u64 != n {
        bail!("{} of {n} commits were seen", latencies.len());
    }
    Ok(Live::of(achieved_rate, latencies))
}

/// The consumer's rate at which [`scenario`] measures stored → committed latency.
const LIVE_RATE: f64 = 2_000.0;

/// What [`scenario`] compares: one event per transaction and the default batch size with a
/// per-event handler (docs/consumers.md), and the default with the README's batch handler.
pub const CONFIGURATIONS: [(usize, Handling); 3] = [
    (1, Handling::PerEvent),
    (outbox_consumer::DEFAULT_BATCH_SIZE, Handling::PerEvent),
    (outbox_consumer::DEFAULT_BATCH_SIZE, Handling::Batch),
];

const RATE: &str = "side effects/s (dedupe insert + handler insert, then ack)";
const CPU_TOTAL: &str = "CPU, the three together";
pub const VS_ONE: &str = "side effects/s ÷ batch size 1 (same run)";
pub const VS_PUBLISHING: &str = "CPU ÷ the publishing side's on the relay drain (same run)";

pub fn label(events: u64, batch_size: usize, handling: Handling) -> String {
    let handler = match handling {
        Handling::PerEvent => ", a per-event handler (one INSERT per event)",
        Handling::Batch => ", the README's batch handler (one INSERT per transaction)",
    };
    if batch_size == 1 {
        format!(
            "consumer: {} events on 12 shards, batch size 1 (one transaction each){handler}",
            Unit::Rate.format(events as f64)
        )
    } else {
        format!(
            "consumer: {} events on 12 shards, batch size {batch_size} (the default){handler}",
            Unit::Rate.format(events as f64)
        )
    }
}

/// outbox-consumer applying a backlog, one side effect per event, and its latency at a
/// fixed rate, for each of [`CONFIGURATIONS`]; with this run's relay drain
/// (`drain`: events/s, publishing CPU µs/event), each one's CPU per side effect over the
/// publishing side's. Returns the README's handler's side effects/s and CPU µs/event.
pub async fn scenario(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    live_seconds: Duration,
    drain: Option<(f64, f64)>,
) -> Result<Option<(f64, f64)>> {
    let mut one_rate = None;
    let mut readmes = None;
    for (batch_size, handling) in CONFIGURATIONS {
        let label = label(events, batch_size, handling);
        let case = bench.case("consumer").await?;
        let consumed = consume(bench, &case, events, batch_size, handling).await?;
        let stream = case.stream.clone();
        bench.drop_case(case, &[&stream]).await?;
        let n = events as f64;
        let rate = n / consumed.seconds;
        results.record(&label, RATE, Unit::Rate, rate);
        match one_rate {
            None => one_rate = Some(rate),
            Some(one) => results.record(&label, VS_ONE, Unit::Ratio, rate / one),
        }
        let cpu = [
            ("consumer CPU", consumed.consumer_cpu),
            ("its Postgres backends CPU", consumed.backends_cpu),
            ("nats-server CPU", consumed.server_cpu),
        ];
        let total = results.record_cpu(&label, &cpu, n, CPU_TOTAL);
        if let Some((_, publishing)) = drain {
            results.record(&label, VS_PUBLISHING, Unit::Ratio, total / publishing);
        }
        if handling == Handling::Batch {
            readmes = Some((rate, total));
        }

        let case = bench.case("consumer_live").await?;
        let live = live(bench, &case, LIVE_RATE, live_seconds, batch_size, handling).await?;
        let stream = case.stream.clone();
        bench.drop_case(case, &[&stream]).await?;
        let at = Unit::Rate.format(LIVE_RATE);
        results.record(
            &label,
            &format!("stored → committed p50 at {at} events/s"),
            Unit::Millis,
            live.p50_ms,
        );
        results.record(
            &label,
            &format!("stored → committed p99 at {at} events/s"),
            Unit::Millis,
            live.p99_ms,
        );
        eprintln!(
            "bench: {label}: {rate:.0}/s; CPU µs/event: consumer {:.1}, backends {:.1}, nats {:.1}, total {:.1}; \
             at {:.0}/s stored → committed p50 {:.2} ms, p99 {:.2} ms",
            consumed.consumer_cpu * 1e6 / n,
            consumed.backends_cpu * 1e6 / n,
            consumed.server_cpu * 1e6 / n,
            total,
            live.achieved_rate,
            live.p50_ms,
            live.p99_ms,
        );
    }
    Ok(readmes)
}
