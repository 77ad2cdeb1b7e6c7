//! Parked events: what a shard does with an event whose handler keeps failing
//! ([`OnFailure::Park`]), with the later events of its entity, and with an operator's
//! re-drive.
//!
//! # Invariants
//! - PK1 An event is parked in the transaction that records its `dedupe_key`: its row in the
//!   parked table (id, dedupe key, entity, stream sequence, attempts, the last error's text,
//!   its headers and payload) commits with the key or neither does, and only then is it
//!   acknowledged (C1). A parked event is never lost and never counted as processed.
//!   An integer id is in `outbox_id`, a uuid or text id in `outbox_id_text` (the other one
//!   null). A table made before `outbox_id_text` existed still parks integer ids; a shard
//!   that meets a uuid or text id with such a table stops with [`SetupError::ParkedTable`]
//!   naming the migration before it handles that event.
//! - PK2 An entity with a parked event has the rest of its events parked behind it (attempts
//!   0), not handled: the handler never sees an entity's event after one of its events that
//!   was not applied. Holding only that entity's messages instead would keep them
//!   unacknowledged, and at `max_ack_pending` they would stop the whole shard again. The
//!   shard's other entities go on.
//! - PK3 Which entities are parked is the table's: the shard reads it through each new
//!   connection before it handles a batch (a batch waits while that read fails), then
//!   every [`PARKED_POLL`]. Before events are parked behind an entity, the transaction
//!   that parks them confirms the entity still has rows: an operator's discard (deleting
//!   them) frees the entity for its next event at once.
//! - PK4 A re-drive (an entity's rows with `redrive = true`) runs on the shard's task between
//!   batches, in stream order, each event in a transaction that deletes its row (a row
//!   already gone is skipped: nothing runs twice) and runs the handler; the dedupe key stays
//!   recorded. A re-driven event that fails again keeps its row (attempts + 1, the new
//!   error), the entity's `redrive` flags are cleared, and the rest stays parked behind it.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use tokio_postgres::error::SqlState;
use tracing::{info, warn};

use super::{Apply, Failure, Worker};
use crate::config::{Config, OnFailure};
use crate::error::{Error, SetupError, Unavailable};
use crate::event::Event;
use crate::metrics::Parked;
use crate::transaction::Transaction;

/// How often a shard reads which of its entities are parked and which are to be re-driven.
pub const PARKED_POLL: Duration = Duration::from_secs(5);

/// Why events are parked, as recorded.
pub(super) enum Reason<'a> {
    /// The handler failed on it `attempts` times; the last error.
    Failed { attempts: u32, error: &'a str },
    /// An earlier event of its entity is parked.
    Behind,
}

/// One parked row, as a re-drive reads it.
struct Row {
    dedupe_key: String,
    event: Event,
}

impl<A: Apply> Worker<A> {
    /// Whether this shard parks events (and so keeps a parked table).
    pub(super) fn parks(&self) -> bool {
        self.config.on_failure == OnFailure::Park
    }

    /// Checks that the parked table is usable (at connect, with [`OnFailure::Park`]), and
    /// whether it has `outbox_id_text` (PK1).
    pub(super) async fn check_parked_table(
        &mut self,
        client: &tokio_postgres::Client,
    ) -> Result<(), Error> {
        let table = &self.config.parked_table;
        let check = |text_column: &str| {
            format!(
                "select consumer, dedupe_key, outbox_id, {text_column}entity_id, event_type, \
                 shard, stream_sequence, delivered, attempts, error, subject, headers, payload, \
                 redrive from {table} where false"
            )
        };
        let checked = match client.prepare(&check("outbox_id_text, ")).await {
            Err(error) if error.code() == Some(&SqlState::UNDEFINED_COLUMN) => {
                let older = client.prepare(&check("")).await;
                if older.is_ok() && self.parked_text_ids {
                    warn!(table = %table, "the parked table has no column outbox_id_text: events with uuid or text ids cannot be parked until sql/consumer.sql is run again (it adds the column)");
                }
                self.parked_text_ids = false;
                older
            }
            checked => {
                self.parked_text_ids = true;
                checked
            }
        };
        match checked {
            Ok(_) => Ok(()),
            Err(error) if super::is_schema_error(&error) => Err(SetupError::ParkedTable {
                table: table.clone(),
                reason: replication::describe(&error),
            }
            .into()),
            Err(error) => Err(Unavailable::Postgres(error).into()),
        }
    }

