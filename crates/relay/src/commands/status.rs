//! `outbox-relay status`: the relay's objects as they are now, as a table for people or
//! JSON for scripts (`--json`), and an exit status a probe or a cron job can act on.
//!
//! [`gather`] reads, on one control connection and one NATS connection: the slot (active and
//! for which backend, confirmed position, lag behind the server's WAL, `wal_status`,
//! `safe_wal_size`), the publication (tables, operations, root publishing, row filters and
//! column lists), the lease holder (`pg_locks` and `pg_stat_activity`), the stream (state,
//! settings, limits) and its last event (outbox id, age from its `created_at`, position and
//! source). It then judges what it read ([`assess`]): every [`Finding`] says what is wrong,
//! why it matters and what to do. [`render`] draws the table.
//!
//! | exit | health | when |
//! |---|---|---|
//! | 0 | healthy | nothing below (warnings allowed) |
//! | 3 | lagging | slot lag above `max_lag_bytes`; `wal_status` `extended` or `unreserved`; no relay holds the lease; the lease holder is not streaming |
//! | 4 | broken | slot, publication or stream missing; slot `lost`; the start-up checks refuse the publication, table or slot, or the stream's subjects; a `discard: new` stream that is full; the slot read by a program that holds no lease |
//! | 1 | unknown | Postgres or NATS cannot be reached, or a query fails, and nothing read is broken |
//! | 2 | | invalid configuration (as for every command) |
//!
//! 1 and 2 keep the meaning they have for every command of the binary (an error that needs
//! an operator; invalid configuration), so the health codes are 3 and 4.
//!
//! # Invariants
//! - STA1 Read-only: status creates, changes and locks nothing. The start-up checks run with
//!   `create` off, and only on objects that exist; the lease holder is read from
//!   `pg_locks`, never found by trying the lock.
//! - STA2 The exit status is the worst finding: broken > unknown > lagging > healthy; warnings
//!   leave it at healthy.
//! - STA3 Nothing secret is printed: the Postgres target without its password, NATS servers
//!   without credentials, and the whole output through the log scrubber (in `main`).
//! - STA4 [`render`], the JSON and [`assess`] depend on the [`Status`] alone: times and ages are
//!   taken while gathering, so tests pin the output on fixed values.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy, StorageType};
use pgoutput::Lsn;
use serde::Serialize;
use tokio_postgres::Client;

use crate::config::{format_duration, format_size, opt, Config};
use crate::postgres::checks;
use crate::postgres::error::describe;
use crate::stream::policy::{self, StreamSeverity};

/// How long reading either side may take, connecting included: a probe must not hang.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How bad a finding is; the order is the exit status's precedence (STA2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Worth knowing; the relay works.
    Warning,
    /// Events are behind or not flowing; the set-up is sound.
    Lagging,
    /// Part of the state could not be read.
    Unknown,
    /// The relay cannot relay correctly until an operator acts.
    Broken,
}

/// The verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Exit 0.
    Healthy,
    /// Exit 3.
    Lagging,
    /// Exit 4.
    Broken,
    /// Exit 1: the state could not be read completely.
    Unknown,
}

impl Health {
    /// The process's exit status (see the module docs).
    pub fn exit_code(self) -> u8 {
        match self {
            Health::Healthy => 0,
            Health::Unknown => 1,
            Health::Lagging => 3,
            Health::Broken => 4,
        }
    }

    fn of(findings: &[Finding]) -> Health {
        match findings.iter().map(|f| f.level).max() {
            Some(Level::Broken) => Health::Broken,
            Some(Level::Unknown) => Health::Unknown,
            Some(Level::Lagging) => Health::Lagging,
            Some(Level::Warning) | None => Health::Healthy,
        }
    }
}

/// Something wrong: what, why it matters, and the fix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// How bad.
    pub level: Level,
    /// What, why, and what to do.
    pub message: String,
}

impl Finding {
    fn new(level: Level, message: impl Into<String>) -> Finding {
        Finding {
            level,
            message: message.into(),
        }
    }
}

/// Everything `outbox-relay status` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The verdict, from the findings (STA2).
    pub health: Health,
    /// The exit status of the verdict.
    pub exit_code: u8,
    /// What is wrong, worst first.
    pub findings: Vec<Finding>,
    /// The Postgres connection, without its password.
    pub postgres: String,
    /// The outbox table and the mapping the relay reads it through.
    pub table: String,
    /// The NATS servers, without credentials.
    pub nats: String,
    /// The slot; `None` when Postgres could not be read.
    pub slot: Option<Slot>,
    /// The lease; `None` when Postgres could not be read.
    pub lease: Option<LeaseState>,
    /// The publication; `None` when Postgres could not be read.
    pub publication: Option<Publication>,
    /// The stream; `None` when NATS could not be read.
    pub stream: Option<Stream>,
    /// The stream's last message; `None` when the stream is empty or unreadable.
    pub last_event: Option<LastEvent>,
}

/// A Postgres backend (session), as `pg_stat_activity` shows it to this role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// Its process id.
    pub pid: i32,
    /// Its `application_name` (hidden for other roles' sessions without `pg_read_all_stats`).
    pub application_name: Option<String>,
    /// Its client's address, `None` for a Unix socket (or hidden).
    pub client_addr: Option<String>,
    /// Its client's port.
    pub client_port: Option<i32>,
    /// When it connected (UTC).
    pub backend_start: Option<String>,
}

/// The replication slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Slot {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing slot.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<SlotState>,
}

/// An existing slot's state (`pg_replication_slots`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotState {
    /// Its output plugin (`pgoutput`).
    pub plugin: Option<String>,
    /// Its database.
    pub database: Option<String>,
    /// Whether a walsender streams it.
    pub active: bool,
    /// That walsender's pid.
    pub active_pid: Option<i32>,
    /// That walsender's session.
    pub walsender: Option<Backend>,
    /// The oldest WAL it retains.
    pub restart_lsn: Option<String>,
    /// What its consumer confirmed: where the relay resumes.
    pub confirmed_flush_lsn: Option<String>,
    /// The server's WAL position (`pg_current_wal_lsn()`, on a standby the replay position).
    pub current_wal_lsn: Option<String>,
    /// `current_wal_lsn - confirmed_flush_lsn`, in bytes.
    pub lag_bytes: Option<u64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (Postgres 13+).
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost; `None`: no limit
    /// (`max_slot_wal_keep_size = -1`) or Postgres before 13.
    pub safe_wal_size: Option<i64>,
}

