//! Configuration: every option is a flag, an environment variable and a key of an optional
//! TOML file. Precedence: flag > environment > file > default.
//!
//! The room at the bottom of the crate: it uses nothing else of it (`.ci/check-structure`
//! keeps it so), and every other room may use it. This file holds the validated types
//! ([`Config`] and its parts) and [`effective`]; `options.rs` the options table, `raw.rs` the
//! raw sources, `validate.rs` the one validation, `parse.rs` single values. Besides those: [`nats`], the NATS
//! options (servers, one credential, TLS files; their connections are `crate::connect`'s);
//! [`backfill`], which rows the backfill at slot creation publishes; [`secrets`], which
//! secrets are too weak for the log scrubber.
//!
//! Raw values stay strings until [`Config::from_sources`] validates them all in one place,
//! so every error names the key as the operator wrote it (`OUTBOX_RELAY_PARTITIONS`,
//! `--partitions` or `partitions` in the file) and says what is expected.
//!
//! The Postgres connection also follows libpq: `DATABASE_URL` is a connection string whose
//! missing parameters come from the `PG*` variables and the password file
//! ([`replication::ConnInfo`]); with no `DATABASE_URL` at all, the `PG*` variables alone
//! configure it (when at least one is set).
//!
//! [`effective`] renders the configuration for `outbox-relay config`: every value and where
//! it came from, secrets as `<redacted>`.
//!
//! # Invariants
//! - CFG1 Secrets (the Postgres password, NATS credentials in the URL, with or without a
//!   scheme, any option whose key names a password, token or secret) never appear in
//!   `Debug`, `Display` or error output of a config, raw or validated, nor in
//!   [`effective`]; errors about the TOML file give the line and column, never the line.
//!   [`Config::secrets`] lists them for the log scrubber (`crate::observe::logging`), the last line
//!   of defence for text the relay does not format itself.
//! - CFG2 An unknown file key or `OUTBOX_RELAY_*` variable is an error, not ignored: a typo
//!   must not silently fall back to a default.
//! - CFG3 `NATS_URL` is never split inside a credential: a list where a ',' may have split
//!   one (an entry without its own scheme and with user information, right after an entry
//!   without: `nats://relay:2024,Spring!@h`) is refused with the advice to percent-encode
//!   (`%2C`), and redacted whole; `ws://` and `wss://` URLs, which the relay cannot speak,
//!   are refused too (exit 2 at start, both).
//! - CFG4 What is allowed but risky is said once at start, one line each, never quoting a
//!   secret ([`Config::warnings`]): secrets on the command line, secret files group or
//!   others can read (libpq's rule), secrets too weak for the log scrubber, credentials
//!   that would travel without verified TLS.
//! - CFG6 `outbox-relay config` prints a file `--config` loads back to the same settings,
//!   secrets left out: a URL without its password or credentials, a secret option as a
//!   comment naming where to give it; never `<redacted>` placeholders that fail to load.
//! - CFG5 The outbox table's name is read as PostgreSQL reads a qualified name: a part in
//!   double quotes exactly as written (case, dots, spaces; `""` for `"`), an unquoted part
//!   folded to lower case; what SQL would refuse is refused, naming the fix, never guessed.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream::stream::{DiscardPolicy, StorageType};
use replication::{AuthMethod, ConnInfo};

pub mod backfill;
pub mod nats;
pub mod secrets;
pub mod table;

pub use outbox::TableName;

mod options;
mod parse;
mod raw;
mod validate;
pub use options::*;
pub use parse::*;
pub use raw::*;

/// A table's name with its SQL form, `"schema"."name"` (both parts quoted once, here): the
/// outbox table as validated, and the relations the errors name. Reads as its
/// [`TableName`] (`Deref`), displays as `schema.name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    name: TableName,
    sql: String,
}

impl Table {
    /// The name, and its SQL form.
    pub fn new(name: TableName) -> Table {
        let sql = format!(
            "{}.{}",
            replication::quote_identifier(&name.schema),
            replication::quote_identifier(&name.name)
        );
        Table { name, sql }
    }

    /// `"schema"."name"`, for SQL text.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The name as the framer and the logs take it.
    pub fn name(&self) -> &TableName {
        &self.name
    }
}

impl From<TableName> for Table {
    fn from(name: TableName) -> Table {
        Table::new(name)
    }
}

impl std::ops::Deref for Table {
    type Target = TableName;

    fn deref(&self) -> &TableName {
        &self.name
    }
}

impl PartialEq<TableName> for Table {
    fn eq(&self, other: &TableName) -> bool {
        self.name == *other
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.name.fmt(f)
    }
}

/// How to log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The `application_name` of the relay's Postgres sessions when the connection string and
/// `PGAPPNAME` give none.
pub const FALLBACK_APPLICATION_NAME: &str = "outbox-relay";

/// A NATS URL list whose credentials never print.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUrl(String);

impl NatsUrl {
    /// The URL(s), credentials included, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl NatsUrl {
    /// The credentials in the URLs (passwords, tokens), in every form a library may print
    /// them: as written, percent-decoded, and as the `url` crate serializes them.
    pub fn secrets(&self) -> Vec<String> {
        let mut secrets = Vec::new();
        for entry in self.0.split(',') {
            let entry = entry.trim();
            let (_, Some(userinfo), _) = split_nats_url(entry) else {
                continue;
            };
            // user:password, or a token alone.
            let secret = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
            secrets.push(secret.to_owned());
            let with_scheme = if entry.contains("://") {
                entry.to_owned()
            } else {
                format!("nats://{entry}")
            };
            if let Ok(url) = url::Url::parse(&with_scheme) {
                secrets.extend(url.password().map(str::to_owned));
                if url.password().is_none() {
                    secrets.push(url.username().to_owned());
                }
            }
        }
        secrets
    }
}

/// Splits one NATS server URL into its scheme (with `://`, or empty), its user info (up to
/// the last `@`) and the rest (`host:port...`).
fn split_nats_url(entry: &str) -> (&str, Option<&str>, &str) {
    let (scheme, rest) = match entry.find("://") {
        Some(at) => entry.split_at(at + 3),
        None => ("", entry),
    };
    match rest.rfind('@') {
        Some(at) => (scheme, Some(&rest[..at]), &rest[at + 1..]),
        None => (scheme, None, rest),
    }
}

/// Whether `host[:port][/...]` has a numeric port, if any. Without an `@`, a user:password
/// would land in the port.
fn nats_host_port_ok(rest: &str) -> bool {
    let host_port = rest.split(['/', '?']).next().unwrap_or("");
    let port = match host_port.strip_prefix('[') {
        Some(v6) => v6
            .split_once(']')
            .map(|(_, after)| after.strip_prefix(':').unwrap_or(after)),
        None => Some(host_port.rsplit_once(':').map_or("", |(_, port)| port)),
    };
    !host_port.is_empty() && port.is_some_and(|port| port.bytes().all(|b| b.is_ascii_digit()))
}

