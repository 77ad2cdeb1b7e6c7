//! Subjects: `{prefix}.{shard}.{event_type_token}`.
//!
//! NATS splits subjects on `.`, treats `*` and `>` as wildcards, and forbids whitespace and
//! empty tokens. An event type may contain any of them, so it is escaped into one token by
//! this rule:
//!
//! - the empty event type becomes `%` (a lone `%`, which the rule below never produces);
//! - every byte of `%`, `.`, `*`, `>`, ASCII whitespace and control characters (0x00–0x20,
//!   0x7F) becomes `%XX` (upper-case hex);
//! - every other byte, including UTF-8 multi-byte sequences, is kept as is.
//!
//! # Invariants
//! - SUB1 Injective: distinct event types give distinct tokens (`%` only ever appears as an
//!   escape, and a lone `%` only for the empty string), so [`unescape_token`] inverts it.
//! - SUB2 A token is never empty and never contains `.`, `*`, `>` or whitespace.

use std::fmt::Write as _;

use crate::percent;

fn must_escape(byte: u8) -> bool {
    matches!(byte, b'%' | b'.' | b'*' | b'>' | 0x00..=0x20 | 0x7F)
}

/// Appends the subject token for `event_type` to `out`.
pub fn push_token(out: &mut String, event_type: &str) {
    if event_type.is_empty() {
        out.push('%');
        return;
    }
    percent::push_escaped(out, event_type, must_escape);
}

/// The subject token for `event_type`.
pub fn escape_token(event_type: &str) -> String {
    let mut token = String::with_capacity(event_type.len());
    push_token(&mut token, event_type);
    token
}

/// Inverts [`escape_token`]; `None` if `token` is not something it produces.
pub fn unescape_token(token: &str) -> Option<String> {
    if token == "%" {
        return Some(String::new());
    }
    percent::unescape(token, must_escape).filter(|s| !s.is_empty())
}

/// `{prefix}.{shard}.{token}`.
pub fn subject(prefix: &str, shard: u64, event_type: &str) -> String {
    let mut subject = String::with_capacity(prefix.len() + event_type.len() + 24);
    subject.push_str(prefix);
    let _ = write!(subject, ".{shard}.");
    push_token(&mut subject, event_type);
    subject
}

/// Checks that a subject prefix is usable: non-empty dot-separated tokens without
/// wildcards or whitespace.
pub fn validate_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty() {
        return Err("the subject prefix is empty".into());
    }
    for token in prefix.split('.') {
        if token.is_empty() {
            return Err(format!(
                "subject prefix {prefix:?} has an empty token (two dots, or a dot at an end)"
            ));
        }
        if token
            .bytes()
            .any(|b| matches!(b, b'*' | b'>' | 0x00..=0x20 | 0x7F))
        {
            return Err(format!(
                "subject prefix {prefix:?} contains a wildcard, whitespace or a control character"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_tokens() {
        assert_eq!(escape_token("OrderPaid"), "OrderPaid");
        assert_eq!(escape_token("order.refunded"), "order%2Erefunded");
        assert_eq!(escape_token("type*"), "type%2A");
        assert_eq!(escape_token("type>"), "type%3E");
        assert_eq!(escape_token("Order Cancelled"), "Order%20Cancelled");
        assert_eq!(escape_token("100%"), "100%25");
        assert_eq!(escape_token(""), "%");
        assert_eq!(escape_token("Ünïcödé"), "Ünïcödé");
        assert_eq!(escape_token("a\tb\r\n\x7f"), "a%09b%0D%0A%7F");
        assert_eq!(
            subject("outbox", 7, "order.refunded"),
            "outbox.7.order%2Erefunded"
        );
    }

    #[test]
    fn unescape_rejects_what_escape_never_produces() {
        for bad in ["", "a.b", "%2", "%zz", "%41", "%2e", "a b", "%%"] {
            assert_eq!(unescape_token(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn prefix_validation() {
        assert!(validate_prefix("outbox").is_ok());
        assert!(validate_prefix("app.outbox").is_ok());
        for bad in ["", ".", "a..b", "a.", "a.*", "a >", "a\tb"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn escape_is_injective_and_safe(event_type in any::<String>()) {
            let token = escape_token(&event_type);
            prop_assert!(!token.is_empty());
            prop_assert!(!token.bytes().any(|b| matches!(b, b'.' | b'*' | b'>') || b.is_ascii_whitespace() || b.is_ascii_control()));
            prop_assert_eq!(unescape_token(&token), Some(event_type));
        }
    }
}