/// The lease (advisory lock keyed by the slot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseState {
    /// Whether a session holds it.
    pub held: bool,
    /// That session.
    pub holder: Option<Backend>,
}

/// The publication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Publication {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing publication.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<PublicationState>,
}

/// An existing publication's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublicationState {
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// The operations it publishes: `insert`, `update`, `delete`, `truncate`.
    pub operations: Vec<String>,
    /// `publish_via_partition_root` (Postgres 13+).
    pub publish_via_partition_root: Option<bool>,
    /// Whether it publishes the outbox table.
    pub includes_outbox_table: bool,
    /// The tables it publishes.
    pub tables: Vec<PublishedTable>,
}

/// A table of the publication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishedTable {
    /// `schema.table`.
    pub name: String,
    /// Its row filter (Postgres 15+), if any.
    pub row_filter: Option<String>,
    /// Its column list (Postgres 15+), if any.
    pub columns: Option<Vec<String>>,
}

/// The stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stream {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing stream.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<StreamState>,
}

/// An existing stream's state and settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamState {
    /// Its subjects.
    pub subjects: Vec<String>,
    /// Messages it holds.
    pub messages: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Its first sequence.
    pub first_sequence: u64,
    /// Its last sequence.
    pub last_sequence: u64,
    /// Its consumers.
    pub consumers: usize,
    /// Its duplicate window.
    pub duplicate_window_seconds: f64,
    /// `file` or `memory`.
    pub storage: String,
    /// Its replicas.
    pub replicas: usize,
    /// `limits`, `interest` or `workqueue`.
    pub retention: String,
    /// Events older than this are deleted; `None`: unlimited.
    pub max_age_seconds: Option<f64>,
    /// Size limit; `None`: unlimited.
    pub max_bytes: Option<u64>,
    /// Message count limit; `None`: unlimited.
    pub max_msgs: Option<u64>,
    /// Message count limit per subject; `None`: unlimited.
    pub max_msgs_per_subject: Option<u64>,
    /// Largest message; `None`: the server's `max_payload`.
    pub max_msg_size: Option<u64>,
    /// `old` or `new`.
    pub discard: String,
    /// The server's `max_payload`.
    pub server_max_payload: u64,
    /// The cluster's leader for the stream, if clustered.
    pub leader: Option<String>,
}

/// The stream's last message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LastEvent {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its subject.
    pub subject: String,
    /// `Outbox-Id`: a number for integer ids (as always), a string for uuid and text ids.
    #[serde(serialize_with = "serialize_id")]
    pub outbox_id: Option<outbox::EventId>,
    /// The row's `created_at` (UTC), from the `Outbox-Ordering-Key`'s millisecond prefix.
    pub created_at: Option<String>,
    /// When the stream stored it (UTC).
    pub stored_at: String,
    /// Its age when read: from `created_at`, else from `stored_at`.
    pub age_seconds: f64,
    /// `created_at` or `stored_at`: what the age is measured from.
    pub age_from: String,
    /// `Outbox-Commit-Lsn`.
    pub commit_lsn: Option<String>,
    /// `Outbox-Tx-Index`.
    pub tx_index: Option<u64>,
    /// `Outbox-Source`: cluster, timeline, database and slot it was relayed from.
    pub source: Option<String>,
    /// Whether it is a dead-letter record in place of an event.
    pub dead_letter: bool,
}

/// Reads everything, judges it ([`assess`]) and never fails: what cannot be read is a
/// finding of level [`Level::Unknown`].
pub async fn gather(config: &Config) -> Status {
    let now = SystemTime::now();
    let late = |what: String| {
        vec![Finding::new(
            Level::Unknown,
            format!("{what} did not answer within {} s", READ_TIMEOUT.as_secs()),
        )]
    };
    let (postgres, nats) = tokio::join!(
        tokio::time::timeout(READ_TIMEOUT, gather_postgres(config)),
        tokio::time::timeout(READ_TIMEOUT, gather_nats(config, now))
    );
    let (slot, lease, publication, mut findings) = postgres.unwrap_or_else(|_| {
        let what = format!("Postgres at {}", config.database.redacted());
        (None, None, None, late(what))
    });
    let (stream, last_event, nats_findings) = nats.unwrap_or_else(|_| {
        let what = format!("NATS at {}", config.nats.servers().join(","));
        (None, None, late(what))
    });
    findings.extend(nats_findings);
    let mut status = Status {
        health: Health::Healthy,
        exit_code: 0,
        findings,
        postgres: config.database.redacted(),
        table: format!("{} ({})", config.table, config.mapping),
        nats: config.nats.servers().join(","),
        slot,
        lease,
        publication,
        stream,
        last_event,
    };
    let judged = assess(&status, config);
    status.findings.extend(judged);
    status.findings.sort_by_key(|f| std::cmp::Reverse(f.level));
    status.health = Health::of(&status.findings);
    status.exit_code = status.health.exit_code();
    status
}

type PostgresPart = (
    Option<Slot>,
    Option<LeaseState>,
    Option<Publication>,
    Vec<Finding>,
);

async fn gather_postgres(config: &Config) -> PostgresPart {
    let unknown = |what: String| vec![Finding::new(Level::Unknown, what)];
    let client = match replication::connect_sql(&config.database).await {
        Ok(client) => client,
        Err(e) => {
            return (
                None,
                None,
                None,
                unknown(format!(
                    "cannot connect to Postgres at {}: {e}",
                    config.database.redacted()
                )),
            )
        }
    };
    let (slot, lease, publication) = match read_parts(&client, config).await {
        Ok(read) => read,
        Err(e) => return (None, None, None, unknown(e)),
    };
    let mut findings = Vec::new();
    // The start-up checks, read-only (STA1), on objects that exist (missing ones are findings
    // of their own, with a fix that fits `status`).
    if slot.exists && publication.exists {
        let mut checking = config.clone();
        checking.create = false;
        if let Err(e) = checks::postgres(&client, &checking).await {
            let level = if e.is_transient() {
                Level::Unknown
            } else {
                Level::Broken
            };
            findings.push(Finding::new(
                level,
                format!("the relay's start-up checks refuse: {e}"),
            ));
        }
    }
    (Some(slot), Some(lease), Some(publication), findings)
}

