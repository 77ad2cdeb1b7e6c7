//! Why a sink stops ([`SinkError`]), and what an event's or a server's refusal means:
//! [`PoisonKind`] (an event JetStream will never store: the poison policy decides) and
//! [`Refusal`] (the server refuses the publishing connection for good, CN7). A leaf beside
//! [`crate::conn`] and [`crate::publisher`], which both return these.

use async_nats::jetstream::context::PublishErrorKind;

use crate::message::Excess;
use crate::tracker::TrackerError;

/// Why the sink stopped.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The publish could not be sent.
    #[error("publishing outbox event id={id} failed: {source}")]
    Publish {
        /// The outbox row id.
        id: outbox::EventId,
        /// Why, in async-nats's error type (the frame could not be handed to the
        /// connection in time, or the connection is gone).
        source: async_nats::jetstream::context::PublishError,
    },
    /// JetStream refused the message, or no ack came in time.
    #[error("JetStream did not store outbox event id={id}: {source}")]
    Ack {
        /// The outbox row id.
        id: outbox::EventId,
        /// The server's answer, classified as async-nats classifies it (AK3), or a timeout.
        source: async_nats::jetstream::context::PublishError,
    },
    /// An event JetStream can never accept, under [`PoisonPolicy::Halt`] (or whose
    /// dead-letter record cannot fit either).
    #[error("outbox event id={id} cannot be stored: {reason}")]
    Poison {
        /// The outbox row id.
        id: outbox::EventId,
        /// What kind of problem.
        kind: PoisonKind,
        /// Why, in detail.
        reason: String,
    },
    /// Strict mode, [`PoisonPolicy::DeadLetter`]: the event was acknowledged as a duplicate
    /// of another event (P8); the next session publishes a dead-letter record in its place.
    #[error("outbox event id={id} cannot be stored: {reason}; re-syncing to publish a dead-letter record in its place")]
    ReusedId {
        /// The outbox row id.
        id: outbox::EventId,
        /// Why.
        reason: String,
    },
    /// A duplicate's original could not be read (P8).
    #[error(
        "cannot check the original of outbox event id={id}, acknowledged as a duplicate: {source}"
    )]
    Verify {
        /// The outbox row id.
        id: outbox::EventId,
        /// What async-nats reported.
        source: async_nats::jetstream::stream::RawMessageError,
    },
    /// The session's publishing connection could not be opened (CN1, CN2).
    #[error("cannot open the publishing connection to NATS: {0}")]
    Connect(String),
    /// The server refused the publishing connection's subscription to its replies (CN2): a
    /// permission the NATS user lacks.
    #[error("the NATS server refused the subscription to {subject}, where the publish acks arrive: {why}")]
    SubscriptionRefused {
        /// The subscription's subject (`{inbox}.>`).
        subject: String,
        /// The server's words.
        why: String,
    },
    /// The session's publishing connection failed or the server closed it before the event
    /// was acknowledged (CN3, CN4).
    #[error("the publishing connection to NATS closed before outbox event id={id} was acknowledged: {why}")]
    Closed {
        /// The outbox row id.
        id: outbox::EventId,
        /// Why, in the server's words when it said any.
        why: String,
    },
    /// The session's publishing connection failed or the server closed it while the acker
    /// awaited no answer (CN3, CN4): the session ends now, not at its next publish.
    #[error("the publishing connection to NATS closed: {0}")]
    Disconnected(String),
    /// A bug: the items violated the Begin/Event/Commit protocol.
    #[error("replication items out of protocol: {0}")]
    Protocol(#[from] TrackerError),
    /// The server refused the publishing connection for good (CN7): a credential it does not
    /// accept, or no header support.
    #[error("the NATS server refuses the publishing connection: {why}")]
    Refused {
        /// What it refused.
        kind: Refusal,
        /// The server's words, or what its INFO said.
        why: String,
    },
    /// [`PoisonPolicy::DeadLetter`]: the server denied the event's subject (P11); the next
    /// session publishes a dead-letter record in place of every event to it.
    #[error("the NATS server denied publishing outbox event id={id} to {subject}: {why}; re-syncing to publish a dead-letter record in place of every event to that subject")]
    Denied {
        /// The outbox row id.
        id: outbox::EventId,
        /// The subject.
        subject: String,
        /// The server's words.
        why: String,
    },
    /// The server went into lame-duck mode (CN6, P12): everything published was
    /// acknowledged; the next session dials another server. Not a failure.
    #[error("the NATS server {server} is in lame-duck mode: the session ended after its acknowledgements, the next one dials another server")]
    LameDuck {
        /// `host:port`.
        server: String,
    },
}

/// What the server refused for good (CN7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The credential: refused, timed out, expired or revoked.
    Authentication,
    /// The server has no header support (`headers: false`).
    NoHeaders,
}

/// Why an event cannot be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoisonKind {
    /// Larger than `max_payload` or `max_msg_size`.
    TooLarge,
    /// Its publish line is longer than `max_control_line`.
    ControlLine,
    /// Its dead-letter record does not fit either.
    DeadLetterTooLarge,
    /// Acknowledged as a duplicate of another event (P8).
    ReusedId,
    /// Its payload is not valid UTF-8 (P7).
    NotUtf8,
    /// Strict mode: acknowledged as a duplicate of a message that carries no row identity,
    /// so not the relay's (P8): another writer used this event's `Nats-Msg-Id`.
    ForeignDuplicate,
    /// The NATS user may not publish to its subject (P11).
    Denied,
}

impl From<Excess> for PoisonKind {
    fn from(excess: Excess) -> Self {
        match excess {
            Excess::Size => PoisonKind::TooLarge,
            Excess::ControlLine => PoisonKind::ControlLine,
        }
    }
}

