//! What `--mark-published` and `--retention-grace` need of the outbox table and the
//! relay's role, checked before the first session (`crate::setup::ensure`): the marking's
//! columns and privileges (`crate::process::mark` U5) and retention's privilege to delete
//! (`crate::process::retention` RET6). A missing table is left to [`crate::postgres::checks`],
//! which names it.

use outbox::Role;
use tokio_postgres::Client;

use crate::config::Config;
use crate::error::{RelayError, Result};
use crate::postgres::error::describe;

/// What U5 requires of a column: its name, the types it may have, and how to add it.
const COLUMNS: [(&str, &str, &str); 3] = [
    (
        "status",
        "a text type (text, varchar, char) or an enum with the label 'published'",
        "status text NOT NULL DEFAULT 'pending'",
    ),
    (
        "published_at",
        "timestamptz or timestamp",
        "published_at timestamptz",
    ),
    (
        "attempts",
        "an integer type (smallint, integer, bigint) or numeric",
        "attempts integer NOT NULL DEFAULT 0",
    ),
];

/// Each column's type, whether it fits, and the role's privileges on it and on `id`.
const CHECK_SQL: &str = "\
    SELECT c.name, t.typname, \
           CASE WHEN t.typtype = 'e' THEN EXISTS (SELECT 1 FROM pg_catalog.pg_enum e WHERE e.enumtypid = t.oid AND e.enumlabel = 'published') \
                ELSE t.typname = ANY (CASE c.name WHEN 'status' THEN ARRAY['text','varchar','bpchar','name','citext'] \
                                                  WHEN 'published_at' THEN ARRAY['timestamptz','timestamp'] \
                                                  ELSE ARRAY['int2','int4','int8','numeric'] END) END, \
           CASE WHEN a.attnum IS NULL THEN false ELSE pg_catalog.has_column_privilege($1::text::regclass, a.attnum, 'UPDATE') END, \
           CASE WHEN a.attnum IS NULL THEN false ELSE pg_catalog.has_column_privilege($1::text::regclass, a.attnum, 'SELECT') END \
      FROM unnest(ARRAY['status','published_at','attempts']) WITH ORDINALITY AS c(name, n) \
      LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = $1::text::regclass AND a.attname = c.name AND a.attnum > 0 AND NOT a.attisdropped \
      LEFT JOIN pg_catalog.pg_type t ON t.oid = a.atttypid \
     ORDER BY c.n";

/// A failed read of `what`, tried again.
fn unreadable(what: &str) -> impl Fn(tokio_postgres::Error) -> RelayError + '_ {
    move |e| RelayError::transient(anyhow::anyhow!("cannot read {what}: {}", describe(&e)))
}

