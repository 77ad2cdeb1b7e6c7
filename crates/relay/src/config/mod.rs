//! Configuration: every option is a flag, an environment variable and a key of an optional
//! TOML file. Precedence: flag > environment > file > default.
//!
//! The room at the bottom of the crate: it uses nothing else of it (`.ci/check-structure`
//! keeps it so), and every other room may use it. Besides this file: [`nats`], the NATS
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

/// One option: its file key, flag, environment variable and default.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// Key in the TOML file.
    pub key: &'static str,
    /// Environment variable.
    pub env: &'static str,
    /// Default, if any.
    pub default: Option<&'static str>,
    /// What the option does (shown by `--help`).
    pub help: &'static str,
    /// The flag's name when it is not the key with dashes (the `nats` CLI's names).
    pub long: Option<&'static str>,
}

impl OptionSpec {
    /// The flag's name without the dashes: `long`, or the key with dashes.
    pub fn long(&self) -> String {
        self.long
            .map_or_else(|| self.key.replace('_', "-"), str::to_owned)
    }

    /// The command-line flag, `--key-with-dashes` (or `--{long}`).
    pub fn flag(&self) -> String {
        format!("--{}", self.long())
    }

    /// How to set it: `--flag, ENV or the file key key`.
    pub fn how_to_set(&self) -> String {
        format!("{}, {} or the file key {}", self.flag(), self.env, self.key)
    }

    /// Whether it is a yes/no option (those default to `false`): given as a bare flag
    /// (`--mark-published`) it means `true`.
    pub fn is_switch(&self) -> bool {
        self.default == Some("false")
    }

    /// Whether its value is (or may hold) a secret, never to be shown (CFG1).
    pub fn is_secret(&self) -> bool {
        key_is_secret(self.key)
    }
}

macro_rules! long {
    () => {
        None
    };
    ($flag:literal) => {
        Some($flag)
    };
}

macro_rules! options {
    ($($name:ident = ($key:literal, $env:literal, $default:expr, $help:literal $(, flag = $flag:literal)?);)*) => {
        $(
            #[doc = $help]
            pub const $name: OptionSpec = OptionSpec { key: $key, env: $env, default: $default, help: $help, long: long!($($flag)?) };
        )*
        /// Every option, in help order.
        pub const ALL: &[OptionSpec] = &[$($name),*];
    };
}

