//! Logging, and the last line of defence for secrets in text the relay does not format
//! itself.
//!
//! Logs go to stderr, as text or JSON lines. Text is coloured only when stderr is a
//! terminal and `NO_COLOR` is unset or empty (<https://no-color.org>), so a log redirected to
//! a file, a pipe or journald carries no escape codes.
//!
//! The relay's own messages never contain a secret: passwords live in
//! [`replication::Secret`], URLs are shown redacted (config invariant C1). Libraries may
//! still print one (async-nats logs a server's URL, credentials included, at debug level),
//! and a panic message could quote anything. So every log line, the final error line and
//! panic messages pass through [`scrub`], which replaces each registered secret
//! ([`register_secrets`], the configuration's [`crate::Config::secrets`]) in the forms a
//! library may print it (as is, percent-encoded, JSON- or Rust-escaped) by `<redacted>`.
//!
//! # Invariants
//! - G1 No registered secret of [`MIN_SCRUBBED_LEN`] characters or more reaches stderr
//!   through the log writer, [`scrub`] or the panic hook. (Shorter ones would match
//!   ordinary text everywhere; they are still never printed by the relay's own code.)

use std::borrow::Cow;
use std::ffi::OsStr;
use std::io::{IsTerminal, Write};
use std::sync::{PoisonError, RwLock};

use crate::config::LogFormat;

/// Secrets shorter than this are not scrubbed from free text (see G1).
pub const MIN_SCRUBBED_LEN: usize = 4;

/// The forms of the registered secrets, longest first.
static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

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

/// Registers secrets for [`scrub`] (G1), and installs the panic hook that scrubs panic
/// messages.
pub fn register_secrets(secrets: impl IntoIterator<Item = String>) {
    let mut forms: Vec<String> = Vec::new();
    for secret in secrets {
        if secret.chars().count() < MIN_SCRUBBED_LEN {
            continue;
        }
        let json = serde_json::to_string(&secret).unwrap_or_default();
        let debug = format!("{secret:?}");
        forms.push(replication::conninfo::percent_encode(&secret));
        forms.push(json.trim_matches('"').to_owned());
        forms.push(debug.trim_matches('"').to_owned());
        forms.push(secret);
    }
    let mut registered = SECRETS.write().unwrap_or_else(PoisonError::into_inner);
    registered.extend(forms);
    registered.sort_by_key(|form| std::cmp::Reverse(form.len()));
    registered.dedup();
    drop(registered);
    install_panic_hook();
}

/// `text` with every registered secret replaced by `<redacted>`.
pub fn scrub(text: &str) -> Cow<'_, str> {
    let secrets = SECRETS.read().unwrap_or_else(PoisonError::into_inner);
    if !secrets.iter().any(|secret| text.contains(secret.as_str())) {
        return Cow::Borrowed(text);
    }
    let mut text = text.to_owned();
    for secret in secrets.iter() {
        text = text.replace(secret.as_str(), "<redacted>");
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
        register_secrets(["pa ss\"w/rd-7Q".to_owned(), "abc".to_owned()]);
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
}
