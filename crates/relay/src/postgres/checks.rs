//! The Postgres server's start-up checks and setup: everything that must hold there before
//! streaming can be correct (the stream's are [`crate::stream::policy`]'s).
//!
//! Checked at every session start: `wal_level = logical`; the outbox table exists with the
//! columns the relay reads in usable types; the publication publishes every insert into the
//! table, whoever created it (PG3); the slot is a pgoutput slot of this database.
//! Created when missing, unless `--no-create`: the publication (`FOR TABLE … WITH (publish =
//! 'insert', publish_via_partition_root = true)`) and the slot.
//!
//! With `--failover-slot` the slot is created with `failover = true` (Postgres 17 or newer;
//! an older server is a setup error that says what 17 and the standby need), and an existing
//! slot without it is a warning that gives the fix.
//!
//! # Invariants
//! - PG1 Nothing is created when a check fails: a wrong setup is reported, not patched over.
//! - PG2 Every failure is permanent and its message names the setting, object or column and
//!   how to fix it; connection failures stay transient. A failed check is a setup error
//!   (exit status 2); an error Postgres returns is permanent or transient by its SQLSTATE.
//! - PG3 A publication that would hide an outbox insert from the relay is refused, naming
//!   the publication, each problem and the exact SQL that fixes it: one that does not
//!   publish inserts, does not cover the table (or covers only some of its partitions),
//!   publishes a partitioned table's inserts under its partitions' names (no
//!   `publish_via_partition_root`) or the table's as an ancestor's, filters its rows, or
//!   leaves out a column the relay reads. Anything else it publishes is accepted (and costs
//!   the walsender decoding work, which the log says). `FOR ALL TABLES` and `FOR TABLES IN
//!   SCHEMA` cover the table like `FOR TABLE`. The check runs on every session start, so a
//!   publication changed under a running relay is refused at its next session.
//! - PG4 The control connection reaches the primary: a server in recovery (a standby) is
//!   refused before anything is created on it (no publication, no slot pinning the
//!   primary's catalog through `hot_standby_feedback`): at start a setup error naming the
//!   fix; in a later session of a running relay, a transient error (a fail-over in
//!   progress), retried.

use outbox::OutboxColumns;
use pgoutput::Lsn;
use replication::{quote_identifier, quote_literal};
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::config::{Config, Table, TableName};
use crate::error::{RelayError, Result};
use crate::postgres::error::{describe, is_transient};
use outbox::KnownRelations;

/// What start-up learned about the slot and the publication.
#[derive(Debug, Clone)]
pub struct SlotState {
    /// The slot's `confirmed_flush_lsn`: where streaming resumes.
    pub confirmed_flush_lsn: Lsn,
    /// The relations whose inserts may arrive, for the decoder (D5, D6).
    pub relations: KnownRelations,
}

fn permanent(message: String) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(message))
}

/// A check failed (PG2): exit status 2.
fn setup(message: String) -> RelayError {
    RelayError::setup(anyhow::anyhow!(message))
}

fn sql_error(what: &str, error: tokio_postgres::Error) -> RelayError {
    let mut message = format!("{what}: {}", describe(&error));
    if let Some(fix) = error
        .code()
        .and_then(|code| privilege_fix(what, code.code()))
    {
        message.push_str("; ");
        message.push_str(fix);
    }
    if is_transient(&error) {
        RelayError::transient(anyhow::anyhow!(message))
    } else {
        permanent(message)
    }
}

/// The operator's fix for a privilege error (SQLSTATE 42501) while doing `what`.
fn privilege_fix(what: &str, sqlstate: &str) -> Option<&'static str> {
    if sqlstate != "42501" {
        return None;
    }
    Some(if what.contains("publication") {
        "only the table's owner may create its publication: run sql/publication.sql as the owner, then start the relay with --no-create"
    } else if what.contains("slot") {
        "the role needs the REPLICATION attribute: ALTER ROLE <role> REPLICATION (see sql/role.sql)"
    } else {
        "grant the relay's role what sql/role.sql grants"
    })
}

/// Whether the slot exists.
pub async fn slot_exists(client: &Client, slot: &str) -> Result<bool> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| sql_error("cannot read replication slots", e))?
        .is_some())
}

/// Checks Postgres and creates what is missing (when allowed). Returns the slot's state.
pub async fn postgres(client: &Client, config: &Config) -> Result<SlotState> {
    let relations = publication(client, config).await?;
    let confirmed_flush_lsn = ensure_slot(client, config).await?;
    Ok(SlotState {
        confirmed_flush_lsn,
        relations,
    })
}

/// Every check before the slot, and the publication (created when missing and allowed):
/// what must hold before a slot is created.
pub async fn publication(client: &Client, config: &Config) -> Result<KnownRelations> {
    // PG4, SB1: a standby only as asked, and able to decode.
    let primary = crate::postgres::standby::check(client, config).await?;
    check_wal_level(client).await?;
    check_table(client, config).await?;
    if let Some(primary) = &primary {
        // SB3: the publication is the primary's to create; read on the standby once replayed.
        ensure_publication(primary, config).await?;
        crate::postgres::standby::replayed(client, primary).await?;
    }
    ensure_publication(client, config).await
}

