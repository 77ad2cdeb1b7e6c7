//! CloudEvents 1.0 in binary content mode (the NATS protocol binding): the `ce-*` headers
//! and `content-type` an event carries when the relay is asked for them (`--cloudevents`),
//! beside its own headers. The payload stays the row's, unchanged (the event's `data`).
//!
//! | attribute | header | value |
//! |---|---|---|
//! | specversion | `ce-specversion` | `1.0` |
//! | id | `ce-id` | the dedupe key |
//! | source | `ce-source` | `--cloudevents-source` (default `/{database}/{schema}/{table}`) |
//! | type | `ce-type` | the row's event type |
//! | subject | `ce-subject` | the row's entity id |
//! | time | `ce-time` | `created_at`, RFC 3339 in UTC with milliseconds |
//! | datacontenttype | `content-type` | `application/octet-stream` for a `bytea` payload, else `application/json` |
//!
//! # Invariants
//! - CE1 Every attribute is a function of the row and the configured source alone: a
//!   replay of the row publishes the same CloudEvent (same source, same id), so consumers
//!   de-duplicate on `(source, id)` as the specification asks.
//! - CE2 `ce-time` only when RFC 3339 can write the instant (years 0000 to 9999): an event
//!   outside that range has no `ce-time`, never a wrong one.
//! - CE3 The attributes are headers of the event like those of its columns: written verbatim,
//!   or percent-encoded with the row's other values when the row is header-hostile (H1).

use std::sync::Arc;

use crate::keys::Keys;
use crate::percent;
use crate::timestamp::rfc3339_millis;

/// The CloudEvents version the headers follow.
pub const SPECVERSION: &str = "1.0";

/// The header names, in the order they are written.
const NAMES: [&str; 7] = [
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-subject",
    "content-type",
    "ce-time",
];

/// `datacontenttype` of a text (`jsonb`, `json`, `text`) payload.
pub const JSON: &str = "application/json";
/// `datacontenttype` of a `bytea` payload.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// Whether a header named `name` is one of the CloudEvents attributes this module writes
/// (`ce-*` or `content-type`, any case).
pub fn is_attribute_header(name: &str) -> bool {
    name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce-"))
        || name.eq_ignore_ascii_case("content-type")
}

/// `headers` without the CloudEvents attributes, when they carry them (a `ce-specversion`
/// header says so): what the row's columns gave. Without `ce-specversion` every header is
/// a column's, whatever its name (a header column may be named `content-type` when
/// CloudEvents are off).
pub fn without_attributes<'a>(headers: &mut Vec<(&'a str, &'a str)>) {
    if headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case(NAMES[0]))
    {
        headers.retain(|(name, _)| !is_attribute_header(name));
    }
}

/// The session's CloudEvents settings: the source every event names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
    /// [`NAMES`], allocated once: each event's headers share them.
    names: [Arc<str>; 7],
}

impl CloudEvents {
    /// Events of `source`, a URI-reference (`/billing/public/outbox_events`,
    /// `urn:billing:outbox`, `https://billing.example.com`). Refused: an empty source, or
    /// one with a space or a control character (no URI-reference has them).
    pub fn new(source: impl Into<String>) -> Result<CloudEvents, String> {
        let source = source.into();
        if source.is_empty() || source.bytes().any(|b| b <= b' ' || b == 0x7F) {
            return Err(format!(
                "the CloudEvents source {source:?} is not a URI-reference: it must be non-empty, without spaces or control characters (percent-encode them)"
            ));
        }
        Ok(CloudEvents {
            source,
            names: NAMES.map(Arc::from),
        })
    }

    /// The default source of a table: `/{database}/{schema}/{table}`, each part
    /// percent-encoded but for RFC 3986's unreserved characters.
    pub fn default_source(database: &str, schema: &str, table: &str) -> String {
        let mut source = String::new();
        for part in [database, schema, table] {
            source.push('/');
            percent::push_escaped(&mut source, part, |b| {
                !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
            });
        }
        source
    }

    /// The source every event names.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Appends the attributes of an event (CE1, CE2) to `headers`.
    pub fn push_headers(
        &self,
        headers: &mut Vec<(Arc<str>, String)>,
        keys: &Keys,
        entity_id: &str,
        event_type: &str,
        created_at_ms: i64,
        binary: bool,
    ) {
        let content_type = if binary { OCTET_STREAM } else { JSON };
        let values = [
            SPECVERSION,
            &keys.dedupe_key,
            &self.source,
            event_type,
            entity_id,
            content_type,
        ];
        headers.reserve(NAMES.len());
        for (name, value) in self.names.iter().zip(values) {
            headers.push((name.clone(), value.to_owned()));
        }
        if let Some(time) = rfc3339_millis(created_at_ms) {
            headers.push((self.names[6].clone(), time));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attributes(created_at_ms: i64, binary: bool) -> Vec<(String, String)> {
        let ce = CloudEvents::new("/app/public/outbox_events").unwrap();
        let keys = crate::compute_keys(7, "order-1", "order.created", created_at_ms);
        let mut headers = vec![];
        ce.push_headers(
            &mut headers,
            &keys,
            "order-1",
            "order.created",
            created_at_ms,
            binary,
        );
        headers
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect()
    }

    #[test]
    fn every_attribute_comes_from_the_row_and_the_source() {
        let got = attributes(1_738_326_896_789, false);
        let want = [
            ("ce-specversion", "1.0"),
            ("ce-id", "order.created:order-1:7"),
            ("ce-source", "/app/public/outbox_events"),
            ("ce-type", "order.created"),
            ("ce-subject", "order-1"),
            ("content-type", "application/json"),
            ("ce-time", "2025-01-31T12:34:56.789Z"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        assert!(got.iter().all(|(n, _)| is_attribute_header(n)));
        assert!(!is_attribute_header("Outbox-Id") && !is_attribute_header("c"));
        let bytes = attributes(0, true);
        assert_eq!(bytes[5].1, OCTET_STREAM);
        assert_eq!(bytes[6].1, "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn attributes_are_told_from_columns_by_the_specversion() {
        let mut columns = vec![("content-type", "text/csv"), ("X-Tenant", "t1")];
        without_attributes(&mut columns);
        assert_eq!(
            columns.len(),
            2,
            "no ce-specversion: every header is a column's"
        );
        let mut both = vec![
            ("X-Tenant", "t1"),
            ("ce-specversion", "1.0"),
            ("ce-id", "k"),
        ];
        both.push(("content-type", "application/json"));
        without_attributes(&mut both);
        assert_eq!(both, [("X-Tenant", "t1")]);
    }

    #[test]
    fn no_time_rfc3339_cannot_write() {
        // 10000-01-01 and 1 BC: beyond RFC 3339's four-digit years (CE2).
        for ms in [253_402_300_800_000, -62_167_219_200_001] {
            let got = attributes(ms, false);
            assert!(got.iter().all(|(n, _)| n != "ce-time"), "{ms}: {got:?}");
        }
        let first = attributes(-62_167_219_200_000, false);
        assert_eq!(first[6].1, "0000-01-01T00:00:00.000Z");
    }

    #[test]
    fn sources_are_uri_references() {
        assert_eq!(
            CloudEvents::default_source("app", "Billing Dept", "out.box"),
            "/app/Billing%20Dept/out.box"
        );
        assert!(CloudEvents::new("").is_err());
        assert!(CloudEvents::new("/a b").is_err());
        assert!(CloudEvents::new("/a\r\nce-id: x").is_err());
        assert_eq!(CloudEvents::new("urn:x").unwrap().source(), "urn:x");
    }
}
