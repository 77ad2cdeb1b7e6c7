//! From replication messages to sink items: transaction framing, the outbox table's
//! relation, and the events of its INSERTs.
//!
//! # Invariants
//! - D1 Items keep replication order; every `Event` sits between the `Begin` and `Commit`
//!   of its transaction, and carries its position: that transaction's commit LSN
//!   (`Begin.final_lsn`) and its index among the transaction's outbox inserts.
//! - D2 Only INSERTs into the configured table become events; UPDATE, DELETE, TRUNCATE and
//!   other tables' changes produce nothing (their transactions still frame, so their
//!   positions are confirmed).
//! - D3 A keepalive's WAL end becomes an `Idle` position only outside a transaction.
//! - D4 A row that cannot become a faithful event, or a table whose shape changed so that it
//!   cannot be read, is a permanent error naming the row or the columns: never skipped.

use std::num::NonZeroU64;

use outbox::{EventBuilder, OutboxColumns, Position};
use pgoutput::copy_data::PgTimestamp;
use pgoutput::logical::LogicalMessage;
use pgoutput::{Lsn, ReplicationMessage};
use sink::SinkItem;

use crate::config::TableName;
use crate::error::{RelayError, Result};

/// Decoding state of one replication session.
#[derive(Debug)]
pub struct Decoder {
    table: TableName,
    prefix: String,
    partitions: NonZeroU64,
    /// The outbox table's relation id and event builder, once its Relation message came.
    outbox: Option<(u32, EventBuilder)>,
    /// The commit LSN of the open transaction.
    open_commit_lsn: Option<Lsn>,
    /// The index the next outbox insert of the open transaction gets.
    next_index: u32,
    /// Commit time of the first transaction with events in this session (the oldest event
    /// a session may replay; see the dedupe-window guard).
    pub first_commit_time: Option<PgTimestamp>,
    open_commit_time: PgTimestamp,
    last_idle: Lsn,
}

impl Decoder {
    /// A decoder for `table`.
    pub fn new(table: TableName, prefix: String, partitions: NonZeroU64) -> Self {
        Self {
            table,
            prefix,
            partitions,
            outbox: None,
            open_commit_lsn: None,
            next_index: 0,
            first_commit_time: None,
            open_commit_time: 0,
            last_idle: Lsn::ZERO,
        }
    }

    /// Decodes one message, appending what it yields to `out`.
    pub fn on_message(
        &mut self,
        message: ReplicationMessage,
        out: &mut Vec<SinkItem<Lsn>>,
    ) -> Result<()> {
        match message {
            ReplicationMessage::PrimaryKeepalive(keepalive) => {
                if self.open_commit_lsn.is_none() && keepalive.wal_end_lsn > self.last_idle {
                    self.last_idle = keepalive.wal_end_lsn;
                    out.push(SinkItem::Idle(keepalive.wal_end_lsn));
                }
                Ok(())
            }
            ReplicationMessage::XLogData(data) => {
                let message = LogicalMessage::decode(data.data).map_err(|e| {
                    RelayError::permanent(anyhow::anyhow!(
                        "cannot decode the pgoutput message at {}: {e} (is the slot's plugin pgoutput, protocol version 1?)",
                        data.wal_start_lsn
                    ))
                })?;
                self.on_logical(message, out)
            }
        }
    }

    fn on_logical(&mut self, message: LogicalMessage, out: &mut Vec<SinkItem<Lsn>>) -> Result<()> {
        match message {
            LogicalMessage::Begin(begin) => {
                if let Some(open) = self.open_commit_lsn {
                    return Err(protocol(format!(
                        "Begin of {} while the transaction of {open} is open",
                        begin.final_lsn
                    )));
                }
                self.open_commit_lsn = Some(begin.final_lsn);
                self.open_commit_time = begin.commit_time;
                self.next_index = 0;
                out.push(SinkItem::Begin);
            }
            LogicalMessage::Commit(commit) => {
                if self.open_commit_lsn.take().is_none() {
                    return Err(protocol(format!(
                        "Commit of {} with no transaction open",
                        commit.commit_lsn
                    )));
                }
                out.push(SinkItem::Commit(commit.end_lsn));
            }
            LogicalMessage::Relation(relation) => {
                if relation.namespace == self.table.schema && relation.name == self.table.name {
                    let columns = OutboxColumns::from_relation(&relation).map_err(|e| {
                        RelayError::permanent(anyhow::anyhow!(
                            "the outbox table changed while streaming: {e}"
                        ))
                    })?;
                    let builder = EventBuilder::new(columns, self.prefix.clone(), self.partitions);
                    self.outbox = Some((relation.rel_id, builder));
                }
            }
            LogicalMessage::Insert(insert) => {
                let Some((rel_id, builder)) = &self.outbox else {
                    return Ok(());
                };
                if insert.rel_id != *rel_id {
                    return Ok(());
                }
                let commit_lsn = self
                    .open_commit_lsn
                    .ok_or_else(|| protocol("Insert with no transaction open".to_owned()))?;
                let position = Position {
                    commit_lsn,
                    index: self.next_index,
                };
                self.next_index += 1;
                self.first_commit_time.get_or_insert(self.open_commit_time);
                let event = builder.build(&insert.new_tuple, position).map_err(|e| {
                    RelayError::permanent(anyhow::anyhow!(
                        "{e}; the relay stops here so that nothing after it is confirmed (fix or \
                         delete the row's transaction's effects, or see docs/guarantees.md)"
                    ))
                })?;
                out.push(SinkItem::Event(event));
            }
            LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Origin(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Message(_) => {}
        }
        Ok(())
    }
}

fn protocol(message: String) -> RelayError {
    RelayError::transient(anyhow::anyhow!("replication protocol violation: {message}"))
}