/// Where a ',' may have split a credential of a NATS URL list: the number (from 1) of an
/// entry without a scheme of its own that has user information (an `@` after the comma
/// before any `/`), right after an entry without user information.
/// `nats://relay:2024,Spring!@h:4222` reads as the server `relay` on port 2024, then
/// `Spring!@h:4222`, whose user information is the password's tail;
/// `nats://h1:4222,relay:pw@h2:4222` looks the same, so both are refused, with the fix for
/// each reading. An entry with its own scheme (`,tls://relay:pw@h2`) starts a server.
fn comma_in_credentials(text: &str) -> Option<usize> {
    let has_user_info = |entry: &str| split_nats_url(entry.trim()).1.is_some();
    let entries: Vec<&str> = text.split(',').collect();
    entries
        .windows(2)
        .position(|pair| {
            !has_user_info(pair[0]) && !pair[1].contains("://") && has_user_info(pair[1])
        })
        .map(|before| before + 2)
}

/// NATS URLs (comma-separated, with or without a scheme) with every user info replaced by
/// `<redacted>`; an entry that does not even look like `host:port` is redacted whole, and
/// so is a list where a ',' may have split a credential ([`comma_in_credentials`]).
pub fn redact_nats_urls(text: &str) -> String {
    if comma_in_credentials(text).is_some() {
        return "<redacted>".to_owned();
    }
    text.split(',')
        .map(|entry| match split_nats_url(entry) {
            (scheme, Some(_), rest) => format!("{scheme}<redacted>@{rest}"),
            (_, None, rest) if !nats_host_port_ok(rest.trim()) => "<redacted>".to_owned(),
            _ => entry.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl fmt::Display for NatsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_nats_urls(&self.0))
    }
}

impl fmt::Debug for NatsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NatsUrl({self})")
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The Postgres connection: the server the relay decodes on (its slot and lease).
    pub database: ConnInfo,
    /// With `--primary-url`: the primary, for what must be written while `database` is a
    /// standby (PostgreSQL 16+ decodes there): the publication, heartbeats, the boundary
    /// record, the standby snapshots a slot's creation waits for, marking.
    pub primary: Option<ConnInfo>,
    /// The NATS server(s).
    pub nats_url: NatsUrl,
    /// How to connect to them: the servers without credentials, the credential, TLS.
    pub nats: crate::config::nats::NatsOptions,
    /// The outbox table, with its SQL form.
    pub table: Table,
    /// Which of its columns the relay reads, and how events are shaped from them.
    pub mapping: outbox::Mapping,
    /// The CloudEvents attributes every event carries, if asked for (`--cloudevents`).
    pub cloudevents: Option<outbox::cloudevents::CloudEvents>,
    /// The replication slot.
    pub slot: String,
    /// The publication.
    pub publication: String,
    /// The JetStream stream.
    pub stream: String,
    /// The subject prefix.
    pub subject_prefix: String,
    /// The shard count.
    pub partitions: NonZeroU64,
    /// The in-flight publish window.
    pub max_in_flight: usize,
    /// Duplicate window for a stream the relay creates.
    pub duplicate_window: Duration,
    /// The other settings of a stream the relay creates.
    pub stream_settings: StreamSettings,
    /// Ack timeout.
    pub ack_timeout: Duration,
    /// Shutdown drain deadline.
    pub shutdown_timeout: Duration,
    /// Other writers share the stream: dedupe only.
    pub shared_stream: bool,
    /// What to do with an event JetStream can never accept.
    pub on_poison: sink::PoisonPolicy,
    /// Runtime worker threads (1: a current-thread runtime).
    pub worker_threads: usize,
    /// Slot lag in bytes above which `outbox-relay status` reports lagging.
    pub max_lag_bytes: u64,
    /// Log format.
    pub log_format: LogFormat,
    /// How often the session writes a heartbeat message into the WAL; `None`: never.
    pub heartbeat_interval: Option<Duration>,
    /// Whether the slot is (to be) a PG 17 fail-over slot.
    pub failover_slot: bool,
    /// Metrics and health.
    pub metrics: MetricsConfig,
    /// Whether `run` may create the publication, slot and stream.
    pub create: bool,
    /// Which rows already in the table are published when the slot is created.
    pub backfill: backfill::Mode,
    /// Whether acknowledged rows are marked `published` ([`crate::process::mark`]).
    pub mark_published: bool,
    /// Whether each transaction is published as JetStream atomic batches (`sink::batch`).
    pub atomic_transactions: bool,
    /// Whether streamed events go out as fast-ingest batches where the server and the
    /// stream allow it (`sink::batch` F1–F6, [`crate::stream::atomic`] AT3).
    pub fast_ingest: bool,
    /// Deleting old confirmed rows ([`crate::process::retention`]); `None`: never.
    pub retention: Option<RetentionConfig>,
    /// What to warn about at start, one line each ([`startup_warnings`]).
    pub warnings: Vec<String>,
}

/// Retention's settings ([`crate::process::retention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionConfig {
    /// Rows younger than this (by `created_at`) are kept.
    pub grace: Duration,
    /// Rows per DELETE.
    pub batch: i64,
    /// Time between rounds.
    pub interval: Duration,
}

impl Config {
    /// Every secret of the configuration (the Postgres password, NATS URL credentials), for
    /// the log scrubber.
    pub fn secrets(&self) -> Vec<String> {
        let mut secrets = self.nats_url.secrets();
        secrets.extend(self.nats.secrets());
        for database in std::iter::once(&self.database).chain(&self.primary) {
            secrets.extend(
                database
                    .password()
                    .map(|password| password.expose().to_owned()),
            );
        }
        secrets
    }

    /// Where writes go: `--primary-url` when the relay decodes on a standby, else
    /// `DATABASE_URL`.
    pub fn primary(&self) -> &ConnInfo {
        self.primary.as_ref().unwrap_or(&self.database)
    }

    /// The user names (Postgres, NATS): a secret equal to one is weak for the log scrubber
    /// (`secrets::weakness`).
    pub fn user_names(&self) -> Vec<&str> {
        let mut names = vec![self.database.user()];
        names.extend(self.nats.user());
        names
    }
}

/// The effective configuration, for `outbox-relay config`: every option as a TOML line with
/// where it came from, then the Postgres connection parameter by parameter; no secret (CFG1),
/// and loadable as a config file (CFG6).
pub fn effective(raw: &RawConfig, config: &Config) -> String {
    let mut lines = vec![
        "# outbox-relay: the effective configuration, and where each value came from".to_owned(),
        "# (precedence: flag > environment > config file > the nats CLI's NATS_* variables > default)."
            .to_owned(),
        "# Loadable as a config file (--config). Secrets are never written (CFG6): a URL is shown"
            .to_owned(),
        "# without its password or credentials, and each comment says where to give them."
            .to_owned(),
    ];
    let mut rows: Vec<(String, String)> =
        opt::ALL.iter().map(|spec| option_row(raw, spec)).collect();
    let database_origin = raw
        .values
        .get(opt::DATABASE_URL.key)
        .map(|(_, origin)| origin_of(&opt::DATABASE_URL, origin));
    rows.push((String::new(), String::new()));
    rows.push((
        "# The Postgres connection: libpq parameters (connection string > PG* environment > password file > defaults)".to_owned(),
        String::new(),
    ));
    for (name, value, source) in config.database.describe() {
        let source = match (&source, &database_origin) {
            (replication::Source::ConnString, Some(origin)) => format!("database_url ({origin})"),
            _ => source.to_string(),
        };
        rows.push((format!("# {name} = {}", toml_string(&value)), source));
    }
    lines.extend(aligned(rows));
    lines.push(String::new());
    lines.join("\n")
}

