//! The per-entity ordering check.
//!
//! # Invariants
//! - O1 Integer ids (the seed's): an event is out of order when an event of the same entity
//!   with a greater or equal `(created_at_ms, id)` (what `Outbox-Ordering-Key` sorts like,
//!   also before 1970) was processed before it by this shard worker.
//! - O2 uuid and text ids: their ordering key sorts by time, then by the id's bytes, which
//!   says nothing about the events of one millisecond, so it is not compared. An event is
//!   out of order when an event of the same entity processed before it by this shard worker
//!   has a later `created_at_ms` (the time went backwards, as O1 reports it), or a position
//!   (`Outbox-Commit-Lsn`, `Outbox-Tx-Index`: the commit order) at or above its own (the
//!   stream is not in commit order: shared mode, a replay by hand). Equal milliseconds in
//!   commit order are never reported: no false regressions.
//! - O3 Only events whose handler committed count: duplicates and rolled-back attempts
//!   neither report nor move the mark. An entity whose id kind changed (a mark of the other
//!   kind) starts a new mark, unchecked.
//! - O4 Memory is bounded: at most `capacity` entities are remembered per shard (two
//!   generations of `capacity / 2`; the least recently processed are forgotten first). A
//!   forgotten entity's next event is not checked; nor is the first one after a restart.

use std::collections::HashMap;

use outbox::{EventId, Position};

use crate::event::Event;

/// Where an entity's processed events got to (O1, O2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mark {
    /// An integer id's `(created_at_ms, id)`.
    Seed(i64, i64),
    /// A uuid or text id's creation time and commit position, and the ordering key of the
    /// event that set them, for the report.
    Committed {
        created_at_ms: i64,
        position: Option<Position>,
        ordering_key: String,
    },
}

impl Mark {
    /// The mark `event` sets.
    pub(crate) fn of(event: &Event) -> Mark {
        match &event.id {
            EventId::Int(id) => Mark::Seed(event.created_at_ms, *id),
            EventId::Text(_) => Mark::Committed {
                created_at_ms: event.created_at_ms,
                position: event.position,
                ordering_key: event.keys.ordering_key.clone(),
            },
        }
    }

    /// Whether an event at `self` comes too late after `mark` (O1, O2); `None`: not
    /// comparable (O3).
    fn at_or_below(&self, mark: &Mark) -> Option<bool> {
        match (self, mark) {
            (Mark::Seed(ms, id), Mark::Seed(mark_ms, mark_id)) => {
                Some((ms, id) <= (mark_ms, mark_id))
            }
            (
                Mark::Committed {
                    created_at_ms,
                    position,
                    ..
                },
                Mark::Committed {
                    created_at_ms: mark_ms,
                    position: mark_position,
                    ..
                },
            ) => {
                let reordered = matches!((position, mark_position), (Some(p), Some(m)) if p <= m);
                Some(created_at_ms < mark_ms || reordered)
            }
            _ => None,
        }
    }

    /// The later of `self` and `other` (both the same kind), part by part.
    fn max(self, other: Mark) -> Mark {
        match (self, other) {
            (Mark::Seed(a, b), Mark::Seed(c, d)) => {
                let (ms, id) = (a, b).max((c, d));
                Mark::Seed(ms, id)
            }
            (
                Mark::Committed {
                    created_at_ms: a_ms,
                    position: a_position,
                    ordering_key: a_key,
                },
                Mark::Committed {
                    created_at_ms: b_ms,
                    position: b_position,
                    ordering_key: b_key,
                },
            ) => Mark::Committed {
                ordering_key: match (b_ms, b_position) >= (a_ms, a_position) {
                    true => b_key,
                    false => a_key,
                },
                created_at_ms: a_ms.max(b_ms),
                position: a_position.max(b_position),
            },
            (_, other) => other,
        }
    }

    /// The ordering key of the event that set the mark (`{created_at_ms:013}:{id}`).
    pub(crate) fn ordering_key(&self) -> String {
        match self {
            Mark::Seed(created_at_ms, id) => outbox::ordering_key(*id, *created_at_ms),
            Mark::Committed { ordering_key, .. } => ordering_key.clone(),
        }
    }
}

/// The mark processed per entity, for a bounded number of entities.
#[derive(Debug)]
pub(crate) struct EntityOrder {
    current: HashMap<String, Mark>,
    previous: HashMap<String, Mark>,
    generation: usize,
}

