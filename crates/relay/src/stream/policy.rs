//! The JetStream stream's settings and policy: checked, or created when missing (and
//! allowed) with the configured settings, and what its settings mean for the events said at
//! every start.
//!
//! Created when missing, unless `--no-create`, with the configured duplicate window and
//! `stream_*` settings: replicas, storage, `max_age`, `max_bytes`, `max_msg_size`, discard
//! policy. PG1 and PG2 (`crate::postgres::checks`) hold here too: nothing is created when a
//! check fails, and every failure names what to fix.
//!
//! # Invariants
//! - ST1 The stream is never changed once it exists (but for ST2's record on an empty stream); what its settings mean for the events is
//!   said at every start ([`check_stream`]): subjects that do not cover `{prefix}.>` stop the
//!   relay; memory storage, a stream that acknowledges before it writes (`persist_mode:
//!   async`, nats-server 2.12+: [`check_stream_persistence`]), a retention that deletes
//!   events no consumer has read (`max_age`,
//!   `max_bytes`/`max_msgs` with discard old, interest or work-queue retention), a
//!   `discard: new` limit (full: every publish fails), a `max_msg_size` above the server's
//!   `max_payload`, and settings that differ from the options given for them are warnings
//!   that say why.
//! - ST2 A stream holds the events of one table mapping: a relay with a mapped table records
//!   the mapping's fingerprint in the description of a stream it creates (or of an empty
//!   one without a record, the only change it makes to an existing stream), and a stream
//!   recording another mapping, or holding events without a record while this run maps a
//!   table, is refused naming both ([`check_stream`]).

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use tracing::{info, warn};

use crate::config::{format_duration, format_size, opt, Config, StreamSettings};
use crate::error::{RelayError, Result};

fn permanent(message: String) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(message))
}

/// A check failed (PG2): exit status 2.
fn setup(message: String) -> RelayError {
    RelayError::setup(anyhow::anyhow!(message))
}

/// Checks the stream, or creates it when missing (and allowed) with the configured settings
/// (`config.stream_settings`), then warns about what its settings mean for the events (ST1).
pub async fn stream(jetstream: &jetstream::Context, config: &Config) -> Result<()> {
    let ours = format!("{}.>", config.subject_prefix);
    let mut created = false;
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
            created = true;
            create(jetstream, config, &ours, &error).await?
        }
        Err(error) => {
            return Err(RelayError::transient(anyhow::anyhow!(
                "cannot look up stream {}: {error}",
                config.stream
            )))
        }
    };
    let info = record_mapping(jetstream, config, info).await?;
    if config.atomic_transactions {
        crate::stream::atomic::check(jetstream, &config.stream, created).await?;
    }
    // AT3: --fast-ingest's stream setting on a stream just created.
    crate::stream::atomic::allow_fast(jetstream, config, created).await?;
    let max_payload = jetstream.client().server_info().max_payload;
    let mut findings = check_stream(&info, config, max_payload);
    findings.extend(persistence_finding(jetstream, &config.stream).await?);
    say(findings, &config.stream)
}

/// Creates the missing stream (`error`: the lookup's) with the configured settings, unless
/// `--no-create` forbids it (PG1).
async fn create(
    jetstream: &jetstream::Context,
    config: &Config,
    ours: &str,
    error: &jetstream::context::GetStreamError,
) -> Result<jetstream::stream::Info> {
    if !config.create {
        return Err(setup(format!(
            "stream {} does not exist and --no-create forbids creating it ({error})",
            config.stream
        )));
    }
    let settings = &config.stream_settings;
    let stream = jetstream
        .create_stream(stream_config(config))
        .await
        .map_err(|e| create_error(&config.stream, ours, e))?;
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
    Ok(stream.cached_info().clone())
}

/// Says what the stream's settings mean for the events (ST1): a refusal stops the relay,
/// the rest are warnings.
fn say(findings: Vec<StreamFinding>, stream: &str) -> Result<()> {
    for finding in findings {
        match finding.severity {
            StreamSeverity::Refused => return Err(setup(finding.message)),
            StreamSeverity::Full | StreamSeverity::Warning => {
                warn!(stream = %stream, "{}", finding.message);
            }
        }
    }
    Ok(())
}

