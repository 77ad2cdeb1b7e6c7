//! **Publish modes** (issue 23): the same backlog of 1 000-row transactions drained by the
//! relay once per publish mode, on the same nats-server in the same run: per message (the
//! default, an ack per event) and atomic transactions (`--atomic-transactions`, one atomic
//! batch per transaction, on nats-server 2.12 or newer only; skipped, and said, on an older
//! one). Each drain is [`crate::drain`]'s (a fresh database, slot and stream per mode, the
//! backlog written before the relay starts); rows per mode: events/s, the CPU per event of
//! the walsender, the relay and nats-server, and their sum (the whole pipeline's), and the
//! relay's CPU over the walsender's.

use anyhow::Result;

use crate::harness::Bench;
use crate::report::{Results, Unit};
use crate::{drain, load};

/// A publish mode: its label and the relay environment that selects it.
struct Mode {
    label: &'static str,
    atomic: bool,
}

const MODES: [Mode; 2] = [
    Mode {
        label: "per message",
        atomic: false,
    },
    Mode {
        label: "atomic transactions",
        atomic: true,
    },
];

const ATOMIC_ENV: &str = "OUTBOX_RELAY_ATOMIC_TRANSACTIONS";

/// Drains `events` events in `per_tx`-row transactions once per mode the server supports
/// (`atomic_supported`), recording each mode's figures.
pub async fn compare(
    bench: &mut Bench,
    results: &mut Results,
    events: u64,
    per_tx: u64,
    atomic_supported: bool,
) -> Result<()> {
    for mode in &MODES {
        if mode.atomic && !atomic_supported {
            eprintln!("bench: modes: atomic transactions skipped (nats-server older than 2.12)");
            continue;
        }
        let label = format!("modes: {events} events in {per_tx}-row tx, {}", mode.label);
        let mut case = bench.case("modes").await?;
        case.relay.extra_env.retain(|(key, _)| key != ATOMIC_ENV);
        case.relay
            .extra_env
            .push((ATOMIC_ENV.to_owned(), mode.atomic.to_string()));
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
