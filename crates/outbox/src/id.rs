//! Event ids of any kind the user's table has (integer, uuid, text), and their keys.
//!
//! # Invariants
//! - ID1 An integer id's keys are the seed's `compute_keys`, byte for byte.
//! - ID2 A uuid or text id keeps the seed's formulas with the id's text in place of the
//!   number: `dedupe_key = "{event_type}:{entity_id}:{id}"`, `ordering_key =
//!   "{created_at_ms:013}:{id}"`. That ordering key sorts by creation time, then by the id's
//!   bytes; it does not order the events of one millisecond by commit (the stream's order,
//!   `Outbox-Commit-Lsn` and `Outbox-Tx-Index` do, for every id kind).
//! - ID3 [`EventId::parse`] accepts exactly what Postgres prints for the kind: a decimal
//!   `bigint`, a lower-case hyphenated uuid, any text.

use std::fmt;
use std::fmt::Write as _;

use crate::keys::{compute_keys, Keys};
use crate::mapping::IdKind;

/// An outbox row's id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventId {
    /// An integer column's value.
    Int(i64),
    /// A uuid or text column's value, as Postgres prints it.
    Text(String),
}

impl EventId {
    /// Reads an id of `kind` from its text (ID3).
    pub fn parse(kind: IdKind, text: &str) -> Option<EventId> {
        match kind {
            IdKind::Integer => text.parse().ok().map(EventId::Int),
            IdKind::Uuid => is_uuid(text).then(|| EventId::Text(text.to_owned())),
            IdKind::Text => Some(EventId::Text(text.to_owned())),
        }
    }

    /// Reads an id back from a message: `Outbox-Id`'s value, `Outbox-Id-Kind`'s (absent for
    /// integers), and whether the message says `Outbox-Encoding: percent` (then a uuid or
    /// text id's value is percent-encoded, [`crate::encoding`]).
    pub fn from_header(value: &str, kind: Option<&str>, percent: bool) -> Option<EventId> {
        let kind = IdKind::from_header(kind)?;
        if kind != IdKind::Integer && percent {
            return EventId::parse(kind, &crate::encoding::decode(value)?);
        }
        EventId::parse(kind, value)
    }

    /// The id a message's headers carry: `Outbox-Id`, read with its `Outbox-Id-Kind` and
    /// `Outbox-Encoding` ([`Self::from_header`]); `header` looks a header up by name.
    pub fn from_headers<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Option<EventId> {
        let percent = header(crate::headers::OUTBOX_ENCODING) == Some(crate::encoding::PERCENT);
        EventId::from_header(
            header(crate::headers::OUTBOX_ID)?,
            header(crate::headers::OUTBOX_ID_KIND),
            percent,
        )
    }

    /// The kind of column this id came from, as far as its value tells (a uuid column's
    /// values are [`EventId::Text`] too).
    pub fn is_int(&self) -> bool {
        matches!(self, EventId::Int(_))
    }

    /// The integer, for an integer id.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            EventId::Int(id) => Some(*id),
            EventId::Text(_) => None,
        }
    }

    /// The text of a uuid or text id.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            EventId::Int(_) => None,
            EventId::Text(text) => Some(text),
        }
    }

    /// The keys of the event with this id (ID1, ID2).
    pub fn keys(&self, entity_id: &str, event_type: &str, created_at_ms: i64) -> Keys {
        match self {
            EventId::Int(id) => compute_keys(*id, entity_id, event_type, created_at_ms),
            EventId::Text(id) => {
                let mut dedupe_key =
                    String::with_capacity(event_type.len() + entity_id.len() + id.len() + 2);
                dedupe_key.push_str(event_type);
                dedupe_key.push(':');
                dedupe_key.push_str(entity_id);
                dedupe_key.push(':');
                dedupe_key.push_str(id);
                Keys {
                    dedupe_key,
                    partition_key: entity_id.to_owned(),
                    ordering_key: self.ordering_key(created_at_ms),
                }
            }
        }
    }

    /// The ordering key alone (ID1, ID2).
    pub fn ordering_key(&self, created_at_ms: i64) -> String {
        match self {
            EventId::Int(id) => crate::keys::ordering_key(*id, created_at_ms),
            EventId::Text(id) => {
                let mut key = String::with_capacity(14 + id.len());
                let _ = write!(key, "{created_at_ms:013}:{id}");
                key
            }
        }
    }
}

impl From<i64> for EventId {
    fn from(id: i64) -> Self {
        EventId::Int(id)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventId::Int(id) => write!(f, "{id}"),
            EventId::Text(text) => f.write_str(text),
        }
    }
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower-case hex: how Postgres prints a uuid.
fn is_uuid(text: &str) -> bool {
    text.len() == 36
        && text.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_ids_keep_the_seeds_keys() {
        let id = EventId::parse(IdKind::Integer, "1").unwrap();
        assert_eq!(
            id.keys("order:A-1", "OrderCreated", 1_700_000_000_000),
            compute_keys(1, "order:A-1", "OrderCreated", 1_700_000_000_000)
        );
        assert_eq!(EventId::parse(IdKind::Integer, "x"), None);
    }

    #[test]
    fn text_and_uuid_ids_keep_the_formulas() {
        let u = "0f8fad5b-d9cb-469f-a165-70867728950e";
        let id = EventId::parse(IdKind::Uuid, u).unwrap();
        let keys = id.keys("A-1", "OrderCreated", 1_700_000_000_000);
        assert_eq!(keys.dedupe_key, format!("OrderCreated:A-1:{u}"));
        assert_eq!(keys.ordering_key, format!("1700000000000:{u}"));
        assert_eq!(id.to_string(), u);
        assert_eq!(EventId::parse(IdKind::Uuid, &u.to_uppercase()), None);
        assert_eq!(EventId::parse(IdKind::Uuid, "0f8fad5b"), None);
        let t = EventId::parse(IdKind::Text, "evt_01").unwrap();
        assert_eq!(t.ordering_key(-5), "-000000000005:evt_01");
    }
}
