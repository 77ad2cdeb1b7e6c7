//! Start-up checks and setup: everything that must hold before streaming can be correct.
//!
//! Checked every start: `wal_level = logical`; the outbox table exists with the columns the
//! relay reads in usable types; the publication publishes the table's inserts; the slot is a
//! pgoutput slot of this database; the stream's subjects cover `{prefix}.>`.
//! Created when missing, unless `--no-create`: the publication (`FOR TABLE … WITH (publish =
//! 'insert')`), the slot, and the stream (the configured duplicate window and `stream_*`
//! settings: replicas, storage, `max_age`, `max_bytes`, `max_msg_size`, discard policy).
//!
//! # Invariants
//! - B1 Nothing is created when a check fails: a wrong setup is reported, not patched over.
//! - B2 Every failure is permanent and its message names the setting, object or column and
//!   how to fix it; connection failures stay transient.
//! - B3 The stream is never changed once it exists; what its settings mean for the events is
//!   said at every start ([`check_stream`]): subjects that do not cover `{prefix}.>` stop the
//!   relay; memory storage, a retention that deletes events no consumer has read (`max_age`,
//!   `max_bytes`/`max_msgs` with discard old, interest or work-queue retention), a
//!   `discard: new` limit (full: every publish fails), a `max_msg_size` above the server's
//!   `max_payload`, and settings that differ from the options given for them are warnings
//!   that say why.

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

use std::time::Duration;

use crate::config::{format_duration, format_size, opt, StreamSettings};

/// Checks the stream, or creates it when missing (and allowed) with the configured settings
/// (`config.stream_settings`), then warns about what its settings mean for the events (B3).
pub async fn stream(jetstream: &jetstream::Context, config: &Config) -> Result<()> {
    let ours = format!("{}.>", config.subject_prefix);
    let info = match jetstream.get_stream(&config.stream).await {
        Ok(mut stream) => stream
            .info()
            .await
            .map_err(|e| {
                RelayError::transient(anyhow::anyhow!("cannot read stream {}: {e}", config.stream))
            })?
            .clone(),
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
            let settings = &config.stream_settings;
            let created = jetstream
                .create_stream(stream_config(config))
                .await
                .map_err(|e| create_error(config, &ours, e))?;
            info!(
                stream = %config.stream,
                subjects = %ours,
                duplicate_window = %format_duration(config.duplicate_window),
                replicas = settings.replicas,
                storage = ?settings.storage,
                max_age = %settings.max_age.map_or("unlimited".into(), format_duration),
                max_bytes = %settings.max_bytes.map_or("unlimited".into(), format_size),
                max_msg_size = %settings.max_msg_size.map_or("unlimited".into(), format_size),
                discard = ?settings.discard,
                "created stream"
            );
            created.cached_info().clone()
        }
        Err(error) => {
            return Err(RelayError::transient(anyhow::anyhow!(
                "cannot look up stream {}: {error}",
                config.stream
            )))
        }
    };
    let max_payload = jetstream.client().server_info().max_payload;
    for finding in check_stream(&info, config, max_payload) {
        match finding.severity {
            StreamSeverity::Refused => return Err(permanent(finding.message)),
            StreamSeverity::Full | StreamSeverity::Warning => {
                warn!(stream = %config.stream, "{}", finding.message);
            }
        }
    }
    Ok(())
}

/// The configuration of a stream the relay creates.
pub fn stream_config(config: &Config) -> StreamConfig {
    let settings = &config.stream_settings;
    let limit = |value: Option<u64>| value.and_then(|v| i64::try_from(v).ok()).unwrap_or(-1);
    StreamConfig {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.subject_prefix)],
        storage: settings.storage,
        duplicate_window: config.duplicate_window,
        num_replicas: settings.replicas,
        max_age: settings.max_age.unwrap_or_default(),
        max_bytes: limit(settings.max_bytes),
        max_message_size: settings
            .max_msg_size
            .and_then(|v| i32::try_from(v).ok())
            .unwrap_or(-1),
        discard: settings.discard,
        ..Default::default()
    }
}

