//! The JetStream side of the relay: publish outbox events with `Nats-Msg-Id`, keep a
//! bounded window of unacknowledged publishes, and compute the position that may be
//! confirmed to Postgres.
//!
//! # Invariants
//! - A1–A4 ([`tracker`]): a position is confirmable only when it and everything before it
//!   was acknowledged by JetStream; never on receipt, never for a failed publish.
//! - P1–P4 ([`publisher`]): the window is bounded, errors stop the sink, closing the input
//!   drains it.
//!
//! Generic over the position type: this crate knows nothing of LSNs or Postgres.

pub mod publisher;
pub mod tracker;

pub use publisher::{
    dead_letter_record, is_fence_refusal, publish_message, run, wire_size, PoisonPolicy, SinkError,
    SinkItem, SinkOptions, SinkStats,
};
pub use tracker::{AckTracker, Ticket, TrackerError};