/// `value` as a TOML string.
fn toml_string(value: &str) -> String {
    toml::Value::String(value.to_owned()).to_string()
}

/// Where an option's value came from, in words.
fn origin_of(spec: &OptionSpec, origin: &Origin) -> String {
    match origin {
        Origin::Flag => format!("flag {}", spec.flag()),
        Origin::Env => format!("environment variable {}", spec.env),
        other => other.to_string(),
    }
}

/// One option's line of [`effective`] and its source comment.
fn option_row(raw: &RawConfig, spec: &OptionSpec) -> (String, String) {
    match raw.values.get(spec.key) {
        Some((value, origin)) if key_is_secret(spec.key) => {
            let (loadable, left_out) = loadable_secret(spec, value);
            let origin = origin_of(spec, origin);
            let source = match left_out {
                Some(left_out) => format!("{origin}; {left_out}"),
                None => origin,
            };
            match loadable {
                Some(loadable) => (format!("{} = {}", spec.key, toml_string(&loadable)), source),
                None => (format!("# {} is set ({source})", spec.key), String::new()),
            }
        }
        Some((value, origin)) => (
            format!("{} = {}", spec.key, toml_string(value)),
            origin_of(spec, origin),
        ),
        None if spec.key == opt::DATABASE_URL.key => (
            "# database_url is not set: the PG* environment configures Postgres (below)".to_owned(),
            String::new(),
        ),
        None => (format!("# {} is not set", spec.key), String::new()),
    }
}

/// A secret-bearing option's value as a loadable file may hold it (CFG6): a URL without its
/// password or credentials, nothing for an option that is a secret as a whole; and what was
/// left out, with where to give it when the file is loaded.
fn loadable_secret(spec: &OptionSpec, value: &str) -> (Option<String>, Option<String>) {
    let left_out = |what: &str| {
        Some(format!("{what} not written: {}", match spec.key {
        "database_url" | "primary_url" => "give it as PGPASSWORD or in the password file (~/.pgpass)",
        "nats_url" => "give them as OUTBOX_RELAY_NATS_USER and OUTBOX_RELAY_NATS_PASSWORD, or OUTBOX_RELAY_NATS_TOKEN",
        _ => "keep it in its environment variable",
    }))
    };
    match spec.key {
        "database_url" | "primary_url" => match without_password(value) {
            Some(url) if url != value => (Some(url), left_out("the password")),
            Some(url) => (Some(url), None),
            None => (None, left_out("the URL")),
        },
        "nats_url" if comma_in_credentials(value).is_none() => {
            let mut credentials = false;
            let urls: Vec<String> = value
                .split(',')
                .map(|entry| match split_nats_url(entry) {
                    (scheme, Some(_), rest) => {
                        credentials = true;
                        format!("{scheme}{rest}")
                    }
                    _ => entry.to_owned(),
                })
                .collect();
            (
                Some(urls.join(",")),
                credentials.then(|| left_out("the credentials")).flatten(),
            )
        }
        _ => (None, Some(format!("not written: keep it in {}", spec.env))),
    }
}

/// A libpq connection string without its password: the URL's `user:password@` and
/// `password=` parameter, or the `password = …` pair of the key=value form. `None` when it
/// cannot be taken apart safely.
fn without_password(conninfo: &str) -> Option<String> {
    let trimmed = conninfo.trim();
    if let Some(rest) = ["postgresql://", "postgres://"]
        .iter()
        .find_map(|scheme| trimmed.strip_prefix(scheme).map(|rest| (*scheme, rest)))
    {
        let (scheme, rest) = rest;
        // As libpq reads it: user information is what comes before an '@' that precedes
        // any '/' (a '?' in an unencoded password does not end it).
        let (user, rest) = match rest.find(['@', '/']) {
            Some(at) if rest[at..].starts_with('@') => {
                let userinfo = &rest[..at];
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                (format!("{user}@"), &rest[at + 1..])
            }
            _ => (String::new(), rest),
        };
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (hosts, tail) = rest.split_at(authority_end);
        let authority = format!("{user}{hosts}");
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let kept: Vec<&str> = query
                    .split('&')
                    .filter(|pair| !pair.starts_with("password="))
                    .collect();
                if kept.is_empty() {
                    path.to_owned()
                } else {
                    format!("{path}?{}", kept.join("&"))
                }
            }
            None => tail.to_owned(),
        };
        return Some(format!("{scheme}{authority}{tail}"));
    }
    let pairs = replication::conninfo_pairs(trimmed).ok()?;
    let kept: Vec<String> = pairs
        .iter()
        .filter(|(key, _)| key != "password")
        .map(|(key, value)| format!("{key}={}", replication::quote_conninfo_value(value)))
        .collect();
    Some(kept.join(" "))
}

/// Each `(line, source)` as the line with its source as a comment, the comments aligned
/// (a row without a source is its line alone).
fn aligned(rows: Vec<(String, String)>) -> impl Iterator<Item = String> {
    let width = rows
        .iter()
        .filter(|(_, source)| !source.is_empty())
        .map(|(line, _)| line.chars().count())
        .max()
        .unwrap_or(0);
    rows.into_iter().map(move |(line, source)| {
        if source.is_empty() {
            line
        } else {
            format!("{line:<width$}  # {source}")
        }
    })
}

/// The settings of a stream the relay creates (`crate::stream::policy::stream`) besides its
/// subjects and duplicate window; an existing stream is checked against the ones given
/// explicitly.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// Replicas, 1 to 5.
    pub replicas: usize,
    /// File or memory storage.
    pub storage: StorageType,
    /// Events older than this are deleted; `None`: kept whatever their age.
    pub max_age: Option<Duration>,
    /// Size limit in bytes (at most `i64::MAX`); `None`: unlimited.
    pub max_bytes: Option<u64>,
    /// Largest message in bytes (at most `i32::MAX`); `None`: the server's `max_payload`.
    pub max_msg_size: Option<u64>,
    /// What the stream does at its size limit.
    pub discard: DiscardPolicy,
    /// The options among these given by a flag, the environment or the file (not defaults).
    pub given: Vec<&'static OptionSpec>,
}

