//! Connection parameters, parsed like libpq parses them, in one place for the replication
//! connection and the control connection alike.
//!
//! Sources, by libpq's precedence: the connection string, then the `PG*` environment
//! variables, then (for the password only) the password file, then defaults. Every value
//! remembers where it came from ([`Source`], shown by [`ConnInfo::describe`]).
//!
//! Two notations of the connection string are accepted
//! (<https://www.postgresql.org/docs/15/libpq-connect.html#LIBPQ-CONNSTRING>):
//! - a URL: `postgres://user:password@host:port/dbname?sslmode=verify-full&...` (or
//!   `postgresql://`), with percent-decoding of every component, `[...]` around IPv6
//!   addresses, and a percent-encoded socket directory as host (`postgres://%2Ftmp/db`).
//!   The user info ends at the last `@`, so a password with unencoded `@`, `/`, `?`, `=` or
//!   `:` stays whole; an `@` in the query string (`?application_name=me@host`) is recognised
//!   as such only when that query string is well-formed (every name a supported parameter).
//! - key=value pairs: `host=db port=5432 user=relay password='it\'s' dbname=app`, values
//!   optionally in single quotes, a backslash escaping the next character. As an extension
//!   (libpq rejects it), a doubled quote inside a quoted value is one quote: `'it''s'`.
//!
//! Supported parameters and their environment variables: `host` (`PGHOST`), `port`
//! (`PGPORT`), `user` (`PGUSER`), `password` (`PGPASSWORD`), `dbname` (`PGDATABASE`),
//! `passfile` (`PGPASSFILE`), `sslmode` (`PGSSLMODE`), `sslrootcert` (`PGSSLROOTCERT`, a
//! PEM file or `system`), `sslcert` (`PGSSLCERT`), `sslkey` (`PGSSLKEY`), `channel_binding`
//! (`PGCHANNELBINDING`), `require_auth` (`PGREQUIREAUTH`), `application_name`
//! (`PGAPPNAME`), `connect_timeout` (`PGCONNECT_TIMEOUT`), `target_session_attrs`
//! (`PGTARGETSESSIONATTRS`) and `load_balance_hosts` (`PGLOADBALANCEHOSTS`). A few more are
//! accepted with
//! the value that describes what the relay does anyway ([`NEUTRAL`], e.g.
//! `gssencmode=disable`), so that connection strings printed by managed services
//! work. Any other parameter is an error naming it, and so is a set environment variable
//! of a libpq feature the relay lacks (`PGHOSTADDR`, `PGSERVICE`, `PGOPTIONS`, `PGSSLCRL`,
//! ...): silently ignoring, say, a CRL would connect with weaker security than asked for.
//!
//! Defaults follow libpq, except that the host defaults to `localhost` rather than the
//! default socket directory: port 5432, user `$USER`, else `postgres`; the database is
//! named like the user; `sslmode=prefer` (`verify-full` with `sslrootcert=system`, which
//! refuses weaker modes, as in libpq 16); `channel_binding=prefer`; trusted roots from
//! `~/.postgresql/root.crt` and a client certificate from `~/.postgresql/postgresql.crt`
//! (key `postgresql.key`) when those files exist; and, unlike libpq, a connect timeout of
//! [`DEFAULT_CONNECT_TIMEOUT`] (libpq waits forever; `connect_timeout=0` still does). An
//! empty value means "not given". A host that starts with `/` is a Unix socket directory
//! (the socket is `{host}/.s.PGSQL.{port}`); TLS is never used over a Unix socket (as in
//! libpq), so `channel_binding=require` is refused there.
//!
//! Several hosts, as libpq takes them (multi-host connection strings, as Patroni and
//! CloudNativePG hand them out): `host=a,b,c` with `port=5432` (one port for all) or
//! `port=5432,5433,5434` (one each; an empty entry is the default), the same lists in
//! `PGHOST`/`PGPORT`, or the URL form `postgres://a:5432,b:5433/db`. [`ConnInfo::targets`]
//! gives one single-host `ConnInfo` per host, in order, or shuffled with
//! `load_balance_hosts=random`; the connections try them in turn, each within its own
//! `connect_timeout`, and take the first whose server is what `target_session_attrs` asks
//! for ([`TargetSessionAttrs`], checked as libpq does).
//!
//! The password file (`passfile`, else `~/.pgpass`) is read when no password is given, with
//! libpq's rules (for each host): `host:port:dbname:user:password` lines, `*` matching anything, `\`
//! escaping `:` and `\`, the first matching line wins; a file that group or others can
//! access is ignored with a warning ([`ConnInfo::warnings`]), as is one that is not a plain
//! file.
//!
//! Why not `tokio_postgres::Config`'s parser: it reads no environment and no password file,
//! knows `sslmode` only up to `require`, has no `sslrootcert`, `sslcert`, `sslkey` or
//! `require_auth`, and cannot say where a value came from or keep a password out of its
//! errors. `tokio_postgres::Config` is still what runs the control connection's startup and
//! authentication (see [`crate::connect_sql`]).
//!
//! # Invariants
//! - The password lives only in a [`Secret`], whose `Debug` and `Display` print
//!   `<redacted>`; neither `ConnInfo`'s `Debug`, nor [`ConnInfo::redacted`], nor
//!   [`ConnInfo::describe`] contains it, and no parse error quotes it or a part of it
//!   (the port of a URL, which a forgotten `@` would fill with the password, is never
//!   quoted either).
//! - R8 A parse error quotes nothing of a URL after its scheme: a component is named by
//!   what it is (the host, the port, query parameter 2) and what is wrong with it, never
//!   by its text, since an unencoded `&`, `=` or `@` in a password moves the password's
//!   tail into any of them. The one exception is a query parameter's name that is one of
//!   libpq's own keywords ([`LIBPQ_KEYWORDS`]): no password's tail looks like that by
//!   accident. Values of the connection string (either notation) are never quoted either;
//!   a `PG*` variable's value is (it holds that one value).
//!
//! Inside: the types and [`ConnInfo`]'s resolution are here; `parse.rs` reads a connection
//! string, `values.rs` resolves each parameter, `passfile.rs` reads the password file.

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use crate::modes::{
    ChannelBinding, LoadBalanceHosts, ParseSslModeError, SslMode, TargetSessionAttrs,
};
use crate::Error;

mod parse;
mod passfile;
mod values;
pub use parse::*;
pub use passfile::*;
use values::*;

/// How long connecting (TCP, TLS and authentication together) may take when
/// `connect_timeout` is not given.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A password (or any credential) that never prints its content.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a credential.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The credential itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// An authentication method, as `require_auth` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AuthMethod {
    /// The server asks for nothing (trust).
    None,
    /// Cleartext password.
    Password,
    /// MD5 password hash.
    Md5,
    /// SCRAM-SHA-256 (with or without channel binding).
    ScramSha256,
    /// GSSAPI (Kerberos).
    Gss,
    /// SSPI.
    Sspi,
}

impl AuthMethod {
    const ALL: [AuthMethod; 6] = [
        AuthMethod::None,
        AuthMethod::Password,
        AuthMethod::Md5,
        AuthMethod::ScramSha256,
        AuthMethod::Gss,
        AuthMethod::Sspi,
    ];

