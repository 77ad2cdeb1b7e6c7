//! The end-to-end suite: every file of `tests/` but `faults.rs` is a module of this one test
//! binary, so the relay and its harness are compiled and linked for them once (they were 29
//! binaries). Each module keeps its own docs, servers and rules; the tests of all of them
//! share this process's Postgres and nats-server (`support::servers`), each in its own
//! database, slot, publication, stream and subject prefix (`support::Case`), and the
//! tests that stop or restart a server start their own.
//!
//! Run one file's tests by its module path: `cargo test -p outbox-relay --test e2e -- relay::`
//! (a filter is a substring of `module::test_name`). `tests/faults.rs` is a binary of its own:
//! the torture and the emptied-table lifecycles want the machine to themselves.

#![allow(clippy::unwrap_used)]

mod support;

mod atomic;
mod cloudevents;
mod cluster;
mod connect;
mod container;
mod decode_standby;
mod failover;
mod failover_slot;
mod fast_ingest;
mod heartbeat;
mod history;
mod hostile_rows;
mod identity;
mod metrics;
mod migration;
mod nats_auth;
mod nats_conformance;
mod ops;
mod outages;
mod own_table;
mod own_table_tools;
mod poison;
mod publications;
mod relay;
mod replay;
mod retention;
mod secrets;
mod stalls;
mod standby;
mod trust;
mod verify;
