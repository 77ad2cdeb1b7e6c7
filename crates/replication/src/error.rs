//! Errors, split by what the caller must do about them.
//!
//! The caller is a supervisor loop with two answers: reconnect and resume from the confirmed
//! LSN ([`Error::is_transient`]), or stop and wait for an operator (everything else). The
//! classification is "transient unless proven otherwise": a new failure mode costs a few
//! retries with backoff, while a wrongly permanent error stops the relay for nothing. Errors
//! are permanent only when retrying cannot help: a bad connection string, a TLS setup or
//! certificate problem, a missing role, database, slot or publication, a missing privilege,
//! or a server that is configured in a way we cannot work with.
//!
//! Messages are lowercase with no trailing period and carry the server's message, SQLSTATE,
//! detail and hint, plus a hint of ours where the operator can fix the cause. No error ever
//! contains a password: the connection target appears only in its redacted form
//! ([`crate::ConnInfo::redacted`]).

use std::fmt;
use std::io;
use std::time::Duration;

use crate::modes::{SslMode, TargetSessionAttrs};

/// Everything that can go wrong while connecting, querying or streaming.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection string is invalid. Permanent.
    #[error("invalid connection string: {0}")]
    Config(String),

    /// TLS cannot be set up as configured (missing or unreadable root certificate). Permanent.
    #[error("tls configuration: {0}")]
    TlsConfig(String),

    /// The server refused TLS while `sslmode` demands it. Permanent.
    #[error(
        "the server does not support TLS, but sslmode={sslmode} requires it; \
         hint: enable ssl on the server or use sslmode=prefer"
    )]
    TlsUnsupported {
        /// The `sslmode` that demanded TLS.
        sslmode: SslMode,
    },

    /// The TLS handshake failed: certificate rejected, no common protocol version, ...
    /// Permanent when the certificate or the configuration is the cause.
    #[error("tls handshake with {target} failed: {source}{}", tls_hint(source))]
    TlsHandshake {
        /// The redacted connection target.
        target: String,
        /// What rustls reported.
        #[source]
        source: rustls::Error,
    },

    /// An I/O error on the connection. Transient.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing, with the redacted target where it helps.
        context: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },

    /// The server closed the connection. Transient.
    #[error("the server closed the connection {context}")]
    Closed {
        /// What we were doing.
        context: &'static str,
    },

    /// The server ended the replication stream (CopyDone), which it never does on its own
    /// accord for a healthy logical stream. Transient.
    #[error("the server ended the replication stream")]
    StreamEnded,

    /// An operation took longer than allowed. Transient.
    #[error("timed out after {after:?} {what}")]
    Timeout {
        /// What we were waiting for.
        what: String,
        /// The limit.
        after: Duration,
    },

    /// The server reported an error. Transient or permanent by SQLSTATE.
    #[error("{0}")]
    Server(Box<DbError>),

    /// Authentication cannot work with what we have: no password, a method we do not
    /// implement, or a server that failed to prove it knows the password. Permanent.
    #[error("authentication failed: {0}")]
    Auth(String),

    /// The server did not accept a session setting we pin at startup. Permanent.
    #[error(
        "the server reports {parameter}={actual:?}, but the relay needs {expected}; \
         hint: check that no role or database setting overrides {parameter}"
    )]
    Setting {
        /// The parameter name.
        parameter: &'static str,
        /// What we asked for.
        expected: &'static str,
        /// What the server reported.
        actual: String,
    },

    /// The server sent something the protocol does not allow at this point. Transient.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// A replication message (inside CopyData) does not decode. Transient: a reconnect
    /// replays from the confirmed position.
    #[error("undecodable replication message: {0}")]
    Decode(#[from] pgoutput::DecodeError),

    /// No host of a multi-host connection string gave a session, or none was the server
    /// `target_session_attrs` asks for: what each host did. Transient when a host may yet
    /// become usable (an I/O failure, a server of the wrong kind that a promotion may turn
    /// into the right one); permanent when every host failed permanently.
    #[error("no usable server (target_session_attrs={attrs}) among {hosts}: {tried}")]
    NoServer {
        /// The hosts, redacted (`a:5432,b:5433`).
        hosts: String,
        /// What the connection asked for.
        attrs: TargetSessionAttrs,
        /// Each host's failure, `host:port: why`, separated by `; `.
        tried: String,
        /// Whether retrying may help.
        transient: bool,
    },

    /// An error of the control-plane SQL connection ([`crate::connect_sql`]) that is not a
    /// server error. Transient unless caused by a permanent error of ours (TLS).
    #[error("{context}: {source}")]
    Sql {
        /// What we were doing, with the redacted target.
        context: String,
        /// The tokio-postgres error.
        #[source]
        source: tokio_postgres::Error,
    },
}

