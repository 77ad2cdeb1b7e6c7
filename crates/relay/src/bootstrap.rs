//! Start-up checks and setup: everything that must hold before streaming can be correct.
//!
//! Checked every start: `wal_level = logical`; the outbox table exists with the columns the
//! relay reads in usable types; the publication publishes the table's inserts; the slot is a
//! pgoutput slot of this database; the stream's subjects cover `{prefix}.>`.
//! Created when missing, unless `--no-create`: the publication (`FOR TABLE … WITH (publish =
//! 'insert')`), the slot, and the stream (file storage, the configured duplicate window).
//!
//! # Invariants
//! - B1 Nothing is created when a check fails: a wrong setup is reported, not patched over.
//! - B2 Every failure is permanent and its message names the setting, object or column and
//!   how to fix it; connection failures stay transient.

use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use outbox::OutboxColumns;
use pgoutput::Lsn;
use replication::{quote_identifier, quote_literal};
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::config::Config;
use crate::error::{RelayError, Result};

/// What start-up learned about the slot.
#[derive(Debug, Clone, Copy)]
pub struct SlotState {
    /// The slot's `confirmed_flush_lsn`: where streaming resumes.
    pub confirmed_flush_lsn: Lsn,
}

fn permanent(message: String) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(message))
}

fn sql_error(what: &str, error: tokio_postgres::Error) -> RelayError {
    let transient = match error.code() {
        Some(code) => replication::sqlstate_is_transient(code.code()),
        None => true,
    };
    let db = error.as_db_error().map(|db| {
        let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
        if let Some(hint) = db.hint() {
            text.push_str(&format!("; hint: {hint}"));
        }
        text
    });
    let mut message = format!("{what}: {}", db.unwrap_or_else(|| error.to_string()));
    if let Some(fix) = error
        .code()
        .and_then(|code| privilege_fix(what, code.code()))
    {
        message.push_str("; ");
        message.push_str(fix);
    }
    if transient {
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
    check_wal_level(client).await?;
    check_table(client, config).await?;
    ensure_publication(client, config).await?;
    ensure_slot(client, config).await
}

async fn check_wal_level(client: &Client) -> Result<()> {
    let row = client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(|e| sql_error("cannot read wal_level", e))?;
    let level: String = row.get(0);
    if level != "logical" {
        return Err(permanent(format!(
            "wal_level is {level:?}, but logical replication needs wal_level = logical: run \
             ALTER SYSTEM SET wal_level = logical; and restart Postgres (on managed services, \
             enable logical replication in the instance's parameters)"
        )));
    }
    Ok(())
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
        return Err(permanent(format!(
            "table {} does not exist (or has no columns, or this role cannot see it): create it \
             with sql/schema.sql, or point OUTBOX_RELAY_TABLE at your outbox table",
            config.table
        )));
    }
    let columns: Vec<(String, u32)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, u32>(1)))
        .collect();
    OutboxColumns::resolve(
        &config.table.to_string(),
        columns.iter().map(|(n, t)| (n.as_str(), *t)),
    )
    .map_err(|e| permanent(e.to_string()))
}

async fn ensure_publication(client: &Client, config: &Config) -> Result<()> {
    let publication = client
        .query_opt(
            "SELECT pubinsert FROM pg_catalog.pg_publication WHERE pubname = $1",
            &[&config.publication],
        )
        .await
        .map_err(|e| sql_error("cannot read publications", e))?;
    let table_sql = format!(
        "{}.{}",
        quote_identifier(&config.table.schema),
        quote_identifier(&config.table.name)
    );
    let Some(publication) = publication else {
        if !config.create {
            return Err(permanent(format!(
                "publication {:?} does not exist and --no-create forbids creating it: run \
                 CREATE PUBLICATION {} FOR TABLE {table_sql} WITH (publish = 'insert'); (see sql/publication.sql)",
                config.publication,
                quote_identifier(&config.publication)
            )));
        }
        let sql = format!(
            "CREATE PUBLICATION {} FOR TABLE {table_sql} WITH (publish = 'insert')",
            quote_identifier(&config.publication)
        );
        client
            .batch_execute(&sql)
            .await
            .map_err(|e| sql_error("cannot create the publication", e))?;
        info!(publication = %config.publication, table = %config.table, "created publication");
        return Ok(());
    };
    let publishes_inserts: bool = publication.get(0);
    let includes_table = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[&config.publication, &config.table.schema, &config.table.name],
        )
        .await
        .map_err(|e| sql_error("cannot read the publication's tables", e))?
        .is_some();
    if !includes_table || !publishes_inserts {
        return Err(permanent(format!(
            "publication {:?} exists but does not publish inserts of {}: run ALTER PUBLICATION {} \
             ADD TABLE {table_sql}; and ALTER PUBLICATION {} SET (publish = 'insert');, or choose \
             another OUTBOX_RELAY_PUBLICATION",
            config.publication,
            config.table,
            quote_identifier(&config.publication),
            quote_identifier(&config.publication)
        )));
    }
    Ok(())
}

