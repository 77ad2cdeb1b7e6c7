//! Logging, and the last line of defence for secrets in text the relay does not format
//! itself.
//!
//! Logs go to stderr, as text or JSON lines. Text is coloured only when stderr is a
//! terminal and `NO_COLOR` is unset or empty (<https://no-color.org>), so a log redirected to
//! a file, a pipe or journald carries no escape codes.
//!
//! The relay's own messages never contain a secret: passwords live in
//! [`replication::Secret`], URLs are shown redacted (config invariant CFG1). Libraries may
//! still print one (async-nats logs a server's URL, credentials included, at debug level),
//! and a panic message could quote anything. So every log line, the final error line and
//! panic messages pass through [`scrub`], which replaces each registered secret
//! ([`register_secrets`], the configuration's [`crate::Config::secrets`]) in the forms a
//! library may print it (as is, percent-encoded, JSON- or Rust-escaped) by `<redacted>`.
//!
//! A secret too weak to be replaced everywhere ([`weakness`]: shorter than
//! [`MIN_SCRUBBED_LEN`](crate::config::secrets::MIN_SCRUBBED_LEN), a common word such as `relay` or
//! `secret`, or a user name) is replaced only where it stands as a URL's user information
//! (`:{secret}@`, `//{secret}@`): replacing `relay` in every line would break the logs and show the
//! secret all the same (`outbox-<redacted>`). The configuration warns about such secrets at start
//! (`crate::config`), since free text that quotes them cannot be told from ordinary text.
//!
//! # Invariants
//! - LOG1 No registered secret that is not weak ([`weakness`]) reaches stderr through the log
//!   writer, [`scrub`] or the panic hook; a weak one does not as a URL's user information.
//!   (They are still never printed by the relay's own code.)

use std::borrow::Cow;
use std::ffi::OsStr;
use std::io::{IsTerminal, Write};
use std::sync::{PoisonError, RwLock};

use crate::config::secrets::weakness;
use crate::config::LogFormat;

/// What the scrubber looks for and what it writes instead, longest pattern first.
static SECRETS: RwLock<Vec<(String, String)>> = RwLock::new(Vec::new());

/// Whether log text gets ANSI colours: only on a terminal, and not when `NO_COLOR` is set
/// to a non-empty value.
pub fn use_colour(stderr_is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// Sets up the global subscriber: `RUST_LOG` filter (else `default_filter`, e.g. `info`),
/// `format`, stderr through the scrubber, colour per [`use_colour`].
pub fn init(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let colour = use_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(|| ScrubbedStderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Registers secrets for [`scrub`] (LOG1), weak ones ([`weakness`], `names` being the user
/// names) only as a URL's user information, and installs the panic hook that scrubs panic
/// messages.
pub fn register_secrets(secrets: impl IntoIterator<Item = String>, names: &[&str]) {
    let mut forms: Vec<(String, String)> = Vec::new();
    for secret in secrets {
        if secret.is_empty() {
            continue;
        }
        let encoded = replication::conninfo::percent_encode(&secret);
        if weakness(&secret, names).is_some() {
            for form in [&secret, &encoded] {
                forms.push((format!(":{form}@"), ":<redacted>@".to_owned()));
                forms.push((format!("//{form}@"), "//<redacted>@".to_owned()));
            }
            continue;
        }
        let json = serde_json::to_string(&secret).unwrap_or_default();
        let debug = format!("{secret:?}");
        for form in [
            encoded,
            json.trim_matches('"').to_owned(),
            debug.trim_matches('"').to_owned(),
            secret,
        ] {
            forms.push((form, "<redacted>".to_owned()));
        }
    }
    let mut registered = SECRETS.write().unwrap_or_else(PoisonError::into_inner);
    registered.extend(forms);
    registered.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.cmp(b)));
    registered.dedup();
    drop(registered);
    install_panic_hook();
}

/// `text` with every registered secret replaced by `<redacted>`.
pub fn scrub(text: &str) -> Cow<'_, str> {
    let secrets = SECRETS.read().unwrap_or_else(PoisonError::into_inner);
    if !secrets
        .iter()
        .any(|(pattern, _)| text.contains(pattern.as_str()))
    {
        return Cow::Borrowed(text);
    }
    let mut text = text.to_owned();
    for (pattern, replacement) in secrets.iter() {
        text = text.replace(pattern.as_str(), replacement);
    }
    Cow::Owned(text)
}

/// Panic messages through [`scrub`], in the default hook's format.
fn install_panic_hook() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let message = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "Box<dyn Any>".to_owned());
            let thread = std::thread::current();
            let location = info
                .location()
                .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
                .unwrap_or_default();
            let text = format!(
                "thread '{}' panicked{location}:\n{message}\n",
                thread.name().unwrap_or("<unnamed>")
            );
            let _ = std::io::stderr().write_all(scrub(&text).as_bytes());
            if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
                let backtrace = std::backtrace::Backtrace::force_capture().to_string();
                let _ = std::io::stderr().write_all(scrub(&backtrace).as_bytes());
            }
        }));
    });
}

/// Stderr, each write scrubbed. The fmt layer writes one event per `write_all`, so a secret
/// is never split across writes.
struct ScrubbedStderr;

impl Write for ScrubbedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        std::io::stderr().write_all(scrub(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsStr::new(""))));
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None));
    }

    #[test]
    fn scrub_replaces_every_form_of_a_registered_secret() {
        register_secrets(["pa ss\"w/rd-7Q".to_owned(), "abc".to_owned()], &[]);
        for text in [
            "password pa ss\"w/rd-7Q in the clear",
            "url nats://u:pa%20ss%22w%2Frd-7Q@h:4222",
            "json {\"url\":\"pa ss\\\"w/rd-7Q\"}",
            "debug \"pa ss\\\"w/rd-7Q\"",
        ] {
            let scrubbed = scrub(text);
            assert!(!scrubbed.contains("7Q"), "{scrubbed}");
            assert!(scrubbed.contains("<redacted>"), "{scrubbed}");
        }
        assert_eq!(
            scrub("abc is too short to scrub"),
            "abc is too short to scrub"
        );
    }

    /// Issue 18 case 6: a short or common secret, or one equal to a user name, is scrubbed
    /// where it is a URL's user information, and ordinary text keeps its words (replacing
    /// them would show the secret: `outbox-<redacted>`).
    #[test]
    fn weak_secrets_are_scrubbed_only_as_user_information() {
        assert_eq!(
            weakness("ab", &[]).as_deref(),
            Some("shorter than 4 characters (2)")
        );
        assert_eq!(weakness("Relay", &[]).as_deref(), Some("a common word"));
        assert_eq!(
            weakness("orders", &["orders"]).as_deref(),
            Some("the same as a user name")
        );
        assert_eq!(weakness("x7-Qw9!z", &["relay"]), None);
        register_secrets(
            ["relay".to_owned(), "p,w".to_owned(), "orders".to_owned()],
            &["orders"],
        );
        assert_eq!(
            scrub("outbox-relay connected to nats://relay:relay@h:4222 (token nats://relay@h)"),
            "outbox-relay connected to nats://relay:<redacted>@h:4222 (token nats://<redacted>@h)"
        );
        assert_eq!(
            scrub("nats://u:p%2Cw@h and postgres://orders:orders@db/orders"),
            "nats://u:<redacted>@h and postgres://orders:<redacted>@db/orders"
        );
    }
}
