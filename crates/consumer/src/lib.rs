//! The consumer half of the seed design: every side effect of an outbox event happens once,
//! and in entity order, however often JetStream delivers the event.
//!
//! ```no_run
//! use outbox_consumer::{BatchHandler, BoxError, Config, Consumer, Event, Postgres, Transaction};
//!
//! struct Ledger;
//!
//! impl BatchHandler for Ledger {
//!     async fn handle_batch(&self, tx: &mut Transaction<'_>, events: &[Event]) -> Result<(), BoxError> {
//!         let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
//!         let entities: Vec<&str> = events.iter().map(|e| e.entity_id.as_str()).collect();
//!         let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
//!         let payloads = events.iter().map(Event::payload_str).collect::<Result<Vec<_>, _>>()?;
//!         tx.execute(
//!             "insert into ledger (outbox_id, entity_id, event_type, payload) \
//!              select i, e, t, p::jsonb from unnest($1::text[], $2::text[], $3::text[], $4::text[]) u(i, e, t, p)",
//!             &[&ids, &entities, &types, &payloads],
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
//!     consumer.run_batch(Ledger, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//!     Ok(())
//! }
//! ```
//!
//! (The README's example; this copy is compiled by `cargo test --doc`.)
//!
//! Each shard `n` of the relay's stream (subjects `{prefix}.{n}.>`, or the shard's subjects
//! of the relay's subject template, [`Config::subject_template`]) is consumed through its
//! own durable JetStream pull consumer `{name}-{n}`, by its own task with its own Postgres
//! connection. The worker takes what has been delivered, up to [`Config::batch_size`]
//! messages in stream order, opens one transaction, records all their `dedupe_key`s in one
//! statement into `processed_events` (`sql/consumer.sql`), runs the handler for the new ones
//! (a [`Handler`] per event, or a [`BatchHandler`] for all of them), commits, and only then
//! acknowledges them. With `batch_size = 1` that is one transaction and one ack per event.
//!
//! # Invariants
//! - C1 A message is acknowledged only after the transaction that recorded its `dedupe_key`
//!   and ran its handler committed, or when its `dedupe_key` was already recorded by such a
//!   transaction. A side effect written through the transaction therefore happens exactly
//!   once per event across redeliveries (ack timeouts, a consumer killed between commit and
//!   ack, replays, consumer resets).
//! - C2 The `dedupe_key`s of a transaction's events are inserted (`on conflict do nothing
//!   returning dedupe_key`) before the handler runs, in its transaction: all commit or none
//!   does. A key the insert did not return was recorded before: its event is a duplicate and
//!   its handler does not run; the same key twice in one batch is new once, the first time.
//!   A concurrent delivery of the same event waits on the key's row and then finds it
//!   recorded.
//! - C3 A handler error or panic, or a transaction that fails (or whose commit's outcome is
//!   unknown), rolls back. A Postgres failure keeps the batch in hand and tries it again
//!   after a backoff (nothing acknowledged; the dedupe keys decide what is left to do). A
//!   handler failure is narrowed to one event (C8), which is negatively acknowledged with
//!   a delay (`retry_delay`, doubled per failure up to `retry_delay_max`) and handled
//!   again, alone, on its redelivery: never acknowledged before its handler committed or
//!   it was parked (C9), and nothing after it in its shard is handled before that.
//! - C4 A shard is handled by one task, in stream order: the worker holds what was
//!   delivered by stream sequence and handles the lowest first; a message released for
//!   redelivery (C3) is waited for before anything after it. An entity maps to exactly one
//!   shard (`shard_for_key(partitions, entity_id)`), so each entity's events are handled in
//!   stream order (the database's commit order) while shards run in parallel.
//! - C5 Events are decoded from the relay's headers and checked (V1–V3 in [`event`]): the
//!   `dedupe_key` is derived from the event's identity, not from `Nats-Msg-Id`, and every
//!   message must be on the shard its partition key maps to with the configured partition
//!   count. A message failing a check stops the consumer with a [`MessageError`] naming it and
//!   the fix (after the messages before it are done); it is not acknowledged.
//! - C6 Per entity, each processed event must come after those processed before it (O1–O4
//!   in [`order`]: integer ids by their ordering key, uuid and text ids by creation time
//!   and commit position); one that does not is counted ([`Stats::out_of_order`]) and
//!   logged with its outbox id and both ordering keys, never its payload, and is still
//!   processed.
//! - C7 On shutdown each shard finishes the batch in hand (a [`Handler`]'s batch ends after
//!   the event in hand: what was handled commits, the rest is not processed), ends its pull
//!   subscription, then acknowledges what committed and releases (in stream order) what it
//!   holds unhandled; its last ack is sent as a double ack and awaited (the server answers
//!   only once it processed that ack, hence every earlier one of the shard: a socket flush
//!   alone does not tell, and a connection closed with unread data may be reset and lose
//!   acks still on the wire). A restarted consumer continues where this one stopped. What a
//!   shard handled may still come again (a confirmation that did not come within
//!   [`STOP_CONFIRM`]; nats-server 2.9.10 backing out a delivery to a pull request that
//!   went away, seen about once in twenty restarts in the tests): it is recognised by its
//!   dedupe key (C1) and its handler does not run again.
//! - C8 Batches. A shard consumer has `max_ack_pending = batch_size`: at most a batch is
//!   delivered and not acknowledged. A batch is what has been delivered when the worker is
//!   ready for it (no fixed wait unless [`Config::batch_wait`]); its acks are sent pipelined
//!   after the commit (an explicit ack each; `AckAll` is not used: it would change the
//!   durable consumers' ack policy, which nats-server does not allow to update, and an ack
//!   covering messages the shard has not handled would break C1). A handler failure in a
//!   batch rolls it back; the events before the failing one commit in a transaction of their
//!   own: a [`Handler`] names its failing event, a [`BatchHandler`]'s is found by halving the
//!   failing part until one event fails alone (a half that succeeds on its retry commits).
//!   With more than one message unacknowledged, JetStream (2.9.10) delivers later messages
//!   before it redelivers an unacknowledged one once its `ack_wait` passed. So when a session
//!   starts after a process start or a lost NATS session (or a reconnect, which ends the
//!   session) and the shard consumer has messages delivered and not acknowledged, the
//!   worker handles nothing until that many messages at or below the highest stream
//!   sequence delivered before came back (also not those that came first: a released
//!   message comes back at once, one that went to a pull request of the stopped session
//!   only after `ack_wait`), or at most `max(ack_wait, retry_delay)` + 0.5 s (by then all
//!   were due again, and JetStream redelivers them lowest first); then in stream order.
//! - C9 An event whose handler failed `max_attempts` times (counted by its shard worker
//!   since it started) is decided by [`OnFailure`]: parked (the default; recorded with its
//!   dedupe key in the parked table, acknowledged, and the later events of its entity
//!   parked behind it, unhandled, until an operator re-drives or discards them: PK1–PK4 in
//!   the shard workers' docs), or the consumer stops with [`Error::Handler`] naming it,
//!   unacknowledged. Nothing is skipped silently.
//! - C10 Every event a handler handles runs inside a `tracing` span naming it
//!   (`outbox.handle`, a batch handler's call `outbox.handle_batch`); with the cargo
//!   feature `opentelemetry` the span continues the producer's W3C trace context (TR1–TR3
//!   in [`trace`]). A trace context never decides whether or how an event is handled.

