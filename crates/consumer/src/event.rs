//! From a JetStream message to the [`Event`] a handler sees.
//!
//! # Invariants
//! - V1 Every field comes from the relay's frozen headers (`outbox::headers`), decoded when
//!   `Outbox-Encoding: percent` says the textual ones were percent-encoded; the payload is
//!   the message body, unchanged.
//! - V2 The keys are recomputed from the event's identity with the seed's `compute_keys`
//!   (`Outbox-Id`, `Outbox-Entity-Id`, `Outbox-Event-Type` and the milliseconds of
//!   `Outbox-Ordering-Key`), and the `Outbox-Ordering-Key` and `Outbox-Partition-Key` headers
//!   must equal what it derives. The `dedupe_key` is therefore the event's, whatever
//!   `Nats-Msg-Id` a replay was published with.
//! - V3 A message that does not carry a consistent event is a [`MessageError`] naming its
//!   stream sequence, the problem and the fix: never guessed at, never skipped.

use std::fmt;

use async_nats::HeaderMap;
use bytes::Bytes;
use outbox::headers;
use outbox::{compute_keys, Keys, Position};

/// The header saying how the textual headers are encoded (absent: verbatim), and its one
/// value: the relay's [`outbox::encoding`].
pub use outbox::encoding::PERCENT as ENCODING_PERCENT;
pub use outbox::headers::OUTBOX_ENCODING;

/// One outbox event, as the relay published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The outbox row's `id`.
    pub id: i64,
    /// The row's `entity_id`; all events of an entity are on one shard.
    pub entity_id: String,
    /// The row's `event_type`.
    pub event_type: String,
    /// The seed's keys: `dedupe_key` (what the consumer records), `partition_key`,
    /// `ordering_key`.
    pub keys: Keys,
    /// The row's `created_at`, in milliseconds since 1970 (from the ordering key).
    pub created_at_ms: i64,
    /// The shard (`Outbox-Shard`).
    pub shard: u64,
    /// Where the event stands in the database's commit order (`Outbox-Commit-Lsn`,
    /// `Outbox-Tx-Index`), when the message carries it.
    pub position: Option<Position>,
    /// The row's `payload` jsonb text, unchanged.
    pub payload: Bytes,
    /// The message's subject, `{prefix}.{shard}.{event_type_token}`.
    pub subject: String,
    /// Every header of the message, as published.
    pub headers: HeaderMap,
    /// The message's sequence in the stream.
    pub stream_sequence: u64,
    /// Which delivery of the message this is (1 for the first).
    pub delivered: u64,
}

impl Event {
    /// The payload as text (the relay publishes the jsonb text, which is UTF-8).
    pub fn payload_str(&self) -> Result<&str, std::str::Utf8Error> {
        std::str::from_utf8(&self.payload)
    }

    /// The payload deserialised from JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// The `(created_at_ms, id)` pair the ordering key sorts like.
    pub fn order(&self) -> (i64, i64) {
        (self.created_at_ms, self.id)
    }

    /// Decodes a message of the stream (V1–V3).
    pub fn decode(
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: Bytes,
        stream_sequence: u64,
        delivered: u64,
    ) -> Result<Event, MessageError> {
        let decoded = match headers {
            None => Err(Problem::NotAnEvent),
            Some(map) => Fields::of(map).and_then(|fields| fields.event(subject, payload)),
        };
        decoded
            .map(|event| Event {
                stream_sequence,
                delivered,
                ..event
            })
            .map_err(|problem| MessageError {
                stream_sequence,
                subject: subject.to_owned(),
                problem,
            })
    }
}

/// A message's headers, read as the relay wrote them (V1).
struct Fields<'a> {
    map: &'a HeaderMap,
    percent: bool,
}

impl<'a> Fields<'a> {
    fn of(map: &'a HeaderMap) -> Result<Self, Problem> {
        let percent = match map.get(OUTBOX_ENCODING).map(|v| v.as_str()) {
            None => false,
            Some(ENCODING_PERCENT) => true,
            Some(other) => return Err(Problem::UnknownEncoding(other.to_owned())),
        };
        Ok(Fields { map, percent })
    }

