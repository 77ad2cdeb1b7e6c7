//! Configuration: every option is a flag, an environment variable and a key of an optional
//! TOML file. Precedence: flag > environment > file > default.
//!
//! Raw values stay strings until [`Config::from_sources`] validates them all in one place,
//! so every error names the key as the operator wrote it (`OUTBOX_RELAY_PARTITIONS`,
//! `--partitions` or `partitions` in the file) and says what is expected.
//!
//! # Invariants
//! - C1 Secrets (the Postgres password, NATS credentials in the URL) never appear in
//!   `Debug`, `Display` or error output of a config.
//! - C2 An unknown file key or `OUTBOX_RELAY_*` variable is an error, not ignored: a typo
//!   must not silently fall back to a default.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use replication::ConnInfo;

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
}

impl OptionSpec {
    /// The command-line flag, `--key-with-dashes`.
    pub fn flag(&self) -> String {
        format!("--{}", self.key.replace('_', "-"))
    }
}

macro_rules! options {
    ($($name:ident = ($key:literal, $env:literal, $default:expr, $help:literal);)*) => {
        $(
            #[doc = $help]
            pub const $name: OptionSpec = OptionSpec { key: $key, env: $env, default: $default, help: $help };
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
            "Postgres connection: a libpq URL (postgres://user:pass@host:port/db?sslmode=verify-full&sslrootcert=ca.crt) or key=value string");
        NATS_URL = ("nats_url", "NATS_URL", Some("nats://127.0.0.1:4222"),
            "NATS server URL(s), comma-separated");
        TABLE = ("table", "OUTBOX_RELAY_TABLE", Some("public.outbox_events"),
            "The outbox table, as schema.table");
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
        ACK_TIMEOUT = ("ack_timeout", "OUTBOX_RELAY_ACK_TIMEOUT", Some("10s"),
            "How long to wait for a JetStream ack before reconnecting");
        SHUTDOWN_TIMEOUT = ("shutdown_timeout", "OUTBOX_RELAY_SHUTDOWN_TIMEOUT", Some("10s"),
            "On SIGTERM/SIGINT, how long to wait for in-flight acks");
        SHARED_STREAM = ("shared_stream", "OUTBOX_RELAY_SHARED_STREAM", Some("false"),
            "Other writers publish to the stream too: de-duplication only, no sequence fencing or tail resume (weaker; see docs/guarantees.md)");
        ON_POISON = ("on_poison", "OUTBOX_RELAY_ON_POISON", Some("halt"),
            "An event JetStream can never accept: halt (stop, naming it) or dead-letter (a record on {prefix}.dlq in its place)");
        WORKER_THREADS = ("worker_threads", "OUTBOX_RELAY_WORKER_THREADS", Some("1"),
            "Runtime threads: 1 runs everything on one thread (fastest where Postgres and NATS share the cores); more spreads the relay's tasks");
        LOG_FORMAT = ("log_format", "OUTBOX_RELAY_LOG_FORMAT", Some("text"),
            "Log format: text or json (filter with RUST_LOG)");
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
    /// The built-in default.
    Default,
}

/// Raw option values by file key, each with its origin.
#[derive(Debug, Default, Clone)]
pub struct RawConfig {
    values: BTreeMap<&'static str, (String, Origin)>,
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
        for key in env_keys {
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
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError(format!("cannot read config file {}: {e}", path.display()))
            })?;
            let table: toml::Table = text.parse().map_err(|e| {
                ConfigError(format!(
                    "config file {} is not valid TOML: {e}",
                    path.display()
                ))
            })?;
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
                let value = match value {
                    toml::Value::String(s) => s,
                    toml::Value::Integer(i) => i.to_string(),
                    other => {
                        return Err(ConfigError(format!(
                            "key {key} in config file {} must be a string or an integer, not {}",
                            path.display(),
                            other.type_str()
                        )))
                    }
                };
                raw.offer(spec, value, Origin::File(path.to_owned()));
            }
        }
        for spec in opt::ALL {
            if let Some(default) = spec.default {
                raw.offer(spec, default.to_owned(), Origin::Default);
            }
        }
        Ok(raw)
    }

    fn get(&self, spec: &OptionSpec) -> Result<(&str, &Origin), ConfigError> {
        self.values.get(spec.key).map(|(v, o)| (v.as_str(), o)).ok_or_else(|| {
            ConfigError(format!(
                "{} is required: set the environment variable {}, the flag {} or the key {} in the config file",
                spec.env,
                spec.env,
                spec.flag(),
                spec.key
            ))
        })
    }

    /// Parses one value, naming the key as its origin spells it on failure.
    fn parse<T>(
        &self,
        spec: &OptionSpec,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let (value, origin) = self.get(spec)?;
        parse(value).map_err(|why| {
            let shown = if spec.key == opt::DATABASE_URL.key || spec.key == opt::NATS_URL.key {
                "<redacted>".to_owned()
            } else {
                format!("{value:?}")
            };
            let name = match origin {
                Origin::Flag => spec.flag(),
                Origin::Env => spec.env.to_owned(),
                Origin::File(path) => format!("{} (in {})", spec.key, path.display()),
                Origin::Default => format!("{} (default)", spec.key),
            };
            ConfigError(format!("invalid {name} = {shown}: {why}"))
        })
    }
}

