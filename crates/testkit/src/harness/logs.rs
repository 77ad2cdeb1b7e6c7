//! Reading the relay's log: colour escapes, tracing's timestamps, the lines that mark a
//! session's start and end.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What the relay logs once a session streams.
pub const STREAMING: &str = "streaming outbox events";
/// What the relay logs when a session ends (and it will start another).
pub const SESSION_ENDED: &str = "relay session ended";

/// Removes ANSI colour escapes (`ESC [ … letter`): the relay's log fields are styled.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How many lines of `text` contain every one of `needles`.
pub fn lines_with(text: &str, needles: &[&str]) -> usize {
    text.lines()
        .filter(|line| needles.iter().all(|needle| line.contains(needle)))
        .count()
}

pub use crate::process::last_lines;

/// The lines of a relay's log that start with a timestamp (tracing's
/// `2024-05-01T12:34:56.123456Z`), with that time; colour escapes removed.
pub fn timed_log_lines(output: &str) -> Vec<(SystemTime, String)> {
    strip_ansi(output)
        .lines()
        .filter_map(|line| {
            let stamp = line.split_whitespace().next()?;
            Some((parse_rfc3339_utc(stamp)?, line.to_owned()))
        })
        .collect()
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (up to microseconds, as tracing writes it) with
/// the outbox crate's exact timestamp parser.
pub fn parse_rfc3339_utc(stamp: &str) -> Option<SystemTime> {
    let (date, time) = stamp.strip_suffix('Z')?.split_once('T')?;
    let micros =
        outbox::timestamp::parse_timestamptz(format!("{date} {time}+00").as_bytes()).ok()?;
    let micros = u64::try_from(micros).ok()?;
    Some(UNIX_EPOCH + Duration::from_micros(micros))
}

/// Minimum, median and maximum of `durations` (all zero when empty).
pub fn min_median_max(durations: &[Duration]) -> (Duration, Duration, Duration) {
    let mut sorted = durations.to_vec();
    sorted.sort();
    match sorted.len() {
        0 => Default::default(),
        n if n % 2 == 1 => (sorted[0], sorted[n / 2], sorted[n - 1]),
        n => (
            sorted[0],
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
            sorted[n - 1],
        ),
    }
}

/// Asserts that `text` contains every one of `needles` (the first one missing and `text`
/// are the failure's message).
pub fn assert_contains_all<S: AsRef<str>>(text: &str, needles: impl IntoIterator<Item = S>) {
    for needle in needles {
        let needle = needle.as_ref();
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tracing_timestamps() {
        let line = "\u{1b}[2m2024-05-01T12:34:56.123456Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m streaming outbox events";
        let lines = timed_log_lines(line);
        assert_eq!(lines.len(), 1);
        let since_epoch = lines[0].0.duration_since(UNIX_EPOCH).expect("after 1970");
        assert_eq!(since_epoch, Duration::new(1_714_566_896, 123_456_000));
        assert!(lines[0].1.ends_with(STREAMING));
        assert_eq!(
            parse_rfc3339_utc("2024-05-01T12:34:56Z").map(|t| t.duration_since(UNIX_EPOCH).ok()),
            Some(Some(Duration::from_secs(1_714_566_896)))
        );
        assert_eq!(parse_rfc3339_utc("2024-05-01 12:34:56Z"), None);
    }
}