    /// PK1: an event with a uuid or text id needs `outbox_id_text` to be parkable; the
    /// shard stops before handling it when the table lacks it.
    pub(super) fn check_parkable(&self, event: &Event) -> Result<(), Error> {
        if !self.parks() || self.parked_text_ids || event.id.is_int() {
            return Ok(());
        }
        Err(SetupError::ParkedTable {
            table: self.config.parked_table.clone(),
            reason: format!(
                "it has no column outbox_id_text, which events with uuid or text ids (outbox id \
                 {}) need; run sql/consumer.sql again (it adds the column, idempotently)",
                event.id
            ),
        }
        .into())
    }

    /// Parks `event`, whose handler failed `attempts` times, in a transaction of its own
    /// that records its dedupe key (PK1). Returns whether it was new (else it was recorded
    /// before, and nothing was parked).
    pub(super) async fn park_failed(
        &mut self,
        event: &Event,
        attempts: u32,
        error: &str,
    ) -> Result<bool, tokio_postgres::Error> {
        let Some(connection) = self.client.as_mut() else {
            unreachable!("a batch is handled after connecting");
        };
        let tx = connection.client.transaction().await?;
        let tx = Transaction::new(tx, &connection.statements);
        let keys = vec![event.keys.dedupe_key.as_str()];
        let fresh = !tx.query(&connection.insert, &[&keys]).await?.is_empty();
        if fresh {
            let reason = Reason::Failed { attempts, error };
            let target = Target {
                config: &self.config,
                shard: self.shard,
                text_ids: self.parked_text_ids,
            };
            park_in(&tx, target, &[event], reason).await?;
        }
        tx.into_inner().commit().await?;
        if fresh {
            self.parked.insert(event.entity_id.clone());
            self.count_parked(Parked::Failed, 1);
        }
        Ok(fresh)
    }

    pub(super) fn count_parked(&self, reason: Parked, n: u64) {
        if n > 0 {
            self.stats
                .parked
                .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            self.metrics.parked(reason, n);
        }
    }

    fn shard_i64(&self) -> i64 {
        i64::try_from(self.shard).unwrap_or(i64::MAX)
    }

    /// When it is time (PK3): reads which entities of the shard are parked, and re-drives
    /// those an operator asked for (PK4).
    pub(super) async fn poll_parked(&mut self) -> Result<(), tokio_postgres::Error> {
        let due = !self.parked_loaded || tokio::time::Instant::now() >= self.next_poll;
        if !self.parks() || !due {
            return Ok(());
        }
        self.next_poll = tokio::time::Instant::now() + PARKED_POLL;
        let Some(connection) = self.client.as_ref() else {
            return Ok(());
        };
        let table = &self.config.parked_table;
        let rows = connection
            .client
            .query(
                &format!(
                    "select entity_id, count(*), bool_or(redrive) from {table} \
                     where consumer = $1 and shard = $2 group by entity_id"
                ),
                &[&self.config.name, &self.shard_i64()],
            )
            .await?;
        self.parked = rows.iter().map(|row| row.get(0)).collect();
        self.parked_loaded = true;
        let events: i64 = rows.iter().map(|row| row.get::<_, i64>(1)).sum();
        self.metrics.parked_events(self.shard, events);
        let redrive: Vec<String> = rows
            .iter()
            .filter(|row| row.get::<_, bool>(2))
            .map(|row| row.get(0))
            .collect();
        for entity in redrive {
            if *self.stop.borrow() {
                break;
            }
            self.redrive(&entity).await?;
        }
        Ok(())
    }