/// An empty stream without a mapping record gets this run's (ST2), so that a later run under
/// another mapping is refused.
async fn record_mapping(
    jetstream: &jetstream::Context,
    config: &Config,
    info: jetstream::stream::Info,
) -> Result<jetstream::stream::Info> {
    let Some(record) = mapping_record(config) else {
        return Ok(info);
    };
    if !recorded_mapping(&info.config).is_empty() || info.state.messages != 0 {
        return Ok(info);
    }
    let mut updated = info.config.clone();
    updated.description = Some(record);
    let updated = jetstream.update_stream(&updated).await.map_err(|e| {
        RelayError::transient(anyhow::anyhow!(
            "cannot record the table mapping in stream {}'s description: {e}",
            config.stream
        ))
    })?;
    info!(stream = %config.stream, mapping = %config.mapping, "recorded the table mapping in the stream's description");
    Ok(updated)
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
        description: mapping_record(config),
        ..Default::default()
    }
}

/// What a stream's description says when a relay with a mapped table created it: the
/// mapping's fingerprint (`outbox` MAP3), so that a later run under another mapping is
/// refused (ST2).
const MAPPING_RECORD: &str = "outbox-relay mapping: ";

/// The description that records `config`'s mapping; `None` for the seed's (the streams of
/// every earlier release have none).
fn mapping_record(config: &Config) -> Option<String> {
    let fingerprint = config.mapping.fingerprint();
    (!fingerprint.is_empty()).then(|| format!("{MAPPING_RECORD}{fingerprint}"))
}

/// The mapping a stream records: `""` (the seed's) when its description holds none.
fn recorded_mapping(stream: &StreamConfig) -> &str {
    stream
        .description
        .as_deref()
        .and_then(|d| d.strip_prefix(MAPPING_RECORD))
        .unwrap_or("")
}

/// ST2: a stream holds the events of one mapping. One created under another (or, holding
/// events, under the seed's while this run maps a table) is refused, naming both.
fn check_stream_mapping(
    name: &str,
    info: &jetstream::stream::Info,
    config: &Config,
    findings: &mut Vec<StreamFinding>,
) {
    let recorded = recorded_mapping(&info.config);
    let ours = config.mapping.fingerprint();
    if recorded == ours || (recorded.is_empty() && info.state.messages == 0) {
        return;
    }
    let shown = |f: &str| {
        if f.is_empty() {
            "the seed's table under the default settings".to_owned()
        } else {
            f.trim_end_matches(';').to_owned()
        }
    };
    findings.push(StreamFinding {
        severity: StreamSeverity::Refused,
        message: format!(
            "stream {name} holds events published under another table mapping: it was made for {}, this run maps {}; \
             the same rows would be published with other keys, subjects or headers. Run with the stream's mapping, \
             or give this mapping a stream of its own (OUTBOX_RELAY_STREAM)",
            shown(recorded),
            shown(&ours)
        ),
    });
}