    /// The `require_auth` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::None => "none",
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::Gss => "gss",
            AuthMethod::Sspi => "sspi",
        }
    }
}

/// libpq's `require_auth`: the authentication methods the server may use, e.g.
/// `scram-sha-256` or `!password,!md5`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequireAuth {
    text: String,
    allowed: Vec<AuthMethod>,
}

impl RequireAuth {
    /// Whether the server may authenticate the client with `method`.
    pub fn allows(&self, method: AuthMethod) -> bool {
        self.allowed.contains(&method)
    }

    /// The parameter as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for RequireAuth {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let mut listed = Vec::new();
        let mut negated = None;
        for (index, word) in text.split(',').enumerate() {
            let (negate, name) = match word.strip_prefix('!') {
                Some(name) => (true, name),
                None => (false, word),
            };
            if negated.is_some_and(|n| n != negate) {
                return Err(Error::Config(
                    "require_auth cannot mix negated (!method) and plain methods".to_owned(),
                ));
            }
            negated = Some(negate);
            let method = AuthMethod::ALL
                .into_iter()
                .find(|m| m.as_str() == name)
                .ok_or_else(|| {
                    // Not quoted (R8): the value may be a password's tail.
                    Error::Config(format!(
                        "invalid require_auth: method {} of the list is not one of password, \
                         md5, scram-sha-256, gss, sspi or none (each optionally negated with !)",
                        index + 1
                    ))
                })?;
            listed.push(method);
        }
        let allowed = if negated == Some(true) {
            AuthMethod::ALL
                .into_iter()
                .filter(|m| !listed.contains(m))
                .collect()
        } else {
            listed
        };
        Ok(RequireAuth {
            text: text.to_owned(),
            allowed,
        })
    }
}

/// The trusted roots for verifying the server's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// A PEM file.
    File(PathBuf),
    /// The system's trust store (`sslrootcert=system`).
    System,
}

impl fmt::Display for RootCerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RootCerts::File(path) => write!(f, "{}", path.display()),
            RootCerts::System => f.write_str("system"),
        }
    }
}

