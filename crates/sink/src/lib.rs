//! The JetStream side of the relay: publish outbox events with `Nats-Msg-Id`, keep a
//! bounded window of unacknowledged publishes, and compute the position that may be
//! confirmed to Postgres.
//!
//! # Invariants
//! - A1–A4 ([`tracker`]): a position is confirmable only when it and everything before it
//!   was acknowledged by JetStream; never on receipt, never for a failed publish.
//! - P1–P15 ([`publisher`]): the window is bounded, errors stop the sink, closing the input
//!   drains it, strict mode fences and its fence counts only what the stream stores, nothing
//!   is dropped silently, an ack counts only for the publish it answers, a publish the server
//!   denies goes to the poison policy.
//! - B1–B6 ([`batch`]): with atomic transactions, each transaction is one JetStream atomic
//!   batch (split at the server's limit), committed only at its end, fenced by its first
//!   message, acknowledged by its commit's answer alone.
//! - AK1–AK3 ([`ack`]): JetStream's answers are read totally, as async-nats reads them, and
//!   classified as it classifies them.
//! - S1–S6 ([`resume`]): a replayed event is skipped only when the stream holds it at its
//!   place, compared message by message (not by the table, which outbox users empty); the
//!   fence never depends on the tail, and counts only what the stream stores.
//! - RV1–RV2 ([`vouch`]): the stream's run of replayed events is found by walking back from
//!   the tail and read in bounded chunks; the first event it does not vouch for ends the
//!   comparison.
//! - M1–M3 ([`message`]): no row value can hide a header; sizes are known before
//!   publishing; dead-letter records are cut to fit.
//! - L1–L3 ([`latency`]): what the acker times, once per transaction or run of events.
//! - WIRE1–WIRE5 ([`wire`]): the NATS protocol's framing is read totally and zero-copy; a prefix
//!   of an operation is incomplete, never invalid, and invalid is final; `HPUB`'s sizes are
//!   the real ones.
//! - CN1–CN9 ([`conn`]): the publishing connection speaks every authentication and TLS mode
//!   the relay is configured with, is subscribed before it publishes, is never re-used
//!   after it fails, applies every `INFO` (the account's `max_payload`, lame-duck mode,
//!   `connect_urls`), reads each `-ERR` as nats-server means it, and dials every address.
//!
//! The ack tracker is generic over the position type; the publisher writes an event's
//! position (from `outbox`) into its headers as text. Nothing here speaks to Postgres or
//! decodes replication messages: it depends on `outbox` for the event and its position,
//! not on `pgoutput` or `replication`.

pub mod ack;
pub mod batch;
pub mod conn;
pub mod error;
pub mod latency;
pub mod message;
pub mod publisher;
pub mod resume;
pub mod tracker;
pub mod vouch;
pub mod wire;

pub use conn::{Connection, Connector};
pub use error::{PoisonKind, Refusal, SinkError};
pub use latency::{Latency, LatencySnapshot, LATENCY_BUCKETS_US};
pub use message::{
    control_line_len, publish_message, wire_size, Fence, Limits, DEFAULT_MAX_CONTROL_LINE,
    REPLY_SUBJECT_LEN,
};
pub use publisher::{run, Acknowledged, PoisonPolicy, SinkOptions, SinkStats, REUSED_ID_METRIC};
pub use tracker::{AckTracker, Ticket, TrackerError};
