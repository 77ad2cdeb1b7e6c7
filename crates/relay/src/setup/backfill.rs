//! Backfill (issue 11): publishing the rows that are already in the outbox table.
//!
//! **At slot creation** (`--backfill pending|all|none`, default `pending`): when the relay
//! creates its slot, it creates it on a replication connection with an exported snapshot
//! (`CREATE_REPLICATION_SLOT … LOGICAL pgoutput (SNAPSHOT 'export')`), reads the table in
//! that snapshot on a control connection (`REPEATABLE READ`, `SET TRANSACTION SNAPSHOT`, a
//! cursor in id order, the partitioned root included), publishes those rows through the
//! sink ([`sink::run`], fenced in strict mode), and only then streams from the slot.
//! `pending` selects the rows whose `status` is `'pending'` (the seed's polling publisher
//! has not published them); a table without a `status` column gets `none`, and the log says
//! so.
//!
//! **On an existing slot** (`outbox-relay backfill --from-id/--to-id/--since/--until`):
//! the rows of the current table in that range, with the same keys. No snapshot ties the
//! range to the slot, so a row may also be (or have been) streamed: its copy is dropped by
//! JetStream's `Nats-Msg-Id` de-duplication within the duplicate window, and published
//! again after it. Into a strict stream it is refused without `--force` (it would append
//! old rows after newer events).
//!
//! # Invariants
//! - BF1 No row is missed and none is published twice at the boundary: the snapshot is
//!   exactly what committed before the slot's consistent point, and the slot streams
//!   exactly what committed after it. Streaming starts only after every backfilled row was
//!   acknowledged.
//! - BF2 A backfilled row's position is commit LSN `0/0`, so it precedes every streamed event
//!   (whose commit LSN is at or after the consistent point), and backfilled rows follow each
//!   other in id order (the id column's, `stored` ROW2). The index is, for integer ids, the
//!   outbox id: the same row always gets the same position. Ids above `u32::MAX` are
//!   refused, naming the fix. For uuid and text ids it is the row's ordinal in the
//!   backfill's id order (1, 2, …), counted after the highest index of the backfilled rows
//!   a strict stream already holds when an interrupted backfill starts again (BF3): so
//!   indexes rise along the stream, and are unique within it, but a row's index depends on
//!   the rows before it in that snapshot (another backfill may give it another; P8 never
//!   compares positions). Keys, subject and headers are those of a streamed event: one
//!   builder (`outbox` E4, through [`crate::postgres::rows::RowReader`]), then `sink`'s
//!   message builder. Rows of an event type the mapping's filter excludes are read and not
//!   published, as streaming never publishes them.
//! - BF3 Crash safety: a marker (a physical slot `{slot}_backfill` that reserves no WAL) is
//!   created before the slot and dropped only after every backfilled row was acknowledged.
//!   A start that finds the marker knows the backfill was interrupted: it drops the slot
//!   (nothing was streamed from it yet), creates it again with a new snapshot and backfills
//!   again. In strict mode the rows the stream already holds (its messages at commit LSN
//!   `0/0`) are skipped, so nothing is published twice and the fence holds; in shared mode
//!   `Nats-Msg-Id` de-duplication drops them within the duplicate window.
//! - BF4 Memory is bounded: the cursor fetches [`FETCH_ROWS`] rows at a time into the sink's
//!   bounded channel and window; only the set of stored ids of an interrupted strict
//!   backfill grows with the table.
//! - BF5 The exporting replication connection stays open and idle until the backfill is
//!   done; the snapshot's transaction is read-only.
//! - BF6 A slot created over a stream whose last message is a relayed event (one with an
//!   outbox position: the slot was dropped and is created again, `outbox-relay init`) gets
//!   no backfill: the table's rows are presumably in the stream, and a strict stream would
//!   refuse them as reused ids. The log says so and names `outbox-relay backfill`.
//! - BF7 The rows the mode leaves out (with `pending`, those already `published` in the
//!   snapshot) are recorded, with the mode and the consistent point, before the first row is
//!   backfilled ([`crate::postgres::boundary`]), so that `outbox-relay verify` expects exactly
//!   the rows on the relay's side of the slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use outbox::{headers, EventId, IdKind, Item, Position};
use pgoutput::Lsn;
use replication::{quote_literal, ReplicationConnection};
use sink::SinkStats;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use crate::config::backfill::Mode;
use crate::config::Config;
use crate::error::{RelayError, Result};
use crate::postgres::checks;
use crate::postgres::range::{sql_error, Cursor, Filter};
use crate::postgres::rows::RowReader;

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// BF3: the marker of a backfill in progress.
fn marker_name(slot: &str) -> String {
    const SUFFIX: &str = "_backfill";
    // Slot names are ASCII (config), at most 63 bytes.
    let keep = slot.len().min(63 - SUFFIX.len());
    format!("{}{SUFFIX}", &slot[..keep])
}

