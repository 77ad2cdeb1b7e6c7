//! **The servers' floor for the consumer's latency** (issue 44): the consumer's server work
//! done by the thinnest client this bench can write, for [`crate::pipeline::live`] to run in
//! place of `outbox-consumer`.
//!
//! Per shard, as the library: a durable pull consumer (explicit acks, `max_ack_pending` the
//! batch size, the same pull settings), its own task and Postgres connection; what has been
//! delivered when the task is ready is one batch and one transaction: the batch's
//! `dedupe_key`s recorded (`processed_events`, `on conflict do nothing returning`), the
//! ledger rows in one `INSERT … SELECT unnest(…)` (the README's handler's statement), commit,
//! then an ack per message. Nothing else: no decoding or checks of the events (the ids and
//! columns are read from the headers as they are), no order or parked-entity tracking, no
//! metrics, spans or stop protocol. [`Floor::RoundTrips`] waits for each statement as the
//! library does (four round trips: `BEGIN`, the keys, the ledger, `COMMIT`);
//! [`Floor::Pipelined`] sends the four at once (one round trip), which the library's handler
//! interface does not allow: the handler runs on the keys' answer.

use std::time::Duration;

use anyhow::{Context as _, Result};
use async_nats::jetstream::{self, consumer::pull};
use futures::{FutureExt as _, StreamExt as _};
use outbox::headers;

use crate::harness::{connect_sql, Bench, Case};
use crate::load::PARTITIONS;

/// How the floor's client sends a transaction's statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// Each statement waited for before the next, as the library does: four round trips.
    RoundTrips,
    /// The four statements sent at once: one round trip.
    Pipelined,
}

impl Floor {
    pub fn name(self) -> &'static str {
        match self {
            Floor::RoundTrips => "the servers' floor: a bare client, four round trips",
            Floor::Pipelined => "the servers' floor: a bare client, one pipelined round trip",
        }
    }
}

const RECORD: &str = "insert into processed_events (dedupe_key) select unnest($1::text[]) \
     on conflict do nothing returning dedupe_key";
const LEDGER: &str = "insert into ledger (outbox_id, entity_id, event_type, payload) \
     select i, e, t, p::jsonb from unnest($1::text[], $2::text[], $3::text[], $4::text[]) u(i, e, t, p)";

/// Where an event is when [`start`]'s tasks report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Its message was taken from the pull (the batch's first message as it came).
    Delivered,
    /// Its transaction committed.
    Committed,
}

/// Starts one task per shard consuming `case`'s stream as [`Floor`] says; `mark` is called
/// with each event's outbox id when it is delivered and right after its transaction
/// committed. The tasks run until `stop` turns true.
pub async fn start(
    bench: &Bench,
    case: &Case,
    floor: Floor,
    batch_size: usize,
    mark: impl Fn(Stage, i64) + Clone + Send + Sync + 'static,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<Result<()>>>> {
    let nats = async_nats::connect(bench.nats.url()).await?;
    let js = jetstream::new(nats);
    let stream = js
        .get_stream(&case.stream)
        .await
        .context("the relay's stream")?;
    let mut tasks = Vec::new();
    for shard in 0..PARTITIONS.get() {
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(format!("floor-{shard}")),
                filter_subject: format!("{}.{shard}.>", case.prefix),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: batch_size as i64,
                ..Default::default()
            })
            .await?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch_size)
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await?;
        let sql = connect_sql(&case.pg_url).await?;
        let (mark, stop) = (mark.clone(), stop.clone());
        tasks.push(tokio::spawn(shard_task(
            sql, messages, floor, batch_size, mark, stop,
        )));
    }
    Ok(tasks)
}

async fn shard_task(
    mut sql: tokio_postgres::Client,
    mut messages: pull::Stream,
    floor: Floor,
    batch_size: usize,
    mark: impl Fn(Stage, i64),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let record = sql.prepare(RECORD).await?;
    let ledger = sql.prepare(LEDGER).await?;
    loop {
        let first = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return Ok(()),
            next = messages.next() => next,
        };
        let mut batch = vec![first.context("the pull ended")??];
        while batch.len() < batch_size {
            match messages.next().now_or_never() {
                Some(next) => batch.push(next.context("the pull ended")??),
                None => break,
            }
        }
        let header = |m: &jetstream::Message, name: &str| -> Result<String> {
            Ok(m.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .with_context(|| format!("a message without {name}"))?
                .to_string())
        };
        let (mut keys, mut ids, mut entities, mut types, mut payloads) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut numbers = Vec::with_capacity(batch.len());
        for m in &batch {
            let id = header(m, headers::OUTBOX_ID)?;
            let number: i64 = id.parse()?;
            mark(Stage::Delivered, number);
            numbers.push(number);
            ids.push(id);
        }
        for m in &batch {
            keys.push(header(m, "Nats-Msg-Id")?);
            entities.push(header(m, headers::OUTBOX_ENTITY_ID)?);
            types.push(header(m, headers::OUTBOX_EVENT_TYPE)?);
            payloads.push(String::from_utf8(m.payload.to_vec())?);
        }
        let ledger_params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&ids, &entities, &types, &payloads];
        match floor {
            Floor::RoundTrips => {
                let tx = sql.transaction().await?;
                tx.query(&record, &[&keys]).await?;
                tx.execute(&ledger, &ledger_params).await?;
                tx.commit().await?;
            }
            Floor::Pipelined => {
                // tokio-postgres sends a request when its future is first polled: joined,
                // the four go out together and their answers come back in order.
                let client = &sql;
                futures::future::try_join4(
                    client.batch_execute("begin"),
                    client.query(&record, &[&keys]),
                    client.execute(&ledger, &ledger_params),
                    client.batch_execute("commit"),
                )
                .await?;
            }
        }
        for &number in &numbers {
            mark(Stage::Committed, number);
        }
        for m in batch {
            m.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}"))?;
        }
    }
}
