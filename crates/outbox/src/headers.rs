//! The NATS header names every published event carries. Frozen: consumers match on them.

/// JetStream's de-duplication id: the seed's `dedupe_key`.
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
/// The outbox row's `id`.
pub const OUTBOX_ID: &str = "Outbox-Id";
/// The row's `entity_id`.
pub const OUTBOX_ENTITY_ID: &str = "Outbox-Entity-Id";
/// The row's `event_type`, exactly (the subject carries an escaped form).
pub const OUTBOX_EVENT_TYPE: &str = "Outbox-Event-Type";
/// The seed's `partition_key`.
pub const OUTBOX_PARTITION_KEY: &str = "Outbox-Partition-Key";
/// The seed's `ordering_key`.
pub const OUTBOX_ORDERING_KEY: &str = "Outbox-Ordering-Key";
/// The shard, in decimal.
pub const OUTBOX_SHARD: &str = "Outbox-Shard";
/// The commit LSN of the row's transaction, as `X/X`.
pub const OUTBOX_COMMIT_LSN: &str = "Outbox-Commit-Lsn";
/// The event's 0-based index among its transaction's outbox inserts; with the commit LSN,
/// the event's position in the commit order.
pub const OUTBOX_TX_INDEX: &str = "Outbox-Tx-Index";
/// Which slot published the message: `{system_identifier}/{database}/{slot}`. A relay
/// resumes from a stream's tail only when the tail came from its own source.
pub const OUTBOX_SOURCE: &str = "Outbox-Source";
/// On a dead-letter record: why the event itself could not be stored.
pub const OUTBOX_DEAD_LETTER_REASON: &str = "Outbox-Dead-Letter-Reason";
/// `percent` on a message whose row values are percent-encoded (`crate::encoding`): then the
/// values of `Nats-Msg-Id`, `Outbox-Entity-Id`, `Outbox-Event-Type` and
/// `Outbox-Partition-Key` must be decoded, and those of every header a column gave
/// (`--header-columns`, the trace context), and of `Outbox-Id` and `Outbox-Ordering-Key`
/// when `Outbox-Id-Kind` is present. Absent on every other message.
pub const OUTBOX_ENCODING: &str = "Outbox-Encoding";
/// `uuid` or `text` on the message of a row whose id column is not an integer
/// ([`crate::mapping::IdKind`]); absent for integer ids (the seed's table).
pub const OUTBOX_ID_KIND: &str = "Outbox-Id-Kind";

/// `1` on the last event of its transaction, when the relay published the transaction with
/// `--atomic-transactions` (the commit of its last atomic batch, or the one message after a
/// batch at the limit); absent on every other message, so its absence says nothing.
pub const OUTBOX_TX_END: &str = "Outbox-Tx-End";
/// `--atomic-transactions`: nats-server's batch headers, stored with each message of an
/// atomic batch. `Nats-Batch-Id` names the batch, `Nats-Batch-Sequence` is the message's
/// place in it (1, 2, …), and `Nats-Batch-Commit: 1` is on its last message.
pub const NATS_BATCH_ID: &str = "Nats-Batch-Id";
/// See [`NATS_BATCH_ID`].
pub const NATS_BATCH_SEQUENCE: &str = "Nats-Batch-Sequence";
/// See [`NATS_BATCH_ID`].
pub const NATS_BATCH_COMMIT: &str = "Nats-Batch-Commit";
/// Whether a header named `name` is one of the relay's own (`Nats-*` or `Outbox-*`, any
/// case), as opposed to one a column gave.
pub fn is_relay_header(name: &str) -> bool {
    let lower = |n: usize| name.get(..n).map(str::to_ascii_lowercase);
    lower(5).as_deref() == Some("nats-") || lower(7).as_deref() == Some("outbox-")
}