/// A stream the server refuses to create: a setting it cannot honour is permanent and names
/// the option; a cluster without a leader or quorum, a lost connection or a concurrent
/// creation are transient (the next session looks again).
fn create_error(
    config: &Config,
    ours: &str,
    error: jetstream::context::CreateStreamError,
) -> RelayError {
    use async_nats::jetstream::ErrorCode;
    let message = format!("cannot create stream {}: {error}", config.stream);
    let jetstream::context::CreateStreamErrorKind::JetStream(refusal) = error.kind() else {
        return RelayError::transient(anyhow::anyhow!(message));
    };
    let code = refusal.error_code();
    let fix = match code {
        ErrorCode::CLUSTER_NO_PEERS
        | ErrorCode::CLUSTER_NOT_AVAILABLE
        | ErrorCode::CLUSTER_NOT_ACTIVE
        | ErrorCode::CLUSTER_NOT_LEADER
        | ErrorCode::CLUSTER_INCOMPLETE
        | ErrorCode::RAFT_GENERAL
        | ErrorCode::STREAM_NAME_EXIST => return RelayError::transient(anyhow::anyhow!(message)),
        ErrorCode::STREAM_REPLICAS_NOT_SUPPORTED => format!(
            "a single nats-server keeps one replica: set {}=1, or run a JetStream cluster",
            opt::STREAM_REPLICAS.env
        ),
        ErrorCode::INSUFFICIENT_RESOURCES
        | ErrorCode::STORAGE_RESOURCES_EXCEEDED
        | ErrorCode::MEMORY_RESOURCES_EXCEEDED
        | ErrorCode::ACCOUNT_RESOURCES_EXCEEDED => format!(
            "lower {} or raise the JetStream limits of the server or account (max_file_store, max_memory_store)",
            opt::STREAM_MAX_BYTES.env
        ),
        ErrorCode::STREAM_SUBJECT_OVERLAP => format!(
            "another stream takes subjects overlapping {ours}: choose another {}, or set {} to that stream",
            opt::SUBJECT_PREFIX.env,
            opt::STREAM.env
        ),
        _ => "check the stream options (OUTBOX_RELAY_STREAM_*, docs/configuration.md)".into(),
    };
    permanent(format!("{message}: {fix}"))
}

/// How much a finding of [`check_stream`] matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamSeverity {
    /// The relay cannot use the stream: it refuses to start.
    Refused,
    /// A `discard: new` stream at its limit: every publish fails until room is made.
    Full,
    /// The stream works, but its settings can lose events or weaken a guarantee.
    Warning,
}

/// One thing [`check_stream`] found, said so that the operator knows why and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFinding {
    /// How much it matters.
    pub severity: StreamSeverity,
    /// What, why, and the fix.
    pub message: String,
}

