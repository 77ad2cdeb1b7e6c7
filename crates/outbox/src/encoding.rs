//! Header values no row can subvert.
//!
//! nats-server (2.9.10 at least) finds a header by the first occurrence of its name anywhere
//! in the header block, and reports it absent when that occurrence is not at a line start;
//! async-nats writes the headers in hash-map order. A row value containing `Nats-Msg-Id` or
//! `Nats-Expected-Last-Sequence` could therefore hide the real header, and switch off
//! de-duplication or strict mode's fence. Readers also trim whitespace at the ends of a value
//! (async-nats trims Unicode whitespace), and a header cannot carry a line break at all.
//!
//! So a row is *hostile* ([`row_is_hostile`]) when its `entity_id` or `event_type`
//! ([`is_hostile`]):
//! - contains `nats-` in any case (every present and future `Nats-*` header, and servers
//!   that look names up case-insensitively; `ſ` counts as `s`, as in Unicode case folding),
//!   or
//! - contains an ASCII control character other than TAB (0x00–0x08, 0x0A–0x1F, 0x7F), or
//! - starts or ends with whitespace (`char::is_whitespace`), which readers trim.
//!
//! A hostile row's message carries `Outbox-Encoding: percent`, and the values of
//! `Outbox-Entity-Id`, `Outbox-Event-Type`, `Outbox-Partition-Key` and `Nats-Msg-Id` are
//! [`encode`]d: every byte outside `[A-Za-z0-9_.~:]` becomes `%XX` (upper-case hex).
//! Consumers [`decode`] them to get the exact values back. Every other row's headers carry
//! the values verbatim.
//!
//! # Invariants
//! - H1 [`decode`]`(`[`encode`]`(x)) == x` for every string, and `encode` is injective.
//! - H2 An encoded value never contains `nats-` in any case (it contains no `-`), no control
//!   byte and no whitespace: it is never hostile.
//! - H3 Hostility is a function of the row alone, so every replay of a row gets the same
//!   headers, and the same `Nats-Msg-Id`.
//! - H4 The dedupe key `{event_type}:{entity_id}:{id}` is hostile exactly when its row is
//!   (`:` separates the parts, so no `nats-` spans two of them), and distinct rows keep
//!   distinct encoded keys: the id after the last `:` is kept as is (`-` of a negative id
//!   becomes `%2D`, still no other row's id).

use crate::percent;

/// The value of the `Outbox-Encoding` header on a hostile row's message.
pub const PERCENT: &str = "percent";

/// Bytes [`encode`] escapes: everything outside `[A-Za-z0-9_.~:]`.
fn must_escape(byte: u8) -> bool {
    !(byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'~' | b':'))
}

/// Whether `value` cannot go into a header verbatim (see the module docs).
pub fn is_hostile(value: &str) -> bool {
    let bytes = value.as_bytes();
    let control = |b: u8| b.is_ascii_control() && b != b'\t';
    bytes
        .iter()
        .enumerate()
        .any(|(at, &b)| control(b) || (b == b'-' && ends_with_nats(&value[..at])))
        || value.starts_with(char::is_whitespace)
        || value.ends_with(char::is_whitespace)
}

/// Whether `text` ends with `nats` in any case, Unicode's simple case folding included
/// (`ſ`, U+017F, folds to `s`: Go's `strings.EqualFold` matches `Natſ` with `Nats`).
fn ends_with_nats(text: &str) -> bool {
    let mut chars = text.chars().rev();
    ["sſ", "t", "a", "n"].iter().all(|wanted| {
        chars
            .next()
            .is_some_and(|c| wanted.contains(c.to_ascii_lowercase()))
    })
}

/// Whether a row's values must be encoded: its `entity_id` or `event_type` is hostile.
pub fn row_is_hostile(entity_id: &str, event_type: &str) -> bool {
    is_hostile(entity_id) || is_hostile(event_type)
}

/// Percent-encodes `value` (see the module docs).
pub fn encode(value: &str) -> String {
    let mut out = String::with_capacity(encoded_len(value));
    percent::push_escaped(&mut out, value, must_escape);
    out
}

