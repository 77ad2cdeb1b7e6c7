//! Checking what the stream says is stored against the table, before a session skips by it
//! (`sink::resume` S4).
//!
//! A session skips replayed events at or before the stream's last message, or before what
//! an earlier session of the process saw acknowledged. Both are read back from outside: a
//! database restored from a backup and then written past the old tail has the same
//! `Outbox-Source` and a WAL end past the tail, and anyone with publish permission on the
//! stream's subjects can write a message that looks like the relay's. So each is checked
//! against the row it claims to be.
//!
//! # Invariants
//! - V1 A stored position is vouched for only when the row with its `Outbox-Id` exists in the
//!   table and yields the same `Nats-Msg-Id` and ordering key (for the tail,
//!   `sink::resume::Claim::check`), or the same ordering key (for what was acknowledged: the
//!   acker keeps the id and `created_at`, and the ack itself matched the `Nats-Msg-Id`).
//! - V2 A row that cannot be read as the relay would read it (a NULL key column, an
//!   infinite `created_at`) vouches for nothing. A query that fails ends the session
//!   (transient): a check that did not run never vouches.

use bytes::Bytes;
use outbox::{OutboxRow, Position};
use sink::resume::{Tail, Verdict};
use sink::Acknowledged;
use tokio_postgres::Client;

use crate::config::{table_sql, Config};
use crate::error::{RelayError, Result};

/// The tail's check (V1): `Ok` also when there is nothing to check (no tail, or one without
/// a claimed row: `sink::resume::plan` distrusts those for what they lack).
pub async fn check_tail(client: &Client, config: &Config, tail: &Tail) -> Result<Verdict> {
    let Some(Ok(mark)) = &tail.last else {
        return Ok(Ok(()));
    };
    let (Some(id), Some(position)) = (mark.claim.id, mark.position) else {
        return Ok(Err("the message carries no Outbox-Id".into()));
    };
    Ok(match read_row(client, config, id).await? {
        Ok(row) => mark.claim.check(&event(row, config, position)),
        Err(why) => Err(why),
    })
}

/// The check of what an earlier session of this process saw acknowledged (V1).
pub async fn check_acknowledged(
    client: &Client,
    config: &Config,
    acknowledged: &Acknowledged,
) -> Result<Verdict> {
    let id = acknowledged.id;
    Ok(match read_row(client, config, id).await? {
        Ok(row) if row.created_at_ms == acknowledged.created_at_ms => Ok(()),
        Ok(row) => Err(format!(
            "outbox id {id} in the table gives ordering key {}, the event acknowledged had {}",
            outbox::ordering_key(id, row.created_at_ms),
            outbox::ordering_key(id, acknowledged.created_at_ms)
        )),
        Err(why) => Err(why),
    })
}

fn event(row: OutboxRow, config: &Config, position: Position) -> outbox::OutboxEvent {
    row.into_event(&config.subject_prefix, config.partitions, position)
}

/// The SQL of a row's columns in the order [`row_from`] reads them; `$n::text::timestamptz`
/// casts keep time parameters text.
pub fn row_columns() -> &'static str {
    "id::int8, entity_id::text, event_type::text, payload::text, \
     CASE WHEN isfinite(created_at) \
          THEN (extract(epoch FROM created_at) * 1000000)::numeric(30,0)::text END"
}

/// An outbox row read back from the table, or why the relay could not have published it.
pub fn row_from(row: &tokio_postgres::Row) -> std::result::Result<OutboxRow, (i64, String)> {
    let id: i64 = row.get(0);
    let entity_id: Option<String> = row.get(1);
    let event_type: Option<String> = row.get(2);
    let payload: Option<String> = row.get(3);
    let micros: Option<String> = row.get(4);
    let (Some(entity_id), Some(event_type), Some(payload)) = (entity_id, event_type, payload)
    else {
        return Err((id, "a column the keys need is NULL".into()));
    };
    let Some(micros) = micros.and_then(|m| m.parse::<i128>().ok()) else {
        return Err((id, "created_at is NULL or infinite".into()));
    };
    Ok(OutboxRow {
        id,
        entity_id,
        event_type,
        payload: Bytes::from(payload),
        created_at_ms: outbox::timestamp::epoch_millis(micros),
    })
}

/// The row with `id` as the relay reads it (V2), or why there is none to check against. The
/// payload is not read: no check uses it, and a payload that is not UTF-8 (a SQL_ASCII
/// database) must not stop the check.
async fn read_row(
    client: &Client,
    config: &Config,
    id: i64,
) -> Result<std::result::Result<OutboxRow, String>> {
    let table = table_sql(&config.table);
    let sql = format!(
        "SELECT {} FROM {table} WHERE id = $1",
        row_columns().replace("payload::text", "NULL::text")
    );
    let rows = client.query(&sql, &[&id]).await.map_err(|e| {
        RelayError::transient(anyhow::anyhow!(
            "cannot check outbox id {id}, which the stream says is stored, against table {table}: {e}"
        ))
    })?;
    let Some(row) = rows.first() else {
        return Ok(Err(format!(
            "no row with outbox id {id} in table {table} (a database restored from a backup, a table emptied or recreated, or a message the relay did not write)"
        )));
    };
    let text = |i| row.try_get::<_, Option<String>>(i).ok().flatten();
    let micros = text(4).and_then(|m| m.parse::<i128>().ok());
    Ok(match (text(1), text(2), micros) {
        (Some(entity_id), Some(event_type), Some(micros)) => Ok(OutboxRow {
            id,
            entity_id,
            event_type,
            payload: bytes::Bytes::new(),
            created_at_ms: outbox::timestamp::epoch_millis(micros),
        }),
        _ => Err(format!(
            "outbox id {id} in table {table} has a NULL, non-UTF-8 or infinite key column, so the relay published no event for it"
        )),
    })
}
