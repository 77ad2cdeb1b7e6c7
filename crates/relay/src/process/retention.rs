//! `--retention-grace`: rows both older than the grace period and confirmed by the slot are
//! deleted, a small batch at a time, while this relay streams (and so holds the lease).
//!
//! # The criterion
//! A row is confirmed when its transaction's commit lies at or below the slot's
//! `confirmed_flush_lsn`: the relay stored its event in the stream (I1). The relay does not
//! know the commit LSN of a row, so a round reads it from a snapshot instead:
//!
//! 1. `BEGIN ISOLATION LEVEL REPEATABLE READ`; the first statement reads
//!    `W = pg_current_wal_insert_lsn()`. The snapshot is taken when that statement starts,
//!    so every commit the snapshot sees ended at or below `W`.
//! 2. Read the slot's `confirmed_flush_lsn` (shared memory, not the snapshot) until it is
//!    at least `W`, for at most the interval, but at least [`CONFIRM_WAIT_MIN`] and at most
//!    [`CONFIRM_WAIT`] ([`confirm_wait`]); if it is not, the round ends (the next starts one
//!    interval later). A steadily written database always has WAL above the slot's
//!    position, so a round waits for the relay's next status update rather than giving up
//!    at once: the relay reports progress at most once a second
//!    ([`replication::PROGRESS_INTERVAL`]), so a round that waited only a shorter interval
//!    would find the slot behind `W` every time while anything in the cluster writes.
//! 3. In the same snapshot: `SELECT id … WHERE created_at < now() - grace ORDER BY id LIMIT
//!    batch`. Every row it returns committed at or below `W ≤ confirmed`: confirmed.
//! 4. Commit; `DELETE … WHERE id = ANY($1)` in a short transaction of its own (row locks
//!    on those rows only: writers are never blocked); repeat while a batch was full.
//!
//! Rows committed before the slot existed count as confirmed by this definition. The
//! relay's backfill published them (`--backfill pending|all`), except, with `--backfill
//! pending`, rows that were not pending, and with `--backfill none`, every one of them:
//! those were never relayed, and retention deletes them like the others.
//!
//! # Invariants
//! - RET1 Never an unconfirmed row: only ids read in a snapshot whose every commit lies at or
//!   below the slot's confirmed position are deleted.
//! - RET2 Only while streaming: the task belongs to the session (like the heartbeat, HB1) and
//!   is aborted with it, so a standby or a relay that lost its lease deletes nothing.
//! - RET3 Small: one DELETE of at most `--retention-batch` ids per transaction, by primary
//!   key; a partitioned table's root routes them to its partitions.
//! - RET4 No feed-back: the relay's publication publishes inserts only, and the framer ignores
//!   Delete messages anyway.
//! - RET6 Checked at start ([`check`]): the relay's role may DELETE from the table and read
//!   the id and creation-time columns, or the relay refuses to start (exit 2) naming the
//!   `GRANT`.
//! - RET5 A failing round is logged (once per failing spell) and retried at the next
//!   interval; it never ends the session.
//! - RET7 Only the table the session streams ([`crate::process::identity`] TI5): the snapshot's select
//!   and every DELETE require `to_regclass('schema.table')` to be the OID the session's
//!   identity check found (the DELETE resolves and locks the table before that condition
//!   is evaluated, so a table renamed into its place meanwhile has nothing deleted), and
//!   the slot's confirmed position that step 2 waits for is never past what an identity
//!   check vouched for (TI2): a row of a table created or swapped in since is never deleted.
//!   A round that finds another table deletes nothing and says so.
//! - RET8 The mapping decides the id and creation-time columns (the grace counts from the
//!   mapped creation time); ids of any kind go to the DELETE as text, cast to the id
//!   column's type read from the catalog each round, so the primary key's index serves it.

use std::sync::Arc;
use std::time::Duration;

use outbox::Role;
use pgoutput::Lsn;
use replication::ConnInfo;
use tokio_postgres::{Client, IsolationLevel};
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::config::{Config, RetentionConfig};
use crate::observe::metrics::Metrics;

/// How long a round waits, in its snapshot, for the slot to confirm the snapshot's WAL
/// position (step 2), at most: past the relay's status interval (10 s at most) and an ack.
pub const CONFIRM_WAIT: Duration = Duration::from_secs(15);
/// How long a round waits at least (step 2), however short the interval: past everything
/// between a WAL position and its confirmation. The identity check vouches for the LSN its
/// previous check read ([`crate::process::identity`] TI2: up to two checks, one a second), the
/// relay reports progress at most once a second (twice, for a report just missed), and the
/// marker's round and an ack come on top. A floor of 3 s, which left out the identity check,
/// let a round miss the confirmation under load every time while other databases wrote
/// (a fresh `W` each round), and retention with a short interval stalled.
pub const CONFIRM_WAIT_MIN: Duration = Duration::from_secs(6);

/// Step 2's wait for a retention `interval`.
pub fn confirm_wait(interval: Duration) -> Duration {
    interval.clamp(CONFIRM_WAIT_MIN, CONFIRM_WAIT)
}
/// How often a round reads the slot while it waits.
const CONFIRM_POLL: Duration = Duration::from_millis(100);