async fn ensure_slot(client: &Client, config: &Config) -> Result<SlotState> {
    let query = "SELECT plugin::text, slot_type::text, database::text, confirmed_flush_lsn::text \
                   FROM pg_catalog.pg_replication_slots WHERE slot_name = $1";
    let row = client
        .query_opt(query, &[&config.slot])
        .await
        .map_err(|e| sql_error("cannot read replication slots", e))?;
    let row = match row {
        Some(row) => row,
        None if !config.create => {
            return Err(permanent(format!(
                "replication slot {:?} does not exist and --no-create forbids creating it: run \
                 SELECT pg_create_logical_replication_slot({}, 'pgoutput'); (events committed \
                 before the slot exists are not relayed)",
                config.slot,
                quote_literal(&config.slot)
            )))
        }
        None => {
            client
                .query_one(
                    "SELECT pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&config.slot],
                )
                .await
                .map_err(|e| {
                    sql_error(
                        "cannot create the replication slot (the role needs REPLICATION)",
                        e,
                    )
                })?;
            info!(slot = %config.slot, "created logical replication slot");
            client
                .query_one(query, &[&config.slot])
                .await
                .map_err(|e| sql_error("cannot read the new slot", e))?
        }
    };
    let plugin: Option<String> = row.get(0);
    let slot_type: Option<String> = row.get(1);
    let database: Option<String> = row.get(2);
    let confirmed: Option<String> = row.get(3);
    let current_db: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map_err(|e| sql_error("cannot read the current database", e))?
        .get(0);
    if slot_type.as_deref() != Some("logical") || plugin.as_deref() != Some("pgoutput") {
        return Err(permanent(format!(
            "replication slot {:?} is a {} slot with plugin {}, not a logical pgoutput slot: drop \
             it or choose another OUTBOX_RELAY_SLOT",
            config.slot,
            slot_type.unwrap_or_default(),
            plugin.unwrap_or_else(|| "none".into())
        )));
    }
    if database.as_deref() != Some(current_db.as_str()) {
        return Err(permanent(format!(
            "replication slot {:?} belongs to database {:?}, not {current_db:?}: choose another OUTBOX_RELAY_SLOT",
            config.slot,
            database.unwrap_or_default()
        )));
    }
    let confirmed_flush_lsn = confirmed
        .as_deref()
        .unwrap_or("0/0")
        .parse::<Lsn>()
        .map_err(|e| permanent(format!("slot {:?}: {e}", config.slot)))?;
    Ok(SlotState {
        confirmed_flush_lsn,
    })
}

/// Checks the stream, or creates it when missing (and allowed).
pub async fn stream(jetstream: &jetstream::Context, config: &Config) -> Result<()> {
    let ours = format!("{}.>", config.subject_prefix);
    match jetstream.get_stream(&config.stream).await {
        Ok(mut stream) => {
            let info = stream.info().await.map_err(|e| {
                RelayError::transient(anyhow::anyhow!("cannot read stream {}: {e}", config.stream))
            })?;
            let covered = info
                .config
                .subjects
                .iter()
                .any(|filter| subject_filter_covers(filter, &ours));
            if !covered {
                return Err(permanent(format!(
                    "stream {} exists but its subjects {:?} do not cover {ours}: add {ours} to the \
                     stream's subjects, or choose another OUTBOX_RELAY_STREAM or OUTBOX_RELAY_SUBJECT_PREFIX",
                    config.stream, info.config.subjects
                )));
            }
            if info.config.duplicate_window != config.duplicate_window {
                warn!(
                    stream = %config.stream,
                    duplicate_window = ?info.config.duplicate_window,
                    configured = ?config.duplicate_window,
                    "the existing stream's duplicate window differs from OUTBOX_RELAY_DUPLICATE_WINDOW; the stream's own applies"
                );
            }
            Ok(())
        }
        Err(error)
            if matches!(
                error.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(_)
            ) =>
        {
            if !config.create {
                return Err(permanent(format!(
                    "stream {} does not exist and --no-create forbids creating it ({error})",
                    config.stream
                )));
            }
            jetstream
                .create_stream(StreamConfig {
                    name: config.stream.clone(),
                    subjects: vec![ours.clone()],
                    storage: StorageType::File,
                    duplicate_window: config.duplicate_window,
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    RelayError::transient(anyhow::anyhow!(
                        "cannot create stream {}: {e}",
                        config.stream
                    ))
                })?;
            info!(stream = %config.stream, subjects = %ours, duplicate_window = ?config.duplicate_window, "created stream");
            Ok(())
        }
        Err(error) => Err(RelayError::transient(anyhow::anyhow!(
            "cannot look up stream {}: {error}",
            config.stream
        ))),
    }
}

/// Whether every subject matching `pattern` (e.g. `outbox.>`) also matches `filter`.
pub fn subject_filter_covers(filter: &str, pattern: &str) -> bool {
    let filter: Vec<&str> = filter.split('.').collect();
    let pattern: Vec<&str> = pattern.split('.').collect();
    for (i, f) in filter.iter().enumerate() {
        if *f == ">" {
            // `>` matches one or more tokens; the pattern must have at least one left.
            return pattern.len() > i;
        }
        let Some(p) = pattern.get(i) else {
            return false;
        };
        match (*f, *p) {
            ("*", ">") => return false,
            ("*", _) => {}
            (f, p) if f == p => {}
            _ => return false,
        }
    }
    filter.len() == pattern.len()
}

#[cfg(test)]
mod tests {
    use super::subject_filter_covers as covers;

    #[test]
    fn subject_coverage() {
        assert!(covers("outbox.>", "outbox.>"));
        assert!(covers(">", "outbox.>"));
        assert!(covers("*.>", "outbox.>"));
        assert!(!covers("outbox.*", "outbox.>"));
        assert!(!covers("outbox.1.>", "outbox.>"));
        assert!(!covers("other.>", "outbox.>"));
        assert!(covers("app.>", "app.outbox.>"));
        assert!(!covers("app.outbox", "app.outbox.>"));
    }
}
