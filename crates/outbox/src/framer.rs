//! From replication messages to the items the sink publishes: transaction framing, the
//! outbox table's relation (and its partitions'), and the events of their INSERTs. Pure and
//! synchronous: the reader feeds it decoded messages, it appends [`Item`]s, and every
//! failure is a [`FrameError`] that says whether a new session can get further.
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
//! - D7 A protocol violation (a Begin inside a transaction, a Commit or Insert outside one)
//!   is transient: the session is dropped and replayed from the confirmed position. Every
//!   other error is permanent and names what to fix.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::num::NonZeroU64;

use pgoutput::copy_data::PgTimestamp;
use pgoutput::logical::{Begin, Commit, Insert, LogicalMessage};
use pgoutput::{Lsn, Relation, ReplicationMessage};

use crate::event::{EventBuilder, EventError, OutboxColumns, OutboxEvent, Position, Shape};
use crate::mapping::Mapping;

/// What the framer hands on, in replication order (D1).
// Events dominate the stream and travel in batches (`Vec<Item>`); boxing them would add an
// allocation per event on the hot path to shrink the rare marker variants.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Item<P> {
    /// A transaction starts; it committed at `commit_time_us` (the server's clock, in
    /// microseconds since the Unix epoch: pgoutput's Begin), which travels with it so that
    /// the sink can time commit → stored once per transaction.
    Begin {
        /// The transaction's commit time, microseconds since the Unix epoch.
        commit_time_us: i64,
    },
    /// An outbox row of the open transaction.
    Event(OutboxEvent),
    /// The open transaction committed; `P` is its end position.
    Commit(P),
    /// A position reached with no transaction open (a keepalive's WAL end, D3).
    Idle(P),
}

/// `schema.table`, both parts verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    /// The schema.
    pub schema: String,
    /// The table.
    pub name: String,
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// Why the framer stopped (D4, D6, D7).
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// A replication message that is not pgoutput v1.
    #[error("cannot decode the pgoutput message at {at}: {source} (is the slot's plugin pgoutput, protocol version 1?)")]
    Decode {
        /// Where it started.
        at: Lsn,
        /// What the decoder found.
        source: pgoutput::DecodeError,
    },
    /// Messages out of the protocol's order (D7).
    #[error("replication protocol violation: {0}")]
    Protocol(String),
    /// The table's (or a partition's) Relation lacks a column the relay reads (D4).
    #[error("the outbox table changed while streaming (or a column list of the publication hid a column when the transaction committed): {0}")]
    TableChanged(String),
    /// A row from which no faithful event can be built (D4).
    #[error("{0}; the relay stops here so that nothing after it is confirmed (fix or delete the row's transaction's effects, or see docs/guarantees.md)")]
    Row(#[from] EventError),
    /// An insert under a relation that has the outbox table's columns but is neither the
    /// table, a known partition, nor published (D6).
    #[error("an insert into {}, in the transaction committed at {}, arrived under its own name: it has the columns of the outbox table {} but is neither a partition of it (as of this session's start) nor a table publication {:?} publishes", .0.relation, .0.commit_lsn, .0.table, .0.publication)]
    UnknownRelation(Box<UnplacedInsert>),
}

/// An insert the framer cannot place (D6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnplacedInsert {
    /// The relation the insert arrived under.
    pub relation: TableName,
    /// The outbox table.
    pub table: TableName,
    /// The session's publication.
    pub publication: String,
    /// The transaction's commit LSN.
    pub commit_lsn: Lsn,
}

impl FrameError {
    /// Whether a new session, replaying from the confirmed position, can get further (D7).
    pub fn is_transient(&self) -> bool {
        matches!(self, FrameError::Protocol(_))
    }
}