/// Checks a stream against what the relay needs and the options given for it (B3): its
/// subjects cover `{prefix}.>`; file storage; the duplicate window; the settings given
/// explicitly; `max_msg_size` against the server's `max_payload`; a retention that can
/// delete events no consumer has read; a `discard: new` limit, and whether it is reached.
pub fn check_stream(
    info: &jetstream::stream::Info,
    config: &Config,
    max_payload: usize,
) -> Vec<StreamFinding> {
    use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy};
    let name = &config.stream;
    let stream = &info.config;
    let mut findings = Vec::new();
    let mut say = |severity, message: String| findings.push(StreamFinding { severity, message });
    let ours = format!("{}.>", config.subject_prefix);
    if !stream
        .subjects
        .iter()
        .any(|filter| subject_filter_covers(filter, &ours))
    {
        say(StreamSeverity::Refused, format!(
            "stream {name} exists but its subjects {:?} do not cover {ours}: add {ours} to the \
             stream's subjects, or choose another OUTBOX_RELAY_STREAM or OUTBOX_RELAY_SUBJECT_PREFIX",
            stream.subjects
        ));
    }
    if stream.storage == StorageType::Memory {
        say(
            StreamSeverity::Warning,
            format!(
            "stream {name} keeps its events in memory: a nats-server restart loses every one of \
             them, though Postgres released them once stored; use file storage ({}=file for a \
             stream the relay creates; an existing stream's storage cannot change: recreate it)",
            opt::STREAM_STORAGE.env
        ),
        );
    }
    if stream.duplicate_window != config.duplicate_window {
        say(
            StreamSeverity::Warning,
            format!(
            "stream {name}'s duplicate window ({}) differs from {} ({}); the stream's own applies",
            format_duration(stream.duplicate_window),
            opt::DUPLICATE_WINDOW.env,
            format_duration(config.duplicate_window)
        ),
        );
    }
    let differences = differences(stream, &config.stream_settings);
    if !differences.is_empty() {
        say(
            StreamSeverity::Warning,
            format!(
            "stream {name} differs from the options given for it: {}; the stream's own settings \
             apply (the relay never changes an existing stream): edit the stream (nats stream \
             edit {name}) or change the options",
            differences.join(", ")
        ),
        );
    }
    let max_msg_size = u64::try_from(stream.max_message_size).unwrap_or(0);
    if max_msg_size > 0 && max_payload > 0 && max_msg_size > max_payload as u64 {
        say(
            StreamSeverity::Warning,
            format!(
                "stream {name} accepts messages up to {} (max_msg_size), but the server's \
             max_payload is {}: larger events are refused anyway and handled as poison \
             (OUTBOX_RELAY_ON_POISON); raise max_payload in nats-server's configuration to \
             use the stream's limit",
                format_size(max_msg_size),
                format_size(max_payload as u64)
            ),
        );
    }
    match stream.retention {
        RetentionPolicy::Limits => {}
        RetentionPolicy::Interest => say(
            StreamSeverity::Warning,
            format!(
                "stream {name} has interest retention: it deletes an event once every consumer \
             acknowledged it, and at once while no consumer exists, so events published then \
             are lost; and the relay cannot resume from the stream's last message (replays are \
             de-duplicated by Nats-Msg-Id, within the duplicate window only); use limits retention"
            ),
        ),
        RetentionPolicy::WorkQueue => say(
            StreamSeverity::Warning,
            format!(
                "stream {name} has work-queue retention: it deletes an event once a consumer \
             acknowledged it, so the relay cannot resume from the stream's last message \
             (replays are de-duplicated by Nats-Msg-Id, within the duplicate window only); use \
             limits retention"
            ),
        ),
    }
    if !stream.max_age.is_zero() {
        say(
            StreamSeverity::Warning,
            format!(
                "stream {name} deletes events older than {} (max_age), read or not: a consumer \
             that falls further behind, or stays stopped longer, never sees them, and the \
             relay cannot publish them again (Postgres released them once stored)",
                format_duration(stream.max_age)
            ),
        );
    }
    let positive = |v: i64| u64::try_from(v).ok().filter(|&v| v > 0);
    let max_bytes = positive(stream.max_bytes);
    let max_messages = positive(stream.max_messages);
    let mut limits = Vec::new();
    limits.extend(max_bytes.map(|v| format!("{} (max_bytes)", format_size(v))));
    let messages = |n: u64| format!("{n} message{}", if n == 1 { "" } else { "s" });
    limits.extend(max_messages.map(|v| format!("{} (max_msgs)", messages(v))));
    let per_subject = positive(stream.max_messages_per_subject)
        .map(|v| format!("{} per subject (max_msgs_per_subject)", messages(v)));
    match stream.discard {
        DiscardPolicy::Old => {
            limits.extend(per_subject);
            if !limits.is_empty() {
                say(
                    StreamSeverity::Warning,
                    format!(
                        "stream {name} deletes its oldest events beyond {} (discard old), read or \
                     not: a consumer that falls further behind never sees them, and the relay \
                     cannot publish them again (Postgres released them once stored)",
                        limits.join(" or ")
                    ),
                );
            }
        }
        DiscardPolicy::New => {
            if !limits.is_empty() {
                say(StreamSeverity::Warning, format!(
                    "stream {name} refuses new events beyond {} (discard new): then every \
                     publish of the relay fails, nothing more is relayed and the slot retains \
                     WAL until room is made (raise the limit, or delete events consumers have read)",
                    limits.join(" or ")
                ));
            }
            let state = &info.state;
            let full = max_messages.is_some_and(|max| state.messages >= max)
                || max_bytes.is_some_and(|max| state.bytes >= max / 100 * 99);
            if full {
                say(
                    StreamSeverity::Full,
                    format!(
                        "stream {name} is full: it holds {}, {} (discard new), and refuses \
                     new events: the relay's publishes fail and it retries while the slot retains \
                     WAL; make room (raise max_bytes or max_msgs with nats stream edit {name}, or \
                     delete events consumers have read)",
                        messages(state.messages),
                        format_size(state.bytes)
                    ),
                );
            }
        }
    }
    findings
}

