//! The world around the relay: the outbox table, the WAL, the slot, a cold backup, and the
//! JetStream stream with its duplicate window and fence. Only this is modelled; every
//! decision of the relay is taken by the relay's own code ([`crate::relay`]).
//!
//! # Invariants
//! - MW1 The WAL holds committed transactions only, in commit order, each of 1–2 events at
//!   increasing LSNs; a rolled-back transaction takes ids and a `created_at` tick, and never
//!   reaches the WAL ([`crate::model::State::rolled_back`]).
//! - MW2 A row is identified by its outbox id and `created_at` ([`Row`]): the clock never
//!   rewinds, so a row written after a restore (reused id, reused LSN) is another row, with
//!   another ordering key, as the real `created_at` makes it.
//! - MW3 The stream answers a publish as nats-server does: a `Nats-Msg-Id` in the duplicate
//!   window is a duplicate (naming the original's sequence) whatever the fence says;
//!   otherwise `Nats-Expected-Last-Msg-Id` and `Nats-Expected-Last-Sequence` must match the
//!   stream's last message and sequence, or the publish is refused; otherwise it is stored
//!   at the next sequence. A duplicate consumes no sequence.
//! - MW4 The stream is append-only (no purge, no limits): a message read back at a sequence
//!   is what was stored there.

use std::collections::BTreeMap;
use std::fmt;

use outbox::{Lsn, OutboxEvent, Position};
use sink::resume::{Claim, Mark};

/// The `Outbox-Source` of every message (one cluster, timeline, database and slot: a cold
/// restore keeps them all).
pub const SOURCE: &str = "7301/1/app/slot";

/// `created_at` of clock tick 0, in ms.
pub const BASE_MS: i64 = 1_700_000_000_000;

/// An outbox row: its id and the clock tick of its transaction (MW2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    /// The outbox id (the table's sequence).
    pub id: i64,
    /// The clock tick of its transaction: its `created_at`.
    pub created: u32,
}

impl Row {
    /// Its `created_at`, in ms.
    pub fn created_at_ms(self) -> i64 {
        BASE_MS + i64::from(self.created) * 1_000
    }
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "id {}@t{}", self.id, self.created)
    }
}

/// A committed transaction in the WAL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Txn {
    /// The commit record's LSN: every event's `Outbox-Commit-Lsn`.
    pub commit: u64,
    /// The commit's end LSN: what the slot confirms.
    pub end: u64,
    /// Its events, in insert order (1 or 2).
    pub rows: Vec<Row>,
}

impl Txn {
    /// The position of its `index`-th event.
    pub fn position(&self, index: usize) -> Position {
        Position {
            commit_lsn: Lsn(self.commit),
            index: u32::try_from(index).unwrap_or(u32::MAX),
        }
    }
}

/// Postgres: the WAL, the table, the slot. A cold backup is a copy of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pg {
    /// Committed transactions, in commit order (MW1).
    pub wal: Vec<Txn>,
    /// The WAL end (`IDENTIFY_SYSTEM`'s position): the next commit's LSN.
    pub next_lsn: u64,
    /// The id sequence's next value.
    pub next_id: i64,
    /// The rows in the table (others delete them at will).
    pub table: Vec<Row>,
    /// The slot's `confirmed_flush_lsn`.
    pub confirmed: u64,
}

impl Pg {
    /// A fresh database whose slot was just created.
    pub fn new() -> Pg {
        Pg {
            wal: Vec::new(),
            next_lsn: 10,
            next_id: 1,
            table: Vec::new(),
            confirmed: 10,
        }
    }

    /// The end of the last committed transaction, if any.
    pub fn last_end(&self) -> Option<u64> {
        self.wal.last().map(|txn| txn.end)
    }

    /// Every committed event, in commit order.
    pub fn events(&self) -> impl Iterator<Item = (Row, Position, u64)> + '_ {
        self.wal.iter().flat_map(|txn| {
            txn.rows
                .iter()
                .enumerate()
                .map(move |(i, row)| (*row, txn.position(i), txn.end))
        })
    }
}

impl Default for Pg {
    fn default() -> Self {
        Pg::new()
    }
}

/// A message in the stream: the row it was published for, at the position it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Msg {
    /// The row.
    pub row: Row,
    /// `Outbox-Commit-Lsn`, `Outbox-Tx-Index`.
    pub position: Position,
}

/// A publish as it reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Publish {
    /// The event's row.
    pub row: Row,
    /// The event's position.
    pub position: Position,
    /// `Nats-Expected-Last-Sequence`.
    pub expect_sequence: u64,
    /// `Nats-Expected-Last-Msg-Id`, as the outbox id whose message id it is.
    pub expect_last: Option<i64>,
}

/// JetStream's answer to a publish (MW3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// Stored at this sequence.
    Stored(u64),
    /// `duplicate: true`, the original at this sequence.
    Duplicate(u64),
    /// Refused: wrong last sequence (err_code 10071).
    WrongLastSequence,
    /// Refused: wrong last message id (err_code 10070).
    WrongLastMsgId,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Stored(seq) => write!(f, "stored at seq {seq}"),
            Answer::Duplicate(seq) => write!(f, "duplicate of seq {seq}"),
            Answer::WrongLastSequence => write!(f, "refused: wrong last sequence"),
            Answer::WrongLastMsgId => write!(f, "refused: wrong last msg id"),
        }
    }
}