pub use crate::postgres::standby::{in_recovery, standby_refused};

async fn check_wal_level(client: &Client) -> Result<()> {
    let row = client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(|e| sql_error("cannot read wal_level", e))?;
    let level: String = row.get(0);
    if level != "logical" {
        return Err(setup(format!(
            "wal_level is {level:?}, but logical replication needs wal_level = logical: run \
             ALTER SYSTEM SET wal_level = logical; and restart Postgres (on managed services, \
             enable logical replication in the instance's parameters)"
        )));
    }
    Ok(())
}

/// Why the outbox table was not found: the name as it was read (CFG5), and the table a
/// differently cased or quoted name would have named, when one exists.
async fn missing_table(client: &Client, table: &Table) -> String {
    let near = client
        .query(
            "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) \
               FROM pg_catalog.pg_class c \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE lower(n.nspname) = lower($1) AND lower(c.relname) = lower($2) \
                AND c.relkind IN ('r', 'p') \
              ORDER BY 1 LIMIT 3",
            &[&table.schema, &table.name],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let fix = match near.as_slice() {
        [] => "create it with sql/schema.sql, or point OUTBOX_RELAY_TABLE at your outbox table"
            .to_owned(),
        found => format!(
            "a table whose name differs only in case exists: set OUTBOX_RELAY_TABLE='{}' \
             (an unquoted name is folded to lower case, as in SQL; a name in double quotes keeps \
             its case)",
            found.join("' or '")
        ),
    };
    format!(
        "table {} (read as schema {:?}, table {:?}) does not exist (or has no columns, or this \
         role cannot see it): {fix}",
        table.sql(),
        table.schema,
        table.name
    )
}

/// Reads the table's columns and checks the ones the relay reads.
pub async fn check_table(client: &Client, config: &Config) -> Result<OutboxColumns> {
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::oid \
               FROM pg_catalog.pg_attribute a \
               JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p') \
                AND a.attnum > 0 AND NOT a.attisdropped \
              ORDER BY a.attnum",
            &[&config.table.schema, &config.table.name],
        )
        .await
        .map_err(|e| sql_error("cannot read the outbox table's columns", e))?;
    if rows.is_empty() {
        return Err(setup(missing_table(client, &config.table).await));
    }
    let columns: Vec<(String, u32)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, u32>(1)))
        .collect();
    OutboxColumns::resolve_mapped(
        &config.table.to_string(),
        &config.mapping,
        columns.iter().map(|(n, t)| (n.as_str(), *t)),
    )
    .map_err(|e| setup(e.to_string()))
}

/// The publication the relay creates: the table's inserts, partitions published as the
/// table (Postgres 13+; before that a partitioned table cannot be published at all).
fn create_publication_sql(publication: &str, table: &Table, via_root_supported: bool) -> String {
    let options = if via_root_supported {
        "publish = 'insert', publish_via_partition_root = true"
    } else {
        "publish = 'insert'"
    };
    format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH ({options})",
        quote_identifier(publication),
        table.sql()
    )
}

/// The first Postgres version with `publish_via_partition_root` (and published partitioned
/// tables).
const VIA_ROOT_VERSION: i32 = 130_000;
/// The first Postgres version with row filters, column lists and `TABLES IN SCHEMA`.
const PG15: i32 = 150_000;

pub(crate) async fn server_version(client: &Client) -> Result<i32> {
    let version: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .map_err(|e| sql_error("cannot read the server version", e))?
        .get(0);
    version.parse().map_err(|e| {
        permanent(format!(
            "server_version_num {version:?} is not a number: {e}"
        ))
    })
}

/// Checks the publication (creating it when missing and allowed) on every session start,
/// and returns what the decoder must know about the relations it publishes.
async fn ensure_publication(client: &Client, config: &Config) -> Result<KnownRelations> {
    let version = server_version(client).await?;
    let pg15 = version >= PG15;
    let (publication_oid, mut facts) = read_or_create_publication(client, config, version).await?;
    let (table_oid, is_partition) =
        read_table_facts(client, &config.table, publication_oid, pg15, &mut facts).await?;
    let mut known = KnownRelations {
        publication: config.publication.clone(),
        ..KnownRelations::default()
    };
    read_partitions(client, publication_oid, table_oid, &mut facts, &mut known).await?;
    if is_partition {
        facts.published_ancestor =
            read_published_ancestor(client, publication_oid, table_oid, &facts, pg15).await?;
    }
    // A preset's optional trace-context column is not required of a column list either.
    let optional = config
        .mapping
        .trace_context
        .as_ref()
        .filter(|t| !t.required);
    let read: Vec<&str> = config
        .mapping
        .read_columns()
        .into_iter()
        .filter(|c| optional.is_none_or(|t| t.column != *c))
        .collect();
    if let Some(refusal) = facts.refusal(&config.publication, &config.table, &read) {
        return Err(setup(refusal));
    }
    known.others = read_other_tables(client, &config.publication, table_oid, &known).await?;
    if facts.all_tables {
        info!(publication = %config.publication, "the publication publishes all tables: the walsender decodes every table's changes for the relay, which costs decoding work; the relay relays only the outbox table's inserts");
    } else if !known.others.is_empty() {
        info!(publication = %config.publication, other_tables = known.others.len(), "the publication also publishes other tables: the walsender decodes their changes for the relay too, which costs decoding work; the relay ignores them");
    }
    Ok(known)
}