/// Something worth telling the operator that is not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The first insert that arrived under a partition's own name (D5): committed while the
    /// publication lacked `publish_via_partition_root`, relayed as an insert into the table.
    PartitionInsert {
        /// The partition.
        partition: String,
        /// Its transaction's commit LSN.
        commit_lsn: Lsn,
    },
}

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
pub fn route(
    relation: &Relation,
    table: &TableName,
    known: &KnownRelations,
    mapping: &Mapping,
) -> Route {
    if relation.namespace == table.schema && relation.name == table.name {
        Route::Table
    } else if known.partitions.contains(&relation.rel_id) {
        Route::Partition
    } else if known.others.contains(&relation.rel_id)
        || OutboxColumns::from_relation_mapped(relation, mapping).is_err()
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
        builder: Box<EventBuilder>,
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
pub struct Framer {
    table: TableName,
    shape: Shape,
    mapping: Mapping,
    /// Inserts whose event type the mapping's filter excludes (MAP4): confirmed with their
    /// transactions, never published.
    pub excluded: u64,
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
    /// What the operator should hear about, drained with [`Framer::take_notices`].
    notices: Vec<Notice>,
    open_commit_time: PgTimestamp,
    last_idle: Lsn,
    /// The end of the last transaction or idle position framed.
    received: Lsn,
}

impl Framer {
    /// A framer for `table`, knowing no partitions: see [`Framer::with_relations`].
    pub fn new(table: TableName, prefix: String, partitions: NonZeroU64) -> Self {
        Self {
            table,
            shape: Shape::new(prefix, partitions),
            mapping: Mapping::default(),
            excluded: 0,
            known: KnownRelations::default(),
            relations: HashMap::new(),
            open_commit_lsn: None,
            next_index: 0,
            first_commit_time: None,
            notices: Vec::new(),
            open_commit_time: 0,
            last_idle: Lsn::ZERO,
            received: Lsn::ZERO,
        }
    }

    /// The framer reading the user's table through `mapping` (its template and filter too).
    pub fn with_mapping(mut self, mapping: Mapping) -> Self {
        self.shape.template = mapping.template.clone();
        self.mapping = mapping;
        self
    }

    /// The framer giving every event the CloudEvents attributes `cloudevents` says
    /// ([`crate::cloudevents`]), if any.
    pub fn with_cloudevents(
        mut self,
        cloudevents: Option<crate::cloudevents::CloudEvents>,
    ) -> Self {
        self.shape.cloudevents = cloudevents;
        self
    }

    /// The framer, told what the session's start learned about the relations (D5, D6).
    pub fn with_relations(mut self, known: KnownRelations) -> Self {
        self.known = known;
        self
    }

    /// Routes a relation's later inserts (D2, D4, D5, D6); a Relation message replaces what
    /// an earlier one for the same id said.
    fn on_relation(&mut self, relation: &Relation) -> Result<(), FrameError> {
        let route = route(relation, &self.table, &self.known, &self.mapping);
        let routed = match route {
            Route::Ignore => {
                self.relations.remove(&relation.rel_id);
                return Ok(());
            }
            Route::Unknown => Routed::Unknown(TableName {
                schema: relation.namespace.clone(),
                name: relation.name.clone(),
            }),
            Route::Table | Route::Partition => {
                match OutboxColumns::from_relation_mapped(relation, &self.mapping) {
                    Ok(columns) => Routed::Events {
                        builder: Box::new(EventBuilder::shaped(
                            columns,
                            self.shape.clone(),
                            self.mapping.filter.clone(),
                        )),
                        partition: (route == Route::Partition)
                            .then(|| format!("{}.{}", relation.namespace, relation.name)),
                    },
                    Err(error) if route == Route::Table => {
                        return Err(FrameError::TableChanged(error.to_string()))
                    }
                    Err(error) => Routed::Unreadable(error.to_string()),
                }
            }
        };
        self.relations.insert(relation.rel_id, routed);
        Ok(())
    }

    /// How far the stream has been framed: the end of the last transaction (its commit's
    /// `end_lsn`) or idle position handed on; `0/0` before the first.
    pub fn received(&self) -> Lsn {
        self.received
    }

    /// Notices since the last call (rare: a `Vec` that stays empty costs nothing).
    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// Decodes one message, appending what it yields to `out`.
    pub fn on_message(
        &mut self,
        message: ReplicationMessage,
        out: &mut Vec<Item<Lsn>>,
    ) -> Result<(), FrameError> {
        match message {
            ReplicationMessage::PrimaryKeepalive(keepalive) => {
                if self.open_commit_lsn.is_none() && keepalive.wal_end_lsn > self.last_idle {
                    self.last_idle = keepalive.wal_end_lsn;
                    self.received = self.received.max(keepalive.wal_end_lsn);
                    out.push(Item::Idle(keepalive.wal_end_lsn));
                }
                Ok(())
            }
            ReplicationMessage::XLogData(data) => {
                let message =
                    LogicalMessage::decode(data.data).map_err(|source| FrameError::Decode {
                        at: data.wal_start_lsn,
                        source,
                    })?;
                self.on_logical(message, out)
            }
        }
    }

    fn on_logical(
        &mut self,
        message: LogicalMessage,
        out: &mut Vec<Item<Lsn>>,
    ) -> Result<(), FrameError> {
        match message {
            LogicalMessage::Begin(begin) => self.on_begin(&begin, out),
            LogicalMessage::Commit(commit) => self.on_commit(&commit, out),
            LogicalMessage::Relation(relation) => self.on_relation(&relation),
            LogicalMessage::Insert(insert) => self.on_insert(&insert, out),
            LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Origin(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Message(_) => Ok(()),
        }
    }

    /// A transaction opens (none may be open): its events are numbered from 0.
    #[inline]
    fn on_begin(&mut self, begin: &Begin, out: &mut Vec<Item<Lsn>>) -> Result<(), FrameError> {
        if let Some(open) = self.open_commit_lsn {
            return Err(protocol(format!(
                "Begin of {} while the transaction of {open} is open",
                begin.final_lsn
            )));
        }
        self.open_commit_lsn = Some(begin.final_lsn);
        self.open_commit_time = begin.commit_time;
        self.next_index = 0;
        out.push(Item::Begin {
            commit_time_us: begin.commit_time.saturating_add(PG_EPOCH_UNIX_US),
        });
        Ok(())
    }

    /// The open transaction ends at its `end_lsn`.
    #[inline]
    fn on_commit(&mut self, commit: &Commit, out: &mut Vec<Item<Lsn>>) -> Result<(), FrameError> {
        if self.open_commit_lsn.take().is_none() {
            return Err(protocol(format!(
                "Commit of {} with no transaction open",
                commit.commit_lsn
            )));
        }
        self.received = self.received.max(commit.end_lsn);
        out.push(Item::Commit(commit.end_lsn));
        Ok(())
    }

    /// An insert into a relation of the publication: an event of the outbox table (or its
    /// partition: noticed once), at the next position of the open transaction; a relation
    /// that cannot be read or placed is an error; others are not the outbox's.
    #[inline]
    fn on_insert(&mut self, insert: &Insert, out: &mut Vec<Item<Lsn>>) -> Result<(), FrameError> {
        let Some(routed) = self.relations.get_mut(&insert.rel_id) else {
            return Ok(());
        };
        let commit_lsn = self
            .open_commit_lsn
            .ok_or_else(|| protocol("Insert with no transaction open".to_owned()))?;
        let builder = match routed {
            Routed::Events { builder, partition } => {
                if let Some(partition) = partition.take() {
                    self.notices.push(Notice::PartitionInsert {
                        partition,
                        commit_lsn,
                    });
                }
                &*builder
            }
            Routed::Unreadable(error) => return Err(FrameError::TableChanged(error.clone())),
            Routed::Unknown(relation) => {
                return Err(FrameError::UnknownRelation(Box::new(UnplacedInsert {
                    relation: relation.clone(),
                    table: self.table.clone(),
                    publication: self.known.publication.clone(),
                    commit_lsn,
                })))
            }
        };
        let position = Position {
            commit_lsn,
            index: self.next_index,
        };
        match builder.build(&insert.new_tuple, position)? {
            Some(event) => {
                self.next_index += 1;
                self.first_commit_time.get_or_insert(self.open_commit_time);
                out.push(Item::Event(event));
            }
            None => self.excluded += 1,
        }
        Ok(())
    }
}

/// Postgres timestamps count microseconds from 2000-01-01 UTC: this many after the Unix epoch.
const PG_EPOCH_UNIX_US: i64 = 946_684_800_000_000;

fn protocol(message: String) -> FrameError {
    FrameError::Protocol(message)
}

#[cfg(test)]
mod tests {
    use pgoutput::logical::Column;
    use pgoutput::Relation;

    use super::{route, KnownRelations, Route, TableName};
    use crate::event::oid;

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
                route(
                    &relation,
                    &table,
                    &known,
                    &crate::mapping::Mapping::default()
                ),
                expected,
                "{}",
                relation.name
            );
        }
        let other_schema = Relation {
            namespace: "archive".into(),
            ..relation(10, "outbox_events", &OUTBOX)
        };
        assert_eq!(
            route(
                &other_schema,
                &table,
                &known,
                &crate::mapping::Mapping::default()
            ),
            Route::Unknown
        );
    }
}

