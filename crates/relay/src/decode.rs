//! From replication messages to sink items: transaction framing, the outbox table's
//! relation (and its partitions'), and the events of their INSERTs.
//!
//! # Invariants
//! - D1 Items keep replication order; every `Event` sits between the `Begin` and `Commit`
//!   of its transaction, and carries its position: that transaction's commit LSN
//!   (`Begin.final_lsn`) and its index among the transaction's outbox inserts.
//! - D2 Only INSERTs into the configured table become events; UPDATE, DELETE, TRUNCATE and
//!   other tables' changes produce nothing (their transactions still frame, so their
//!   positions are confirmed). The configured table is matched by namespace and name.
//! - D3 A keepalive's WAL end becomes an `Idle` position only outside a transaction.
//! - D4 A row that cannot become a faithful event, or a table whose shape changed so that it
//!   cannot be read, is a permanent error naming the row or the columns: never skipped.
//! - D5 An INSERT into a partition of the configured table is an INSERT into the table, even
//!   when it arrives under the partition's own relation. The relay's publication publishes
//!   partitions as the root (`publish_via_partition_root`, checked at every session start),
//!   but pgoutput decodes each transaction with the catalog of its commit, so a transaction
//!   committed before the publication had that option arrives under its partition's name.
//!   Such an insert is relayed like any other (its columns resolved by name from the
//!   partition's own `Relation`, which has the table's columns), when the partition is one
//!   (at any level) as of the session's start ([`KnownRelations::partitions`], matched by
//!   relation id, so renames do not matter).
//! - D6 An INSERT under any other relation that has the outbox table's columns, and that
//!   the publication does not publish now, may be a partition detached or dropped since (or
//!   attached after the session started): it is a permanent error naming the relation, the
//!   transaction and the ways forward, never skipped. Relations without the outbox table's
//!   columns cannot be its partitions and fall under D2, as do the other tables the
//!   publication publishes now.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;

use outbox::{EventBuilder, OutboxColumns, Position};
use pgoutput::copy_data::PgTimestamp;
use pgoutput::logical::LogicalMessage;
use pgoutput::{Lsn, Relation, ReplicationMessage};
use replication::quote_identifier;
use sink::SinkItem;
use tracing::warn;

use crate::config::TableName;
use crate::error::{RelayError, Result};

/// What a session's start learned about the relations whose inserts may arrive (D5, D6).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownRelations {
    /// The publication the session streams.
    pub publication: String,
    /// Relation ids of the outbox table's partitions, at any level.
    pub partitions: HashSet<u32>,
    /// Relation ids of what the publication publishes besides the outbox table and its
    /// partitions (with their own partitions).
    pub others: HashSet<u32>,
}

/// What the inserts of one relation become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Events of the outbox table (D2): the table itself.
    Table,
    /// Events of the outbox table (D5): one of its partitions, under its own name.
    Partition,
    /// Nothing (D2).
    Ignore,
    /// A permanent error (D6): it has the outbox table's columns but is neither the table,
    /// a known partition, nor published now.
    Unknown,
}

/// Where the inserts of `relation` go (D2, D5, D6).
pub fn route(relation: &Relation, table: &TableName, known: &KnownRelations) -> Route {
    if relation.namespace == table.schema && relation.name == table.name {
        Route::Table
    } else if known.partitions.contains(&relation.rel_id) {
        Route::Partition
    } else if known.others.contains(&relation.rel_id)
        || OutboxColumns::from_relation(relation).is_err()
    {
        Route::Ignore
    } else {
        Route::Unknown
    }
}

/// A relation whose inserts the session has seen announced.
#[derive(Debug)]
enum Routed {
    /// Its inserts are events built by this builder; `partition` names a partition (D5)
    /// whose first insert is logged.
    Events {
        builder: EventBuilder,
        partition: Option<String>,
    },
    /// A partition whose Relation lacks a column the relay reads (D4; with
    /// `publish_via_partition_root` a partition's Relation is sent but its inserts arrive as
    /// the table's, so only an insert under its own name is an error).
    Unreadable(String),
    /// Its inserts are a permanent error (D6).
    Unknown(TableName),
}

