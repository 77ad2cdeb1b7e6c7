//! `cargo run -p outbox-relay-demo`: the whole relay on a local default.
//!
//! Starts a throwaway Postgres (`wal_level=logical`) and `nats-server -js` on free ports,
//! applies the seed's schema, runs the `outbox-relay` binary on them as an operator would
//! (`outbox-relay run` with `DATABASE_URL`, `NATS_URL` and `OUTBOX_RELAY_METRICS_ADDR`, everything else at its
//! defaults; its log is shown prefixed with `[relay]`), writes sample events the way the
//! seed's `seed.py` does (placeholder key columns, one transaction rolled back), and prints
//! every message as it arrives in JetStream with its subject and keys. Everything is removed
//! on exit. The relay serves its metrics and health on a free local port (printed).
//! `--keep` leaves it running until Ctrl-C, printing the URLs to connect to.
//!
//! The relay binary is the one of the demo's own cargo profile (`target/<profile>/`), built
//! first when the demo runs under cargo ([`testkit::harness::built_relay`]); outside cargo,
//! build it with `cargo build -p outbox-relay`.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use futures::StreamExt;
use testkit::harness::{built_relay, relay_command, sql_connect, STREAMING};
use testkit::{Nats, Postgres, Process};

const SCHEMA: &str = include_str!("../../../sql/schema.sql");

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let keep = std::env::args().any(|a| a == "--keep");
    let relay_bin = built_relay(None, env!("CARGO_PKG_NAME")).map_err(anyhow::Error::msg)?;
    let (pg, nats) = start_servers().await?;
    let database_url = pg.url("postgres");
    let relay = start_relay(&relay_bin, &database_url, &nats).await?;
    let mut messages = follow_stream(&nats).await?;
    let sql = sql_connect(&database_url).await?;
    let written = write_samples(&sql).await?;
    print_messages(&mut messages, written).await?;
    if keep {
        println!("== running until Ctrl-C; write rows to outbox_events at {database_url}");
        tokio::signal::ctrl_c().await?;
    }
    stop(relay, &sql).await?;
    drop(pg);
    drop(nats);
    Ok(())
}

/// A throwaway Postgres 15 with the seed's schema and a nats-server with JetStream.
async fn start_servers() -> anyhow::Result<(Postgres, Nats)> {
    println!("== starting a throwaway Postgres 15 (wal_level=logical) and nats-server -js");
    let (pg, nats) = tokio::task::spawn_blocking(|| (Postgres::start(), Nats::start())).await?;
    pg.psql("postgres", SCHEMA);
    println!(
        "   DATABASE_URL={}\n   NATS_URL={}",
        pg.url("postgres"),
        nats.url()
    );
    Ok((pg, nats))
}

/// `outbox-relay run` on both servers as an operator runs it, once it streams.
async fn start_relay(
    relay_bin: &std::path::Path,
    database_url: &str,
    nats: &Nats,
) -> anyhow::Result<Process> {
    println!("== running {} run (slot outbox_relay, stream OUTBOX, subjects outbox.{{shard}}.{{event_type}})", relay_bin.display());
    let log_filter = std::env::var("RUST_LOG")
        .unwrap_or_else(|_| "info,async_nats=warn,tokio_postgres=warn".to_owned());
    let metrics_addr = format!("127.0.0.1:{}", testkit::free_port());
    let env = [
        ("DATABASE_URL", database_url.to_owned()),
        ("NATS_URL", nats.url()),
        ("OUTBOX_RELAY_METRICS_ADDR", metrics_addr.clone()),
        ("RUST_LOG", log_filter),
    ];
    println!("   metrics: http://{metrics_addr}/metrics, health: /healthz, /readyz");
    let relay = Process::spawn_echoing("relay", relay_command(relay_bin, &[], "run", env));
    Ok(tokio::task::spawn_blocking(move || {
        relay.wait_for_output(STREAMING, Duration::from_secs(60));
        relay
    })
    .await?)
}