/// Where a parameter's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The connection string.
    ConnString,
    /// A `PG*` environment variable.
    Env(&'static str),
    /// The password file.
    PassFile(PathBuf),
    /// The default (possibly derived from other parameters, like `dbname` from `user`).
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::ConnString => f.write_str("connection string"),
            Source::Env(name) => write!(f, "environment variable {name}"),
            Source::PassFile(path) => write!(f, "password file {}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// A supported parameter and the environment variable that supplies it when the
/// connection string does not.
struct Parameter {
    name: &'static str,
    env: &'static str,
}

const PARAMETERS: &[Parameter] = &[
    Parameter {
        name: "host",
        env: "PGHOST",
    },
    Parameter {
        name: "port",
        env: "PGPORT",
    },
    Parameter {
        name: "user",
        env: "PGUSER",
    },
    Parameter {
        name: "password",
        env: "PGPASSWORD",
    },
    Parameter {
        name: "dbname",
        env: "PGDATABASE",
    },
    Parameter {
        name: "passfile",
        env: "PGPASSFILE",
    },
    Parameter {
        name: "sslmode",
        env: "PGSSLMODE",
    },
    Parameter {
        name: "sslrootcert",
        env: "PGSSLROOTCERT",
    },
    Parameter {
        name: "sslcert",
        env: "PGSSLCERT",
    },
    Parameter {
        name: "sslkey",
        env: "PGSSLKEY",
    },
    Parameter {
        name: "channel_binding",
        env: "PGCHANNELBINDING",
    },
    Parameter {
        name: "require_auth",
        env: "PGREQUIREAUTH",
    },
    Parameter {
        name: "application_name",
        env: "PGAPPNAME",
    },
    Parameter {
        name: "connect_timeout",
        env: "PGCONNECT_TIMEOUT",
    },
    Parameter {
        name: "target_session_attrs",
        env: "PGTARGETSESSIONATTRS",
    },
    Parameter {
        name: "load_balance_hosts",
        env: "PGLOADBALANCEHOSTS",
    },
];

/// Parameters (and their environment variables) accepted only with a value that describes
/// what the relay does anyway; the first listed is that behaviour. Values compare
/// ignoring ASCII case.
pub const NEUTRAL: &[(&str, &str, &[&str])] = &[
    ("gssencmode", "PGGSSENCMODE", &["disable", "prefer"]),
    ("sslnegotiation", "PGSSLNEGOTIATION", &["postgres"]),
    ("sslsni", "PGSSLSNI", &["1"]),
    ("sslcertmode", "PGSSLCERTMODE", &["allow"]),
    ("client_encoding", "PGCLIENTENCODING", &["UTF8", "UTF-8"]),
];

/// libpq's connection keywords (PostgreSQL 17): a URL's query parameter so named may be
/// quoted in an error (R8); any other name may be the tail of a password with an unencoded
/// `&`, and is not.
pub const LIBPQ_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslnegotiation",
    "requiressl",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
];

/// libpq environment variables of features the relay lacks: set, they are an error.
const UNSUPPORTED_ENV: &[(&str, &str)] = &[
    ("PGHOSTADDR", "hostaddr"),
    ("PGSERVICE", "service"),
    ("PGSERVICEFILE", "service files"),
    ("PGOPTIONS", "options"),
    ("PGSSLCRL", "sslcrl"),
    ("PGSSLCRLDIR", "sslcrldir"),
    ("PGREQUIREPEER", "requirepeer"),
    ("PGSSLMINPROTOCOLVERSION", "ssl_min_protocol_version"),
    ("PGSSLMAXPROTOCOLVERSION", "ssl_max_protocol_version"),
];

/// Session defaults libpq would send, which the relay's pinned session settings override:
/// ignored, with a warning.
const PINNED_ENV: &[&str] = &["PGDATESTYLE", "PGTZ"];

const DEFAULT_HOST: &str = "localhost";
const DEFAULT_PORT: u16 = 5432;
/// libpq's default socket directory on Debian: a password file names it `localhost`.
const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";

/// Where and how to connect. Parse it with [`str::parse`] or [`ConnInfo::parse_with_env`].
#[derive(Clone, PartialEq, Eq)]
pub struct ConnInfo {
    host: String,
    port: u16,
    /// Every host with its port, in the order given; `(host, port)` is the first.
    hosts: Vec<(String, u16)>,
    target_session_attrs: TargetSessionAttrs,
    load_balance_hosts: LoadBalanceHosts,
    user: String,
    password: Option<Secret>,
    dbname: String,
    passfile: Option<PathBuf>,
    sslmode: SslMode,
    sslrootcert: Option<RootCerts>,
    sslcert: Option<PathBuf>,
    sslkey: Option<PathBuf>,
    channel_binding: ChannelBinding,
    require_auth: Option<RequireAuth>,
    application_name: Option<String>,
    connect_timeout: Option<Duration>,
    sources: BTreeMap<&'static str, Source>,
    warnings: Vec<String>,
}

impl ConnInfo {
    /// Every host with its port, in the order given.
    pub fn hosts(&self) -> &[(String, u16)] {
        &self.hosts
    }

    /// Which kind of server the connection accepts.
    pub fn target_session_attrs(&self) -> TargetSessionAttrs {
        self.target_session_attrs
    }

    /// The order in which the hosts are tried.
    pub fn load_balance_hosts(&self) -> LoadBalanceHosts {
        self.load_balance_hosts
    }

    /// One single-host `ConnInfo` per host, in the order to try them (shuffled with
    /// `load_balance_hosts=random`), each with its own password from the password file when
    /// no password is given.
    pub fn targets(&self) -> Vec<ConnInfo> {
        let mut hosts = self.hosts.clone();
        if self.load_balance_hosts == LoadBalanceHosts::Random {
            shuffle(&mut hosts);
        }
        hosts
            .into_iter()
            .map(|(host, port)| {
                let mut target = self.clone();
                let from_file = matches!(self.source("password"), Source::PassFile(_));
                if self.hosts.len() > 1 && (self.password.is_none() || from_file) {
                    target.password = None;
                    target.sources.remove("password");
                    if let Some(path) = &self.passfile {
                        let key = [host.as_str(), &port.to_string(), &self.dbname, &self.user];
                        target.password = password_from_file(path, key, &mut Vec::new());
                        if target.password.is_some() {
                            target
                                .sources
                                .insert("password", Source::PassFile(path.clone()));
                        }
                    }
                }
                target.hosts = vec![(host.clone(), port)];
                target.host = host;
                target.port = port;
                target
            })
            .collect()
    }

    /// Host name, IP address, or (starting with `/`) Unix socket directory: the first host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// TCP port, or the number in the Unix socket's file name: the first host's.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The role to connect as.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The password, if any.
    pub fn password(&self) -> Option<&Secret> {
        self.password.as_ref()
    }

    /// The database.
    pub fn dbname(&self) -> &str {
        &self.dbname
    }

    /// The TLS policy.
    pub fn sslmode(&self) -> SslMode {
        self.sslmode
    }

    /// The trusted roots: `sslrootcert`, else `~/.postgresql/root.crt` when it exists.
    pub fn root_certs(&self) -> Option<&RootCerts> {
        self.sslrootcert.as_ref()
    }

    /// The client certificate (PEM chain): `sslcert`, else `~/.postgresql/postgresql.crt`
    /// when it exists.
    pub fn sslcert(&self) -> Option<&Path> {
        self.sslcert.as_deref()
    }

    /// The client certificate's private key: `sslkey`, else
    /// `~/.postgresql/postgresql.key` (when there is a client certificate).
    pub fn sslkey(&self) -> Option<&Path> {
        self.sslkey.as_deref()
    }

    /// Whether SCRAM must, may or must not use channel binding.
    pub fn channel_binding(&self) -> ChannelBinding {
        self.channel_binding
    }

    /// The authentication methods the server may use (`None`: any).
    pub fn require_auth(&self) -> Option<&RequireAuth> {
        self.require_auth.as_ref()
    }

    /// The `application_name` to report to the server, if given.
    pub fn application_name(&self) -> Option<&str> {
        self.application_name.as_deref()
    }

    /// How long connecting (TCP, TLS and authentication together) may take; `None` waits
    /// indefinitely (`connect_timeout=0`).
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.connect_timeout
    }

    /// Whether `host` is a Unix socket directory.
    pub fn is_unix_socket(&self) -> bool {
        self.host.starts_with('/')
    }

    /// The Unix socket path (`{host}/.s.PGSQL.{port}`) when `host` is a directory.
    pub fn unix_socket_path(&self) -> Option<PathBuf> {
        self.is_unix_socket()
            .then(|| Path::new(&self.host).join(format!(".s.PGSQL.{}", self.port)))
    }

    /// Where the value of `parameter` came from.
    pub fn source(&self, parameter: &str) -> &Source {
        self.sources.get(parameter).unwrap_or(&Source::Default)
    }

    /// What parsing noticed but did not refuse (an ignored password file, an ignored
    /// environment variable), for the caller to log.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The same parameters with another `application_name`.
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// The same parameters accepting another kind of server.
    pub fn with_target_session_attrs(mut self, attrs: TargetSessionAttrs) -> Self {
        self.target_session_attrs = attrs;
        self
    }

    /// The same parameters with another `sslmode`.
    pub fn with_sslmode(mut self, sslmode: SslMode) -> Self {
        self.sslmode = sslmode;
        self
    }

    /// A URL for logs and errors, without the password:
    /// `postgres://user@host:port/dbname?sslmode=...`.
    pub fn redacted(&self) -> String {
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|(host, port)| {
                if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{}:{port}", percent_encode(host))
                }
            })
            .collect();
        let mut url = format!(
            "postgres://{}@{}/{}?sslmode={}",
            percent_encode(&self.user),
            hosts.join(","),
            percent_encode(&self.dbname),
            self.sslmode
        );
        if self.target_session_attrs != TargetSessionAttrs::Any {
            url.push_str(&format!(
                "&target_session_attrs={}",
                self.target_session_attrs
            ));
        }
        if self.load_balance_hosts != LoadBalanceHosts::Disable {
            url.push_str(&format!(
                "&load_balance_hosts={}",
                self.load_balance_hosts.as_str()
            ));
        }
        if let Some(roots) = &self.sslrootcert {
            url.push_str("&sslrootcert=");
            url.push_str(&percent_encode(&roots.to_string()));
        }
        if let Some(name) = &self.application_name {
            url.push_str("&application_name=");
            url.push_str(&percent_encode(name));
        }
        if self.source("connect_timeout") != &Source::Default {
            let seconds = self.connect_timeout.map_or(0, |t| t.as_secs());
            url.push_str(&format!("&connect_timeout={seconds}"));
        }
        url
    }

    /// Every parameter with its effective value and where it came from, the password shown
    /// as `<redacted>` (for `outbox-relay config`).
    pub fn describe(&self) -> Vec<(&'static str, String, Source)> {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        let list = |f: &dyn Fn(&(String, u16)) -> String| {
            self.hosts.iter().map(f).collect::<Vec<_>>().join(",")
        };
        let values: [(&'static str, Option<String>); 16] = [
            ("host", Some(list(&|(host, _)| host.clone()))),
            ("port", Some(list(&|(_, port)| port.to_string()))),
            ("user", Some(self.user.clone())),
            ("password", self.password.as_ref().map(Secret::to_string)),
            ("dbname", Some(self.dbname.clone())),
            ("passfile", path(&self.passfile)),
            ("sslmode", Some(self.sslmode.to_string())),
            (
                "sslrootcert",
                self.sslrootcert.as_ref().map(RootCerts::to_string),
            ),
            ("sslcert", path(&self.sslcert)),
            ("sslkey", path(&self.sslkey)),
            (
                "channel_binding",
                Some(self.channel_binding.as_str().to_owned()),
            ),
            (
                "require_auth",
                self.require_auth.as_ref().map(|r| r.as_str().to_owned()),
            ),
            ("application_name", self.application_name.clone()),
            (
                "connect_timeout",
                Some(match self.connect_timeout {
                    Some(limit) => format!("{}s", limit.as_secs()),
                    None => "0 (wait indefinitely)".to_owned(),
                }),
            ),
            (
                "target_session_attrs",
                Some(self.target_session_attrs.to_string()),
            ),
            (
                "load_balance_hosts",
                Some(self.load_balance_hosts.as_str().to_owned()),
            ),
        ];
        values
            .into_iter()
            .filter_map(|(name, value)| Some((name, value?, self.source(name).clone())))
            .collect()
    }

    /// Whether any of the `PG*` variables of the supported parameters is set (then the
    /// connection string may be empty, as with libpq).
    pub fn env_has_parameters(env: impl Fn(&str) -> Option<String>) -> bool {
        PARAMETERS
            .iter()
            .any(|p| env(p.env).is_some_and(|v| !v.is_empty()))
    }

    /// Parses `text`, reading the `PG*` variables, `HOME` and `USER` from `env` instead of
    /// the process environment.
    pub fn parse_with_env(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let text = text.trim();
        let pairs = match text
            .strip_prefix("postgresql://")
            .or_else(|| text.strip_prefix("postgres://"))
        {
            Some(rest) => parse_url(rest)?,
            None => parse_key_values(text)?,
        };
        Self::from_pairs(pairs, &|name: &str| env(name).filter(|v| !v.is_empty()))
    }

    fn from_pairs(pairs: Vec<Pair>, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let (mut values, neutral_given) = Values::sort(pairs, env)?;
        let mut warnings = check_environment(env, &neutral_given)?;
        let home = env("HOME").map(PathBuf::from);

        let user = values
            .take("user")
            .unwrap_or_else(|| env("USER").unwrap_or_else(|| "postgres".to_owned()));
        let hosts = values.hosts()?;
        let (host, port) = hosts[0].clone();
        let target_session_attrs = values.target_session_attrs()?;
        let load_balance_hosts = values.load_balance_hosts()?;
        let dbname = values.take("dbname").unwrap_or_else(|| user.clone());
        let passfile = values
            .take("passfile")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|home| home.join(".pgpass")));
        let key = [host.as_str(), &port.to_string(), &dbname, &user];
        let password = values.password(passfile.as_deref(), key, &mut warnings);
        let tls = values.tls(home.as_deref())?;
        let channel_binding = values.channel_binding(tls.sslmode, &hosts)?;
        let require_auth = values
            .take("require_auth")
            .map(|text| text.parse::<RequireAuth>())
            .transpose()?;
        let application_name = values.take("application_name");
        let connect_timeout = values.connect_timeout()?;
        Ok(ConnInfo {
            host,
            port,
            hosts,
            target_session_attrs,
            load_balance_hosts,
            user,
            password,
            dbname,
            passfile,
            sslmode: tls.sslmode,
            sslrootcert: tls.sslrootcert,
            sslcert: tls.sslcert,
            sslkey: tls.sslkey,
            channel_binding,
            require_auth,
            application_name,
            connect_timeout,
            sources: values.sources,
            warnings,
        })
    }
}