/// Whether an earlier backfill at slot creation was interrupted (BF3).
pub async fn interrupted(client: &Client, config: &Config) -> Result<bool> {
    checks::slot_exists(client, &marker_name(&config.slot)).await
}

/// Whether the relay should backfill before it streams: an interrupted backfill, or a slot
/// about to be created with a backfill mode other than `none` over a stream that holds no
/// relayed event yet (BF6).
pub async fn needed(
    client: &Client,
    jetstream: &jetstream::Context,
    config: &Config,
) -> Result<bool> {
    if interrupted(client, config).await? {
        return Ok(true);
    }
    if !config.create
        || config.backfill == Mode::None
        || checks::slot_exists(client, &config.slot).await?
    {
        return Ok(false);
    }
    // A stream that does not exist yet holds nothing.
    let Ok(tail) = sink::resume::read_tail(jetstream, &config.stream, true).await else {
        return Ok(true);
    };
    if let Some(position) = tail.last_position() {
        warn!(slot = %config.slot, stream = %config.stream, last_commit_lsn = %position.commit_lsn,
            "not backfilling: the stream already holds relayed events, so the table's rows are presumably in it (a slot created again after it was dropped); load a range deliberately with `outbox-relay backfill` if some are missing");
        return Ok(false);
    }
    Ok(true)
}

/// The mode that applies to this table: `pending` on a table without `status` is `none`;
/// `pending` on a table with `status` and ids that are not integers is refused (the rows
/// it leaves out cannot be recorded for verify, `boundary` BD1 records integer runs).
async fn effective_mode(client: &Client, config: &Config, kind: IdKind) -> Result<Mode> {
    if config.backfill != Mode::Pending {
        return Ok(config.backfill);
    }
    let has_status = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_attribute a \
               JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = 'status' \
                AND a.attnum > 0 AND NOT a.attisdropped",
            &[&config.table.schema, &config.table.name],
        )
        .await
        .map_err(|e| sql_error("cannot read the outbox table's columns", e))?
        .is_some();
    if has_status && kind != IdKind::Integer {
        Err(RelayError::setup(anyhow::anyhow!(
            "--backfill pending on table {} with {} ids: the rows it leaves out (status not 'pending') cannot be recorded for `outbox-relay verify`, which records integer ids only; start with --backfill all (every row) or none",
            config.table,
            kind.sql_type()
        )))
    } else if has_status {
        Ok(Mode::Pending)
    } else {
        info!(table = %config.table, "--backfill pending: the table has no status column, so no row is pending and nothing is backfilled (use --backfill all to publish every row)");
        Ok(Mode::None)
    }
}

/// Creates the slot with an exported snapshot and publishes the rows the mode selects, in
/// that snapshot, before anything is streamed (BF1–BF5). Called when [`needed`]; the
/// publication and the stream must exist.
pub async fn at_slot_creation(
    client: &Client,
    jetstream: &jetstream::Context,
    config: &Config,
) -> Result<()> {
    let marker = marker_name(&config.slot);
    let resumed = interrupted(client, config).await?;
    let columns = checks::check_table(client, config).await?;
    let mode = effective_mode(client, config, columns.id_kind()).await?;
    if mode == Mode::None {
        if resumed {
            drop_slot(client, &marker).await?;
            info!(slot = %config.slot, "--backfill none: an interrupted backfill is abandoned; the slot streams what committed after it was created");
        }
        return Ok(());
    }
    let row_reader = RowReader::with_payload(config, columns);
    mark_start(client, config, &marker, resumed).await?;

    // BF5: the exporting connection stays open and idle until the backfill is done.
    let mut replication = ReplicationConnection::connect(&config.database).await?;
    let system = replication.identify_system().await?;
    let source = crate::connect::source(&system, config);
    let nudge = crate::postgres::standby::Nudge::start(config);
    let exported = replication
        .create_logical_slot_exporting_snapshot(&config.slot, config.failover_slot)
        .await?;
    drop(nudge);
    info!(slot = %config.slot, consistent_point = %exported.consistent_point, mode = ?mode,
        "created logical replication slot with an exported snapshot; backfilling the rows committed before it");
    let reader = read_in_snapshot(config, &exported.snapshot).await?;
    // BF7: what the slot's creation leaves out, recorded for verify before anything is
    // backfilled (crate::postgres::boundary BD2).
    let consistent_point = exported.consistent_point;
    record_boundary(client, &reader, config, &row_reader, mode, consistent_point).await?;
    let filter = Filter {
        pending_only: mode == Mode::Pending,
        ..Filter::default()
    };
    let cursor = Cursor::open(&reader, config, row_reader, &filter).await?;
    let started = Instant::now();
    let (read, skipped, stats) =
        publish_snapshot(jetstream, config, cursor, resumed, source).await?;
    reader
        .batch_execute("COMMIT")
        .await
        .map_err(|e| sql_error("cannot end the backfill's snapshot transaction", e))?;
    let _ = replication.close().await;
    drop_slot(client, &marker).await?;
    info!(
        read,
        published = stats.stored.load(std::sync::atomic::Ordering::Relaxed),
        duplicates = stats.duplicates.load(std::sync::atomic::Ordering::Relaxed),
        already_in_stream = skipped,
        elapsed = ?started.elapsed(),
        "backfill done; streaming from the slot's consistent point"
    );
    Ok(())
}

