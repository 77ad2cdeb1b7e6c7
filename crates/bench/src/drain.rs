//! **Relay drain**: the real `outbox-relay run` (a child process, configured by
//! environment like the end-to-end tests) drains a backlog that was written before it
//! started (its slot and stream were created by `outbox-relay init` before the backlog).
//!
//! - events/s: the backlog's events divided by the time from spawning the process to the
//!   stream holding all of them (the stream's message count, polled every 10 ms): start-up,
//!   bootstrap checks and connecting are included, as an operator would see them;
//! - CPU µs/event: the relay's `utime + stime` (`/proc/<pid>/stat`) over the events, read
//!   when the last event is stored (start-up included);
//! - start-up: from spawning to the relay's `streaming outbox events` log line (seen by
//!   the same 10 ms polling), part of the drain time;
//! - peak RSS: `VmHWM` of `/proc/<pid>/status` at the same moment;
//! - context switches and read/write system calls of the relay per event (from
//!   `/proc/<pid>/task/*/status` and `/proc/<pid>/io`), start-up included;
//! - also, for the explanation of the figures: the CPU of the walsender serving the relay
//!   and of nats-server during the drain.
//!
//! With `--metrics` the relay serves its metrics and the drain scrapes them every second,
//! so the figures include what metrics cost.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::harness::{Bench, Case};
use crate::procfs;

/// How often `--metrics` scrapes the relay.
pub const SCRAPE_EVERY: Duration = Duration::from_secs(1);

/// How long a drain may take before the benchmark gives up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(900);

/// What one drain cost.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    pub seconds: f64,
    /// From spawning the relay to its "streaming outbox events" log line.
    pub startup_seconds: f64,
    pub relay_cpu: f64,
    pub peak_rss_mib: f64,
    pub walsender_cpu: f64,
    pub server_cpu: f64,
    /// The relay's context switches (all threads) when the last event was stored.
    pub context_switches: u64,
    /// The relay's read- and write-type system calls by then.
    pub io_syscalls: u64,
}

/// Starts the relay on `case` and waits until its stream holds `events` messages.
pub async fn drain(bench: &Bench, case: &Case, events: u64) -> Result<Drain> {
    let server_before = procfs::cpu_seconds(bench.nats.pid())?;
    let start = Instant::now();
    let mut relay = case.spawn_relay();
    let mut startup_seconds = f64::NAN;
    let mut scraped = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Some(port) = bench
            .metrics_port
            .filter(|_| scraped.elapsed() >= SCRAPE_EVERY)
        {
            // --metrics: as Prometheus would (the answer is not needed).
            scraped = Instant::now();
            tokio::task::spawn_blocking(move || testkit::http_get(port, "/metrics"))
                .await?
                .ok();
        }
        if startup_seconds.is_nan() && relay.output().contains("streaming outbox events") {
            startup_seconds = start.elapsed().as_secs_f64();
        }
        if let Some(status) = relay.try_status() {
            bail!(
                "the relay exited ({status}) before draining {events} events:\n{}",
                relay.output()
            );
        }
        if bench.stream_count(&case.stream).await? >= events {
            break;
        }
        if start.elapsed() > DRAIN_TIMEOUT {
            bail!(
                "the relay did not drain {events} events within {DRAIN_TIMEOUT:?}:\n{}",
                relay.output()
            );
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let relay_cpu = procfs::cpu_seconds(relay.pid())?;
    let peak_rss_mib = procfs::peak_rss_mib(relay.pid())?;
    let context_switches = procfs::context_switches(relay.pid())?;
    let io_syscalls = procfs::io_syscalls(relay.pid())?;
    let server_cpu = procfs::cpu_seconds(bench.nats.pid())? - server_before;
    let walsender_cpu = match bench.walsender_pid(&case.slot).await? {
        Some(pid) => procfs::cpu_seconds(pid).unwrap_or(f64::NAN),
        None => f64::NAN,
    };
    let pid = relay.pid();
    let status = tokio::task::spawn_blocking(move || {
        let status = relay.terminate(Duration::from_secs(60));
        (status, relay.output())
    })
    .await?;
    if !status.0.success() {
        eprintln!(
            "bench: the relay (pid {pid}) exited with {} after SIGTERM:\n{}",
            status.0, status.1
        );
    }
    Ok(Drain {
        seconds,
        startup_seconds,
        relay_cpu,
        peak_rss_mib,
        walsender_cpu,
        server_cpu,
        context_switches,
        io_syscalls,
    })
}
