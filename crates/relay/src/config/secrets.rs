//! Which secrets are too weak for the log scrubber (`crate::observe::logging` LOG1): the
//! configuration warns about them at start (CFG4) and the scrubber leaves them out.

/// Secrets shorter than this are not scrubbed from free text (see LOG1).
pub const MIN_SCRUBBED_LEN: usize = 4;

/// Words that appear in ordinary log text (the relay's own vocabulary, its defaults, the
/// usual placeholder passwords): a secret equal to one, ignoring case, is weak (LOG1).
const COMMON_WORDS: &[&str] = &[
    "relay",
    "outbox",
    "outbox_relay",
    "outbox-relay",
    "secret",
    "password",
    "passwd",
    "pass",
    "token",
    "postgres",
    "nats",
    "admin",
    "root",
    "user",
    "test",
    "changeme",
    "change-me",
    "default",
    "stream",
    "event",
    "events",
    "info",
    "warn",
    "error",
    "debug",
    "true",
    "false",
    "null",
    "none",
    "localhost",
];

/// Why `secret` cannot be scrubbed from free text (LOG1): too short, a common word, or one
/// of `names` (user names, shown by the relay and libraries alike); `None` when it can.
pub fn weakness(secret: &str, names: &[&str]) -> Option<String> {
    let length = secret.chars().count();
    if length < MIN_SCRUBBED_LEN {
        Some(format!(
            "shorter than {MIN_SCRUBBED_LEN} characters ({length})"
        ))
    } else if names.iter().any(|name| name.eq_ignore_ascii_case(secret)) {
        Some("the same as a user name".to_owned())
    } else if COMMON_WORDS
        .iter()
        .any(|word| word.eq_ignore_ascii_case(secret))
    {
        Some("a common word".to_owned())
    } else {
        None
    }
}