/// The options.
pub mod opt {
    use super::OptionSpec;
    options! {
        DATABASE_URL = ("database_url", "DATABASE_URL", None,
            "Postgres connection: a libpq URL (postgres://user:pass@host:port/db?sslmode=verify-full&sslrootcert=ca.crt) or key=value string; the PG* variables and ~/.pgpass fill in what it omits, and may replace it");
        NATS_URL = ("nats_url", "NATS_URL", Some("nats://127.0.0.1:4222"),
            "NATS server URL(s), comma-separated: nats:// or tls:// (the relay speaks the NATS TCP protocol, not ws://); user:password@ or token@ in a URL authenticates (percent-encoded, a ',' as %2C)");
        // NATS authentication and TLS: the `nats` CLI's flag names (crate::config::nats).
        NATS_USER = ("nats_user", "OUTBOX_RELAY_NATS_USER", None,
            "NATS user name (with --password)", flag = "user");
        NATS_PASSWORD = ("nats_password", "OUTBOX_RELAY_NATS_PASSWORD", None,
            "NATS password (with --user)", flag = "password");
        NATS_TOKEN = ("nats_token", "OUTBOX_RELAY_NATS_TOKEN", None,
            "NATS authentication token", flag = "token");
        NATS_NKEY = ("nats_nkey", "OUTBOX_RELAY_NATS_NKEY", None,
            "File holding the NATS user's nkey seed (SU...)", flag = "nkey");
        NATS_CREDS = ("nats_creds", "OUTBOX_RELAY_NATS_CREDS", None,
            "NATS credentials file (.creds: user JWT and nkey seed)", flag = "creds");
        NATS_TLSCA = ("nats_tlsca", "OUTBOX_RELAY_NATS_TLSCA", None,
            "PEM file of the CA(s) that sign the NATS server's certificate (implies TLS; default: the system's roots)", flag = "tlsca");
        NATS_TLSCERT = ("nats_tlscert", "OUTBOX_RELAY_NATS_TLSCERT", None,
            "PEM client certificate (chain) for NATS, with --tlskey (implies TLS)", flag = "tlscert");
        NATS_TLSKEY = ("nats_tlskey", "OUTBOX_RELAY_NATS_TLSKEY", None,
            "PEM private key of --tlscert", flag = "tlskey");
        NATS_TLSFIRST = ("nats_tlsfirst", "OUTBOX_RELAY_NATS_TLSFIRST", Some("false"),
            "TLS handshake before the server's INFO, for servers configured with handshake_first (implies TLS)", flag = "tlsfirst");
        NATS_NO_RANDOMIZE = ("nats_no_randomize", "OUTBOX_RELAY_NATS_NO_RANDOMIZE", Some("false"),
            "Dial the NATS servers in the order given (and those the cluster advertises after them) instead of a random order per connection", flag = "no-randomize");
        NATS_INBOX_PREFIX = ("nats_inbox_prefix", "OUTBOX_RELAY_NATS_INBOX_PREFIX", Some("_INBOX"),
            "Subject prefix of the replies the relay subscribes to (its publish acks and requests' replies): the NATS user needs subscribe on {prefix}.> only", flag = "inbox-prefix");
        TABLE = ("table", "OUTBOX_RELAY_TABLE", Some("public.outbox_events"),
            "The outbox table, as schema.table");
        // The user's own table (crate::config::table; docs/own-table.md).
        TABLE_PRESET = ("table_preset", "OUTBOX_RELAY_TABLE_PRESET", Some("seed"),
            "The outbox table's shape: seed (sql/schema.sql's id, entity_id, event_type, payload, created_at) or debezium (id uuid, aggregatetype, aggregateid, type, timestamp, payload, and tracingspancontext when present; subjects {prefix}.{aggregatetype}.{shard}); the *_column settings override single columns");
        ID_COLUMN = ("id_column", "OUTBOX_RELAY_ID_COLUMN", None,
            "The event id column (bigint, integer, uuid or text); default: the preset's");
        ENTITY_ID_COLUMN = ("entity_id_column", "OUTBOX_RELAY_ENTITY_ID_COLUMN", None,
            "The entity (aggregate) id column, the partition key (text, varchar or uuid); default: the preset's");
        EVENT_TYPE_COLUMN = ("event_type_column", "OUTBOX_RELAY_EVENT_TYPE_COLUMN", None,
            "The event type column (text or varchar); default: the preset's");
        PAYLOAD_COLUMN = ("payload_column", "OUTBOX_RELAY_PAYLOAD_COLUMN", None,
            "The payload column (jsonb, json, text, or bytea published as its bytes); default: the preset's");
        CREATED_AT_COLUMN = ("created_at_column", "OUTBOX_RELAY_CREATED_AT_COLUMN", None,
            "The creation time column (timestamptz, or timestamp read as UTC), the ordering key's first part; default: the preset's");
        HEADER_COLUMNS = ("header_columns", "OUTBOX_RELAY_HEADER_COLUMNS", None,
            "Columns copied into headers: column[:Header-Name], comma-separated (a NULL gives no header; names may not start with Nats- or Outbox-)");
        TRACE_CONTEXT_COLUMN = ("trace_context_column", "OUTBOX_RELAY_TRACE_CONTEXT_COLUMN", None,
            "A column holding the producer's W3C trace context (a traceparent value, or Debezium's tracingspancontext properties), published as the traceparent and tracestate headers");
        SUBJECT_TEMPLATE = ("subject_template", "OUTBOX_RELAY_SUBJECT_TEMPLATE", None,
            "Subjects of events: {prefix} first, {shard} once, and {event_type} or {column} placeholders as whole tokens, e.g. {prefix}.{aggregatetype}.{shard}; default: the preset's ({prefix}.{shard}.{event_type} for seed)");
        INCLUDE_EVENT_TYPES = ("include_event_types", "OUTBOX_RELAY_INCLUDE_EVENT_TYPES", None,
            "Publish only events of these types (comma-separated); the others are confirmed without publishing and counted");
        EXCLUDE_EVENT_TYPES = ("exclude_event_types", "OUTBOX_RELAY_EXCLUDE_EVENT_TYPES", None,
            "Never publish events of these types (comma-separated): confirmed without publishing and counted");
        SLOT = ("slot", "OUTBOX_RELAY_SLOT", Some("outbox_relay"),
            "Logical replication slot (pgoutput)");
        PUBLICATION = ("publication", "OUTBOX_RELAY_PUBLICATION", Some("outbox_relay"),
            "Publication of the outbox table's inserts");
        STREAM = ("stream", "OUTBOX_RELAY_STREAM", Some("OUTBOX"),
            "JetStream stream");
        SUBJECT_PREFIX = ("subject_prefix", "OUTBOX_RELAY_SUBJECT_PREFIX", Some("outbox"),
            "Subjects are {prefix}.{shard}.{event_type}");
        PARTITIONS = ("partitions", "OUTBOX_RELAY_PARTITIONS", Some("12"),
            "Shard count: shard = sha256(entity_id)[..8] as u64 mod partitions");
        MAX_IN_FLIGHT = ("max_in_flight", "OUTBOX_RELAY_MAX_IN_FLIGHT", Some("4096"),
            "Publishes awaiting a JetStream ack at most");
        DUPLICATE_WINDOW = ("duplicate_window", "OUTBOX_RELAY_DUPLICATE_WINDOW", Some("2m"),
            "Duplicate window of a stream the relay creates (e.g. 120s, 2m, 1h)");
        // The stream the relay creates (policy::stream); an existing one is checked against
        // the ones given explicitly.
        STREAM_REPLICAS = ("stream_replicas", "OUTBOX_RELAY_STREAM_REPLICAS", Some("1"),
            "Replicas of a stream the relay creates, 1 to 5 (more than 1 needs a JetStream cluster)");
        STREAM_STORAGE = ("stream_storage", "OUTBOX_RELAY_STREAM_STORAGE", Some("file"),
            "Storage of a stream the relay creates: file, or memory (a nats-server restart loses every event it holds, though Postgres has released them: the relay warns)");
        STREAM_MAX_AGE = ("stream_max_age", "OUTBOX_RELAY_STREAM_MAX_AGE", Some("unlimited"),
            "A stream the relay creates deletes events older than this (e.g. 7d, 12h), or unlimited; a limit warns that events no consumer has read yet can be lost");
        STREAM_MAX_BYTES = ("stream_max_bytes", "OUTBOX_RELAY_STREAM_MAX_BYTES", Some("unlimited"),
            "Size limit of a stream the relay creates (e.g. 10GiB; K, M, G, T are powers of 1024), or unlimited; what happens at the limit is --stream-discard");
        STREAM_MAX_MSG_SIZE = ("stream_max_msg_size", "OUTBOX_RELAY_STREAM_MAX_MSG_SIZE", Some("unlimited"),
            "Largest message a stream the relay creates accepts (e.g. 1MiB), or unlimited; the server's max_payload caps it anyway, and larger events are poison (--on-poison)");
        STREAM_DISCARD = ("stream_discard", "OUTBOX_RELAY_STREAM_DISCARD", Some("old"),
            "What a stream the relay creates does at its size limit: old (deletes its oldest events, read or not) or new (refuses new events: the relay's publishes fail and it retries until room is made)");
        ACK_TIMEOUT = ("ack_timeout", "OUTBOX_RELAY_ACK_TIMEOUT", Some("10s"),
            "How long to wait for a JetStream ack before reconnecting");
        SHUTDOWN_TIMEOUT = ("shutdown_timeout", "OUTBOX_RELAY_SHUTDOWN_TIMEOUT", Some("10s"),
            "On SIGTERM/SIGINT, how long to wait for in-flight acks");
        SHARED_STREAM = ("shared_stream", "OUTBOX_RELAY_SHARED_STREAM", Some("false"),
            "Other writers publish to the stream too: de-duplication only, no sequence fencing or tail resume (weaker; see docs/guarantees.md)");
        ON_POISON = ("on_poison", "OUTBOX_RELAY_ON_POISON", Some("halt"),
            "An event JetStream can never accept: halt (stop, naming it) or dead-letter (a record on {prefix}.dlq in its place)");
        ATOMIC_TRANSACTIONS = ("atomic_transactions", "OUTBOX_RELAY_ATOMIC_TRANSACTIONS", Some("false"),
            "Publish each Postgres transaction as one JetStream atomic batch (nats-server 2.12 or newer, a stream with allow_atomic: set on streams the relay creates): consumers never see part of a transaction; one larger than the server's batch limit (1000) is split at it. Strict mode only");
        FAST_INGEST = ("fast_ingest", "OUTBOX_RELAY_FAST_INGEST", Some("true"),
            "Publish consecutive events as fast-ingest batches where the server and the stream allow it (nats-server 2.14 or newer, a one-replica stream with allow_batched: set on streams the relay creates): one answer per batch instead of one per event; elsewhere, in shared mode and with --atomic-transactions, one acknowledged publish per event; false: always one per event");
        WORKER_THREADS = ("worker_threads", "OUTBOX_RELAY_WORKER_THREADS", Some("1"),
            "Runtime threads: 1 runs everything on one thread (fastest where Postgres and NATS share the cores); more spreads the relay's tasks");
        MAX_LAG_BYTES = ("max_lag_bytes", "OUTBOX_RELAY_MAX_LAG_BYTES", Some("1GiB"),
            "Slot lag (WAL the slot retains past its confirmed position) above which outbox-relay status reports lagging and /readyz answers stalled (e.g. 512MiB)");
        // Operations: heartbeats for a quiet outbox database (crate::process::heartbeat) and PG 17
        // fail-over slots (crate::postgres::checks::ensure_slot).
        HEARTBEAT_INTERVAL = ("heartbeat_interval", "OUTBOX_RELAY_HEARTBEAT_INTERVAL", Some("off"),
            "While streaming, write a tiny WAL message (pg_logical_emit_message) in the outbox database this often (e.g. 30s), or off: lets the slot advance when only other databases of the cluster write");
        FAILOVER_SLOT = ("failover_slot", "OUTBOX_RELAY_FAILOVER_SLOT", Some("false"),
            "Create the slot with failover = true (Postgres 17 or newer), so a standby with sync_replication_slots keeps it across a fail-over");
        LOG_FORMAT = ("log_format", "OUTBOX_RELAY_LOG_FORMAT", Some("text"),
            "Log format: text or json (filter with RUST_LOG)");
        // Backfill (issue 11, crate::setup::backfill): rows already in the table when the slot is
        // created.
        BACKFILL = ("backfill", "OUTBOX_RELAY_BACKFILL", Some("pending"),
            "When the relay creates its slot, publish the rows already in the table, read in the slot's exported snapshot: pending (rows whose status is 'pending'; none if the table has no status column), all, or none");
        // Marking and retention (issue 11 parts 3 and 4: crate::process::mark,
        // crate::process::retention).
        MARK_PUBLISHED = ("mark_published", "OUTBOX_RELAY_MARK_PUBLISHED", Some("false"),
            "After JetStream acknowledged events, set status = 'published', published_at = now(), attempts = attempts + 1 on their rows, in batches beside the session (needs those columns and UPDATE on them; the slot is confirmed only past marked rows)");
        RETENTION_GRACE = ("retention_grace", "OUTBOX_RELAY_RETENTION_GRACE", Some("off"),
            "Delete rows older than this (e.g. 7d) once the slot confirmed them, in small batches while this relay holds the lease, or off; rows committed before the slot existed count as confirmed (docs/operations.md)");
        RETENTION_BATCH = ("retention_batch", "OUTBOX_RELAY_RETENTION_BATCH", Some("1000"),
            "Rows per retention DELETE (1 to 100000)");
        RETENTION_INTERVAL = ("retention_interval", "OUTBOX_RELAY_RETENTION_INTERVAL", Some("60s"),
            "How often retention looks for old confirmed rows");
        // Metrics and health (crate::observe::metrics, crate::observe::http): MetricsConfig.
        METRICS_ADDR = ("metrics_addr", "OUTBOX_RELAY_METRICS_ADDR", None,
            "Serve Prometheus metrics (/metrics) and health (/healthz, /readyz) over HTTP on this address, e.g. 0.0.0.0:9464, [::]:9464, :9464 (all interfaces) or 127.0.0.1:0 (a free port, logged); off unless set");
    }
}

