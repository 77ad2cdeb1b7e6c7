//! outbox-relay: a Postgres transactional-outbox table, streamed over logical replication
//! into a NATS JetStream stream, every committed event exactly once and in commit order.
//!
//! This crate wires the others and holds no domain logic of its own: [`config`] turns
//! flags, environment and file into a validated [`Config`]; [`logging`] sets up the logs
//! (colour only on a terminal) and scrubs secrets from them; [`bootstrap`] checks and
//! creates the publication, slot and stream; [`decode`] frames replication messages into
//! sink items; [`pipeline`] runs the reader and the sink and restarts them on failure; [`nats`]
//! connects to NATS with the configured credential and TLS files; [`status`] reads and judges
//! the slot, publication, lease and stream for `outbox-relay status`.
//!
//! # Invariants
//! The numbered invariants I1–I5 are stated in [`pipeline`] and in docs/architecture.md.

pub mod bootstrap;
pub mod config;
pub mod decode;
pub mod error;
pub mod lease;
pub mod logging;
pub mod metrics;
pub mod nats;
pub mod pipeline;
pub mod status;

pub use config::Config;
pub use error::RelayError;
pub use pipeline::run;