/// The publication's oid and options, created first when missing and allowed
/// (`--no-create` forbids it).
async fn read_or_create_publication(
    client: &Client,
    config: &Config,
    version: i32,
) -> Result<(u32, PublicationFacts)> {
    let via_root_supported = version >= VIA_ROOT_VERSION;
    let select = format!(
        "SELECT p.oid, p.puballtables, p.pubinsert, p.pubupdate, p.pubdelete, {}, {} \
           FROM pg_catalog.pg_publication p WHERE p.pubname = $1",
        if version >= 110_000 {
            "p.pubtruncate"
        } else {
            "false"
        },
        if via_root_supported {
            "p.pubviaroot"
        } else {
            "NULL::bool"
        },
    );
    let mut row = client
        .query_opt(&select, &[&config.publication])
        .await
        .map_err(|e| sql_error("cannot read publications", e))?;
    if row.is_none() {
        let create = create_publication_sql(&config.publication, &config.table, via_root_supported);
        if !config.create {
            return Err(setup(format!(
                "publication {:?} does not exist and --no-create forbids creating it: run \
                 {create}; (see sql/publication.sql)",
                config.publication,
            )));
        }
        client
            .batch_execute(&create)
            .await
            .map_err(|e| sql_error("cannot create the publication", e))?;
        info!(publication = %config.publication, table = %config.table, "created publication");
        row = client
            .query_opt(&select, &[&config.publication])
            .await
            .map_err(|e| sql_error("cannot read the new publication", e))?;
    }
    let Some(row) = row else {
        return Err(RelayError::transient(anyhow::anyhow!(
            "publication {:?} vanished right after it was created",
            config.publication
        )));
    };
    let facts = PublicationFacts {
        all_tables: row.get(1),
        insert: row.get(2),
        update: row.get(3),
        delete: row.get(4),
        truncate: row.get(5),
        via_root: row.get(6),
        ..PublicationFacts::default()
    };
    Ok((row.get(0), facts))
}

/// The outbox table as the publication sees it (listed, by schema, row filter, column
/// list) into `facts`; returns the table's oid and whether it is itself a partition.
async fn read_table_facts(
    client: &Client,
    table: &Table,
    publication_oid: u32,
    pg15: bool,
    facts: &mut PublicationFacts,
) -> Result<(u32, bool)> {
    let table_query = format!(
        "SELECT c.oid, c.relkind = 'p', c.relispartition, pr.prrelid IS NOT NULL, {}, {}, {} \
           FROM pg_catalog.pg_class c \
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
           LEFT JOIN pg_catalog.pg_publication_rel pr ON pr.prrelid = c.oid AND pr.prpubid = $1 \
          WHERE n.nspname = $2 AND c.relname = $3 AND c.relkind IN ('r', 'p')",
        if pg15 {
            "EXISTS (SELECT 1 FROM pg_catalog.pg_publication_namespace pn \
                      WHERE pn.pnpubid = $1 AND pn.pnnspid = c.relnamespace)"
        } else {
            "false"
        },
        if pg15 {
            "pg_catalog.pg_get_expr(pr.prqual, pr.prrelid)"
        } else {
            "NULL::text"
        },
        if pg15 {
            "(SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_attribute a \
               WHERE a.attrelid = c.oid AND a.attnum = ANY (pr.prattrs))"
        } else {
            "NULL::text[]"
        },
    );
    let table = client
        .query_opt(
            &table_query,
            &[&publication_oid, &table.schema, &table.name],
        )
        .await
        .map_err(|e| sql_error("cannot read the publication's tables", e))?
        .ok_or_else(|| {
            RelayError::transient(anyhow::anyhow!(
                "table {} vanished while the relay checked it",
                table
            ))
        })?;
    facts.partitioned = table.get(1);
    facts.listed = table.get(3);
    facts.schema_listed = table.get(4);
    facts.row_filter = table.get(5);
    facts.columns = table.get(6);
    Ok((table.get(0), table.get(2)))
}

