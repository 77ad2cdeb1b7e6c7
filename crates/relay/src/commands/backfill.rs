//! `outbox-relay backfill --from-id/--to-id/--since/--until`: the rows of the current table
//! in that range, published with the same keys as streamed events, on an existing slot and
//! stream. No snapshot ties the range to the slot, so a row may also be (or have been)
//! streamed: its copy is dropped by JetStream's `Nats-Msg-Id` de-duplication within the
//! duplicate window, and published again after it. Into a strict stream it is refused
//! without `--force` (it would append old rows after newer events). The rows are read as at
//! slot creation (`crate::postgres::range`, `crate::setup::backfill` BF2).

use std::time::{Duration, Instant};

use async_nats::jetstream;
use tracing::info;

use crate::config::Config;
use crate::error::{RelayError, Result, Target};
use crate::postgres::checks;
pub use crate::postgres::range::Filter;
use crate::postgres::range::{sql_error, Cursor};
use crate::postgres::rows::{check_id_bound, RowReader};
use crate::stream::policy;

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Awaits one publish's ack and counts it.
async fn settle(ack: jetstream::context::PublishAckFuture, report: &mut RangeReport) -> Result<()> {
    let ack = ack.await.map_err(|e| {
        RelayError::transient(anyhow::anyhow!(
            "a backfill publish was not acknowledged: {e}"
        ))
    })?;
    if ack.duplicate {
        report.duplicates += 1;
    } else {
        report.published += 1;
    }
    Ok(())
}

/// What `outbox-relay backfill` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeReport {
    /// Rows read.
    pub read: u64,
    /// Stored as new messages.
    pub published: u64,
    /// Dropped by JetStream as duplicates (the stream held the id within its window).
    pub duplicates: u64,
}

/// `outbox-relay backfill`: publishes the rows of the current table in `filter`'s range,
/// with the same keys as streamed events, on an existing slot and stream. Refused into a
/// strict stream unless `force`.
pub async fn range(config: &Config, filter: &Filter, force: bool) -> Result<RangeReport> {
    if !config.shared_stream && !force {
        return Err(RelayError::setup(anyhow::anyhow!(
            "stream {} is in strict mode, where the relay is its only writer and the stream is in commit order: a backfill appends old rows after newer events (and a row the stream holds beyond the duplicate window would be stored twice). Run it with --shared-stream true if the stream is shared, or add --force to append anyway",
            config.stream
        )));
    }
    let client = replication::connect_sql(&config.database).await?;
    if !checks::slot_exists(&client, &config.slot).await? {
        return Err(RelayError::setup(anyhow::anyhow!(
            "replication slot {:?} does not exist: `outbox-relay backfill` loads a range beside a running relay; to publish the rows already in the table when the slot is created, start the relay (or `outbox-relay init`) with --backfill",
            config.slot
        )));
    }
    let jetstream =
        crate::connect::jetstream_context(crate::connect::connect_nats(config).await?, config);
    policy::stream(&jetstream, config)
        .await
        .map_err(|e| e.at(Target::Nats))?;
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await
        .map_err(|e| sql_error("cannot read the outbox table", e))?;
    let columns = checks::check_table(&client, config).await?;
    let reader = RowReader::with_payload(config, columns);
    for (flag, bound) in [("--from-id", &filter.from_id), ("--to-id", &filter.to_id)] {
        if let Some(text) = bound {
            check_id_bound(&client, reader.id_kind(), flag, text).await?;
        }
    }
    let cursor = Cursor::open(&client, config, reader, filter).await?;
    if cursor.total == 0 {
        let _ = client.batch_execute("COMMIT").await;
        return Err(crate::postgres::rows::no_rows_in_range(
            &config.table,
            "backfill",
        ));
    }
    let report = publish_range(&jetstream, config, cursor).await?;
    let _ = client.batch_execute("COMMIT").await;
    Ok(report)
}

/// Publishes the cursor's rows directly (at most `max_in_flight` acks awaited at once),
/// counting what JetStream stored and what it dropped as duplicates.
async fn publish_range(
    jetstream: &jetstream::Context,
    config: &Config,
    mut cursor: Cursor<'_>,
) -> Result<RangeReport> {
    let mut report = RangeReport::default();
    let mut acks = std::collections::VecDeque::new();
    let mut last_log = Instant::now();
    while let Some(events) = cursor.next().await? {
        report.read += events.len() as u64;
        for event in events {
            if acks.len() >= config.max_in_flight {
                if let Some(ack) = acks.pop_front() {
                    settle(ack, &mut report).await?;
                }
            }
            let message = sink::publish_message(&event);
            let ack = jetstream
                .send_publish(event.subject.clone(), message)
                .await
                .map_err(|e| {
                    RelayError::transient(anyhow::anyhow!(
                        "cannot publish outbox row id={}: {e}",
                        event.id
                    ))
                })?;
            acks.push_back(ack);
        }
        if last_log.elapsed() >= PROGRESS_EVERY {
            last_log = Instant::now();
            info!(
                read = report.read,
                total = cursor.total,
                "backfill progress"
            );
        }
    }
    while let Some(ack) = acks.pop_front() {
        settle(ack, &mut report).await?;
    }
    Ok(report)
}