impl Error {
    /// Whether reconnecting (with backoff) may succeed: "transient unless proven otherwise".
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_)
            | Error::TlsConfig(_)
            | Error::TlsUnsupported { .. }
            | Error::Auth(_)
            | Error::Setting { .. } => false,
            Error::TlsHandshake { source, .. } => !tls_error_is_permanent(source),
            Error::Io { .. }
            | Error::Closed { .. }
            | Error::StreamEnded
            | Error::Timeout { .. }
            | Error::Protocol(_)
            | Error::Decode(_) => true,
            Error::Server(db) => db.is_transient(),
            Error::NoServer { transient, .. } => *transient,
            Error::Sql { source, .. } => sql_error_is_transient(source),
        }
    }

    /// The SQLSTATE of a server error, if this is one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Server(db) => Some(db.code()),
            Error::Sql { source, .. } => source.code().map(|code| code.code()),
            _ => None,
        }
    }

    /// The server error, if this is one.
    pub fn as_db_error(&self) -> Option<&DbError> {
        match self {
            Error::Server(db) => Some(db),
            _ => None,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn protocol(message: impl Into<String>) -> Self {
        Error::Protocol(message.into())
    }
}

/// Walks the source chain of a tokio-postgres error: our own errors (raised by our TLS
/// connector) keep their classification; a server error is classified by SQLSTATE.
fn sql_error_is_transient(error: &tokio_postgres::Error) -> bool {
    if let Some(db) = error.as_db_error() {
        return sqlstate_is_transient(db.code().code());
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(ours) = cause.downcast_ref::<Error>() {
            return ours.is_transient();
        }
        if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
            return !tls_error_is_permanent(tls);
        }
        source = cause.source();
    }
    true
}

/// Whether a TLS failure will repeat on every attempt: certificate, name and configuration
/// problems do; garbled records and alerts may be a network hiccup.
fn tls_error_is_permanent(error: &rustls::Error) -> bool {
    matches!(
        error,
        rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::UnsupportedNameType
            | rustls::Error::PeerIncompatible(_)
            | rustls::Error::InvalidCertRevocationList(_)
            | rustls::Error::General(_)
    )
}

fn tls_hint(error: &rustls::Error) -> &'static str {
    match error {
        rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidForName
            | rustls::CertificateError::NotValidForNameContext { .. },
        ) => {
            "; hint: the server certificate does not name this host: connect by a name it \
             lists, or use sslmode=verify-ca to skip the host name check"
        }
        rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer) => {
            "; hint: the server certificate is not signed by a CA in sslrootcert: point \
             sslrootcert at the CA that issued it"
        }
        rustls::Error::InvalidCertificate(_) => {
            "; hint: check the server certificate and sslrootcert"
        }
        _ => "",
    }
}

/// `error` on one line: `message (SQLSTATE code); detail: …; hint: …` for an error the server
/// returned, else what failed and its cause (`error connecting to server: Connection refused`).
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => {
            let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                text.push_str(&format!("; detail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            text
        }
        None => match std::error::Error::source(error) {
            Some(cause) => format!("{error}: {cause}"),
            None => error.to_string(),
        },
    }
}

/// Whether a SQLSTATE means "try again later" (connection problems, shutdowns, crashes, too
/// many connections, a slot still held by a dying walsender, serialization failures, and
/// everything not known to be permanent) rather than "an operator must act".
pub fn sqlstate_is_transient(code: &str) -> bool {
    const PERMANENT: &[&str] = &[
        "3D000", // invalid_catalog_name: unknown database
        "0A000", // feature_not_supported
        "55000", // object_not_in_prerequisite_state: wal_level, slot of another database
        "22023", // invalid_parameter_value: bad START_REPLICATION option
    ];
    let permanent_class = code.starts_with("28") // invalid_authorization_specification
        || code.starts_with("42"); // syntax_error_or_access_rule_violation: 42704, 42501, 42P01
    !(permanent_class || PERMANENT.contains(&code))
}

