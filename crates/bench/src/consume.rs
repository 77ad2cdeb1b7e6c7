//! **Consumer throughput**: `outbox-consumer` applying a backlog of the relay's events, one
//! side effect per event, each in the Postgres transaction that records its `dedupe_key`.
//!
//! - The events are those the relay publishes for the seed-like rows of [`crate::load`]
//!   (1 000 entities, `OrderPaid`, the relay's headers), published pipelined to a fresh
//!   stream before the consumer starts ([`crate::ceilings::publish_pipelined`]).
//! - The consumer runs in this process on the relay's 12 shards (12 durable consumers,
//!   tasks and Postgres connections), with a handler like the README's: one `INSERT` into a
//!   ledger table through the transaction. Per event: `BEGIN`, the dedupe insert, the
//!   handler's insert, `COMMIT`, then the ack.
//! - events/s: the backlog divided by the time from starting the consumer to the last
//!   event processed (start-up, creating the durable consumers, included);
//! - CPU µs/event: this process (the consumer; nothing else runs in it meanwhile), the
//!   consumer's Postgres backends (reaped by the postmaster once its connections closed) and
//!   nats-server, over the same time.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use outbox::{OutboxRow, Position};
use outbox_consumer::{BoxError, Config, Consumer, Event, Handler, Postgres, Transaction};
use pgoutput::Lsn;

use crate::ceilings;
use crate::harness::{Bench, Case};
use crate::load;
use crate::procfs;

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

/// The side effect: a ledger row per event.
struct Ledger;

impl Handler for Ledger {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), BoxError> {
        tx.execute(
            "insert into ledger (outbox_id, entity_id, payload) values ($1, $2, $3::text::jsonb)",
            &[&event.id, &event.entity_id, &event.payload_str()?],
        )
        .await?;
        Ok(())
    }
}

/// Publishes `events` relay events to a fresh stream of `case` and applies them with the
/// consumer.
pub async fn consume(bench: &Bench, case: &Case, events: u64) -> Result<Consumed> {
    case.sql
        .batch_execute(outbox_consumer::SCHEMA_SQL)
        .await
        .context("apply sql/consumer.sql")?;
    case.sql
        .batch_execute(
            "create table ledger (outbox_id bigint not null, entity_id text not null, payload jsonb not null)",
        )
        .await?;
    bench.create_stream(&case.stream, &case.prefix).await?;
    let backlog: Vec<_> = (1..=events as i64)
        .map(|id| {
            OutboxRow {
                id,
                entity_id: format!("entity-{}", id % 1000),
                event_type: "OrderPaid".to_owned(),
                payload: format!("{{\"amount\": 10, \"order_id\": {id}}}").into(),
                created_at_ms: 1_700_000_000_000 + id,
            }
            .into_event(
                &case.prefix,
                load::PARTITIONS,
                Position {
                    commit_lsn: Lsn(id as u64),
                    index: 0,
                },
            )
        })
        .collect();
    let js = ceilings::pipelined_context(bench).await?;
    let stored = ceilings::publish_pipelined(&js, &backlog).await?;
    if stored != events {
        bail!("consumer: {stored} of {events} events were stored");
    }
    drop(backlog);

    let mut config = Config::new("bench");
    config.stream = case.stream.clone();
    config.subject_prefix = case.prefix.clone();
    config.partitions = load::PARTITIONS;
    let nats = async_nats::connect(bench.nats.url()).await?;
    let postgres = Postgres::new(case.pg_url.parse()?, tokio_postgres::NoTls);
    let consumer = Consumer::new(config, nats, postgres);
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
    let running = tokio::spawn(consumer.run(Ledger, async {
        let _ = stopped.await;
    }));
    while stats.processed() < events {
        if running.is_finished() {
            bail!("the consumer stopped: {:?}", running.await);
        }
        if start.elapsed() > TIMEOUT {
            bail!(
                "the consumer applied {} of {events} events in {TIMEOUT:?}",
                stats.processed()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let consumer_cpu = procfs::cpu_seconds(me)? - before[0];
    let server_cpu = procfs::cpu_seconds(bench.nats.pid())? - before[2];
    let _ = stop.send(());
    running.await??;
    // The consumer's connections are closed: once their backends exited, the postmaster
    // has reaped their CPU time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let backends_cpu = procfs::reaped_children_cpu_seconds(postmaster)? - before[1];
    let applied: i64 = case
        .sql
        .query_one("select count(distinct outbox_id) from ledger", &[])
        .await?
        .get(0);
    if applied != events as i64 || stats.duplicates() != 0 {
        bail!(
            "consumer: {applied} of {events} events applied, {} duplicates",
            stats.duplicates()
        );
    }
    Ok(Consumed {
        seconds,
        consumer_cpu,
        backends_cpu,
        server_cpu,
    })
}