/// Every message of the stream `OUTBOX`, from its first.
async fn follow_stream(nats: &Nats) -> anyhow::Result<jetstream::consumer::pull::Stream> {
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let stream = js.get_stream("OUTBOX").await?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            ack_policy: jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await?;
    Ok(consumer.messages().await?)
}

/// Writes the sample events as the seed's `seed.py` does, and one transaction rolled back;
/// returns how many were committed.
async fn write_samples(sql: &tokio_postgres::Client) -> anyhow::Result<usize> {
    println!("== writing sample events the way the seed's seed.py does (placeholder keys)");
    let insert = "insert into outbox_events(entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
                  values ($1, $2, $3, 'placeholder', '0000000000000:00000000000000000000', $4::text::jsonb)";
    // Entities on different shards (shard_for_key(12, ·): order:A-1 → 0, order:C-3 → 6,
    // customer:42 → 3), and event types the subject must escape.
    let samples = [
        (
            "order:A-1",
            "OrderCreated",
            r#"{"order_id": "A-1", "amount": 10}"#,
        ),
        (
            "order:A-1",
            "OrderUpdated",
            r#"{"order_id": "A-1", "amount": 20}"#,
        ),
        (
            "order:C-3",
            "OrderCreated",
            r#"{"order_id": "C-3", "amount": 5}"#,
        ),
        ("order:A-1", "OrderPaid", r#"{"order_id": "A-1"}"#),
        (
            "order:C-3",
            "order.refunded",
            r#"{"order_id": "C-3", "reason": "damaged"}"#,
        ),
        (
            "customer:42",
            "Customer Registered",
            r#"{"customer_id": 42}"#,
        ),
    ];
    for (i, (entity, event_type, payload)) in samples.iter().enumerate() {
        sql.execute(insert, &[entity, event_type, &format!("tmp{i}"), payload])
            .await?;
    }
    sql.batch_execute(
        "begin; insert into outbox_events(entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         values ('order:C-9', 'OrderCreated', 'tmp-rolled-back', '', '', '{}'); rollback;",
    )
    .await?;
    println!(
        "   committed {} events and rolled one back (it must not appear)",
        samples.len()
    );
    Ok(samples.len())
}

/// Prints the next `count` messages with their subject and keys.
async fn print_messages(
    messages: &mut jetstream::consumer::pull::Stream,
    count: usize,
) -> anyhow::Result<()> {
    println!("== messages in JetStream:");
    for _ in 0..count {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .context("no message within 30 s")?
            .context("consumer ended")??;
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default()
        };
        let seq = message
            .info()
            .map(|i| i.stream_sequence)
            .unwrap_or_default();
        println!(
            "   #{seq} {subject}\n      Nats-Msg-Id={} Outbox-Ordering-Key={} Outbox-Shard={} Outbox-Commit-Lsn={}\n      payload={}",
            header("Nats-Msg-Id"),
            header("Outbox-Ordering-Key"),
            header("Outbox-Shard"),
            header("Outbox-Commit-Lsn"),
            String::from_utf8_lossy(&message.payload),
            subject = message.subject,
        );
    }
    Ok(())
}

/// Stops the relay as an operator does (SIGTERM: drain, confirm, exit) and shows what the
/// slot confirmed.
async fn stop(relay: Process, sql: &tokio_postgres::Client) -> anyhow::Result<()> {
    println!("== stopping the relay (SIGTERM: drain, confirm, exit)");
    let status = tokio::task::spawn_blocking(move || {
        let mut relay = relay;
        relay.terminate(Duration::from_secs(30))
    })
    .await?;
    anyhow::ensure!(status.success(), "the relay exited with {status}");
    let confirmed: String = sql
        .query_one("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = 'outbox_relay'", &[])
        .await?
        .get(0);
    println!("== done: the slot confirmed {confirmed}; servers and data are removed on exit");
    Ok(())
}
