//! The one place the LSN rule lives: which position may be confirmed, given which
//! publishes JetStream has acknowledged.
//!
//! The tracker sees the replication stream as a sequence of *groups*: a transaction
//! (`begin`, `publish`×n, `commit(end)`) or an idle position (`idle(pos)`, a keepalive's WAL
//! end seen with no transaction open). Acks may arrive in any order.
//!
//! # Invariants
//! - A1 The watermark is the end position of the newest group such that it and every
//!   earlier group are closed and have every publish acknowledged. Nothing else moves it:
//!   not receipt, not a publish that failed, timed out or was dropped (an un-acked ticket
//!   simply never counts).
//! - A2 The watermark never decreases (a position older than the watermark is ignored; a
//!   debug build asserts it never happens).
//! - A3 A transaction without publishes is confirmable as soon as everything before it is.
//! - A4 An idle position is only accepted with no transaction open: a keepalive in the
//!   middle of a transaction says nothing about that transaction.
//!
//! Pure and synchronous: no clock, no I/O, generic over the position type.

use std::collections::VecDeque;

/// Identifies one publish to [`AckTracker::ack`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(u64);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Group<P> {
    /// Publishes not yet acknowledged.
    pending: u64,
    /// `None` while the transaction is open.
    end: Option<P>,
}

/// Misuse of the tracker's protocol: a bug in the caller, never a runtime condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TrackerError {
    /// `begin` while a transaction is open.
    #[error("begin while a transaction is open")]
    NestedBegin,
    /// `publish` or `commit` with no transaction open.
    #[error("{0} with no transaction open")]
    NoTransaction(&'static str),
    /// An ack for a ticket that is not outstanding.
    #[error("ack for a ticket that is not outstanding")]
    UnknownTicket,
}

/// Turns acknowledgements into a confirmable watermark. See the module docs. `Clone`, `Eq`
/// and `Hash` for a model checker's state (`crates/model`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AckTracker<P> {
    groups: VecDeque<Group<P>>,
    /// Sequence number of `groups[0]`.
    first_group: u64,
    open: bool,
    watermark: P,
    outstanding: u64,
}

impl<P: Ord + Copy + std::fmt::Debug> AckTracker<P> {
    /// A tracker whose watermark starts at `start` (the slot's confirmed position).
    pub fn new(start: P) -> Self {
        Self {
            groups: VecDeque::new(),
            first_group: 0,
            open: false,
            watermark: start,
            outstanding: 0,
        }
    }

    /// The newest confirmable position (A1).
    pub fn watermark(&self) -> P {
        self.watermark
    }

    /// Publishes not yet acknowledged.
    pub fn outstanding(&self) -> u64 {
        self.outstanding
    }

    /// Whether a transaction is open.
    pub fn in_transaction(&self) -> bool {
        self.open
    }

    /// Opens a transaction.
    pub fn begin(&mut self) -> Result<(), TrackerError> {
        if self.open {
            return Err(TrackerError::NestedBegin);
        }
        self.open = true;
        self.groups.push_back(Group {
            pending: 0,
            end: None,
        });
        Ok(())
    }

    /// Registers a publish in the open transaction.
    pub fn publish(&mut self) -> Result<Ticket, TrackerError> {
        if !self.open {
            return Err(TrackerError::NoTransaction("publish"));
        }
        let index = self.groups.len() - 1;
        self.groups[index].pending += 1;
        self.outstanding += 1;
        Ok(Ticket(self.first_group + index as u64))
    }

    /// Closes the open transaction at `end` (its commit `end_lsn`). Returns the new
    /// watermark if it moved.
    pub fn commit(&mut self, end: P) -> Result<Option<P>, TrackerError> {
        if !self.open {
            return Err(TrackerError::NoTransaction("commit"));
        }
        self.open = false;
        let index = self.groups.len() - 1;
        self.groups[index].end = Some(end);
        Ok(self.advance())
    }

    /// Records a position reached with no transaction open (A4). Returns the new watermark
    /// if it moved; ignored while a transaction is open.
    pub fn idle(&mut self, position: P) -> Option<P> {
        if self.open {
            return None;
        }
        match self.groups.back_mut() {
            // Fold consecutive idle positions into one group: memory stays flat however
            // long the stream idles behind a slow ack.
            Some(last) if last.pending == 0 && last.end.is_some() => {
                last.end = last.end.max(Some(position));
            }
            _ => self.groups.push_back(Group {
                pending: 0,
                end: Some(position),
            }),
        }
        self.advance()
    }

    /// Records JetStream's acknowledgement of a publish. Returns the new watermark if it moved.
    pub fn ack(&mut self, ticket: Ticket) -> Result<Option<P>, TrackerError> {
        let index = ticket
            .0
            .checked_sub(self.first_group)
            .ok_or(TrackerError::UnknownTicket)?;
        let group = usize::try_from(index)
            .ok()
            .and_then(|i| self.groups.get_mut(i))
            .filter(|g| g.pending > 0)
            .ok_or(TrackerError::UnknownTicket)?;
        group.pending -= 1;
        self.outstanding -= 1;
        Ok(self.advance())
    }