    /// Re-drives the parked events of `entity`, in stream order, until one fails (PK4).
    async fn redrive(&mut self, entity: &str) -> Result<(), tokio_postgres::Error> {
        let (rows, unreadable) = self.parked_rows(entity).await?;
        info!(
            shard = self.shard,
            parked = rows.len(),
            "re-driving an entity's parked events"
        );
        for row in rows {
            if *self.stop.borrow() {
                return Ok(());
            }
            if let Some(error) = self.redrive_one(&row).await? {
                warn!(
                    shard = self.shard,
                    outbox_id = %row.event.id,
                    stream_sequence = row.event.stream_sequence,
                    %error,
                    "a re-driven event failed again; it and its entity's later events stay parked"
                );
                self.keep_parked(entity, Some((&row.dedupe_key, &error)))
                    .await?;
                return Ok(());
            }
        }
        if unreadable {
            // The rest stays parked behind the row that is not an event.
            return self.keep_parked(entity, None).await;
        }
        self.parked.remove(entity);
        Ok(())
    }

    /// The parked rows of `entity` on this shard, in stream order, as events, up to one that
    /// is not an event (then `true`).
    async fn parked_rows(
        &mut self,
        entity: &str,
    ) -> Result<(Vec<Row>, bool), tokio_postgres::Error> {
        let Some(connection) = self.client.as_ref() else {
            return Ok((Vec::new(), true));
        };
        let table = &self.config.parked_table;
        let rows = connection
            .client
            .query(
                &format!(
                    "select dedupe_key, subject, headers::text, payload, stream_sequence, \
                     delivered from {table} \
                     where consumer = $1 and shard = $2 and entity_id = $3 \
                     order by stream_sequence"
                ),
                &[&self.config.name, &self.shard_i64(), &entity],
            )
            .await?;
        let mut parked = Vec::with_capacity(rows.len());
        for row in rows {
            let subject: String = row.get(1);
            let headers = headers_from_json(row.get(2));
            let payload: Vec<u8> = row.get(3);
            let sequence = u64::try_from(row.get::<_, i64>(4)).unwrap_or(0);
            let delivered = u64::try_from(row.get::<_, i64>(5)).unwrap_or(0);
            match Event::decode(
                &subject,
                Some(&headers),
                Bytes::from(payload),
                sequence,
                delivered,
            ) {
                Ok(event) => parked.push(Row {
                    dedupe_key: row.get(0),
                    event,
                }),
                Err(error) => {
                    // Parked events were decoded before; a row edited by hand may not be.
                    warn!(shard = self.shard, %error, "a parked row is not an event; the entity's re-drive stops before it");
                    return Ok((parked, true));
                }
            }
        }
        Ok((parked, false))
    }

    /// One re-driven event: its row deleted and its handler run in one transaction. Returns
    /// the handler's failure, if it failed (rolled back).
    async fn redrive_one(&mut self, row: &Row) -> Result<Option<String>, tokio_postgres::Error> {
        let Some(connection) = self.client.as_mut() else {
            return Ok(None);
        };
        let table = &self.config.parked_table;
        let tx = connection.client.transaction().await?;
        let mut tx = Transaction::new(tx, &connection.statements);
        let claimed = tx
            .execute(
                &format!("delete from {table} where consumer = $1 and dedupe_key = $2"),
                &[&self.config.name, &row.dedupe_key],
            )
            .await?;
        if claimed == 0 {
            // Re-driven or discarded meanwhile.
            tx.into_inner().rollback().await?;
            return Ok(None);
        }
        let events = std::slice::from_ref(&row.event);
        match super::run_handler(&*self.handler, &mut tx, events, &self.stop).await {
            Ok(()) => {
                tx.into_inner().commit().await?;
                self.metrics.redriven();
                self.committed(events, &super::Done::handled(vec![0]));
                Ok(None)
            }
            Err(Failure::Handler { error, .. }) => {
                let _ = tx.into_inner().rollback().await;
                Ok(Some(error))
            }
            Err(Failure::Stopped { .. }) => {
                let _ = tx.into_inner().rollback().await;
                Ok(None)
            }
        }
    }