/// BF7: reads in the slot's snapshot (`reader`) which rows `mode` leaves out, and records
/// them with the slot's consistent point (crate::postgres::boundary BD2).
async fn record_boundary(
    client: &Client,
    reader: &Client,
    config: &Config,
    row_reader: &RowReader,
    mode: Mode,
    consistent_point: Lsn,
) -> Result<()> {
    let boundary = crate::postgres::boundary::in_snapshot(
        reader,
        &config.table,
        row_reader,
        mode,
        consistent_point,
    )
    .await
    .map_err(|e| sql_error("cannot read the slot's boundary in its snapshot", e))?;
    // SB1: decoding on a standby, the record is the primary's to write (BD2: a failure is a
    // warning, as on a primary).
    match &config.primary {
        None => crate::postgres::boundary::record(client, config, &boundary).await,
        Some(_) => match crate::postgres::standby::connect_primary(config).await {
            Ok(primary) => crate::postgres::boundary::record(&primary, config, &boundary).await,
            Err(e) => tracing::warn!("cannot record the slot's boundary on the primary: {e}"),
        },
    }
    Ok(())
}

/// Before the slot is created: the marker slot says a backfill is under way (created
/// now, or left by an interrupted one, whose slot is dropped to be created again).
async fn mark_start(client: &Client, config: &Config, marker: &str, resumed: bool) -> Result<()> {
    if !config.create {
        return Err(RelayError::setup(anyhow::anyhow!(
            "a backfill of slot {:?} was interrupted (marker slot {marker:?} exists), and --no-create forbids creating the slot again: start without --no-create to backfill again, or drop {marker:?} to give it up",
            config.slot
        )));
    }
    if resumed {
        if checks::slot_exists(client, &config.slot).await? {
            // Nothing was streamed from it: streaming starts after the marker is dropped.
            drop_slot(client, &config.slot).await?;
        }
        info!(slot = %config.slot, "a backfill was interrupted: creating the slot again and backfilling from a new snapshot (rows the stream holds are not published twice)");
    } else {
        client
            .execute(
                "SELECT pg_catalog.pg_create_physical_replication_slot($1)",
                &[&marker],
            )
            .await
            .map_err(|e| {
                sql_error(
                    "cannot create the backfill's marker slot (the role needs REPLICATION)",
                    e,
                )
            })?;
    }

    Ok(())
}

/// A connection reading the table in the exported snapshot (read-only, repeatable read).
async fn read_in_snapshot(config: &Config, snapshot: &str) -> Result<Client> {
    let reader = replication::connect_sql(&config.database).await?;
    reader
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; SET TRANSACTION SNAPSHOT {}",
            quote_literal(snapshot)
        ))
        .await
        .map_err(|e| sql_error("cannot read the table in the slot's snapshot", e))?;
    Ok(reader)
}

/// Publishes the cursor's rows through a sink of its own (with the relay's keys and
/// checks), skipping those a resumed backfill finds on the stream already; returns the
/// rows read, those skipped, and the sink's figures.
async fn publish_snapshot(
    jetstream: &jetstream::Context,
    config: &Config,
    mut cursor: Cursor<'_>,
    resumed: bool,
    source: String,
) -> Result<(u64, u64, Arc<SinkStats>)> {
    let tail = sink::resume::read_tail(jetstream, &config.stream, false)
        .await
        .map_err(|e| RelayError::transient(anyhow::Error::new(e)))?;
    let (stored, highest) = if resumed && !config.shared_stream && tail.last_sequence > 0 {
        stored_backfill_ids(jetstream, &config.stream, tail.last_sequence).await?
    } else {
        (HashSet::new(), 0)
    };
    // BF2: ordinals of uuid and text ids rise after the indexes the stream holds.
    cursor.ordinal = highest;
    let max_payload = jetstream.client().server_info().max_payload;
    let options = crate::connect::sink_options(
        config,
        (!config.shared_stream).then_some(tail.last_sequence),
        crate::connect::max_message_bytes(&tail, max_payload),
        source,
        tail.replicas,
    );
    let publishing = crate::connect::nats::open_publishing(
        &crate::connect::nats::connector(&config.nats)?,
        jetstream,
        config,
    )
    .await?;
    let stats = Arc::new(SinkStats::default());
    let (items_tx, items_rx) = mpsc::channel(4);
    let (watermark_tx, _watermark) = watch::channel(Position {
        commit_lsn: Lsn::ZERO,
        index: 0,
    });
    let mut sink = AbortOnDropHandle::new(tokio::spawn(sink::run(
        jetstream.clone(),
        publishing,
        options,
        items_rx,
        watermark_tx,
        stats.clone(),
    )));

    let (read, skipped) = feed(&mut cursor, &stored, &items_tx, &stats).await?;
    drop(items_tx);
    match (&mut sink).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => return Err(error.into()),
        Err(join) => {
            return Err(RelayError::permanent(anyhow::anyhow!(
                "the backfill's sink task failed: {join}"
            )))
        }
    }
    Ok((read, skipped, stats))
}