/// Decoding state of one replication session.
#[derive(Debug)]
pub struct Decoder {
    table: TableName,
    prefix: String,
    partitions: NonZeroU64,
    known: KnownRelations,
    /// The relations whose inserts matter, by relation id, once their Relation message came.
    relations: HashMap<u32, Routed>,
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
    /// A decoder for `table`, knowing no partitions: see [`Decoder::with_relations`].
    pub fn new(table: TableName, prefix: String, partitions: NonZeroU64) -> Self {
        Self {
            table,
            prefix,
            partitions,
            known: KnownRelations::default(),
            relations: HashMap::new(),
            open_commit_lsn: None,
            next_index: 0,
            first_commit_time: None,
            open_commit_time: 0,
            last_idle: Lsn::ZERO,
        }
    }

    /// The decoder, told what the session's start learned about the relations (D5, D6).
    pub fn with_relations(mut self, known: KnownRelations) -> Self {
        self.known = known;
        self
    }

    /// Routes a relation's later inserts (D2, D4, D5, D6); a Relation message replaces what
    /// an earlier one for the same id said.
    fn on_relation(&mut self, relation: &Relation) -> Result<()> {
        let route = route(relation, &self.table, &self.known);
        let routed = match route {
            Route::Ignore => {
                self.relations.remove(&relation.rel_id);
                return Ok(());
            }
            Route::Unknown => Routed::Unknown(TableName {
                schema: relation.namespace.clone(),
                name: relation.name.clone(),
            }),
            Route::Table | Route::Partition => match OutboxColumns::from_relation(relation) {
                Ok(columns) => Routed::Events {
                    builder: EventBuilder::new(columns, self.prefix.clone(), self.partitions),
                    partition: (route == Route::Partition)
                        .then(|| format!("{}.{}", relation.namespace, relation.name)),
                },
                Err(error) if route == Route::Table => return Err(changed(error)),
                Err(error) => Routed::Unreadable(error.to_string()),
            },
        };
        self.relations.insert(relation.rel_id, routed);
        Ok(())
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
            LogicalMessage::Relation(relation) => self.on_relation(&relation)?,
            LogicalMessage::Insert(insert) => {
                let Some(routed) = self.relations.get_mut(&insert.rel_id) else {
                    return Ok(());
                };
                let commit_lsn = self
                    .open_commit_lsn
                    .ok_or_else(|| protocol("Insert with no transaction open".to_owned()))?;
                let builder = match routed {
                    Routed::Events { builder, partition } => {
                        if let Some(name) = partition.take() {
                            warn!(
                                partition = %name,
                                table = %self.table,
                                commit_lsn = %commit_lsn,
                                "inserts into a partition arrive under the partition's own name (committed while the publication lacked publish_via_partition_root); relaying them as inserts into the table"
                            );
                        }
                        &*builder
                    }
                    Routed::Unreadable(error) => return Err(changed(error)),
                    Routed::Unknown(relation) => {
                        return Err(unknown_relation(
                            relation,
                            &self.table,
                            &self.known,
                            commit_lsn,
                        ))
                    }
                };
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

/// D4: the table's (or a partition's) Relation lacks a column the relay reads.
fn changed(error: impl std::fmt::Display) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(
        "the outbox table changed while streaming (or a column list of the publication hid a \
         column when the transaction committed): {error}"
    ))
}

/// D6: an insert into `relation`, which has the outbox table's columns but is neither the
/// table, a partition of it known at the session's start, nor published by the publication.
fn unknown_relation(
    relation: &TableName,
    table: &TableName,
    known: &KnownRelations,
    commit_lsn: Lsn,
) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(
        "an insert into {relation}, in the transaction committed at {commit_lsn}, arrived under \
         its own name: {relation} has the columns of the outbox table {table} but is neither a \
         partition of it (as of this session's start) nor a table publication {publication:?} \
         publishes, so it may be a partition of {table} detached or dropped since (its inserts \
         committed before the publication had publish_via_partition_root = true), or one \
         attached after the session started. The relay stops rather than skip it: if \
         {relation} is a partition of {table} now, restart the relay; if it was one, attach it \
         again (ALTER TABLE {table_sql} ATTACH PARTITION {relation_sql} FOR VALUES …) and \
         restart; if it never was, publish it too (ALTER PUBLICATION {publication_sql} ADD \
         TABLE {relation_sql};) and restart; if it was dropped, its events can only be skipped \
         deliberately, with the rest of its transaction, by advancing the slot past \
         {commit_lsn} (pg_replication_slot_advance)",
        publication = known.publication,
        publication_sql = quote_identifier(&known.publication),
        table_sql = table.to_sql(),
        relation_sql = relation.to_sql(),
    ))
}

