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
//! - F1 No row is missed and none is published twice at the boundary: the snapshot is
//!   exactly what committed before the slot's consistent point, and the slot streams
//!   exactly what committed after it. Streaming starts only after every backfilled row was
//!   acknowledged.
//! - F2 A backfilled row's position is commit LSN `0/0`, so it precedes every streamed event
//!   (whose commit LSN is at or after the consistent point), and backfilled rows follow each
//!   other in id order (the id column's, `stored` V3). The index is, for integer ids, the
//!   outbox id: the same row always gets the same position. Ids above `u32::MAX` are
//!   refused, naming the fix. For uuid and text ids it is the row's ordinal in the
//!   backfill's id order (1, 2, …), counted after the highest index of the backfilled rows
//!   a strict stream already holds when an interrupted backfill starts again (F3): so
//!   indexes rise along the stream, and are unique within it, but a row's index depends on
//!   the rows before it in that snapshot (another backfill may give it another; P8 never
//!   compares positions). Keys, subject and headers are those of a streamed event: one
//!   builder (`outbox` E4, through [`crate::process::stored::RowReader`]), then `sink`'s
//!   message builder. Rows of an event type the mapping's filter excludes are read and not
//!   published, as streaming never publishes them.
//! - F3 Crash safety: a marker (a physical slot `{slot}_backfill` that reserves no WAL) is
//!   created before the slot and dropped only after every backfilled row was acknowledged.
//!   A start that finds the marker knows the backfill was interrupted: it drops the slot
//!   (nothing was streamed from it yet), creates it again with a new snapshot and backfills
//!   again. In strict mode the rows the stream already holds (its messages at commit LSN
//!   `0/0`) are skipped, so nothing is published twice and the fence holds; in shared mode
//!   `Nats-Msg-Id` de-duplication drops them within the duplicate window.
//! - F4 Memory is bounded: the cursor fetches [`FETCH_ROWS`] rows at a time into the sink's
//!   bounded channel and window; only the set of stored ids of an interrupted strict
//!   backfill grows with the table.
//! - F5 The exporting replication connection stays open and idle until the backfill is
//!   done; the snapshot's transaction is read-only.
//! - F6 A slot created over a stream whose last message is a relayed event (one with an
//!   outbox position: the slot was dropped and is created again, `outbox-relay init`) gets
//!   no backfill: the table's rows are presumably in the stream, and a strict stream would
//!   refuse them as reused ids. The log says so and names `outbox-relay backfill`.
//! - F7 The rows the mode leaves out (with `pending`, those already `published` in the
//!   snapshot) are recorded, with the mode and the consistent point, before the first row is
//!   backfilled ([`crate::process::boundary`]), so that `outbox-relay verify` expects exactly
//!   the rows on the relay's side of the slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use outbox::{headers, EventId, IdKind, Item, OutboxEvent, Position, Role};
use pgoutput::Lsn;
use replication::{quote_literal, ReplicationConnection};
use sink::SinkStats;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use crate::config::backfill::Mode;
use crate::config::{table_sql, Config};
use crate::error::{RelayError, Result, Target};
use crate::process::bootstrap;
use crate::process::stored::{check_id_bound, RowReader};

/// Rows fetched from the cursor at a time.
pub const FETCH_ROWS: usize = 1000;
/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// The cursor's name.
const CURSOR: &str = "outbox_relay_backfill";

/// A time bound as SQL: a duration ago (`6h`, as `replay` and `verify` take it) or a
/// timestamp Postgres reads.
fn time_sql(text: &str) -> String {
    match crate::config::parse_duration(text) {
        Ok(ago) => format!(
            "now() - {}::interval",
            quote_literal(&format!("{} milliseconds", ago.as_millis()))
        ),
        Err(_) => format!("{}::timestamptz", quote_literal(text)),
    }
}

/// Which rows to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only rows whose `status` is `'pending'`.
    pub pending_only: bool,
    /// `id >= from_id`, as text (compared as the id column's type, `stored` V3).
    pub from_id: Option<String>,
    /// `id <= to_id`.
    pub to_id: Option<String>,
    /// `created_at >= since` (a timestamp Postgres parses, e.g. RFC 3339, or a duration ago).
    pub since: Option<String>,
    /// `created_at < until`.
    pub until: Option<String>,
}

