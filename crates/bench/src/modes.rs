//! **Publish modes** (issue 23): the same backlog of 1 000-row transactions drained by the
//! relay once per publish mode, on the same nats-server in the same run: per message (an ack
//! per event, `--fast-ingest false`), fast-ingest batches (the default, nats-server 2.14 or
//! newer) and atomic transactions (`--atomic-transactions`, one atomic batch per
//! transaction, nats-server 2.12 or newer); a mode the server lacks is skipped, and said. A
//! fourth row, for reference only, drains in fast-ingest batches into a stream an operator
//! made with `persist_mode: async` (acknowledged before written; the relay warns about it):
//! what giving up nats-server's durability against a kill would save.
//! Each drain is [`crate::drain`]'s (a fresh database, slot and stream per mode, the backlog
//! written before the relay starts); rows per mode: events/s, the CPU per event of the
//! walsender, the relay and nats-server, and their sum (the whole pipeline's), and the
//! relay's CPU over the walsender's.

use anyhow::Result;

use crate::harness::Bench;
use crate::report::{Results, Unit};
use crate::{drain, load};

/// A publish mode: its label, the first nats-server that has it and the relay environment
/// that selects it.
struct Mode {
    label: &'static str,
    first: (u64, u64),
    env: [(&'static str, bool); 2],
    /// The stream is created beforehand with `persist_mode: async`: nats-server acknowledges
    /// before it writes, which the relay warns about (a server kill loses acknowledged
    /// events). Measured for reference only: what giving up that durability would save.
    persist_async: bool,
}

const ATOMIC_ENV: &str = "OUTBOX_RELAY_ATOMIC_TRANSACTIONS";
const FAST_ENV: &str = "OUTBOX_RELAY_FAST_INGEST";

const MODES: [Mode; 4] = [
    Mode {
        label: "per message",
        first: (0, 0),
        env: [(ATOMIC_ENV, false), (FAST_ENV, false)],
        persist_async: false,
    },
    Mode {
        label: "fast-ingest batches",
        first: (2, 14),
        env: [(ATOMIC_ENV, false), (FAST_ENV, true)],
        persist_async: false,
    },
    Mode {
        label: "atomic transactions",
        first: (2, 12),
        env: [(ATOMIC_ENV, true), (FAST_ENV, false)],
        persist_async: false,
    },
    Mode {
        label: "fast-ingest batches, persist_mode async (reference: not durable)",
        first: (2, 14),
        env: [(ATOMIC_ENV, false), (FAST_ENV, true)],
        persist_async: true,
    },
];

/// Drains `events` events in `per_tx`-row transactions once per mode nats-server `version`
/// has, recording each mode's figures.
pub async fn compare(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    per_tx: u64,
    version: (u64, u64),
) -> Result<()> {
    for mode in &MODES {
        if version < mode.first {
            eprintln!(
                "bench: modes: {} skipped (nats-server {}.{} is older than {}.{})",
                mode.label, version.0, version.1, mode.first.0, mode.first.1
            );
            continue;
        }
        let label = format!("modes: {events} events in {per_tx}-row tx, {}", mode.label);
        let mut case = bench.case("modes").await?;
        for (key, value) in mode.env {
            case.relay.extra_env.retain(|(set, _)| set != key);
            case.relay
                .extra_env
                .push((key.to_owned(), value.to_string()));
        }
        if mode.persist_async {
            create_async_stream(bench, &case).await?;
        }
        bench.relay_init(&case)?;
        load::write_batched(&case.sql, events, per_tx).await?;
        let drained = drain::drain(bench, &case, events).await?;
        let n = events as f64;
        let per_event = |seconds: f64| seconds * 1e6 / n;
        let (walsender, relay, server) = (
            per_event(drained.walsender_cpu),
            per_event(drained.relay_cpu),
            per_event(drained.server_cpu),
        );
        results.record(&label, "events/s", Unit::Rate, n / drained.seconds);
        results.record(&label, "walsender CPU", Unit::MicrosPerEvent, walsender);
        results.record(&label, "relay CPU", Unit::MicrosPerEvent, relay);
        results.record(&label, "nats-server CPU", Unit::MicrosPerEvent, server);
        results.record(
            &label,
            "pipeline CPU (walsender + relay + nats-server)",
            Unit::MicrosPerEvent,
            walsender + relay + server,
        );
        results.record(
            &label,
            "relay CPU / walsender CPU",
            Unit::Ratio,
            relay / walsender,
        );
        eprintln!(
            "bench: {label}: {:.0}/s; CPU µs/event walsender {walsender:.2}, relay {relay:.2}, nats-server {server:.2}, sum {:.2}",
            n / drained.seconds,
            walsender + relay + server
        );
        let stream = case.relay.stream.clone();
        bench.drop_case(case, &[&stream]).await?;
    }
    Ok(())
}

/// The case's stream as the relay would create it on 2.14+ (`allow_batched`), but with
/// `persist_mode: async`, which only an operator can choose.
async fn create_async_stream(bench: &Bench, case: &crate::harness::Case) -> Result<()> {
    let config = serde_json::json!({
        "name": case.stream, "subjects": [format!("{}.>", case.prefix)], "storage": "file",
        "duplicate_window": crate::harness::DUPLICATE_WINDOW.as_nanos(),
        "allow_batched": true, "persist_mode": "async",
    });
    let answer: serde_json::Value = bench
        .js
        .request(format!("STREAM.CREATE.{}", case.stream), &config)
        .await?;
    if let Some(error) = answer.get("error") {
        anyhow::bail!(
            "create stream {} (persist_mode async): {error}",
            case.stream
        );
    }
    Ok(())
}
