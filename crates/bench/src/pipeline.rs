//! **The pipeline to the side effect** (issue 44): Postgres → the relay → JetStream →
//! `outbox-consumer` applying the README's handler (a batch's ledger rows in one statement,
//! in the transaction that records their `dedupe_key`s), all running at once.
//!
//! - [`backlog`]: a backlog of 1 000-row transactions written after `outbox-relay init`
//!   (as the relay's drain), then the consumer (in this process, the default batch size) and
//!   the relay started together. side effects/s: the backlog over the time from starting
//!   them to the last event's transaction committed; CPU µs/event over the same time: the
//!   relay, its walsender, nats-server (storing and delivering), the consumer (this
//!   process; nothing else runs in it meanwhile) and the consumer's Postgres backends
//!   (reaped by the postmaster once its connections closed, while the walsender still runs).
//! - [`seed_pair`]: the seed's own pair on the same backlog, for reference: its polling loop
//!   and a consumer of one event per transaction, at once; side effects/s.
//! - [`live`]: with both caught up, one writer connection per 2 500 events/s commits
//!   single-row transactions at a fixed rate; an event's latency is from just before its
//!   `INSERT` was sent (so a little before the row's `created_at`) to the consumer's commit
//!   of its side effect (the `after_commit` hook), same clock: p50 and p99; also to the
//!   message's store time in the stream (the server's clock, same machine).
//! - [`floor_scenario`]: [`live`] at 1 000 events/s with outbox-consumer, then with the
//!   servers' floor ([`floor`]) in its place, which also tells when each message was
//!   delivered to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::consume::{self, Handling, Live};
use crate::floor::{self, Floor, Stage};
use crate::harness::{connect_sql, Bench, Case};
use crate::latency::now_nanos;
use crate::report::{Results, Unit};
use crate::{latency, load, polling, procfs};

/// What the backlog's pipeline cost.
#[derive(Debug, Clone, Copy)]
pub struct Piped {
    pub seconds: f64,
    pub relay_cpu: f64,
    pub walsender_cpu: f64,
    pub nats_cpu: f64,
    pub consumer_cpu: f64,
    pub backends_cpu: f64,
}

/// Runs the relay and the consumer together on a backlog of `events` in `per_tx`-row
/// transactions, until every side effect committed.
pub async fn backlog(bench: &Bench, case: &Case, events: u64, per_tx: u64) -> Result<Piped> {
    bench.relay_init(case)?;
    consume::ledger(case).await?;
    load::write_batched(&case.sql, events, per_tx).await?;
    let consumer = consume::consumer(bench, case, outbox_consumer::DEFAULT_BATCH_SIZE).await?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (postmaster, me) = (bench.pg.pid(), std::process::id());
    let before = [
        procfs::cpu_seconds(me)?,
        procfs::reaped_children_cpu_seconds(postmaster)?,
        procfs::cpu_seconds(bench.nats.pid())?,
    ];
    let start = Instant::now();
    let running = consume::run(consumer, Handling::Batch, stopped);
    let mut relay = case.spawn_relay();
    consume::wait_processed(&stats, &running, events).await?;
    let seconds = start.elapsed().as_secs_f64();
    let consumer_cpu = procfs::cpu_seconds(me)? - before[0];
    let nats_cpu = procfs::cpu_seconds(bench.nats.pid())? - before[2];
    let relay_cpu = procfs::cpu_seconds(relay.pid())?;
    let walsender_cpu = match bench.walsender_pid(&case.slot).await? {
        Some(pid) => procfs::cpu_seconds(pid)?,
        None => f64::NAN,
    };
    let _ = stop.send(());
    running.await??;
    // The consumer's backends are gone and reaped; the walsender is not (the relay runs).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let backends_cpu = procfs::reaped_children_cpu_seconds(postmaster)? - before[1];
    tokio::task::spawn_blocking(move || relay.terminate(Duration::from_secs(60))).await?;
    consume::check_applied(case, events, stats.duplicates()).await?;
    Ok(Piped {
        seconds,
        relay_cpu,
        walsender_cpu,
        nats_cpu,
        consumer_cpu,
        backends_cpu,
    })
}

