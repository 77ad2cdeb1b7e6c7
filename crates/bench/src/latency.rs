//! **Live latency**, commit → stored: with the relay running and caught up, writers commit
//! transactions of `R` rows (1 or 10) at a fixed event rate for a fixed time.
//!
//! - Each writer connection runs a fixed schedule (transaction `t` is due at
//!   `start + t · R / rate`, writers taking every `W`-th transaction), so a slow commit does
//!   not shift the later ones (no sleep-per-event drift); a writer that falls behind writes
//!   at once.
//! - Right after each `INSERT … RETURNING id` (autocommit: the statement's reply is the
//!   COMMIT's) returns, the writer records the wall clock for each of its row ids.
//! - Afterwards the stream is read back; an event's latency is the JetStream message's
//!   stored timestamp (`info().published`: the server's clock when it stored the message,
//!   same machine, same clock) minus its commit time. The PubAck the relay waits for is
//!   sent right after the store, so this is commit → PubAck less one loopback hop.
//! - The client sees its COMMIT return a little after the WAL was flushed, which is when the
//!   walsender may already send it: a latency can come out slightly smaller than the real
//!   one (even negative for a single event), never larger.
//! - The rate reported is the achieved one: events over the time from the first commit to
//!   the last.
//! - 100 events are written and relayed before the measured ones (warm-up, not counted).
//! - Where the CPU goes, per measured event: the relay, its walsender, nats-server, the
//!   writers' Postgres backends (reaped by the postmaster when their connections close)
//!   and this process (the writers' client side), from the start of the schedule to the
//!   last event stored. Above ~100 µs per event in all, two cores cannot keep up with
//!   10 000 events/s and the latency is a queue's.
//! - Whose turn it was: the time the relay's, its walsender's and nats-server's threads
//!   spent runnable but waiting for a CPU (`/proc/<pid>/task/*/schedstat`), per event. When
//!   that wait is of the order of the latency, the machine, not the relay, is what waits.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use testkit::harness::read_stream;

use crate::harness::{connect_sql, Bench, Case};
use crate::procfs;

const INSERT_ONE: &str = "insert into outbox_events \
        (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
    values ('entity-' || ($1::bigint % 1000), 'OrderPaid', $2::text || $1::bigint, 'tmp', 'tmp', \
            jsonb_build_object('order_id', $1::bigint, 'amount', 10)) \
    returning id";

/// `$3` rows numbered from `$1` in one statement (one transaction in autocommit).
const INSERT_MANY: &str = "insert into outbox_events \
        (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
    select 'entity-' || (k % 1000), 'OrderPaid', $2::text || k, 'tmp', 'tmp', \
           jsonb_build_object('order_id', k, 'amount', 10) \
      from generate_series($1::bigint, $1::bigint + $3::bigint - 1) k \
    returning id";

const WARM_UP: u64 = 100;

/// The latency figures of one run.
#[derive(Debug, Clone, Copy)]
pub struct Latency {
    pub achieved_rate: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// CPU seconds per measured event, from the first measured commit to the last event
    /// stored: the relay, its walsender, nats-server, the writers' Postgres backends and
    /// the bench process (the writers' client side).
    pub cpu: CpuPerEvent,
}

/// Where the CPU of the live path goes, in seconds per event.
#[derive(Debug, Clone, Copy)]
pub struct CpuPerEvent {
    /// The relay's context switches per event (all threads).
    pub relay_switches: f64,
    /// The relay's read/write system calls per event.
    pub relay_syscalls: f64,
    pub relay: f64,
    pub walsender: f64,
    pub nats: f64,
    pub backends: f64,
    pub bench: f64,
    /// Seconds per event the relay's threads waited for a CPU while runnable.
    pub relay_waited: f64,
    /// The same for its walsender and for nats-server.
    pub walsender_waited: f64,
    pub nats_waited: f64,
    /// Seconds per event the hypervisor ran something else on the machine's CPUs while the
    /// VM wanted them (`steal` of `/proc/stat`, all CPUs).
    pub stolen: f64,
}

