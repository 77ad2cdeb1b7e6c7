//! Connection parameters, parsed like libpq parses them.
//!
//! Two notations are accepted (<https://www.postgresql.org/docs/15/libpq-connect.html#LIBPQ-CONNSTRING>):
//! - a URL: `postgres://user:password@host:port/dbname?sslmode=verify-full&...` (or
//!   `postgresql://`), with percent-decoding of every component, `[...]` around IPv6
//!   addresses, and a percent-encoded socket directory as host (`postgres://%2Ftmp/db`);
//! - key=value pairs: `host=db port=5432 user=relay password='it\'s' dbname=app`, values
//!   optionally in single quotes, a backslash escaping the next character. As an extension
//!   (libpq rejects it), a doubled quote inside a quoted value is one quote: `'it''s'`.
//!
//! Supported parameters: `host`, `port`, `user`, `password`, `dbname`, `sslmode`,
//! `sslrootcert`, `application_name`, `connect_timeout`. Any other is an error naming it:
//! silently ignoring, say, `sslcert` would connect with weaker security than asked for.
//!
//! Defaults follow libpq, except that the host defaults to `localhost` rather than the
//! default socket directory: port 5432, user `$PGUSER`, else `$USER`, else `postgres`; the
//! database is named like the user; the password comes from `$PGPASSWORD` when not given;
//! `sslmode=prefer`. An empty value means "not given". A host that starts with `/` is a Unix
//! socket directory (the socket is `{host}/.s.PGSQL.{port}`); TLS is never used over a Unix
//! socket, whatever `sslmode` says (as in libpq).
//!
//! # Invariants
//! - The password lives only in a [`Secret`], whose `Debug` and `Display` print
//!   `<redacted>`; neither `ConnInfo`'s `Debug` nor [`ConnInfo::redacted`] contains it, and
//!   no parse error quotes it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::Error;

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

/// Where and how to connect. Parse it with [`str::parse`].
#[derive(Clone, PartialEq, Eq)]
pub struct ConnInfo {
    host: String,
    port: u16,
    user: String,
    password: Option<Secret>,
    dbname: String,
    sslmode: SslMode,
    sslrootcert: Option<PathBuf>,
    application_name: Option<String>,
    connect_timeout: Option<Duration>,
}

const PARAMETERS: &[&str] = &[
    "host",
    "port",
    "user",
    "password",
    "dbname",
    "sslmode",
    "sslrootcert",
    "application_name",
    "connect_timeout",
];

const DEFAULT_HOST: &str = "localhost";
const DEFAULT_PORT: u16 = 5432;

impl ConnInfo {
    /// Host name, IP address, or (starting with `/`) Unix socket directory.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// TCP port, or the number in the Unix socket's file name.
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

    /// The PEM file with the trusted root certificates, if given.
    pub fn sslrootcert(&self) -> Option<&Path> {
        self.sslrootcert.as_deref()
    }

    /// The `application_name` to report to the server, if given.
    pub fn application_name(&self) -> Option<&str> {
        self.application_name.as_deref()
    }

    /// How long connecting (TCP, TLS and authentication together) may take; `None` waits
    /// indefinitely.
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