impl SinkError {
    /// Whether a new session may get further: everything but poison ([`Self::poison_id`]),
    /// an event JetStream will never accept, is retried from the confirmed position.
    pub fn is_transient(&self) -> bool {
        self.poison_id().is_none() && !matches!(self, SinkError::Refused { .. })
    }

    /// Whether the session ended because its server went into lame-duck mode (P12): no
    /// failure, the next session starts at once.
    pub fn is_lame_duck(&self) -> bool {
        matches!(self, SinkError::LameDuck { .. })
    }

    /// What the error means and what the operator can do, where there is more to say than
    /// the error itself: for poison, and for strict mode's fence refusing a publish.
    pub fn advice(&self) -> Option<&'static str> {
        if self.is_fence_refusal() {
            return Some("the stream's last message is not what this relay published last (a publish was lost, or another writer uses the stream: then set OUTBOX_RELAY_SHARED_STREAM=true); re-syncing from the stream's tail");
        }
        if let SinkError::Refused {
            kind: Refusal::NoHeaders,
            ..
        } = self
        {
            return Some("the relay publishes with headers (Nats-Msg-Id, the fence): enable header support on the NATS server");
        }
        self.poison_id()?;
        Some(match self {
            SinkError::Poison { kind: PoisonKind::Denied, .. } => {
                "the NATS user may not publish to this event's subject; nothing after it is confirmed (allow the user to publish to the stream's subjects, {prefix}.>, or run with OUTBOX_RELAY_ON_POISON=dead-letter to publish a record in its place on {prefix}.dlq; see docs/guarantees.md)"
            }
            SinkError::Poison { kind: PoisonKind::ControlLine, .. } => {
                "NATS cannot carry this event's subject; nothing after it is confirmed (the subject holds the escaped event type, and the server refuses a publish line longer than its max_control_line, 4096 bytes by default: run with OUTBOX_RELAY_ON_POISON=dead-letter to publish a record in its place; see docs/guarantees.md)"
            }
            SinkError::Poison { kind: PoisonKind::DeadLetterTooLarge, .. } => {
                "neither this event nor a dead-letter record in its place fits what JetStream accepts; nothing after it is confirmed (raise the stream's max_msg_size or the server's max_payload; see docs/guarantees.md)"
            }
            SinkError::Poison { kind: PoisonKind::NotUtf8, .. } => {
                "its payload is not valid UTF-8, which the relay never publishes; nothing after it is confirmed (the payload column holds bytes in another encoding: a SQL_ASCII database, or a client that bypassed encoding checks; the committed row reads the same on every replay, so run with OUTBOX_RELAY_ON_POISON=dead-letter to publish a record naming it in its place, then repair the row and publish it with `outbox-relay replay`; see docs/guarantees.md)"
            }
            SinkError::Poison { kind: PoisonKind::ForeignDuplicate, .. } => {
                "this event would be dropped as a duplicate of a message another writer published on the stream's subjects; nothing after it is confirmed (strict mode needs the relay to be the stream's only writer: find the other writer and stop it, or give it its own subjects, or set OUTBOX_RELAY_SHARED_STREAM=true if it publishes the same events; to relay this event, restart once the duplicate window has passed, or run with OUTBOX_RELAY_ON_POISON=dead-letter to publish a record in its place; see docs/guarantees.md)"
            }
            SinkError::Poison { kind: PoisonKind::ReusedId, .. } => {
                "this event would be dropped as a duplicate; nothing after it is confirmed (outbox ids were reused within the stream's duplicate window, e.g. by TRUNCATE ... RESTART IDENTITY or a restored sequence: move the id sequence past every id relayed, SELECT setval(pg_get_serial_sequence('<table>', 'id'), <highest id relayed>), so new rows get new ids; to relay this event, restart once the duplicate window has passed, or run with OUTBOX_RELAY_ON_POISON=dead-letter to publish a record in its place; see docs/guarantees.md)"
            }
            _ => {
                "JetStream refuses this event for good; nothing after it is confirmed (raise the stream's max_msg_size or the server's max_payload, or run with OUTBOX_RELAY_ON_POISON=dead-letter; see docs/guarantees.md)"
            }
        })
    }

    /// Whether this is strict mode's fence refusing a publish out of sequence: the expected
    /// last sequence (10071) or, the chained half of the fence, the expected last message id
    /// (10070; nats-server checks it first when both disagree).
    pub fn is_fence_refusal(&self) -> bool {
        matches!(self, SinkError::Ack { source, .. } if matches!(
            source.kind(),
            PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId
        ))
    }

    /// JetStream's own error code of a refused publish (`err_code`: 10071 wrong last
    /// sequence, 10201 a batch holding a stored message id…), when the server gave one.
    pub fn jetstream_code(&self) -> Option<u64> {
        use std::error::Error as _;
        match self {
            SinkError::Ack { source, .. } => source
                .source()
                .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
                .map(|e| e.error_code().0),
            _ => None,
        }
    }

    /// The outbox id of an event JetStream will never accept, whatever we retry (an
    /// oversized payload): the caller must stop or dead-letter it, not retry forever.
    pub fn poison_id(&self) -> Option<outbox::EventId> {
        match self {
            SinkError::Poison { id, .. } => Some(id.clone()),
            SinkError::Publish { id, source }
                if source.kind() == PublishErrorKind::MaxPayloadExceeded =>
            {
                Some(id.clone())
            }
            SinkError::Ack { id, source } if is_size_refusal(source) => Some(id.clone()),
            _ => None,
        }
    }
}

fn is_size_refusal(error: &async_nats::jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    let code = error
        .source()
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .map(|e| e.error_code());
    code == Some(async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}