/// The table's partitions at any level into `known`, and those the publication lists
/// into `facts`.
async fn read_partitions(
    client: &Client,
    publication_oid: u32,
    table_oid: u32,
    facts: &mut PublicationFacts,
    known: &mut KnownRelations,
) -> Result<()> {
    let partitions = client
        .query(
            "WITH RECURSIVE parts(oid) AS ( \
                 SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhparent = $2 \
                 UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN parts ON i.inhparent = parts.oid) \
             SELECT c.oid, pg_catalog.format('%I.%I', n.nspname, c.relname), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel pr \
                             WHERE pr.prpubid = $1 AND pr.prrelid = c.oid) \
               FROM parts JOIN pg_catalog.pg_class c ON c.oid = parts.oid \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE c.relispartition ORDER BY 2",
            &[&publication_oid, &table_oid],
        )
        .await
        .map_err(|e| sql_error("cannot read the outbox table's partitions", e))?;
    for partition in &partitions {
        known.partitions.insert(partition.get(0));
        if partition.get::<_, bool>(2) {
            facts.listed_partitions.push(partition.get(1));
        }
    }
    Ok(())
}

/// The table is itself a partition: an ancestor the publication publishes would publish
/// the table's inserts as its own (with publish_via_partition_root). Its name, if any.
async fn read_published_ancestor(
    client: &Client,
    publication_oid: u32,
    table_oid: u32,
    facts: &PublicationFacts,
    pg15: bool,
) -> Result<Option<String>> {
    let ancestor = client
        .query_opt(
            &format!(
                "WITH RECURSIVE up(oid, child) AS ( \
                     SELECT i.inhparent, i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhrelid = $2 \
                     UNION SELECT i.inhparent, i.inhrelid FROM pg_catalog.pg_inherits i JOIN up ON i.inhrelid = up.oid) \
                 SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) \
                   FROM up JOIN pg_catalog.pg_class c ON c.oid = up.oid \
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                  WHERE $3 OR EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel pr \
                                       WHERE pr.prpubid = $1 AND pr.prrelid = c.oid) {} \
                  LIMIT 1",
                if pg15 {
                    "OR EXISTS (SELECT 1 FROM pg_catalog.pg_publication_namespace pn \
                                 WHERE pn.pnpubid = $1 AND pn.pnnspid = c.relnamespace)"
                } else {
                    ""
                }
            ),
            &[&publication_oid, &table_oid, &facts.all_tables],
        )
        .await
        .map_err(|e| sql_error("cannot read the outbox table's ancestors", e))?;
    Ok(ancestor.map(|row| row.get(0)))
}

/// What else the publication publishes (with their partitions): the decoder ignores their
/// inserts (D2, D6), but the walsender decodes their changes all the same.
async fn read_other_tables(
    client: &Client,
    publication: &str,
    table_oid: u32,
    known: &KnownRelations,
) -> Result<std::collections::HashSet<u32>> {
    let published = client
        .query(
            "WITH RECURSIVE pub(oid) AS ( \
                 SELECT c.oid FROM pg_catalog.pg_publication_tables pt \
                   JOIN pg_catalog.pg_namespace n ON n.nspname = pt.schemaname \
                   JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
                  WHERE pt.pubname = $1 \
                 UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN pub ON i.inhparent = pub.oid) \
             SELECT oid FROM pub",
            &[&publication],
        )
        .await
        .map_err(|e| sql_error("cannot read the publication's tables", e))?;
    Ok(published
        .iter()
        .map(|row| row.get::<_, u32>(0))
        .filter(|oid| *oid != table_oid && !known.partitions.contains(oid))
        .collect())
}

/// What the catalog says about a publication and the outbox table, for [`Self::refusal`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicationFacts {
    /// `publish` includes `insert`.
    pub insert: bool,
    /// `publish` includes `update`.
    pub update: bool,
    /// `publish` includes `delete`.
    pub delete: bool,
    /// `publish` includes `truncate`.
    pub truncate: bool,
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// `publish_via_partition_root`; `None` before Postgres 13, which lacks it.
    pub via_root: Option<bool>,
    /// The outbox table is partitioned.
    pub partitioned: bool,
    /// The publication lists the table itself (`FOR TABLE`).
    pub listed: bool,
    /// The publication lists the table's schema (`FOR TABLES IN SCHEMA`).
    pub schema_listed: bool,
    /// The table's row filter in the publication.
    pub row_filter: Option<String>,
    /// The table's column list in the publication (`None`: every column).
    pub columns: Option<Vec<String>>,
    /// Partitions of the table the publication lists, as SQL names.
    pub listed_partitions: Vec<String>,
    /// An ancestor the publication publishes, when the table is itself a partition.
    pub published_ancestor: Option<String>,
}

/// How to fix one problem.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fix {
    /// SQL statements, each ending in `;`.
    Sql(String),
    /// Something else to do.
    Do(String),
}

