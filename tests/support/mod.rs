//! The end-to-end tests' harness is testkit's ([`testkit::harness`]): cases (a database with
//! the seed's table, a slot, a publication, a stream and a prefix on the servers) running the
//! real `outbox-relay` binary (which cargo builds for these tests), writers, the faithfulness
//! check and the relay's log. This module only makes it `support::…` for the test files.

#![allow(unused_imports)]

pub use testkit::harness::*;

#[allow(dead_code)]
pub mod nats_jwt;