/// The slot, the lease and the publication, with the sessions of the lease's holder and
/// of the slot's walsender.
async fn read_parts(
    client: &Client,
    config: &Config,
) -> Result<(Slot, LeaseState, Publication), String> {
    let slot = read_slot(client, &config.slot).await?;
    let publication = read_publication(client, config).await?;
    let holder = crate::postgres::lease::holder(client, &config.slot)
        .await
        .map_err(|e| e.to_string())?;
    let walsender = slot.state.as_ref().and_then(|s| s.active_pid);
    let pids: Vec<i32> = holder.iter().chain(walsender.iter()).copied().collect();
    let backends = read_backends(client, &pids).await?;
    let backend = |pid: i32| {
        backends
            .iter()
            .find(|b| b.pid == pid)
            .cloned()
            .unwrap_or(Backend {
                pid,
                application_name: None,
                client_addr: None,
                client_port: None,
                backend_start: None,
            })
    };
    let mut slot = slot;
    if let Some(state) = slot.state.as_mut() {
        state.walsender = state.active_pid.map(backend);
    }
    let lease = LeaseState {
        held: holder.is_some(),
        holder: holder.map(backend),
    };
    Ok((slot, lease, publication))
}

fn sql_error(what: &str) -> impl Fn(tokio_postgres::Error) -> String + '_ {
    move |e| format!("cannot read {what}: {}", describe(&e))
}

/// The slot's row as JSON (columns differ between Postgres versions) and the server's WAL
/// position.
async fn read_slot(client: &Client, name: &str) -> Result<Slot, String> {
    let row = client
        .query_opt(
            "SELECT pg_catalog.to_jsonb(s)::text, \
                    (CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() \
                          ELSE pg_catalog.pg_current_wal_lsn() END)::text \
               FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1",
            &[&name],
        )
        .await
        .map_err(sql_error("the replication slot"))?;
    let Some(row) = row else {
        return Ok(Slot {
            name: name.to_owned(),
            exists: false,
            state: None,
        });
    };
    let json: String = row.get(0);
    let current: Option<String> = row.get(1);
    let slot: serde_json::Value = serde_json::from_str(&json)
        .map_err(|e| format!("cannot read the replication slot: {e}"))?;
    let text = |key: &str| slot.get(key).and_then(|v| v.as_str()).map(str::to_owned);
    let confirmed = text("confirmed_flush_lsn");
    let lsn = |text: &Option<String>| text.as_deref().and_then(|t| t.parse::<Lsn>().ok());
    let lag_bytes = match (lsn(&confirmed), lsn(&current)) {
        (Some(confirmed), Some(current)) => Some(confirmed.bytes_until(current)),
        _ => None,
    };
    Ok(Slot {
        name: name.to_owned(),
        exists: true,
        state: Some(SlotState {
            plugin: text("plugin"),
            database: text("database"),
            active: slot
                .get("active")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            active_pid: slot
                .get("active_pid")
                .and_then(|v| v.as_i64())
                .and_then(|pid| i32::try_from(pid).ok()),
            walsender: None,
            restart_lsn: text("restart_lsn"),
            confirmed_flush_lsn: confirmed,
            current_wal_lsn: current,
            lag_bytes,
            wal_status: text("wal_status"),
            safe_wal_size: slot.get("safe_wal_size").and_then(|v| v.as_i64()),
        }),
    })
}

async fn read_publication(client: &Client, config: &Config) -> Result<Publication, String> {
    let name = &config.publication;
    let row = client
        .query_opt(
            "SELECT pg_catalog.to_jsonb(p)::text FROM pg_catalog.pg_publication p WHERE p.pubname = $1",
            &[name],
        )
        .await
        .map_err(sql_error("the publication"))?;
    let Some(row) = row else {
        return Ok(Publication {
            name: name.clone(),
            exists: false,
            state: None,
        });
    };
    let publication: serde_json::Value = serde_json::from_str(&row.get::<_, String>(0))
        .map_err(|e| format!("cannot read the publication: {e}"))?;
    let flag = |key: &str| publication.get(key).and_then(|v| v.as_bool());
    let operations = [
        ("pubinsert", "insert"),
        ("pubupdate", "update"),
        ("pubdelete", "delete"),
        ("pubtruncate", "truncate"),
    ]
    .iter()
    .filter(|(key, _)| flag(key) == Some(true))
    .map(|(_, op)| (*op).to_owned())
    .collect();
    let tables = read_published_tables(client, name).await?;
    let ours = config.table.to_string();
    Ok(Publication {
        name: name.clone(),
        exists: true,
        state: Some(PublicationState {
            all_tables: flag("puballtables").unwrap_or(false),
            operations,
            publish_via_partition_root: flag("pubviaroot"),
            includes_outbox_table: tables.iter().any(|t| t.name == ours),
            tables,
        }),
    })
}

/// The tables the publication publishes, with their row filters and column lists.
async fn read_published_tables(client: &Client, name: &str) -> Result<Vec<PublishedTable>, String> {
    // Row filters and column lists exist from Postgres 15 on: read through to_jsonb, a
    // missing column is NULL. `attnames` always lists the published columns; a column list
    // is set when `pg_publication_rel.prattrs` is.
    let rows = client
        .query(
            "SELECT t.schemaname::text, t.tablename::text, pg_catalog.to_jsonb(t) ->> 'rowfilter', \
                    CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r \
                                        JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid \
                                        JOIN pg_catalog.pg_class c ON c.oid = r.prrelid \
                                        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                                       WHERE p.pubname = t.pubname AND n.nspname = t.schemaname \
                                         AND c.relname = t.tablename \
                                         AND (pg_catalog.to_jsonb(r) ->> 'prattrs') IS NOT NULL) \
                         THEN (pg_catalog.to_jsonb(t) -> 'attnames')::text END \
               FROM pg_catalog.pg_publication_tables t WHERE t.pubname = $1 ORDER BY 1, 2",
            &[&name],
        )
        .await
        .map_err(sql_error("the publication's tables"))?;
    Ok(rows
        .iter()
        .map(|row| PublishedTable {
            name: format!("{}.{}", row.get::<_, String>(0), row.get::<_, String>(1)),
            row_filter: row.get(2),
            columns: row
                .get::<_, Option<String>>(3)
                .and_then(|json| serde_json::from_str(&json).ok()),
        })
        .collect())
}