/// What [`PublicationFacts::refusal`] found: each problem in the catalog's words, the fixes
/// in order, and whether the problems hid inserts already.
#[derive(Debug, Default)]
struct Findings {
    problems: Vec<String>,
    fixes: Vec<Fix>,
    hid_rows: bool,
}

impl PublicationFacts {
    /// Why the publication would hide an outbox insert from the relay, with the exact fix;
    /// `None` when it hides none (whatever else it publishes).
    pub fn refusal(&self, publication: &str, table: &Table, read: &[&str]) -> Option<String> {
        let alter = format!("ALTER PUBLICATION {}", quote_identifier(publication));
        let table_sql = table.sql();
        let mut found = Findings::default();
        self.check_inserts(&alter, &mut found);
        self.check_listed(table, &alter, table_sql, &mut found);
        self.check_partition_root(table, &alter, &mut found);
        self.check_filter_and_columns(table, read, &alter, table_sql, &mut found);
        self.check_ancestor(table, &mut found);
        if found.problems.is_empty() {
            return None;
        }
        Some(found.message(publication, table))
    }

    /// The publication must publish inserts.
    fn check_inserts(&self, alter: &str, found: &mut Findings) {
        if self.insert {
            return;
        }
        let actions: Vec<&str> = [
            (true, "insert"),
            (self.update, "update"),
            (self.delete, "delete"),
            (self.truncate, "truncate"),
        ]
        .iter()
        .filter_map(|(on, action)| on.then_some(*action))
        .collect();
        found.problems.push(format!(
            "does not publish inserts (publish = '{}')",
            actions[1..].join(", ")
        ));
        found.fixes.push(Fix::Sql(format!(
            "{alter} SET (publish = '{}');",
            actions.join(", ")
        )));
        found.hid_rows = true;
    }

    /// The publication must publish the table itself (not only some of its partitions).
    fn check_listed(&self, table: &TableName, alter: &str, table_sql: &str, found: &mut Findings) {
        if self.all_tables || self.listed || self.schema_listed {
            return;
        }
        if self.listed_partitions.is_empty() {
            found.problems.push(format!("does not publish {table}"));
        } else {
            found.problems.push(format!(
                "publishes only partitions of {table} ({}), not the table itself, so their \
                 inserts arrive under the partitions' names and partitions added later are \
                 not published",
                self.listed_partitions.join(", ")
            ));
        }
        found
            .fixes
            .push(Fix::Sql(format!("{alter} ADD TABLE {table_sql};")));
        // A table dropped and created again, or swapped in by rename, is no longer the
        // table the publication names: its inserts so far were hidden (issue 18).
        found.hid_rows = true;
    }

    /// A partitioned table's inserts must arrive under its own name.
    fn check_partition_root(&self, table: &TableName, alter: &str, found: &mut Findings) {
        if !self.partitioned || self.via_root == Some(true) {
            return;
        }
        if self.via_root.is_none() {
            found.problems.push(format!(
                "cannot publish the partitioned table {table} before Postgres 13"
            ));
            found.fixes.push(Fix::Do(
                "upgrade Postgres to 13 or later, or use an unpartitioned outbox table".to_owned(),
            ));
        } else {
            found.problems.push(format!(
                "publishes the inserts into {table}'s partitions under each partition's \
                 name, not the table's (publish_via_partition_root is off)"
            ));
            found.fixes.push(Fix::Sql(format!(
                "{alter} SET (publish_via_partition_root = true);"
            )));
        }
    }

    /// Every row, with every column the relay reads: no row filter, no column list without
    /// them.
    fn check_filter_and_columns(
        &self,
        table: &TableName,
        read: &[&str],
        alter: &str,
        table_sql: &str,
        found: &mut Findings,
    ) {
        let mut relist = false;
        if let Some(filter) = &self.row_filter {
            found.problems.push(format!(
                "publishes only the rows of {table} that match the row filter WHERE {filter}"
            ));
            relist = true;
            found.hid_rows = true;
        }
        if let Some(columns) = &self.columns {
            let missing: Vec<&str> = read
                .iter()
                .copied()
                .filter(|name| !columns.iter().any(|c| c == name))
                .collect();
            if !missing.is_empty() {
                found.problems.push(format!(
                    "publishes only the columns {} of {table}, without {}, which the relay reads",
                    columns.join(", "),
                    missing.join(", ")
                ));
                relist = true;
            }
        }
        if relist {
            // Re-adding the table drops its row filter and column list, in one transaction
            // so that no insert slips between the two.
            found.fixes.push(Fix::Sql(format!(
                "BEGIN; {alter} DROP TABLE {table_sql}; {alter} ADD TABLE {table_sql}; COMMIT;"
            )));
        }
    }

    /// A published ancestor (with publish_via_partition_root) takes the table's inserts as
    /// its own.
    fn check_ancestor(&self, table: &TableName, found: &mut Findings) {
        if let (Some(ancestor), Some(true)) = (&self.published_ancestor, self.via_root) {
            found.problems.push(format!(
                "publishes the inserts into {table} as those of its ancestor {ancestor} \
                 (publish_via_partition_root)"
            ));
            found.fixes.push(Fix::Do(format!(
                "set OUTBOX_RELAY_TABLE to {ancestor}, or use a publication that does not \
                 publish {ancestor}"
            )));
        }
    }
}