    /// The same parameters with another `application_name`.
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
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
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            percent_encode(&self.host)
        };
        let mut url = format!(
            "postgres://{}@{}:{}/{}?sslmode={}",
            percent_encode(&self.user),
            host,
            self.port,
            percent_encode(&self.dbname),
            self.sslmode
        );
        if let Some(path) = &self.sslrootcert {
            url.push_str("&sslrootcert=");
            url.push_str(&percent_encode(&path.to_string_lossy()));
        }
        if let Some(name) = &self.application_name {
            url.push_str("&application_name=");
            url.push_str(&percent_encode(name));
        }
        if let Some(timeout) = self.connect_timeout {
            url.push_str(&format!("&connect_timeout={}", timeout.as_secs()));
        }
        url
    }

    /// Parses `text`, reading defaults from `env` instead of the process environment.
    pub fn parse_with_env(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let text = text.trim();
        let pairs = match text
            .strip_prefix("postgresql://")
            .or_else(|| text.strip_prefix("postgres://"))
        {
            Some(rest) => parse_url(rest)?,
            None => parse_key_values(text)?,
        };
        Self::from_pairs(pairs, env)
    }

    fn from_pairs(
        pairs: Vec<(String, String)>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, Error> {
        let mut values: [Option<String>; PARAMETERS.len()] = Default::default();
        for (key, value) in pairs {
            let Some(index) = PARAMETERS.iter().position(|p| *p == key) else {
                return Err(Error::Config(format!(
                    "unknown parameter {key:?}; supported: {}",
                    PARAMETERS.join(", ")
                )));
            };
            // Last one wins, as in libpq; an empty value means "not given".
            values[index] = (!value.is_empty()).then_some(value);
        }
        let [host, port, user, password, dbname, sslmode, sslrootcert, application_name, connect_timeout] =
            values;

        let env = |name: &str| env(name).filter(|value| !value.is_empty());
        let user = user
            .or_else(|| env("PGUSER"))
            .or_else(|| env("USER"))
            .unwrap_or_else(|| "postgres".to_owned());
        let host = host.unwrap_or_else(|| DEFAULT_HOST.to_owned());
        if host.contains(',') {
            return Err(Error::Config(format!(
                "multiple hosts ({host:?}) are not supported; give one host"
            )));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(port) => match port.parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => {
                    return Err(Error::Config(format!(
                        "invalid port {port:?}: expected a number from 1 to 65535"
                    )))
                }
            },
        };
        let sslmode = match sslmode {
            None => SslMode::default(),
            Some(mode) => mode
                .parse::<SslMode>()
                .map_err(|e| Error::Config(e.to_string()))?,
        };
        let connect_timeout = match connect_timeout {
            None => None,
            Some(text) => {
                let seconds = text.parse::<i64>().map_err(|_| {
                    Error::Config(format!(
                        "invalid connect_timeout {text:?}: expected a whole number of seconds"
                    ))
                })?;
                // libpq: zero or negative waits forever; the minimum is 2 seconds.
                u64::try_from(seconds)
                    .ok()
                    .filter(|s| *s > 0)
                    .map(|s| Duration::from_secs(s.max(2)))
            }
        };
        Ok(ConnInfo {
            dbname: dbname.unwrap_or_else(|| user.clone()),
            host,
            port,
            password: password.or_else(|| env("PGPASSWORD")).map(Secret),
            user,
            sslmode,
            sslrootcert: sslrootcert.map(PathBuf::from),
            application_name,
            connect_timeout,
        })
    }
}

impl FromStr for ConnInfo {
    type Err = Error;