async fn read_backends(client: &Client, pids: &[i32]) -> Result<Vec<Backend>, String> {
    if pids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT pid, application_name, pg_catalog.host(client_addr), client_port, \
                    pg_catalog.to_char(backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
               FROM pg_catalog.pg_stat_activity WHERE pid = ANY($1)",
            &[&pids],
        )
        .await
        .map_err(sql_error("the sessions (pg_stat_activity)"))?;
    Ok(rows
        .iter()
        .map(|row| Backend {
            pid: row.get(0),
            application_name: row
                .get::<_, Option<String>>(1)
                .filter(|name| !name.is_empty()),
            client_addr: row.get(2),
            client_port: row.get::<_, Option<i32>>(3).filter(|&port| port > 0),
            backend_start: row.get(4),
        })
        .collect())
}

async fn gather_nats(
    config: &Config,
    now: SystemTime,
) -> (Option<Stream>, Option<LastEvent>, Vec<Finding>) {
    let unknown = |what: String| vec![Finding::new(Level::Unknown, what)];
    let client = match crate::connect::nats::connect(&config.nats).await {
        Ok(client) => client,
        Err(e) => return (None, None, unknown(e.to_string())),
    };
    let max_payload = client.server_info().max_payload;
    let jetstream = jetstream::new(client);
    let mut stream = match jetstream.get_stream(&config.stream).await {
        Ok(stream) => stream,
        Err(e) => {
            let missing = matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            );
            if !missing {
                return (
                    None,
                    None,
                    unknown(format!("cannot read stream {}: {e}", config.stream)),
                );
            }
            let stream = Stream {
                name: config.stream.clone(),
                exists: false,
                state: None,
            };
            return (Some(stream), None, Vec::new());
        }
    };
    let info = match stream.info().await {
        Ok(info) => info.clone(),
        Err(e) => {
            return (
                None,
                None,
                unknown(format!("cannot read stream {}: {e}", config.stream)),
            )
        }
    };
    let mut findings = stream_findings(&info, config, max_payload);
    match policy::persistence_finding(&jetstream, &config.stream).await {
        Ok(finding) => findings.extend(finding.map(status_finding)),
        Err(e) => findings.push(Finding::new(Level::Unknown, e.to_string())),
    }
    let last_event = read_last_event(&stream, &info, config, now, &mut findings).await;
    let stream = Stream {
        name: config.stream.clone(),
        exists: true,
        state: Some(stream_state(&info, max_payload)),
    };
    (Some(stream), last_event, findings)
}

/// The stream's findings ([`policy::check_stream`], ST1) as status levels: refused or
/// full is broken.
fn stream_findings(
    info: &jetstream::stream::Info,
    config: &Config,
    max_payload: usize,
) -> Vec<Finding> {
    policy::check_stream(info, config, max_payload)
        .into_iter()
        .map(status_finding)
        .collect()
}

/// A stream finding as a status level: refused or full is broken.
fn status_finding(finding: policy::StreamFinding) -> Finding {
    let level = match finding.severity {
        StreamSeverity::Refused | StreamSeverity::Full => Level::Broken,
        StreamSeverity::Warning => Level::Warning,
    };
    Finding::new(level, finding.message)
}

/// The stream's last message as the last event, if the stream holds any; a warning in
/// `findings` when it cannot be read.
async fn read_last_event(
    stream: &jetstream::stream::Stream,
    info: &jetstream::stream::Info,
    config: &Config,
    now: SystemTime,
    findings: &mut Vec<Finding>,
) -> Option<LastEvent> {
    if info.state.last_sequence > 0 && info.state.messages > 0 {
        match stream.get_raw_message(info.state.last_sequence).await {
            Ok(message) => Some(last_event(&message, now)),
            Err(e) => {
                findings.push(Finding::new(
                    Level::Warning,
                    format!(
                        "cannot read the last message of stream {} (sequence {}): {e}",
                        config.stream, info.state.last_sequence
                    ),
                ));
                None
            }
        }
    } else {
        None
    }
}

fn stream_state(info: &jetstream::stream::Info, max_payload: usize) -> StreamState {
    let config = &info.config;
    let positive = |v: i64| u64::try_from(v).ok().filter(|&v| v > 0);
    StreamState {
        subjects: config.subjects.clone(),
        messages: info.state.messages,
        bytes: info.state.bytes,
        first_sequence: info.state.first_sequence,
        last_sequence: info.state.last_sequence,
        consumers: info.state.consumer_count,
        duplicate_window_seconds: config.duplicate_window.as_secs_f64(),
        storage: match config.storage {
            StorageType::File => "file",
            StorageType::Memory => "memory",
        }
        .into(),
        replicas: config.num_replicas.max(1),
        retention: match config.retention {
            RetentionPolicy::Limits => "limits",
            RetentionPolicy::Interest => "interest",
            RetentionPolicy::WorkQueue => "workqueue",
        }
        .into(),
        max_age_seconds: Some(config.max_age)
            .filter(|age| !age.is_zero())
            .map(|age| age.as_secs_f64()),
        max_bytes: positive(config.max_bytes),
        max_msgs: positive(config.max_messages),
        max_msgs_per_subject: positive(config.max_messages_per_subject),
        max_msg_size: positive(i64::from(config.max_message_size)),
        discard: match config.discard {
            DiscardPolicy::Old => "old",
            DiscardPolicy::New => "new",
        }
        .into(),
        server_max_payload: max_payload as u64,
        leader: info.cluster.as_ref().and_then(|c| c.leader.clone()),
    }
}

fn last_event(message: &jetstream::message::StreamMessage, now: SystemTime) -> LastEvent {
    use outbox::headers;
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    let created_ms = header(headers::OUTBOX_ORDERING_KEY).and_then(|key| {
        key.split_once(':')
            .and_then(|(ms, _)| ms.parse::<i64>().ok())
    });
    let stored_ms = i64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
    let now_ms = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let (from_ms, age_from) = match created_ms {
        Some(ms) => (ms, "created_at"),
        None => (stored_ms, "stored_at"),
    };
    LastEvent {
        sequence: message.sequence,
        subject: message.subject.to_string(),
        outbox_id: outbox::EventId::from_headers(|name| {
            message.headers.get(name).map(|v| v.as_str())
        }),
        created_at: created_ms.map(utc_millis),
        stored_at: utc_millis(stored_ms),
        age_seconds: (now_ms.saturating_sub(from_ms).max(0)) as f64 / 1000.0,
        age_from: age_from.into(),
        commit_lsn: header(headers::OUTBOX_COMMIT_LSN),
        tx_index: header(headers::OUTBOX_TX_INDEX).and_then(|i| i.parse().ok()),
        source: header(headers::OUTBOX_SOURCE),
        dead_letter: header(headers::OUTBOX_DEAD_LETTER_REASON).is_some(),
    }
}