/// A stream the server refuses to create: a setting it cannot honour is permanent and names
/// the option; a cluster without a leader or quorum, a lost connection or a concurrent
/// creation are transient (the next session looks again).
fn create_error(
    stream: &str,
    ours: &str,
    error: jetstream::context::CreateStreamError,
) -> RelayError {
    use async_nats::jetstream::ErrorCode;
    let message = format!("cannot create stream {}: {error}", stream);
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

/// Checks a stream against what the relay needs and the options given for it (ST1): its
/// subjects cover `{prefix}.>`; file storage; the duplicate window; the settings given
/// explicitly; `max_msg_size` against the server's `max_payload`; a retention that can
/// delete events no consumer has read; a `discard: new` limit, and whether it is reached.
pub fn check_stream(
    info: &jetstream::stream::Info,
    config: &Config,
    max_payload: usize,
) -> Vec<StreamFinding> {
    let name = &config.stream;
    let stream = &info.config;
    let mut findings = Vec::new();
    check_stream_subjects(name, stream, &config.subject_prefix, &mut findings);
    check_stream_mapping(name, info, config, &mut findings);
    check_stream_settings(name, stream, config, max_payload, &mut findings);
    check_stream_retention(name, stream, &mut findings);
    check_stream_limits(name, info, &mut findings);
    findings
}

/// The stream's subjects cover `{prefix}.>`, or the relay refuses it.
fn check_stream_subjects(
    name: &str,
    stream: &StreamConfig,
    subject_prefix: &str,
    findings: &mut Vec<StreamFinding>,
) {
    let mut say = |severity, message: String| findings.push(StreamFinding { severity, message });
    let ours = format!("{}.>", subject_prefix);
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
}

/// File storage, the duplicate window, the settings given explicitly, and `max_msg_size`
/// against the server's `max_payload`.
fn check_stream_settings(
    name: &str,
    stream: &StreamConfig,
    config: &Config,
    max_payload: usize,
    findings: &mut Vec<StreamFinding>,
) {
    let mut say = |severity, message: String| findings.push(StreamFinding { severity, message });
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
}

/// The first nats-server with a stream setting `persist_mode` (2.12).
const PERSIST_MODE_FIRST_VERSION: (u64, u64) = (2, 12);

/// ST1: what the stream's `persist_mode` means for the events, read through the API's JSON
/// (async-nats's typed configuration has no such field) on a server that has the setting.
pub async fn persistence_finding(
    jetstream: &jetstream::Context,
    name: &str,
) -> Result<Option<StreamFinding>> {
    let version = jetstream.client().server_info().version;
    if !crate::stream::atomic::supports(&version, PERSIST_MODE_FIRST_VERSION) {
        return Ok(None);
    }
    let settings = crate::stream::atomic::stream_config(jetstream, name).await?;
    Ok(check_stream_persistence(name, &settings))
}

/// ST1: a stream that acknowledges a publish before writing it (`persist_mode: async`) loses
/// the events of nats-server's last moments when it is killed or crashes, after the relay
/// confirmed them (an LSN is confirmed on the ack) and Postgres released their WAL: a
/// warning, like memory storage. `settings` is the stream's configuration as JSON.
pub fn check_stream_persistence(name: &str, settings: &serde_json::Value) -> Option<StreamFinding> {
    let mode = settings
        .get("persist_mode")
        .and_then(serde_json::Value::as_str)?;
    (mode == "async").then(|| StreamFinding {
        severity: StreamSeverity::Warning,
        message: format!(
            "stream {name} acknowledges events before writing them (persist_mode: async): when \
             nats-server is killed or crashes, the events it acknowledged last (up to its flush \
             delay) are lost, though the relay confirmed them and Postgres released them, so \
             nothing publishes them again; create the stream with persist_mode: default (a \
             stream's persist mode cannot change: recreate it)"
        ),
    })
}

/// A retention that can delete events no consumer has read: interest or work-queue
/// retention, a max age.
fn check_stream_retention(name: &str, stream: &StreamConfig, findings: &mut Vec<StreamFinding>) {
    use async_nats::jetstream::stream::RetentionPolicy;
    let mut say = |severity, message: String| findings.push(StreamFinding { severity, message });
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
}

/// The stream's limits: with `discard: old` they delete unread events; with `discard: new`
/// they refuse the relay's publishes, and whether they are reached now.
fn check_stream_limits(
    name: &str,
    info: &jetstream::stream::Info,
    findings: &mut Vec<StreamFinding>,
) {
    use async_nats::jetstream::stream::DiscardPolicy;
    let stream = &info.config;
    let mut say = |severity, message: String| findings.push(StreamFinding { severity, message });
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

    use super::{check_stream, check_stream_persistence, jetstream, StreamSeverity};

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
    fn a_stream_that_acknowledges_before_it_writes_is_a_warning_that_says_why() {
        let found = check_stream_persistence("S", &serde_json::json!({"persist_mode": "async"}))
            .expect("a finding");
        assert_eq!(found.severity, StreamSeverity::Warning);
        assert!(
            found
                .message
                .contains("stream S acknowledges events before writing them (persist_mode: async)")
                && found
                    .message
                    .contains("create the stream with persist_mode: default"),
            "{found:?}"
        );
        // The default, said or not (a server before 2.12 says nothing).
        for settings in [
            serde_json::json!({"persist_mode": "default"}),
            serde_json::json!({}),
            serde_json::Value::Null,
        ] {
            assert_eq!(check_stream_persistence("S", &settings), None, "{settings}");
        }
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