/// The error for a connection string's parameter the relay does not support, quoting no
/// value and, from a URL's query string, not even the name (R8).
fn unsupported(pair: &Pair) -> Error {
    if let Some(index) = pair
        .url_query_index
        .filter(|_| !LIBPQ_KEYWORDS.contains(&pair.key.as_str()))
    {
        // Not quoted (R8): `?password=hun&ter2=x` makes "ter2" a name.
        return Error::Config(format!(
            "unsupported parameter: query parameter {index} of the URL is not a libpq \
             parameter{} (its name is not shown: it may be the tail of a password with \
             an unencoded '&'; percent-encode '&', '=' and '#' in values as %26, %3D, \
             %23); supported: {}",
            closest_parameter(&pair.key)
                .map(|name| format!(" (did you mean {name}?)"))
                .unwrap_or_default(),
            supported_parameters()
        ));
    }
    if pair.follows_bare_password {
        // The "key" may be the rest of a password that has a space in it.
        return Error::Config(
            "unsupported parameter after the password; if the password contains a \
             space, put it in single quotes: password='...'"
                .to_owned(),
        );
    }
    Error::Config(format!(
        "unsupported parameter {:?}; supported: {}",
        pair.key,
        supported_parameters()
    ))
}

/// The environment's part that no parameter takes: a variable of a libpq feature the relay
/// does not support is an error, a neutral parameter's variable (unless the connection
/// string gave the parameter, `neutral_given`) must have the neutral value, and the pinned
/// session settings' variables are ignored with the warnings returned.
fn check_environment(
    env: &dyn Fn(&str) -> Option<String>,
    neutral_given: &[&str],
) -> Result<Vec<String>, Error> {
    for (variable, feature) in UNSUPPORTED_ENV {
        if env(variable).is_some() {
            return Err(Error::Config(format!(
                "the environment variable {variable} is set, but outbox-relay does not \
                 support {feature}; unset it"
            )));
        }
    }
    for neutral in NEUTRAL.iter().filter(|n| !neutral_given.contains(&n.0)) {
        if let Some(value) = env(neutral.1) {
            check_neutral(neutral, &value, Some(neutral.1))?;
        }
    }
    Ok(PINNED_ENV
        .iter()
        .filter(|variable| env(variable).is_some())
        .map(|variable| {
            format!(
                "{variable} is ignored: the relay pins DateStyle=ISO and TimeZone=UTC for \
                 its sessions"
            )
        })
        .collect())
}

impl FromStr for ConnInfo {
    type Err = Error;

    /// Parses a URL or key=value string; defaults come from the process environment.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ConnInfo::parse_with_env(s, |name| std::env::var(name).ok())
    }
}

impl fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnInfo")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("dbname", &self.dbname)
            .field("passfile", &self.passfile)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("sslcert", &self.sslcert)
            .field("sslkey", &self.sslkey)
            .field("channel_binding", &self.channel_binding)
            .field("require_auth", &self.require_auth)
            .field("application_name", &self.application_name)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// Same as [`ConnInfo::redacted`].