/// `encode(value).len()`, without building it.
pub fn encoded_len(value: &str) -> usize {
    percent::escaped_len(value, must_escape)
}

/// Inverts [`encode`]; `None` for a value `encode` never produces.
pub fn decode(value: &str) -> Option<String> {
    percent::unescape(value, must_escape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hostile_values() {
        for hostile in [
            "Nats-Msg-Id",
            "order Nats-Expected-Last-Sequence: 0",
            "x-nats-y",
            "NATS-",
            "nAtS-TTL",
            "a\rb",
            "a\nb",
            "a\0b",
            "a\x1bb",
            "a\x7fb",
            " leading",
            "trailing ",
            "\ttab",
            "nbsp\u{a0}",
            "Natſ-Msg-Id",
        ] {
            assert!(is_hostile(hostile), "{hostile:?}");
        }
        for benign in [
            "",
            "order-1",
            "OrderPaid",
            "nats",
            "natsX-",
            "nat-s",
            "in\tside",
            "Ünïcödé",
            "a b",
            "Nats_Msg_Id",
        ] {
            assert!(!is_hostile(benign), "{benign:?}");
        }
        assert!(row_is_hostile("order-1", "Nats-Msg-Id"));
        assert!(row_is_hostile("Nats-Msg-Id", "OrderPaid"));
        assert!(!row_is_hostile("order-1", "OrderPaid"));
    }

    #[test]
    fn golden_encodings() {
        assert_eq!(encode("OrderPaid"), "OrderPaid");
        assert_eq!(
            encode("Nats-Msg-Id:order 1:42"),
            "Nats%2DMsg%2DId:order%201:42"
        );
        assert_eq!(encode("a%b"), "a%25b");
        assert_eq!(encode("a\r\nb"), "a%0D%0Ab");
        assert_eq!(encode("ü"), "%C3%BC");
        assert_eq!(encode("_.~:"), "_.~:");
        assert_eq!(decode("Nats%2DMsg%2DId").as_deref(), Some("Nats-Msg-Id"));
    }

    #[test]
    fn decode_rejects_what_encode_never_produces() {
        for bad in ["a-b", "%2", "%2d", "%zz", "%+1", "%41", "a b", "%%", "%C3"] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
    }

    /// H4: the key's hostility is its row's.
    #[test]
    fn a_dedupe_key_is_hostile_exactly_when_its_row_is() {
        for (event_type, entity_id) in [
            ("nats", "-x"),
            ("Nats", "Msg-Id"),
            ("a", "b"),
            ("Nats-Msg-Id", "b"),
        ] {
            let key = crate::compute_keys(-5, entity_id, event_type, 0).dedupe_key;
            assert_eq!(
                is_hostile(&key),
                row_is_hostile(entity_id, event_type),
                "{key:?}"
            );
        }
    }

    proptest! {
        /// H1 and H2.
        #[test]
        fn encoding_round_trips_and_is_never_hostile(value in any::<String>()) {
            let encoded = encode(&value);
            prop_assert_eq!(encoded.len(), encoded_len(&value));
            prop_assert!(!encoded.to_ascii_lowercase().contains("nats-"));
            prop_assert!(!encoded.bytes().any(|b| b.is_ascii_control() || b.is_ascii_whitespace()));
            prop_assert!(!is_hostile(&encoded));
            prop_assert_eq!(decode(&encoded), Some(value));
        }

        /// Hostile-looking inputs: header names inside arbitrary text.
        #[test]
        fn header_names_in_values_round_trip(
            before in "[a-zA-Z: -]{0,8}",
            name in "(?i)(nats-msg-id|nats-expected-last-sequence|nats-rollup)",
            after in "[a-zA-Z: \r\n-]{0,8}",
        ) {
            let value = format!("{before}{name}{after}");
            prop_assert!(is_hostile(&value));
            let encoded = encode(&value);
            prop_assert!(!is_hostile(&encoded));
            prop_assert_eq!(decode(&encoded), Some(value));
        }

        /// H1: injective.
        #[test]
        fn distinct_values_encode_distinctly(a in any::<String>(), b in any::<String>()) {
            prop_assume!(a != b);
            prop_assert_ne!(encode(&a), encode(&b));
        }
    }
}
