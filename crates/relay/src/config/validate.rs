//! Validation: the raw values turned into a [`Config`] in one place ([`Config::from_sources`]),
//! every error naming the key as the operator wrote it, and the warnings said once at start
//! (CFG4).

use super::*;

impl Config {
    /// Validates every raw value; the first invalid one is the error.
    pub fn from_sources(raw: &RawConfig) -> Result<Config, ConfigError> {
        use opt::*;
        let database = database_from(raw)?;
        let primary = primary_from(raw)?;
        let nats_url = raw.parse(&NATS_URL, parse_nats_url)?;
        let nats = crate::config::nats::NatsOptions::from_raw(raw, &nats_url)?;
        let warnings = startup_warnings(raw, &database, &nats_url, &nats);
        let table = raw.parse(&TABLE, parse_table_name)?;
        let mapping = crate::config::table::mapping_from(raw)?;
        let cloudevents =
            crate::config::table::cloudevents_from(raw, database.dbname(), &table, &mapping)?;
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
        atomic_needs_strict(atomic_transactions, shared_stream)?;
        let fast_ingest = raw.parse(&FAST_INGEST, parse_bool)?;
        let retention = retention_from(raw)?;
        Ok(Config {
            database,
            primary,
            nats_url,
            // The sink's acks arrive on one subscription per session (sink P10): room for a
            // whole window of them.
            nats,
            table,
            mapping,
            cloudevents,
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

/// `--atomic-transactions` needs strict mode: a shared stream's other writers publish the same
/// message ids, and JetStream refuses a whole atomic batch holding one.
fn atomic_needs_strict(atomic_transactions: bool, shared_stream: bool) -> Result<(), ConfigError> {
    if atomic_transactions && shared_stream {
        return Err(ConfigError(format!(
            "{} needs strict mode: a shared stream's other writers publish the same message ids, and JetStream refuses a whole atomic batch holding one; unset {}",
            opt::ATOMIC_TRANSACTIONS.flag(),
            opt::SHARED_STREAM.flag()
        )));
    }
    Ok(())
}

/// `--primary-url`: the primary when the relay decodes on a standby, over the PG* variables
/// as `DATABASE_URL`, with the relay's application name. Retention is refused with it: it
/// reads the slot's confirmed position and deletes on another server (not supported yet).
fn primary_from(raw: &RawConfig) -> Result<Option<ConnInfo>, ConfigError> {
    let libpq_env = |name: &str| raw.libpq_env(name);
    let Some(primary) = raw.parse_optional(&opt::PRIMARY_URL, |v| {
        ConnInfo::parse_with_env(v, libpq_env).map_err(|e| e.to_string())
    })?
    else {
        return Ok(None);
    };
    if raw.parse(&opt::FAILOVER_SLOT, parse_bool)? {
        return Err(ConfigError(format!(
            "{} cannot be used with {}: Postgres creates no fail-over slot on a standby (a standby's slot survives its own promotion without it); unset one of them",
            opt::FAILOVER_SLOT.flag(),
            opt::PRIMARY_URL.flag()
        )));
    }
    if raw.values.contains_key(opt::RETENTION_GRACE.key)
        && raw
            .parse(&opt::RETENTION_GRACE, |v| word_or("off", v, parse_duration))?
            .is_some()
    {
        return Err(ConfigError(format!(
            "{} cannot be used with {} yet: retention reads the slot's confirmed position on the standby and deletes on the primary; unset one of them",
            opt::RETENTION_GRACE.flag(),
            opt::PRIMARY_URL.flag()
        )));
    }
    Ok(Some(if primary.application_name().is_none() {
        primary.with_application_name(FALLBACK_APPLICATION_NAME)
    } else {
        primary
    }))
}

/// The Postgres connection: `DATABASE_URL` (over the PG* variables), or the PG* variables
/// alone when they say something and `DATABASE_URL` is not set; with the relay's
/// application name when none is given.
pub(super) fn database_from(raw: &RawConfig) -> Result<ConnInfo, ConfigError> {
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
/// The duplicate window and the stream's settings, which must agree.
pub(super) fn stream_limits(raw: &RawConfig) -> Result<(Duration, StreamSettings), ConfigError> {
    let duplicate_window = raw.parse(&opt::DUPLICATE_WINDOW, parse_duration)?;
    let stream_settings = StreamSettings::from_raw(raw)?;
    check_max_age(raw, &stream_settings, duplicate_window)?;
    Ok((duplicate_window, stream_settings))
}

/// JetStream refuses a stream whose max age is shorter than its duplicate window.
pub(super) fn check_max_age(
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
pub(super) fn retention_from(raw: &RawConfig) -> Result<Option<RetentionConfig>, ConfigError> {
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
/// What is risky but allowed, for the log at start, one line each: the Postgres
/// connection's own warnings ([`ConnInfo::warnings`]); secrets given on the command line
/// (any user of the machine reads them in `ps`); files holding secrets that group or others
/// can read (libpq's rule, [`replication::conninfo::exposed_secret_file`]); secrets too
/// weak for the log scrubber ([`secrets::weakness`]); credentials that would travel
/// without verified TLS. Never a secret itself.
pub(super) fn startup_warnings(
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
pub(super) fn given<'a>(raw: &'a RawConfig, spec: &OptionSpec) -> Option<(&'a String, &'a Origin)> {
    raw.values
        .get(spec.key)
        .map(|(value, origin)| (value, origin))
}

/// Secrets given on the command line, which any user of the machine reads in `ps`.
pub(super) fn secrets_on_command_line(
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
pub(super) fn exposed_secret_files(raw: &RawConfig) -> Vec<String> {
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
pub(super) fn weak_secrets(
    database: &ConnInfo,
    nats: &crate::config::nats::NatsOptions,
) -> Vec<String> {
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
pub(super) fn credentials_in_clear(
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