impl Findings {
    /// The refusal: the problems, the SQL fixes in one `run`, the other fixes, and when rows
    /// were hidden already, how to find and publish them.
    fn message(&self, publication: &str, table: &TableName) -> String {
        let sql: Vec<&str> = self
            .fixes
            .iter()
            .filter_map(|fix| match fix {
                Fix::Sql(sql) => Some(sql.as_str()),
                Fix::Do(_) => None,
            })
            .collect();
        let other = self.fixes.iter().filter_map(|fix| match fix {
            Fix::Do(text) => Some(text.as_str()),
            Fix::Sql(_) => None,
        });
        let mut todo = Vec::new();
        if !sql.is_empty() {
            todo.push(format!("run {}", sql.join(" ")));
        }
        todo.extend(other.map(str::to_owned));
        let mut message = format!(
            "publication {publication:?} would hide inserts into {table} from the relay: it {}. \
             To fix it, {} (or choose another OUTBOX_RELAY_PUBLICATION)",
            self.problems.join("; it "),
            todo.join(", and ")
        );
        if self.hid_rows {
            message.push_str(
                ". Postgres decodes each transaction with the publication as it was at the \
             commit, so inserts it hid before the fix stay hidden (a table dropped and \
             created again, or swapped in by rename, is not the table the publication \
             named): run the fix in a transaction that first holds inserts back (LOCK \
             TABLE … IN SHARE MODE) and last reads SELECT max(id), then, before the relay \
             starts, `outbox-relay verify` lists the rows missing from the stream and \
             `outbox-relay backfill --from-id <the first of them> --to-id <that max>` (with \
             --force on a strict stream) publishes those the publication hid \
             (docs/operations.md)",
            );
        }
        message
    }
}

/// The first `server_version_num` with fail-over slots (`--failover-slot`).
const FAILOVER_VERSION: i32 = 170_000;

/// `--failover-slot` on a server older than 17 is refused before anything is created (PG1),
/// whoever creates the slot (this module, or a backfill's replication connection).
pub async fn check_failover_support(client: &Client, config: &Config) -> Result<()> {
    failover_supported(config.failover_slot, server_version(client).await?)
}

fn failover_supported(failover_slot: bool, version: i32) -> Result<()> {
    if failover_slot && version < FAILOVER_VERSION {
        return Err(setup(format!(
            "--failover-slot needs Postgres 17 or newer, and this server is {}.{}: fail-over \
             slots (synchronized to a standby) came with 17. Upgrade, then set \
             synchronized_standby_slots on the primary and sync_replication_slots = on (with \
             hot_standby_feedback = on and primary_slot_name) on the standby; or run without \
             --failover-slot (after a fail-over the slot is then missing on the new primary)",
            version / 10000,
            version % 10000
        )));
    }
    Ok(())
}

async fn ensure_slot(client: &Client, config: &Config) -> Result<Lsn> {
    let version = server_version(client).await?;
    failover_supported(config.failover_slot, version)?;
    let row = read_or_create_slot(client, config, version).await?;
    let current_db: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map_err(|e| sql_error("cannot read the current database", e))?
        .get(0);
    judge_slot(config, &row, &current_db)
}

/// The slot's row of `pg_replication_slots` (plugin, type, database, confirmed flush LSN,
/// fail-over), the slot created first when missing and allowed (`--no-create` forbids it).
async fn read_or_create_slot(
    client: &Client,
    config: &Config,
    version: i32,
) -> Result<tokio_postgres::Row> {
    let failover_column = if version >= FAILOVER_VERSION {
        "failover"
    } else {
        "false"
    };
    let query = format!(
        "SELECT plugin::text, slot_type::text, database::text, confirmed_flush_lsn::text, \
                {failover_column} FROM pg_catalog.pg_replication_slots WHERE slot_name = $1"
    );
    let query = query.as_str();
    let row = client
        .query_opt(query, &[&config.slot])
        .await
        .map_err(|e| sql_error("cannot read replication slots", e))?;
    Ok(match row {
        Some(row) => row,
        None if !config.create => {
            return Err(setup(format!(
                "replication slot {:?} does not exist and --no-create forbids creating it: run \
                 SELECT pg_create_logical_replication_slot({}, 'pgoutput'); (events committed \
                 before the slot exists are not relayed)",
                config.slot,
                quote_literal(&config.slot)
            )))
        }
        None => {
            // SB4: on a standby the creation waits for the primary's next standby snapshot.
            let _nudge = crate::postgres::standby::Nudge::start(config);
            // PG 17: (name, plugin, temporary, twophase, failover).
            let create = if config.failover_slot {
                "SELECT pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
            } else {
                "SELECT pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')"
            };
            client
                .query_one(create, &[&config.slot])
                .await
                .map_err(|e| {
                    sql_error(
                        "cannot create the replication slot (the role needs REPLICATION)",
                        e,
                    )
                })?;
            info!(slot = %config.slot, failover = config.failover_slot, "created logical replication slot");
            client
                .query_one(query, &[&config.slot])
                .await
                .map_err(|e| sql_error("cannot read the new slot", e))?
        }
    })
}