impl StreamSettings {
    fn from_raw(raw: &RawConfig) -> Result<StreamSettings, ConfigError> {
        use opt::*;
        let replicas = raw.parse(&STREAM_REPLICAS, |v| match v.parse::<usize>() {
            Ok(n) if (1..=5).contains(&n) => Ok(n),
            _ => Err("expected 1 to 5 (JetStream keeps at most 5 replicas)".into()),
        })?;
        let storage = raw.parse(&STREAM_STORAGE, |v| {
            parse::one_of(
                v,
                &[("file", StorageType::File), ("memory", StorageType::Memory)],
            )
        })?;
        let max_age = raw.parse(&STREAM_MAX_AGE, |v| unlimited_or(v, parse_duration))?;
        let max_bytes = raw.parse(&STREAM_MAX_BYTES, |v| {
            unlimited_or(v, |v| at_most(parse_size(v)?, i64::MAX as u64))
        })?;
        let max_msg_size = raw.parse(&STREAM_MAX_MSG_SIZE, |v| {
            unlimited_or(v, |v| at_most(parse_size(v)?, i32::MAX as u64))
        })?;
        let discard = raw.parse(&STREAM_DISCARD, |v| {
            parse::one_of(
                v,
                &[("old", DiscardPolicy::Old), ("new", DiscardPolicy::New)],
            )
        })?;
        let given = [
            &STREAM_REPLICAS,
            &STREAM_STORAGE,
            &STREAM_MAX_AGE,
            &STREAM_MAX_BYTES,
            &STREAM_MAX_MSG_SIZE,
            &STREAM_DISCARD,
        ]
        .into_iter()
        .filter(|spec| {
            raw.values
                .get(spec.key)
                .is_some_and(|(_, origin)| *origin != Origin::Default)
        })
        .collect();
        Ok(StreamSettings {
            replicas,
            storage,
            max_age,
            max_bytes,
            max_msg_size,
            discard,
            given,
        })
    }
}

/// Metrics and health (`crate::observe::metrics`, `crate::observe::http`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Where to serve `/metrics`, `/healthz` and `/readyz`; `None`: nowhere. `/readyz`
    /// answers stalled above [`Config::max_lag_bytes`].
    pub addr: Option<SocketAddr>,
}