/// Hands the cursor's rows to the sink, one batch per fetch between a `Begin` and a
/// `Commit`, without those in `stored`; stops early when the sink ended (its result says
/// why). Returns the rows read and those skipped.
async fn feed(
    cursor: &mut Cursor<'_>,
    stored: &HashSet<EventId>,
    items_tx: &mpsc::Sender<Vec<Item<Position>>>,
    stats: &SinkStats,
) -> Result<(u64, u64)> {
    let mut last_log = Instant::now();
    let (mut read, mut skipped) = (0u64, 0u64);
    while let Some(events) = cursor.next().await? {
        read += events.len() as u64;
        let mut batch = Vec::with_capacity(events.len() + 2);
        batch.push(Item::Begin {
            commit_time_us: sink::latency::unix_micros_now(),
        });
        let mut last = None;
        for event in events {
            last = Some(event.position);
            if stored.contains(&event.id) {
                skipped += 1;
            } else {
                batch.push(Item::Event(event));
            }
        }
        if let Some(last) = last {
            batch.push(Item::Commit(last));
        }
        if items_tx.send(batch).await.is_err() {
            // The sink ended: its result says why.
            break;
        }
        if last_log.elapsed() >= PROGRESS_EVERY {
            last_log = Instant::now();
            info!(
                read,
                total = cursor.total,
                acknowledged = stats.acked(),
                "backfill progress"
            );
        }
    }
    Ok((read, skipped))
}

async fn drop_slot(client: &Client, slot: &str) -> Result<()> {
    client
        .execute("SELECT pg_catalog.pg_drop_replication_slot($1)", &[&slot])
        .await
        .map_err(|e| sql_error(&format!("cannot drop replication slot {slot:?}"), e))?;
    Ok(())
}

/// BF3: the outbox ids of the backfilled messages (commit LSN `0/0`) a strict stream holds,
/// and their highest index (BF2), read with a headers-only ordered consumer.
async fn stored_backfill_ids(
    jetstream: &jetstream::Context,
    stream: &str,
    last_sequence: u64,
) -> Result<(HashSet<EventId>, u32)> {
    let failed = |e: &dyn std::fmt::Display| {
        RelayError::transient(anyhow::anyhow!(
            "cannot read what stream {stream} holds of an interrupted backfill: {e}"
        ))
    };
    let handle = jetstream.get_stream(stream).await.map_err(|e| failed(&e))?;
    let consumer = handle
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            headers_only: true,
            ..Default::default()
        })
        .await
        .map_err(|e| failed(&e))?;
    let mut messages = consumer.messages().await.map_err(|e| failed(&e))?;
    let mut ids = HashSet::new();
    let mut highest = 0u32;
    let zero = Lsn::ZERO.to_string();
    loop {
        let message = match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
            Ok(Some(Ok(message))) => message,
            Ok(Some(Err(e))) => return Err(failed(&e)),
            Ok(None) => return Err(failed(&"the consumer ended")),
            Err(_) => return Err(failed(&"no message within 10 s")),
        };
        let info = message.info().map_err(|e| failed(&e))?;
        let sequence = info.stream_sequence;
        if let Some(headers) = &message.headers {
            let header = |name: &str| headers.get(name).map(|v| v.as_str());
            if header(headers::OUTBOX_COMMIT_LSN) == Some(zero.as_str()) {
                if let Some(id) = EventId::from_headers(header) {
                    ids.insert(id);
                }
                if let Some(index) = header(headers::OUTBOX_TX_INDEX).and_then(|i| i.parse().ok()) {
                    highest = highest.max(index);
                }
            }
        }
        if sequence >= last_sequence {
            return Ok((ids, highest));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_fits_a_slot_name() {
        assert_eq!(marker_name("outbox_relay"), "outbox_relay_backfill");
        assert_eq!(marker_name(&"s".repeat(63)).len(), 63);
    }
}
