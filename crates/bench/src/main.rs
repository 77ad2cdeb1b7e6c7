//! `outbox-relay-bench`: how close the relay comes to what this machine allows, measured
//! side by side in one run (issue 4).
//!
//! ```text
//! cargo run --release -p outbox-relay-bench -- --quick         # ~1 minute, small sizes, 1 run
//! cargo run --release -p outbox-relay-bench -- --out table.md   # the full table, 3 runs
//! ```
//!
//! It starts its own throwaway Postgres 15 (`wal_level=logical`) and `nats-server -js`
//! (file storage) through `testkit`, measures the real release binary
//! `target/release/outbox-relay` (built first when run through cargo), and prints one
//! markdown table (also written to `--out`). Every scenario of every run gets a fresh
//! database, slot, publication and stream ([`harness`]). What each row means:
//!
//! - **backlogs** (100 000 and 1 000 000 events in 1 000-row transactions, 100 000
//!   single-row transactions), each written after `outbox-relay init` and a second slot
//!   were created, then drained three ways: the **decode ceiling** (`pg_recvlogical`,
//!   [`ceilings::decode`]), the **broker ceiling** (pipelined JetStream publishes of the
//!   same messages, [`ceilings::broker`]) and the **relay drain** ([`drain`]: events/s,
//!   the relay's CPU µs/event and peak RSS); then **relay / min(ceilings)** and
//!   **relay / pg_recvlogical** per run, and the CPU per event of each process (relay,
//!   walsender, nats-server) with the ratio **relay CPU ÷ walsender CPU**;
//! - **live latency** ([`latency`]): commit → stored p50/p99/p99.9/max at 1 000, 10 000
//!   and 50 000 events/s in single-row and 10-row transactions, with the CPU per event of
//!   each process and the time each waited for a CPU;
//! - **polling baseline** ([`polling`]): the seed's polling publisher draining a 100 000-
//!   event backlog (per-row and batched), and **relay / polling**;
//! - **a 1 000 000-row transaction** ([`drain`] again): the relay's peak RSS while it
//!   passes through;
//! - **consumer** ([`consume`]): `outbox-consumer` applying 100 000 relay events, one side
//!   effect each in the transaction that records its `dedupe_key`, with batch size 1 and the
//!   default: events/s, CPU per event, and stored → committed latency at 2 000 events/s
//!   (`--only consumer` needs no relay binary);
//! - **the pipeline to the side effect** ([`pipeline`]): Postgres → relay → JetStream →
//!   outbox-consumer applying the README's handler, all at once, from the 100 000-event
//!   backlog: side effects/s over this run's relay drain, consumer alone and the seed's own
//!   pair, CPU per event of every process; insert → side effect p50/p99 at 1 000 and 10 000
//!   events/s;
//! - **header profiles** ([`headers`], only with `--only headers`): the relay's messages
//!   published pipelined with its headers, a lean profile and `Nats-Msg-Id` alone, and
//!   nats-server's CPU per message for each;
//! - **publish modes** ([`modes`], only with `--only modes`): the 1 000-row backlog drained per
//!   message and with atomic transactions (nats-server 2.12+), CPU per event of each process
//!   and of the whole pipeline.
//! - **the servers' floor for insert → side effect** ([`floor`], only with `--only floor`):
//!   at 1 000 events/s through the relay, outbox-consumer with the README's handler, then a
//!   bare client doing the same statements (in four round trips, then pipelined in one) in
//!   its place; p50/p99 to the side effect, p99 to stored and to delivered, and the CPU
//!   the VM's host took meanwhile.
//!
//! Every figure is the median of `--runs` runs (3; 1 with `--quick`) with min and max.
//! Nothing here asserts a timing: the tool prints figures and the targets they meet or miss.
//!
//! For experiments and profiling: `--only` runs some scenarios, `--events` /
//! `--large-events` / `--latency-rates` / `--latency-tx-rows` / `--latency-seconds` change sizes,
//! `--payload-bytes` pads the 1 000-row backlogs' payloads ([`load`]), `--relay-bin`
//! measures another build, `--relay-env KEY=VALUE` sets the relay's environment and
//! `--relay-wrapper "valgrind --tool=callgrind …"` or `"perf record … --"` runs it under a
//! profiler (its CPU and RSS figures then describe the wrapper). `BENCH_LATENCY_TRACE=1`
//! prints the live latency per 100 ms of commit time.

