//! The slot's boundary (issue 18 case 10): which rows already in the table when the relay
//! created its slot were left out of the stream by design, recorded when the slot is created,
//! so that `outbox-relay verify` ([`crate::commands::verify`]) expects exactly the rows on the
//! relay's side of it instead of reporting the migrated history as missing.
//!
//! With `--backfill pending` (the default) the rows that were `published` in the slot's
//! exported snapshot are not the relay's: the polling publisher published them. Which rows
//! those were cannot be told later (`status` changes, `--mark-published` sets it; a row's
//! `xmin` changes with every update), so the backfill records them while it reads the
//! snapshot ([`in_snapshot`], [`record`]): the backfill mode, the slot's consistent point
//! (the first position it streams), the highest id and the number of rows in the snapshot,
//! and the left-out rows as runs of consecutive ids.
//!
//! **Where: one row per slot in `outbox_relay_boundary`, in the outbox table's schema**
//! (`sql/boundary.sql`). The alternatives fall short: the stream's metadata needs
//! nats-server 2.10; its description holds 4 KiB (too little for an exact set), is the
//! operator's text that `nats stream edit` or infrastructure-as-code rewrite, and would need a
//! `STREAM.UPDATE` permission the relay needs nowhere else; a marker message in the stream
//! would be delivered to every consumer of `{prefix}.>`, become the strict stream's tail and
//! expire with `max_age`. The facts are the table's and the slot's, both in this database:
//! the record is written beside them, survives the stream's retention, has no size limit,
//! and verify reads it on the connection it already holds. Its cost: the relay's role must
//! create the table (it does when it may, as it does the publication) or be granted `SELECT,
//! INSERT, UPDATE` on it; without that it warns once, naming the grant, and goes on.
//!
//! # Invariants
//! - BD1 Exact: a run `lo..=hi` is recorded only when every id in it is a row of the snapshot
//!   that the mode left out (the runs of consecutive ids among them). Ids are unique, so no
//!   row committed after the snapshot can fall in a run: verify leaves out exactly the
//!   recorded rows and expects every other, and a message missing for a backfilled or a
//!   streamed row is reported by its id. The record costs 16 bytes per run: left-out ids
//!   that are consecutive take one run; each gap in them (a rolled-back insert's id, a
//!   pending row between two published ones) starts another. A million runs take 16 MB,
//!   read once by verify.
//! - BD2 Recorded before the first row is backfilled, committed on its own, and replaced when an
//!   interrupted backfill creates the slot again (the new snapshot's facts). The record
//!   serves the audit, not the relay: failing to write it is a warning (once per slot
//!   creation, with the fix), never a reason to stop.
//! - BD3 No record (a slot created before this version, with `--backfill none`, by hand, or
//!   over a stream that already held events) is not an error: verify then expects every row,
//!   as before, and says once why rows may be reported missing ([`Read`]).
//! - BD4 The record follows the mapped id column. Only integer ids are recorded (runs and
//!   the highest id): a table whose ids are uuids or text has nothing left out by design,
//!   since `--backfill pending` is refused on it when it has a `status` column
//!   (`crate::setup::backfill`), and without one `pending` backfills nothing and records
//!   no runs.

use pgoutput::Lsn;
use replication::quote_identifier;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::config::backfill::Mode;
use crate::config::{Config, Table, TableName};

/// The record's table name, in the outbox table's schema.
pub const TABLE: &str = "outbox_relay_boundary";

/// What the slot's creation left out of the stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Boundary {
    /// The backfill mode (`pending` or `all`).
    pub mode: String,
    /// The slot's consistent point: it streams what commits at or after it.
    pub consistent_point: Lsn,
    /// The highest id in the snapshot (`None`: the table was empty).
    pub snapshot_max_id: Option<i64>,
    /// Rows in the snapshot.
    pub snapshot_rows: i64,
    /// The left-out rows: runs `lo..=hi` of consecutive ids, ascending (BD1).
    pub runs: Vec<(i64, i64)>,
}

impl Boundary {
    /// Rows left out.
    pub fn left_out_rows(&self) -> i64 {
        self.runs.iter().map(|(lo, hi)| hi - lo + 1).sum()
    }

