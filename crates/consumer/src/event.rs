//! From a JetStream message to the [`Event`] a handler sees.
//!
//! # Invariants
//! - V1 Every field comes from the relay's frozen headers (`outbox::headers`), decoded when
//!   `Outbox-Encoding: percent` says the textual ones were percent-encoded; the payload is
//!   the message body, unchanged. Under `percent` these are encoded ([`is_encoded`]):
//!   `Nats-Msg-Id`, `Outbox-Entity-Id`, `Outbox-Event-Type`, `Outbox-Partition-Key`;
//!   `Outbox-Id` and `Outbox-Ordering-Key` when `Outbox-Id-Kind` is present (uuid and text
//!   ids); every header that is not the relay's own (`Nats-*`, `Outbox-*`: the columns
//!   copied into headers, `traceparent`, `tracestate`). [`Event::header`] applies that rule,
//!   and a message whose encoded values do not decode is refused (V3).
//! - V2 The keys are recomputed from the event's identity with [`outbox::EventId::keys`]
//!   (`Outbox-Id` read as its `Outbox-Id-Kind`, absent for integers, `Outbox-Entity-Id`,
//!   `Outbox-Event-Type` and the milliseconds of `Outbox-Ordering-Key`, before its first
//!   `:`): integer ids give the seed's `compute_keys` exactly. The `Outbox-Ordering-Key` and
//!   `Outbox-Partition-Key` headers must equal what it derives. The `dedupe_key` is
//!   therefore the event's, whatever `Nats-Msg-Id` a replay was published with.
//! - V3 A message that does not carry a consistent event is a [`MessageError`] naming its
//!   stream sequence, the problem and the fix: never guessed at, never skipped.
//! - V4 [`Event::trace_context`] is the decoded `traceparent` when it is a well-formed W3C
//!   traceparent ([`outbox::mapping::is_traceparent`]), with the decoded `tracestate` if
//!   any; a malformed one is no trace context (advisory: never a reason to refuse an event).

use std::borrow::Cow;
use std::fmt;

use async_nats::HeaderMap;
use bytes::Bytes;
use outbox::headers;
use outbox::mapping::{is_traceparent, TRACEPARENT, TRACESTATE};
use outbox::{EventId, Keys, Position};

/// The header saying how the textual headers are encoded (absent: verbatim), and its one
/// value: the relay's [`outbox::encoding`].
pub use outbox::encoding::PERCENT as ENCODING_PERCENT;
pub use outbox::headers::OUTBOX_ENCODING;

/// One outbox event, as the relay published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The outbox row's `id`: an integer (the seed's table, `Outbox-Id-Kind` absent), or a
    /// uuid or text id as Postgres prints it.
    pub id: EventId,
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
    /// The message's subject, `{prefix}.{shard}.{event_type_token}` (or the relay's
    /// subject template's).
    pub subject: String,
    /// Every header of the message, as published (read a value with [`Event::header`],
    /// which decodes it when the message is percent-encoded).
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

    /// The `(created_at_ms, id)` pair an integer id's ordering key sorts like; `None` for
    /// a uuid or text id (whose ordering key sorts by time, then by the id's bytes: not an
    /// order of events; their commit order is [`Event::position`]).
    pub fn order(&self) -> Option<(i64, i64)> {
        self.id.as_int().map(|id| (self.created_at_ms, id))
    }

    /// The value of header `name`, decoded when the message is percent-encoded and the
    /// relay encodes that header (V1: its row values, a uuid or text id, and every header
    /// that is not the relay's own, such as the columns copied into headers and
    /// `traceparent`). The first value when the header is there twice; `None` when absent.
    pub fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let value = self.headers.get(name)?.as_str();
        if is_encoded(name, &self.headers) {
            // Decodable: checked when the message was decoded (V1, V3).
            if let Some(decoded) = percent_decode(value) {
                return Some(Cow::Owned(decoded));
            }
        }
        Some(Cow::Borrowed(value))
    }

    /// The producer's W3C trace context (V4): `traceparent`, and `tracestate` if present.
    pub fn trace_context(&self) -> Option<(Cow<'_, str>, Option<Cow<'_, str>>)> {
        let parent = self.header(TRACEPARENT).filter(|p| is_traceparent(p))?;
        Some((parent, self.header(TRACESTATE)))
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

/// Whether the relay percent-encodes the value of header `name` on a message with these
/// `headers` (V1): never without `Outbox-Encoding: percent`.
pub fn is_encoded(name: &str, headers: &HeaderMap) -> bool {
    let is = |header: &str| name.eq_ignore_ascii_case(header);
    headers.get(OUTBOX_ENCODING).map(|v| v.as_str()) == Some(ENCODING_PERCENT)
        && (!headers::is_relay_header(name)
            || [
                headers::NATS_MSG_ID,
                headers::OUTBOX_ENTITY_ID,
                headers::OUTBOX_EVENT_TYPE,
                headers::OUTBOX_PARTITION_KEY,
            ]
            .into_iter()
            .any(is)
            || (headers.get(headers::OUTBOX_ID_KIND).is_some()
                && (is(headers::OUTBOX_ID) || is(headers::OUTBOX_ORDERING_KEY))))
}

/// A message's headers, read as the relay wrote them (V1).
struct Fields<'a> {
    map: &'a HeaderMap,
    percent: bool,
    /// `Outbox-Id-Kind`: absent for integer ids.
    id_kind: Option<&'a str>,
}