mod ceilings;
mod consume;
mod drain;
mod floor;
mod harness;
mod headers;
mod latency;
mod load;
mod modes;
mod pipeline;
mod polling;
mod procfs;
mod report;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use clap::{Parser, ValueEnum};

use crate::harness::Bench;
use crate::report::{Results, Target, Unit};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay-bench",
    about = "Measures outbox-relay against pg_recvlogical, pipelined JetStream publishing and a polling publisher on throwaway servers"
)]
struct Cli {
    /// Small sizes (20 000-event backlogs) and one run: about a minute.
    #[arg(long)]
    quick: bool,
    /// Runs per figure (default 3, 1 with --quick); figures are medians with min and max.
    #[arg(long)]
    runs: Option<usize>,
    /// Also write the table (markdown) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The relay binary (default: target/release/outbox-relay, built first under cargo).
    #[arg(long)]
    relay_bin: Option<PathBuf>,
    /// Only these scenarios (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// A command prefix for `outbox-relay run`, split on whitespace, for profiling, e.g.
    /// "valgrind --tool=callgrind --callgrind-out-file=/tmp/relay.%p.out" (CPU and RSS
    /// figures then describe the wrapper, not the relay).
    #[arg(long, allow_hyphen_values = true)]
    relay_wrapper: Option<String>,
    /// Extra environment for the relay, KEY=VALUE (repeatable), for experiments such as
    /// TOKIO_WORKER_THREADS=1.
    #[arg(long = "relay-env", value_name = "KEY=VALUE")]
    relay_env: Vec<String>,
    /// Serve the relay's metrics (OUTBOX_RELAY_METRICS_ADDR on a free port) and scrape
    /// /metrics every second while it drains, to measure what metrics cost the relay.
    #[arg(long)]
    metrics: bool,
    /// Rates of the live-latency scenario, events/s (default 1000,10000,50000; 1000,10000
    /// with --quick); one writer connection per 2 500 transactions/s.
    #[arg(long, value_delimiter = ',')]
    latency_rates: Vec<f64>,
    /// Rows per transaction of the live-latency scenario (default 1,10): each rate runs
    /// once per value.
    #[arg(long, value_delimiter = ',')]
    latency_tx_rows: Vec<u64>,
    /// Seconds each live-latency rate runs (default 10, 3 with --quick).
    #[arg(long)]
    latency_seconds: Option<f64>,
    /// Override the size of the 100 000-event backlogs and of the polling baseline.
    #[arg(long)]
    events: Option<u64>,
    /// Override the size of the 1 000 000-event backlog and of the large transaction.
    #[arg(long)]
    large_events: Option<u64>,
    /// Pad the payloads of the backlogs in 1 000-row transactions to about this many bytes
    /// of JSON text (default: about 30 bytes, `{"amount": 10, "order_id": i}`).
    #[arg(long)]
    payload_bytes: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// 100 000 events in 1 000-row transactions.
    Batch,
    /// 1 000 000 events in 1 000-row transactions.
    BatchLarge,
    /// 100 000 single-row transactions.
    Single,
    /// commit → stored at 1 000, 10 000 and 50 000 events/s, single-row and 10-row
    /// transactions.
    Latency,
    /// The seed's polling publisher.
    Polling,
    /// One transaction of 1 000 000 rows.
    BigTx,
    /// outbox-consumer applying 100 000 events (no relay involved).
    Consumer,
    /// The 1 000-row backlog drained once per publish mode (per message, atomic
    /// transactions on nats-server 2.12+), same server, same run (issue 23).
    Modes,
    /// Postgres → relay → JetStream → outbox-consumer applying the README's handler, all at
    /// once: from a backlog, and insert → side effect at the live-latency rates (issue 44).
    Pipeline,
    /// The relay's messages published pipelined with its headers, a lean profile and
    /// `Nats-Msg-Id` alone: nats-server's CPU per message for each (issue 44).
    Headers,
    /// insert → side effect at 1 000 events/s through the relay: outbox-consumer, then the
    /// servers' floor (a bare client doing the same statements, in four round trips and in
    /// one) in its place (issue 44).
    Floor,
}

