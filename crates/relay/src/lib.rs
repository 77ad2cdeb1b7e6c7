//! outbox-relay: a Postgres transactional-outbox table, streamed over logical replication
//! into a NATS JetStream stream, every committed event exactly once and in commit order.
//!
//! This crate wires the others and holds no domain logic of its own. Its modules are rooms
//! whose doors open one way (docs/architecture.md, "Inside crates/relay"; no import circle,
//! checked by `.ci/check-structure`), from the bottom:
//!
//! - [`config`]: flags, environment and file turned into a validated [`Config`], with
//!   provenance and redaction. Uses nothing else of the crate.
//! - [`error`]: [`RelayError`], by what the caller does next. Uses `config`.
//! - [`observe`]: logging, metrics, health. Uses `config`, `error`.
//! - [`connect`]: the NATS and Postgres connections a configuration describes, and what a
//!   sink publishes with. Uses `config`, `error`.
//! - [`process`]: the streaming process ([`run`]): sessions, lease, bootstrap checks,
//!   backfill, the identity watch, monitor, heartbeats, marking, retention. Uses the rooms
//!   above.
//! - [`commands`]: what users run once (`status`, `verify`, `replay`), over the process's
//!   pieces. Uses every other room; none uses it.
//!
//! The binary (`main.rs`) holds the command line and dispatches to `process` and
//! `commands`. Framing replication messages into events is `outbox::framer`'s; the resume
//! policy is `sink::resume`'s.
//!
//! # Invariants
//! The system's invariants I1–I13 are numbered in docs/architecture.md; [`process::pipeline`]
//! states the ones it keeps under those numbers.

pub mod commands;
pub mod config;
pub mod connect;
pub mod error;
pub mod observe;
pub mod process;

pub use config::Config;
pub use error::RelayError;
pub use process::pipeline::run;