/// The slot found, judged: a logical pgoutput slot of `current_db` (else refused), a
/// warning when `--failover-slot` is on and it is not a fail-over slot; its confirmed
/// flush LSN.
fn judge_slot(config: &Config, row: &tokio_postgres::Row, current_db: &str) -> Result<Lsn> {
    let plugin: Option<String> = row.get(0);
    let slot_type: Option<String> = row.get(1);
    let database: Option<String> = row.get(2);
    let confirmed: Option<String> = row.get(3);
    let failover: Option<bool> = row.get(4);
    if config.failover_slot && failover != Some(true) {
        warn!(
            slot = %config.slot,
            "--failover-slot is on but the existing slot is not a fail-over slot, so a standby \
             does not keep it: run ALTER_REPLICATION_SLOT {} (FAILOVER true) on a replication \
             connection (psql \"dbname=... replication=database\"), or drop the slot and let the \
             relay recreate it (events committed meanwhile are not relayed: see \
             docs/operations.md)",
            quote_identifier(&config.slot)
        );
    }
    if slot_type.as_deref() != Some("logical") || plugin.as_deref() != Some("pgoutput") {
        return Err(setup(format!(
            "replication slot {:?} is a {} slot with plugin {}, not a logical pgoutput slot: drop \
             it or choose another OUTBOX_RELAY_SLOT",
            config.slot,
            slot_type.unwrap_or_default(),
            plugin.unwrap_or_else(|| "none".into())
        )));
    }
    if database.as_deref() != Some(current_db) {
        return Err(setup(format!(
            "replication slot {:?} belongs to database {:?}, not {current_db:?}: choose another OUTBOX_RELAY_SLOT",
            config.slot,
            database.unwrap_or_default()
        )));
    }
    confirmed
        .as_deref()
        .unwrap_or("0/0")
        .parse::<Lsn>()
        .map_err(|e| permanent(format!("slot {:?}: {e}", config.slot)))
}

#[cfg(test)]
mod tests {
    use super::{create_publication_sql, PublicationFacts};
    use crate::config::{Table, TableName};

    fn outbox() -> Table {
        Table::new(TableName {
            schema: "public".into(),
            name: "outbox_events".into(),
        })
    }

    /// A publication `FOR TABLE public.outbox_events WITH (publish = 'insert')`.
    fn good() -> PublicationFacts {
        PublicationFacts {
            insert: true,
            listed: true,
            via_root: Some(false),
            ..PublicationFacts::default()
        }
    }

    fn refusal(facts: &PublicationFacts) -> String {
        facts
            .refusal("p", &outbox(), SEED_COLUMNS)
            .expect("the publication is refused")
    }

    const SEED_COLUMNS: &[&str] = &["id", "entity_id", "event_type", "payload", "created_at"];

    const RELIST: &str = "run BEGIN; ALTER PUBLICATION \"p\" DROP TABLE \"public\".\"outbox_events\"; \
                          ALTER PUBLICATION \"p\" ADD TABLE \"public\".\"outbox_events\"; COMMIT; (or";

    #[test]
    fn the_relay_creates_a_publication_of_inserts_that_publishes_partitions_as_the_table() {
        assert_eq!(
            create_publication_sql("outbox_relay", &outbox(), true),
            "CREATE PUBLICATION \"outbox_relay\" FOR TABLE \"public\".\"outbox_events\" \
             WITH (publish = 'insert', publish_via_partition_root = true)"
        );
        assert_eq!(
            create_publication_sql("we\"ird", &outbox(), false),
            "CREATE PUBLICATION \"we\"\"ird\" FOR TABLE \"public\".\"outbox_events\" WITH (publish = 'insert')"
        );
    }

    #[test]
    fn publications_that_hide_no_insert_are_accepted() {
        let accepted = [
            good(),
            PublicationFacts {
                partitioned: true,
                via_root: Some(true),
                listed_partitions: vec!["\"public\".\"outbox_events_a\"".into()],
                ..good()
            },
            PublicationFacts {
                listed: false,
                all_tables: true,
                update: true,
                ..good()
            },
            PublicationFacts {
                listed: false,
                schema_listed: true,
                ..good()
            },
            PublicationFacts {
                columns: Some(
                    ["id", "entity_id", "event_type", "payload", "created_at"]
                        .map(String::from)
                        .to_vec(),
                ),
                ..good()
            },
            // Before Postgres 13, without the option, an unpartitioned table is fine.
            PublicationFacts {
                via_root: None,
                ..good()
            },
            // An ancestor published without publish_via_partition_root publishes the
            // table's inserts under the table's (or its partitions') names.
            PublicationFacts {
                published_ancestor: Some("\"public\".\"all_events\"".into()),
                ..good()
            },
        ];
        for facts in accepted {
            assert_eq!(
                facts.refusal("p", &outbox(), SEED_COLUMNS),
                None,
                "{facts:?}"
            );
        }
    }