/// The seed's own pair on a backlog of `events` in `per_tx`-row transactions, run at once:
/// its polling publisher ([`polling::Variant::PerRow`], the seed's loop: claim 50 rows, per
/// row publish, await the ack, `UPDATE`) and a consumer of one event per transaction, as the
/// seed's `consumer.py` (outbox-consumer at batch size 1 with the per-event handler: its
/// dedupe insert and the side effect, then the ack). Returns side effects/s.
pub async fn seed_pair(bench: &Bench, case: &Case, events: u64, per_tx: u64) -> Result<f64> {
    consume::ledger(case).await?;
    load::write_batched(&case.sql, events, per_tx).await?;
    let (prefix, stream) = polling::stream_of(case);
    bench.create_stream(&stream, &prefix).await?;
    let consumer = consume::consumer_of(bench, case, &stream, &prefix, 1).await?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let start = Instant::now();
    let running = consume::run(consumer, Handling::PerEvent, stopped);
    let variant = polling::Variant::PerRow { limit: 50 };
    polling::drain(bench, case, variant, events, &stream, &prefix).await?;
    consume::wait_processed(&stats, &running, events).await?;
    let seconds = start.elapsed().as_secs_f64();
    let _ = stop.send(());
    running.await??;
    consume::check_applied(case, events, stats.duplicates()).await?;
    Ok(events as f64 / seconds)
}

const INSERT_ONE: &str = "insert into outbox_events \
        (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
    values ('entity-' || ($1::bigint % 1000), 'OrderPaid', 'live-' || $1::bigint, 'tmp', 'tmp', \
            jsonb_build_object('order_id', $1::bigint, 'amount', 10)) \
    returning id";

/// Events written before the measured ones (through the whole pipeline, not counted).
const WARM_UP: u64 = 100;

/// What applies the events in [`live`]: the library, or the servers' floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applier {
    /// `outbox-consumer` with the README's handler.
    Library,
    /// The thinnest client doing the same server work ([`floor`]).
    Floor(Floor),
}

/// The applier running in [`live`].
enum Running {
    Library {
        stop: tokio::sync::oneshot::Sender<()>,
        task: tokio::task::JoinHandle<Result<(), outbox_consumer::Error>>,
        stats: Arc<outbox_consumer::Stats>,
    },
    Floor {
        stop: tokio::sync::watch::Sender<bool>,
        tasks: Vec<tokio::task::JoinHandle<Result<()>>>,
    },
}

impl Running {
    async fn start(
        bench: &Bench,
        case: &Case,
        applier: Applier,
        mark: impl Fn(Stage, i64) + Clone + Send + Sync + 'static,
    ) -> Result<Running> {
        let batch_size = outbox_consumer::DEFAULT_BATCH_SIZE;
        Ok(match applier {
            Applier::Library => {
                let consumer = consume::consumer(bench, case, batch_size)
                    .await?
                    .after_commit(move |event| {
                        if let Some(id) = event.id.as_int() {
                            mark(Stage::Committed, id);
                        }
                    });
                let stats = consumer.stats();
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let task = consume::run(consumer, Handling::Batch, stopped);
                Running::Library { stop, task, stats }
            }
            Applier::Floor(how) => {
                let (stop, stopped) = tokio::sync::watch::channel(false);
                let tasks = floor::start(bench, case, how, batch_size, mark, stopped).await?;
                Running::Floor { stop, tasks }
            }
        })
    }

    /// Waits until `seen` counts `events` ([`consume::wait_counted`]).
    async fn wait(&self, seen: &AtomicU64, events: u64) -> Result<()> {
        let stopped = || match self {
            Running::Library { task, .. } => task.is_finished(),
            Running::Floor { tasks, .. } => tasks.iter().any(|t| t.is_finished()),
        };
        consume::wait_counted(|| seen.load(Ordering::Relaxed), stopped, events).await
    }