impl Filter {
    /// The `WHERE` clause (empty for every row) on the mapped id and creation-time columns
    /// (`status` keeps its name).
    fn where_sql(&self, config: &Config, reader: &RowReader) -> String {
        let mut conditions = Vec::new();
        if self.pending_only {
            conditions.push("status = 'pending'".to_owned());
        }
        let id = reader.id_ordered();
        if let Some(from) = &self.from_id {
            conditions.push(format!("{id} >= {}", reader.id_literal(from)));
        }
        if let Some(to) = &self.to_id {
            conditions.push(format!("{id} <= {}", reader.id_literal(to)));
        }
        let created_at = replication::quote_identifier(config.mapping.column(Role::CreatedAt));
        if let Some(since) = &self.since {
            conditions.push(format!("{created_at} >= {}", time_sql(since)));
        }
        if let Some(until) = &self.until {
            conditions.push(format!("{created_at} < {}", time_sql(until)));
        }
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    }
}

/// F2: a backfilled row's position, before every streamed event: by its id for an integer
/// id, else by `ordinal`, its place in the backfill's id order.
pub fn position_of(id: &EventId, ordinal: u32) -> Result<Position> {
    match id {
        EventId::Int(id) => position(*id),
        EventId::Text(_) => Ok(Position {
            commit_lsn: Lsn::ZERO,
            index: ordinal,
        }),
    }
}

/// F2: an integer id's backfilled position, before every streamed event.
pub fn position(id: i64) -> Result<Position> {
    u32::try_from(id)
        .map(|index| Position {
            commit_lsn: Lsn::ZERO,
            index,
        })
        .map_err(|_| {
            RelayError::permanent(anyhow::anyhow!(
                "outbox row id={id} cannot be backfilled: backfilled rows are positioned by their id, up to {}; start with --backfill none and load older rows with `outbox-relay backfill` into a shared stream",
                u32::MAX
            ))
        })
}

/// F3: the marker of a backfill in progress.
fn marker_name(slot: &str) -> String {
    const SUFFIX: &str = "_backfill";
    // Slot names are ASCII (config), at most 63 bytes.
    let keep = slot.len().min(63 - SUFFIX.len());
    format!("{}{SUFFIX}", &slot[..keep])
}

fn sql_error(what: &str, error: tokio_postgres::Error) -> RelayError {
    // 22021: a row holds bytes that are not UTF-8 (a SQL_ASCII database); every retry reads
    // the same row.
    let not_utf8 =
        error.code() == Some(&tokio_postgres::error::SqlState::CHARACTER_NOT_IN_REPERTOIRE);
    let transient = !not_utf8
        && error
            .code()
            .is_none_or(|code| replication::sqlstate_is_transient(code.code()));
    let mut text = match error.as_db_error() {
        Some(db) => format!("{what}: {} (SQLSTATE {})", db.message(), db.code().code()),
        None => format!("{what}: {error}"),
    };
    if not_utf8 {
        text.push_str(
            ": a row of the range holds text that is not valid UTF-8 (a SQL_ASCII database stores any bytes), \
             which the relay never publishes; repair or delete that row, or leave it out of the range",
        );
    }
    if transient {
        RelayError::transient(anyhow::anyhow!(text))
    } else {
        RelayError::permanent(anyhow::anyhow!(text))
    }
}

/// Whether an earlier backfill at slot creation was interrupted (F3).
pub async fn interrupted(client: &Client, config: &Config) -> Result<bool> {
    bootstrap::slot_exists(client, &marker_name(&config.slot)).await
}

