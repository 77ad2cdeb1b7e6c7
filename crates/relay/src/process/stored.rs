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
use outbox::{EventBuilder, EventId, OutboxColumns, OutboxEvent, OutboxRow, Position};
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
    let (Some(id), Some(position)) = (&mark.claim.id, mark.position) else {
        return Ok(Err("the message carries no Outbox-Id".into()));
    };
    Ok(match read_row(client, config, id, position).await? {
        Ok(event) => mark.claim.check(&event),
        Err(why) => Err(why),
    })
}

/// The check of what an earlier session of this process saw acknowledged (V1).
pub async fn check_acknowledged(
    client: &Client,
    config: &Config,
    acknowledged: &Acknowledged,
) -> Result<Verdict> {
    let id = &acknowledged.id;
    Ok(
        match read_row(client, config, id, acknowledged.position).await? {
            Ok(event) if event.created_at_ms == acknowledged.created_at_ms => Ok(()),
            Ok(event) => Err(format!(
                "outbox id {id} in the table gives ordering key {}, the event acknowledged had {}",
                event.keys.ordering_key,
                id.ordering_key(acknowledged.created_at_ms)
            )),
            Err(why) => Err(why),
        },
    )
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
    Ok(OutboxRow::seed(
        id,
        entity_id,
        event_type,
        Bytes::from(payload),
        outbox::timestamp::epoch_millis(micros),
    ))
}

/// Reads rows of the table as the relay reads them (V2): the mapped columns, each as text
/// (`bytea` as its hex output), through the builder streaming uses (`outbox` E4), so a row
/// read back yields exactly the event streaming derived.
#[derive(Debug)]
pub struct RowReader {
    builder: EventBuilder,
    select: String,
    id_column: String,
    id_type: &'static str,
}

impl RowReader {
    /// A reader for `columns` (the mapping resolved against the table) under `config`.
    pub fn new(config: &Config, columns: OutboxColumns) -> RowReader {
        let payload = config.mapping.column(outbox::Role::Payload);
        let select = columns
            .read_columns()
            .map(|c| {
                let quoted = replication::quote_identifier(c);
                // The payload is not read: no check uses it, and a payload that is not
                // UTF-8 (a SQL_ASCII database) must not stop the check.
                if c == payload {
                    // An empty payload of the column's kind (a bytea's is `\x`).
                    match columns.payload_kind() {
                        outbox::PayloadKind::Bytes => "'\\x'::text".to_owned(),
                        outbox::PayloadKind::Text => "''::text".to_owned(),
                    }
                } else {
                    format!("{quoted}::text")
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        RowReader {
            id_column: replication::quote_identifier(config.mapping.column(outbox::Role::Id)),
            id_type: columns.id_kind().sql_type(),
            builder: EventBuilder::shaped(
                columns.clone(),
                config.shape(),
                config.mapping.filter.clone(),
            ),
            select,
        }
    }

    /// The event of a row this reader selected, at `position`; `None` when the filter
    /// excludes its event type.
    pub fn event(
        &self,
        row: &tokio_postgres::Row,
        position: Position,
    ) -> std::result::Result<Option<OutboxEvent>, outbox::EventError> {
        self.builder.build_values(
            |i| {
                Ok(row
                    .try_get::<_, Option<String>>(i)
                    .ok()
                    .flatten()
                    .map(Bytes::from))
            },
            position,
        )
    }
}

/// The row with `id` as the relay reads it (V2), as the event it yields at `position`, or
/// why there is none to check against.
async fn read_row(
    client: &Client,
    config: &Config,
    id: &EventId,
    position: Position,
) -> Result<std::result::Result<OutboxEvent, String>> {
    let table = table_sql(&config.table);
    let columns = crate::process::bootstrap::check_table(client, config).await?;
    let reader = RowReader::new(config, columns);
    let sql = format!(
        "SELECT {} FROM {table} WHERE {} = $1::text::{}",
        reader.select, reader.id_column, reader.id_type
    );
    let rows = client.query(&sql, &[&id.to_string()]).await.map_err(|e| {
        RelayError::transient(anyhow::anyhow!(
            "cannot check outbox id {id}, which the stream says is stored, against table {table}: {e}"
        ))
    })?;
    let Some(row) = rows.first() else {
        return Ok(Err(format!(
            "no row with outbox id {id} in table {table} (a database restored from a backup, a table emptied or recreated, or a message the relay did not write)"
        )));
    };
    Ok(match reader.event(row, position) {
        Ok(Some(event)) => Ok(event),
        Ok(None) => Err(format!(
            "outbox id {id} in table {table} has an event type the filter excludes, so the relay published no event for it"
        )),
        Err(_) => Err(format!(
            "outbox id {id} in table {table} has a NULL, non-UTF-8 or infinite key column, so the relay published no event for it"
        )),
    })
}