    /// A re-drive of `entity` ended before its last row (PK4): its `redrive` flags are
    /// cleared, and the row of the event that failed again (`failed`: its dedupe key and
    /// error) counts the attempt.
    async fn keep_parked(
        &mut self,
        entity: &str,
        failed: Option<(&str, &str)>,
    ) -> Result<(), tokio_postgres::Error> {
        let Some(connection) = self.client.as_ref() else {
            return Ok(());
        };
        let table = &self.config.parked_table;
        let (key, error) = failed.unzip();
        connection
            .client
            .execute(
                &format!(
                    "update {table} set redrive = false, \
                     attempts = attempts + case when dedupe_key = $4 then 1 else 0 end, \
                     error = case when dedupe_key = $4 then $5 else error end \
                     where consumer = $1 and shard = $2 and entity_id = $3"
                ),
                &[&self.config.name, &self.shard_i64(), &entity, &key, &error],
            )
            .await?;
        Ok(())
    }
}

/// Where a shard parks: the configuration's table, the shard, and whether the table has
/// `outbox_id_text` (PK1).
#[derive(Clone, Copy)]
pub(super) struct Target<'a> {
    pub(super) config: &'a Config,
    pub(super) shard: u64,
    pub(super) text_ids: bool,
}

/// The columns of parked rows, one array per column (PK1).
struct Columns<'a> {
    keys: Vec<&'a str>,
    int_ids: Vec<Option<i64>>,
    text_ids: Vec<Option<&'a str>>,
    entities: Vec<&'a str>,
    types: Vec<&'a str>,
    sequences: Vec<i64>,
    delivered: Vec<i64>,
    subjects: Vec<&'a str>,
    headers: Vec<String>,
    payloads: Vec<&'a [u8]>,
}

impl<'a> Columns<'a> {
    fn of(events: &[&'a Event]) -> Self {
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        Columns {
            keys: events.iter().map(|e| e.keys.dedupe_key.as_str()).collect(),
            int_ids: events.iter().map(|e| e.id.as_int()).collect(),
            text_ids: events.iter().map(|e| e.id.as_text()).collect(),
            entities: events.iter().map(|e| e.entity_id.as_str()).collect(),
            types: events.iter().map(|e| e.event_type.as_str()).collect(),
            sequences: events.iter().map(|e| int(e.stream_sequence)).collect(),
            delivered: events.iter().map(|e| int(e.delivered)).collect(),
            subjects: events.iter().map(|e| e.subject.as_str()).collect(),
            headers: events.iter().map(|e| headers_json(&e.headers)).collect(),
            payloads: events.iter().map(|e| &e.payload[..]).collect(),
        }
    }
}

/// Inserts parked rows for `events` in `tx` (PK1).
pub(super) async fn park_in(
    tx: &Transaction<'_>,
    target: Target<'_>,
    events: &[&Event],
    reason: Reason<'_>,
) -> Result<(), tokio_postgres::Error> {
    let (attempts, error) = match reason {
        Reason::Failed { attempts, error } => (
            i32::try_from(attempts).unwrap_or(i32::MAX),
            error.to_owned(),
        ),
        Reason::Behind => (
            0,
            "not handled: an earlier event of its entity is parked".into(),
        ),
    };
    let c = Columns::of(events);
    let shard = i64::try_from(target.shard).unwrap_or(i64::MAX);
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
        &target.config.name,
        &shard,
        &attempts,
        &error,
        &c.keys,
        &c.int_ids,
        &c.entities,
        &c.types,
        &c.sequences,
        &c.delivered,
        &c.subjects,
        &c.headers,
        &c.payloads,
    ];
    // A table without outbox_id_text gets integer ids only (check_parkable).
    let (text_column, text_value, text_array) = match target.text_ids {
        true => (", outbox_id_text", ", x", ", $14::text[]"),
        false => ("", "", ""),
    };
    if target.text_ids {
        params.push(&c.text_ids);
    }
    let table = &target.config.parked_table;
    tx.execute(
        &format!(
            "insert into {table} (consumer, shard, attempts, error, dedupe_key, outbox_id, \
             entity_id, event_type, stream_sequence, delivered, subject, headers, payload\
             {text_column}) \
             select $1, $2, $3, $4, k, i, e, t, s, d, j, h::jsonb, p{text_value} \
             from unnest($5::text[], $6::int8[], $7::text[], $8::text[], $9::int8[], \
             $10::int8[], $11::text[], $12::text[], $13::bytea[]{text_array}) \
             u(k, i, e, t, s, d, j, h, p{text_value}) \
             on conflict do nothing"
        ),
        &params,
    )
    .await?;
    Ok(())
}