    fn advance(&mut self) -> Option<P> {
        let before = self.watermark;
        while let Some(Group {
            pending: 0,
            end: Some(end),
        }) = self.groups.front()
        {
            let end = *end;
            debug_assert!(
                end >= self.watermark,
                "position {end:?} is older than watermark {:?}",
                self.watermark
            );
            self.watermark = self.watermark.max(end);
            self.groups.pop_front();
            self.first_group += 1;
        }
        (self.watermark != before).then_some(self.watermark)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn transaction_confirms_only_after_every_ack() {
        let mut t = AckTracker::new(0u64);
        t.begin().unwrap();
        let a = t.publish().unwrap();
        let b = t.publish().unwrap();
        assert_eq!(t.commit(10).unwrap(), None, "not confirmable on receipt");
        assert_eq!(t.ack(b).unwrap(), None, "one of two acks is not enough");
        assert_eq!(t.ack(a).unwrap(), Some(10));
        assert_eq!(t.watermark(), 10);
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn later_transaction_waits_for_earlier_one() {
        let mut t = AckTracker::new(0u64);
        t.begin().unwrap();
        let first = t.publish().unwrap();
        t.commit(10).unwrap();
        t.begin().unwrap();
        let second = t.publish().unwrap();
        t.commit(20).unwrap();
        assert_eq!(
            t.ack(second).unwrap(),
            None,
            "an ack out of order must not skip the gap"
        );
        assert_eq!(t.ack(first).unwrap(), Some(20), "both confirm together");
    }

    #[test]
    fn open_transaction_is_never_confirmed() {
        let mut t = AckTracker::new(0u64);
        t.begin().unwrap();
        let a = t.publish().unwrap();
        assert_eq!(
            t.ack(a).unwrap(),
            None,
            "acked but not committed: the transaction may have more rows"
        );
        assert_eq!(t.watermark(), 0);
    }

    #[test]
    fn empty_transaction_confirms_when_predecessors_do() {
        let mut t = AckTracker::new(0u64);
        t.begin().unwrap();
        let a = t.publish().unwrap();
        t.commit(10).unwrap();
        t.begin().unwrap();
        assert_eq!(t.commit(20).unwrap(), None);
        assert_eq!(t.ack(a).unwrap(), Some(20));
        t.begin().unwrap();
        assert_eq!(
            t.commit(30).unwrap(),
            Some(30),
            "nothing before it is pending"
        );
    }

    #[test]
    fn idle_positions_confirm_only_with_nothing_open_before_them() {
        let mut t = AckTracker::new(0u64);
        assert_eq!(
            t.idle(5),
            Some(5),
            "idle with nothing in flight confirms at once"
        );
        t.begin().unwrap();
        let a = t.publish().unwrap();
        assert_eq!(t.idle(50), None, "ignored inside a transaction");
        t.commit(10).unwrap();
        assert_eq!(t.idle(15), None, "waits behind the pending transaction");
        assert_eq!(t.idle(18), None);
        assert_eq!(t.ack(a).unwrap(), Some(18));
    }

    #[test]
    fn idle_positions_fold_into_one_group() {
        let mut t = AckTracker::new(0u64);
        t.begin().unwrap();
        let a = t.publish().unwrap();
        t.commit(10).unwrap();
        for p in 11..10_000 {
            t.idle(p);
        }
        assert_eq!(t.groups.len(), 2);
        assert_eq!(t.ack(a).unwrap(), Some(9_999));
    }

    #[test]
    fn watermark_never_moves_back() {
        let mut t = AckTracker::new(100u64);
        assert_eq!(t.idle(100), None);
        t.begin().unwrap();
        t.commit(150).unwrap();
        assert_eq!(t.watermark(), 150);
    }

    #[test]
    fn misuse_is_an_error() {
        let mut t = AckTracker::new(0u64);
        assert_eq!(t.publish(), Err(TrackerError::NoTransaction("publish")));
        assert_eq!(t.commit(1), Err(TrackerError::NoTransaction("commit")));
        t.begin().unwrap();
        assert_eq!(t.begin(), Err(TrackerError::NestedBegin));
        let a = t.publish().unwrap();
        t.ack(a).unwrap();
        assert_eq!(t.ack(a), Err(TrackerError::UnknownTicket), "double ack");
        assert_eq!(t.ack(Ticket(99)), Err(TrackerError::UnknownTicket));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Txn(u8),
        Idle,
        Ack(usize),
    }

    proptest! {
        /// Against a model: the watermark is the end of the longest fully-acked prefix of
        /// closed groups, whatever order acks come in.
        #[test]
        fn matches_model(ops in proptest::collection::vec(prop_oneof![
            (0u8..4).prop_map(Op::Txn), Just(Op::Idle), (0usize..64).prop_map(Op::Ack)
        ], 0..80)) {
            let mut tracker = AckTracker::new(0u64);
            let mut position = 0u64;
            // Model: per group (end, publish ids); publish ids still unacked with their tickets.
            let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
            let mut unacked: Vec<(usize, Ticket)> = Vec::new();
            let mut acked: std::collections::HashSet<usize> = Default::default();
            let mut next_id = 0usize;
            for op in ops {
                match op {
                    Op::Txn(n) => {
                        tracker.begin().unwrap();
                        let mut ids = Vec::new();
                        for _ in 0..n {
                            unacked.push((next_id, tracker.publish().unwrap()));
                            ids.push(next_id);
                            next_id += 1;
                        }
                        position += 10;
                        tracker.commit(position).unwrap();
                        groups.push((position, ids));
                    }
                    Op::Idle => {
                        position += 1;
                        tracker.idle(position);
                        groups.push((position, vec![]));
                    }
                    Op::Ack(i) if !unacked.is_empty() => {
                        let (id, ticket) = unacked.swap_remove(i % unacked.len());
                        tracker.ack(ticket).unwrap();
                        acked.insert(id);
                    }
                    Op::Ack(_) => {}
                }
                let expected = groups
                    .iter()
                    .take_while(|(_, ids)| ids.iter().all(|id| acked.contains(id)))
                    .map(|(end, _)| *end)
                    .last()
                    .unwrap_or(0);
                prop_assert_eq!(tracker.watermark(), expected);
                prop_assert_eq!(tracker.outstanding(), unacked.len() as u64);
            }
        }
    }
}