/// Where a raw value came from; errors name the key in that form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag.
    Flag,
    /// An environment variable.
    Env,
    /// The TOML file.
    File(PathBuf),
    /// One of the `nats` CLI's own environment variables ([`NATS_CLI_ENV`]).
    NatsCliEnv(&'static str),
    /// The built-in default.
    Default,
}

/// The `nats` CLI's environment variables the relay honours, below its own variables and its
/// config file: an operator's shell set up for `nats` works for the relay too, and
/// `OUTBOX_RELAY_*` or the file still win.
pub const NATS_CLI_ENV: [(&str, &OptionSpec); 7] = [
    ("NATS_USER", &opt::NATS_USER),
    ("NATS_PASSWORD", &opt::NATS_PASSWORD),
    ("NATS_CREDS", &opt::NATS_CREDS),
    ("NATS_NKEY", &opt::NATS_NKEY),
    ("NATS_CA", &opt::NATS_TLSCA),
    ("NATS_CERT", &opt::NATS_TLSCERT),
    ("NATS_KEY", &opt::NATS_TLSKEY),
];

/// Raw option values by file key, each with its origin; and the environment libpq reads
/// (`PG*`, `HOME`, `USER`), for the Postgres connection. Its `Debug` redacts secrets (CFG1).
#[derive(Default, Clone)]
pub struct RawConfig {
    values: BTreeMap<&'static str, (String, Origin)>,
    libpq_env: BTreeMap<String, String>,
    /// The `--config` file, when it holds a secret (whether or not another source wins).
    secret_file: Option<PathBuf>,
}

