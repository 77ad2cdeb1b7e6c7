//! Writing backlogs, and reading them back as the events the relay would publish.
//!
//! Rows look like the seed's: `entity-{i % 1000}`, `OrderPaid`, placeholder key columns
//! (the relay derives the keys itself) and a small jsonb payload
//! `{"amount": 10, "order_id": i}` (about 30 bytes), or, with `--payload-bytes`
//! ([`set_payload_bytes`]), that payload with a `"note"` padding it to about that many bytes
//! of JSON text, for the backlogs [`write_batched`] writes.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context as _, Result};
use outbox::{OutboxEvent, OutboxRow, Position};
use pgoutput::Lsn;
use testkit::harness::Row;
pub use testkit::harness::ROW_COLUMNS;
use tokio_postgres::Client;

/// The relay's default shard count.
pub const PARTITIONS: NonZeroU64 = match NonZeroU64::new(12) {
    Some(n) => n,
    None => panic!("12 is not zero"),
};

/// Rows `$1..=$2` in one statement (one transaction in autocommit); a payload padded with
/// `$3` characters when `$3 > 0`.
const INSERT_RANGE: &str = "insert into outbox_events \
        (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
    select 'entity-' || (i % 1000), 'OrderPaid', 'tmp-' || i, 'tmp', 'tmp', \
           jsonb_build_object('order_id', i, 'amount', 10) \
             || case when $3::int > 0 then jsonb_build_object('note', repeat('x', $3::int)) \
                     else '{}'::jsonb end \
      from generate_series($1::bigint, $2::bigint) i";

/// The JSON text of the unpadded payload, `{"amount": 10, "order_id": 100000}`, and what
/// a `"note"` adds besides its characters (`, "note": ""`).
const PAYLOAD_BASE: usize = 34 + 12;

/// Characters of padding in the backlogs' payloads (0: the small payload).
static PAYLOAD_PAD: AtomicI32 = AtomicI32::new(0);

/// Pads the payloads of the backlogs written from now on to about `bytes` of JSON text.
pub fn set_payload_bytes(bytes: usize) {
    let pad = bytes.saturating_sub(PAYLOAD_BASE).max(1);
    PAYLOAD_PAD.store(i32::try_from(pad).unwrap_or(i32::MAX), Ordering::Relaxed);
}

/// The mean length of the outbox rows' payloads as JSON text, bytes.
pub async fn mean_payload_bytes(sql: &Client) -> Result<f64> {
    let row = sql
        .query_one(
            "select coalesce(avg(length(payload::text)), 0)::float8 from outbox_events",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// A procedure committing one row per transaction, server-side: the fastest way to write
/// many single-row transactions (no client round trip per commit).
const SINGLE_ROW_PROCEDURE: &str =
    "create or replace procedure bench_single_rows(first_i bigint, last_i bigint) \
    language plpgsql as $$ \
    begin \
      for i in first_i..last_i loop \
        insert into outbox_events \
               (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
        values ('entity-' || (i % 1000), 'OrderPaid', 'tmp-' || i, 'tmp', 'tmp', \
                jsonb_build_object('order_id', i, 'amount', 10)); \
        commit; \
      end loop; \
    end $$";

/// Writes `total` rows in transactions of `per_tx` rows.
pub async fn write_batched(sql: &Client, total: u64, per_tx: u64) -> Result<()> {
    let statement = sql.prepare(INSERT_RANGE).await?;
    let pad = PAYLOAD_PAD.load(Ordering::Relaxed);
    let mut first = 1u64;
    while first <= total {
        let last = (first + per_tx - 1).min(total);
        sql.execute(&statement, &[&(first as i64), &(last as i64), &pad])
            .await
            .with_context(|| format!("insert rows {first}..={last}"))?;
        first = last + 1;
    }
    Ok(())
}

/// Writes `total` rows, one transaction each.
pub async fn write_single_rows(sql: &Client, total: u64) -> Result<()> {
    sql.batch_execute(SINGLE_ROW_PROCEDURE).await?;
    sql.batch_execute(&format!("call bench_single_rows(1, {total})"))
        .await
        .context("call bench_single_rows")?;
    Ok(())
}

/// `pg_current_wal_lsn()`: the end of everything written so far.
pub async fn current_wal_lsn(sql: &Client) -> Result<Lsn> {
    let text: String = sql
        .query_one("select pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    text.parse()
        .map_err(|e| anyhow::anyhow!("pg_current_wal_lsn {text:?}: {e:?}"))
}

/// The event the relay publishes for a row selected with [`ROW_COLUMNS`] (keys, shard,
/// subject as the outbox crate derives them), built without decoding WAL: for the broker
/// ceiling and the polling publisher.
pub fn row_event(prefix: &str, row: &tokio_postgres::Row, position: Position) -> OutboxEvent {
    OutboxRow::from(Row::from_sql(row)).into_event(prefix, PARTITIONS, position)
}

/// Every row of the case's table as the event the relay would publish under `prefix`, in
/// id order; `per_tx` rows share a (stand-in) commit LSN and count their index from 0.
pub async fn read_events(
    sql: &Client,
    prefix: &str,
    per_tx: u64,
    commit_lsn: Lsn,
) -> Result<Vec<OutboxEvent>> {
    let statement = sql
        .prepare(&format!(
            "select {ROW_COLUMNS} from outbox_events where id between $1 and $2 order by id"
        ))
        .await?;
    let max: i64 = sql
        .query_one("select coalesce(max(id), 0) from outbox_events", &[])
        .await?
        .get(0);
    let mut events = Vec::with_capacity(usize::try_from(max).unwrap_or(0));
    let chunk = 50_000i64;
    let mut first = 1i64;
    while first <= max {
        for row in sql
            .query(&statement, &[&first, &(first + chunk - 1)])
            .await?
        {
            let id: i64 = row.get(0);
            let index = u32::try_from((id - 1).rem_euclid(per_tx.max(1) as i64)).unwrap_or(0);
            events.push(row_event(prefix, &row, Position { commit_lsn, index }));
        }
        first += chunk;
    }
    Ok(events)
}
