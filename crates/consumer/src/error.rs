//! Errors, classified by what the caller must do.
//!
//! - [`Error::Setup`]: the configuration, the stream, the JetStream consumer or the
//!   `processed_events` table is not as it must be. Fix it and restart; retrying cannot help.
//! - [`Error::Message`]: a message on a shard subject that the consumer cannot handle. It was
//!   not acknowledged; remove it (or fix the configuration) and restart.
//! - [`Error::Handler`]: the handler failed on one event `max_attempts` times and the
//!   configuration says to stop ([`crate::OnFailure::Stop`]). The event was not
//!   acknowledged; fix the cause and restart.
//! - [`Error::Unavailable`]: Postgres or NATS failed or is unreachable. Transient:
//!   [`crate::Consumer::run`] retries these itself with backoff and never returns them.
//!
//! A handler's own error is otherwise none of these: the transaction rolls back and the
//! message is redelivered after a growing delay, then parked (see [`crate::Handler`]).

pub use crate::event::{MessageError, Problem};

/// Anything a consumer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Permanent: fix the configuration or the servers' setup, then restart.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// Permanent: a message the consumer cannot handle (not acknowledged).
    #[error(transparent)]
    Message(#[from] MessageError),
    /// Permanent: the handler kept failing on an event (with [`crate::OnFailure::Stop`]).
    #[error(transparent)]
    Handler(#[from] HandlerFailed),
    /// Transient: retried with backoff.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
}

/// The handler failed on one event `attempts` times, and the consumer stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the handler failed {attempts} times on outbox id {outbox_id} (stream sequence \
     {stream_sequence}, entity {entity_id:?}, dedupe key {dedupe_key:?}): {error}; the consumer \
     stopped (on_failure = stop) without acknowledging it: fix the cause and restart, or \
     choose on_failure = park"
)]
pub struct HandlerFailed {
    /// The event's outbox id.
    pub outbox_id: outbox::EventId,
    /// Its stream sequence.
    pub stream_sequence: u64,
    /// Its entity.
    pub entity_id: String,
    /// Its dedupe key.
    pub dedupe_key: String,
    /// How many times the handler failed on it.
    pub attempts: u32,
    /// The last failure's text.
    pub error: String,
}

impl Error {
    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable(_))
    }
}

/// The configuration or the servers' setup cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetupError {
    /// A configuration value is invalid.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// The stream does not exist.
    #[error(
        "stream {0} does not exist: start the relay (it creates the stream) or run \
         `outbox-relay init`, or set the consumer's stream to the relay's OUTBOX_RELAY_STREAM"
    )]
    StreamMissing(String),
    /// JetStream refused to create or update a shard's durable consumer.
    #[error(
        "JetStream refused the durable consumer {durable} on stream {stream}: {reason}; if a \
         consumer of that name exists with another configuration (subject filter, delivery), \
         delete it (`nats consumer rm {stream} {durable}`) or choose another consumer name"
    )]
    ConsumerRefused {
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        durable: String,
        /// JetStream's answer.
        reason: String,
    },
    /// The table that records parked events is missing or unusable.
    #[error(
        "cannot record parked events in table {table}: {reason}; create it with \
         sql/consumer.sql (or set the consumer's parked_table, or on_failure = stop) and \
         grant the consumer's role SELECT, INSERT, UPDATE and DELETE on it"
    )]
    ParkedTable {
        /// The configured table.
        table: String,
        /// Postgres's answer.
        reason: String,
    },
    /// The table that records processed events is missing or unusable.
    #[error(
        "cannot record processed events in table {table}: {reason}; create it with \
         sql/consumer.sql (or set the consumer's processed_table) and grant the consumer's \
         role INSERT on it"
    )]
    ProcessedTable {
        /// The configured table.
        table: String,
        /// Postgres's answer.
        reason: String,
    },
}

/// A server failed or could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// Postgres: its message, SQLSTATE, detail and hint (`replication::describe`).
    #[error("postgres: {}", replication::describe(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// NATS or JetStream.
    #[error("nats: {what}: {source}")]
    Nats {
        /// What was attempted.
        what: &'static str,
        /// The client's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Unavailable {
    pub(crate) fn nats(
        what: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Unavailable::Nats {
            what,
            source: source.into(),
        }
    }
}
