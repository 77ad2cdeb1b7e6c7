//! Whole transactions, for a reader of the whole stream (no I/O).
//!
//! A shard's consumer sees only its shard's part of a Postgres transaction. A reader of the
//! whole stream (one consumer on `{prefix}.>`, read in stream order) sees every event of
//! it, and [`Transactions`] groups those events back into the transactions they were
//! committed in, handing a transaction back only once it knows the transaction is whole.
//! With the relay's `--atomic-transactions` that is at once, when the transaction's last
//! event is read (`Outbox-Tx-End`); otherwise when the next transaction's first event is.
//!
//! ```no_run
//! use async_nats::jetstream::{consumer::pull::OrderedConfig, stream::Stream};
//! use futures::StreamExt;
//! use outbox_consumer::{BoxError, Event, Transactions};
//!
//! async fn read(stream: Stream) -> Result<(), BoxError> {
//!     // The whole stream but the dead-letter subject, in stream order.
//!     let config = OrderedConfig { filter_subject: "outbox.*.>".into(), ..Default::default() };
//!     let mut messages = stream.create_consumer(config).await?.messages().await?;
//!     let mut transactions = Transactions::new();
//!     while let Some(message) = messages.next().await {
//!         let message = message?;
//!         let info = message.info()?;
//!         let (sequence, delivered) = (info.stream_sequence, info.delivered as u64);
//!         let event = Event::decode(message.subject.as_str(), message.headers.as_ref(),
//!                                   message.payload.clone(), sequence, delivered)?;
//!         for whole in transactions.push(event)? {
//!             println!("{:?}: {} events", whole.commit_lsn, whole.events.len());
//!         }
//!     }
//!     Ok(())
//! }
//! ```
//!
//! # Invariants
//! - W1 Never part of a transaction as a whole one: a transaction is handed back when an
//!   event of a later transaction is read (the stream is in commit order, so nothing of the
//!   earlier one can follow), or at once when it reads the event marked `Outbox-Tx-End`
//!   (the relay marks a transaction's last event so when it publishes the transaction with
//!   `--atomic-transactions`: the sink's B7). A transaction not yet known whole is
//!   [`Transactions::open`]; nothing else ends it.
//! - W2 Checked, never guessed: within a transaction `Outbox-Tx-Index` runs 0, 1, 2, …
//!   without a gap or a repeat, and positions rise along the stream. An event at or below
//!   the highest stream sequence taken is a redelivery and is ignored. Anything else is a
//!   [`Broken`] naming the event, what was expected, and the likely cause (a reader of one
//!   shard or a filtered subject, a reader that started inside a transaction, a message
//!   deleted from the stream, another writer); the assembler is left as it was.
//! - W3 An event without a commit position, or with the backfill's (`Outbox-Commit-Lsn`
//!   `0/0`: a row published from the table, not from a transaction), is a transaction of
//!   its own, handed back at once; it leaves an open transaction open.
//! - W4 Bounded: an open transaction holds its events; one growing past `max_events`
//!   ([`Transactions::with_max_events`], [`DEFAULT_MAX_EVENTS`] by default) is a
//!   [`Broken::TooLarge`], not unbounded memory.

use crate::event::Event;
use outbox::headers::{NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE, OUTBOX_TX_END};
use outbox::{Lsn, Position};

/// How many events an open transaction may hold by default (W4).
pub const DEFAULT_MAX_EVENTS: usize = 100_000;

/// One message's place in an atomic batch: nats-server's batch headers, stored with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlace {
    /// `Nats-Batch-Id`.
    pub id: String,
    /// `Nats-Batch-Sequence`, from 1.
    pub sequence: u64,
    /// `Nats-Batch-Commit`: the batch's last message.
    pub commit: bool,
}

impl Event {
    /// The event's place in an atomic batch (`--atomic-transactions`), when the message
    /// carries nats-server's batch headers; `None` for a message published on its own.
    pub fn batch(&self) -> Option<BatchPlace> {
        let id = self.headers.get(NATS_BATCH_ID)?.as_str().to_owned();
        let sequence = self
            .headers
            .get(NATS_BATCH_SEQUENCE)?
            .as_str()
            .parse()
            .ok()?;
        let commit = self
            .headers
            .get(NATS_BATCH_COMMIT)
            .is_some_and(|value| !value.as_str().is_empty());
        Some(BatchPlace {
            id,
            sequence,
            commit,
        })
    }