/// Judges what was read: missing and lost objects, WAL retention and lag, the lease.
pub fn assess(status: &Status, config: &Config) -> Vec<Finding> {
    let mut findings = Vec::new();
    if let Some(slot) = &status.slot {
        findings.extend(assess_slot(slot, config));
    }
    if let Some(publication) = &status.publication {
        if !publication.exists {
            findings.push(Finding::new(
                Level::Broken,
                format!(
                "publication {} does not exist: nothing is relayed; create it with outbox-relay \
                 init, or as the table's owner with sql/publication.sql",
                publication.name
            ),
            ));
        }
    }
    let slot = status.slot.as_ref().and_then(|s| s.state.as_ref());
    if let Some(lease) = &status.lease {
        findings.extend(assess_lease(lease, slot, config));
    }
    if let Some(stream) = &status.stream {
        if !stream.exists {
            findings.push(Finding::new(
                Level::Broken,
                format!(
                "stream {} does not exist: nothing is relayed; create it with outbox-relay init \
                 (if the relay ran before, the stream was deleted with the events in it)",
                stream.name
            ),
            ));
        }
    }
    findings
}

/// The slot: missing, lost or at risk (its `wal_status`), or further behind than
/// `--max-lag-bytes`.
fn assess_slot(slot: &Slot, config: &Config) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut say = |level, message: String| findings.push(Finding::new(level, message));
    let slot_name = &config.slot;
    match &slot.state {
        None => say(
            Level::Broken,
            format!(
                "replication slot {slot_name} does not exist: nothing is relayed, and events \
             committed while it is missing never will be; create it with outbox-relay init \
             (if the stream already holds events, the slot was dropped: events committed \
             since are missing from the stream)"
            ),
        ),
        Some(state) => {
            match state.wal_status.as_deref() {
                Some("lost") => say(
                    Level::Broken,
                    format!(
                        "replication slot {slot_name} is lost (wal_status lost): Postgres \
                     removed WAL it still needed (max_slot_wal_keep_size), so events \
                     committed after its confirmed position {} are missing from the stream; \
                     drop it and create it again with outbox-relay init, then recover the \
                     missing events from the table (docs/operations.md)",
                        state.confirmed_flush_lsn.as_deref().unwrap_or("?")
                    ),
                ),
                Some("unreserved") => say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} retains WAL beyond max_slot_wal_keep_size \
                     (wal_status unreserved): the next checkpoint may remove it and lose the \
                     slot; the relay must catch up now"
                    ),
                ),
                Some("extended") => say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} retains more WAL than max_wal_size \
                     (wal_status extended): the relay is behind"
                    ),
                ),
                _ => {}
            }
            if let Some(lag) = state.lag_bytes.filter(|&lag| lag > config.max_lag_bytes) {
                say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} is {} behind the server's WAL, more than \
                     {} ({}): the relay is behind or stopped, and Postgres keeps that WAL",
                        format_size(lag),
                        format_size(config.max_lag_bytes),
                        opt::MAX_LAG_BYTES.env
                    ),
                );
            }
        }
    }
    findings
}

/// The lease against the slot: a program reading the slot without the lease, no relay,
/// or a relay holding the lease without streaming.
fn assess_lease(lease: &LeaseState, slot: Option<&SlotState>, config: &Config) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut say = |level, message: String| findings.push(Finding::new(level, message));
    let slot_name = &config.slot;
    match (&lease.holder, slot) {
        (None, Some(slot)) if slot.active => say(
            Level::Broken,
            format!(
                "replication slot {slot_name} is read by {} but no relay holds the lease: \
             another program consumes the slot, and what it confirms never reaches the \
             stream; stop it (SELECT pg_terminate_backend({})) and run outbox-relay",
                describe_backend(slot.walsender.as_ref(), slot.active_pid),
                slot.active_pid
                    .map_or("<pid>".into(), |pid| pid.to_string())
            ),
        ),
        (None, _) => say(
            Level::Lagging,
            format!(
                "no relay holds the lease for slot {slot_name}: no relay is running, so nothing \
             is relayed; start outbox-relay run"
            ),
        ),
        (Some(holder), Some(slot)) if !slot.active => say(
            Level::Lagging,
            format!(
                "the relay holding the lease ({}) is not streaming: slot {slot_name} is \
             inactive (between sessions after a failure? its log says why)",
                describe_backend(Some(holder), Some(holder.pid))
            ),
        ),
        _ => {}
    }
    findings
}

/// `pid 4242 (outbox-relay, 10.0.0.3:50412)`.
fn describe_backend(backend: Option<&Backend>, pid: Option<i32>) -> String {
    let Some(pid) = backend.map(|b| b.pid).or(pid) else {
        return "an unknown backend".into();
    };
    let mut details = Vec::new();
    if let Some(backend) = backend {
        details.extend(backend.application_name.clone());
        match (&backend.client_addr, backend.client_port) {
            (Some(addr), Some(port)) if addr.contains(':') => {
                details.push(format!("[{addr}]:{port}"))
            }
            (Some(addr), Some(port)) => details.push(format!("{addr}:{port}")),
            (Some(addr), None) => details.push(addr.clone()),
            (None, _) if backend.backend_start.is_some() => details.push("local socket".into()),
            (None, _) => {}
        }
        if let Some(start) = &backend.backend_start {
            details.push(format!("since {start}"));
        }
    }
    if details.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid} ({})", details.join(", "))
    }
}

/// An outbox id in status's JSON: a number for an integer id, a string for the others.
fn serialize_id<S: serde::Serializer>(
    id: &Option<outbox::EventId>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match id {
        None => serializer.serialize_none(),
        Some(outbox::EventId::Int(id)) => serializer.serialize_i64(*id),
        Some(outbox::EventId::Text(id)) => serializer.serialize_str(id),
    }
}

