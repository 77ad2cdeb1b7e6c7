//! `%XX` escaping (upper-case hex), shared by the subject token ([`crate::subject`]) and
//! the encoding of hostile header values ([`crate::encoding`]). Each caller chooses which
//! bytes must be escaped; it must select either every non-ASCII byte or none (so an escape
//! never splits a UTF-8 sequence).
//!
//! # Invariants
//! - %1 Canonical and injective: exactly the bytes `must_escape` selects (and always `%`,
//!   which callers must select) become `%XX`; [`unescape`] accepts only what [`push_escaped`]
//!   produces, so it inverts it.

use std::fmt::Write as _;

/// Appends `value` to `out` with every byte `must_escape` selects written as `%XX`.
pub(crate) fn push_escaped(out: &mut String, value: &str, must_escape: impl Fn(u8) -> bool) {
    debug_assert_eq!(must_escape(0x80), must_escape(0xFF));
    let mut rest = value;
    // A UTF-8 sequence's lead byte comes first, so `at` is always a char boundary.
    while let Some(at) = rest.bytes().position(&must_escape) {
        out.push_str(&rest[..at]);
        let width = rest[at..].chars().next().map_or(1, char::len_utf8);
        for byte in &rest.as_bytes()[at..at + width] {
            let _ = write!(out, "%{byte:02X}");
        }
        rest = &rest[at + width..];
    }
    out.push_str(rest);
}

/// The length of [`push_escaped`]'s output, without building it.
pub(crate) fn escaped_len(value: &str, must_escape: impl Fn(u8) -> bool) -> usize {
    value.len() + 2 * value.bytes().filter(|&b| must_escape(b)).count()
}

/// Inverts [`push_escaped`]; `None` if `escaped` is not something it produces with the same
/// `must_escape` (a lone or short `%`, lower-case or non-hex digits, an escape of a byte
/// that is not escaped, an unescaped byte that should be, or bytes that are not UTF-8).
pub(crate) fn unescape(escaped: &str, must_escape: impl Fn(u8) -> bool) -> Option<String> {
    let bytes = escaped.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let byte = bytes[at];
        if byte == b'%' {
            let hex = escaped.get(at + 1..at + 3)?;
            let decoded = u8::from_str_radix(hex, 16).ok()?;
            let canonical = hex
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase());
            if !must_escape(decoded) || !canonical {
                return None;
            }
            out.push(decoded);
            at += 3;
        } else if must_escape(byte) {
            return None;
        } else {
            out.push(byte);
            at += 1;
        }
    }
    String::from_utf8(out).ok()
}