/// An error reported by the server (ErrorResponse), with a hint of ours where the operator
/// can fix the cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbError {
    severity: String,
    code: String,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
    advice: Option<String>,
}

impl DbError {
    /// Builds an error from its fields; `user` (the connecting role) makes our hint concrete.
    pub(crate) fn new(
        severity: String,
        code: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
        user: Option<&str>,
    ) -> Self {
        let advice = advice(&code, &message, user);
        DbError {
            severity,
            code,
            message,
            detail,
            hint,
            advice,
        }
    }

    pub(crate) fn from_tokio_postgres(db: &tokio_postgres::error::DbError, user: &str) -> Self {
        DbError::new(
            db.severity().to_owned(),
            db.code().code().to_owned(),
            db.message().to_owned(),
            db.detail().map(str::to_owned),
            db.hint().map(str::to_owned),
            Some(user),
        )
    }

    /// `ERROR`, `FATAL` or `PANIC` (not localized).
    pub fn severity(&self) -> &str {
        &self.severity
    }

    /// The SQLSTATE.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The server's primary message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The server's detail, if any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// The server's hint, if any.
    pub fn hint(&self) -> Option<&str> {
        self.hint.as_deref()
    }

    /// Our hint for the operator, if we know how to fix the cause.
    pub fn advice(&self) -> Option<&str> {
        self.advice.as_deref()
    }

    /// See [`sqlstate_is_transient`].
    pub fn is_transient(&self) -> bool {
        sqlstate_is_transient(&self.code)
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.code)?;
        if let Some(detail) = &self.detail {
            write!(f, "; detail: {}", sentence_fragment(detail))?;
        }
        match (&self.hint, &self.advice) {
            (Some(hint), Some(advice)) => {
                write!(f, "; hint: {}; {}", sentence_fragment(hint), advice)?
            }
            (Some(hint), None) => write!(f, "; hint: {}", sentence_fragment(hint))?,
            (None, Some(advice)) => write!(f, "; hint: {advice}")?,
            (None, None) => {}
        }
        Ok(())
    }
}

impl From<DbError> for Error {
    fn from(db: DbError) -> Self {
        Error::Server(Box::new(db))
    }
}

/// The server's details and hints are full sentences; ours embed them mid-message.
fn sentence_fragment(text: &str) -> &str {
    text.trim_end().trim_end_matches('.')
}