    /// Whether the relay marked the event as its transaction's last (`Outbox-Tx-End`: with
    /// `--atomic-transactions` only, so `false` says nothing).
    pub fn ends_transaction(&self) -> bool {
        self.headers
            .get(OUTBOX_TX_END)
            .is_some_and(|value| value.as_str() == "1")
    }
}

/// A whole transaction: its commit LSN (`None` for an event without one, W3) and its
/// events in commit order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WholeTransaction {
    /// `Outbox-Commit-Lsn`.
    pub commit_lsn: Option<Lsn>,
    /// The events, `Outbox-Tx-Index` 0, 1, 2, ….
    pub events: Vec<Event>,
}

/// Why an event cannot be placed in a transaction (W2, W4). The assembler is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    /// The event's index is not the one its transaction needs next.
    #[error(
        "stream sequence {stream_sequence}: event {index} of the transaction committed at {commit_lsn}, \
         but the transaction's next event is {expected}: {}",
        if *expected == 0 {
            "the reader starts inside a transaction; start it at a transaction's first event (Outbox-Tx-Index 0)"
        } else {
            "events of the transaction are missing or repeated; read the whole stream ({prefix}.>), unfiltered, from one writer (strict mode)"
        }
    )]
    Index {
        stream_sequence: u64,
        commit_lsn: Lsn,
        index: u32,
        expected: u32,
    },
    /// The event's position is not after the last one taken.
    #[error(
        "stream sequence {stream_sequence}: position {commit_lsn}/{index} is not after the last one read ({last_commit_lsn}/{last_index}): \
         the stream is not in commit order (another writer, or a shared-mode stream); read a stream written by one relay in strict mode"
    )]
    Backwards {
        stream_sequence: u64,
        commit_lsn: Lsn,
        index: u32,
        last_commit_lsn: Lsn,
        last_index: u32,
    },
    /// An event of a transaction whose end the stream marked already.
    #[error(
        "stream sequence {stream_sequence}: event {index} of the transaction committed at {commit_lsn} comes after the event marked Outbox-Tx-End; \
         the stream holds messages of another writer: read a stream written by one relay in strict mode"
    )]
    AfterEnd {
        stream_sequence: u64,
        commit_lsn: Lsn,
        index: u32,
    },
    /// The open transaction would hold more than the assembler's `max_events`.
    #[error(
        "stream sequence {stream_sequence}: the transaction committed at {commit_lsn} has more than {max_events} events; \
         raise Transactions::with_max_events if the memory is there"
    )]
    TooLarge {
        stream_sequence: u64,
        commit_lsn: Lsn,
        max_events: usize,
    },
}

/// Groups a whole-stream reader's events into whole transactions (W1–W4): feed it every
/// event in stream order with [`Transactions::push`].
#[derive(Debug)]
pub struct Transactions {
    /// The open transaction's events (indexes 0, 1, …).
    open: Vec<Event>,
    /// The highest stream sequence taken (W2: anything at or below is a redelivery).
    last_sequence: u64,
    /// The position of the last event taken that had one (W2).
    last_position: Option<Position>,
    max_events: usize,
}

impl Default for Transactions {
    fn default() -> Self {
        Transactions::new()
    }
}

impl Transactions {
    /// An assembler that has read nothing yet.
    pub fn new() -> Self {
        Transactions::with_max_events(DEFAULT_MAX_EVENTS)
    }

    /// An assembler whose open transaction holds at most `max_events` events (W4).
    pub fn with_max_events(max_events: usize) -> Self {
        Transactions {
            open: Vec::new(),
            last_sequence: 0,
            last_position: None,
            max_events: max_events.max(1),
        }
    }

    /// The open transaction's events read so far (not yet known whole: W1).
    pub fn open(&self) -> &[Event] {
        &self.open
    }

    /// Takes the next event of the stream; returns the transactions it made whole, oldest
    /// first (none, one, or two: the one it ended and its own).
    pub fn push(&mut self, event: Event) -> Result<Vec<WholeTransaction>, Broken> {
        if event.stream_sequence <= self.last_sequence {
            return Ok(Vec::new());
        }
        let Some(position) = event.position.filter(|p| p.commit_lsn != Lsn::ZERO) else {
            // W3.
            self.last_sequence = event.stream_sequence;
            return Ok(vec![WholeTransaction {
                commit_lsn: event.position.map(|p| p.commit_lsn),
                events: vec![event],
            }]);
        };
        let continues = self.open_lsn() == Some(position.commit_lsn);
        self.check(&event, position, continues)?;
        let mut whole = Vec::new();
        if !continues {
            whole.extend(self.take());
        }
        let ends = event.ends_transaction();
        self.last_sequence = event.stream_sequence;
        self.last_position = Some(position);
        self.open.push(event);
        if ends {
            whole.extend(self.take());
        }
        Ok(whole)
    }