/// PK2: splits the new events of `slice` (`fresh`) into those to handle and those of
/// entities with parked events, which are parked behind them in `tx`. Which entities are
/// parked is `parked`, confirmed against the table in `tx` for the entities of the slice
/// (so that a discard counts at once, not only at the next read); an entity whose rows are
/// gone leaves `parked`.
pub(super) async fn park_behind(
    tx: &Transaction<'_>,
    target: Target<'_>,
    parked: &mut HashSet<String>,
    slice: &[Event],
    fresh: Vec<usize>,
) -> Result<(Vec<usize>, Vec<usize>), tokio_postgres::Error> {
    let candidates: HashSet<&str> = fresh
        .iter()
        .map(|&i| slice[i].entity_id.as_str())
        .filter(|entity| parked.contains(*entity))
        .collect();
    if candidates.is_empty() {
        return Ok((fresh, Vec::new()));
    }
    let (config, shard) = (target.config, target.shard);
    let table = &config.parked_table;
    let candidates: Vec<&str> = candidates.into_iter().collect();
    let still: HashSet<String> = tx
        .query(
            &format!(
                "select distinct entity_id from {table} \
                 where consumer = $1 and shard = $2 and entity_id = any($3)"
            ),
            &[
                &config.name,
                &i64::try_from(shard).unwrap_or(i64::MAX),
                &candidates,
            ],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    for gone in candidates.iter().filter(|entity| !still.contains(**entity)) {
        parked.remove(*gone);
    }
    let (behind, handled): (Vec<usize>, Vec<usize>) = fresh
        .into_iter()
        .partition(|&i| still.contains(&slice[i].entity_id));
    if !behind.is_empty() {
        let events: Vec<&Event> = behind.iter().map(|&i| &slice[i]).collect();
        park_in(tx, target, &events, Reason::Behind).await?;
    }
    Ok((handled, behind))
}

/// A message's headers as `[[name, value], …]` JSON text.
fn headers_json(headers: &HeaderMap) -> String {
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (AsRef::<str>::as_ref(name), value.as_str()))
        })
        .collect();
    serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".into())
}

/// [`headers_json`] inverted; what does not parse is left out (the decode then says what
/// is missing).
fn headers_from_json(text: &str) -> HeaderMap {
    let pairs: Vec<(String, String)> = serde_json::from_str(text).unwrap_or_default();
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        headers.append(name.as_str(), value.as_str());
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_json() {
        let mut headers = HeaderMap::new();
        headers.insert("Outbox-Id", "7");
        headers.append("X-Twice", "a");
        headers.append("X-Twice", "b \"quoted\"");
        let back = headers_from_json(&headers_json(&headers));
        assert_eq!(back.get("Outbox-Id").map(|v| v.as_str()), Some("7"));
        let twice: Vec<&str> = back.get_all("X-Twice").map(|v| v.as_str()).collect();
        assert_eq!(twice, ["a", "b \"quoted\""]);
    }
}