/// The framer on pgoutput v1 bytes encoded here, message by message, one test per rule.
#[cfg(test)]
mod rules {
    #![allow(clippy::unwrap_used)]

    use std::num::NonZeroU64;

    use bytes::{BufMut, BytesMut};
    use pgoutput::{Lsn, PrimaryKeepalive, ReplicationMessage, XLogData};

    use super::*;
    use crate::event::oid;

    const TABLE: u32 = 16_400;
    const PARTITION: u32 = 16_401;
    const OTHER: u32 = 16_500;

    fn framer() -> Framer {
        Framer::new(
            TableName {
                schema: "public".into(),
                name: "outbox_events".into(),
            },
            "outbox".into(),
            NonZeroU64::new(12).unwrap(),
        )
        .with_relations(KnownRelations {
            publication: "outbox_relay".into(),
            partitions: [PARTITION].into(),
            others: [].into(),
        })
    }

    fn xlog(data: BytesMut) -> ReplicationMessage {
        ReplicationMessage::XLogData(XLogData {
            wal_start_lsn: Lsn(1),
            wal_end_lsn: Lsn(1),
            send_time: 0,
            data: data.freeze(),
        })
    }

    fn begin(final_lsn: u64) -> ReplicationMessage {
        let mut b = BytesMut::new();
        b.put_u8(b'B');
        b.put_u64(final_lsn);
        b.put_i64(0);
        b.put_u32(7);
        xlog(b)
    }