/// The table for people (STA4: a function of `status` alone).
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let headline = match status.health {
        Health::Healthy => "healthy".to_owned(),
        other => format!(
            "{} (exit {})",
            format!("{other:?}").to_uppercase(),
            other.exit_code()
        ),
    };
    let _ = writeln!(out, "outbox-relay status: {headline}");
    for finding in &status.findings {
        let level = format!("{:?}", finding.level).to_lowercase();
        let _ = writeln!(out, "  {level}: {}", finding.message);
    }
    out.push('\n');
    let mut rows: Vec<(&str, String)> = Vec::new();
    rows.push(("postgres", status.postgres.clone()));
    rows.push(("table", status.table.clone()));
    render_slot(&mut rows, status.slot.as_ref());
    render_publication(&mut rows, status.publication.as_ref());
    rows.push((
        "lease",
        match &status.lease {
            None => "unknown".into(),
            Some(LeaseState { holder: None, .. }) => "held by no relay".into(),
            Some(LeaseState {
                holder: Some(holder),
                ..
            }) => format!("held by {}", describe_backend(Some(holder), None)),
        },
    ));
    rows.push(("nats", status.nats.clone()));
    render_stream(&mut rows, status.stream.as_ref());
    render_last_event(&mut rows, status.last_event.as_ref());
    let width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    for (label, value) in rows {
        let _ = writeln!(out, "{label:<width$}  {value}");
    }
    out
}

fn render_slot(rows: &mut Vec<(&str, String)>, slot: Option<&Slot>) {
    let Some(slot) = slot else {
        rows.push(("slot", "unknown".into()));
        return;
    };
    let Some(state) = &slot.state else {
        rows.push(("slot", format!("{}: does not exist", slot.name)));
        return;
    };
    let activity = if state.active {
        format!(
            "active, streamed by {}",
            describe_backend(state.walsender.as_ref(), state.active_pid)
        )
    } else {
        "inactive".into()
    };
    rows.push((
        "slot",
        format!(
            "{} ({}, database {}): {activity}",
            slot.name,
            state.plugin.as_deref().unwrap_or("?"),
            state.database.as_deref().unwrap_or("?")
        ),
    ));
    rows.push((
        "  confirmed",
        format!(
            "{} (restart {})",
            state.confirmed_flush_lsn.as_deref().unwrap_or("none"),
            state.restart_lsn.as_deref().unwrap_or("none")
        ),
    ));
    rows.push((
        "  lag",
        match (state.lag_bytes, &state.current_wal_lsn) {
            (Some(lag), Some(current)) => {
                format!("{} behind the server's WAL at {current}", format_size(lag))
            }
            _ => "unknown".into(),
        },
    ));
    rows.push((
        "  wal",
        format!(
            "wal_status {}, safe_wal_size {}",
            state.wal_status.as_deref().unwrap_or("unknown"),
            match state.safe_wal_size {
                Some(size) if size >= 0 => format_size(size as u64),
                Some(size) => format!("-{}", format_size(size.unsigned_abs())),
                None => "unlimited".into(),
            }
        ),
    ));
}

fn render_publication(rows: &mut Vec<(&str, String)>, publication: Option<&Publication>) {
    let Some(publication) = publication else {
        rows.push(("publication", "unknown".into()));
        return;
    };
    let Some(state) = &publication.state else {
        rows.push((
            "publication",
            format!("{}: does not exist", publication.name),
        ));
        return;
    };
    let mut head = format!(
        "{}: {}",
        publication.name,
        if state.operations.is_empty() {
            "no operations".into()
        } else {
            state.operations.join(", ")
        }
    );
    if let Some(root) = state.publish_via_partition_root {
        let _ = write!(head, "; publish_via_partition_root {root}");
    }
    rows.push(("publication", head));
    const SHOWN: usize = 5;
    let mut tables: Vec<String> = state
        .tables
        .iter()
        .take(SHOWN)
        .map(|table| {
            let mut text = table.name.clone();
            if let Some(columns) = &table.columns {
                let _ = write!(text, " ({})", columns.join(", "));
            }
            if let Some(filter) = &table.row_filter {
                let _ = write!(text, " WHERE {filter}");
            }
            text
        })
        .collect();
    if state.tables.len() > SHOWN {
        tables.push(format!("… {} more", state.tables.len() - SHOWN));
    }
    let mut value = if state.all_tables {
        format!("all tables ({}): ", state.tables.len())
    } else {
        String::new()
    };
    value.push_str(&if tables.is_empty() {
        "none".to_owned()
    } else {
        tables.join("; ")
    });
    rows.push(("  tables", value));
}

fn render_stream(rows: &mut Vec<(&str, String)>, stream: Option<&Stream>) {
    let Some(stream) = stream else {
        rows.push(("stream", "unknown".into()));
        return;
    };
    let Some(state) = &stream.state else {
        rows.push(("stream", format!("{}: does not exist", stream.name)));
        return;
    };
    rows.push((
        "stream",
        format!("{}: subjects {}", stream.name, state.subjects.join(", ")),
    ));
    rows.push((
        "  messages",
        format!(
            "{} ({}), sequences {} to {}, {} consumer{}",
            state.messages,
            format_size(state.bytes),
            state.first_sequence,
            state.last_sequence,
            state.consumers,
            if state.consumers == 1 { "" } else { "s" }
        ),
    ));
    let mut settings = format!(
        "{} storage, {} replica{}",
        state.storage,
        state.replicas,
        if state.replicas == 1 { "" } else { "s" }
    );
    if let Some(leader) = &state.leader {
        let _ = write!(settings, " (leader {leader})");
    }
    let _ = write!(
        settings,
        ", duplicate window {}, {} retention, discard {}",
        format_duration(Duration::from_secs_f64(state.duplicate_window_seconds)),
        state.retention,
        state.discard
    );
    rows.push(("  settings", settings));
    let size = |v: Option<u64>| v.map_or("unlimited".into(), format_size);
    let count = |v: Option<u64>| v.map_or("unlimited".into(), |v| v.to_string());
    rows.push((
        "  limits",
        format!(
            "max_age {}, max_bytes {}, max_msgs {}, max_msgs_per_subject {}, max_msg_size {} (server max_payload {})",
            state
                .max_age_seconds
                .map_or("unlimited".into(), |s| format_duration(Duration::from_secs_f64(s))),
            size(state.max_bytes),
            count(state.max_msgs),
            count(state.max_msgs_per_subject),
            size(state.max_msg_size),
            format_size(state.server_max_payload)
        ),
    ));
}