/// Sizes of one benchmark run.
#[derive(Debug, Clone)]
struct Sizes {
    batch: u64,
    batch_large: u64,
    single: u64,
    polling: u64,
    big_tx: u64,
    consumer: u64,
    latency: Duration,
    /// Events/s of the live-latency scenario.
    rates: Vec<f64>,
    /// Rows per transaction of the live-latency scenario.
    tx_rows: Vec<u64>,
}

/// Writer connections for `rate` events/s in `tx_rows`-row transactions: one per 2 500
/// transactions/s (a connection commits one at a time).
fn writers_for(rate: f64, tx_rows: u64) -> usize {
    (rate / tx_rows.max(1) as f64 / 2_500.0).ceil().max(1.0) as usize
}

impl Sizes {
    fn new(quick: bool, events: Option<u64>, large_events: Option<u64>) -> Sizes {
        let mut sizes = if quick {
            Sizes {
                batch: 20_000,
                batch_large: 100_000,
                single: 20_000,
                polling: 20_000,
                big_tx: 100_000,
                consumer: 20_000,
                latency: Duration::from_secs(3),
                rates: vec![1_000.0, 10_000.0],
                tx_rows: vec![1, 10],
            }
        } else {
            Sizes {
                batch: 100_000,
                batch_large: 1_000_000,
                single: 100_000,
                polling: 100_000,
                big_tx: 1_000_000,
                consumer: 100_000,
                latency: Duration::from_secs(10),
                rates: vec![1_000.0, 10_000.0, 50_000.0],
                tx_rows: vec![1, 10],
            }
        };
        if let Some(n) = events {
            sizes.batch = n;
            sizes.single = n;
            sizes.polling = n;
            sizes.consumer = n;
        }
        if let Some(n) = large_events {
            sizes.batch_large = n;
            sizes.big_tx = n;
        }
        sizes
    }
}

/// Rows per transaction of the batched backlogs.
const TX_ROWS: u64 = 1_000;

const DECODE: &str = "decode ceiling: pg_recvlogical";
const BROKER: &str = "broker ceiling: pipelined publish";
const RELAY: &str = "relay drain";
const RELAY_CPU: &str = "relay CPU";
const RELAY_RSS: &str = "relay peak RSS";
const VS_MIN: &str = "relay / min(ceilings)";
const VS_DECODE: &str = "relay / pg_recvlogical";
const RELAY_PER_WALSENDER: &str = "relay CPU ÷ walsender CPU";

fn group(n: u64) -> String {
    Unit::Rate.format(n as f64)
}

fn backlog_label(events: u64, per_tx: u64) -> String {
    if per_tx == 1 {
        format!("backlog: {} single-row transactions", group(events))
    } else {
        format!(
            "backlog: {} events in {}-row transactions",
            group(events),
            group(per_tx)
        )
    }
}

fn latency_label(rate: f64, tx_rows: u64) -> String {
    if tx_rows == 1 {
        format!("live latency at {} events/s", group(rate as u64))
    } else {
        format!(
            "live latency at {} events/s in {}-row transactions",
            group(rate as u64),
            group(tx_rows)
        )
    }
}

fn polling_label(events: u64) -> String {
    format!("polling baseline: {} events", group(events))
}