    fn commit(commit_lsn: u64, end_lsn: u64) -> ReplicationMessage {
        let mut b = BytesMut::new();
        b.put_u8(b'C');
        b.put_u8(0);
        b.put_u64(commit_lsn);
        b.put_u64(end_lsn);
        b.put_i64(0);
        xlog(b)
    }

    fn cstr(b: &mut BytesMut, s: &str) {
        b.put_slice(s.as_bytes());
        b.put_u8(0);
    }

    /// The seed's table: id, entity_id, event_type, payload, created_at.
    fn relation(rel_id: u32, name: &str, with_payload: bool) -> ReplicationMessage {
        let mut columns = vec![
            ("id", oid::INT8),
            ("entity_id", oid::TEXT),
            ("event_type", oid::TEXT),
            ("created_at", oid::TIMESTAMPTZ),
        ];
        if with_payload {
            columns.push(("payload", oid::JSONB));
        }
        let mut b = BytesMut::new();
        b.put_u8(b'R');
        b.put_u32(rel_id);
        cstr(&mut b, "public");
        cstr(&mut b, name);
        b.put_u8(b'd');
        b.put_u16(columns.len() as u16);
        for (name, type_oid) in columns {
            b.put_u8(0);
            cstr(&mut b, name);
            b.put_u32(type_oid);
            b.put_i32(-1);
        }
        xlog(b)
    }

    fn tuple(b: &mut BytesMut, values: &[Option<&str>]) {
        b.put_u8(b'N');
        b.put_u16(values.len() as u16);
        for value in values {
            match value {
                Some(text) => {
                    b.put_u8(b't');
                    b.put_i32(text.len() as i32);
                    b.put_slice(text.as_bytes());
                }
                None => b.put_u8(b'n'),
            }
        }
    }