    /// A cursor over the runs for ids asked in ascending order.
    pub fn cursor(&self) -> RunCursor<'_> {
        RunCursor {
            runs: &self.runs,
            next: 0,
        }
    }
}

/// [`Boundary::runs`] asked in ascending id order: linear in ids plus runs.
#[derive(Debug)]
pub struct RunCursor<'a> {
    runs: &'a [(i64, i64)],
    next: usize,
}

impl RunCursor<'_> {
    /// Whether `id` (not below any id asked before) was left out.
    pub fn left_out(&mut self, id: i64) -> bool {
        while let Some((_, hi)) = self.runs.get(self.next) {
            if id <= *hi {
                break;
            }
            self.next += 1;
        }
        self.runs.get(self.next).is_some_and(|(lo, _)| *lo <= id)
    }
}

/// The record's table, schema-qualified and quoted.
pub fn table(outbox: &TableName) -> String {
    format!(
        "{}.{}",
        quote_identifier(&outbox.schema),
        quote_identifier(TABLE)
    )
}

/// The facts of the snapshot `reader`'s open transaction is in, for `mode` (BD1), on the
/// mapped id column (`rows`): the highest id and the runs for integer ids only (BD4).
pub async fn in_snapshot(
    reader: &Client,
    table: &Table,
    rows: &crate::postgres::rows::RowReader,
    mode: Mode,
    consistent_point: Lsn,
) -> Result<Boundary, tokio_postgres::Error> {
    let from = table.sql();
    let integer = rows.id_kind() == outbox::IdKind::Integer;
    let id = rows.id_column();
    let max_id = if integer {
        format!("max({id})::int8")
    } else {
        "NULL::int8".to_owned()
    };
    let totals = reader
        .query_one(&format!("SELECT {max_id}, count(*)::int8 FROM {from}"), &[])
        .await?;
    let mut runs = vec![];
    if mode == Mode::Pending && integer {
        // Left out: what the backfill's `status = 'pending'` does not select. Consecutive
        // ids share `id - row_number()`.
        for row in reader
            .query(
                &format!(
                    "SELECT min(id)::int8, max(id)::int8 FROM \
                       (SELECT {id} AS id, {id} - row_number() OVER (ORDER BY {id}) AS run \
                          FROM {from} WHERE (status = 'pending') IS NOT TRUE) AS left_out \
                     GROUP BY run ORDER BY 1"
                ),
                &[],
            )
            .await?
        {
            runs.push((row.get(0), row.get(1)));
        }
    }
    Ok(Boundary {
        mode: match mode {
            Mode::Pending => "pending",
            Mode::All => "all",
            Mode::None => "none",
        }
        .to_owned(),
        consistent_point,
        snapshot_max_id: totals.get(0),
        snapshot_rows: totals.get(1),
        runs,
    })
}

/// Records `boundary` for the slot, creating the table when it is missing and the relay may
/// create things (BD2). Never fails: what went wrong is a warning naming the fix.
pub async fn record(client: &Client, config: &Config, boundary: &Boundary) {
    match try_record(client, config, boundary).await {
        Ok(()) => info!(slot = %config.slot, mode = %boundary.mode,
            consistent_point = %boundary.consistent_point,
            left_out = boundary.left_out_rows(), runs = boundary.runs.len(),
            "recorded the slot's boundary for `outbox-relay verify` in {}", table(&config.table)),
        Err(why) => warn!(slot = %config.slot,
            "cannot record the slot's boundary in {} ({why}): `outbox-relay verify` will report the {} rows left out by --backfill {} as missing. \
             Create it with sql/boundary.sql and GRANT SELECT, INSERT, UPDATE ON it to the relay's role before the slot is created",
            table(&config.table), boundary.left_out_rows(), boundary.mode),
    }
}