/// Environment variables we read that are not options (so C2 does not reject them).
const KNOWN_EXTRA_ENV: &[&str] = &["OUTBOX_RELAY_CONFIG"];

/// `schema.table`, both parts verbatim (quoted when used in SQL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// The schema.
    pub schema: String,
    /// The table.
    pub name: String,
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

impl TableName {
    /// The name as SQL: both parts quoted.
    pub fn to_sql(&self) -> String {
        format!(
            "{}.{}",
            replication::quote_identifier(&self.schema),
            replication::quote_identifier(&self.name)
        )
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

/// A NATS URL list whose credentials never print.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUrl(String);

impl NatsUrl {
    /// The URL(s), credentials included, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NatsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redacted: Vec<String> = self
            .0
            .split(',')
            .map(|url| match (url.find("://"), url.rfind('@')) {
                (Some(scheme), Some(at)) if at > scheme => {
                    format!("{}<redacted>{}", &url[..scheme + 3], &url[at..])
                }
                _ => url.to_owned(),
            })
            .collect();
        f.write_str(&redacted.join(","))
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
    /// The outbox table.
    pub table: TableName,
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
    /// Log format.
    pub log_format: LogFormat,
    /// Whether `run` may create the publication, slot and stream.
    pub create: bool,
}

impl Config {
    /// Validates every raw value; the first invalid one is the error.
    pub fn from_sources(raw: &RawConfig) -> Result<Config, ConfigError> {
        use opt::*;
        let database = raw.parse(&DATABASE_URL, |v| {
            ConnInfo::from_str(v).map_err(|e| e.to_string())
        })?;
        let nats_url = raw.parse(&NATS_URL, |v| {
            for url in v.split(',') {
                let url = url.trim();
                let scheme_ok = ["nats://", "tls://", "ws://", "wss://"]
                    .iter()
                    .any(|s| url.starts_with(s))
                    || !url.contains("://");
                if url.is_empty() || !scheme_ok {
                    return Err(
                        "expected nats://host:port (or tls://, ws://, wss://), comma-separated"
                            .into(),
                    );
                }
            }
            Ok(NatsUrl(v.to_owned()))
        })?;
        let table = raw.parse(&TABLE, |v| {
            let (schema, name) = v.split_once('.').unwrap_or(("public", v));
            if schema.is_empty() || name.is_empty() {
                return Err("expected schema.table, e.g. public.outbox_events".into());
            }
            Ok(TableName {
                schema: schema.to_owned(),
                name: name.to_owned(),
            })
        })?;
        let slot = raw.parse(&SLOT, |v| {
            let valid = !v.is_empty()
                && v.len() <= 63
                && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if valid {
                Ok(v.to_owned())
            } else {
                Err("replication slot names have 1 to 63 characters: lower-case letters, digits and underscores".into())
            }
        })?;
        let publication = raw.parse(&PUBLICATION, |v| {
            if v.is_empty() || v.len() > 63 {
                Err("publication names have 1 to 63 characters".into())
            } else {
                Ok(v.to_owned())
            }
        })?;
        let stream = raw.parse(&STREAM, |v| {
            let valid = !v.is_empty()
                && v.bytes().all(|b| {
                    !matches!(b, b'.' | b'*' | b'>' | b'/' | b'\\') && b.is_ascii_graphic()
                });
            if valid {
                Ok(v.to_owned())
            } else {
                Err(
                    "stream names are printable ASCII without spaces, '.', '*', '>', '/' or '\\'"
                        .into(),
                )
            }
        })?;
        let subject_prefix = raw.parse(&SUBJECT_PREFIX, |v| {
            outbox::subject::validate_prefix(v)?;
            Ok(v.to_owned())
        })?;
        let partitions = raw.parse(&PARTITIONS, |v| {
            v.parse::<NonZeroU64>()
                .map_err(|_| "expected a positive integer (the seed's default is 12)".to_owned())
        })?;
        let max_in_flight = raw.parse(&MAX_IN_FLIGHT, |v| match v.parse::<usize>() {
            Ok(n) if (1..=1_000_000).contains(&n) => Ok(n),
            _ => Err("expected an integer from 1 to 1000000".into()),
        })?;
        let duplicate_window = raw.parse(&DUPLICATE_WINDOW, parse_duration)?;
        let ack_timeout = raw.parse(&ACK_TIMEOUT, parse_duration)?;
        let shutdown_timeout = raw.parse(&SHUTDOWN_TIMEOUT, parse_duration)?;
        let shared_stream = raw.parse(&SHARED_STREAM, parse_bool)?;
        let on_poison = raw.parse(&ON_POISON, |v| match v {
            "halt" => Ok(sink::PoisonPolicy::Halt),
            "dead-letter" => Ok(sink::PoisonPolicy::DeadLetter),
            _ => Err("expected halt or dead-letter".into()),
        })?;
        let worker_threads = raw.parse(&WORKER_THREADS, |v| match v.parse::<usize>() {
            Ok(n) if (1..=256).contains(&n) => Ok(n),
            _ => Err("expected an integer from 1 to 256".into()),
        })?;
        let log_format = raw.parse(&LOG_FORMAT, |v| match v {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err("expected text or json".into()),
        })?;
        Ok(Config {
            database,
            nats_url,
            table,
            slot,
            publication,
            stream,
            subject_prefix,
            partitions,
            max_in_flight,
            duplicate_window,
            ack_timeout,
            shutdown_timeout,
            shared_stream,
            on_poison,
            worker_threads,
            log_format,
            create: true,
        })
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

/// Parses `500ms`, `90s`, `2m`, `1h` (a bare number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| "expected a duration like 500ms, 90s, 2m or 1h".to_owned())?;
    let duration = match unit.trim() {
        "ms" => Duration::from_millis(number),
        "" | "s" => Duration::from_secs(number),
        "m" | "min" => Duration::from_secs(number.saturating_mul(60)),
        "h" => Duration::from_secs(number.saturating_mul(3600)),
        _ => return Err(format!("unknown unit {unit:?}: use ms, s, m or h")),
    };
    if duration.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(
        flags: &[(&'static str, &str)],
        env: &[(&str, &str)],
        file: Option<&str>,
    ) -> Result<Config, ConfigError> {
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
        let raw = RawConfig::load(
            &flags,
            &|k| env_map.get(k).cloned(),
            &keys,
            file.map(|_| path.as_path()),
        )?;
        Config::from_sources(&raw)
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

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("1.5s").is_err());
    }
}
