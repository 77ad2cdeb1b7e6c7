//! The per-entity ordering check.
//!
//! # Invariants
//! - O1 An event is out of order when an event of the same entity with a greater or equal
//!   `(created_at_ms, id)` (what `Outbox-Ordering-Key` sorts like, also before 1970) was
//!   processed before it by this shard worker. Only events whose handler committed count:
//!   duplicates and rolled-back attempts neither report nor move the mark.
//! - O2 Memory is bounded: at most `capacity` entities are remembered per shard (two
//!   generations of `capacity / 2`; the least recently processed are forgotten first). A
//!   forgotten entity's next event is not checked; nor is the first one after a restart.

use std::collections::HashMap;

/// The highest `(created_at_ms, id)` processed per entity, for a bounded number of entities.
#[derive(Debug)]
pub(crate) struct EntityOrder {
    current: HashMap<String, (i64, i64)>,
    previous: HashMap<String, (i64, i64)>,
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

    /// The mark `order` falls at or below, if any (O1).
    pub(crate) fn regression(&self, entity: &str, order: (i64, i64)) -> Option<(i64, i64)> {
        self.current
            .get(entity)
            .or_else(|| self.previous.get(entity))
            .copied()
            .filter(|&mark| order <= mark)
    }

    /// Records that `order` of `entity` committed.
    pub(crate) fn record(&mut self, entity: &str, order: (i64, i64)) {
        let mark = self
            .regression(entity, order)
            .map_or(order, |mark| mark.max(order));
        self.previous.remove(entity);
        self.current.insert(entity.to_owned(), mark);
        if self.current.len() >= self.generation {
            self.previous = std::mem::take(&mut self.current);
        }
    }
}

/// `{created_at_ms:013}:{id:020}`, the ordering key of a mark.
pub(crate) fn ordering_key((created_at_ms, id): (i64, i64)) -> String {
    outbox::compute_keys(id, "", "", created_at_ms).ordering_key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_keys_that_do_not_increase_per_entity() {
        let mut order = EntityOrder::new(100);
        assert_eq!(order.regression("a", (10, 1)), None);
        order.record("a", (10, 1));
        assert_eq!(order.regression("a", (10, 2)), None);
        assert_eq!(order.regression("b", (5, 2)), None, "another entity");
        assert_eq!(order.regression("a", (9, 3)), Some((10, 1)), "earlier time");
        assert_eq!(order.regression("a", (10, 1)), Some((10, 1)), "equal");
        // An out-of-order event does not lower the mark.
        order.record("a", (20, 5));
        order.record("a", (15, 6));
        assert_eq!(order.regression("a", (18, 7)), Some((20, 5)));
        // Before 1970 sorts numerically, not as text.
        order.record("c", (-5, 1));
        assert_eq!(order.regression("c", (3, 2)), None);
        assert_eq!(ordering_key((-5, 1)), "-000000000005:00000000000000000001");
    }

    #[test]
    fn remembers_a_bounded_number_of_entities() {
        let mut order = EntityOrder::new(4);
        for entity in 0..1000 {
            order.record(&entity.to_string(), (1, entity));
            assert!(order.current.len() + order.previous.len() <= 4);
        }
        // The most recent ones are still checked.
        assert_eq!(order.regression("999", (0, 0)), Some((1, 999)));
        // An entity processed again moves to the current generation.
        order.record("998", (2, 1));
        assert_eq!(order.regression("998", (1, 0)), Some((2, 1)));
    }
}
