//! The raw sources: flags, environment and the TOML file collected as strings with where
//! each came from ([`RawConfig`], [`Origin`]), secrets redacted in its `Debug` (CFG1), unknown
//! keys refused (CFG2).

use super::*;

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
/// Raw option values by file key, each with its origin; and the environment libpq reads
/// (`PG*`, `HOME`, `USER`), for the Postgres connection. Its `Debug` redacts secrets (CFG1).
#[derive(Default, Clone)]
pub struct RawConfig {
    pub(super) values: BTreeMap<&'static str, (String, Origin)>,
    pub(super) libpq_env: BTreeMap<String, String>,
    /// The `--config` file, when it holds a secret (whether or not another source wins).
    pub(super) secret_file: Option<PathBuf>,
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
    pub(super) fn offer_env_keys(
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
    pub(super) fn offer_file(&mut self, path: &Path) -> Result<(), ConfigError> {
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

    pub(super) fn get(&self, spec: &OptionSpec) -> Result<(&str, &Origin), ConfigError> {
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
    pub(super) fn libpq_env(&self, name: &str) -> Option<String> {
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
pub(super) const KNOWN_EXTRA_ENV: &[&str] = &["OUTBOX_RELAY_CONFIG"];

/// Options whose value is, or may contain, a secret (CFG1). Any option whose key names a
/// password, token or secret is one too.
pub(super) const SECRET_KEYS: &[&str] = &["database_url", "primary_url", "nats_url"];

/// Whether the value of option `key` is, or may contain, a secret.
pub(super) fn key_is_secret(key: &str) -> bool {
    SECRET_KEYS.contains(&key)
        || ["password", "token", "secret"]
            .iter()
            .any(|w| key.contains(w))
}

/// Whether `value` of `spec` holds a secret: a password or token option; a Postgres
/// connection string with a password (or one that does not parse); NATS URLs with
/// credentials.
pub(super) fn value_holds_secret(spec: &OptionSpec, value: &str) -> bool {
    if spec.key == opt::DATABASE_URL.key || spec.key == opt::PRIMARY_URL.key {
        ConnInfo::parse_with_env(value, |_| None).map_or(true, |info| info.password().is_some())
    } else if spec.key == opt::NATS_URL.key {
        !NatsUrl(value.to_owned()).secrets().is_empty()
    } else {
        spec.is_secret()
    }
}

/// A raw value as it may be shown: NATS URLs without their credentials, other secrets as
/// `<redacted>`, everything else as given.
pub(super) fn shown_value(key: &str, value: &str) -> String {
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
pub(super) fn toml_error(path: &Path, text: &str, error: &toml::de::Error) -> ConfigError {
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
/// A config file's value as text: TOML strings, integers and booleans only.
pub(super) fn file_value(
    key: &str,
    value: toml::Value,
    path: &Path,
) -> Result<String, ConfigError> {
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