    #[test]
    fn a_publication_without_inserts_is_refused_keeping_its_other_actions() {
        let message = refusal(&PublicationFacts {
            insert: false,
            update: true,
            delete: true,
            ..good()
        });
        assert!(
            message.starts_with(
                "publication \"p\" would hide inserts into public.outbox_events from the relay: \
                 it does not publish inserts (publish = 'update, delete'). To fix it, run \
                 ALTER PUBLICATION \"p\" SET (publish = 'insert, update, delete'); (or choose \
                 another OUTBOX_RELAY_PUBLICATION). Postgres decodes each transaction"
            ),
            "{message}"
        );
    }

    #[test]
    fn a_partitioned_table_without_publish_via_partition_root_is_refused() {
        let message = refusal(&PublicationFacts {
            partitioned: true,
            ..good()
        });
        assert!(
            message.contains("under each partition's name")
                && message.contains(
                    "To fix it, run ALTER PUBLICATION \"p\" SET (publish_via_partition_root = true); (or"
                ),
            "{message}"
        );
        let message = refusal(&PublicationFacts {
            partitioned: true,
            via_root: None,
            ..good()
        });
        assert!(message.contains("upgrade Postgres to 13"), "{message}");
    }

    #[test]
    fn a_publication_of_partitions_only_is_refused_naming_them() {
        let message = refusal(&PublicationFacts {
            partitioned: true,
            listed: false,
            via_root: Some(true),
            listed_partitions: vec![
                "\"public\".\"outbox_events_a\"".into(),
                "\"public\".\"outbox_events_b\"".into(),
            ],
            ..good()
        });
        assert!(
            message.contains(
                "it publishes only partitions of public.outbox_events (\"public\".\"outbox_events_a\", \
                 \"public\".\"outbox_events_b\"), not the table itself"
            ) && message.contains(
                "To fix it, run ALTER PUBLICATION \"p\" ADD TABLE \"public\".\"outbox_events\"; (or"
            ),
            "{message}"
        );
        // Without the option as well: both fixes, in an order that works.
        let message = refusal(&PublicationFacts {
            partitioned: true,
            listed: false,
            listed_partitions: vec!["\"public\".\"outbox_events_a\"".into()],
            ..good()
        });
        assert!(
            message.contains(
                "run ALTER PUBLICATION \"p\" ADD TABLE \"public\".\"outbox_events\"; \
                 ALTER PUBLICATION \"p\" SET (publish_via_partition_root = true); (or"
            ),
            "{message}"
        );
        let message = refusal(&PublicationFacts {
            listed: false,
            ..good()
        });
        assert!(
            message.contains("it does not publish public.outbox_events."),
            "{message}"
        );
    }

    #[test]
    fn row_filters_and_column_lists_that_hide_a_read_column_are_refused_with_one_relist() {
        let message = refusal(&PublicationFacts {
            row_filter: Some("(event_type <> 'Hidden'::text)".into()),
            ..good()
        });
        assert!(
            message.contains("row filter WHERE (event_type <> 'Hidden'::text)")
                && message.contains(RELIST)
                && message.contains("stay hidden"),
            "{message}"
        );
        let message = refusal(&PublicationFacts {
            columns: Some(
                ["id", "entity_id", "event_type", "created_at", "status"]
                    .map(String::from)
                    .to_vec(),
            ),
            ..good()
        });
        assert!(
            message.contains(
                "only the columns id, entity_id, event_type, created_at, status of \
                 public.outbox_events, without payload, which the relay reads"
            ) && message.contains(RELIST),
            "{message}"
        );
        let message = refusal(&PublicationFacts {
            row_filter: Some("(true)".into()),
            columns: Some(vec!["id".into()]),
            ..good()
        });
        assert_eq!(message.matches("BEGIN;").count(), 1, "{message}");
        assert!(
            message.contains("without entity_id, event_type, payload, created_at"),
            "{message}"
        );
    }

    #[test]
    fn a_table_published_as_its_ancestor_is_refused() {
        let message = refusal(&PublicationFacts {
            via_root: Some(true),
            published_ancestor: Some("\"public\".\"all_events\"".into()),
            ..good()
        });
        assert!(
            message.contains("as those of its ancestor \"public\".\"all_events\"")
                && message.contains("set OUTBOX_RELAY_TABLE to \"public\".\"all_events\""),
            "{message}"
        );
    }
}