/// The wall clock, nanoseconds since the Unix epoch.
pub fn now_nanos() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// Runs the relay on `case` and measures commit → stored at `rate` events/s in
/// transactions of `tx_rows` rows for `duration`, with `writers` connections.
pub async fn live(
    bench: &Bench,
    case: &Case,
    rate: f64,
    tx_rows: u64,
    duration: Duration,
    writers: usize,
) -> Result<Latency> {
    let tx_rows = tx_rows.max(1);
    let relay = case.spawn_relay();
    let relay = tokio::task::spawn_blocking(move || {
        relay.wait_for_output("streaming outbox events", Duration::from_secs(60));
        relay
    })
    .await?;

    // Warm-up: a few events through the whole path before measuring.
    let insert = case.sql.prepare(INSERT_ONE).await?;
    for k in 0..WARM_UP {
        case.sql
            .query_one(&insert, &[&(k as i64), &"warm-"])
            .await?;
    }
    case.wait_for_count(&bench.js, WARM_UP, Duration::from_secs(60))
        .await;

    let transactions = ((rate * duration.as_secs_f64()) / tx_rows as f64).round() as u64;
    let total = transactions * tx_rows;
    let writers = writers.max(1) as u64;
    let mut connections = Vec::new();
    for _ in 0..writers {
        connections.push(connect_sql(&case.pg_url).await?);
    }
    let walsender = bench
        .walsender_pid(&case.slot)
        .await?
        .context("the relay's walsender is not running")?;
    let postmaster = bench.pg.pid();
    let me = std::process::id();
    let cpu_before = [
        procfs::cpu_seconds(relay.pid())?,
        procfs::cpu_seconds(walsender)?,
        procfs::cpu_seconds(bench.nats.pid())?,
        procfs::reaped_children_cpu_seconds(postmaster)?,
        procfs::cpu_seconds(me)?,
    ];
    let waited_before = [
        procfs::run_queue_wait_seconds(relay.pid())?,
        procfs::run_queue_wait_seconds(walsender)?,
        procfs::run_queue_wait_seconds(bench.nats.pid())?,
    ];
    let switches_before = procfs::context_switches(relay.pid())?;
    let syscalls_before = procfs::io_syscalls(relay.pid())?;
    let stolen_before = procfs::stolen_seconds()?;
    // --metrics: scraped every second while the events flow, as Prometheus would.
    let scraper = bench.metrics_port.map(|port| {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(crate::drain::SCRAPE_EVERY).await;
                let _ =
                    tokio::task::spawn_blocking(move || testkit::http_get(port, "/metrics")).await;
            }
        })
    });
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for (w, sql) in (0..writers).zip(connections) {
        tasks.push(tokio::spawn(async move {
            let insert = sql
                .prepare(if tx_rows == 1 {
                    INSERT_ONE
                } else {
                    INSERT_MANY
                })
                .await?;
            let mut commits: Vec<(i64, i128)> = Vec::with_capacity((total / writers) as usize + 1);
            let mut t = w;
            while t < transactions {
                let due = start + Duration::from_secs_f64((t * tx_rows) as f64 / rate);
                tokio::time::sleep_until(due).await;
                let first = (t * tx_rows) as i64;
                let rows = if tx_rows == 1 {
                    vec![sql.query_one(&insert, &[&first, &"live-"]).await?]
                } else {
                    sql.query(&insert, &[&first, &"live-", &(tx_rows as i64)])
                        .await?
                };
                let committed = now_nanos();
                commits.extend(rows.iter().map(|row| (row.get::<_, i64>(0), committed)));
                t += writers;
            }
            anyhow::Ok(commits)
        }));
    }
    let mut commits: HashMap<i64, i128> = HashMap::with_capacity(total as usize);
    for task in tasks {
        commits.extend(task.await.context("writer task")??);
    }
    let first = commits.values().min().copied().unwrap_or(0);
    let last = commits.values().max().copied().unwrap_or(0);
    let achieved_rate = if last > first {
        (commits.len() as f64 - 1.0) / ((last - first) as f64 / 1e9)
    } else {
        f64::NAN
    };

    case.wait_for_count(&bench.js, WARM_UP + total, Duration::from_secs(120))
        .await;
    if let Some(scraper) = scraper {
        scraper.abort();
    }
    let waited = [
        procfs::run_queue_wait_seconds(relay.pid())? - waited_before[0],
        procfs::run_queue_wait_seconds(walsender)? - waited_before[1],
        procfs::run_queue_wait_seconds(bench.nats.pid())? - waited_before[2],
    ];
    let switches = procfs::context_switches(relay.pid())? - switches_before;
    let syscalls = procfs::io_syscalls(relay.pid())? - syscalls_before;
    let stolen = procfs::stolen_seconds()? - stolen_before;
    let cpu_stored = [
        procfs::cpu_seconds(relay.pid())?,
        procfs::cpu_seconds(walsender)?,
        procfs::cpu_seconds(bench.nats.pid())?,
        procfs::cpu_seconds(me)?,
    ];
    // The writers' connections are closed (their tasks ended): once their backends have
    // exited, the postmaster has reaped their CPU time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let backends = procfs::reaped_children_cpu_seconds(postmaster)? - cpu_before[3];
    let per_event = |seconds: f64| seconds / total.max(1) as f64;
    let cpu = CpuPerEvent {
        relay_switches: switches as f64 / total.max(1) as f64,
        relay_syscalls: syscalls as f64 / total.max(1) as f64,
        relay: per_event(cpu_stored[0] - cpu_before[0]),
        walsender: per_event(cpu_stored[1] - cpu_before[1]),
        nats: per_event(cpu_stored[2] - cpu_before[2]),
        backends: per_event(backends),
        bench: per_event(cpu_stored[3] - cpu_before[4]),
        relay_waited: per_event(waited[0]),
        walsender_waited: per_event(waited[1]),
        nats_waited: per_event(waited[2]),
        stolen: per_event(stolen),
    };
    let stored = stored_times(bench, &case.stream, WARM_UP + total).await;
    let mut latencies: Vec<f64> = commits
        .iter()
        .filter_map(|(id, committed)| {
            stored
                .get(id)
                .map(|stored| (stored - committed) as f64 / 1e6)
        })
        .collect();
    if latencies.len() != commits.len() {
        bail!(
            "only {} of {} committed events were found in the stream",
            latencies.len(),
            commits.len()
        );
    }
    if std::env::var_os("BENCH_LATENCY_TRACE").is_some() {
        trace(&commits, &stored, first);
    }
    latencies.sort_by(f64::total_cmp);
    let quantile = |q: f64| {
        let index = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(index).copied().unwrap_or(f64::NAN)
    };
    let figures = Latency {
        achieved_rate,
        p50_ms: quantile(0.50),
        p99_ms: quantile(0.99),
        p999_ms: quantile(0.999),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        cpu,
    };
    tokio::task::spawn_blocking(move || {
        let mut relay = relay;
        relay.terminate(Duration::from_secs(60))
    })
    .await?;
    Ok(figures)
}

/// Outbox id → the server's store time (ns since the epoch) of the first `count` messages.
pub async fn stored_times(bench: &Bench, stream: &str, count: u64) -> HashMap<i64, i128> {
    let messages = read_stream(&bench.js, stream, count, Duration::from_secs(120)).await;
    let times = messages.iter().map(|m| (m.outbox_id(), m.published_ns));
    times.collect()
}

/// Per 100 ms of commit time: events, median and max latency (`BENCH_LATENCY_TRACE=1`).
fn trace(commits: &HashMap<i64, i128>, stored: &HashMap<i64, i128>, first: i128) {
    let mut buckets: std::collections::BTreeMap<i128, Vec<f64>> = Default::default();
    for (id, committed) in commits {
        if let Some(s) = stored.get(id) {
            buckets
                .entry((committed - first) / 100_000_000)
                .or_default()
                .push((s - committed) as f64 / 1e6);
        }
    }
    for (bucket, mut values) in buckets {
        values.sort_by(f64::total_cmp);
        eprintln!(
            "bench: latency trace t={:.1}s n={} p50={:.3}ms max={:.3}ms",
            bucket as f64 / 10.0,
            values.len(),
            values[values.len() / 2],
            values[values.len() - 1]
        );
    }
}