/// The running retention task; dropping it stops the task (RET2).
#[derive(Debug)]
pub struct Retention {
    _task: AbortOnDropHandle<()>,
}

/// Starts retention for a session streaming the table `table_oid`; `None` when
/// retention is off.
pub fn start(config: &Config, metrics: Arc<Metrics>, table_oid: u32) -> Option<Retention> {
    let settings = config.retention?;
    let task = Task {
        database: config.database.clone(),
        slot: config.slot.clone(),
        table: config.table.sql().to_owned(),
        table_oid,
        select_sql: select_sql(config.table.sql(), config),
        config: config.clone(),
        settings,
        metrics,
    };
    Some(Retention {
        _task: AbortOnDropHandle::new(tokio::spawn(task.run())),
    })
}

/// Old rows' ids as text, in id order (`$1`: the grace in seconds, `$2`: the batch), of the
/// table only while its name is the OID `$4` (`$3`: the name; RET7), on the mapped id and
/// creation-time columns (RET8).
fn select_sql(table: &str, config: &Config) -> String {
    let column = |role| replication::quote_identifier(config.mapping.column(role));
    let (id, created_at) = (column(Role::Id), column(Role::CreatedAt));
    // Under a name of its own: `ORDER BY id` would sort an output column named id as text.
    format!(
        "SELECT {id}::text AS outbox_relay_id FROM {table} \
          WHERE {created_at} < pg_catalog.now() - pg_catalog.make_interval(secs => $1::float8) \
            AND pg_catalog.to_regclass($3::text) = $4::int8::oid \
          ORDER BY {id} LIMIT $2"
    )
}

/// `$1`: the ids, as text (`id_in`: [`crate::postgres::rows::id_in_text_array`]'s
/// condition); `$2`, `$3`: the table's name and the OID it must have (RET7).
fn delete_sql(table: &str, id_in: &str) -> String {
    format!(
        "DELETE FROM {table} WHERE {id_in} \
            AND pg_catalog.to_regclass($2::text) = $3::int8::oid"
    )
}

/// Whether the table's name is still the OID the session streams (RET7).
const SAME_TABLE_SQL: &str = "SELECT pg_catalog.to_regclass($1::text) = $2::int8::oid";

struct Task {
    database: ConnInfo,
    slot: String,
    /// The table's name, in SQL, and the OID the session streams under it (RET7).
    table: String,
    table_oid: u32,
    select_sql: String,
    /// For the DELETE's id condition, read each round (RET8).
    config: Config,
    settings: RetentionConfig,
    metrics: Arc<Metrics>,
}

/// How a round ended.
#[derive(Debug, PartialEq, Eq)]
enum Round {
    /// Every old confirmed row is gone (or there was none).
    Done { deleted: u64 },
    /// The slot did not confirm the snapshot's WAL position in time.
    Unconfirmed {
        deleted: u64,
        wal: Lsn,
        confirmed: Option<Lsn>,
    },
    /// The table's name is another table than the one the session streams (RET7).
    OtherTable { deleted: u64 },
}

impl Task {
    async fn run(self) {
        let mut client: Option<Client> = None;
        let mut failing = false;
        let mut ticker = tokio::time::interval(self.settings.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match self.round(&mut client).await {
                Ok(round) => {
                    if std::mem::take(&mut failing) {
                        info!("retention works again");
                    }
                    match round {
                        Round::Done { deleted: 0 } => debug!("retention: no old confirmed row"),
                        Round::Done { deleted } => {
                            info!(deleted, "retention deleted old confirmed rows");
                        }
                        Round::Unconfirmed {
                            deleted,
                            wal,
                            confirmed,
                        } => debug!(
                            deleted,
                            wal = %wal,
                            confirmed_flush_lsn = ?confirmed.map(|lsn| lsn.to_string()),
                            "retention: the slot has not confirmed everything committed; waiting for the next round"
                        ),
                        Round::OtherTable { deleted } => debug!(
                            deleted,
                            table = %self.table,
                            table_oid = self.table_oid,
                            "retention: the table's name no longer is the table this session streams; deleting nothing (the identity check stops the relay)"
                        ),
                    }
                }
                Err(error) => {
                    client = None;
                    if !std::mem::replace(&mut failing, true) {
                        warn!(error = %error, "retention failed; retrying every {:?}", self.settings.interval);
                    } else {
                        debug!(error = %error, "retention failed again");
                    }
                }
            }
        }
    }

    /// Step 2: the slot's confirmed position, polled until it reaches `wal` or the wait
    /// (at most an interval) is over; `None` without a slot.
    async fn wait_confirmed(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
        wal: Lsn,
    ) -> anyhow::Result<Option<Lsn>> {
        let waited_until = tokio::time::Instant::now() + confirm_wait(self.settings.interval);
        Ok(loop {
            let confirmed = transaction
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?
            .and_then(|row| row.get::<_, Option<String>>(0))
            .map(|text| text.parse::<Lsn>())
            .transpose()
            .map_err(|e| anyhow::anyhow!("confirmed_flush_lsn: {e}"))?;
            if confirmed.is_some_and(|confirmed| confirmed >= wal)
                || tokio::time::Instant::now() >= waited_until
            {
                break confirmed;
            }
            tokio::time::sleep(CONFIRM_POLL).await;
        })
    }