/// The settings given explicitly in `settings` that `stream` does not have, each as
/// `max_age 1h (OUTBOX_RELAY_STREAM_MAX_AGE: 7d)`.
fn differences(stream: &StreamConfig, settings: &StreamSettings) -> Vec<String> {
    let size = |v: Option<u64>| v.map_or("unlimited".into(), format_size);
    let limit = |v: i64| size(u64::try_from(v).ok().filter(|&v| v > 0));
    let age = |v: Option<Duration>| v.map_or("unlimited".into(), format_duration);
    let storage = |s: StorageType| match s {
        StorageType::File => "file",
        StorageType::Memory => "memory",
    };
    let discard = |d: async_nats::jetstream::stream::DiscardPolicy| format!("{d:?}").to_lowercase();
    let mut found = Vec::new();
    for spec in &settings.given {
        let (have, want) = match spec.key {
            k if k == opt::STREAM_REPLICAS.key => (
                stream.num_replicas.max(1).to_string(),
                settings.replicas.to_string(),
            ),
            k if k == opt::STREAM_STORAGE.key => (
                storage(stream.storage).into(),
                storage(settings.storage).into(),
            ),
            k if k == opt::STREAM_MAX_AGE.key => (
                age(Some(stream.max_age).filter(|a| !a.is_zero())),
                age(settings.max_age),
            ),
            k if k == opt::STREAM_MAX_BYTES.key => {
                (limit(stream.max_bytes), size(settings.max_bytes))
            }
            k if k == opt::STREAM_MAX_MSG_SIZE.key => (
                limit(i64::from(stream.max_message_size)),
                size(settings.max_msg_size),
            ),
            k if k == opt::STREAM_DISCARD.key => {
                (discard(stream.discard), discard(settings.discard))
            }
            _ => continue,
        };
        if have != want {
            let key = spec.key.trim_start_matches("stream_");
            found.push(format!("{key} {have} ({}: {want})", spec.env));
        }
    }
    found
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
mod stream_tests {
    #![allow(clippy::unwrap_used)]

    use super::{check_stream, jetstream, StreamSeverity};

    /// A stream's info as the server sends it: `config` over a file stream without limits.
    fn info(config: serde_json::Value, messages: u64, bytes: u64) -> jetstream::stream::Info {
        let mut base = serde_json::json!({
            "name": "OUTBOX", "subjects": ["outbox.>"], "retention": "limits",
            "max_consumers": -1, "max_msgs": -1, "max_bytes": -1, "max_age": 0,
            "max_msgs_per_subject": -1, "max_msg_size": -1, "discard": "old",
            "storage": "file", "num_replicas": 1, "duplicate_window": 120_000_000_000u64,
        });
        for (key, value) in config.as_object().unwrap() {
            base[key] = value.clone();
        }
        serde_json::from_value(serde_json::json!({
            "config": base,
            "created": "2025-01-31T12:00:00Z",
            "state": {
                "messages": messages, "bytes": bytes, "first_seq": 1, "last_seq": messages,
                "first_ts": "2025-01-31T12:00:00Z", "last_ts": "2025-01-31T12:00:00Z",
                "consumer_count": 0,
            },
        }))
        .unwrap()
    }

    fn check(
        config: serde_json::Value,
        messages: u64,
        env: &[(&str, &str)],
    ) -> Vec<(StreamSeverity, String)> {
        let mut all = vec![("DATABASE_URL", "postgres://relay@db/app")];
        all.extend_from_slice(env);
        let relay = crate::config::tests::load(&[], &all, None).unwrap();
        check_stream(&info(config, messages, messages * 100), &relay, 1 << 20)
            .into_iter()
            .map(|finding| (finding.severity, finding.message))
            .collect()
    }

    #[test]
    fn the_stream_the_relay_creates_by_default_gets_no_finding() {
        assert_eq!(check(serde_json::json!({}), 10, &[]), vec![]);
    }

    #[test]
    fn subjects_that_do_not_cover_ours_are_refused() {
        let found = check(serde_json::json!({"subjects": ["other.>"]}), 0, &[]);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, StreamSeverity::Refused);
        assert!(found[0].1.contains("do not cover outbox.>"), "{found:?}");
    }

    #[test]
    fn retention_that_can_delete_unread_events_is_a_warning_that_says_why() {
        let found = check(
            serde_json::json!({"max_age": 3_600_000_000_000u64, "max_bytes": 1 << 30,
                               "max_msgs_per_subject": 10}),
            0,
            &[],
        );
        let messages: Vec<&str> = found.iter().map(|(_, m)| m.as_str()).collect();
        assert!(found.iter().all(|(s, _)| *s == StreamSeverity::Warning));
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(messages[0].contains("deletes events older than 1h (max_age), read or not"));
        assert!(messages[1].contains(
            "deletes its oldest events beyond 1 GiB (max_bytes) or 10 messages per subject \
             (max_msgs_per_subject) (discard old)"
        ));
        for retention in ["interest", "workqueue"] {
            let found = check(serde_json::json!({ "retention": retention }), 0, &[]);
            assert_eq!(found.len(), 1, "{found:?}");
            assert!(
                found[0]
                    .1
                    .contains("cannot resume from the stream's last message"),
                "{found:?}"
            );
        }
    }

    #[test]
    fn a_discard_new_limit_warns_and_a_full_stream_says_publishes_fail() {
        let config = serde_json::json!({"discard": "new", "max_msgs": 5});
        let found = check(config.clone(), 4, &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0]
            .1
            .contains("refuses new events beyond 5 messages (max_msgs)"));
        let found = check(config, 5, &[]);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[1].0, StreamSeverity::Full);
        assert!(
            found[1].1.contains("is full: it holds 5 messages, "),
            "{found:?}"
        );
    }

    #[test]
    fn settings_given_explicitly_are_compared_and_defaults_are_not() {
        let config = serde_json::json!({"num_replicas": 3, "max_msg_size": 2 << 20});
        let found = check(config.clone(), 0, &[]);
        assert_eq!(
            found.len(),
            1,
            "only max_msg_size vs max_payload: {found:?}"
        );
        assert!(found[0].1.contains("max_payload is 1 MiB"), "{found:?}");
        let found = check(
            config,
            0,
            &[
                ("OUTBOX_RELAY_STREAM_REPLICAS", "1"),
                ("OUTBOX_RELAY_STREAM_MAX_MSG_SIZE", "2MiB"),
                ("OUTBOX_RELAY_STREAM_DISCARD", "new"),
            ],
        );
        assert!(
            found.iter().any(|(_, m)| {
                m.contains(
                "differs from the options given for it: replicas 3 \
                 (OUTBOX_RELAY_STREAM_REPLICAS: 1), discard old (OUTBOX_RELAY_STREAM_DISCARD: new);"
            )
            }),
            "{found:?}"
        );
    }
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