impl fmt::Debug for RawConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let values: BTreeMap<&str, (String, &Origin)> = self
            .values
            .iter()
            .map(|(key, (value, origin))| (*key, (shown_value(key, value), origin)))
            .collect();
        f.debug_struct("RawConfig")
            .field("values", &values)
            .field("libpq_env", &self.libpq_env.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// An invalid configuration. The message names the key and what it expects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl RawConfig {
    /// Sets `spec` from `origin` unless a higher-precedence origin already did.
    pub fn offer(&mut self, spec: &OptionSpec, value: String, origin: Origin) {
        self.values.entry(spec.key).or_insert((value, origin));
    }

    /// Layers the sources: `flags` (already parsed by clap, key → value), the environment,
    /// then the TOML file if one is given, then defaults.
    pub fn load(
        flags: &BTreeMap<&'static str, String>,
        env: &dyn Fn(&str) -> Option<String>,
        env_keys: &[String],
        file: Option<&Path>,
    ) -> Result<Self, ConfigError> {
        let mut raw = RawConfig::default();
        for spec in opt::ALL {
            if let Some(value) = flags.get(spec.key) {
                raw.offer(spec, value.clone(), Origin::Flag);
            }
        }
        for spec in opt::ALL {
            if let Some(value) = env(spec.env) {
                raw.offer(spec, value, Origin::Env);
            }
        }
        raw.offer_env_keys(env, env_keys)?;
        if let Some(path) = file {
            raw.offer_file(path)?;
        }
        for (var, spec) in NATS_CLI_ENV {
            if let Some(value) = env(var) {
                raw.offer(spec, value, Origin::NatsCliEnv(var));
            }
        }
        for spec in opt::ALL {
            if let Some(default) = spec.default {
                raw.offer(spec, default.to_owned(), Origin::Default);
            }
        }
        Ok(raw)
    }

    /// The `PG*`, `HOME` and `USER` variables, for libpq's rules; an unknown
    /// `OUTBOX_RELAY_*` variable is an error.
    fn offer_env_keys(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        env_keys: &[String],
    ) -> Result<(), ConfigError> {
        for key in env_keys {
            if key.starts_with("PG") || key == "HOME" || key == "USER" {
                if let Some(value) = env(key) {
                    self.libpq_env.insert(key.clone(), value);
                }
            }
            let known =
                opt::ALL.iter().any(|s| s.env == key) || KNOWN_EXTRA_ENV.contains(&key.as_str());
            if key.starts_with("OUTBOX_RELAY_") && !known {
                return Err(ConfigError(format!(
                    "unknown environment variable {key}: known ones are {}",
                    opt::ALL
                        .iter()
                        .filter(|s| s.env.starts_with("OUTBOX_RELAY_"))
                        .map(|s| s.env)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The config file's keys (TOML: strings, integers or booleans), each a known option;
    /// remembers the file when it holds a secret.
    fn offer_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
        let table: toml::Table = text.parse().map_err(|e| toml_error(path, &text, &e))?;
        for (key, value) in table {
            let spec = opt::ALL.iter().find(|s| s.key == key).ok_or_else(|| {
                ConfigError(format!(
                    "unknown key {key:?} in config file {}: known keys are {}",
                    path.display(),
                    opt::ALL
                        .iter()
                        .map(|s| s.key)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            let value = file_value(&key, value, path)?;
            if value_holds_secret(spec, &value) {
                self.secret_file = Some(path.to_owned());
            }
            self.offer(spec, value, Origin::File(path.to_owned()));
        }
        Ok(())
    }

    /// The option as the operator gave it (`--flag`, `ENV`, `key (in file)`), if given.
    pub(crate) fn name(&self, spec: &OptionSpec) -> Option<String> {
        let (_, origin) = self.values.get(spec.key)?;
        Some(match origin {
            Origin::Flag => spec.flag(),
            Origin::Env => spec.env.to_owned(),
            Origin::NatsCliEnv(var) => (*var).to_owned(),
            Origin::File(path) => format!("{} (in {})", spec.key, path.display()),
            Origin::Default => format!("{} (default)", spec.key),
        })
    }

    /// Parses an option without a default: `None` when it is not given.
    pub(crate) fn parse_optional<T>(
        &self,
        spec: &OptionSpec,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, ConfigError> {
        if self.values.contains_key(spec.key) {
            self.parse(spec, parse).map(Some)
        } else {
            Ok(None)
        }
    }

    fn get(&self, spec: &OptionSpec) -> Result<(&str, &Origin), ConfigError> {
        self.values.get(spec.key).map(|(v, o)| (v.as_str(), o)).ok_or_else(|| {
            let libpq = if spec.key == opt::DATABASE_URL.key {
                " (or the libpq variables PGHOST, PGDATABASE, PGUSER, ...)"
            } else {
                ""
            };
            ConfigError(format!(
                "{} is required: set the environment variable {}{libpq}, the flag {} or the key {} in the config file",
                spec.env,
                spec.env,
                spec.flag(),
                spec.key
            ))
        })
    }

    /// A variable of the environment libpq reads (`PG*`, `HOME`, `USER`).
    fn libpq_env(&self, name: &str) -> Option<String> {
        self.libpq_env.get(name).cloned()
    }

    /// Parses one value, naming the key as its origin spells it on failure.
    pub(crate) fn parse<T>(
        &self,
        spec: &OptionSpec,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let (value, _) = self.get(spec)?;
        parse(value).map_err(|why| {
            let shown = if spec.is_secret() {
                "<redacted>".to_owned()
            } else {
                format!("{value:?}")
            };
            let name = self.name(spec).unwrap_or_else(|| spec.flag());
            ConfigError(format!("invalid {name} = {shown}: {why}"))
        })
    }
}

/// Environment variables we read that are not options (so CFG2 does not reject them).
const KNOWN_EXTRA_ENV: &[&str] = &["OUTBOX_RELAY_CONFIG"];

/// Options whose value is, or may contain, a secret (CFG1). Any option whose key names a
/// password, token or secret is one too.
const SECRET_KEYS: &[&str] = &["database_url", "nats_url"];

/// Whether the value of option `key` is, or may contain, a secret.
fn key_is_secret(key: &str) -> bool {
    SECRET_KEYS.contains(&key)
        || ["password", "token", "secret"]
            .iter()
            .any(|w| key.contains(w))
}

/// Whether `value` of `spec` holds a secret: a password or token option; a Postgres
/// connection string with a password (or one that does not parse); NATS URLs with
/// credentials.
fn value_holds_secret(spec: &OptionSpec, value: &str) -> bool {
    if spec.key == opt::DATABASE_URL.key {
        ConnInfo::parse_with_env(value, |_| None).map_or(true, |info| info.password().is_some())
    } else if spec.key == opt::NATS_URL.key {
        !NatsUrl(value.to_owned()).secrets().is_empty()
    } else {
        spec.is_secret()
    }
}

/// A raw value as it may be shown: NATS URLs without their credentials, other secrets as
/// `<redacted>`, everything else as given.
fn shown_value(key: &str, value: &str) -> String {
    if key == opt::NATS_URL.key {
        redact_nats_urls(value)
    } else if key_is_secret(key) {
        "<redacted>".to_owned()
    } else {
        value.to_owned()
    }
}

/// A TOML syntax error, located by line and column but without the offending line, which
/// may hold a password (CFG1).
fn toml_error(path: &Path, text: &str, error: &toml::de::Error) -> ConfigError {
    let location = match error.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.chars().rev().take_while(|c| *c != '\n').count() + 1;
            format!(" at line {line}, column {column}")
        }
        None => String::new(),
    };
    let message: Vec<&str> = error.message().lines().map(str::trim).collect();
    ConfigError(format!(
        "config file {} is not valid TOML{location}: {}; hint: each line is key = \"string\" \
         or key = integer, each key once",
        path.display(),
        message.join("; ")
    ))
}

pub use outbox::TableName;

/// `schema.table` as SQL: both parts quoted.
pub fn table_sql(table: &TableName) -> String {
    format!(
        "{}.{}",
        replication::quote_identifier(&table.schema),
        replication::quote_identifier(&table.name)
    )
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
    /// The Postgres connection.
    pub database: ConnInfo,
    /// The NATS server(s).
    pub nats_url: NatsUrl,
    /// How to connect to them: the servers without credentials, the credential, TLS.
    pub nats: crate::config::nats::NatsOptions,
    /// The outbox table.
    pub table: TableName,
    /// Which of its columns the relay reads, and how events are shaped from them.
    pub mapping: outbox::Mapping,
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
    /// Validates every raw value; the first invalid one is the error.
    pub fn from_sources(raw: &RawConfig) -> Result<Config, ConfigError> {
        use opt::*;
        let database = database_from(raw)?;
        let nats_url = raw.parse(&NATS_URL, parse_nats_url)?;
        let nats = crate::config::nats::NatsOptions::from_raw(raw, &nats_url)?;
        let warnings = startup_warnings(raw, &database, &nats_url, &nats);
        let table = raw.parse(&TABLE, parse_table_name)?;
        let mapping = crate::config::table::mapping_from(raw)?;
        let slot = raw.parse(&SLOT, parse_slot_name)?;
        let publication = raw.parse(&PUBLICATION, parse_publication_name)?;
        let stream = raw.parse(&STREAM, parse_stream_name)?;
        let subject_prefix = raw.parse(&SUBJECT_PREFIX, parse_subject_prefix)?;
        let partitions = raw.parse(&PARTITIONS, parse_partitions)?;
        let max_in_flight = raw.parse(&MAX_IN_FLIGHT, |v| integer_in(v, 1, 1_000_000))?;
        let (duplicate_window, stream_settings) = stream_limits(raw)?;
        let ack_timeout = raw.parse(&ACK_TIMEOUT, parse_duration)?;
        let shutdown_timeout = raw.parse(&SHUTDOWN_TIMEOUT, parse_duration)?;
        let shared_stream = raw.parse(&SHARED_STREAM, parse_bool)?;
        let on_poison = raw.parse(&ON_POISON, parse_on_poison)?;
        let worker_threads = raw.parse(&WORKER_THREADS, |v| integer_in(v, 1, 256))?;
        let max_lag_bytes = raw.parse(&MAX_LAG_BYTES, parse_size)?;
        let log_format = raw.parse(&LOG_FORMAT, parse_log_format)?;
        let heartbeat_interval =
            raw.parse(&HEARTBEAT_INTERVAL, |v| word_or("off", v, parse_duration))?;
        let failover_slot = raw.parse(&FAILOVER_SLOT, parse_bool)?;
        let metrics = MetricsConfig::from_raw(raw)?;
        let mark_published = raw.parse(&MARK_PUBLISHED, parse_bool)?;
        let atomic_transactions = raw.parse(&ATOMIC_TRANSACTIONS, parse_bool)?;
        if atomic_transactions && shared_stream {
            return Err(ConfigError(format!(
                "{} needs strict mode: a shared stream's other writers publish the same message ids, and JetStream refuses a whole atomic batch holding one; unset {}",
                ATOMIC_TRANSACTIONS.flag(),
                SHARED_STREAM.flag()
            )));
        }
        let fast_ingest = raw.parse(&FAST_INGEST, parse_bool)?;
        let retention = retention_from(raw)?;
        Ok(Config {
            database,
            nats_url,
            // The sink's acks arrive on one subscription per session (sink P10): room for a
            // whole window of them.
            nats,
            table,
            mapping,
            slot,
            publication,
            stream,
            subject_prefix,
            partitions,
            max_in_flight,
            duplicate_window,
            stream_settings,
            ack_timeout,
            shutdown_timeout,
            shared_stream,
            on_poison,
            worker_threads,
            max_lag_bytes,
            log_format,
            heartbeat_interval,
            failover_slot,
            metrics,
            create: true,
            backfill: raw.parse(&BACKFILL, backfill::Mode::parse)?,
            mark_published,
            atomic_transactions,
            fast_ingest,
            retention,
            warnings,
        })
    }
}

/// The Postgres connection: `DATABASE_URL` (over the PG* variables), or the PG* variables
/// alone when they say something and `DATABASE_URL` is not set; with the relay's
/// application name when none is given.
fn database_from(raw: &RawConfig) -> Result<ConnInfo, ConfigError> {
    let libpq_env = |name: &str| raw.libpq_env(name);
    let database = if raw.values.contains_key(opt::DATABASE_URL.key)
        || !ConnInfo::env_has_parameters(libpq_env)
    {
        raw.parse(&opt::DATABASE_URL, |v| {
            ConnInfo::parse_with_env(v, libpq_env).map_err(|e| e.to_string())
        })?
    } else {
        // libpq's habit: no connection string, the PG* variables say it all.
        ConnInfo::parse_with_env("", libpq_env).map_err(|e| {
            ConfigError(format!(
                "DATABASE_URL is not set, and the PG* environment variables do not make a \
                 valid connection: {e}"
            ))
        })?
    };
    // libpq's fallback_application_name: without one of its own, the relay's sessions
    // say who they are in pg_stat_activity (and in `outbox-relay status`).
    Ok(if database.application_name().is_none() {
        database.with_application_name(FALLBACK_APPLICATION_NAME)
    } else {
        database
    })
}

/// `NATS_URL`: a comma-separated list of `nats://` or `tls://` servers (never WebSocket),
/// each `[user:password@]host[:port]`, with the same credentials in every entry or none.
/// The errors never quote the text (it may hold a password).
fn parse_nats_url(v: &str) -> Result<NatsUrl, String> {
    for (i, url) in v.split(',').enumerate() {
        let url = url.trim();
        if ["ws://", "wss://"].iter().any(|s| url.starts_with(s)) {
            return Err(format!(
                "server {} of the list is a WebSocket URL (ws:// or wss://), which the \
                 relay cannot use: it speaks the NATS TCP protocol only; give the \
                 server's client port (4222 by default, not its websocket port) as \
                 nats://host:4222, or tls://host:4222 for TLS",
                i + 1
            ));
        }
        let scheme_ok =
            ["nats://", "tls://"].iter().any(|s| url.starts_with(s)) || !url.contains("://");
        if url.is_empty() || !scheme_ok {
            return Err("expected nats://host:port (or tls://), comma-separated".into());
        }
        // Not quoted: the text may hold a password.
        if !nats_host_port_ok(split_nats_url(url).2) {
            return Err(format!(
                "server {} of the list is not [user:password@]host[:port] with a \
                 numeric port (a ',' or '@' in a password must be percent-encoded: \
                 %2C, %40)",
                i + 1
            ));
        }
    }
    if let Some(entry) = comma_in_credentials(v) {
        return Err(format!(
            "server {entry} of the list has user information (user:password@ or \
             token@) but server {} does not, so a ',' may have split a credential: a \
             ',' in a user name, password or token must be percent-encoded as %2C; \
             separate servers need the same credentials in every URL (or --user and \
             --password, or --token, instead)",
            entry - 1
        ));
    }
    Ok(NatsUrl(v.to_owned()))
}

/// The subjects' prefix ([`outbox::subject::validate_prefix`]).
fn parse_subject_prefix(v: &str) -> Result<String, String> {
    outbox::subject::validate_prefix(v)?;
    Ok(v.to_owned())
}

/// `--partitions`: a positive integer.
fn parse_partitions(v: &str) -> Result<NonZeroU64, String> {
    v.parse::<NonZeroU64>()
        .map_err(|_| "expected a positive integer (the seed's default is 12)".to_owned())
}

/// A publication's name, as Postgres accepts it.
fn parse_publication_name(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 63 {
        Err("publication names have 1 to 63 characters".into())
    } else {
        Ok(v.to_owned())
    }
}

/// An integer from `low` to `high`.
fn integer_in<T>(v: &str, low: T, high: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    match v.parse::<T>() {
        Ok(n) if (low..=high).contains(&n) => Ok(n),
        _ => Err(format!("expected an integer from {low} to {high}")),
    }
}

/// `--on-poison`: `halt` or `dead-letter`.
fn parse_on_poison(v: &str) -> Result<sink::PoisonPolicy, String> {
    match v {
        "halt" => Ok(sink::PoisonPolicy::Halt),
        "dead-letter" => Ok(sink::PoisonPolicy::DeadLetter),
        _ => Err("expected halt or dead-letter".into()),
    }
}

/// `--log-format`: `text` or `json`.
fn parse_log_format(v: &str) -> Result<LogFormat, String> {
    match v {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err("expected text or json".into()),
    }
}

/// `schema.table`, `public` when no schema is given.
fn parse_table_name(v: &str) -> Result<TableName, String> {
    let (schema, name) = v.split_once('.').unwrap_or(("public", v));
    if schema.is_empty() || name.is_empty() {
        return Err("expected schema.table, e.g. public.outbox_events".into());
    }
    Ok(TableName {
        schema: schema.to_owned(),
        name: name.to_owned(),
    })
}

/// A replication slot's name, as Postgres accepts it.
fn parse_slot_name(v: &str) -> Result<String, String> {
    let valid = !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(v.to_owned())
    } else {
        Err("replication slot names have 1 to 63 characters: lower-case letters, digits and underscores".into())
    }
}

/// A JetStream stream's name, as the server accepts it.
fn parse_stream_name(v: &str) -> Result<String, String> {
    let valid = !v.is_empty()
        && v.bytes()
            .all(|b| !matches!(b, b'.' | b'*' | b'>' | b'/' | b'\\') && b.is_ascii_graphic());
    if valid {
        Ok(v.to_owned())
    } else {
        Err("stream names are printable ASCII without spaces, '.', '*', '>', '/' or '\\'".into())
    }
}

/// The duplicate window and the stream's settings, which must agree.
fn stream_limits(raw: &RawConfig) -> Result<(Duration, StreamSettings), ConfigError> {
    let duplicate_window = raw.parse(&opt::DUPLICATE_WINDOW, parse_duration)?;
    let stream_settings = StreamSettings::from_raw(raw)?;
    check_max_age(raw, &stream_settings, duplicate_window)?;
    Ok((duplicate_window, stream_settings))
}

/// JetStream refuses a stream whose max age is shorter than its duplicate window.
fn check_max_age(
    raw: &RawConfig,
    stream_settings: &StreamSettings,
    duplicate_window: Duration,
) -> Result<(), ConfigError> {
    let Some(max_age) = stream_settings
        .max_age
        .filter(|age| *age < duplicate_window)
    else {
        return Ok(());
    };
    let name = |spec: &OptionSpec| raw.name(spec).unwrap_or_else(|| spec.flag());
    Err(ConfigError(format!(
        "{} ({}) is shorter than {} ({}), which JetStream refuses: a stream keeps events \
         at least as long as it remembers their ids; raise one or lower the other",
        name(&opt::STREAM_MAX_AGE),
        format_duration(max_age),
        name(&opt::DUPLICATE_WINDOW),
        format_duration(duplicate_window)
    )))
}

/// Retention's settings, `None` when `--retention-grace off`.
fn retention_from(raw: &RawConfig) -> Result<Option<RetentionConfig>, ConfigError> {
    use opt::*;
    let Some(grace) = raw.parse(&RETENTION_GRACE, |v| word_or("off", v, parse_duration))? else {
        return Ok(None);
    };
    Ok(Some(RetentionConfig {
        grace,
        batch: raw.parse(&RETENTION_BATCH, |v| integer_in(v, 1, 100_000))?,
        interval: raw.parse(&RETENTION_INTERVAL, parse_duration)?,
    }))
}

/// A config file's value as text: TOML strings, integers and booleans only.
fn file_value(key: &str, value: toml::Value, path: &Path) -> Result<String, ConfigError> {
    Ok(match value {
        toml::Value::String(s) => s,
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => {
            return Err(ConfigError(format!(
                "key {key} in config file {} must be a string, an integer or a boolean, not {}",
                path.display(),
                other.type_str()
            )))
        }
    })
}

/// What is risky but allowed, for the log at start, one line each: the Postgres
/// connection's own warnings ([`ConnInfo::warnings`]); secrets given on the command line
/// (any user of the machine reads them in `ps`); files holding secrets that group or others
/// can read (libpq's rule, [`replication::conninfo::exposed_secret_file`]); secrets too
/// weak for the log scrubber ([`secrets::weakness`]); credentials that would travel
/// without verified TLS. Never a secret itself.
fn startup_warnings(
    raw: &RawConfig,
    database: &ConnInfo,
    nats_url: &NatsUrl,
    nats: &crate::config::nats::NatsOptions,
) -> Vec<String> {
    let mut warnings: Vec<String> = database.warnings().to_vec();
    warnings.extend(secrets_on_command_line(raw, database, nats_url));
    warnings.extend(exposed_secret_files(raw));
    warnings.extend(weak_secrets(database, nats));
    warnings.extend(credentials_in_clear(database, nats));
    warnings
}

/// The value and origin of `spec`, when it was given.
fn given<'a>(raw: &'a RawConfig, spec: &OptionSpec) -> Option<(&'a String, &'a Origin)> {
    raw.values
        .get(spec.key)
        .map(|(value, origin)| (value, origin))
}

/// Secrets given on the command line, which any user of the machine reads in `ps`.
fn secrets_on_command_line(
    raw: &RawConfig,
    database: &ConnInfo,
    nats_url: &NatsUrl,
) -> Vec<String> {
    use opt::*;
    let mut warnings = vec![];
    // Secrets on the command line.
    let on_command_line = |spec: &OptionSpec, holds: &str, instead: &str| {
        format!(
            "{} {holds} on the command line, where every user of this machine can read it \
             (ps, /proc/<pid>/cmdline): set {instead} instead",
            spec.flag()
        )
    };
    for spec in [&NATS_PASSWORD, &NATS_TOKEN] {
        if matches!(given(raw, spec), Some((_, Origin::Flag))) {
            let instead = format!(
                "{} or the file key {} (in a file only the relay's user can read)",
                spec.env, spec.key
            );
            warnings.push(on_command_line(spec, "is given", &instead));
        }
    }
    if matches!(given(raw, &DATABASE_URL), Some((_, Origin::Flag)))
        && database.source("password") == &replication::Source::ConnString
    {
        warnings.push(on_command_line(
            &DATABASE_URL,
            "holds a password and is given",
            "DATABASE_URL, or keep the password out of the URL and give it in PGPASSWORD or a \
             password file (PGPASSFILE, ~/.pgpass)",
        ));
    }
    if matches!(given(raw, &NATS_URL), Some((_, Origin::Flag))) && !nats_url.secrets().is_empty() {
        warnings.push(on_command_line(
            &NATS_URL,
            "holds credentials and is given",
            "NATS_URL, or give the credentials with OUTBOX_RELAY_NATS_USER and \
             OUTBOX_RELAY_NATS_PASSWORD (or OUTBOX_RELAY_NATS_TOKEN)",
        ));
    }

    warnings
}

/// Files holding secrets that group or others can read (libpq's rule).
fn exposed_secret_files(raw: &RawConfig) -> Vec<String> {
    use opt::*;
    let mut warnings = vec![];
    // Files holding secrets that group or others can read.
    let exposed = |path: &Path, what: String, holds: &str| {
        replication::conninfo::exposed_secret_file(path, &what, true)
            .map(|warning| format!("{warning}: it holds {holds}"))
    };
    if let Some(path) = &raw.secret_file {
        warnings.extend(exposed(path, "config file".to_owned(), "a secret"));
    }
    for (spec, holds) in [
        (&NATS_NKEY, "the NATS user's nkey seed"),
        (&NATS_CREDS, "the NATS user's nkey seed"),
        (&NATS_TLSKEY, "the NATS client certificate's private key"),
    ] {
        if let Some((path, _)) = given(raw, spec) {
            let name = raw.name(spec).unwrap_or_else(|| spec.flag());
            warnings.extend(exposed(Path::new(path), format!("{name} file"), holds));
        }
    }

    warnings
}

/// Secrets too weak for the log scrubber ([`crate::config::secrets::weakness`]).
fn weak_secrets(database: &ConnInfo, nats: &crate::config::nats::NatsOptions) -> Vec<String> {
    let mut warnings = vec![];
    // Secrets the log scrubber cannot take out of free text.
    let mut names = vec![database.user()];
    names.extend(nats.user());
    let mut secrets: Vec<(String, &str)> = Vec::new();
    if let Some(password) = database.password() {
        secrets.push((
            format!(
                "the Postgres password (from the {})",
                database.source("password")
            ),
            password.expose(),
        ));
    }
    if let Some((what, secret)) = nats.credential_secret() {
        secrets.push((what, secret));
    }
    for (what, secret) in secrets {
        if let Some(weakness) = secrets::weakness(secret, &names) {
            warnings.push(format!(
                "{what} is {weakness}: the log scrubber takes it out of a library's log line or \
                 error only where it stands as a URL's user information, so such text may show \
                 it; use a long random secret"
            ));
        }
    }

    warnings
}

/// Credentials that would travel without verified TLS.
fn credentials_in_clear(
    database: &ConnInfo,
    nats: &crate::config::nats::NatsOptions,
) -> Vec<String> {
    use opt::*;
    let mut warnings = vec![];
    // Credentials that would travel without verified TLS.
    // channel_binding=require accepts SCRAM-SHA-256-PLUS only, which binds the exchange to
    // the TLS channel: neither the password nor the session goes to a server in the middle.
    let weak_auth = database.channel_binding() != replication::ChannelBinding::Require
        && database
            .require_auth()
            .is_none_or(|r| r.allows(AuthMethod::Password) || r.allows(AuthMethod::Md5));
    if database.password().is_some()
        && !database.is_unix_socket()
        && database.sslmode() != replication::SslMode::VerifyFull
        && weak_auth
    {
        warnings.push(format!(
            "Postgres: sslmode={} does not verify the server's certificate and host name, so an \
             attacker on the network path can pose as the server and ask for the password in \
             clear text, or as md5 (a salted hash open to offline guessing); set \
             sslmode=verify-full (with \
             sslrootcert), or at least require_auth=scram-sha-256 (SCRAM never reveals the \
             password, though without verify-full the attacker can still read the session): \
             docs/operations.md, Hardened connections",
            database.sslmode()
        ));
    }
    if let Some(given_by) = nats.credential_in_clear() {
        warnings.push(format!(
            "NATS: the credentials of {given_by} are sent as written over a server URL without \
             verified TLS (nats:// or no scheme, and no {} or {}), so an attacker on the network \
             path reads them, or strips the server's TLS offer first; use tls:// URLs or {} \
             (the server's certificate is then verified): docs/operations.md, Hardened \
             connections",
            NATS_TLSCA.flag(),
            NATS_TLSFIRST.flag(),
            NATS_TLSCA.flag(),
        ));
    }
    warnings
}

impl Config {
    /// Every secret of the configuration (the Postgres password, NATS URL credentials), for
    /// the log scrubber.
    pub fn secrets(&self) -> Vec<String> {
        let mut secrets = self.nats_url.secrets();
        secrets.extend(self.nats.secrets());
        secrets.extend(
            self.database
                .password()
                .map(|password| password.expose().to_owned()),
        );
        secrets
    }

    /// The user names (Postgres, NATS): a secret equal to one is weak for the log scrubber
    /// (`secrets::weakness`).
    pub fn user_names(&self) -> Vec<&str> {
        let mut names = vec![self.database.user()];
        names.extend(self.nats.user());
        names
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag => f.write_str("command-line flag"),
            Origin::Env => f.write_str("environment"),
            Origin::NatsCliEnv(var) => write!(f, "the nats CLI's environment variable {var}"),
            Origin::File(path) => write!(f, "config file {}", path.display()),
            Origin::Default => f.write_str("default"),
        }
    }
}

/// The effective configuration, for `outbox-relay config`: every option as a TOML line with
/// where it came from, then the Postgres connection parameter by parameter; secrets as
/// `<redacted>` (CFG1).
pub fn effective(raw: &RawConfig, config: &Config) -> String {
    let mut lines = vec![
        "# outbox-relay: the effective configuration, and where each value came from".to_owned(),
        "# (precedence: flag > environment > config file > the nats CLI's NATS_* variables > default;"
            .to_owned(),
        "# secrets are <redacted>)"
            .to_owned(),
    ];
    let quote = |value: &str| toml::Value::String(value.to_owned()).to_string();
    let origin_of = |spec: &OptionSpec, origin: &Origin| match origin {
        Origin::Flag => format!("flag {}", spec.flag()),
        Origin::Env => format!("environment variable {}", spec.env),
        other => other.to_string(),
    };
    let mut rows = Vec::new();
    for spec in opt::ALL {
        match raw.values.get(spec.key) {
            Some((value, origin)) => rows.push((
                format!("{} = {}", spec.key, quote(&shown_value(spec.key, value))),
                origin_of(spec, origin),
            )),
            None if spec.key == opt::DATABASE_URL.key => rows.push((
                "# database_url is not set: the PG* environment configures Postgres (below)"
                    .to_owned(),
                String::new(),
            )),
            None => rows.push((format!("# {} is not set", spec.key), String::new())),
        }
    }
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
        rows.push((format!("# {name} = {}", quote(&value)), source));
    }
    lines.extend(aligned(rows));
    lines.push(String::new());
    lines.join("\n")
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
        let storage = raw.parse(&STREAM_STORAGE, |v| match v {
            "file" => Ok(StorageType::File),
            "memory" => Ok(StorageType::Memory),
            _ => Err("expected file or memory".into()),
        })?;
        let max_age = raw.parse(&STREAM_MAX_AGE, |v| unlimited_or(v, parse_duration))?;
        let max_bytes = raw.parse(&STREAM_MAX_BYTES, |v| {
            unlimited_or(v, |v| at_most(parse_size(v)?, i64::MAX as u64))
        })?;
        let max_msg_size = raw.parse(&STREAM_MAX_MSG_SIZE, |v| {
            unlimited_or(v, |v| at_most(parse_size(v)?, i32::MAX as u64))
        })?;
        let discard = raw.parse(&STREAM_DISCARD, |v| match v {
            "old" => Ok(DiscardPolicy::Old),
            "new" => Ok(DiscardPolicy::New),
            _ => Err("expected old or new".into()),
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

/// `unlimited` as `None`, anything else through `parse`.
fn unlimited_or<T>(
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, String> {
    word_or("unlimited", text, parse)
}

/// `None` for `word` (`unlimited`, `off`), else what `parse` makes of `text`.
fn word_or<T>(
    word: &str,
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, String> {
    if text.trim() == word {
        Ok(None)
    } else {
        parse(text)
            .map(Some)
            .map_err(|why| format!("{why}, or {word}"))
    }
}

fn at_most(value: u64, limit: u64) -> Result<u64, String> {
    if value <= limit {
        Ok(value)
    } else {
        Err(format!("must be at most {limit} bytes"))
    }
}

/// Parses a listening address: `IP:PORT`, `[IPv6]:PORT`, or `:PORT` for every interface.
pub fn parse_listen_addr(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let expanded;
    let text = match text.strip_prefix(':') {
        Some(port) => {
            expanded = format!("0.0.0.0:{port}");
            &expanded
        }
        None => text,
    };
    text.parse().map_err(|_| {
        "expected an IP address and a port, e.g. 0.0.0.0:9464, [::]:9464, :9464 or 127.0.0.1:0 \
         (a host name is not accepted)"
            .to_owned()
    })
}

/// Parses a byte size: `1048576`, `512KiB`, `64MiB`, `10GiB`, `1TiB` (also `K`, `KB`, `M`,
/// `MB`…, any case: powers of 1024, as Postgres and nats-server read them).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let expected = || "expected a size like 1048576, 512KiB, 64MiB or 10GiB".to_owned();
    let number: u64 = number.parse().map_err(|_| expected())?;
    let unit = unit.trim().to_ascii_lowercase();
    let prefix = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let power = match prefix {
        "" => 0,
        "k" => 1,
        "m" => 2,
        "g" => 3,
        "t" => 4,
        _ => return Err(format!("unknown unit {unit:?}: use KiB, MiB, GiB or TiB")),
    };
    let bytes = number
        .checked_mul(1024u64.pow(power))
        .ok_or_else(|| "too large".to_owned())?;
    if bytes == 0 {
        return Err("must be greater than zero".into());
    }
    Ok(bytes)
}

/// A byte count for people: `56 B`, `64 MiB` (exact), `120.6 KiB` (rounded).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1024u64.pow(unit as u32 + 1) {
        unit += 1;
    }
    let scale = 1024u64.pow(unit as u32);
    if bytes % scale == 0 {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.1} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

/// A duration as [`parse_duration`] reads it: `500ms`, `90s`, `2m`, `1h`, `7d`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis % 1000 != 0 {
        return format!("{millis}ms");
    }
    let secs = millis / 1000;
    match secs {
        0 => "0s".into(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// Parses `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

/// Parses `500ms`, `90s`, `2m`, `1h`, `7d` (a bare number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    // A bare number is seconds, as it always was; everything else is humantime's
    // (`500ms`, `90s`, `2min`, `1h30m`, `7d`), which the ecosystem's tools read too.
    let duration = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("expected a duration like 500ms, 90s, 2min, 1h30m or 7d ({e})"))?,
    };
    if duration.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(duration)
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
        load_raw(flags, env, file).and_then(|raw| Config::from_sources(&raw))
    }

    fn load_raw(
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Result<RawConfig, ConfigError> {
        let flags = flags.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let env_map: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let dir = tempfile_dir();
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

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-config-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
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
        let e = load(
            &[],
            &[("DATABASE_URL", "postgres://u:s3cret@h:notaport/db")],
            None,
        )
        .unwrap_err();
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
        let config = load(
            &[],
            &[("DATABASE_URL", "postgres://relay:hun?ter=2@db:5432/app")],
            None,
        )
        .unwrap();
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

    #[test]
    fn effective_configuration_shows_values_and_origins_but_no_secret() {
        let raw = load_raw(
            &[("partitions", "5")],
            &[
                (
                    "DATABASE_URL",
                    "postgres://relay:hunter2@db:5432/app?sslmode=require",
                ),
                ("NATS_URL", "nats://u:hunter2@nats:4222"),
                ("PGAPPNAME", "from-env"),
            ],
            Some("stream = \"FROM_FILE\"\n"),
        )
        .unwrap();
        let config = Config::from_sources(&raw).unwrap();
        let text = effective(&raw, &config);
        assert!(!text.contains("hunter2"), "{text}");
        for expected in [
            "partitions = \"5\"",
            "# flag --partitions",
            "stream = \"FROM_FILE\"",
            "# config file ",
            "database_url = \"<redacted>\"",
            "# environment variable DATABASE_URL",
            "nats_url = \"nats://<redacted>@nats:4222\"",
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