async fn try_record(client: &Client, config: &Config, boundary: &Boundary) -> Result<(), String> {
    let table = table(&config.table);
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(|e| text(&e))?
        .get(0);
    if !exists {
        if !config.create {
            return Err("it does not exist and --no-create forbids creating it".into());
        }
        client
            .batch_execute(&create_sql(&table))
            .await
            .map_err(|e| text(&e))?;
    }
    let flat: Vec<i64> = boundary
        .runs
        .iter()
        .flat_map(|(lo, hi)| [*lo, *hi])
        .collect();
    client
        .execute(
            &format!(
                "INSERT INTO {table} AS b (slot, outbox_table, mode, consistent_point, snapshot_max_id, snapshot_rows, left_out_rows, left_out) \
                 VALUES ($1, $2, $3, $4::text::pg_lsn, $5, $6, $7, $8) \
                 ON CONFLICT (slot) DO UPDATE SET outbox_table = excluded.outbox_table, mode = excluded.mode, \
                   consistent_point = excluded.consistent_point, snapshot_max_id = excluded.snapshot_max_id, \
                   snapshot_rows = excluded.snapshot_rows, left_out_rows = excluded.left_out_rows, \
                   left_out = excluded.left_out, recorded_at = now()"
            ),
            &[
                &config.slot,
                &config.table.sql(),
                &boundary.mode,
                &boundary.consistent_point.to_string(),
                &boundary.snapshot_max_id,
                &boundary.snapshot_rows,
                &boundary.left_out_rows(),
                &flat,
            ],
        )
        .await
        .map_err(|e| text(&e))?;
    Ok(())
}

/// The record's table (`sql/boundary.sql` holds the same).
fn create_sql(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
           slot text PRIMARY KEY, \
           outbox_table text NOT NULL, \
           mode text NOT NULL, \
           consistent_point pg_lsn NOT NULL, \
           snapshot_max_id int8, \
           snapshot_rows int8 NOT NULL, \
           left_out_rows int8 NOT NULL, \
           left_out int8[] NOT NULL, \
           recorded_at timestamptz NOT NULL DEFAULT now())"
    )
}

/// What verify finds of the slot's boundary (BD3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Recorded when the slot was created.
    Recorded(Boundary),
    /// Not recorded, and why.
    Absent(String),
}

/// The slot's recorded boundary, or why there is none (BD3). Read-only.
pub async fn read(client: &Client, config: &Config) -> Read {
    let table = table(&config.table);
    let row = client
        .query_opt(
            &format!(
                "SELECT mode, consistent_point::text, snapshot_max_id, snapshot_rows, left_out \
                   FROM {table} WHERE slot = $1"
            ),
            &[&config.slot],
        )
        .await;
    let row = match row {
        Ok(Some(row)) => row,
        Ok(None) => return Read::Absent(format!("{table} has no row for slot {:?}", config.slot)),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Read::Absent(format!("{table} does not exist"))
        }
        Err(e) => return Read::Absent(format!("cannot read {table}: {}", text(&e))),
    };
    let flat: Vec<i64> = row.get(4);
    let Ok(consistent_point) = row.get::<_, String>(1).parse::<Lsn>() else {
        return Read::Absent(format!("{table} holds an unreadable consistent point"));
    };
    if flat.len() % 2 != 0 || flat.chunks(2).any(|run| run[0] > run[1]) {
        return Read::Absent(format!("{table} holds malformed id runs"));
    }
    Read::Recorded(Boundary {
        mode: row.get(0),
        consistent_point,
        snapshot_max_id: row.get(2),
        snapshot_rows: row.get(3),
        runs: flat.chunks(2).map(|run| (run[0], run[1])).collect(),
    })
}

fn text(e: &tokio_postgres::Error) -> String {
    crate::postgres::error::describe(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_finds_ids_in_runs_asked_in_ascending_order() {
        let boundary = Boundary {
            mode: "pending".into(),
            consistent_point: Lsn::ZERO,
            snapshot_max_id: Some(20),
            snapshot_rows: 12,
            runs: vec![(2, 4), (7, 7), (10, 12)],
        };
        assert_eq!(boundary.left_out_rows(), 7);
        let mut cursor = boundary.cursor();
        let left_out: Vec<i64> = (0..15).filter(|id| cursor.left_out(*id)).collect();
        assert_eq!(left_out, [2, 3, 4, 7, 10, 11, 12]);
        assert!(!Boundary {
            runs: vec![],
            ..boundary
        }
        .cursor()
        .left_out(3));
    }
}
