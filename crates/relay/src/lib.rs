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
//! - [`postgres`]: the Postgres server outside the replication stream: its checks
//!   (`wal_level`, table, publication, slot), the rows the relay reads, the slot's boundary,
//!   the lease, one rendering of its errors. Uses `config`, `error`, `observe`.
//! - [`stream`]: the JetStream stream's settings and policy, atomic and fast-ingest support.
//!   Uses `config`, `error`, `observe`.
//! - [`setup`]: what must exist and hold on both servers before a slot is streamed, the
//!   backfill at slot creation included. Uses the rooms above.
//! - [`process`]: the streaming process ([`run`]): sessions, the identity watch, monitor,
//!   heartbeats, marking, retention. Uses the rooms above.
//! - [`commands`]: what users run once (`status`, `verify`, `replay`, `backfill`, `init`),
//!   over the server rooms and `setup`. Never uses `process`; nothing uses it.
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
pub mod postgres;
pub mod process;
pub mod setup;
pub mod stream;

pub use config::Config;
pub use error::RelayError;
pub use process::pipeline::run;