/// Our hint for errors an operator can fix.
fn advice(code: &str, message: &str, user: Option<&str>) -> Option<String> {
    let user = user.unwrap_or("<user>");
    let advice = match code {
        "28P01" => "check the password in DATABASE_URL".to_owned(),
        "28000" if message.contains("no pg_hba.conf entry for replication connection") => {
            format!("add a `host replication {user} <addr> scram-sha-256` line to pg_hba.conf")
        }
        "28000" if message.contains("no pg_hba.conf entry") => {
            format!("add a `host <database> {user} <addr> scram-sha-256` line to pg_hba.conf")
        }
        "28000" if message.contains("role") && message.contains("does not exist") => {
            "check the user in DATABASE_URL".to_owned()
        }
        "3D000" => "check the database name in DATABASE_URL".to_owned(),
        "42501" if message.contains("replication") || message.contains("walsender") => {
            format!("the role needs the REPLICATION attribute: ALTER ROLE {user} REPLICATION")
        }
        "42704" if message.contains("replication slot") => {
            "create the slot first: SELECT pg_create_logical_replication_slot('<slot>', 'pgoutput')"
                .to_owned()
        }
        "42704" if message.contains("publication") => {
            "create the publication first: CREATE PUBLICATION <name> FOR TABLE <outbox table>"
                .to_owned()
        }
        "55000"
            if message.contains("cannot read from logical replication slot")
                || (message.contains("can no longer") && message.contains("replication slot")) =>
        {
            "the slot was invalidated (wal_status = lost): the WAL it needed is gone, so events \
             committed in it cannot be decoded; the relay does not recreate the slot by itself \
             (a new one would skip them): follow docs/operations.md, \"The slot is invalidated\""
                .to_owned()
        }
        "55000" if message.contains("wal_level") => {
            "set wal_level = logical in postgresql.conf and restart the server".to_owned()
        }
        "53300" if message.contains("max_wal_senders") => {
            "raise max_wal_senders on the server, or stop other replication clients".to_owned()
        }
        "55006" if message.contains("replication slot") => {
            "another client is streaming from this slot; the relay retries until it is free"
                .to_owned()
        }
        _ => return None,
    };
    Some(advice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(code: &str, message: &str) -> DbError {
        DbError::new(
            "FATAL".into(),
            code.into(),
            message.into(),
            None,
            None,
            Some("relay"),
        )
    }

    #[test]
    fn sqlstate_classification() {
        for transient in [
            "57P01", "57P02", "57P03", "53300", "55006", "08006", "08001", "08P01", "40001",
            "40P01", "XX000", "53100", "58000",
        ] {
            assert!(sqlstate_is_transient(transient), "{transient}");
        }
        for permanent in [
            "28000", "28P01", "3D000", "42704", "42501", "0A000", "42P01", "55000", "42601",
            "22023",
        ] {
            assert!(!sqlstate_is_transient(permanent), "{permanent}");
        }
    }

    #[test]
    fn error_classification() {
        assert!(!Error::Config("x".into()).is_transient());
        assert!(!Error::TlsConfig("x".into()).is_transient());
        assert!(!Error::TlsUnsupported {
            sslmode: SslMode::Require
        }
        .is_transient());
        assert!(!Error::Auth("x".into()).is_transient());
        assert!(Error::io("x", io::Error::from(io::ErrorKind::ConnectionReset)).is_transient());
        assert!(Error::Closed { context: "x" }.is_transient());
        assert!(Error::StreamEnded.is_transient());
        assert!(Error::protocol("x").is_transient());
        let cert = Error::TlsHandshake {
            target: "postgres://u@h:1/d".into(),
            source: rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        };
        assert!(!cert.is_transient());
        assert!(cert.to_string().contains("sslrootcert"), "{cert}");
        let garbled = Error::TlsHandshake {
            target: "postgres://u@h:1/d".into(),
            source: rustls::Error::DecryptError,
        };
        assert!(garbled.is_transient());
        let shutdown = Error::from(db(
            "57P01",
            "terminating connection due to administrator command",
        ));
        assert!(shutdown.is_transient());
        assert_eq!(shutdown.sqlstate(), Some("57P01"));
        assert_eq!(Error::StreamEnded.sqlstate(), None);
    }

    #[test]
    fn messages_carry_server_fields_and_our_hints() {
        let error = Error::from(DbError::new(
            "ERROR".into(),
            "42P01".into(),
            "relation \"outbox\" does not exist".into(),
            Some("Some detail.".into()),
            Some("Some hint.".into()),
            None,
        ));
        assert_eq!(
            error.to_string(),
            "relation \"outbox\" does not exist (SQLSTATE 42P01); detail: Some detail; hint: Some hint"
        );

        let password = Error::from(db(
            "28P01",
            "password authentication failed for user \"relay\"",
        ));
        assert!(!password.is_transient());
        assert_eq!(
            password.to_string(),
            "password authentication failed for user \"relay\" (SQLSTATE 28P01); \
             hint: check the password in DATABASE_URL"
        );

        let hba = db(
            "28000",
            "no pg_hba.conf entry for replication connection from host \"10.0.0.1\", user \"relay\", no encryption",
        );
        assert_eq!(
            hba.advice(),
            Some("add a `host replication relay <addr> scram-sha-256` line to pg_hba.conf")
        );

        let privilege = db(
            "42501",
            "must be superuser or replication role to start walsender",
        );
        assert_eq!(
            privilege.advice(),
            Some("the role needs the REPLICATION attribute: ALTER ROLE relay REPLICATION")
        );

        for invalidated in [
            "cannot read from logical replication slot \"outbox_relay\"",
            "can no longer get changes from replication slot \"outbox_relay\"",
            "can no longer access replication slot \"outbox_relay\"",
        ] {
            let error = db("55000", invalidated);
            assert!(!error.is_transient(), "{invalidated}");
            assert!(
                error
                    .advice()
                    .is_some_and(|a| a.contains("The slot is invalidated")),
                "{invalidated}"
            );
        }
        let wal_level = db("55000", "logical decoding requires wal_level >= logical");
        assert!(wal_level
            .advice()
            .is_some_and(|a| a.contains("wal_level = logical")));

        let both = DbError::new(
            "ERROR".into(),
            "42704".into(),
            "replication slot \"s\" does not exist".into(),
            None,
            Some("Server hint.".into()),
            None,
        );
        assert!(both
            .to_string()
            .contains("; hint: Server hint; create the slot first"));
    }
}