impl fmt::Display for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse(text: &str) -> ConnInfo {
        ConnInfo::parse_with_env(text, no_env).unwrap()
    }

    fn parse_err(text: &str) -> String {
        ConnInfo::parse_with_env(text, no_env)
            .unwrap_err()
            .to_string()
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    fn hosts(info: &ConnInfo) -> Vec<(&str, u16)> {
        info.hosts()
            .iter()
            .map(|(host, port)| (host.as_str(), *port))
            .collect()
    }

    /// libpq's multi-host lists, in both notations and the environment.
    #[test]
    fn several_hosts_with_one_port_or_one_each() {
        let info = parse("host=a,b,c port=6432");
        assert_eq!(hosts(&info), [("a", 6432), ("b", 6432), ("c", 6432)]);
        assert_eq!((info.host(), info.port()), ("a", 6432));
        let info = parse("host=a,,/tmp port=1,,3");
        assert_eq!(hosts(&info), [("a", 1), ("localhost", 5432), ("/tmp", 3)]);
        let info = parse("host=a,b");
        assert_eq!(hosts(&info), [("a", 5432), ("b", 5432)]);
        let info = parse("postgres://u@h1:5432,h2:5433/db?target_session_attrs=read-write");
        assert_eq!(hosts(&info), [("h1", 5432), ("h2", 5433)]);
        assert_eq!(info.dbname(), "db");
        assert_eq!(info.target_session_attrs(), TargetSessionAttrs::ReadWrite);
        let info = parse("postgresql://h1,[::1]:7,h3/db");
        assert_eq!(hosts(&info), [("h1", 5432), ("::1", 7), ("h3", 5432)]);
        let info = parse("postgres://h1,h2/db");
        assert_eq!(hosts(&info), [("h1", 5432), ("h2", 5432)]);
        let info = ConnInfo::parse_with_env(
            "",
            env_of(&[
                ("PGHOST", "p1,p2"),
                ("PGPORT", "5,6"),
                ("PGTARGETSESSIONATTRS", "primary"),
                ("PGLOADBALANCEHOSTS", "random"),
            ]),
        )
        .unwrap();
        assert_eq!(hosts(&info), [("p1", 5), ("p2", 6)]);
        assert_eq!(info.source("host"), &Source::Env("PGHOST"));
        assert_eq!(info.target_session_attrs(), TargetSessionAttrs::Primary);
        assert_eq!(info.load_balance_hosts(), LoadBalanceHosts::Random);
        let error = ConnInfo::parse_with_env("", env_of(&[("PGPORT", "5,x")]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("invalid port PGPORT=\"5,x\"") && error.contains("for each host"),
            "{error}"
        );
        // The URL's ports are never quoted (R8).
        let error = parse_err("postgres://h1:5432,h2:zq9/db");
        assert!(
            error.contains("invalid port in the URL") && !error.contains("zq9"),
            "{error}"
        );
        // Unix sockets anywhere in the list cannot do channel binding.
        let error = parse_err("host=h,/tmp channel_binding=require sslmode=require");
        assert!(error.contains("Unix socket"), "{error}");
    }

    #[test]
    fn targets_are_single_hosts_in_order_or_shuffled() {
        let info = parse("host=a,b,c port=1,2,3 user=u dbname=d target_session_attrs=standby");
        let targets = info.targets();
        let each: Vec<_> = targets.iter().map(hosts).collect();
        assert_eq!(each, [vec![("a", 1)], vec![("b", 2)], vec![("c", 3)]]);
        assert!(targets
            .iter()
            .all(|t| t.target_session_attrs() == TargetSessionAttrs::Standby && t.dbname() == "d"));
        let info = parse("host=a,b,c,d,e,f,g,h load_balance_hosts=random");
        let mut orders = std::collections::BTreeSet::new();
        for _ in 0..50 {
            let order: Vec<String> = info.targets().iter().map(|t| t.host().to_owned()).collect();
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, ["a", "b", "c", "d", "e", "f", "g", "h"]);
            orders.insert(order);
        }
        assert!(orders.len() > 1, "random order: always {orders:?}");
        let error = parse_err("host=a load_balance_hosts=sometimes");
        assert!(error.contains("expected disable or random"), "{error}");
    }

    /// libpq's target_session_attrs: the value names, the passes and what each accepts.
    #[test]
    fn target_session_attrs_as_libpq_defines_them() {
        for attrs in TargetSessionAttrs::ALL {
            let info = parse(&format!("host=h target_session_attrs={attrs}"));
            assert_eq!(info.target_session_attrs(), attrs);
        }
        assert_eq!(
            parse("host=h target_session_attrs=READ-WRITE").target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
        let error = parse_err("host=h target_session_attrs=writable");
        assert!(
            error.contains(
                "expected any, read-write, read-only, primary, standby or prefer-standby"
            ) && !error.contains("writable"),
            "{error}"
        );
        use TargetSessionAttrs as T;
        assert_eq!(T::PreferStandby.passes(), [T::Standby, T::Any]);
        assert_eq!(T::ReadWrite.passes(), [T::ReadWrite]);
        let show = Some("SHOW transaction_read_only");
        let recovery = Some("SELECT pg_catalog.pg_is_in_recovery()");
        let queries: Vec<_> = T::ALL.into_iter().map(T::check_query).collect();
        assert_eq!(queries, [None, show, show, recovery, recovery, None]);
        // (attrs, the server's answer, accepted)
        for (attrs, answer, accepted) in [
            (T::ReadWrite, "off", true),
            (T::ReadWrite, "on", false),
            (T::ReadOnly, "on", true),
            (T::ReadOnly, "off", false),
            (T::Primary, "f", true),
            (T::Primary, "t", false),
            (T::Standby, "t", true),
            (T::Standby, "f", false),
            (T::Any, "on", true),
        ] {
            assert_eq!(attrs.accepts(answer).is_ok(), accepted, "{attrs} {answer}");
        }
        assert_eq!(
            T::ReadWrite.accepts("on"),
            Err("read-only (transaction_read_only = on)")
        );
    }

    #[test]
    fn several_hosts_are_shown_by_config_and_in_the_redacted_url() {
        let info = parse(
            "host=a,b port=1,2 password=secret target_session_attrs=read-write load_balance_hosts=random",
        );
        assert_eq!(
            info.redacted(),
            format!(
                "postgres://{}@a:1,b:2/{}?sslmode=prefer&target_session_attrs=read-write&load_balance_hosts=random",
                info.user(),
                info.dbname()
            )
        );
        let described: BTreeMap<&str, String> = info
            .describe()
            .into_iter()
            .map(|(name, value, _)| (name, value))
            .collect();
        assert_eq!(described["host"], "a,b");
        assert_eq!(described["port"], "1,2");
        assert_eq!(described["target_session_attrs"], "read-write");
        assert_eq!(described["load_balance_hosts"], "random");
        assert!(!format!("{described:?}").contains("secret"));
        // One host and the defaults: as before.
        let info = parse("host=h port=7 user=u dbname=d");
        assert_eq!(info.redacted(), "postgres://u@h:7/d?sslmode=prefer");
    }

    #[test]
    fn url_with_everything() {
        let info = parse(
            "postgres://relay:s%40cr%2Ft@db.example.com:6543/app%20db?sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca.crt&application_name=outbox+relay&connect_timeout=7\
             &channel_binding=require&require_auth=scram-sha-256&sslcert=%2Fc.crt&sslkey=%2Fc.key",
        );
        assert_eq!(info.host(), "db.example.com");
        assert_eq!(info.port(), 6543);
        assert_eq!(info.user(), "relay");
        assert_eq!(info.password().map(Secret::expose), Some("s@cr/t"));
        assert_eq!(info.dbname(), "app db");
        assert_eq!(info.sslmode(), SslMode::VerifyFull);
        assert_eq!(
            info.root_certs(),
            Some(&RootCerts::File(PathBuf::from("/etc/ca.crt")))
        );
        assert_eq!(info.application_name(), Some("outbox+relay"));
        assert_eq!(info.connect_timeout(), Some(Duration::from_secs(7)));
        assert_eq!(info.channel_binding(), ChannelBinding::Require);
        let require = info.require_auth().unwrap();
        assert!(require.allows(AuthMethod::ScramSha256) && !require.allows(AuthMethod::Md5));
        assert_eq!(info.sslcert(), Some(Path::new("/c.crt")));
        assert_eq!(info.sslkey(), Some(Path::new("/c.key")));
        assert!(!info.is_unix_socket());
        assert_eq!(info.source("host"), &Source::ConnString);
    }

    #[test]
    fn url_variants() {
        let info = parse("postgresql://[::1]:5433/db");
        assert_eq!(
            (info.host(), info.port(), info.dbname()),
            ("::1", 5433, "db")
        );
        assert!(info.redacted().contains("@[::1]:5433/"));

        let info = parse("postgres://%2Fvar%2Frun%2Fpostgresql/db");
        assert_eq!(info.host(), "/var/run/postgresql");
        assert!(info.is_unix_socket());
        assert_eq!(
            info.unix_socket_path(),
            Some(PathBuf::from("/var/run/postgresql/.s.PGSQL.5432"))
        );

        let info = parse("postgres:///db?host=/tmp&port=55433&user=u");
        assert_eq!(
            (info.host(), info.port(), info.user(), info.dbname()),
            ("/tmp", 55433, "u", "db")
        );

        let info = parse("postgres://u@h");
        assert_eq!((info.host(), info.dbname()), ("h", "u"));

        // Passwords with unencoded delimiters stay whole: the user info ends at the last '@'.
        for password in [
            "p@ss",
            "12/34",
            "pa?ss",
            "a:b",
            "x/y?z@w",
            "pa?ss=word",
            "a=b",
            "q?x=y&z=w",
            "p@ss?x=y",
            "?=",
            "h/d?sslmode=disable",
        ] {
            let info = parse(&format!("postgres://u:{password}@h:7/d?sslmode=disable"));
            assert_eq!(info.password().map(Secret::expose), Some(password));
            assert_eq!((info.user(), info.host(), info.port()), ("u", "h", 7));
            assert_eq!((info.dbname(), info.sslmode()), ("d", SslMode::Disable));
            let info = parse(&format!("postgres://u:{password}@h"));
            assert_eq!(info.password().map(Secret::expose), Some(password));
            assert_eq!((info.host(), info.dbname()), ("h", "u"));
        }
        // ... but an '@' in a well-formed query string is not the end of the user info.
        let info = parse("postgres://h/d?application_name=me@host");
        assert_eq!((info.host(), info.dbname()), ("h", "d"));
        assert_eq!(info.application_name(), Some("me@host"));
        let info = parse("postgres://u:p@h/d?application_name=me@host");
        assert_eq!(info.password().map(Secret::expose), Some("p"));
        assert_eq!(info.application_name(), Some("me@host"));
    }

    #[test]
    fn key_value_quoting() {
        let info = parse(
            "host=db port = 6000 user=relay password='it''s a \\'secret\\' \\\\ ok' dbname=app\\ x",
        );
        assert_eq!(
            (info.host(), info.port(), info.user()),
            ("db", 6000, "relay")
        );
        assert_eq!(
            info.password().map(Secret::expose),
            Some("it's a 'secret' \\ ok")
        );
        assert_eq!(info.dbname(), "app x");

        let info = parse("password='' user=u");
        assert_eq!(info.password(), None, "empty means not given");
        let info = parse("user=a user=b");
        assert_eq!(info.user(), "b", "last one wins");
    }

    #[test]
    fn defaults() {
        let info = parse("");
        assert_eq!(info.host(), "localhost");
        assert_eq!(info.port(), 5432);
        assert_eq!(info.user(), "postgres");
        assert_eq!(info.dbname(), "postgres");
        assert_eq!(info.password(), None);
        assert_eq!(info.sslmode(), SslMode::Prefer);
        assert_eq!(info.channel_binding(), ChannelBinding::Prefer);
        assert_eq!(info.connect_timeout(), Some(DEFAULT_CONNECT_TIMEOUT));
        assert_eq!(info.source("connect_timeout"), &Source::Default);
        assert_eq!(info.root_certs(), None);
        assert_eq!(info.sslcert(), None);

        let info = ConnInfo::parse_with_env("postgres://h/d", |n| {
            (n == "USER").then(|| "unix".to_owned())
        })
        .unwrap();
        assert_eq!(info.user(), "unix");

        assert_eq!(
            parse("connect_timeout=1").connect_timeout(),
            Some(Duration::from_secs(2))
        );
        assert_eq!(parse("connect_timeout=0").connect_timeout(), None);
        assert_eq!(parse("connect_timeout=-5").connect_timeout(), None);
        assert!(parse("connect_timeout=0")
            .redacted()
            .contains("connect_timeout=0"));
        assert!(!parse("").redacted().contains("connect_timeout"));
    }

    #[test]
    fn pg_environment_fills_what_the_string_does_not_give() {
        let env = env_of(&[
            ("PGHOST", "envhost"),
            ("PGPORT", "6000"),
            ("PGUSER", "pguser"),
            ("PGDATABASE", "envdb"),
            ("PGPASSWORD", "from-env"),
            ("PGSSLMODE", "require"),
            ("PGSSLROOTCERT", "/env/ca.crt"),
            ("PGSSLCERT", "/env/client.crt"),
            ("PGSSLKEY", "/env/client.key"),
            ("PGAPPNAME", "envapp"),
            ("PGCONNECT_TIMEOUT", "30"),
            ("PGCHANNELBINDING", "require"),
            ("PGREQUIREAUTH", "!password,!md5"),
            ("USER", "unix"),
        ]);
        let info = ConnInfo::parse_with_env("", &env).unwrap();
        assert_eq!((info.host(), info.port()), ("envhost", 6000));
        assert_eq!((info.user(), info.dbname()), ("pguser", "envdb"));
        assert_eq!(info.password().map(Secret::expose), Some("from-env"));
        assert_eq!(info.sslmode(), SslMode::Require);
        assert_eq!(
            info.root_certs(),
            Some(&RootCerts::File("/env/ca.crt".into()))
        );
        assert_eq!(info.sslcert(), Some(Path::new("/env/client.crt")));
        assert_eq!(info.sslkey(), Some(Path::new("/env/client.key")));
        assert_eq!(info.application_name(), Some("envapp"));
        assert_eq!(info.connect_timeout(), Some(Duration::from_secs(30)));
        assert_eq!(info.channel_binding(), ChannelBinding::Require);
        let require = info.require_auth().unwrap();
        assert!(!require.allows(AuthMethod::Password) && !require.allows(AuthMethod::Md5));
        assert!(require.allows(AuthMethod::ScramSha256) && require.allows(AuthMethod::None));
        assert_eq!(info.source("host"), &Source::Env("PGHOST"));
        assert_eq!(info.source("password"), &Source::Env("PGPASSWORD"));

        // The connection string wins over the environment, parameter by parameter.
        let info =
            ConnInfo::parse_with_env("postgres://u:given@h/d?sslmode=verify-ca", &env).unwrap();
        assert_eq!((info.host(), info.port()), ("h", 6000));
        assert_eq!((info.user(), info.dbname()), ("u", "d"));
        assert_eq!(info.password().map(Secret::expose), Some("given"));
        assert_eq!(info.sslmode(), SslMode::VerifyCa);
        assert_eq!(info.source("port"), &Source::Env("PGPORT"));
        assert_eq!(info.source("user"), &Source::ConnString);

        assert!(ConnInfo::env_has_parameters(&env));
        assert!(!ConnInfo::env_has_parameters(env_of(&[("USER", "x")])));
    }

    #[test]
    fn unsupported_libpq_features_are_named() {
        for (variable, feature) in [
            ("PGHOSTADDR", "hostaddr"),
            ("PGSERVICE", "service"),
            ("PGOPTIONS", "options"),
            ("PGSSLCRL", "sslcrl"),
        ] {
            let error = ConnInfo::parse_with_env("host=h", env_of(&[(variable, "x")]))
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(variable) && error.contains(feature) && error.contains("unset"),
                "{error}"
            );
        }
        // Neutral parameters: the value the relay behaves as is accepted, others refused.
        let info = parse(
            "host=h target_session_attrs=any gssencmode=disable client_encoding=utf8 sslsni=1",
        );
        assert_eq!(info.host(), "h");
        let error = parse_err("host=h gssencmode=require");
        assert!(
            error
                .contains("gssencmode (the connection string's value, not shown) is not supported")
                && !error.contains("require"),
            "{error}"
        );
        let error = ConnInfo::parse_with_env("", env_of(&[("PGGSSENCMODE", "require")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("PGGSSENCMODE"), "{error}");
        // The connection string's neutral value wins over the environment's.
        ConnInfo::parse_with_env("gssencmode=disable", env_of(&[("PGGSSENCMODE", "require")]))
            .unwrap();
        // Pinned session defaults are ignored with a warning.
        let info = ConnInfo::parse_with_env("", env_of(&[("PGTZ", "Europe/Berlin")])).unwrap();
        assert!(
            info.warnings()[0].contains("PGTZ is ignored"),
            "{:?}",
            info.warnings()
        );
    }

    #[test]
    fn sslrootcert_system_means_verify_full() {
        let info = parse("host=h sslrootcert=system");
        assert_eq!(info.root_certs(), Some(&RootCerts::System));
        assert_eq!(info.sslmode(), SslMode::VerifyFull);
        assert!(info.redacted().contains("sslrootcert=system"));
        let info = parse("host=h sslrootcert=system sslmode=verify-full");
        assert_eq!(info.sslmode(), SslMode::VerifyFull);
        for weak in ["disable", "prefer", "require", "verify-ca"] {
            let error = parse_err(&format!("host=h sslrootcert=system sslmode={weak}"));
            assert!(
                error.contains(&format!("weak sslmode \"{weak}\""))
                    && error.contains("verify-full"),
                "{error}"
            );
        }
    }

    #[test]
    fn channel_binding_and_require_auth_values() {
        assert_eq!(
            parse("channel_binding=disable").channel_binding(),
            ChannelBinding::Disable
        );
        let error = parse_err("channel_binding=yes");
        assert!(error.contains("disable, prefer or require"), "{error}");
        let error = parse_err("channel_binding=require sslmode=disable");
        assert!(error.contains("needs TLS"), "{error}");
        let error = parse_err("channel_binding=require host=/tmp");
        assert!(error.contains("Unix socket"), "{error}");

        let allowed = |text: &str| {
            let require: RequireAuth = text.parse().unwrap();
            AuthMethod::ALL
                .into_iter()
                .filter(|m| require.allows(*m))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            allowed("scram-sha-256,md5"),
            [AuthMethod::Md5, AuthMethod::ScramSha256]
        );
        assert_eq!(
            allowed("!password,!md5,!none"),
            [AuthMethod::ScramSha256, AuthMethod::Gss, AuthMethod::Sspi]
        );
        let error = parse_err("require_auth=md5,!password");
        assert!(error.contains("cannot mix"), "{error}");
        let error = parse_err("require_auth=md5,kerberos");
        assert!(
            error.contains("method 2 of the list") && !error.contains("kerberos"),
            "{error}"
        );
    }

    #[test]
    fn password_file_supplies_the_password_with_libpq_rules() {
        let scratch = testkit::scratch_dir("pgpass");
        let dir = scratch.path();
        let file = dir.join("pgpass");
        testkit::write_file_mode(
            &file,
            "# comment\n\
             other:5432:*:relay:wrong-host\n\
             db\\:x:*:app:relay:escaped-host\n\
             db:5432:app:relay:pa\\:ss\\\\word:ignored\r\n\
             *:*:*:*:fallback\n",
            0o600,
        );
        let passfile = file.display().to_string();
        let env = env_of(&[("PGPASSFILE", &passfile)]);
        let info = ConnInfo::parse_with_env("host=db user=relay dbname=app", &env).unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("pa:ss\\word"));
        assert_eq!(info.source("password"), &Source::PassFile(file.clone()));
        let info = ConnInfo::parse_with_env("host=db:x user=relay dbname=app", &env).unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("escaped-host"));
        let info = ConnInfo::parse_with_env("host=elsewhere user=x", &env).unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("fallback"));
        // Each host of a list has its own line.
        let info = ConnInfo::parse_with_env("host=db,other,elsewhere user=relay dbname=app", &env)
            .unwrap();
        let passwords: Vec<_> = info
            .targets()
            .iter()
            .map(|target| target.password().map(|p| p.expose().to_owned()))
            .collect();
        assert_eq!(
            passwords,
            [
                Some("pa:ss\\word".to_owned()),
                Some("wrong-host".to_owned()),
                Some("fallback".to_owned())
            ]
        );
        // A password given in the string or PGPASSWORD wins over the file.
        let info =
            ConnInfo::parse_with_env("host=db user=relay dbname=app password=given", &env).unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("given"));
        // The passfile parameter, and ~/.pgpass by default.
        let info = ConnInfo::parse_with_env(
            &format!("host=db user=relay dbname=app passfile={passfile}"),
            no_env,
        )
        .unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("pa:ss\\word"));
        std::fs::copy(&file, dir.join(".pgpass")).unwrap();
        let home = dir.display().to_string();
        let info =
            ConnInfo::parse_with_env("host=db user=relay dbname=app", env_of(&[("HOME", &home)]))
                .unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("pa:ss\\word"));

        // Group- or world-readable: ignored, with a warning that says how to fix it.
        testkit::write_file_mode(&file, "*:*:*:*:exposed\n", 0o644);
        let info = ConnInfo::parse_with_env("host=db", &env).unwrap();
        assert_eq!(info.password(), None);
        assert!(
            info.warnings()[0].contains("group or world access")
                && info.warnings()[0].contains("chmod 600"),
            "{:?}",
            info.warnings()
        );
        // A missing file: nothing, silently.
        let info =
            ConnInfo::parse_with_env("host=db passfile=/nonexistent/pgpass", no_env).unwrap();
        assert_eq!((info.password(), info.warnings().len()), (None, 0));
    }

    #[test]
    fn errors_name_the_problem() {
        for (text, expected) in [
            ("host=h sslcrl=/x", "unsupported parameter \"sslcrl\""),
            (
                "postgres://h/d?options=-c%20x",
                "unsupported parameter \"options\"",
            ),
            ("port=abc", "invalid port (the connection"),
            ("port=0", "invalid port"),
            (
                "sslmode=allow",
                "disable, prefer, require, verify-ca, verify-full",
            ),
            ("host", "missing \"=\""),
            ("host=a,b port=1,2,3", "3 ports for 2 hosts"),
            ("postgres://[::1/db", "IPv6"),
            ("postgres://h:abc/db", "invalid port in the URL"),
        ] {
            let error = parse_err(text);
            assert!(error.contains(expected), "{text}: {error}");
        }
        let error = ConnInfo::parse_with_env("", env_of(&[("PGPORT", "abc")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("invalid port PGPORT=\"abc\""), "{error}");
        // A typo in a URL's parameter: not quoted, but the likely name is suggested.
        let error = parse_err("postgres://h/db?sslmdoe=require");
        assert!(
            error.contains("query parameter 1 of the URL")
                && error.contains("did you mean sslmode?"),
            "{error}"
        );
        assert!(!error.contains("sslmdoe"), "{error}");
    }

    /// Issue 18 case 6: a malformed URL's error quotes nothing after the scheme (R8), since
    /// a password's unencoded '&', '=', '@' or '%' moves its tail into any component.
    #[test]
    fn malformed_url_errors_quote_no_part_of_the_url() {
        for (text, expected) in [
            // The case: the password's tail became a parameter without '='.
            (
                "postgres://u@h/db?password=hun&ter2",
                "query parameter 2 of the URL has no '='",
            ),
            (
                "postgres://u@h/db?password=hun&ter2=x",
                "query parameter 2 of the URL is not",
            ),
            (
                "postgres://u@h/db?password=hun&ter2=%zz",
                "query parameter 2 (its value)",
            ),
            (
                "postgres://u@h/db?password=hun&%zzter2=x",
                "query parameter 2 (its name)",
            ),
            (
                "postgres://u@h/db?password=hun%zzter2",
                "query parameter 1 (its value)",
            ),
            (
                "postgres://u@h/db?password=hun&sslmode=ter2",
                "invalid sslmode (the connection",
            ),
            (
                "postgres://u@h/db?password=hun&port=ter2",
                "invalid port (the connection",
            ),
            (
                "postgres://u@h/db?password=hun&port=1,ter2",
                "invalid port (the connection",
            ),
            (
                "postgres://u@h/db?password=hun&target_session_attrs=ter2",
                "invalid target_session_attrs (the connection",
            ),
            (
                "postgres://u@h/db?password=hun&connect_timeout=ter2",
                "invalid connect_timeout",
            ),
            (
                "postgres://u@h/db?password=hun&channel_binding=ter2",
                "invalid channel_binding",
            ),
            (
                "postgres://u@h/db?password=hun&require_auth=ter2",
                "method 1 of the list",
            ),
            (
                "postgres://u@h/db?password=hun&gssencmode=ter2",
                "gssencmode (the connection",
            ),
            ("postgres://u:hun@ter2%zz@h/db", "the URL's password"),
            ("postgres://u:hun@h%zzter2/db", "the URL's host"),
            ("postgres://u:hun@h/db%zzter2", "the URL's dbname"),
            ("postgres://u:hun@h/db%C0ter2", "not UTF-8"),
            (
                "user=u password='hun' sslmode=ter2",
                "invalid sslmode (the connection",
            ),
        ] {
            let error = parse_err(text);
            assert!(error.contains(expected), "{text}: {error}");
            assert!(
                !error.contains("ter2") && !error.contains("hun"),
                "{text}: {error}"
            );
        }
        // A libpq keyword the relay does not support is still named (no password's tail
        // looks like one by accident).
        let error = parse_err("postgres://u@h/db?options=-c%20x");
        assert!(error.contains("\"options\""), "{error}");
    }

    #[test]
    fn secret_files_with_group_or_world_access_are_named() {
        let scratch = testkit::scratch_dir("exposed");
        let key = scratch.path().join("client.key");
        testkit::write_file_mode(&key, "key", 0o600);
        assert_eq!(exposed_secret_file(&key, "sslkey", true), None);
        testkit::write_file_mode(&key, "key", 0o700);
        assert_eq!(exposed_secret_file(&key, "sslkey", true), None);
        testkit::write_file_mode(&key, "key", 0o640);
        let warning = exposed_secret_file(&key, "--nkey file", false).unwrap();
        assert!(
            warning.starts_with("--nkey file ")
                && warning.contains("has group or world access (mode 0640)")
                && warning.contains("chmod 600"),
            "{warning}"
        );
        assert_eq!(
            exposed_secret_file(&scratch.path().join("none"), "x", false),
            None
        );
    }

    #[test]
    fn password_never_printed() {
        let secret = "hunter2-%-secret";
        for text in [
            "postgres://relay:hunter2-secret@h:1/d?sslmode=require".to_owned(),
            "user=relay password=hunter2-secret host=h".to_owned(),
        ] {
            let info = parse(&text);
            let described = format!("{:?}", info.describe());
            for shown in [
                format!("{info:?}"),
                info.to_string(),
                info.redacted(),
                described,
            ] {
                assert!(!shown.contains("hunter2"), "{shown}");
            }
            assert!(format!("{info:?}").contains("password: Some(<redacted>)"));
        }
        // Parse errors around a password do not quote it, or a part of it.
        for text in [
            format!("postgres://relay:{secret}@h/d"),
            format!("postgres://relay@h/d?password={secret}"),
            format!("user=relay password='{secret}"),
            format!("password={secret} bogus=1"),
            // A password with a space, unquoted: its tail looks like a parameter.
            "password=hunter2 hunter2x=1 host=h".to_owned(),
            // A forgotten '@': the password is where the port would be.
            "postgres://relay:hunter2/db".to_owned(),
            "postgres://relay:hunter2%zz/db".to_owned(),
            // '?' and '=' in the password, and a broken port after it.
            "postgres://relay:hunter2?x=hunter2@h:bad/db".to_owned(),
        ] {
            let error = parse_err(&text);
            assert!(!error.contains("hunter2"), "{text}: {error}");
        }
    }

    #[test]
    fn redacted_form() {
        let info = parse("postgres://relay:pw@h:5433/my%2Fdb?application_name=relay");
        assert_eq!(
            info.redacted(),
            "postgres://relay@h:5433/my%2Fdb?sslmode=prefer&application_name=relay"
        );
        let reparsed = parse(&info.redacted());
        assert_eq!(reparsed.dbname(), "my/db");
        assert_eq!(reparsed.password(), None);
    }

    #[test]
    fn describe_lists_values_and_sources() {
        let info = ConnInfo::parse_with_env(
            "postgres://relay:pw@h/app",
            env_of(&[("PGAPPNAME", "from-env")]),
        )
        .unwrap();
        let described = info.describe();
        let find = |name: &str| {
            described
                .iter()
                .find(|(n, _, _)| *n == name)
                .cloned()
                .unwrap_or_else(|| panic!("{name} in {described:?}"))
        };
        assert_eq!(find("password").1, "<redacted>");
        assert_eq!(find("password").2, Source::ConnString);
        assert_eq!(find("application_name").2, Source::Env("PGAPPNAME"));
        assert_eq!(find("port"), ("port", "5432".to_owned(), Source::Default));
        assert_eq!(find("connect_timeout").1, "10s");
    }

    #[test]
    fn sslmode_round_trip() {
        for mode in [
            SslMode::Disable,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert_eq!(mode.to_string().parse::<SslMode>(), Ok(mode));
        }
        assert!("VERIFY-FULL".parse::<SslMode>().is_err());
        assert!(SslMode::VerifyCa.requires_tls());
        assert!(!SslMode::Prefer.requires_tls());
    }
}