    /// Stops the applier; the duplicates it recognised.
    async fn stop(self) -> Result<u64> {
        match self {
            Running::Library { stop, task, stats } => {
                let _ = stop.send(());
                task.await??;
                Ok(stats.duplicates())
            }
            Running::Floor { stop, tasks } => {
                let _ = stop.send(true);
                for task in tasks {
                    task.await??;
                }
                Ok(0)
            }
        }
    }
}

/// insert → each stage, ms: stored in the stream (the server's store time), delivered to
/// the applier (the floor only), its side effect committed.
pub struct Stages {
    pub stored: Live,
    pub delivered: Option<Live>,
    pub committed: Live,
    /// CPU the hypervisor gave to something else while the VM wanted it, µs per event, over
    /// the measured writes (`steal` of `/proc/stat`).
    pub stolen_us: f64,
}

/// When each event was delivered (the floor only) and committed, nanoseconds.
#[derive(Default)]
struct Marks {
    delivered: HashMap<i64, i128>,
    committed: HashMap<i64, i128>,
}

/// Runs the relay and `applier`, then writes single-row transactions at `rate` for
/// `duration` with `writers` connections: insert → stored, delivered to the applier (when
/// it tells: the floor) and side effect committed.
pub async fn live(
    bench: &Bench,
    case: &Case,
    applier: Applier,
    rate: f64,
    duration: Duration,
    writers: usize,
) -> Result<Stages> {
    bench.relay_init(case)?;
    consume::ledger(case).await?;
    let marks: Arc<Mutex<Marks>> = Arc::default();
    let seen: Arc<AtomicU64> = Arc::default();
    let (marking, count) = (Arc::clone(&marks), Arc::clone(&seen));
    let mark = move |stage: Stage, id: i64| {
        if let Ok(mut marks) = marking.lock() {
            let at = now_nanos();
            match stage {
                Stage::Delivered => marks.delivered.insert(id, at),
                Stage::Committed => marks.committed.insert(id, at),
            };
        }
        if stage == Stage::Committed {
            count.fetch_add(1, Ordering::Relaxed);
        }
    };
    let running = Running::start(bench, case, applier, mark).await?;
    let mut relay = case.spawn_relay();
    let insert = case.sql.prepare(INSERT_ONE).await?;
    for k in 0..WARM_UP {
        case.sql.query_one(&insert, &[&(k as i64)]).await?;
    }
    running.wait(&seen, WARM_UP).await?;

    let total = (rate * duration.as_secs_f64()).round() as u64;
    let writers = writers.max(1) as u64;
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let stolen_before = procfs::stolen_seconds()?;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let sql = connect_sql(&case.pg_url).await?;
        tasks.push(tokio::spawn(async move {
            let insert = sql.prepare(INSERT_ONE).await?;
            let mut sent = Vec::with_capacity((total / writers) as usize + 1);
            let mut t = w;
            while t < total {
                tokio::time::sleep_until(start + Duration::from_secs_f64(t as f64 / rate)).await;
                let at = now_nanos();
                let row = sql.query_one(&insert, &[&((WARM_UP + t) as i64)]).await?;
                sent.push((row.get::<_, i64>(0), at));
                t += writers;
            }
            anyhow::Ok(sent)
        }));
    }
    let mut sent: Vec<(i64, i128)> = Vec::with_capacity(total as usize);
    for task in tasks {
        sent.extend(task.await.context("writer task")??);
    }
    let first = sent.iter().map(|(_, at)| *at).min().unwrap_or(0);
    let last = sent.iter().map(|(_, at)| *at).max().unwrap_or(0);
    let achieved_rate = (sent.len() as f64 - 1.0).max(0.0) / ((last - first).max(1) as f64 / 1e9);
    running.wait(&seen, WARM_UP + total).await?;
    let stolen_us = (procfs::stolen_seconds()? - stolen_before) * 1e6 / total.max(1) as f64;
    let duplicates = running.stop().await?;
    tokio::task::spawn_blocking(move || relay.terminate(Duration::from_secs(60))).await?;
    consume::check_applied(case, WARM_UP + total, duplicates).await?;

    let stored = latency::stored_times(bench, &case.stream, WARM_UP + total).await;
    let marks = marks
        .lock()
        .map_err(|_| anyhow::anyhow!("a commit hook panicked"))?;
    let since_insert = |at: &HashMap<i64, i128>| -> Vec<f64> {
        sent.iter()
            .filter_map(|(id, sent)| at.get(id).map(|done| (done - sent) as f64 / 1e6))
            .collect()
    };
    let latencies = since_insert(&marks.committed);
    if latencies.len() != sent.len() {
        bail!(
            "{} of {} side effects were seen",
            latencies.len(),
            sent.len()
        );
    }
    let delivered = since_insert(&marks.delivered);
    let delivered = (delivered.len() == sent.len()).then(|| Live::of(achieved_rate, delivered));
    let stored = Live::of(achieved_rate, since_insert(&stored));
    Ok(Stages {
        committed: Live::of(achieved_rate, latencies),
        stored,
        delivered,
        stolen_us,
    })
}

