//! The consumer half of the seed design: every side effect of an outbox event happens once,
//! and in entity order, however often JetStream delivers the event.
//!
//! ```no_run
//! use outbox_consumer::{BoxError, Config, Consumer, Event, Handler, Postgres, Transaction};
//!
//! struct Ledger;
//!
//! impl Handler for Ledger {
//!     async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), BoxError> {
//!         tx.execute(
//!             "insert into ledger (outbox_id, entity_id, event_type, payload) \
//!              values ($1, $2, $3, $4::text::jsonb)",
//!             &[&event.id, &event.entity_id, &event.event_type, &event.payload_str()?],
//!         )
//!         .await?;
//!         Ok(())
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), BoxError> {
//!     let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//!     let postgres = Postgres::new("host=127.0.0.1 dbname=app".parse()?, tokio_postgres::NoTls);
//!     let consumer = Consumer::new(Config::new("ledger"), nats, postgres);
//!     consumer.run(Ledger, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//!     Ok(())
//! }
//! ```
//!
//! (The README's example; this copy is compiled by `cargo test --doc`.)
//!
//! Each shard `n` of the relay's stream (subjects `{prefix}.{n}.>`) is consumed through its
//! own durable JetStream pull consumer `{name}-{n}`, by its own task with its own Postgres
//! connection. For every delivery the worker opens a transaction, inserts the event's
//! `dedupe_key` into `processed_events` (`sql/consumer.sql`), runs the handler in that
//! transaction, commits, and only then acknowledges.
//!
//! # Invariants
//! - C1 A message is acknowledged only after the transaction that recorded its `dedupe_key`
//!   and ran its handler committed, or when its `dedupe_key` was already recorded by such a
//!   transaction. A side effect written through the transaction therefore happens exactly
//!   once per event across redeliveries (ack timeouts, a consumer killed between commit and
//!   ack, replays, consumer resets).
//! - C2 The `dedupe_key` is inserted (`on conflict do nothing`) before the handler runs, in
//!   its transaction: both commit or neither does. A concurrent delivery of the same event
//!   waits on the key's row and then finds it recorded.
//! - C3 A handler error or panic, or a transaction that fails (or whose commit's outcome is
//!   unknown), rolls back and is negatively acknowledged with `retry_delay`: it is never
//!   acknowledged, and its redelivery decides by the dedupe key whether anything is left to do.
//! - C4 A shard's consumer has `max_ack_pending = 1` and one task: its messages are handled
//!   one at a time in stream order, and a message being redelivered is handled again before
//!   any later message of its shard. An entity maps to exactly one shard
//!   (`shard_for_key(partitions, entity_id)`), so each entity's events are handled in stream
//!   order (the database's commit order) while shards run in parallel.
//! - C5 Events are decoded from the relay's headers and checked (V1–V3 in [`event`]): the
//!   `dedupe_key` is derived from the event's identity, not from `Nats-Msg-Id`, and every
//!   message must be on the shard its partition key maps to with the configured partition
//!   count. A message failing a check stops the consumer with a [`MessageError`] naming it and
//!   the fix; it is not acknowledged.
//! - C6 Per entity, the ordering key of each processed event must increase (O1–O2 in
//!   [`order`]); one that does not is counted ([`Stats::out_of_order`]) and logged with its
//!   outbox id and both ordering keys, never its payload, and is still processed.
//! - C7 On shutdown each shard finishes the message in hand (commit, or roll back), ends its
//!   pull subscription, then answers it (ack or nak) and releases any message delivered but
//!   not handled; its last ack is sent as a double ack and awaited (the server answers only
//!   once it processed that ack, hence every earlier one of the shard: a socket flush alone
//!   does not tell, and a connection closed with unread data may be reset and lose acks
//!   still on the wire). A restarted consumer continues where this one stopped, without
//!   waiting for `ack_wait` except for a message that was on the wire at that instant. What
//!   a shard handled may still come again (a confirmation that did not come within
//!   [`STOP_CONFIRM`]; nats-server 2.9.10 backing out a delivery to a pull request that
//!   went away, seen about once in twenty restarts in the tests): it is recognised by its
//!   dedupe key (C1) and its handler does not run again.

mod config;
mod consumer;
pub mod error;
pub mod event;
mod order;

use std::future::Future;

pub use config::Config;
pub use consumer::{Consumer, Postgres, Stats, STOP_CONFIRM};
pub use error::{Error, MessageError, Problem, SetupError, Unavailable};
pub use event::{percent_decode, Event};
pub use outbox::{Keys, Position};
pub use tokio_postgres::Transaction;

/// A handler's error: anything `?` accepts.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `sql/consumer.sql`: the `processed_events` table.
pub const SCHEMA_SQL: &str = include_str!("../sql/consumer.sql");

/// What to do with one event, inside the transaction that records its `dedupe_key`.
///
/// Write the side effects through `tx`: they commit together with the dedupe record, and
/// the message is acknowledged after that. Return an error to roll everything back and have
/// the event redelivered after `retry_delay` (the shard waits for it: later events of the
/// shard are not handled before it succeeds). Effects outside the database (an HTTP call, an
/// e-mail) are not covered by the transaction: make them idempotent on `event.keys.dedupe_key`.
pub trait Handler: Send + Sync + 'static {
    /// Handles `event`.
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        event: &Event,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// A shared handler (keep a clone to inspect it while the consumer runs).
impl<H: Handler> Handler for std::sync::Arc<H> {
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        event: &Event,
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        H::handle(self, tx, event)
    }
}

#[cfg(test)]
mod tests {
    /// The first code block of `text` fenced with `fence`.
    fn first_block<'a>(text: &'a str, fence: &str) -> Vec<&'a str> {
        text.lines()
            .skip_while(|line| line.trim_end() != fence)
            .skip(1)
            .take_while(|line| line.trim_end() != "```")
            .collect()
    }

    #[test]
    fn the_readmes_example_is_the_compiled_one() {
        let readme = include_str!("../../../README.md");
        let consuming = &readme[readme.find("## Consuming").unwrap_or(0)..];
        let docs: String = include_str!("lib.rs")
            .lines()
            .filter_map(|line| {
                line.strip_prefix("//!")
                    .map(|l| l.strip_prefix(' ').unwrap_or(l))
            })
            .collect::<Vec<_>>()
            .join("\n");
        let in_readme = first_block(consuming, "```rust");
        assert!(
            !in_readme.is_empty(),
            "README.md has a rust block under ## Consuming"
        );
        assert_eq!(in_readme, first_block(&docs, "```no_run"));
    }
}