/// Whether the relay should backfill before it streams: an interrupted backfill, or a slot
/// about to be created with a backfill mode other than `none` over a stream that holds no
/// relayed event yet (F6).
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
        || bootstrap::slot_exists(client, &config.slot).await?
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
/// it leaves out cannot be recorded for verify, `boundary` N1 records integer runs).
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
/// that snapshot, before anything is streamed (F1–F5). Called when [`needed`]; the
/// publication and the stream must exist.
pub async fn at_slot_creation(
    client: &Client,
    jetstream: &jetstream::Context,
    config: &Config,
) -> Result<()> {
    let marker = marker_name(&config.slot);
    let resumed = interrupted(client, config).await?;
    let columns = bootstrap::check_table(client, config).await?;
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

    // F5: the exporting connection stays open and idle until the backfill is done.
    let mut replication = ReplicationConnection::connect(&config.database).await?;
    let system = replication.identify_system().await?;
    let source = crate::connect::source(&system, config);
    let exported = replication
        .create_logical_slot_exporting_snapshot(&config.slot, config.failover_slot)
        .await?;
    info!(slot = %config.slot, consistent_point = %exported.consistent_point, mode = ?mode,
        "created logical replication slot with an exported snapshot; backfilling the rows committed before it");
    let reader = read_in_snapshot(config, &exported.snapshot).await?;
    // F7: what the slot's creation leaves out, recorded for verify before anything is
    // backfilled (crate::process::boundary N2).
    let boundary = crate::process::boundary::in_snapshot(
        &reader,
        config,
        &row_reader,
        mode,
        exported.consistent_point,
    )
    .await
    .map_err(|e| sql_error("cannot read the slot's boundary in its snapshot", e))?;
    crate::process::boundary::record(client, config, &boundary).await;
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
        if bootstrap::slot_exists(client, &config.slot).await? {
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
    // F2: ordinals of uuid and text ids rise after the indexes the stream holds.
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

/// F3: the outbox ids of the backfilled messages (commit LSN `0/0`) a strict stream holds,
/// and their highest index (F2), read with a headers-only ordered consumer.
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

/// The selected rows in id order, [`FETCH_ROWS`] at a time, as events (F2, F4). Runs in the
/// caller's open transaction.
struct Cursor<'a> {
    client: &'a Client,
    reader: RowReader,
    /// The last ordinal given (F2: uuid and text ids).
    ordinal: u32,
    /// How many rows the filter selects.
    total: u64,
}

impl<'a> Cursor<'a> {
    async fn open(
        client: &'a Client,
        config: &'a Config,
        reader: RowReader,
        filter: &Filter,
    ) -> Result<Cursor<'a>> {
        let from = format!(
            "{}{}",
            table_sql(&config.table),
            filter.where_sql(config, &reader)
        );
        // The replication session's rendering of timestamps (outbox::timestamp) and bytea.
        client
            .batch_execute(
                "SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO'; SET LOCAL bytea_output = 'hex'",
            )
            .await
            .map_err(|e| sql_error("cannot prepare the backfill's session", e))?;
        let total: i64 = client
            .query_one(&format!("SELECT count(*) FROM {from}"), &[])
            .await
            .map_err(|e| sql_error("cannot count the rows to backfill", e))?
            .get(0);
        client
            .batch_execute(&format!(
                "DECLARE {CURSOR} NO SCROLL CURSOR FOR SELECT {} FROM {from} ORDER BY {}",
                reader.select(),
                reader.order_by()
            ))
            .await
            .map_err(|e| sql_error("cannot read the outbox table", e))?;
        info!(table = %config.table, rows = total, "backfilling rows in id order");
        Ok(Cursor {
            client,
            reader,
            ordinal: 0,
            total: u64::try_from(total).unwrap_or(0),
        })
    }

    async fn next(&mut self) -> Result<Option<Vec<OutboxEvent>>> {
        let rows = self
            .client
            .query(&format!("FETCH {FETCH_ROWS} FROM {CURSOR}"), &[])
            .await
            .map_err(|e| sql_error("cannot read the outbox table", e))?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let Some(id) = self.reader.id_of(&row) else {
                return Err(RelayError::permanent(anyhow::anyhow!(
                    "an outbox row's id cannot be read as the id column's type"
                )));
            };
            self.ordinal = self.ordinal.checked_add(1).ok_or_else(|| {
                RelayError::permanent(anyhow::anyhow!(
                    "more than {} rows to backfill: positions are exhausted",
                    u32::MAX
                ))
            })?;
            let position = position_of(&id, self.ordinal)?;
            match self.reader.event(&row, position) {
                Ok(Some(event)) => events.push(event),
                // Excluded by the event-type filter: never published (F2).
                Ok(None) => {}
                Err(e) => {
                    return Err(RelayError::permanent(anyhow::anyhow!(
                        "{e}, so no event can be derived from it: fill it in, or backfill a range without it"
                    )))
                }
            }
        }
        Ok(Some(events))
    }
}

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
    if !bootstrap::slot_exists(&client, &config.slot).await? {
        return Err(RelayError::setup(anyhow::anyhow!(
            "replication slot {:?} does not exist: `outbox-relay backfill` loads a range beside a running relay; to publish the rows already in the table when the slot is created, start the relay (or `outbox-relay init`) with --backfill",
            config.slot
        )));
    }
    let jetstream =
        crate::connect::jetstream_context(crate::connect::connect_nats(config).await?, config);
    bootstrap::stream(&jetstream, config)
        .await
        .map_err(|e| e.at(Target::Nats))?;
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await
        .map_err(|e| sql_error("cannot read the outbox table", e))?;
    let columns = bootstrap::check_table(&client, config).await?;
    let reader = RowReader::with_payload(config, columns);
    for (flag, bound) in [("--from-id", &filter.from_id), ("--to-id", &filter.to_id)] {
        if let Some(text) = bound {
            check_id_bound(&client, reader.id_kind(), flag, text).await?;
        }
    }
    let cursor = Cursor::open(&client, config, reader, filter).await?;
    if cursor.total == 0 {
        let _ = client.batch_execute("COMMIT").await;
        return Err(crate::process::stored::no_rows_in_range(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backfilled_rows_precede_streamed_events_in_id_order() {
        let first = position(1).ok();
        let later = position(2).ok();
        assert!(first < later);
        let streamed = Position {
            commit_lsn: Lsn(0x0100_0000),
            index: 0,
        };
        assert!(position(i64::from(u32::MAX)).ok() < Some(streamed));
        assert!(position(i64::from(u32::MAX) + 1).is_err());
        assert!(position(-1).is_err());
    }

    #[test]
    fn the_marker_fits_a_slot_name() {
        assert_eq!(marker_name("outbox_relay"), "outbox_relay_backfill");
        assert_eq!(marker_name(&"s".repeat(63)).len(), 63);
    }

    #[test]
    fn filters_select_pending_rows_and_ranges() {
        let config =
            crate::config::tests::load(&[], &[("DATABASE_URL", "postgres://u@h/db")], None)
                .unwrap();
        let seed = crate::process::stored::test_reader(&config, outbox::event::oid::INT8);
        assert_eq!(Filter::default().where_sql(&config, &seed), "");
        let filter = Filter {
            pending_only: true,
            from_id: Some("3".into()),
            to_id: Some("9".into()),
            since: Some("2026-01-01T00:00:00Z".into()),
            until: Some("x'y".into()),
        };
        assert_eq!(
            filter.where_sql(&config, &seed),
            " WHERE status = 'pending' AND \"id\" >= '3'::int8 AND \"id\" <= '9'::int8 AND \"created_at\" >= '2026-01-01T00:00:00Z'::timestamptz AND \"created_at\" < 'x''y'::timestamptz"
        );
        // Text ids compare by their bytes (stored V3).
        let text = crate::process::stored::test_reader(&config, outbox::event::oid::TEXT);
        let filter = Filter {
            from_id: Some("evt'1".into()),
            ..Filter::default()
        };
        assert_eq!(
            filter.where_sql(&config, &text),
            " WHERE \"id\" COLLATE \"C\" >= ('evt''1'::text COLLATE \"C\")"
        );
        // A duration ago, as replay and verify take it.
        let filter = Filter {
            since: Some("1h30m".into()),
            ..Filter::default()
        };
        assert_eq!(
            filter.where_sql(&config, &seed),
            " WHERE \"created_at\" >= now() - '5400000 milliseconds'::interval"
        );
    }

    #[test]
    fn non_integer_ids_are_positioned_by_their_ordinal() {
        let id = EventId::Text("b".into());
        assert_eq!(position_of(&id, 7).ok().map(|p| p.index), Some(7));
        assert_eq!(
            position_of(&EventId::Int(5), 7).ok().map(|p| p.index),
            Some(5)
        );
    }
}