    /// W2, W4: whether `event` (at `position`) may be taken; `continues`: it is of the open
    /// transaction.
    fn check(&self, event: &Event, position: Position, continues: bool) -> Result<(), Broken> {
        let stream_sequence = event.stream_sequence;
        if let Some(last) = self.last_position.filter(|last| position <= *last) {
            return Err(Broken::Backwards {
                stream_sequence,
                commit_lsn: position.commit_lsn,
                index: position.index,
                last_commit_lsn: last.commit_lsn,
                last_index: last.index,
            });
        }
        // A transaction handed back at its `Outbox-Tx-End` gets no more events.
        if !continues && self.last_position.map(|p| p.commit_lsn) == Some(position.commit_lsn) {
            return Err(Broken::AfterEnd {
                stream_sequence,
                commit_lsn: position.commit_lsn,
                index: position.index,
            });
        }
        let expected = if continues { self.open.len() as u32 } else { 0 };
        if position.index != expected {
            return Err(Broken::Index {
                stream_sequence,
                commit_lsn: position.commit_lsn,
                index: position.index,
                expected,
            });
        }
        if continues && self.open.len() >= self.max_events {
            return Err(Broken::TooLarge {
                stream_sequence,
                commit_lsn: position.commit_lsn,
                max_events: self.max_events,
            });
        }
        Ok(())
    }

    /// The open transaction's commit LSN, if it has events: the last position's taken.
    fn open_lsn(&self) -> Option<Lsn> {
        let position = self.last_position.filter(|_| !self.open.is_empty())?;
        Some(position.commit_lsn)
    }