    fn row(id: i64, entity_id: Option<&str>) -> Vec<Option<String>> {
        vec![
            Some(id.to_string()),
            entity_id.map(str::to_owned),
            Some("OrderPaid".into()),
            Some("2024-05-01 12:00:00.123+00".into()),
            Some("{}".into()),
        ]
    }

    fn insert(rel_id: u32, values: Vec<Option<String>>) -> ReplicationMessage {
        let values: Vec<Option<&str>> = values.iter().map(Option::as_deref).collect();
        let mut b = BytesMut::new();
        b.put_u8(b'I');
        b.put_u32(rel_id);
        tuple(&mut b, &values);
        xlog(b)
    }

    fn update(rel_id: u32, id: i64) -> ReplicationMessage {
        let values = row(id, Some("e"));
        let values: Vec<Option<&str>> = values.iter().map(Option::as_deref).collect();
        let mut b = BytesMut::new();
        b.put_u8(b'U');
        b.put_u32(rel_id);
        tuple(&mut b, &values);
        xlog(b)
    }

    fn truncate(rel_id: u32) -> ReplicationMessage {
        let mut b = BytesMut::new();
        b.put_u8(b'T');
        b.put_u32(1);
        b.put_u8(0);
        b.put_u32(rel_id);
        xlog(b)
    }

