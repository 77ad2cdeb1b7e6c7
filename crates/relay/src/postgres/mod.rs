//! The Postgres server, as the relay sees it outside the replication stream: what must hold
//! there and what the relay reads and records there.
//!
//! - [`checks`]: `wal_level`, the outbox table's columns, the publication's facts (created
//!   when missing and allowed) and the slot, checked before every session (PG1–PG3).
//! - [`privileges`]: what `--mark-published` and `--retention-grace` need of the table and
//!   the role.
//! - [`rows`]: reading outbox rows as the relay reads them (ROW1, ROW2); [`range`]: the rows of a
//!   range in id order, as a backfill reads them.
//! - [`boundary`]: the rows a slot's creation left out by design (BD1–BD3).
//! - [`lease`]: the advisory lock that lets one relay stream a slot (LS1, LS2).
//! - [`failover`]: whether the standbys hold a copy of the slot a promotion keeps (FP1–FP3).
//! - [`error`]: one rendering of an error Postgres returns.
//! - [`standby`]: decoding on a standby, the primary for writes (SB1–SB4).
//!
//! May use: `config`, `error`, `observe`. Never uses `connect`'s NATS side, `stream`,
//! `setup`, `process` or `commands`: they all stand on it.

pub mod boundary;
pub mod checks;
pub mod error;
pub mod failover;
pub mod lease;
pub mod privileges;
pub mod range;
pub mod rows;
pub mod standby;