mod config;
mod consumer;
pub mod error;
pub mod event;
pub mod metrics;
mod order;
pub mod trace;
pub mod transaction;
pub mod whole;

use std::future::Future;

pub use config::{Config, OnFailure, DEFAULT_BATCH_SIZE, DEFAULT_MAX_ATTEMPTS, MAX_BATCH_SIZE};
pub use consumer::{Consumer, Postgres, Stats, PARKED_POLL, STOP_CONFIRM};
pub use error::{Error, HandlerFailed, MessageError, Problem, SetupError, Unavailable};
pub use event::{percent_decode, Event};
pub use metrics::Metrics;
pub use outbox::EventId;
pub use outbox::{Keys, Position};
pub use transaction::Transaction;
pub use whole::{Broken, Transactions, WholeTransaction};

/// A handler's error: anything `?` accepts.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `sql/consumer.sql`: the `processed_events` and `parked_events` tables.
pub const SCHEMA_SQL: &str = include_str!("../sql/consumer.sql");

/// What to do with one event, inside the transaction that records its `dedupe_key`.
///
/// Write the side effects through `tx`: they commit together with the dedupe record, and
/// the message is acknowledged after that. Return an error to roll everything back and have
/// the event redelivered after a growing delay (the shard waits for it: later events of the
/// shard are not handled before it succeeds), and after `max_attempts` parked or the
/// consumer stopped (C9). SQL text run through `tx` is prepared once per connection
/// ([`transaction`]). Effects outside the database (an HTTP call, an
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

/// What to do with several events at once (for [`Consumer::run_batch`]), inside the
/// transaction that records their `dedupe_key`s: e.g. one `INSERT ... SELECT unnest(...)`
/// for all of them.
///
/// `events` are those of the batch not processed before, in stream order (an entity's
/// events in the order they were committed). As with [`Handler`], an error rolls everything
/// back; the consumer then finds the failing event by handling halves of the batch in their
/// own transactions (see the crate docs, C8), so a batch handler must not assume it always
/// sees whole pull batches.
pub trait BatchHandler: Send + Sync + 'static {
    /// Handles `events`.
    fn handle_batch(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// A shared batch handler.
impl<H: BatchHandler> BatchHandler for std::sync::Arc<H> {
    fn handle_batch(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        H::handle_batch(self, tx, events)
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