    fn raw(&self, name: &'static str) -> Result<&'a str, Problem> {
        self.map
            .get(name)
            .map(|value| value.as_str())
            .ok_or(Problem::MissingHeader(name))
    }

    fn text(&self, name: &'static str) -> Result<String, Problem> {
        let value = self.raw(name)?;
        if self.percent {
            percent_decode(value).ok_or(Problem::BadHeader {
                name,
                reason: "is not valid percent-encoded UTF-8",
            })
        } else {
            Ok(value.to_owned())
        }
    }

    fn number(&self, name: &'static str) -> Result<i64, Problem> {
        self.raw(name)?.parse().map_err(|_| Problem::BadHeader {
            name,
            reason: "is not an integer",
        })
    }

    /// The event (V2, V3), its stream sequence and delivery count still 0.
    fn event(&self, subject: &str, payload: Bytes) -> Result<Event, Problem> {
        if self.raw(headers::OUTBOX_ID).is_err() && self.raw(headers::OUTBOX_ENTITY_ID).is_err() {
            return Err(Problem::NotAnEvent);
        }
        let id = self.number(headers::OUTBOX_ID)?;
        let entity_id = self.text(headers::OUTBOX_ENTITY_ID)?;
        let event_type = self.text(headers::OUTBOX_EVENT_TYPE)?;
        let partition_key = self.text(headers::OUTBOX_PARTITION_KEY)?;
        let ordering_key = self.raw(headers::OUTBOX_ORDERING_KEY)?;
        let shard =
            u64::try_from(self.number(headers::OUTBOX_SHARD)?).map_err(|_| Problem::BadHeader {
                name: headers::OUTBOX_SHARD,
                reason: "is negative",
            })?;
        let created_at_ms = ordering_key
            .split_once(':')
            .and_then(|(ms, _)| ms.parse::<i64>().ok())
            .ok_or(Problem::BadHeader {
                name: headers::OUTBOX_ORDERING_KEY,
                reason: "is not {created_at_ms}:{id}",
            })?;
        let keys = compute_keys(id, &entity_id, &event_type, created_at_ms);
        if keys.ordering_key != ordering_key || keys.partition_key != partition_key {
            return Err(Problem::InconsistentKeys);
        }
        Ok(Event {
            id,
            entity_id,
            event_type,
            keys,
            created_at_ms,
            shard,
            position: self.position()?,
            payload,
            subject: subject.to_owned(),
            headers: self.map.clone(),
            stream_sequence: 0,
            delivered: 0,
        })
    }

    fn position(&self) -> Result<Option<Position>, Problem> {
        match (
            self.raw(headers::OUTBOX_COMMIT_LSN),
            self.raw(headers::OUTBOX_TX_INDEX),
        ) {
            (Ok(lsn), Ok(index)) => {
                Position::from_headers(lsn, index)
                    .map(Some)
                    .ok_or(Problem::BadHeader {
                        name: headers::OUTBOX_COMMIT_LSN,
                        reason: "or Outbox-Tx-Index is not a position",
                    })
            }
            _ => Ok(None),
        }
    }
}

/// The relay's percent encoding ([`outbox::encoding::encode`]), inverted; `None` for a value
/// the relay never produces (a malformed or non-canonical escape, or not UTF-8).
pub fn percent_decode(text: &str) -> Option<String> {
    outbox::encoding::decode(text)
}

/// A message the consumer cannot handle. Permanent: redelivering it cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message at stream sequence {stream_sequence} on {subject}: {problem}")]
pub struct MessageError {
    /// Its sequence in the stream.
    pub stream_sequence: u64,
    /// Its subject.
    pub subject: String,
    /// What is wrong, and the fix.
    pub problem: Problem,
}

/// What is wrong with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// No `Outbox-*` headers at all.
    NotAnEvent,
    /// A header the relay always sets is missing.
    MissingHeader(&'static str),
    /// A header that cannot be read.
    BadHeader {
        /// The header.
        name: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// An `Outbox-Encoding` this consumer does not know.
    UnknownEncoding(String),
    /// The ordering or partition key is not what the seed derives from the event's identity.
    InconsistentKeys,
    /// The event's partition key maps to another shard with the configured partition count.
    WrongShard {
        /// The shard the message was published on.
        published: u64,
        /// `shard_for_key(partitions, partition_key)`.
        computed: u64,
        /// The configured partition count.
        partitions: u64,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NOT_OURS: &str = "only outbox-relay may publish on the stream's shard subjects: \
             remove the message (`nats stream rmm STREAM SEQUENCE`) and find its publisher";
        match self {
            Problem::NotAnEvent => {
                write!(f, "not an outbox event (no Outbox-Id header); {NOT_OURS}")
            }
            Problem::MissingHeader(name) => write!(f, "header {name} is missing; {NOT_OURS}"),
            Problem::BadHeader { name, reason } => write!(f, "header {name} {reason}; {NOT_OURS}"),
            Problem::UnknownEncoding(value) => write!(
                f,
                "unknown {OUTBOX_ENCODING} {value:?}: the relay is newer than this consumer; \
                 upgrade outbox-consumer"
            ),
            Problem::InconsistentKeys => write!(
                f,
                "its Outbox-Ordering-Key or Outbox-Partition-Key is not what the seed derives \
                 from Outbox-Id, Outbox-Entity-Id and Outbox-Event-Type; {NOT_OURS}"
            ),
            Problem::WrongShard {
                published,
                computed,
                partitions,
            } => write!(
                f,
                "published on shard {published}, but with {partitions} partitions its partition \
                 key maps to shard {computed}: set the consumer's partitions to the relay's \
                 (OUTBOX_RELAY_PARTITIONS)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, *value);
        }
        map
    }

    fn relay_headers(entity: &str, event_type: &str) -> Vec<(&'static str, String)> {
        let keys = compute_keys(7, entity, event_type, 1_700_000_000_123);
        vec![
            (headers::NATS_MSG_ID, keys.dedupe_key),
            (headers::OUTBOX_ID, "7".into()),
            (headers::OUTBOX_ENTITY_ID, entity.into()),
            (headers::OUTBOX_EVENT_TYPE, event_type.into()),
            (headers::OUTBOX_PARTITION_KEY, keys.partition_key),
            (headers::OUTBOX_ORDERING_KEY, keys.ordering_key),
            (headers::OUTBOX_SHARD, "3".into()),
            (headers::OUTBOX_COMMIT_LSN, "0/16B3748".into()),
            (headers::OUTBOX_TX_INDEX, "2".into()),
        ]
    }

    fn decode(pairs: &[(&'static str, String)]) -> Result<Event, MessageError> {
        let pairs: Vec<(&'static str, &str)> =
            pairs.iter().map(|(n, v)| (*n, v.as_str())).collect();
        Event::decode(
            "outbox.3.OrderPaid",
            Some(&headers(&pairs)),
            Bytes::from_static(b"{\"amount\": 10}"),
            42,
            1,
        )
    }

    #[test]
    fn decodes_the_relays_headers() {
        let event = decode(&relay_headers("order:A-1", "OrderPaid")).unwrap();
        assert_eq!(event.id, 7);
        assert_eq!(event.entity_id, "order:A-1");
        assert_eq!(event.event_type, "OrderPaid");
        assert_eq!(event.keys.dedupe_key, "OrderPaid:order:A-1:7");
        assert_eq!(event.created_at_ms, 1_700_000_000_123);
        assert_eq!(event.shard, 3);
        assert_eq!(event.position, Position::from_headers("0/16B3748", "2"));
        assert_eq!(event.stream_sequence, 42);
        let value: serde_json::Value = event.json().unwrap();
        assert_eq!(value["amount"], 10);
    }

    #[test]
    fn percent_encoded_headers_are_decoded_only_when_the_header_says_so() {
        let entity = "user:nats-1\u{7}";
        let keys = compute_keys(7, entity, "Nats-Event", 1_700_000_000_123);
        let mut pairs = relay_headers(entity, "Nats-Event");
        for (name, value) in &mut pairs {
            if [
                headers::OUTBOX_ENTITY_ID,
                headers::OUTBOX_EVENT_TYPE,
                headers::OUTBOX_PARTITION_KEY,
                headers::NATS_MSG_ID,
            ]
            .contains(name)
            {
                *value = outbox::encoding::encode(value);
            }
        }
        // Without the header, values are taken verbatim.
        assert_eq!(decode(&pairs).unwrap().entity_id, "user:nats%2D1%07");
        pairs.push((OUTBOX_ENCODING, ENCODING_PERCENT.into()));
        let event = decode(&pairs).unwrap();
        assert_eq!(event.entity_id, entity);
        assert_eq!(event.event_type, "Nats-Event");
        assert_eq!(event.keys, keys);
    }

    #[test]
    fn a_message_without_a_consistent_event_is_refused_naming_the_fix() {
        let not_ours = Event::decode("outbox.3.x", None, Bytes::new(), 9, 1).unwrap_err();
        assert_eq!(not_ours.stream_sequence, 9);
        assert!(
            not_ours.to_string().contains("nats stream rmm"),
            "{not_ours}"
        );

        let mut missing = relay_headers("e", "t");
        missing.retain(|(name, _)| *name != headers::OUTBOX_SHARD);
        assert_eq!(
            decode(&missing).unwrap_err().problem,
            Problem::MissingHeader(headers::OUTBOX_SHARD)
        );

        let mut tampered = relay_headers("e", "t");
        tampered[1].1 = "8".into();
        assert_eq!(
            decode(&tampered).unwrap_err().problem,
            Problem::InconsistentKeys
        );

        let mut future = relay_headers("e", "t");
        future.push((OUTBOX_ENCODING, "base64".into()));
        let error = decode(&future).unwrap_err();
        assert!(
            error.to_string().contains("upgrade outbox-consumer"),
            "{error}"
        );
    }

    #[test]
    fn a_replay_with_another_nats_msg_id_keeps_the_events_dedupe_key() {
        let mut replay = relay_headers("e", "t");
        replay[0].1 = "replayed-by-hand".into();
        assert_eq!(decode(&replay).unwrap().keys.dedupe_key, "t:e:7");
    }
}