impl EntityOrder {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            current: HashMap::new(),
            previous: HashMap::new(),
            generation: (capacity / 2).max(1),
        }
    }

    fn mark(&self, entity: &str) -> Option<&Mark> {
        self.current
            .get(entity)
            .or_else(|| self.previous.get(entity))
    }

    /// The mark `order` falls at or below, if any (O1, O2).
    pub(crate) fn regression(&self, entity: &str, order: &Mark) -> Option<Mark> {
        self.mark(entity)
            .filter(|mark| order.at_or_below(mark) == Some(true))
            .cloned()
    }

    /// Records that `order` of `entity` committed.
    pub(crate) fn record(&mut self, entity: &str, order: Mark) {
        let mark = match self.mark(entity) {
            Some(mark) if order.at_or_below(mark).is_some() => mark.clone().max(order),
            _ => order,
        };
        self.previous.remove(entity);
        self.current.insert(entity.to_owned(), mark);
        if self.current.len() >= self.generation {
            self.previous = std::mem::take(&mut self.current);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox::Lsn;

    fn seed(ms: i64, id: i64) -> Mark {
        Mark::Seed(ms, id)
    }

    fn text(ms: i64, lsn: u64, index: u32) -> Mark {
        Mark::Committed {
            created_at_ms: ms,
            position: Some(Position {
                commit_lsn: Lsn(lsn),
                index,
            }),
            ordering_key: format!("{ms:013}:id-{lsn}-{index}"),
        }
    }

    #[test]
    fn reports_keys_that_do_not_increase_per_entity() {
        let mut order = EntityOrder::new(100);
        assert_eq!(order.regression("a", &seed(10, 1)), None);
        order.record("a", seed(10, 1));
        assert_eq!(order.regression("a", &seed(10, 2)), None);
        assert_eq!(order.regression("b", &seed(5, 2)), None, "another entity");
        assert_eq!(
            order.regression("a", &seed(9, 3)),
            Some(seed(10, 1)),
            "earlier time"
        );
        assert_eq!(
            order.regression("a", &seed(10, 1)),
            Some(seed(10, 1)),
            "equal"
        );
        // An out-of-order event does not lower the mark.
        order.record("a", seed(20, 5));
        order.record("a", seed(15, 6));
        assert_eq!(order.regression("a", &seed(18, 7)), Some(seed(20, 5)));
        // Before 1970 sorts numerically, not as text.
        order.record("c", seed(-5, 1));
        assert_eq!(order.regression("c", &seed(3, 2)), None);
        assert_eq!(
            seed(-5, 1).ordering_key(),
            "-000000000005:00000000000000000001"
        );
    }

    #[test]
    fn text_ids_are_checked_by_time_and_commit_position_never_by_id_bytes() {
        let mut order = EntityOrder::new(100);
        order.record("a", text(10, 100, 0));
        // Same millisecond, later in commit order: in order whatever the ids' bytes.
        assert_eq!(order.regression("a", &text(10, 100, 1)), None);
        order.record("a", text(10, 100, 1));
        assert_eq!(order.regression("a", &text(10, 200, 0)), None);
        // The time went backwards.
        let report = order.regression("a", &text(9, 300, 0)).unwrap();
        assert_eq!(report.ordering_key(), "0000000000010:id-100-1");
        // Not in commit order (a reordered stream).
        assert!(order.regression("a", &text(11, 100, 0)).is_some());
        // Without positions only the time counts.
        let no_position = Mark::Committed {
            created_at_ms: 10,
            position: None,
            ordering_key: String::new(),
        };
        assert_eq!(order.regression("a", &no_position), None);
        // Another kind for the same entity starts a new mark, unchecked (O3).
        assert_eq!(order.regression("a", &seed(1, 1)), None);
        order.record("a", seed(1, 1));
        assert_eq!(order.regression("a", &seed(1, 1)), Some(seed(1, 1)));
    }

    #[test]
    fn remembers_a_bounded_number_of_entities() {
        let mut order = EntityOrder::new(4);
        for entity in 0..1000 {
            order.record(&entity.to_string(), seed(1, entity));
            assert!(order.current.len() + order.previous.len() <= 4);
        }
        // The most recent ones are still checked.
        assert_eq!(order.regression("999", &seed(0, 0)), Some(seed(1, 999)));
        // An entity processed again moves to the current generation.
        order.record("998", seed(2, 1));
        assert_eq!(order.regression("998", &seed(1, 0)), Some(seed(2, 1)));
    }
}