    /// Parses a URL or key=value string; defaults come from `PGUSER`, `USER` and
    /// `PGPASSWORD`.
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
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
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

/// `user:password@host:port/dbname?k=v&...`, after the scheme.
fn parse_url(rest: &str) -> Result<Vec<(String, String)>, Error> {
    let mut pairs = Vec::new();
    let (userinfo, rest) = split_userinfo(rest);
    if let Some(userinfo) = userinfo {
        let (user, password) = match userinfo.split_once(':') {
            Some((user, password)) => (user, Some(password)),
            None => (userinfo, None),
        };
        pairs.push(("user".to_owned(), percent_decode(user, "user")?));
        if let Some(password) = password {
            pairs.push(("password".to_owned(), percent_decode(password, "password")?));
        }
    }
    let (main, query) = match rest.split_once('?') {
        Some((main, query)) => (main, Some(query)),
        None => (rest, None),
    };
    let (host_port, path) = match main.split_once('/') {
        Some((host_port, path)) => (host_port, Some(path)),
        None => (main, None),
    };
    let (host, port) = if let Some(bracketed) = host_port.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(|| {
            Error::Config(format!("unterminated IPv6 address in host {host_port:?}"))
        })?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| {
                Error::Config(format!("unexpected {after:?} after IPv6 address"))
            })?),
        };
        (host.to_owned(), port)
    } else {
        match host_port.rsplit_once(':') {
            Some((host, port)) => (percent_decode(host, "host")?, Some(port)),
            None => (percent_decode(host_port, "host")?, None),
        }
    };
    pairs.push(("host".to_owned(), host));
    if let Some(port) = port {
        pairs.push(("port".to_owned(), percent_decode(port, "port")?));
    }
    if let Some(path) = path {
        pairs.push(("dbname".to_owned(), percent_decode(path, "dbname")?));
    }
    for param in query.into_iter().flat_map(|q| q.split('&')) {
        if param.is_empty() {
            continue;
        }
        let (key, value) = param.split_once('=').ok_or_else(|| {
            Error::Config(format!(
                "URL query parameter {param:?} has no '=' and value"
            ))
        })?;
        let key = percent_decode(key, "query parameter name")?;
        let what = if key == "password" {
            "password"
        } else {
            "query parameter value"
        };
        pairs.push((key, percent_decode(value, what)?));
    }
    Ok(pairs)
}

/// Splits `user:password@` off the rest of the URL. The user info ends at the last '@'
/// (so that a password with an unencoded '/', '?' or '@' stays whole and never ends up in
/// the host, port or database name, where errors and logs would show it), except for an
/// '@' inside the query string (`?application_name=me@host`).
fn split_userinfo(rest: &str) -> (Option<&str>, &str) {
    let Some(mut at) = rest.rfind('@') else {
        return (None, rest);
    };
    if let Some(question) = rest[..at].find('?') {
        if rest[question..at].contains('=') {
            match rest[..question].rfind('@') {
                Some(earlier) => at = earlier,
                None => return (None, rest),
            }
        }
    }
    (Some(&rest[..at]), &rest[at + 1..])
}

/// Decodes `%XX` escapes (`+` stays a plus, as in libpq). Errors quote the text except for
/// the password.
fn percent_decode(text: &str, what: &str) -> Result<String, Error> {
    let quoted = |text: &str| {
        if what == "password" {
            String::new()
        } else {
            format!(" {text:?}")
        }
    };
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::Config(format!(
                        "invalid percent-encoding in the URL's {what}{}",
                        quoted(text)
                    ))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| {
        Error::Config(format!(
            "the URL's {what}{} is not UTF-8 after percent-decoding",
            quoted(text)
        ))
    })
}