fn protocol(message: String) -> RelayError {
    RelayError::transient(anyhow::anyhow!("replication protocol violation: {message}"))
}

#[cfg(test)]
mod tests {
    use outbox::event::oid;
    use pgoutput::logical::Column;
    use pgoutput::Relation;

    use super::{route, KnownRelations, Route};
    use crate::config::TableName;

    fn relation(rel_id: u32, name: &str, columns: &[(&str, u32)]) -> Relation {
        Relation {
            rel_id,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: b'd',
            columns: columns
                .iter()
                .map(|(name, type_oid)| Column {
                    flags: 0,
                    name: (*name).into(),
                    type_oid: *type_oid,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    /// The outbox table's columns, in another order than the table's (as a partition
    /// attached from a table of its own may have them).
    const OUTBOX: [(&str, u32); 6] = [
        ("created_at", oid::TIMESTAMPTZ),
        ("id", oid::INT8),
        ("status", oid::TEXT),
        ("entity_id", oid::TEXT),
        ("event_type", oid::TEXT),
        ("payload", oid::JSONB),
    ];

    #[test]
    fn inserts_into_the_table_and_its_partitions_are_events_and_unknown_lookalikes_stop() {
        let table = TableName {
            schema: "public".into(),
            name: "outbox_events".into(),
        };
        let known = KnownRelations {
            publication: "p".into(),
            partitions: [11, 12].into(),
            others: [20, 21].into(),
        };
        let cases = [
            // D2: the table by name, whatever its relation id.
            (relation(10, "outbox_events", &OUTBOX), Route::Table),
            (relation(99, "outbox_events", &OUTBOX), Route::Table),
            // D5: a partition by relation id, whatever its name (renamed since).
            (
                relation(11, "outbox_events_2024", &OUTBOX),
                Route::Partition,
            ),
            (relation(12, "renamed", &OUTBOX), Route::Partition),
            // D2: what the publication publishes besides, outbox-shaped or not.
            (relation(20, "other_outbox", &OUTBOX), Route::Ignore),
            (
                relation(21, "orders", &[("id", oid::INT8), ("total", oid::INT8)]),
                Route::Ignore,
            ),
            // Not outbox-shaped: cannot be a partition of the table.
            (
                relation(30, "dropped_since", &[("id", oid::INT8)]),
                Route::Ignore,
            ),
            // D6: outbox-shaped, unknown: a partition detached or dropped since, perhaps.
            (relation(31, "outbox_events_2019", &OUTBOX), Route::Unknown),
        ];
        for (relation, expected) in cases {
            assert_eq!(
                route(&relation, &table, &known),
                expected,
                "{}",
                relation.name
            );
        }
        let other_schema = Relation {
            namespace: "archive".into(),
            ..relation(10, "outbox_events", &OUTBOX)
        };
        assert_eq!(route(&other_schema, &table, &known), Route::Unknown);
    }
}