impl<'a> Fields<'a> {
    fn of(map: &'a HeaderMap) -> Result<Self, Problem> {
        let percent = match map.get(OUTBOX_ENCODING).map(|v| v.as_str()) {
            None => false,
            Some(ENCODING_PERCENT) => true,
            Some(other) => return Err(Problem::UnknownEncoding(other.to_owned())),
        };
        let id_kind = map.get(headers::OUTBOX_ID_KIND).map(|v| v.as_str());
        Ok(Fields {
            map,
            percent,
            id_kind,
        })
    }

    fn raw(&self, name: &'static str) -> Result<&'a str, Problem> {
        self.map
            .get(name)
            .map(|value| value.as_str())
            .ok_or(Problem::MissingHeader(name))
    }

    fn text(&self, name: &'static str) -> Result<String, Problem> {
        self.text_if(name, self.percent).map(Cow::into_owned)
    }

    /// `name`'s value, decoded when `encoded`.
    fn text_if(&self, name: &'static str, encoded: bool) -> Result<Cow<'a, str>, Problem> {
        let value = self.raw(name)?;
        if encoded {
            percent_decode(value)
                .map(Cow::Owned)
                .ok_or(Problem::BadHeader {
                    name,
                    reason: "is not valid percent-encoded UTF-8",
                })
        } else {
            Ok(Cow::Borrowed(value))
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
        let id = self.id()?;
        let entity_id = self.text(headers::OUTBOX_ENTITY_ID)?;
        let event_type = self.text(headers::OUTBOX_EVENT_TYPE)?;
        let partition_key = self.text(headers::OUTBOX_PARTITION_KEY)?;
        let text_id = self.id_kind.is_some();
        let ordering_key = self.text_if(headers::OUTBOX_ORDERING_KEY, text_id && self.percent)?;
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
        let keys = id.keys(&entity_id, &event_type, created_at_ms);
        if keys.ordering_key != *ordering_key || keys.partition_key != partition_key {
            return Err(Problem::InconsistentKeys);
        }
        self.check_columns()?;
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

    /// `Outbox-Id`, of the kind `Outbox-Id-Kind` says (V2).
    fn id(&self) -> Result<EventId, Problem> {
        let value = self.raw(headers::OUTBOX_ID)?;
        match (
            EventId::from_header(value, self.id_kind, self.percent),
            self.id_kind,
        ) {
            (Some(id), _) => Ok(id),
            (None, None) => Err(Problem::BadHeader {
                name: headers::OUTBOX_ID,
                reason: "is not an integer",
            }),
            (None, Some(kind)) if outbox::IdKind::from_header(Some(kind)).is_none() => {
                Err(Problem::UnknownIdKind(kind.to_owned()))
            }
            (None, Some(_)) => Err(Problem::BadHeader {
                name: headers::OUTBOX_ID,
                reason: "is not an id of the kind Outbox-Id-Kind names",
            }),
        }
    }

    /// Under `percent`, every header a column gave decodes (V1).
    fn check_columns(&self) -> Result<(), Problem> {
        if !self.percent {
            return Ok(());
        }
        for (name, values) in self.map.iter() {
            let name: &str = name.as_ref();
            if headers::is_relay_header(name) {
                continue;
            }
            if values.iter().any(|v| percent_decode(v.as_str()).is_none()) {
                return Err(Problem::BadColumnHeader(name.to_owned()));
            }
        }
        Ok(())
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
    /// An `Outbox-Id-Kind` this consumer does not know.
    UnknownIdKind(String),
    /// A header a column gave (not `Nats-*` or `Outbox-*`) is not valid percent-encoded
    /// UTF-8 on a message that says `Outbox-Encoding: percent`.
    BadColumnHeader(String),
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
            Problem::UnknownIdKind(value) => write!(
                f,
                "unknown {} {value:?}: the relay is newer than this consumer; upgrade \
                 outbox-consumer",
                headers::OUTBOX_ID_KIND
            ),
            Problem::BadColumnHeader(name) => write!(
                f,
                "header {name} is not valid percent-encoded UTF-8 although the message says \
                 {OUTBOX_ENCODING}: {ENCODING_PERCENT}; {NOT_OURS}"
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
    use outbox::compute_keys;

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
        assert_eq!(event.id, EventId::Int(7));
        assert_eq!(event.order(), Some((1_700_000_000_123, 7)));
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

    /// Percent-encodes the headers the relay encodes for a header-hostile row: the entity
    /// id, the event type, the partition key and `Nats-Msg-Id`.
    fn percent_encode_text_headers(pairs: &mut [(&str, String)]) {
        for (name, value) in pairs {
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
    }

    #[test]
    fn percent_encoded_headers_are_decoded_only_when_the_header_says_so() {
        let entity = "user:nats-1\u{7}";
        let keys = compute_keys(7, entity, "Nats-Event", 1_700_000_000_123);
        let mut pairs = relay_headers(entity, "Nats-Event");
        percent_encode_text_headers(&mut pairs);
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

    /// The headers of a uuid or text id's event, as the relay publishes them (the values
    /// encoded when `hostile`), with a column header and a trace context.
    fn text_id_headers(
        id: &str,
        kind: &str,
        entity: &str,
        hostile: bool,
    ) -> Vec<(&'static str, String)> {
        let event_id = EventId::Text(id.into());
        let keys = event_id.keys(entity, "OrderPaid", 1_700_000_000_123);
        let encode = |v: &str| match hostile {
            true => outbox::encoding::encode(v),
            false => v.to_owned(),
        };
        let mut pairs = vec![
            (headers::NATS_MSG_ID, encode(&keys.dedupe_key)),
            (headers::OUTBOX_ID, encode(id)),
            (headers::OUTBOX_ID_KIND, kind.into()),
            (headers::OUTBOX_ENTITY_ID, encode(entity)),
            (headers::OUTBOX_EVENT_TYPE, "OrderPaid".into()),
            (headers::OUTBOX_PARTITION_KEY, encode(&keys.partition_key)),
            (headers::OUTBOX_ORDERING_KEY, encode(&keys.ordering_key)),
            (headers::OUTBOX_SHARD, "3".into()),
            (headers::OUTBOX_COMMIT_LSN, "0/16B3748".into()),
            (headers::OUTBOX_TX_INDEX, "2".into()),
            ("X-Tenant", encode("acme-eu")),
            (TRACEPARENT, encode(TP)),
            (TRACESTATE, encode("congo=t61rcWkgMzE")),
        ];
        if hostile {
            pairs.push((OUTBOX_ENCODING, ENCODING_PERCENT.into()));
        }
        pairs
    }

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn decodes_uuid_and_text_ids_with_their_keys() {
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        let event = decode(&text_id_headers(uuid, "uuid", "A-1", false)).unwrap();
        assert_eq!(event.id, EventId::Text(uuid.into()));
        assert_eq!(event.keys.dedupe_key, format!("OrderPaid:A-1:{uuid}"));
        assert_eq!(event.keys.ordering_key, format!("1700000000123:{uuid}"));
        assert_eq!(event.created_at_ms, 1_700_000_000_123);
        assert_eq!(event.order(), None);
        // A text id with ':' in it: the milliseconds end at the first ':'.
        let event = decode(&text_id_headers("evt:01:x", "text", "A-1", false)).unwrap();
        assert_eq!(event.id.as_text(), Some("evt:01:x"));
        assert_eq!(event.keys.ordering_key, "1700000000123:evt:01:x");
        // Not a uuid, an unknown kind.
        let bad = decode(&text_id_headers("not-a-uuid", "uuid", "A-1", false)).unwrap_err();
        assert!(
            matches!(
                bad.problem,
                Problem::BadHeader {
                    name: headers::OUTBOX_ID,
                    ..
                }
            ),
            "{bad}"
        );
        let future = decode(&text_id_headers("x", "ulid", "A-1", false)).unwrap_err();
        assert_eq!(future.problem, Problem::UnknownIdKind("ulid".into()));
        assert!(
            future.to_string().contains("upgrade outbox-consumer"),
            "{future}"
        );
    }

    #[test]
    fn percent_encoded_text_ids_ordering_keys_and_column_headers_are_decoded() {
        let id = "Nats-Msg-Id: 1";
        let pairs = text_id_headers(id, "text", "user:nats-1", true);
        let event = decode(&pairs).unwrap();
        assert_eq!(event.id.as_text(), Some(id));
        assert_eq!(event.entity_id, "user:nats-1");
        assert_eq!(event.keys.ordering_key, format!("1700000000123:{id}"));
        assert_eq!(event.header("X-Tenant").as_deref(), Some("acme-eu"));
        assert_eq!(event.header(headers::OUTBOX_ID).as_deref(), Some(id));
        assert_eq!(
            event.header(headers::OUTBOX_ENTITY_ID).as_deref(),
            Some("user:nats-1")
        );
        // The relay's own other headers are never encoded.
        assert_eq!(
            event.header(headers::OUTBOX_COMMIT_LSN).as_deref(),
            Some("0/16B3748")
        );
        assert_eq!(event.header("X-Missing"), None);
        let (parent, state) = event.trace_context().unwrap();
        assert_eq!(
            (parent.as_ref(), state.as_deref()),
            (TP, Some("congo=t61rcWkgMzE"))
        );

        // A column header that does not decode: not the relay's message.
        let mut bad = pairs.clone();
        bad.push(("X-Region", "eu-west".into()));
        let error = decode(&bad).unwrap_err();
        assert_eq!(error.problem, Problem::BadColumnHeader("X-Region".into()));
    }

    #[test]
    fn integer_ids_headers_are_verbatim_without_percent_and_the_trace_context_is_checked() {
        let mut pairs = relay_headers("e", "t");
        pairs.push(("X-Tenant", "a%20b".into()));
        pairs.push((TRACEPARENT, "00-garbage".into()));
        let event = decode(&pairs).unwrap();
        assert_eq!(event.header("X-Tenant").as_deref(), Some("a%20b"));
        assert_eq!(
            event.trace_context(),
            None,
            "a malformed traceparent is none (V4)"
        );
        let mut pairs = relay_headers("e", "t");
        pairs.push((TRACEPARENT, TP.into()));
        let event = decode(&pairs).unwrap();
        assert_eq!(event.trace_context(), Some((TP.into(), None)));
        // Under percent, an integer id's Outbox-Id and Outbox-Ordering-Key stay verbatim.
        let mut hostile = relay_headers("Nats-1", "t");
        percent_encode_text_headers(&mut hostile);
        hostile.push((OUTBOX_ENCODING, ENCODING_PERCENT.into()));
        let event = decode(&hostile).unwrap();
        assert_eq!(event.id, EventId::Int(7));
        assert!(!is_encoded(headers::OUTBOX_ID, &event.headers));
        assert!(!is_encoded(headers::OUTBOX_ORDERING_KEY, &event.headers));
        assert!(is_encoded(headers::OUTBOX_ENTITY_ID, &event.headers));
        assert!(is_encoded("traceparent", &event.headers));
    }
}