    /// The open transaction, handed back whole.
    fn take(&mut self) -> Option<WholeTransaction> {
        let commit_lsn = self.open_lsn()?;
        Some(WholeTransaction {
            commit_lsn: Some(commit_lsn),
            events: std::mem::take(&mut self.open),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::HeaderMap;
    use proptest::prelude::*;

    /// Event `index` of the transaction committed at `lsn`, at stream sequence `sequence`,
    /// marked as its transaction's last when `end`.
    fn event(sequence: u64, lsn: u64, index: u32, end: bool) -> Event {
        let id = outbox::EventId::Int(sequence as i64);
        let mut headers = HeaderMap::new();
        if end {
            headers.insert(OUTBOX_TX_END, "1");
        }
        Event {
            keys: id.keys("e", "T", 0),
            id,
            entity_id: "e".into(),
            event_type: "T".into(),
            created_at_ms: 0,
            shard: 0,
            position: Some(Position {
                commit_lsn: Lsn(lsn),
                index,
            }),
            payload: bytes::Bytes::new(),
            subject: "outbox.0.T".into(),
            headers,
            stream_sequence: sequence,
            delivered: 1,
        }
    }

    fn sizes(whole: &[WholeTransaction]) -> Vec<(Option<u64>, usize)> {
        whole
            .iter()
            .map(|t| (t.commit_lsn.map(|l| l.0), t.events.len()))
            .collect()
    }

    #[test]
    fn w1_a_transaction_is_whole_at_its_end_marker_or_when_the_next_one_begins() {
        let mut txs = Transactions::new();
        // Marked (atomic mode): whole at once.
        assert!(txs.push(event(1, 0x10, 0, false)).unwrap().is_empty());
        assert_eq!(
            sizes(&txs.push(event(2, 0x10, 1, true)).unwrap()),
            [(Some(0x10), 2)]
        );
        // Unmarked (per-message mode): open until the next transaction's first event.
        assert!(txs.push(event(3, 0x20, 0, false)).unwrap().is_empty());
        assert!(txs.push(event(4, 0x20, 1, false)).unwrap().is_empty());
        assert_eq!(txs.open().len(), 2);
        // The next one ends it, and is whole itself at once (a marked one-event transaction).
        assert_eq!(
            sizes(&txs.push(event(5, 0x30, 0, true)).unwrap()),
            [(Some(0x20), 2), (Some(0x30), 1)]
        );
        assert!(txs.open().is_empty());
    }

    #[test]
    fn w2_redeliveries_are_ignored_and_gaps_repeats_and_reordering_refused_leaving_it_unchanged() {
        let mut txs = Transactions::new();
        txs.push(event(1, 0x10, 0, false)).unwrap();
        txs.push(event(2, 0x10, 1, false)).unwrap();
        assert!(
            txs.push(event(2, 0x10, 1, false)).unwrap().is_empty(),
            "a redelivery"
        );
        assert!(
            txs.push(event(1, 0x10, 0, false)).unwrap().is_empty(),
            "a redelivery"
        );
        let gap = txs.push(event(4, 0x10, 3, false)).unwrap_err();
        assert!(
            matches!(
                gap,
                Broken::Index {
                    expected: 2,
                    index: 3,
                    ..
                }
            ),
            "{gap}"
        );
        assert!(gap.to_string().contains("missing or repeated"), "{gap}");
        let inside = txs.push(event(5, 0x20, 4, false)).unwrap_err();
        assert!(
            matches!(inside, Broken::Index { expected: 0, .. }),
            "{inside}"
        );
        assert!(
            inside.to_string().contains("starts inside a transaction"),
            "{inside}"
        );
        let backwards = txs.push(event(6, 0x08, 0, false)).unwrap_err();
        assert!(matches!(backwards, Broken::Backwards { .. }), "{backwards}");
        assert_eq!(txs.open().len(), 2, "refused events leave it as it was");
        txs.push(event(7, 0x10, 2, true)).unwrap();
        let after = txs.push(event(8, 0x10, 3, false)).unwrap_err();
        assert!(matches!(after, Broken::AfterEnd { .. }), "{after}");
        // The reader may go on past a refused event (its choice): the stream goes on.
        assert_eq!(
            sizes(&txs.push(event(9, 0x20, 0, true)).unwrap()),
            [(Some(0x20), 1)]
        );
    }

    #[test]
    fn w3_events_without_a_transaction_are_their_own_and_leave_the_open_one_open() {
        let mut txs = Transactions::new();
        txs.push(event(1, 0x10, 0, false)).unwrap();
        let mut backfilled = event(2, 0, 7, false);
        assert_eq!(
            sizes(&txs.push(backfilled.clone()).unwrap()),
            [(Some(0), 1)]
        );
        backfilled.position = None;
        backfilled.stream_sequence = 3;
        assert_eq!(sizes(&txs.push(backfilled).unwrap()), [(None, 1)]);
        assert_eq!(txs.open().len(), 1);
    }

    #[test]
    fn w4_an_open_transaction_past_max_events_is_refused() {
        let mut txs = Transactions::with_max_events(2);
        txs.push(event(1, 0x10, 0, false)).unwrap();
        txs.push(event(2, 0x10, 1, false)).unwrap();
        let error = txs.push(event(3, 0x10, 2, false)).unwrap_err();
        assert!(
            matches!(error, Broken::TooLarge { max_events: 2, .. }),
            "{error}"
        );
    }

    proptest! {
        /// W1: whatever the transactions' sizes and which of them are marked, every
        /// transaction handed back is whole and in commit order, each once; only the last,
        /// unmarked one may still be open.
        #[test]
        fn whole_transactions_only(txs in proptest::collection::vec((1u32..6, any::<bool>()), 1..30)) {
            let mut assembler = Transactions::new();
            let mut out = Vec::new();
            let mut sequence = 0;
            for (t, &(size, marked)) in txs.iter().enumerate() {
                for index in 0..size {
                    sequence += 1;
                    let end = marked && index + 1 == size;
                    out.extend(assembler.push(event(sequence, 0x100 * (t as u64 + 1), index, end)).unwrap());
                }
            }
            let expected: Vec<(Option<u64>, usize)> = txs
                .iter()
                .enumerate()
                .map(|(t, &(size, _))| (Some(0x100 * (t as u64 + 1)), size as usize))
                .collect();
            let last_open = !txs.last().unwrap().1;
            prop_assert_eq!(sizes(&out), &expected[..expected.len() - usize::from(last_open)]);
            prop_assert_eq!(assembler.open().len(), if last_open { txs.last().unwrap().0 as usize } else { 0 });
            for whole in &out {
                let indexes: Vec<u32> = whole.events.iter().map(|e| e.position.unwrap().index).collect();
                prop_assert_eq!(indexes, (0..whole.events.len() as u32).collect::<Vec<_>>());
            }
        }
    }
}