/// Encodes everything but the URL's unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// libpq's key=value notation. Errors never quote a value (it might be the password).
fn parse_key_values(text: &str) -> Result<Vec<(String, String)>, Error> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            // The word is not quoted: it may be the tail of a password that lacks quotes.
            return Err(Error::Config(
                "missing \"=\" after a parameter name in the connection info string".to_owned(),
            ));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => {
                        return Err(Error::Config(format!(
                            "unterminated quoted value of {key:?} in connection info string"
                        )))
                    }
                    Some('\\') => {
                        if let Some(c) = chars.next() {
                            value.push(c);
                        }
                    }
                    Some('\'') => {
                        // Extension: '' inside quotes is one quote (libpq would reject it).
                        if chars.next_if_eq(&'\'').is_some() {
                            value.push('\'');
                        } else {
                            break;
                        }
                    }
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(escaped) = chars.next() {
                        value.push(escaped);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
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

    #[test]
    fn url_with_everything() {
        let info = parse(
            "postgres://relay:s%40cr%2Ft@db.example.com:6543/app%20db?sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca.crt&application_name=outbox+relay&connect_timeout=7",
        );
        assert_eq!(info.host(), "db.example.com");
        assert_eq!(info.port(), 6543);
        assert_eq!(info.user(), "relay");
        assert_eq!(info.password().map(Secret::expose), Some("s@cr/t"));
        assert_eq!(info.dbname(), "app db");
        assert_eq!(info.sslmode(), SslMode::VerifyFull);
        assert_eq!(info.sslrootcert(), Some(Path::new("/etc/ca.crt")));
        assert_eq!(info.application_name(), Some("outbox+relay"));
        assert_eq!(info.connect_timeout(), Some(Duration::from_secs(7)));
        assert!(!info.is_unix_socket());
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
        for password in ["p@ss", "12/34", "pa?ss", "a:b", "x/y?z@w"] {
            let info = parse(&format!("postgres://u:{password}@h:7/d?sslmode=disable"));
            assert_eq!(info.password().map(Secret::expose), Some(password));
            assert_eq!((info.user(), info.host(), info.port()), ("u", "h", 7));
            assert_eq!((info.dbname(), info.sslmode()), ("d", SslMode::Disable));
        }
        // ... but an '@' in the query string is not the end of the user info.
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
        assert_eq!(info.connect_timeout(), None);

        let env = |name: &str| match name {
            "PGUSER" => Some("pguser".to_owned()),
            "USER" => Some("unix".to_owned()),
            "PGPASSWORD" => Some("from-env".to_owned()),
            _ => None,
        };
        let info = ConnInfo::parse_with_env("host=h", env).unwrap();
        assert_eq!((info.user(), info.dbname()), ("pguser", "pguser"));
        assert_eq!(info.password().map(Secret::expose), Some("from-env"));
        let info = ConnInfo::parse_with_env("postgres://h/d", |n| {
            (n == "USER").then(|| "unix".to_owned())
        })
        .unwrap();
        assert_eq!(info.user(), "unix");
        let info = ConnInfo::parse_with_env("password=given", env).unwrap();
        assert_eq!(info.password().map(Secret::expose), Some("given"));

        assert_eq!(
            parse("connect_timeout=1").connect_timeout(),
            Some(Duration::from_secs(2))
        );
        assert_eq!(parse("connect_timeout=0").connect_timeout(), None);
        assert_eq!(parse("connect_timeout=-5").connect_timeout(), None);
    }

    #[test]
    fn errors_name_the_problem() {
        let error = parse_err("host=h sslcert=/x");
        assert!(error.contains("unknown parameter \"sslcert\""), "{error}");
        let error = parse_err("postgres://h/d?options=-c%20x");
        assert!(error.contains("unknown parameter \"options\""), "{error}");
        let error = parse_err("port=abc");
        assert!(error.contains("invalid port \"abc\""), "{error}");
        let error = parse_err("port=0");
        assert!(error.contains("invalid port"), "{error}");
        let error = parse_err("sslmode=allow");
        assert!(
            error.contains("disable, prefer, require, verify-ca, verify-full"),
            "{error}"
        );
        let error = parse_err("host");
        assert!(error.contains("missing \"=\""), "{error}");
        let error = parse_err("host=a,b");
        assert!(error.contains("multiple hosts"), "{error}");
        let error = parse_err("postgres://[::1/db");
        assert!(error.contains("IPv6"), "{error}");
    }

    #[test]
    fn password_never_printed() {
        let secret = "hunter2-%-secret";
        for text in [
            "postgres://relay:hunter2-secret@h:1/d?sslmode=require".to_owned(),
            "user=relay password=hunter2-secret host=h".to_owned(),
        ] {
            let info = parse(&text);
            for shown in [format!("{info:?}"), info.to_string(), info.redacted()] {
                assert!(!shown.contains("hunter2"), "{shown}");
            }
            assert!(format!("{info:?}").contains("password: Some(<redacted>)"));
        }
        // Parse errors around a password do not quote it.
        for text in [
            format!("postgres://relay:{secret}@h/d"),
            format!("postgres://relay@h/d?password={secret}"),
            format!("user=relay password='{secret}"),
            format!("password={secret} bogus=1"),
        ] {
            let error = parse_err(&text);
            assert!(!error.contains("hunter2"), "{error}");
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