/// This run's references for the pipeline's ratios: the relay's drain alone (events/s,
/// publishing CPU µs/event) and the consumer alone with the README's handler (side
/// effects/s, CPU µs/event), when they ran.
#[derive(Debug, Clone, Copy, Default)]
pub struct SameRun {
    pub drain: Option<(f64, f64)>,
    pub consumer: Option<(f64, f64)>,
}

/// The pipeline's side effects/s over the relay's drain alone.
pub const VS_DRAIN: &str = "side effects/s ÷ the relay's drain alone (same run)";

/// The seed's pair's side effects/s, and the pipeline's over them.
pub const SEED_PAIR: &str =
    "the seed's pair at once (its polling loop, one event per consumer transaction): side effects/s";
pub const VS_SEED_PAIR: &str = "side effects/s ÷ the seed's pair (same run)";

/// The pipeline's row name.
pub fn label(events: u64, per_tx: u64) -> String {
    format!(
        "pipeline to the side effect: {} events in {}-row transactions, the README's handler",
        Unit::Rate.format(events as f64),
        Unit::Rate.format(per_tx as f64)
    )
}

/// The measure of the `quantile` ("p50", "p99") of insert → side effect at `rate`.
pub fn latency_measure(quantile: &str, rate: f64) -> String {
    format!(
        "insert → side effect committed {quantile} at {} events/s",
        Unit::Rate.format(rate)
    )
}