fn render_last_event(rows: &mut Vec<(&str, String)>, event: Option<&LastEvent>) {
    let Some(event) = event else {
        rows.push(("last event", "none".into()));
        return;
    };
    let what = match (&event.outbox_id, event.dead_letter) {
        (Some(id), false) => format!("outbox id {id}"),
        (Some(id), true) => format!("dead-letter record of outbox id {id}"),
        (None, _) => "a message without Outbox-Id".into(),
    };
    rows.push((
        "last event",
        format!(
            "{what}, sequence {}, subject {}",
            event.sequence, event.subject
        ),
    ));
    rows.push((
        "  age",
        format!(
            "{} (created {}, stored {})",
            format_age(event.age_seconds),
            event.created_at.as_deref().unwrap_or("unknown"),
            event.stored_at
        ),
    ));
    rows.push((
        "  position",
        format!(
            "commit {} #{}, source {}",
            event.commit_lsn.as_deref().unwrap_or("unknown"),
            event.tx_index.map_or("?".into(), |index| index.to_string()),
            event.source.as_deref().unwrap_or("unknown")
        ),
    ));
}

/// `3.2 s`, `4 min 12 s`, `5 h 3 min`, `2 d 4 h`.
fn format_age(seconds: f64) -> String {
    let whole = seconds as u64;
    match whole {
        0..=59 => format!("{seconds:.1} s"),
        60..=3599 => format!("{} min {} s", whole / 60, whole % 60),
        3600..=86_399 => format!("{} h {} min", whole / 3600, whole % 3600 / 60),
        _ => format!("{} d {} h", whole / 86_400, whole % 86_400 / 3600),
    }
}