fn big_tx_label(events: u64) -> String {
    format!("one transaction of {} rows", group(events))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let runs = cli.runs.unwrap_or(if cli.quick { 1 } else { 3 }).max(1);
    let mut sizes = Sizes::new(cli.quick, cli.events, cli.large_events);
    if !cli.latency_rates.is_empty() {
        sizes.rates = cli.latency_rates.clone();
    }
    if !cli.latency_tx_rows.is_empty() {
        sizes.tx_rows = cli.latency_tx_rows.clone();
    }
    if let Some(seconds) = cli.latency_seconds {
        sizes.latency = Duration::from_secs_f64(seconds);
    }
    let selected = |s: Scenario| cli.only.is_empty() || cli.only.contains(&s);
    if let Some(bytes) = cli.payload_bytes {
        load::set_payload_bytes(bytes);
    }
    let relay_bin = if cli.only == [Scenario::Consumer] {
        // Nothing runs the relay: do not build it.
        PathBuf::from("outbox-relay (not used)")
    } else {
        harness::locate_relay(cli.relay_bin.clone())?
    };
    let wrapper: Vec<String> = cli
        .relay_wrapper
        .as_deref()
        .map(|w| w.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    if cfg!(debug_assertions) {
        eprintln!(
            "bench: WARNING: this is a debug build of the bench; its own publishing and writing \
             are slower than they should be: run it with --release"
        );
    }
    eprintln!("bench: relay binary {}", relay_bin.display());
    let mut relay_env = Vec::new();
    for pair in &cli.relay_env {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--relay-env {pair:?} is not KEY=VALUE"))?;
        relay_env.push((key.to_owned(), value.to_owned()));
    }
    let mut env_shown = cli.relay_env.clone();
    let metrics_port = cli.metrics.then(testkit::free_port);
    if let Some(port) = metrics_port {
        // One relay runs at a time, so one port serves them all.
        let pair = (
            "OUTBOX_RELAY_METRICS_ADDR".to_owned(),
            format!("127.0.0.1:{port}"),
        );
        env_shown.push(format!("{}={} (scraped every second)", pair.0, pair.1));
        relay_env.push(pair);
    }
    let mut bench = Bench::start(relay_bin, wrapper, relay_env).await?;
    bench.metrics_port = metrics_port;
    // Read before the runs: the commit is the one the relay binary was built from (when
    // cargo built it just now), even if the tree moves while the benchmark runs.
    let machine = machine(&bench).await;
    let started = Instant::now();
    let mut results = Results::default();

    for run in 0..runs {
        eprintln!("bench: run {}/{runs}", run + 1);
        // This run's relay drain and consumer alone, for the pipeline's same-run ratios.
        let mut same_run = pipeline::SameRun::default();
        if selected(Scenario::Batch) {
            same_run.drain = Some(backlog(&mut bench, &mut results, sizes.batch, TX_ROWS).await?);
        }
        if selected(Scenario::Single) {
            backlog(&mut bench, &mut results, sizes.single, 1).await?;
        }
        if selected(Scenario::BatchLarge) {
            backlog(&mut bench, &mut results, sizes.batch_large, TX_ROWS).await?;
        }
        if selected(Scenario::Latency) {
            for &tx_rows in &sizes.tx_rows {
                for &rate in &sizes.rates {
                    live_latency(&mut bench, &mut results, rate, tx_rows, sizes.latency).await?;
                }
            }
        }
        if selected(Scenario::Polling) {
            polling_baseline(&mut bench, &mut results, sizes.polling, run, sizes.batch).await?;
        }
        if selected(Scenario::BigTx) {
            big_transaction(&mut bench, &mut results, sizes.big_tx).await?;
        }
        if selected(Scenario::Consumer) {
            same_run.consumer = consume::scenario(
                &mut bench,
                &mut results,
                sizes.consumer,
                sizes.latency,
                same_run.drain,
            )
            .await?;
        }
        if selected(Scenario::Pipeline) {
            let rates = [1_000.0, 10_000.0];
            pipeline::scenario(
                &mut bench,
                &mut results,
                sizes.batch,
                TX_ROWS,
                &rates,
                sizes.latency,
                same_run,
            )
            .await?;
        }
        if cli.only.contains(&Scenario::Floor) {
            pipeline::floor_scenario(&mut bench, &mut results, 1_000.0, sizes.latency).await?;
        }
        if cli.only.contains(&Scenario::Headers) {
            headers::compare(&mut bench, &mut results, sizes.batch).await?;
        }
        if cli.only.contains(&Scenario::Modes) {
            let version = nats_version();
            modes::compare(&mut bench, &mut results, sizes.batch, TX_ROWS, version).await?;
        }
    }

    let targets = targets(&results, &sizes);
    let mut markdown = format!(
        "Machine: {machine}\n\nRelay: `{}`{}; runs per figure: {runs}{}{}; total time {:.0} s.\n\n",
        bench.relay_bin.display(),
        if env_shown.is_empty() && cli.relay_wrapper.is_none() {
            String::new()
        } else {
            format!(" (wrapper {:?}, env {:?})", cli.relay_wrapper, env_shown)
        },
        if cli.quick { " (--quick sizes)" } else { "" },
        cli.payload_bytes.map_or_else(String::new, |bytes| format!(
            "; the 1 000-row backlogs' payloads padded to about {bytes} bytes of JSON"
        )),
        started.elapsed().as_secs_f64()
    );
    markdown.push_str(&results.table());
    markdown.push_str("\nTargets (issues 4, 13 and 44):\n\n");
    markdown.push_str(&report::targets_table(&targets));
    println!("{markdown}");
    if let Some(path) = &cli.out {
        std::fs::write(path, &markdown).with_context(|| format!("write {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

/// Decode ceiling, broker ceiling and relay drain on one freshly written backlog; returns
/// the relay's drain: events/s, and the publishing side's CPU µs/event (relay, walsender,
/// nats-server).
async fn backlog(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    per_tx: u64,
) -> Result<(f64, f64)> {
    let label = backlog_label(events, per_tx);
    let name = if per_tx == 1 { "single" } else { "batch" };
    let case = bench.case(name).await?;
    bench.relay_init(&case)?;
    let recv_slot = format!("recv_{}", case.database);
    bench.create_slot(&case, &recv_slot).await?;

    let writing = Instant::now();
    if per_tx == 1 {
        load::write_single_rows(&case.sql, events).await?;
    } else {
        load::write_batched(&case.sql, events, per_tx).await?;
    }
    let endpos = load::current_wal_lsn(&case.sql).await?;
    eprintln!(
        "bench: {label}: written in {:.1} s, payloads of {:.0} bytes of JSON on average",
        writing.elapsed().as_secs_f64(),
        load::mean_payload_bytes(&case.sql).await?
    );
    let n = events as f64;

    let decode = ceilings::decode(bench, &case, &recv_slot, endpos).await?;
    let decode_rate = n / decode.seconds;
    results.record(&label, DECODE, Unit::Rate, decode_rate);

    let broker_prefix = case.prefix.replacen('t', "c", 1);
    let broker_stream = format!("CEIL_{}", case.database.to_uppercase());
    let messages = load::read_events(&case.sql, &broker_prefix, per_tx, endpos).await?;
    let broker = ceilings::broker(bench, &messages, &broker_stream, &broker_prefix).await?;
    drop(messages);
    let broker_rate = n / broker.seconds;
    results.record(&label, BROKER, Unit::Rate, broker_rate);

    let drain = drain::drain(bench, &case, events).await?;
    let relay_rate = n / drain.seconds;
    let per_event = |seconds: f64| seconds * 1e6 / n;
    for (measure, unit, value) in [
        (RELAY, Unit::Rate, relay_rate),
        (
            VS_MIN,
            Unit::Ratio,
            relay_rate / decode_rate.min(broker_rate),
        ),
        (VS_DECODE, Unit::Ratio, relay_rate / decode_rate),
        (RELAY_CPU, Unit::MicrosPerEvent, per_event(drain.relay_cpu)),
        (RELAY_RSS, Unit::Mib, drain.peak_rss_mib),
        (
            "relay context switches",
            Unit::PerEvent,
            drain.context_switches as f64 / n,
        ),
        (
            "relay read/write syscalls",
            Unit::PerEvent,
            drain.io_syscalls as f64 / n,
        ),
        (
            "relay start-up (spawn → streaming)",
            Unit::Millis,
            drain.startup_seconds * 1e3,
        ),
        (
            "walsender CPU under pg_recvlogical",
            Unit::MicrosPerEvent,
            per_event(decode.walsender_cpu),
        ),
        (
            "walsender CPU under the relay",
            Unit::MicrosPerEvent,
            per_event(drain.walsender_cpu),
        ),
        (
            RELAY_PER_WALSENDER,
            Unit::Ratio,
            drain.relay_cpu / drain.walsender_cpu,
        ),
        (
            "pg_recvlogical CPU",
            Unit::MicrosPerEvent,
            per_event(decode.client_cpu),
        ),
        (
            "nats-server CPU, broker ceiling",
            Unit::MicrosPerEvent,
            per_event(broker.server_cpu),
        ),
        (
            "publishing client CPU, broker ceiling",
            Unit::MicrosPerEvent,
            per_event(broker.client_cpu),
        ),
        (
            "nats-server CPU, relay drain",
            Unit::MicrosPerEvent,
            per_event(drain.server_cpu),
        ),
    ] {
        results.record(&label, measure, unit, value);
    }
    eprintln!(
        "bench: {label}: pg_recvlogical {:.0}/s, broker {:.0}/s, relay {:.0}/s ({:.2} µs/event CPU, {:.1} MiB peak RSS)",
        decode_rate,
        broker_rate,
        relay_rate,
        per_event(drain.relay_cpu),
        drain.peak_rss_mib
    );
    let stream = case.stream.clone();
    bench.drop_case(case, &[&stream, &broker_stream]).await?;
    let publishing = drain.relay_cpu + drain.walsender_cpu + drain.server_cpu;
    Ok((relay_rate, per_event(publishing)))
}

/// commit → stored with the relay running, at `rate` events per second in `tx_rows`-row
/// transactions.
async fn live_latency(
    bench: &mut Bench,
    results: &mut Results,
    rate: f64,
    tx_rows: u64,
    duration: Duration,
) -> Result<()> {
    let label = latency_label(rate, tx_rows);
    let case = bench.case("live").await?;
    bench.relay_init(&case)?;
    let writers = writers_for(rate, tx_rows);
    let figures = latency::live(bench, &case, rate, tx_rows, duration, writers).await?;
    results.record(&label, "achieved rate", Unit::Rate, figures.achieved_rate);
    results.record(&label, "commit → stored p50", Unit::Millis, figures.p50_ms);
    results.record(&label, "commit → stored p99", Unit::Millis, figures.p99_ms);
    results.record(
        &label,
        "commit → stored p99.9",
        Unit::Millis,
        figures.p999_ms,
    );
    results.record(&label, "commit → stored max", Unit::Millis, figures.max_ms);
    results.record(
        &label,
        "relay context switches",
        Unit::PerEvent,
        figures.cpu.relay_switches,
    );
    results.record(
        &label,
        "relay read/write syscalls",
        Unit::PerEvent,
        figures.cpu.relay_syscalls,
    );
    for (who, seconds) in [
        ("relay CPU", figures.cpu.relay),
        ("walsender CPU", figures.cpu.walsender),
        ("nats-server CPU", figures.cpu.nats),
        ("writers' Postgres backends CPU", figures.cpu.backends),
        ("writers' client CPU (bench process)", figures.cpu.bench),
    ] {
        results.record(&label, who, Unit::MicrosPerEvent, seconds * 1e6);
    }
    results.record(
        &label,
        RELAY_PER_WALSENDER,
        Unit::Ratio,
        figures.cpu.relay / figures.cpu.walsender,
    );
    for (who, seconds) in [
        ("relay waiting for a CPU", figures.cpu.relay_waited),
        ("walsender waiting for a CPU", figures.cpu.walsender_waited),
        ("nats-server waiting for a CPU", figures.cpu.nats_waited),
        ("CPU stolen from the VM by its host", figures.cpu.stolen),
    ] {
        results.record(&label, who, Unit::MicrosPerEvent, seconds * 1e6);
    }
    eprintln!(
        "bench: {label}: achieved {:.0}/s, p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms, max {:.3} ms; CPU µs/event: relay {:.1}, walsender {:.1}, nats {:.1}, backends {:.1}, bench {:.1}",
        figures.achieved_rate, figures.p50_ms, figures.p99_ms, figures.p999_ms, figures.max_ms,
        figures.cpu.relay * 1e6, figures.cpu.walsender * 1e6, figures.cpu.nats * 1e6,
        figures.cpu.backends * 1e6, figures.cpu.bench * 1e6
    );
    let stream = case.stream.clone();
    bench.drop_case(case, &[&stream]).await
}

/// The seed's polling publisher (per-row and batched) on a backlog like the relay's.
async fn polling_baseline(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    run: usize,
    relay_events: u64,
) -> Result<()> {
    let label = polling_label(events);
    let relay_label = backlog_label(relay_events, TX_ROWS);
    let relay_rate = results.value(&relay_label, RELAY, run);
    for (variant, measure) in [
        (
            polling::Variant::PerRow { limit: 50 },
            "seed's loop (claim 50, per row: publish, await ack, UPDATE)",
        ),
        (
            polling::Variant::Batched { limit: 1000 },
            "batched (claim 1 000, publish pipelined, await all, one UPDATE)",
        ),
    ] {
        let case = bench.case("polling").await?;
        load::write_batched(&case.sql, events, TX_ROWS).await?;
        let (prefix, stream) = polling::stream_of(&case);
        let seconds = polling::drain(bench, &case, variant, events, &stream, &prefix).await?;
        let rate = events as f64 / seconds;
        results.record(&label, measure, Unit::Rate, rate);
        eprintln!("bench: {label}: {measure}: {rate:.0}/s");
        if let Some(relay_rate) = relay_rate {
            let ratio = match variant {
                polling::Variant::PerRow { .. } => "relay / seed's polling",
                polling::Variant::Batched { .. } => "relay / batched polling",
            };
            results.record(&label, ratio, Unit::Ratio, relay_rate / rate);
        }
        bench.drop_case(case, &[&stream]).await?;
    }
    Ok(())
}

/// The relay passing one transaction of `events` rows.
async fn big_transaction(bench: &mut Bench, results: &mut Results, events: u64) -> Result<()> {
    let label = big_tx_label(events);
    let case = bench.case("bigtx").await?;
    bench.relay_init(&case)?;
    let writing = Instant::now();
    load::write_batched(&case.sql, events, events).await?;
    eprintln!(
        "bench: {label}: written in {:.1} s",
        writing.elapsed().as_secs_f64()
    );
    let drain = drain::drain(bench, &case, events).await?;
    let n = events as f64;
    results.record(&label, RELAY_RSS, Unit::Mib, drain.peak_rss_mib);
    results.record(
        &label,
        "relay context switches",
        Unit::PerEvent,
        drain.context_switches as f64 / n,
    );
    results.record(&label, RELAY, Unit::Rate, n / drain.seconds);
    results.record(
        &label,
        RELAY_CPU,
        Unit::MicrosPerEvent,
        drain.relay_cpu * 1e6 / n,
    );
    eprintln!(
        "bench: {label}: relay {:.0}/s, {:.1} MiB peak RSS",
        n / drain.seconds,
        drain.peak_rss_mib
    );
    let stream = case.stream.clone();
    bench.drop_case(case, &[&stream]).await
}

/// A target's bound on a median.
#[derive(Debug, Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Bound {
    fn met(self, value: f64) -> bool {
        match self {
            Bound::AtLeast(bound) => value >= bound,
            Bound::AtMost(bound) => value <= bound,
        }
    }
}

/// The issue's targets against the medians.
fn targets(results: &Results, sizes: &Sizes) -> Vec<Target> {
    use Bound::{AtLeast, AtMost};
    let single = backlog_label(sizes.single, 1);
    let batch = backlog_label(sizes.batch, TX_ROWS);
    let large = backlog_label(sizes.batch_large, TX_ROWS);
    let live = latency_label(1_000.0, 1);
    let busy = latency_label(10_000.0, 1);
    let big_tx = big_tx_label(sizes.big_tx);
    let polling = polling_label(sizes.polling);
    let (readme_batch, readme_handling) = consume::CONFIGURATIONS[2];
    let readmes = consume::label(sizes.consumer, readme_batch, readme_handling);
    let pipeline = pipeline::label(sizes.batch, TX_ROWS);
    let pipeline_p99 = pipeline::latency_measure("p99", 1_000.0);
    // (measure, scenario, goal, unit, bound), in the table's order.
    let mut goals = vec![(VS_DECODE, &single, "≥ 1.0", Unit::Ratio, AtLeast(1.0))];
    for label in [&batch, &large] {
        goals.push((VS_DECODE, label, "≥ 0.9", Unit::Ratio, AtLeast(0.9)));
    }
    for label in [&single, &batch, &large] {
        goals.push((
            RELAY_CPU,
            label,
            "≤ 4 µs/event",
            Unit::MicrosPerEvent,
            AtMost(4.0),
        ));
    }
    // Issue 13: the relay no more CPU per event than the walsender it reads from.
    for label in [&batch, &large] {
        goals.push((
            RELAY_PER_WALSENDER,
            label,
            "≤ 1.0",
            Unit::Ratio,
            AtMost(1.0),
        ));
    }
    goals.extend([
        (
            "commit → stored p50",
            &live,
            "≤ 0.5 ms",
            Unit::Millis,
            AtMost(0.5),
        ),
        (
            "commit → stored p99",
            &live,
            "≤ 1 ms",
            Unit::Millis,
            AtMost(1.0),
        ),
        (
            "commit → stored p99",
            &busy,
            "≤ 5 ms",
            Unit::Millis,
            AtMost(5.0),
        ),
        (RELAY_RSS, &big_tx, "≤ 64 MiB", Unit::Mib, AtMost(64.0)),
        (RELAY_RSS, &large, "≤ 64 MiB", Unit::Mib, AtMost(64.0)),
    ]);
    // Issue 44: the consumer side with the README's handler, and the pipeline to the side
    // effect.
    goals.extend([
        (consume::VS_ONE, &readmes, "≥ 4", Unit::Ratio, AtLeast(4.0)),
        (
            consume::VS_PUBLISHING,
            &readmes,
            "≤ 3",
            Unit::Ratio,
            AtMost(3.0),
        ),
        (
            pipeline::VS_DRAIN,
            &pipeline,
            "≥ 0.25",
            Unit::Ratio,
            AtLeast(0.25),
        ),
        (
            pipeline::VS_SEED_PAIR,
            &pipeline,
            "≥ 8",
            Unit::Ratio,
            AtLeast(8.0),
        ),
        (
            pipeline_p99.as_str(),
            &pipeline,
            "≤ 3 ms",
            Unit::Millis,
            AtMost(3.0),
        ),
    ]);
    goals.push((
        "relay / seed's polling",
        &polling,
        "≥ 5",
        Unit::Ratio,
        AtLeast(5.0),
    ));
    goals
        .into_iter()
        .map(|(measure, scenario, goal, unit, bound)| {
            let value = results.get(scenario, measure).map(|f| f.median());
            // The drain's ratio is named for what it compares.
            let name = if measure == VS_DECODE {
                "relay drain / pg_recvlogical"
            } else {
                measure
            };
            Target {
                what: format!("{name}, {scenario}"),
                goal: goal.to_owned(),
                measured: value.map_or_else(
                    || "not run".to_owned(),
                    |v| format!("{} {}", unit.format(v), unit.label()),
                ),
                met: value.map(|v| bound.met(v)),
            }
        })
        .collect()
}

/// nproc, memory, CPU model, kernel, Postgres and nats-server versions, and the commit.
async fn machine(bench: &Bench) -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let memory = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or_else(
            || "?".to_owned(),
            |kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0),
        );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_owned();
    let postgres = match bench.admin.query_one("select version()", &[]).await {
        Ok(row) => row
            .get::<_, String>(0)
            .split(" on ")
            .next()
            .unwrap_or_default()
            .to_owned(),
        Err(_) => "?".to_owned(),
    };
    let nats_bin =
        std::env::var("TESTKIT_NATS_SERVER").unwrap_or_else(|_| "nats-server".to_owned());
    let nats = command_output(&nats_bin, &["--version"]);
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"]);
    let dirty =
        !command_output("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty();
    format!(
        "{cores} cores ({cpu}), {memory} memory, Linux {kernel}; {postgres}; {nats}; commit {commit}{}",
        if dirty { " (with uncommitted changes)" } else { "" }
    )
}

/// Whether the benchmark's nats-server (`TESTKIT_NATS_SERVER`, else the one on `PATH`) is
/// 2.12 or newer: atomic batches.
/// The benchmarked nats-server's (major, minor) version.
fn nats_version() -> (u64, u64) {
    let bin = std::env::var("TESTKIT_NATS_SERVER").unwrap_or_else(|_| "nats-server".to_owned());
    let version = command_output(&bin, &["--version"]);
    let mut parts = version
        .trim_start_matches(|c: char| !c.is_ascii_digit())
        .split('.')
        .map(|part| part.parse::<u64>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