/// U5: the table has the columns, with compatible types, and the relay's role may update
/// them; otherwise a setup error naming every problem and its fix. A missing table is left
/// to [`crate::postgres::checks`], which names it.
pub async fn marking(client: &Client, config: &Config) -> Result<()> {
    if !config.mark_published {
        return Ok(());
    }
    let table = config.table.sql();
    let exists: bool = client
        .query_one("SELECT pg_catalog.to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(unreadable("the outbox table's columns"))?
        .get(0);
    if !exists {
        return Ok(());
    }
    let rows = client
        .query(CHECK_SQL, &[&table])
        .await
        .map_err(unreadable("the outbox table's columns"))?;
    let id_readable: bool = client
        .query_one(
            "SELECT pg_catalog.has_column_privilege($1::text::regclass, $2, 'SELECT')",
            &[&table, &config.mapping.column(Role::Id)],
        )
        .await
        .map_err(unreadable("the relay's privileges"))?
        .get(0);
    let columns: Vec<Column> = rows
        .iter()
        .map(|row| Column {
            name: row.get(0),
            type_name: row.get(1),
            fits: row.get(2),
            may_update: row.get(3),
            may_select: row.get(4),
        })
        .collect();
    let id = config.mapping.column(Role::Id);
    let problems = judge_columns(table, &columns, (id, id_readable));
    if problems.is_empty() {
        return Ok(());
    }
    Err(RelayError::setup(anyhow::anyhow!(
        "--mark-published (OUTBOX_RELAY_MARK_PUBLISHED) sets status, published_at and attempts on relayed rows of {table}, but {}; \
         fix that or turn --mark-published off",
        problems.join("; ")
    )))
}

/// One column of [`CHECK_SQL`]'s answer: its type (`None`: no such column), whether the
/// type fits, and the relay's privileges on it.
struct Column {
    name: String,
    type_name: Option<String>,
    fits: Option<bool>,
    may_update: bool,
    may_select: bool,
}

/// U5's judge: every problem with the columns and the relay's privileges, each with its
/// fix (`id`: the id column, and whether the relay may read it).
fn judge_columns(table: &str, columns: &[Column], id: (&str, bool)) -> Vec<String> {
    let (id, id_readable) = id;
    let mut problems = Vec::new();
    let mut ungranted = Vec::new();
    for column in columns {
        let Column {
            name,
            type_name,
            fits,
            may_update,
            may_select,
        } = column;
        let Some((_, wanted, add)) = COLUMNS.iter().find(|(column, _, _)| *column == name) else {
            continue;
        };
        match type_name {
            None => problems.push(format!(
                "the table has no column {name} (add it: ALTER TABLE {table} ADD COLUMN {add};)"
            )),
            Some(type_name) if *fits != Some(true) => problems.push(format!(
                "column {name} is of type {type_name}, expected {wanted}"
            )),
            Some(_) => {
                if !*may_update {
                    ungranted.push(format!("UPDATE ({name})"));
                }
                if !*may_select && name == "status" {
                    ungranted.push("SELECT (status)".to_owned());
                }
            }
        }
    }
    if !id_readable {
        ungranted.push(format!("SELECT ({})", replication::quote_identifier(id)));
    }
    if !ungranted.is_empty() {
        problems.push(format!(
            "the relay's role may not {} (grant it: GRANT {} ON {table} TO <the relay's role>;)",
            ungranted.join(", "),
            ungranted.join(", ")
        ));
    }
    problems
}

/// RET6: the relay's role may delete old rows; otherwise a setup error naming the `GRANT`. A
/// missing table is left to [`crate::postgres::checks`], which names it.
pub async fn retention(client: &Client, config: &Config) -> Result<()> {
    if config.retention.is_none() {
        return Ok(());
    }
    let table = config.table.sql();
    let (id, created_at) = (
        config.mapping.column(Role::Id),
        config.mapping.column(Role::CreatedAt),
    );
    let row = client
        .query_one(
            "SELECT pg_catalog.to_regclass($1) IS NOT NULL AND pg_catalog.has_table_privilege($1::text::regclass, 'DELETE'), \
             pg_catalog.to_regclass($1) IS NOT NULL AND pg_catalog.has_column_privilege($1::text::regclass, $2, 'SELECT') \
             AND pg_catalog.has_column_privilege($1::text::regclass, $3, 'SELECT'), \
             pg_catalog.to_regclass($1) IS NULL",
            &[&table, &id, &created_at],
        )
        .await
        .map_err(|e| RelayError::transient(anyhow::anyhow!("cannot read the relay's privileges on {table}: {}", describe(&e))))?;
    let (may_delete, may_read, missing): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
    if missing || (may_delete && may_read) {
        return Ok(());
    }
    let mut grants = Vec::new();
    if !may_delete {
        grants.push("DELETE".to_owned());
    }
    if !may_read {
        grants.push(format!(
            "SELECT ({}, {})",
            replication::quote_identifier(id),
            replication::quote_identifier(created_at)
        ));
    }
    Err(RelayError::setup(anyhow::anyhow!(
        "--retention-grace (OUTBOX_RELAY_RETENTION_GRACE) deletes old confirmed rows of {table}, but the relay's role may not {}; \
         grant it (GRANT {} ON {table} TO <the relay's role>;) or turn retention off",
        grants.join(" or "),
        grants.join(", ")
    )))
}