/// Unix milliseconds as `2025-01-31T12:34:56.789Z`.
fn utc_millis(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    // The civil date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn config(env: &[(&str, &str)]) -> Config {
        let mut all = vec![("DATABASE_URL", "postgres://relay:hunter2@db:5432/app")];
        all.extend_from_slice(env);
        crate::config::tests::load(&[], &all, None).unwrap()
    }

    fn relay_backend(pid: i32, port: i32) -> Backend {
        Backend {
            pid,
            application_name: Some("outbox-relay".into()),
            client_addr: Some("10.0.0.3".into()),
            client_port: Some(port),
            backend_start: Some("2025-01-31T12:00:00Z".into()),
        }
    }

    /// A healthy system: the relay streams the slot and holds the lease.
    fn healthy() -> Status {
        Status {
            health: Health::Healthy,
            exit_code: 0,
            findings: vec![],
            postgres: "postgres://relay@db:5432/app?sslmode=prefer".into(),
            table: "public.outbox_events (the seed's columns)".into(),
            nats: "nats://nats:4222".into(),
            slot: Some(Slot {
                name: "outbox_relay".into(),
                exists: true,
                state: Some(SlotState {
                    plugin: Some("pgoutput".into()),
                    database: Some("app".into()),
                    active: true,
                    active_pid: Some(4242),
                    walsender: Some(relay_backend(4242, 50412)),
                    restart_lsn: Some("0/16B3710".into()),
                    confirmed_flush_lsn: Some("0/16B3748".into()),
                    current_wal_lsn: Some("0/16B3B48".into()),
                    lag_bytes: Some(1024),
                    wal_status: Some("reserved".into()),
                    safe_wal_size: None,
                }),
            }),
            lease: Some(LeaseState {
                held: true,
                holder: Some(relay_backend(4241, 50410)),
            }),
            publication: Some(Publication {
                name: "outbox_relay".into(),
                exists: true,
                state: Some(PublicationState {
                    all_tables: false,
                    operations: vec!["insert".into()],
                    publish_via_partition_root: Some(false),
                    includes_outbox_table: true,
                    tables: vec![PublishedTable {
                        name: "public.outbox_events".into(),
                        row_filter: None,
                        columns: None,
                    }],
                }),
            }),
            stream: Some(Stream {
                name: "OUTBOX".into(),
                exists: true,
                state: Some(StreamState {
                    subjects: vec!["outbox.>".into()],
                    messages: 1234,
                    bytes: 1_258_291,
                    first_sequence: 1,
                    last_sequence: 1234,
                    consumers: 1,
                    duplicate_window_seconds: 120.0,
                    storage: "file".into(),
                    replicas: 1,
                    retention: "limits".into(),
                    max_age_seconds: None,
                    max_bytes: None,
                    max_msgs: None,
                    max_msgs_per_subject: None,
                    max_msg_size: None,
                    discard: "old".into(),
                    server_max_payload: 1_048_576,
                    leader: None,
                }),
            }),
            last_event: Some(LastEvent {
                sequence: 1234,
                subject: "outbox.3.OrderPaid".into(),
                outbox_id: Some(outbox::EventId::Int(4711)),
                created_at: Some(utc_millis(1_738_326_896_789)),
                stored_at: utc_millis(1_738_326_896_795),
                age_seconds: 3.25,
                age_from: "created_at".into(),
                commit_lsn: Some("0/16B3748".into()),
                tx_index: Some(0),
                source: Some("7301/1/app/outbox_relay".into()),
                dead_letter: false,
            }),
        }
    }

    #[test]
    fn renders_a_healthy_system_as_a_table() {
        let expected = "\
outbox-relay status: healthy

postgres     postgres://relay@db:5432/app?sslmode=prefer
table        public.outbox_events (the seed's columns)
slot         outbox_relay (pgoutput, database app): active, streamed by pid 4242 (outbox-relay, 10.0.0.3:50412, since 2025-01-31T12:00:00Z)
  confirmed  0/16B3748 (restart 0/16B3710)
  lag        1 KiB behind the server's WAL at 0/16B3B48
  wal        wal_status reserved, safe_wal_size unlimited
publication  outbox_relay: insert; publish_via_partition_root false
  tables     public.outbox_events
lease        held by pid 4241 (outbox-relay, 10.0.0.3:50410, since 2025-01-31T12:00:00Z)
nats         nats://nats:4222
stream       OUTBOX: subjects outbox.>
  messages   1234 (1.2 MiB), sequences 1 to 1234, 1 consumer
  settings   file storage, 1 replica, duplicate window 2m, limits retention, discard old
  limits     max_age unlimited, max_bytes unlimited, max_msgs unlimited, max_msgs_per_subject unlimited, max_msg_size unlimited (server max_payload 1 MiB)
last event   outbox id 4711, sequence 1234, subject outbox.3.OrderPaid
  age        3.2 s (created 2025-01-31T12:34:56.789Z, stored 2025-01-31T12:34:56.795Z)
  position   commit 0/16B3748 #0, source 7301/1/app/outbox_relay
";
        assert_eq!(render(&healthy()), expected);
    }

    #[test]
    fn renders_findings_first_and_what_is_missing_or_unknown() {
        let mut status = healthy();
        status.slot = Some(Slot {
            name: "outbox_relay".into(),
            exists: false,
            state: None,
        });
        status.stream = None;
        status.last_event = None;
        status.lease = Some(LeaseState {
            held: false,
            holder: None,
        });
        status.findings = vec![
            Finding::new(
                Level::Broken,
                "replication slot outbox_relay does not exist",
            ),
            Finding::new(Level::Unknown, "cannot connect to NATS"),
        ];
        status.health = Health::of(&status.findings);
        let text = render(&status);
        assert!(
            text.starts_with(
                "outbox-relay status: BROKEN (exit 4)\n  broken: replication slot outbox_relay does not exist\n  unknown: cannot connect to NATS\n\n"
            ),
            "{text}"
        );
        for line in [
            "slot         outbox_relay: does not exist\n",
            "lease        held by no relay\n",
            "stream       unknown\n",
            "last event   none\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
    }

    #[test]
    fn json_names_every_part() {
        let json = serde_json::to_value(healthy()).unwrap();
        assert_eq!(json["health"], "healthy");
        assert_eq!(json["slot"]["exists"], true);
        assert_eq!(json["slot"]["lag_bytes"], 1024);
        assert_eq!(json["slot"]["safe_wal_size"], serde_json::Value::Null);
        assert_eq!(json["slot"]["walsender"]["pid"], 4242);
        assert_eq!(json["lease"]["holder"]["application_name"], "outbox-relay");
        assert_eq!(json["publication"]["operations"][0], "insert");
        assert_eq!(json["stream"]["max_bytes"], serde_json::Value::Null);
        assert_eq!(json["stream"]["duplicate_window_seconds"], 120.0);
        assert_eq!(json["last_event"]["outbox_id"], 4711);
        assert_eq!(json["last_event"]["created_at"], "2025-01-31T12:34:56.789Z");
        let missing = serde_json::to_value(Slot {
            name: "s".into(),
            exists: false,
            state: None,
        })
        .unwrap();
        assert_eq!(missing, serde_json::json!({"name": "s", "exists": false}));
    }

    #[test]
    fn a_healthy_system_has_no_finding() {
        let status = healthy();
        assert_eq!(assess(&status, &config(&[])), vec![]);
    }

    #[test]
    fn lag_above_the_threshold_and_wal_retention_are_lagging() {
        let mut status = healthy();
        let config = config(&[("OUTBOX_RELAY_MAX_LAG_BYTES", "512")]);
        let findings = assess(&status, &config);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].level, Level::Lagging);
        assert!(
            findings[0].message.contains("1 KiB behind")
                && findings[0].message.contains("OUTBOX_RELAY_MAX_LAG_BYTES"),
            "{findings:?}"
        );
        for (wal_status, level) in [
            ("extended", Level::Lagging),
            ("unreserved", Level::Lagging),
            ("lost", Level::Broken),
        ] {
            let slot = status.slot.as_mut().unwrap().state.as_mut().unwrap();
            slot.wal_status = Some(wal_status.into());
            let findings = assess(&status, &super::tests::config(&[]));
            assert_eq!(findings.len(), 1, "{findings:?}");
            assert_eq!(findings[0].level, level, "{wal_status}");
            assert!(findings[0].message.contains(wal_status), "{findings:?}");
        }
    }

    #[test]
    fn the_lease_and_the_walsender_are_judged_together() {
        let config = config(&[]);
        // No relay at all: lagging (the set-up is sound, nothing flows).
        let mut status = healthy();
        status.lease = Some(LeaseState {
            held: false,
            holder: None,
        });
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = false;
        let findings = assess(&status, &config);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].level, Level::Lagging);
        assert!(findings[0].message.contains("no relay holds the lease"));
        // Someone reads the slot without the lease: broken.
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = true;
        let findings = assess(&status, &config);
        assert_eq!(findings[0].level, Level::Broken, "{findings:?}");
        assert!(findings[0].message.contains("pg_terminate_backend(4242)"));
        // The holder does not stream: lagging.
        let mut status = healthy();
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = false;
        let findings = assess(&status, &config);
        assert_eq!(findings[0].level, Level::Lagging, "{findings:?}");
        assert!(findings[0].message.contains("pid 4241"), "{findings:?}");
    }

    #[test]
    fn missing_objects_are_broken_and_the_worst_finding_decides() {
        let mut status = healthy();
        status.slot.as_mut().unwrap().state = None;
        status.publication.as_mut().unwrap().state = None;
        status.publication.as_mut().unwrap().exists = false;
        status.stream.as_mut().unwrap().state = None;
        status.stream.as_mut().unwrap().exists = false;
        let findings = assess(&status, &config(&[]));
        assert_eq!(findings.len(), 3, "{findings:?}");
        assert!(findings.iter().all(|f| f.level == Level::Broken));
        let mut all = findings;
        all.push(Finding::new(Level::Unknown, "x"));
        all.push(Finding::new(Level::Lagging, "y"));
        assert_eq!(Health::of(&all), Health::Broken);
        assert_eq!(Health::of(&all[3..]), Health::Unknown);
        assert_eq!(Health::of(&all[4..]), Health::Lagging);
        assert_eq!(
            Health::of(&[Finding::new(Level::Warning, "z")]),
            Health::Healthy
        );
        let codes: Vec<u8> = [
            Health::Healthy,
            Health::Unknown,
            Health::Lagging,
            Health::Broken,
        ]
        .iter()
        .map(|h| h.exit_code())
        .collect();
        assert_eq!(codes, [0, 1, 3, 4]);
    }

    #[test]
    fn utc_timestamps_and_ages() {
        assert_eq!(utc_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_millis(951_782_400_001), "2000-02-29T00:00:00.001Z");
        assert_eq!(utc_millis(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_age(0.04), "0.0 s");
        assert_eq!(format_age(252.0), "4 min 12 s");
        assert_eq!(format_age(18_180.0), "5 h 3 min");
        assert_eq!(format_age(187_200.0), "2 d 4 h");
    }
}