    /// Step 3: the ids of old confirmed rows, at most a batch, read in `transaction`'s
    /// snapshot; `None` when the table's name is another table's (`oid`: the streamed one's).
    async fn old_ids(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
        oid: i64,
    ) -> anyhow::Result<Option<Vec<String>>> {
        let same: Option<bool> = transaction
            .query_one(SAME_TABLE_SQL, &[&self.table, &oid])
            .await?
            .get(0);
        if same != Some(true) {
            return Ok(None);
        }
        let grace = self.settings.grace.as_secs_f64();
        Ok(Some(
            transaction
                .query(
                    &self.select_sql,
                    &[&grace, &self.settings.batch, &self.table, &oid],
                )
                .await?
                .iter()
                .map(|row| row.get(0))
                .collect(),
        ))
    }

    /// Deletes old confirmed rows, a batch at a time, until a batch is not full (RET1, RET3).
    async fn round(&self, client: &mut Option<Client>) -> anyhow::Result<Round> {
        let client = match client {
            Some(client) if !client.is_closed() => client,
            _ => client.insert(replication::connect_sql(&self.database).await?),
        };
        let delete_sql = delete_sql(
            &self.table,
            &crate::postgres::rows::id_in_text_array(client, &self.config).await?,
        );
        let mut deleted = 0;
        loop {
            let transaction = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await?;
            // Step 1: the snapshot is taken as this statement starts.
            let wal = current_wal(&transaction).await?;
            // Step 2.
            let confirmed = self.wait_confirmed(&transaction, wal).await?;
            if confirmed.is_none_or(|confirmed| confirmed < wal) {
                transaction.commit().await?;
                return Ok(Round::Unconfirmed {
                    deleted,
                    wal,
                    confirmed,
                });
            }
            // Step 3, in the same snapshot, of the table the session streams only (RET7).
            let oid = i64::from(self.table_oid);
            let Some(ids) = self.old_ids(&transaction, oid).await? else {
                transaction.commit().await?;
                return Ok(Round::OtherTable { deleted });
            };
            transaction.commit().await?;
            if ids.is_empty() {
                return Ok(Round::Done { deleted });
            }
            // Step 4 (RET7: nothing if the name is another table's by now).
            let rows = client
                .execute(&delete_sql, &[&ids, &self.table, &oid])
                .await?;
            deleted += rows;
            self.metrics.retention_deleted(rows);
            if (ids.len() as i64) < self.settings.batch {
                return Ok(Round::Done { deleted });
            }
        }
    }
}

/// The server's WAL insert position (step 1).
async fn current_wal(transaction: &tokio_postgres::Transaction<'_>) -> anyhow::Result<Lsn> {
    transaction
        .query_one("SELECT pg_catalog.pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get::<_, String>(0)
        .parse()
        .map_err(|e| anyhow::anyhow!("pg_current_wal_insert_lsn: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_waits_past_the_whole_confirmation_chain_however_short_the_interval() {
        let chain = 2 * crate::process::identity::CHECK + 2 * replication::PROGRESS_INTERVAL;
        assert!(
            CONFIRM_WAIT_MIN >= chain + Duration::from_secs(1),
            "{chain:?}"
        );
        assert_eq!(confirm_wait(Duration::from_millis(200)), CONFIRM_WAIT_MIN);
        assert_eq!(
            confirm_wait(Duration::from_secs(10)),
            Duration::from_secs(10)
        );
        assert_eq!(confirm_wait(Duration::from_secs(60)), CONFIRM_WAIT);
    }

    #[test]
    fn x3_statements_read_old_rows_by_id_and_delete_by_primary_key() {
        let config = crate::config::tests::load(
            &[("retention_grace", "7d")],
            &[("DATABASE_URL", "postgres://u@h/db")],
            None,
        )
        .unwrap();
        let select = select_sql("\"public\".\"outbox_events\"", &config);
        assert!(
            select.starts_with("SELECT \"id\"::text AS outbox_relay_id FROM"),
            "{select}"
        );
        assert!(select.contains("ORDER BY \"id\" LIMIT $2"), "{select}");
        assert!(
            select.contains("\"created_at\" < pg_catalog.now()"),
            "{select}"
        );
        let delete = delete_sql(
            "\"public\".\"outbox_events\"",
            "\"id\" = ANY($1::text[]::bigint[])",
        );
        assert!(
            delete.starts_with(
                "DELETE FROM \"public\".\"outbox_events\" WHERE \"id\" = ANY($1::text[]::bigint[])"
            ),
            "{delete}"
        );
        assert!(
            delete.contains("to_regclass($2::text) = $3::int8::oid"),
            "{delete}"
        );
        assert!(
            select.contains("to_regclass($3::text) = $4::int8::oid"),
            "{select}"
        );
    }
}