/// The pipeline from a backlog of `events` in `per_tx`-row transactions, then insert → side
/// effect at each of `rates` for `seconds`, recorded in `results`.
pub async fn scenario(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    per_tx: u64,
    rates: &[f64],
    seconds: Duration,
    same_run: SameRun,
) -> Result<()> {
    let label = label(events, per_tx);
    let case = bench.case("pipeline").await?;
    let piped = backlog(bench, &case, events, per_tx).await?;
    let stream = case.stream.clone();
    bench.drop_case(case, &[&stream]).await?;
    let n = events as f64;
    let rate = n / piped.seconds;
    results.record(&label, "side effects/s", Unit::Rate, rate);
    if let Some((drain, _)) = same_run.drain {
        results.record(&label, VS_DRAIN, Unit::Ratio, rate / drain);
    }
    if let Some((alone, _)) = same_run.consumer {
        results.record(
            &label,
            "side effects/s ÷ the consumer alone (same run)",
            Unit::Ratio,
            rate / alone,
        );
    }
    let cpu = [
        ("relay CPU", piped.relay_cpu),
        ("walsender CPU", piped.walsender_cpu),
        ("nats-server CPU (storing and delivering)", piped.nats_cpu),
        ("consumer CPU", piped.consumer_cpu),
        ("the consumer's Postgres backends CPU", piped.backends_cpu),
    ];
    let total = results.record_cpu(&label, &cpu, n, "CPU, the five together");
    eprintln!(
        "bench: {label}: {rate:.0} side effects/s; CPU µs/event: relay {:.1}, walsender {:.1}, nats {:.1}, consumer {:.1}, backends {:.1}, total {:.1}",
        piped.relay_cpu * 1e6 / n,
        piped.walsender_cpu * 1e6 / n,
        piped.nats_cpu * 1e6 / n,
        piped.consumer_cpu * 1e6 / n,
        piped.backends_cpu * 1e6 / n,
        total,
    );
    let case = bench.case("seed_pair").await?;
    let seed = seed_pair(bench, &case, events, per_tx).await?;
    let (_, polling_stream) = polling::stream_of(&case);
    bench.drop_case(case, &[&polling_stream]).await?;
    results.record(&label, SEED_PAIR, Unit::Rate, seed);
    results.record(&label, VS_SEED_PAIR, Unit::Ratio, rate / seed);
    eprintln!(
        "bench: {label}: the seed's pair {seed:.0} side effects/s (the pipeline {:.1}×)",
        rate / seed
    );
    for &at in rates {
        let case = bench.case("pipeline_live").await?;
        let writers = crate::writers_for(at, 1);
        let figures = live(bench, &case, Applier::Library, at, seconds, writers)
            .await?
            .committed;
        let stream = case.stream.clone();
        bench.drop_case(case, &[&stream]).await?;
        for (q, value) in [("p50", figures.p50_ms), ("p99", figures.p99_ms)] {
            results.record(&label, &latency_measure(q, at), Unit::Millis, value);
        }
        let at = Unit::Rate.format(at);
        results.record(
            &label,
            &format!("achieved rate, live at {at} events/s"),
            Unit::Rate,
            figures.achieved_rate,
        );
        eprintln!(
            "bench: {label}: live at {at}/s (achieved {:.0}/s): insert → side effect p50 {:.2} ms, p99 {:.2} ms",
            figures.achieved_rate, figures.p50_ms, figures.p99_ms
        );
    }
    Ok(())
}

/// insert → side effect at `rate` for `seconds`, applied by the library and by the servers'
/// floor ([`floor`]: a bare client, four round trips, then one), in that order, recorded in
/// `results`.
pub async fn floor_scenario(
    bench: &mut Bench,
    results: &mut Results,
    rate: f64,
    seconds: Duration,
) -> Result<()> {
    let label = format!(
        "insert → side effect at {} events/s: outbox-consumer and the servers' floor",
        Unit::Rate.format(rate)
    );
    for (name, applier) in [
        ("outbox-consumer, the README's handler", Applier::Library),
        (Floor::RoundTrips.name(), Applier::Floor(Floor::RoundTrips)),
        (Floor::Pipelined.name(), Applier::Floor(Floor::Pipelined)),
    ] {
        let case = bench.case("floor").await?;
        let writers = crate::writers_for(rate, 1);
        let stages = live(bench, &case, applier, rate, seconds, writers).await?;
        let stream = case.stream.clone();
        bench.drop_case(case, &[&stream]).await?;
        let figures = stages.committed;
        for (q, value) in [("p50", figures.p50_ms), ("p99", figures.p99_ms)] {
            results.record(&label, &format!("{name}: {q}"), Unit::Millis, value);
        }
        eprintln!(
            "bench: {label}: {name} (achieved {:.0}/s): p50 {:.2} ms, p99 {:.2} ms",
            figures.achieved_rate, figures.p50_ms, figures.p99_ms
        );
        results.record(
            &label,
            &format!("{name}: CPU stolen from the VM by its host"),
            Unit::MicrosPerEvent,
            stages.stolen_us,
        );
        eprintln!(
            "bench: {label}: {name}: CPU stolen from the VM by its host {:.1} µs/event",
            stages.stolen_us
        );
        for (stage, figures) in [
            ("stored", Some(stages.stored)),
            ("delivered to it", stages.delivered),
        ] {
            let Some(figures) = figures else { continue };
            let measure = format!("{name}: insert → {stage}, p99");
            results.record(&label, &measure, Unit::Millis, figures.p99_ms);
            eprintln!(
                "bench: {label}: {name}: insert → {stage} p50 {:.2} ms, p99 {:.2} ms",
                figures.p50_ms, figures.p99_ms
            );
        }
    }
    Ok(())
}
