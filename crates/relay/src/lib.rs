//! outbox-relay: a Postgres transactional-outbox table, streamed over logical replication
//! into a NATS JetStream stream, every committed event exactly once and in commit order.
//!
//! This crate wires the others and holds no domain logic of its own: [`config`] turns
//! flags, environment and file into a validated [`Config`]; [`logging`] sets up the logs
//! (colour only on a terminal) and scrubs secrets from them; [`bootstrap`] checks and
//! creates the publication, slot and stream; [`pipeline`] runs a session as a list of steps
//! (lease, connections, checks, resume plan, reader and sink) and restarts it on failure;
//! [`nats`] connects to NATS with the configured credential and TLS files; [`metrics`]
//! counts and shows what happens, [`monitor`] polls the slot and logs backlog progress
//! and checks the table's identity ([`identity`]: a table dropped, created again or swapped
//! by rename stops the relay, and nothing is confirmed past what a check vouched for),
//! and [`http`] serves both with health on `--metrics-addr`. Framing
//! replication messages into events is `outbox::framer`'s; the resume policy is
//! `sink::resume`'s; [`status`] reads and judges the slot, publication, lease and stream for
//! `outbox-relay status`; [`heartbeat`] writes the optional WAL heartbeats of a streaming
//! session; [`verify`] reconciles the table with the stream (`outbox-relay verify`) and
//! [`replay`] re-publishes a range of rows (`outbox-relay replay`); [`mark`] sets
//! acknowledged rows `published` (`--mark-published`) and [`retention`] deletes old
//! confirmed rows (`--retention-grace`).
//!
//! # Invariants
//! The system's invariants I1–I12 are numbered in docs/architecture.md; [`pipeline`] states
//! the ones it keeps under those numbers.

pub mod commands;
pub mod config;
pub mod connect;
pub mod error;
pub mod observe;
pub mod process;

pub use config::Config;
pub use error::RelayError;
pub use process::pipeline::run;