impl MetricsConfig {
    /// The metrics options alone (`outbox-relay probe` needs no other).
    pub fn from_raw(raw: &RawConfig) -> Result<MetricsConfig, ConfigError> {
        Ok(MetricsConfig {
            addr: raw.parse_optional(&opt::METRICS_ADDR, parse_listen_addr)?,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A config from flags, environment variables and a file's text.
    pub(crate) fn load(
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Result<Config, ConfigError> {
        // The file stays until the configuration is validated (its mode is checked then).
        let dir = tempfile::tempdir().unwrap();
        load_raw_in(dir.path(), flags, env, file).and_then(|raw| Config::from_sources(&raw))
    }

    /// A config from a `DATABASE_URL` alone.
    pub(crate) fn load_url(url: &str) -> Result<Config, ConfigError> {
        load(&[], &[("DATABASE_URL", url)], None)
    }

    fn load_raw(
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Result<RawConfig, ConfigError> {
        // Removed when the load returns: the tests leave no directory behind.
        let dir = tempfile::tempdir().unwrap();
        load_raw_in(dir.path(), flags, env, file)
    }

    /// [`load_raw`] with the file `relay.toml` written in `dir`.
    fn load_raw_in(
        dir: &Path,
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Result<RawConfig, ConfigError> {
        let flags = flags.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let env_map: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let path = dir.join("relay.toml");
        if let Some(text) = file {
            std::fs::write(&path, text).unwrap();
        }
        let keys: Vec<String> = env_map.keys().cloned().collect();
        RawConfig::load(
            &flags,
            &|k| env_map.get(k).cloned(),
            &keys,
            file.map(|_| path.as_path()),
        )
    }

    /// The `nats` CLI's variables are honoured below the relay's own variables and its file,
    /// and `config` names them as the origin.
    #[test]
    fn the_nats_clis_variables_are_honoured_below_the_relays_own() {
        let base = [("DATABASE_URL", "postgres://u@h/db")];
        let nats_cli = [("NATS_USER", "cli-user"), ("NATS_PASSWORD", "Cli-pw-4f1x")];
        let env: Vec<(&str, &str)> = base.iter().chain(&nats_cli).copied().collect();
        let raw = load_raw(&[], &env, None).unwrap();
        assert_eq!(raw.name(&opt::NATS_USER).as_deref(), Some("NATS_USER"));
        let config = Config::from_sources(&raw).unwrap();
        assert_eq!(config.nats.user(), Some("cli-user"));
        let shown = effective(&raw, &config);
        assert!(
            shown.contains("the nats CLI's environment variable NATS_USER")
                && !shown.contains("Cli-pw-4f1x"),
            "{shown}"
        );

        let mut ours = env.clone();
        ours.push(("OUTBOX_RELAY_NATS_USER", "relay-user"));
        let config = load(&[], &ours, None).unwrap();
        assert_eq!(config.nats.user(), Some("relay-user"));
        let config = load(&[], &env, Some("nats_user = \"file-user\"")).unwrap();
        assert_eq!(config.nats.user(), Some("file-user"));
    }

    const DB: (&str, &str) = ("DATABASE_URL", "postgres://relay:s3cret@db:5432/app");

    #[test]
    fn defaults() {
        let config = load(&[], &[DB], None).unwrap();
        assert_eq!(
            config.table,
            TableName {
                schema: "public".into(),
                name: "outbox_events".into()
            }
        );
        assert_eq!(config.slot, "outbox_relay");
        assert_eq!(config.publication, "outbox_relay");
        assert_eq!(config.stream, "OUTBOX");
        assert_eq!(config.subject_prefix, "outbox");
        assert_eq!(config.partitions.get(), 12);
        assert_eq!(config.nats_url.expose(), "nats://127.0.0.1:4222");
        assert_eq!(config.duplicate_window, Duration::from_secs(120));
    }

    #[test]
    fn flag_over_env_over_file() {
        let file = "partitions = 3\nstream = \"FROM_FILE\"\nslot = \"file_slot\"\n";
        let config = load(
            &[("partitions", "5")],
            &[
                DB,
                ("OUTBOX_RELAY_PARTITIONS", "4"),
                ("OUTBOX_RELAY_STREAM", "FROM_ENV"),
            ],
            Some(file),
        )
        .unwrap();
        assert_eq!(config.partitions.get(), 5);
        assert_eq!(config.stream, "FROM_ENV");
        assert_eq!(config.slot, "file_slot");
    }

    #[test]
    fn errors_name_the_key_as_given() {
        let e = load(&[], &[DB, ("OUTBOX_RELAY_PARTITIONS", "zero")], None).unwrap_err();
        assert!(
            e.0.contains("OUTBOX_RELAY_PARTITIONS") && e.0.contains("positive integer"),
            "{e}"
        );
        let e = load(&[("partitions", "0")], &[DB], None).unwrap_err();
        assert!(e.0.contains("--partitions"), "{e}");
        let e = load(&[], &[DB], Some("partitions = 0\n")).unwrap_err();
        assert!(e.0.contains("partitions (in "), "{e}");
        let e = load(&[], &[DB, ("OUTBOX_RELAY_SLOT", "Bad-Slot")], None).unwrap_err();
        assert!(e.0.contains("OUTBOX_RELAY_SLOT"), "{e}");
        let e = load(
            &[],
            &[DB, ("OUTBOX_RELAY_DUPLICATE_WINDOW", "2 fortnights")],
            None,
        )
        .unwrap_err();
        assert!(e.0.contains("OUTBOX_RELAY_DUPLICATE_WINDOW"), "{e}");
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = load(&[], &[DB], Some("partitionz = 3\n")).unwrap_err();
        assert!(e.0.contains("unknown key \"partitionz\""), "{e}");
        let e = load(&[], &[DB, ("OUTBOX_RELAY_PARTITIONZ", "3")], None).unwrap_err();
        assert!(e.0.contains("OUTBOX_RELAY_PARTITIONZ"), "{e}");
    }

    #[test]
    fn database_url_is_required() {
        let e = load(&[], &[], None).unwrap_err();
        assert!(e.0.contains("DATABASE_URL is required"), "{e}");
    }

    #[test]
    fn secrets_never_print() {
        let config = load(
            &[],
            &[DB, ("NATS_URL", "nats://user:hunter2@nats:4222")],
            None,
        )
        .unwrap();
        let shown = format!("{config:?} {}", config.nats_url);
        assert!(
            !shown.contains("s3cret") && !shown.contains("hunter2"),
            "{shown}"
        );
        let e = load_url("postgres://u:s3cret@h:notaport/db").unwrap_err();
        assert!(
            !e.0.contains("s3cret") && e.0.contains("DATABASE_URL"),
            "{e}"
        );
    }

    /// Item 8 of issue 7: NATS URLs without a scheme, TOML syntax errors, passwords with
    /// '?' and '=', and `RawConfig`'s `Debug`.
    #[test]
    fn secrets_never_print_in_any_form() {
        // A NATS URL without a scheme, with a password or a token; several servers.
        for (url, secret) in [
            ("user:hunter2@nats:4222", "hunter2"),
            ("tok3n-hunter2@nats:4222", "tok3n-hunter2"),
            ("nats://a:4222,nats://u:hunter2@b:4222", "hunter2"),
            ("tls://u:p%40ss-hunter2@nats:4222", "hunter2"),
        ] {
            let config = load(&[], &[DB, ("NATS_URL", url)], None).unwrap();
            let shown = format!("{config:?} {}", config.nats_url);
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.contains("<redacted>@"), "{shown}");
            assert!(
                config.secrets().iter().any(|s| s.contains("hunter2")),
                "the scrubber learns the secret: {:?}",
                config.secrets()
            );
        }
        // A ',' in a password splits the list: refused without quoting any part.
        let e = load(
            &[],
            &[DB, ("NATS_URL", "nats://u:hunter2,x@nats:4222")],
            None,
        )
        .unwrap_err();
        assert!(e.0.contains("NATS_URL") && !e.0.contains("hunter2"), "{e}");
        assert!(e.0.contains("%2C"), "{e}");
        assert_eq!(redact_nats_urls("u:hunter2"), "<redacted>");
    }

    /// Issue 18 case 6: a ',' in a NATS credential is refused with the advice to
    /// percent-encode it, never read as two servers; no part of the password is shown
    /// anywhere, `outbox-relay config`'s redaction included.
    #[test]
    fn a_comma_in_nats_credentials_is_refused_not_split() {
        for url in [
            "nats://relay:2024,Spring!@h:4222",
            "relay:2024,Spring!@h:4222",
            "nats://relay:20,24@h:4222",
            "nats://tq,kZq@h",
            "nats://us,er:2024Spring@h",
            // Credentials on a later server only, without a scheme: the same shape.
            "nats://a:4222,u:2024Spring@b:4222",
        ] {
            let e = load(&[], &[DB, ("NATS_URL", url)], None).unwrap_err();
            assert!(
                e.0.contains("invalid NATS_URL") && e.0.contains("%2C"),
                "{url}: {e}"
            );
            for part in ["2024", "Spring", "kZq", "us,er"] {
                assert!(!e.0.contains(part), "{url}: {e}");
            }
            let shown = redact_nats_urls(url);
            assert!(
                !shown.contains("Spring") && !shown.contains("2024") && !shown.contains("kZq"),
                "{shown}"
            );
        }
        // Percent-encoded, it is one server and one password.
        let config = load(
            &[],
            &[DB, ("NATS_URL", "nats://relay:2024%2CSpring!@h:4222")],
            None,
        )
        .unwrap();
        assert_eq!(config.nats.servers(), ["nats://h:4222"]);
        assert!(config.secrets().iter().any(|s| s == "2024,Spring!"));
        // A server with its own scheme starts a new server.
        let config = load(
            &[],
            &[DB, ("NATS_URL", "nats://a:4222,tls://u:2024Spring@b:4222")],
            None,
        )
        .unwrap();
        assert_eq!(config.nats.servers(), ["nats://a:4222", "tls://b:4222"]);
    }

    /// The warnings of a configuration that loads, for one risk each.
    fn warnings(
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Vec<String> {
        let config = load(flags, env, file).unwrap();
        let shown = config.warnings.join("\n");
        for secret in config.secrets() {
            assert!(
                !shown.contains(&secret),
                "a warning shows a secret: {shown}"
            );
        }
        config.warnings
    }

    /// The one warning containing `part` (each risk is said once), or a panic listing them.
    fn the_warning<'a>(warnings: &'a [String], part: &str) -> &'a str {
        let found: Vec<&String> = warnings.iter().filter(|w| w.contains(part)).collect();
        assert_eq!(found.len(), 1, "{part:?} in {warnings:#?}");
        found[0]
    }

    const HARDENED_DB: (&str, &str) = (
        "DATABASE_URL",
        "postgres://relay:Q9-long-random-pw@db/app?sslmode=verify-full&sslrootcert=/etc/ca.crt",
    );
    const HARDENED_NATS: (&str, &str) = ("NATS_URL", "tls://relay:W7-long-random-pw@nats:4222");

    /// Issue 18 cases 6 and 9: a hardened configuration warns about nothing; each risk
    /// gets one line that names it and the fix, never the secret.
    #[test]
    fn startup_warnings_name_each_risk_once() {
        assert_eq!(
            warnings(&[], &[HARDENED_DB, HARDENED_NATS], None),
            [] as [String; 0]
        );
        assert_eq!(
            warnings(
                &[],
                &[
                    (
                        "DATABASE_URL",
                        "postgres://relay:Q9-long-random-pw@db/app?require_auth=scram-sha-256"
                    ),
                    (
                        "NATS_URL",
                        "nats://relay:W7-long-random-pw@nats:4222,tls://relay:W7-long-random-pw@n2"
                    ),
                    ("OUTBOX_RELAY_NATS_TLSFIRST", "true"),
                ],
                None
            ),
            [] as [String; 0],
            "SCRAM required, and TLS demanded for every server"
        );

        // Secrets on the command line.
        let w = warnings(
            &[
                ("nats_user", "relay"),
                ("nats_password", "W7-long-random-pw"),
            ],
            &[HARDENED_DB, ("NATS_URL", "tls://nats:4222")],
            None,
        );
        assert!(
            the_warning(&w, "--password is given on the command line")
                .contains("set OUTBOX_RELAY_NATS_PASSWORD or the file key nats_password"),
            "{w:?}"
        );
        assert_eq!(w.len(), 1, "{w:?}");
        let w = warnings(
            &[("nats_token", "W7-long-random-pw")],
            &[HARDENED_DB, ("NATS_URL", "tls://nats:4222")],
            None,
        );
        the_warning(&w, "--token is given on the command line");
        let w = warnings(
            &[
                ("database_url", HARDENED_DB.1),
                ("nats_url", HARDENED_NATS.1),
            ],
            &[],
            None,
        );
        assert!(
            the_warning(
                &w,
                "--database-url holds a password and is given on the command line"
            )
            .contains("PGPASSWORD"),
            "{w:?}"
        );
        the_warning(
            &w,
            "--nats-url holds credentials and is given on the command line",
        );
        assert_eq!(w.len(), 2, "{w:?}");
        // Without a password in it, the URL on the command line is no secret.
        let w = warnings(
            &[(
                "database_url",
                "postgres://relay@db/app?sslmode=verify-full&sslrootcert=/ca",
            )],
            &[HARDENED_NATS],
            None,
        );
        assert_eq!(w, [] as [String; 0]);

        // Files holding secrets that group or others can read.
        let dir = tempfile::tempdir().unwrap();
        let seed = dir.path().join("relay.nk");
        let seed_text = nkeys::KeyPair::new_user().seed().unwrap();
        testkit::write_file_mode(&seed, &seed_text, 0o644);
        let seed_env = ("OUTBOX_RELAY_NATS_NKEY", seed.to_str().unwrap());
        let w = warnings(
            &[],
            &[HARDENED_DB, ("NATS_URL", "tls://nats:4222"), seed_env],
            None,
        );
        assert!(
            the_warning(&w, "OUTBOX_RELAY_NATS_NKEY file")
                .contains("has group or world access (mode 0644)")
                && w[0].contains("or less (chmod 6")
                && w[0].contains("nkey seed"),
            "{w:?}"
        );
        testkit::write_file_mode(&seed, &seed_text, 0o600);
        let w = warnings(
            &[],
            &[HARDENED_DB, ("NATS_URL", "tls://nats:4222"), seed_env],
            None,
        );
        assert_eq!(w, [] as [String; 0]);
        // The config file, when it holds a secret (here one that the environment overrides).
        let file = "nats_password = \"W7-long-random-pw\"\nnats_user = \"relay\"\n";
        let w = warnings(
            &[],
            &[
                HARDENED_DB,
                ("NATS_URL", "tls://nats:4222"),
                ("OUTBOX_RELAY_NATS_PASSWORD", "X8-other-pw"),
            ],
            Some(file),
        );
        the_warning(&w, "config file");
        assert!(
            w[0].contains("has group or world access") && w[0].contains("holds a secret"),
            "{w:?}"
        );
        let w = warnings(&[], &[HARDENED_DB, HARDENED_NATS], Some("partitions = 3\n"));
        assert_eq!(w, [] as [String; 0], "no secret in the file");

        // Secrets too weak for the log scrubber.
        let w = warnings(
            &[],
            &[
                (
                    "DATABASE_URL",
                    "postgres://relay:relay@db/app?sslmode=verify-full&sslrootcert=/ca",
                ),
                ("NATS_URL", "tls://abc@nats:4222"),
            ],
            None,
        );
        assert!(
            the_warning(
                &w,
                "the Postgres password (from the connection string) is the same as a user name"
            )
            .contains("log scrubber"),
            "{w:?}"
        );
        the_warning(
            &w,
            "the NATS token (of the token in NATS_URL) is shorter than 4 characters (3)",
        );
        let w = warnings(
            &[],
            &[
                HARDENED_DB,
                ("NATS_URL", "tls://nats:4222"),
                ("OUTBOX_RELAY_NATS_TOKEN", "Secret"),
            ],
            None,
        );
        the_warning(&w, "OUTBOX_RELAY_NATS_TOKEN) is a common word");

        // Credentials without verified TLS.
        for (url, mode) in [
            ("postgres://relay:Q9-long-random-pw@db/app", "prefer"),
            (
                "postgres://relay:Q9-long-random-pw@db/app?sslmode=require",
                "require",
            ),
            (
                "postgres://relay:Q9-long-random-pw@db/app?sslmode=verify-ca&require_auth=md5",
                "verify-ca",
            ),
        ] {
            let w = warnings(&[], &[("DATABASE_URL", url), HARDENED_NATS], None);
            assert!(
                the_warning(&w, &format!("Postgres: sslmode={mode} does not verify"))
                    .contains("require_auth=scram-sha-256"),
                "{w:?}"
            );
        }
        let w = warnings(
            &[],
            &[("DATABASE_URL", "postgres://relay@db/app"), HARDENED_NATS],
            None,
        );
        assert_eq!(w, [] as [String; 0], "no password, nothing to reveal");
        let w = warnings(
            &[],
            &[
                (
                    "DATABASE_URL",
                    "postgres://relay:Q9-long-random-pw@db/app?sslmode=require&channel_binding=require",
                ),
                HARDENED_NATS,
            ],
            None,
        );
        assert_eq!(w, [] as [String; 0], "SCRAM-SHA-256-PLUS only");
        let w = warnings(
            &[],
            &[
                HARDENED_DB,
                ("NATS_URL", "nats://relay:W7-long-random-pw@nats:4222"),
            ],
            None,
        );
        assert!(
            the_warning(&w, "NATS: the credentials of the user:password in NATS_URL")
                .contains("use tls:// URLs or --tlsca"),
            "{w:?}"
        );
        let w = warnings(
            &[],
            &[
                HARDENED_DB,
                ("NATS_URL", "tls://a:4222,nats://b:4222"),
                ("OUTBOX_RELAY_NATS_TOKEN", "W7-long-random-pw"),
            ],
            None,
        );
        the_warning(&w, "NATS: the credentials of OUTBOX_RELAY_NATS_TOKEN");
        let seed_env = ("OUTBOX_RELAY_NATS_NKEY", seed.to_str().unwrap());
        let w = warnings(
            &[],
            &[HARDENED_DB, ("NATS_URL", "nats://nats:4222"), seed_env],
            None,
        );
        assert_eq!(w, [] as [String; 0], "an nkey reveals nothing");
    }

    /// Issue 18 case 8: WebSocket URLs are refused at start, saying what to use instead.
    #[test]
    fn websocket_nats_urls_are_refused() {
        for url in ["ws://h:8080", "nats://a:4222, wss://u:p@h:443"] {
            let e = load(&[], &[DB, ("NATS_URL", url)], None).unwrap_err();
            assert!(
                e.0.contains("WebSocket URL")
                    && e.0.contains("NATS TCP protocol only")
                    && e.0.contains("nats://host:4222")
                    && e.0.contains("tls://"),
                "{url}: {e}"
            );
            assert!(!e.0.contains(":p@"), "{e}");
        }

        // TOML syntax errors locate the problem without echoing the line.
        for file in [
            "database_url = \"postgres://relay:hunter2@db/app\n",
            "database_url = postgres://relay:hunter2@db/app\n",
            "database_url = \"postgres://relay:hunter2\\q@db/app\"\n",
            "database_url = \"postgres://relay:hunter2@db/app\" trailing\n",
            "nats_url = 'nats://u:hunter2@n:4222'\nnats_url = 'x'\n",
        ] {
            let e = load(&[], &[], Some(file)).unwrap_err();
            assert!(!e.0.contains("hunter2"), "{e}");
            assert!(e.0.contains("is not valid TOML at line "), "{e}");
        }
        // A wrong type names the key, not the value.
        let e = load(&[], &[], Some("database_url = [\"hunter2\"]\n")).unwrap_err();
        assert!(
            e.0.contains("database_url") && !e.0.contains("hunter2"),
            "{e}"
        );

        // Unencoded '?' and '=' in a DATABASE_URL password: parsed whole, and an error
        // elsewhere in the URL does not quote a part of it.
        let config = load_url("postgres://relay:hun?ter=2@db:5432/app").unwrap();
        assert_eq!(
            config.database.password().map(|p| p.expose()),
            Some("hun?ter=2")
        );
        assert_eq!(
            (config.database.host(), config.database.dbname()),
            ("db", "app")
        );
        for url in [
            "postgres://relay:hunter2?x=hunter2@db:notaport/app",
            "postgres://relay:hunter2/app",
            "user=relay password=hunter2 hunter2=1",
        ] {
            let e = load(&[], &[("DATABASE_URL", url)], None).unwrap_err();
            assert!(
                !e.0.contains("hunter2") && e.0.contains("DATABASE_URL"),
                "{e}"
            );
        }

        // RawConfig's Debug, from every source.
        let raw = load_raw(
            &[("database_url", "postgres://relay:hunter2@db/app")],
            &[
                ("NATS_URL", "u:hunter2@nats:4222"),
                ("PGPASSWORD", "hunter2"),
            ],
            Some("nats_url = \"nats://u:hunter2@n:4222\"\n"),
        )
        .unwrap();
        let shown = format!("{raw:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("PGPASSWORD"), "names, not values: {shown}");
    }

    /// `--primary-url` (decoding on a standby): a secret like `DATABASE_URL`, where writes go,
    /// and refused with what it cannot do yet.
    #[test]
    fn a_primary_url_is_secret_and_refuses_failover_slots_and_retention() {
        let primary = ("primary_url", "postgres://relay:hunter2@primary/app");
        let config = load(&[primary], &[DB], None).unwrap();
        assert_eq!(config.primary().host(), "primary");
        assert!(config.secrets().iter().any(|s| s == "hunter2"));
        let shown = effective(&load_raw(&[primary], &[DB], None).unwrap(), &config);
        assert!(
            !shown.contains("hunter2") && shown.contains("primary_url = "),
            "{shown}"
        );
        assert_eq!(load(&[], &[DB], None).unwrap().primary().host(), "db");
        for (setting, named) in [
            (("failover_slot", "true"), "--failover-slot"),
            (("retention_grace", "7d"), "--retention-grace"),
        ] {
            let e = load(&[primary, setting], &[DB], None).unwrap_err();
            assert!(e.0.contains(named) && e.0.contains("--primary-url"), "{e}");
        }
    }

    #[test]
    fn pg_environment_alone_configures_postgres() {
        let config = load(
            &[],
            &[
                ("PGHOST", "envhost"),
                ("PGDATABASE", "app"),
                ("PGUSER", "relay"),
                ("PGPASSWORD", "hunter2"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(
            (config.database.host(), config.database.dbname()),
            ("envhost", "app")
        );
        assert_eq!(
            config.database.source("host"),
            &replication::Source::Env("PGHOST")
        );
        // DATABASE_URL wins parameter by parameter.
        let config = load(
            &[],
            &[DB, ("PGHOST", "envhost"), ("PGAPPNAME", "from-env")],
            None,
        )
        .unwrap();
        assert_eq!(config.database.host(), "db");
        assert_eq!(config.database.application_name(), Some("from-env"));
        let e = load(&[], &[("PGHOSTADDR", "10.0.0.1"), ("PGHOST", "h")], None).unwrap_err();
        assert!(e.0.contains("PGHOSTADDR"), "{e}");
    }

    /// `outbox-relay config`'s text for `partitions = 5` given as a flag, `stream` in a file,
    /// and `env`; with the configuration it shows.
    fn shown(env: &[(&str, &str)]) -> (Config, String) {
        let raw = load_raw(
            &[("partitions", "5")],
            env,
            Some("stream = \"FROM_FILE\"\n"),
        )
        .unwrap();
        let config = Config::from_sources(&raw).unwrap();
        let text = effective(&raw, &config);
        assert!(!text.contains("hunter2"), "{text}");
        (config, text)
    }

    #[test]
    fn effective_configuration_shows_values_and_origins_but_no_secret() {
        let (_, text) = shown(&[
            (
                "DATABASE_URL",
                "postgres://relay:hunter2@db:5432/app?sslmode=require",
            ),
            ("NATS_URL", "nats://u:hunter2@nats:4222"),
            ("PGAPPNAME", "from-env"),
        ]);
        for expected in [
            "partitions = \"5\"",
            "# flag --partitions",
            "stream = \"FROM_FILE\"",
            "# config file ",
            "database_url = \"postgres://relay@db:5432/app?sslmode=require\"",
            "# environment variable DATABASE_URL; the password not written: give it as PGPASSWORD",
            "nats_url = \"nats://nats:4222\"",
            "the credentials not written: give them as OUTBOX_RELAY_NATS_USER",
            "slot = \"outbox_relay\"",
            "# default",
            "# password = \"<redacted>\"",
            "# database_url (environment variable DATABASE_URL)",
            "# application_name = \"from-env\"",
            "# environment variable PGAPPNAME",
            "# sslmode = \"require\"",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from\n{text}");
        }
    }

    /// CFG6: what `config` prints loads back (`--config`) to the same settings, the secrets
    /// given where its comments say; no secret and no placeholder in it.
    #[test]
    fn the_effective_configuration_loads_back_without_its_secrets() {
        for database_url in [
            "postgres://relay:hunter2@db:5432/app?sslmode=require&password=hunter2&connect_timeout=7",
            "host=db port=5432 user=relay password='hunter2' dbname=app sslmode=require connect_timeout=7",
        ] {
            let (config, text) = shown(&[
                ("DATABASE_URL", database_url),
                (
                    "NATS_URL",
                    "nats://u:hunter2@nats:4222,nats://u:hunter2@nats2:4222",
                ),
                ("OUTBOX_RELAY_TABLE", "\"Billing\".\"Outbox Events\""),
            ]);
            assert!(
                text.lines()
                    .all(|line| line.starts_with('#') || !line.contains("redacted")),
                "no placeholder outside a comment: {text}"
            );
            let secrets = [
                ("PGPASSWORD", "hunter2"),
                ("OUTBOX_RELAY_NATS_USER", "u"),
                ("OUTBOX_RELAY_NATS_PASSWORD", "hunter2"),
            ];
            let loaded = load(&[], &secrets, Some(&text)).unwrap();
            assert_eq!(loaded.database.redacted(), config.database.redacted());
            assert_eq!(
                loaded.database.password().map(|p| p.expose().to_owned()),
                Some("hunter2".to_owned())
            );
            assert_eq!(loaded.database.connect_timeout(), config.database.connect_timeout());
            assert_eq!(loaded.nats.user(), Some("u"));
            assert_eq!(loaded.partitions, config.partitions);
            assert_eq!(loaded.stream, "FROM_FILE");
            assert_eq!(loaded.table.sql(), config.table.sql());
        }
        for (url, without) in [
            (
                "postgresql://relay:p%40ss@h1:5432,h2:5433/app",
                "postgresql://relay@h1:5432,h2:5433/app",
            ),
            (
                "postgres://u:Pg?pw=s3cret@h:5432/app?sslmode=disable",
                "postgres://u@h:5432/app?sslmode=disable",
            ),
            ("postgres://h/app?password=x", "postgres://h/app"),
            (
                "host=h application_name='my app'",
                "host=h application_name='my app'",
            ),
        ] {
            assert_eq!(without_password(url).as_deref(), Some(without), "{url}");
        }
    }

    #[test]
    fn metrics_addresses() {
        let config = load(&[], &[DB], None).unwrap();
        assert_eq!(config.metrics.addr, None, "off unless set");
        let config = load(&[("metrics_addr", ":9464")], &[DB], None).unwrap();
        assert_eq!(config.metrics.addr, Some("0.0.0.0:9464".parse().unwrap()));
        assert_eq!(parse_listen_addr("[::1]:0"), Ok("[::1]:0".parse().unwrap()));
        let e = load(
            &[],
            &[DB, ("OUTBOX_RELAY_METRICS_ADDR", "localhost:9464")],
            None,
        )
        .unwrap_err();
        assert!(
            e.0.contains("OUTBOX_RELAY_METRICS_ADDR") && e.0.contains("0.0.0.0:9464"),
            "{e}"
        );
    }

    #[test]
    fn stream_settings_default_to_a_file_stream_without_limits() {
        let config = load(&[], &[DB], None).unwrap();
        let settings = &config.stream_settings;
        assert_eq!(settings.replicas, 1);
        assert_eq!(settings.storage, StorageType::File);
        assert_eq!(
            (settings.max_age, settings.max_bytes, settings.max_msg_size),
            (None, None, None)
        );
        assert_eq!(settings.discard, DiscardPolicy::Old);
        assert!(settings.given.is_empty(), "defaults are not given");
        assert_eq!(config.max_lag_bytes, 1 << 30);
    }

    #[test]
    fn stream_settings_come_from_every_source_and_remember_which_were_given() {
        let config = load(
            &[("stream_max_bytes", "10GiB")],
            &[
                DB,
                ("OUTBOX_RELAY_STREAM_STORAGE", "memory"),
                ("OUTBOX_RELAY_STREAM_DISCARD", "new"),
                ("OUTBOX_RELAY_MAX_LAG_BYTES", "512MiB"),
            ],
            Some("stream_max_age = \"7d\"\nstream_max_msg_size = \"1MiB\"\nstream_replicas = 3\n"),
        )
        .unwrap();
        let settings = &config.stream_settings;
        assert_eq!(settings.replicas, 3);
        assert_eq!(settings.storage, StorageType::Memory);
        assert_eq!(settings.max_age, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(settings.max_bytes, Some(10 << 30));
        assert_eq!(settings.max_msg_size, Some(1 << 20));
        assert_eq!(settings.discard, DiscardPolicy::New);
        let mut given: Vec<&str> = settings.given.iter().map(|spec| spec.key).collect();
        given.sort_unstable();
        assert_eq!(
            given,
            [
                "stream_discard",
                "stream_max_age",
                "stream_max_bytes",
                "stream_max_msg_size",
                "stream_replicas",
                "stream_storage"
            ]
        );
        assert_eq!(config.max_lag_bytes, 512 << 20);
    }

    #[test]
    fn invalid_stream_settings_name_the_option_and_what_it_takes() {
        for (env, value, expected) in [
            ("OUTBOX_RELAY_STREAM_REPLICAS", "6", "expected 1 to 5"),
            (
                "OUTBOX_RELAY_STREAM_STORAGE",
                "disk",
                "expected file or memory",
            ),
            (
                "OUTBOX_RELAY_STREAM_DISCARD",
                "oldest",
                "expected old or new",
            ),
            (
                "OUTBOX_RELAY_STREAM_MAX_BYTES",
                "0",
                "greater than zero, or unlimited",
            ),
            ("OUTBOX_RELAY_STREAM_MAX_BYTES", "10XB", "unknown unit"),
            (
                "OUTBOX_RELAY_STREAM_MAX_MSG_SIZE",
                "4GiB",
                "at most 2147483647 bytes",
            ),
            ("OUTBOX_RELAY_STREAM_MAX_AGE", "forever", "or unlimited"),
            ("OUTBOX_RELAY_MAX_LAG_BYTES", "unlimited", "expected a size"),
        ] {
            let e = load(&[], &[DB, (env, value)], None).unwrap_err();
            assert!(
                e.0.contains(env) && e.0.contains(expected),
                "{env}={value}: {e}"
            );
        }
        let e = load(&[("stream_max_age", "1m")], &[DB], None).unwrap_err();
        assert!(
            e.0.contains("--stream-max-age (1m) is shorter than duplicate_window (default) (2m)"),
            "{e}"
        );
    }

    #[test]
    fn sizes_parse_in_powers_of_1024_and_print_back() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("64mb"), Ok(64 << 20));
        assert_eq!(parse_size("10 GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("7b"), Ok(7));
        assert!(parse_size("1.5GiB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(format_size(56), "56 B");
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(123_456), "120.6 KiB");
        assert_eq!(parse_size(&format_size(64 << 20)), Ok(64 << 20));
        for text in ["500ms", "90s", "2m", "1h", "7d"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(604_800)));
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration("2min"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1_500)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn heartbeats_are_off_unless_an_interval_is_given_and_failover_slots_are_opt_in() {
        let config = load(&[], &[DB], None).unwrap();
        assert_eq!(config.heartbeat_interval, None);
        assert!(!config.failover_slot);
        let config = load(
            &[("heartbeat_interval", "30s")],
            &[DB, ("OUTBOX_RELAY_FAILOVER_SLOT", "true")],
            None,
        )
        .unwrap();
        assert_eq!(config.heartbeat_interval, Some(Duration::from_secs(30)));
        assert!(config.failover_slot);
        let e = load(
            &[],
            &[DB, ("OUTBOX_RELAY_HEARTBEAT_INTERVAL", "often")],
            None,
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("OUTBOX_RELAY_HEARTBEAT_INTERVAL") && text.contains("or off"),
            "{text}"
        );
    }

    #[test]
    fn marking_and_retention_are_off_unless_asked_and_retention_takes_a_grace_batch_and_interval() {
        let config = load(&[], &[DB], None).unwrap();
        assert!(!config.mark_published);
        assert_eq!(config.retention, None);
        let config = load(
            &[("retention_grace", "7d"), ("retention_batch", "500")],
            &[DB, ("OUTBOX_RELAY_MARK_PUBLISHED", "true")],
            None,
        )
        .unwrap();
        assert!(config.mark_published);
        assert_eq!(
            config.retention,
            Some(RetentionConfig {
                grace: Duration::from_secs(7 * 86_400),
                batch: 500,
                interval: Duration::from_secs(60),
            })
        );
        let e = load(
            &[("retention_grace", "1s"), ("retention_batch", "0")],
            &[DB],
            None,
        )
        .unwrap_err();
        assert!(
            e.0.contains("retention-batch") && e.0.contains("1 to 100000"),
            "{e}"
        );
        let e = load(&[], &[DB, ("OUTBOX_RELAY_RETENTION_GRACE", "soon")], None).unwrap_err();
        assert!(
            e.0.contains("OUTBOX_RELAY_RETENTION_GRACE") && e.0.contains("or off"),
            "{e}"
        );
    }
}