    fn keepalive(wal_end: u64) -> ReplicationMessage {
        ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
            wal_end_lsn: Lsn(wal_end),
            send_time: 0,
            reply_requested: false,
        })
    }

    /// Feeds `messages`; returns the items as short strings, or the first error.
    fn run(
        framer: &mut Framer,
        messages: Vec<ReplicationMessage>,
    ) -> Result<Vec<String>, FrameError> {
        let mut out = Vec::new();
        for message in messages {
            framer.on_message(message, &mut out)?;
        }
        Ok(out
            .into_iter()
            .map(|item| match item {
                Item::Begin { .. } => "begin".to_owned(),
                Item::Event(e) => format!(
                    "event {} at {}/{}",
                    e.id, e.position.commit_lsn, e.position.index
                ),
                Item::Commit(end) => format!("commit {end}"),
                Item::Idle(at) => format!("idle {at}"),
            })
            .collect())
    }

    #[test]
    fn d1_events_keep_replication_order_inside_their_transaction_with_their_position() {
        let items = run(
            &mut framer(),
            vec![
                relation(TABLE, "outbox_events", true),
                begin(0x100),
                insert(TABLE, row(2, Some("a"))),
                insert(TABLE, row(1, Some("b"))),
                commit(0x100, 0x108),
                begin(0x200),
                insert(TABLE, row(3, Some("a"))),
                commit(0x200, 0x208),
            ],
        )
        .unwrap();
        assert_eq!(
            items,
            [
                "begin",
                "event 2 at 0/100/0",
                "event 1 at 0/100/1",
                "commit 0/108",
                "begin",
                "event 3 at 0/200/0",
                "commit 0/208"
            ]
        );
    }

    /// The commit time travels with the Begin (for the sink's latency metrics), and
    /// `received` follows the transactions and idle positions framed.
    #[test]
    fn begin_carries_the_unix_commit_time_and_received_follows_commits_and_idle_positions() {
        let mut framer = framer();
        let mut out = Vec::new();
        framer.on_message(begin(0x100), &mut out).unwrap();
        // The helper's Begin says 2000-01-01 00:00:00 UTC, Postgres' epoch.
        assert!(
            matches!(
                out[..],
                [Item::Begin {
                    commit_time_us: 946_684_800_000_000
                }]
            ),
            "{out:?}"
        );
        assert_eq!(framer.received(), Lsn::ZERO, "nothing complete yet");
        framer.on_message(commit(0x100, 0x108), &mut out).unwrap();
        assert_eq!(framer.received(), Lsn(0x108));
        framer.on_message(keepalive(0x200), &mut out).unwrap();
        assert_eq!(framer.received(), Lsn(0x200));
    }

    #[test]
    fn d2_only_inserts_into_the_table_become_events_and_other_transactions_still_frame() {
        let items = run(
            &mut framer(),
            vec![
                relation(TABLE, "outbox_events", true),
                begin(0x100),
                update(TABLE, 1),
                truncate(TABLE),
                insert(OTHER, row(9, Some("x"))),
                commit(0x100, 0x108),
            ],
        )
        .unwrap();
        assert_eq!(items, ["begin", "commit 0/108"]);
    }

    #[test]
    fn d3_a_keepalive_is_an_idle_position_only_outside_a_transaction() {
        let items = run(
            &mut framer(),
            vec![
                keepalive(0x50),
                keepalive(0x50),
                begin(0x100),
                keepalive(0x90),
                commit(0x100, 0x108),
                keepalive(0x110),
            ],
        )
        .unwrap();
        assert_eq!(
            items,
            ["idle 0/50", "begin", "commit 0/108", "idle 0/110"],
            "repeated and in-transaction keepalives add nothing"
        );
    }

    #[test]
    fn d4_an_unreadable_row_or_table_is_a_permanent_error_naming_it() {
        let error = run(
            &mut framer(),
            vec![
                relation(TABLE, "outbox_events", true),
                begin(0x100),
                insert(TABLE, row(5, None)),
            ],
        )
        .unwrap_err();
        assert!(!error.is_transient());
        let text = error.to_string();
        assert!(
            text.contains("id=5") && text.contains("entity_id"),
            "{text}"
        );

        let error = run(&mut framer(), vec![relation(TABLE, "outbox_events", false)]).unwrap_err();
        assert!(matches!(error, FrameError::TableChanged(_)), "{error}");
        assert!(error.to_string().contains("payload"), "{error}");
    }

    #[test]
    fn d5_an_insert_under_a_known_partition_is_an_event_of_the_table_and_is_noticed_once() {
        let mut framer = framer();
        let items = run(
            &mut framer,
            vec![
                relation(PARTITION, "outbox_events_2024", true),
                begin(0x100),
                insert(PARTITION, row(1, Some("a"))),
                insert(PARTITION, row(2, Some("a"))),
                commit(0x100, 0x108),
            ],
        )
        .unwrap();
        assert_eq!(items[1..3], ["event 1 at 0/100/0", "event 2 at 0/100/1"]);
        assert_eq!(
            framer.take_notices(),
            [Notice::PartitionInsert {
                partition: "public.outbox_events_2024".into(),
                commit_lsn: Lsn(0x100)
            }]
        );
        assert!(framer.take_notices().is_empty());
    }

    #[test]
    fn d6_an_outbox_shaped_relation_the_relay_cannot_place_stops_it() {
        let error = run(
            &mut framer(),
            vec![
                relation(16_999, "outbox_events_2019", true),
                begin(0x100),
                insert(16_999, row(1, Some("a"))),
            ],
        )
        .unwrap_err();
        assert!(!error.is_transient());
        let FrameError::UnknownRelation(unplaced) = &error else {
            panic!("{error}")
        };
        assert_eq!(unplaced.relation.name, "outbox_events_2019");
        assert_eq!(unplaced.commit_lsn, Lsn(0x100));
    }

    #[test]
    fn d7_protocol_violations_are_transient() {
        for messages in [
            vec![begin(0x100), begin(0x200)],
            vec![commit(0x100, 0x108)],
            vec![
                relation(TABLE, "outbox_events", true),
                insert(TABLE, row(1, Some("a"))),
            ],
        ] {
            let error = run(&mut framer(), messages).unwrap_err();
            assert!(matches!(error, FrameError::Protocol(_)), "{error}");
            assert!(error.is_transient());
        }
        let garbage = xlog(BytesMut::from(&b"Z"[..]));
        let error = run(&mut framer(), vec![garbage]).unwrap_err();
        assert!(matches!(error, FrameError::Decode { .. }), "{error}");
        assert!(!error.is_transient());
    }
}