/// The JetStream stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Stream {
    /// Its messages; sequence n is `messages[n - 1]` (MW4).
    pub messages: Vec<Msg>,
    /// The duplicate window: message ids stored since the window last expired, and their
    /// sequences. `Nats-Msg-Id` is `order.created:order-{id}:{id}`, a function of the
    /// outbox id alone in this model, so the window is keyed by outbox id.
    pub window: BTreeMap<i64, u64>,
}

impl Stream {
    /// The last sequence.
    pub fn last_sequence(&self) -> u64 {
        self.messages.len() as u64
    }

    /// The message at `sequence`.
    pub fn at(&self, sequence: u64) -> Option<&Msg> {
        let index = usize::try_from(sequence.checked_sub(1)?).ok()?;
        self.messages.get(index)
    }

    /// The mark the relay reads back at `sequence` (`sink::resume::Mark::of` of the
    /// message the relay wrote).
    pub fn mark(&self, sequence: u64) -> Result<Mark, String> {
        self.at(sequence)
            .map(mark_of)
            .ok_or_else(|| "no message found".to_owned())
    }

    /// nats-server's answer to `publish` (MW3), applied to the stream.
    pub fn answer(&mut self, publish: &Publish) -> Answer {
        if let Some(&original) = self.window.get(&publish.row.id) {
            return Answer::Duplicate(original);
        }
        if let Some(expected) = publish.expect_last {
            if self.messages.last().map(|m| m.row.id) != Some(expected) {
                return Answer::WrongLastMsgId;
            }
        }
        if publish.expect_sequence != self.last_sequence() {
            return Answer::WrongLastSequence;
        }
        self.messages.push(Msg {
            row: publish.row,
            position: publish.position,
        });
        let sequence = self.last_sequence();
        self.window.insert(publish.row.id, sequence);
        Answer::Stored(sequence)
    }
}

/// The event the relay publishes for `row` at `position`, built as the relay builds it
/// (`outbox::OutboxRow::into_event`).
pub fn event(row: Row, position: Position) -> OutboxEvent {
    outbox::OutboxRow::seed(
        row.id,
        format!("order-{}", row.id),
        "order.created",
        bytes::Bytes::from_static(b"{}"),
        row.created_at_ms(),
    )
    .into_event(
        "outbox",
        std::num::NonZeroU64::new(8).unwrap_or(std::num::NonZeroU64::MIN),
        position,
    )
}

/// What the relay wrote into the message for `msg` (its headers, read back).
pub fn mark_of(msg: &Msg) -> Mark {
    let event = event(msg.row, msg.position);
    Mark {
        position: Some(msg.position),
        source: Some(SOURCE.to_owned()),
        claim: Claim {
            id: Some(event.id.clone()),
            msg_id: Some(sink::message::msg_id(&event)),
            ordering_key: Some(event.keys.ordering_key.clone()),
            dead_letter: false,
        },
    }
}

/// A position as traces print it: `commit_lsn.index`.
pub fn at(position: Position) -> String {
    format!("{}.{}", position.commit_lsn.0, position.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(id: i64, expect_sequence: u64, expect_last: Option<i64>) -> Publish {
        Publish {
            row: Row { id, created: 1 },
            position: Position {
                commit_lsn: Lsn(10 + 2 * id as u64),
                index: 0,
            },
            expect_sequence,
            expect_last,
        }
    }

    /// MW3: a duplicate is answered as such whatever the fence says, and consumes no
    /// sequence; a wrong fence is refused; otherwise stored.
    #[test]
    fn the_stream_answers_as_nats_server_does() {
        let mut stream = Stream::default();
        assert_eq!(stream.answer(&publish(1, 0, None)), Answer::Stored(1));
        assert_eq!(stream.answer(&publish(1, 7, Some(9))), Answer::Duplicate(1));
        assert_eq!(stream.last_sequence(), 1);
        assert_eq!(
            stream.answer(&publish(2, 2, None)),
            Answer::WrongLastSequence
        );
        assert_eq!(
            stream.answer(&publish(2, 1, Some(5))),
            Answer::WrongLastMsgId
        );
        assert_eq!(stream.answer(&publish(2, 1, Some(1))), Answer::Stored(2));
        // The window expired: the same id is stored again, at the fence.
        stream.window.clear();
        assert_eq!(stream.answer(&publish(1, 2, Some(2))), Answer::Stored(3));
    }

    /// The window is keyed by outbox id: the relay's `Nats-Msg-Id` is a function of the id
    /// alone in the model (the same for a restored row with another `created_at`), and the
    /// ordering key is not.
    #[test]
    fn the_msg_id_is_the_ids_and_the_ordering_key_the_rows() {
        let at = Position {
            commit_lsn: Lsn(10),
            index: 0,
        };
        let first = event(Row { id: 3, created: 1 }, at);
        let restored = event(Row { id: 3, created: 4 }, at);
        assert_eq!(
            sink::message::msg_id(&first),
            sink::message::msg_id(&restored)
        );
        assert_ne!(first.keys.ordering_key, restored.keys.ordering_key);
        assert_ne!(
            sink::message::msg_id(&first),
            sink::message::msg_id(&event(Row { id: 4, created: 1 }, at))
        );
        let mark = mark_of(&Msg {
            row: Row { id: 3, created: 1 },
            position: at,
        });
        assert_eq!(sink::resume::vouch(&mark, &first, &lineage()), Ok(()));
        assert!(sink::resume::vouch(&mark, &restored, &lineage()).is_err());
    }

    fn lineage() -> sink::resume::Lineage {
        sink::resume::Lineage {
            source: SOURCE.to_owned(),
            history: Vec::new(),
        }
    }
}
