//! **The polling baseline**: what users run instead of a relay, written here as the seed
//! describes it (`publish_batch` of `deterministic-shard-aware-outbox.md`), publishing the
//! relay's own messages (`sink::publish_message`: same subject, headers, `Nats-Msg-Id`).
//!
//! Each round is one transaction: claim up to `limit` `pending` rows, oldest first,
//! `FOR UPDATE SKIP LOCKED`, setting them `publishing`; publish them; mark them
//! `published` (`attempts + 1`, `published_at = now()`); commit. Rounds repeat until a
//! claim returns nothing. Timed from the first claim to the last commit.
//!
//! - [`Variant::PerRow`] is the seed's loop: per row, publish, await its ack, `UPDATE` it.
//!   The seed claims 50 rows at a time (its `main`).
//! - [`Variant::Batched`] is the best cheap improvement: publish the whole claimed batch
//!   pipelined, await all acks, then one `UPDATE … WHERE id = ANY($1)`; 1 000 rows a claim.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use outbox::{OutboxEvent, Position};
use pgoutput::Lsn;

use crate::harness::{connect_sql, Bench, Case};
use crate::load::{row_event, ROW_COLUMNS};

/// How the polling publisher publishes a claimed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The seed's: publish, await the ack, mark published, one row at a time.
    PerRow { limit: i64 },
    /// Publish the batch pipelined, await all acks, one UPDATE.
    Batched { limit: i64 },
}

impl Variant {
    fn limit(self) -> i64 {
        match self {
            Variant::PerRow { limit } | Variant::Batched { limit } => limit,
        }
    }
}

/// The polling publisher's subject prefix and stream in `case` (the relay's prefix with
/// another first letter: the subjects have the same length).
pub fn stream_of(case: &Case) -> (String, String) {
    (
        case.prefix.replacen('t', "p", 1),
        format!("POLL_{}", case.database.to_uppercase()),
    )
}

/// Drains the case's `pending` rows into the stream `stream` covering `{prefix}.>` (created
/// unless it exists as [`Bench::create_stream`] makes it); returns the seconds it took. The
/// caller deletes the stream (with its case).
pub async fn drain(
    bench: &Bench,
    case: &Case,
    variant: Variant,
    events: u64,
    stream: &str,
    prefix: &str,
) -> Result<f64> {
    bench.create_stream(stream, prefix).await?;
    let mut sql = connect_sql(&case.pg_url).await?;
    let client = async_nats::connect(bench.nats.url()).await?;
    let js = jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_ack_inflight(variant.limit() as usize + 1)
        .build(client);
    let claim = format!(
        "with cte as ( \
           select id from outbox_events where status = 'pending' \
            order by created_at asc limit $1 for update skip locked) \
         update outbox_events set status = 'publishing' \
          where id in (select id from cte) \
         returning {ROW_COLUMNS}"
    );
    let start = Instant::now();
    let mut published = 0u64;
    loop {
        let tx = sql.transaction().await?;
        let rows = tx.query(&claim, &[&variant.limit()]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        let events: Vec<OutboxEvent> = rows
            .iter()
            .map(|row| {
                row_event(
                    prefix,
                    row,
                    Position {
                        commit_lsn: Lsn::ZERO,
                        index: 0,
                    },
                )
            })
            .collect();
        match variant {
            Variant::PerRow { .. } => {
                let mark = tx
                    .prepare(
                        "update outbox_events set status = 'published', attempts = attempts + 1, \
                         published_at = now() where id = $1",
                    )
                    .await?;
                for event in &events {
                    js.send_publish(event.subject.clone(), sink::publish_message(event))
                        .await
                        .context("polling: publish")?
                        .await
                        .context("polling: ack")?;
                    tx.execute(&mark, &[&event.id.as_int()]).await?;
                }
            }
            Variant::Batched { .. } => {
                let mut acks = Vec::with_capacity(events.len());
                for event in &events {
                    acks.push(
                        js.send_publish(event.subject.clone(), sink::publish_message(event))
                            .await
                            .context("polling: publish")?,
                    );
                }
                for ack in acks {
                    ack.await.context("polling: ack")?;
                }
                let ids: Vec<i64> = events.iter().filter_map(|e| e.id.as_int()).collect();
                tx.execute(
                    "update outbox_events set status = 'published', attempts = attempts + 1, \
                     published_at = now() where id = any($1)",
                    &[&ids],
                )
                .await?;
            }
        }
        tx.commit().await?;
        published += events.len() as u64;
    }
    let seconds = start.elapsed().as_secs_f64();
    let stored = bench.stream_count(stream).await?;
    if published != events || stored != events {
        bail!("polling published {published} and the stream holds {stored}, expected {events}");
    }
    Ok(seconds)
}
