//! libpq's connection modes: `sslmode`, `channel_binding`, `target_session_attrs` and
//! `load_balance_hosts`, as values with their libpq spellings. A leaf: [`crate::conninfo`]
//! parses them and [`crate::error`] names them, and neither is imported here.

use std::fmt;
use std::str::FromStr;

/// libpq's `sslmode`, without `allow` (which prefers plaintext).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SslMode {
    /// Never use TLS.
    Disable,
    /// Use TLS if the server offers it; verify the chain only if a root certificate is
    /// available (as libpq does).
    #[default]
    Prefer,
    /// Demand TLS; verify nothing, unless a root certificate is available, in which case
    /// this is `verify-ca` (as libpq does).
    Require,
    /// Demand TLS and a certificate chain to a trusted root; the host name is not checked.
    VerifyCa,
    /// Demand TLS, a certificate chain to a trusted root, and the host name in the
    /// certificate.
    VerifyFull,
}

impl SslMode {
    /// The libpq spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether a server without TLS must be refused.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text is not a supported `sslmode`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid sslmode {0:?}: expected one of disable, prefer, require, verify-ca, verify-full")]
pub struct ParseSslModeError(String);

impl FromStr for SslMode {
    type Err = ParseSslModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(SslMode::Disable),
            "prefer" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            other => Err(ParseSslModeError(other.to_owned())),
        }
    }
}

/// libpq's `channel_binding`: whether SCRAM must bind the authentication to the TLS
/// channel (SCRAM-SHA-256-PLUS with `tls-server-end-point`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ChannelBinding {
    /// Never bind.
    Disable,
    /// Bind when on TLS and the server offers it.
    #[default]
    Prefer,
    /// Authenticate with SCRAM-SHA-256-PLUS or not at all: no cleartext, md5, plain SCRAM
    /// or passwordless downgrade.
    Require,
}

impl ChannelBinding {
    /// The libpq spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ChannelBinding::Disable => "disable",
            ChannelBinding::Prefer => "prefer",
            ChannelBinding::Require => "require",
        }
    }
}

/// libpq's `target_session_attrs`: which kind of server a connection accepts, among the
/// hosts listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TargetSessionAttrs {
    /// Any server.
    #[default]
    Any,
    /// One that accepts read-write transactions by default (`transaction_read_only` off):
    /// a primary, not a hot standby.
    ReadWrite,
    /// One that does not (`transaction_read_only` on).
    ReadOnly,
    /// One not in recovery (`pg_is_in_recovery()` false).
    Primary,
    /// One in recovery: a standby.
    Standby,
    /// A standby if one of the hosts is; else any server (a second pass over the hosts).
    PreferStandby,
}

impl TargetSessionAttrs {
    pub(crate) const ALL: [TargetSessionAttrs; 6] = [
        TargetSessionAttrs::Any,
        TargetSessionAttrs::ReadWrite,
        TargetSessionAttrs::ReadOnly,
        TargetSessionAttrs::Primary,
        TargetSessionAttrs::Standby,
        TargetSessionAttrs::PreferStandby,
    ];

    /// The libpq spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TargetSessionAttrs::Any => "any",
            TargetSessionAttrs::ReadWrite => "read-write",
            TargetSessionAttrs::ReadOnly => "read-only",
            TargetSessionAttrs::Primary => "primary",
            TargetSessionAttrs::Standby => "standby",
            TargetSessionAttrs::PreferStandby => "prefer-standby",
        }
    }

    /// The passes over the hosts, each with what it accepts: `prefer-standby` is a pass for
    /// a standby, then one for any server (as in libpq).
    pub fn passes(self) -> &'static [TargetSessionAttrs] {
        match self {
            TargetSessionAttrs::PreferStandby => {
                &[TargetSessionAttrs::Standby, TargetSessionAttrs::Any]
            }
            TargetSessionAttrs::Any => &[TargetSessionAttrs::Any],
            TargetSessionAttrs::ReadWrite => &[TargetSessionAttrs::ReadWrite],
            TargetSessionAttrs::ReadOnly => &[TargetSessionAttrs::ReadOnly],
            TargetSessionAttrs::Primary => &[TargetSessionAttrs::Primary],
            TargetSessionAttrs::Standby => &[TargetSessionAttrs::Standby],
        }
    }

    /// The query whose one boolean answer decides a pass (as libpq asks it), `None` for
    /// `any`.
    pub fn check_query(self) -> Option<&'static str> {
        match self {
            TargetSessionAttrs::Any | TargetSessionAttrs::PreferStandby => None,
            TargetSessionAttrs::ReadWrite | TargetSessionAttrs::ReadOnly => {
                Some("SHOW transaction_read_only")
            }
            TargetSessionAttrs::Primary | TargetSessionAttrs::Standby => {
                Some("SELECT pg_catalog.pg_is_in_recovery()")
            }
        }
    }

    /// Whether a server whose answer to [`Self::check_query`] is `answer` (`on`/`off`,
    /// `t`/`f`) is accepted; `Err` says what the server is instead, for the log.
    pub fn accepts(self, answer: &str) -> Result<(), &'static str> {
        let yes = matches!(answer.trim(), "on" | "t" | "true");
        let (accepted, instead) = match self {
            TargetSessionAttrs::Any | TargetSessionAttrs::PreferStandby => (true, ""),
            TargetSessionAttrs::ReadWrite => (!yes, "read-only (transaction_read_only = on)"),
            TargetSessionAttrs::ReadOnly => (yes, "read-write (transaction_read_only = off)"),
            TargetSessionAttrs::Primary => (!yes, "a standby (in recovery)"),
            TargetSessionAttrs::Standby => (yes, "a primary (not in recovery)"),
        };
        if accepted {
            Ok(())
        } else {
            Err(instead)
        }
    }
}

impl fmt::Display for TargetSessionAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// libpq's `load_balance_hosts`: the order in which the hosts are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LoadBalanceHosts {
    /// In the order given.
    #[default]
    Disable,
    /// In a random order, drawn for each connection.
    Random,
}

impl LoadBalanceHosts {
    /// The libpq spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadBalanceHosts::Disable => "disable",
            LoadBalanceHosts::Random => "random",
        }
    }
}
