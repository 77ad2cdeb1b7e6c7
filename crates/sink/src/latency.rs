//! Latency histograms the acker fills and a metrics endpoint reads, and the acker's clock
//! for the transaction it acknowledges.
//!
//! Cheap by construction: the acker times once per transaction (commit → stored) and once
//! per run of events with the same `created_at` (created → stored; the rows of one
//! transaction usually share it, `now()` being the transaction's start), never per event;
//! an observation is a bucket search and three relaxed atomic additions.
//!
//! # Invariants
//! - L1 Only events this session published count: events skipped on resume (P6) were
//!   stored by an earlier session and are not timed.
//! - L2 A transaction is "stored" when the acker has JetStream's ack for every event of it:
//!   acks are awaited in publish order, so that is when the acker reaches its Commit, the
//!   moment its end position becomes confirmable (A1).
//! - L3 The oldest unconfirmed transaction's commit time is set while the acker awaits the
//!   acks of a transaction with events and cleared when it reaches its Commit; it outlives a
//!   failed session, whose next one replays the same transaction first.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Upper bounds of the latency buckets, in microseconds: 100 µs to 30 min.
pub const LATENCY_BUCKETS_US: [u64; 22] = [
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    300_000_000,
    600_000_000,
    1_800_000_000,
];

/// A latency histogram with [`LATENCY_BUCKETS_US`] (and `+Inf`), filled with
/// [`Latency::observe`], read with [`Latency::snapshot`].
#[derive(Debug, Default)]
pub struct Latency {
    /// Per bucket (not cumulative); the last one is `+Inf`.
    counts: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

/// What a [`Latency`] holds at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencySnapshot {
    /// `(upper bound in seconds, observations in this bucket)`, not cumulative, the last
    /// bound `+Inf`.
    pub buckets: Vec<(f64, u64)>,
    /// Sum of the observations, in seconds.
    pub sum_seconds: f64,
    /// Number of observations.
    pub count: u64,
}

impl Latency {
    /// Records `n` observations of `micros`.
    pub fn observe(&self, micros: u64, n: u64) {
        let bucket = LATENCY_BUCKETS_US.partition_point(|&bound| bound < micros);
        self.counts[bucket].fetch_add(n, Ordering::Relaxed);
        self.sum_us
            .fetch_add(micros.saturating_mul(n), Ordering::Relaxed);
    }

    /// The buckets, sum and count now (the count is the buckets' total, so the three agree).
    pub fn snapshot(&self) -> LatencySnapshot {
        let bounds = LATENCY_BUCKETS_US
            .iter()
            .map(|&us| us as f64 / 1e6)
            .chain(std::iter::once(f64::INFINITY));
        let buckets: Vec<(f64, u64)> = bounds
            .zip(&self.counts)
            .map(|(bound, count)| (bound, count.load(Ordering::Relaxed)))
            .collect();
        LatencySnapshot {
            count: buckets.iter().map(|(_, n)| n).sum(),
            sum_seconds: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            buckets,
        }
    }
}

/// Microseconds since the Unix epoch now.
pub fn unix_micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Microseconds from `then_us` to `now_us`, 0 if the clocks disagree (the commit time and
/// `created_at` come from the server's clock).
fn elapsed_us(then_us: i64, now_us: i64) -> u64 {
    u64::try_from(now_us.saturating_sub(then_us)).unwrap_or(0)
}

/// The acker's clock: times the transaction it acknowledges (L1–L3).
#[derive(Debug)]
pub(crate) struct TxnClock<'a> {
    commit_to_ack: &'a Latency,
    created_to_ack: &'a Latency,
    oldest_unconfirmed_us: &'a AtomicI64,
    /// The open transaction's commit time, microseconds since the Unix epoch.
    commit_time_us: i64,
    /// Whether the open transaction has an event (set as oldest unconfirmed, L3).
    has_events: bool,
    /// Whether this session published an event of it (L1).
    published: bool,
    /// Events acknowledged with the same `created_at` (ms), not yet observed.
    run: Option<(i64, u64)>,
}

impl<'a> TxnClock<'a> {
    pub(crate) fn new(
        commit_to_ack: &'a Latency,
        created_to_ack: &'a Latency,
        oldest_unconfirmed_us: &'a AtomicI64,
    ) -> Self {
        TxnClock {
            commit_to_ack,
            created_to_ack,
            oldest_unconfirmed_us,
            commit_time_us: 0,
            has_events: false,
            published: false,
            run: None,
        }
    }

    /// A transaction that committed at `commit_time_us` begins.
    pub(crate) fn begin(&mut self, commit_time_us: i64) {
        self.commit_time_us = commit_time_us;
        self.has_events = false;
        self.published = false;
    }

    /// The acker is about to wait for an event of the open transaction (L3).
    pub(crate) fn awaiting(&mut self) {
        if !self.has_events {
            self.has_events = true;
            self.oldest_unconfirmed_us
                .store(self.commit_time_us, Ordering::Relaxed);
        }
    }

    /// JetStream acknowledged an event this session published, created at `created_at_ms`.
    pub(crate) fn acked(&mut self, created_at_ms: i64) {
        self.published = true;
        if let Some((created, n)) = &mut self.run {
            if *created == created_at_ms {
                *n += 1;
                return;
            }
        }
        if let Some((created, n)) = self.run.replace((created_at_ms, 1)) {
            self.observe_created(created, n, unix_micros_now());
        }
    }

    /// The acker reached the open transaction's Commit: every event of it is stored (L2).
    pub(crate) fn commit(&mut self) {
        if self.published {
            let now = unix_micros_now();
            self.commit_to_ack
                .observe(elapsed_us(self.commit_time_us, now), 1);
            if let Some((created, n)) = self.run.take() {
                self.observe_created(created, n, now);
            }
        }
        if self.has_events {
            self.oldest_unconfirmed_us.store(0, Ordering::Relaxed);
        }
        self.has_events = false;
        self.published = false;
    }

    fn observe_created(&self, created_at_ms: i64, n: u64, now_us: i64) {
        let created_us = created_at_ms.saturating_mul(1000);
        self.created_to_ack
            .observe(elapsed_us(created_us, now_us), n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_whose_bound_holds_them() {
        let latency = Latency::default();
        latency.observe(100, 1); // exactly a bound: that bucket (le is inclusive)
        latency.observe(101, 2);
        latency.observe(u64::MAX / 4, 1); // beyond every bound: +Inf
        let snapshot = latency.snapshot();
        assert_eq!(snapshot.count, 4);
        assert_eq!(snapshot.buckets[0], (0.0001, 1));
        assert_eq!(snapshot.buckets[1], (0.00025, 2));
        assert_eq!(snapshot.buckets.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(snapshot.buckets.len(), LATENCY_BUCKETS_US.len() + 1);
    }

    #[test]
    fn a_transaction_is_timed_once_and_its_events_by_created_at_run() {
        let (commit, created, oldest) = (Latency::default(), Latency::default(), AtomicI64::new(0));
        let mut clock = TxnClock::new(&commit, &created, &oldest);
        let now = unix_micros_now();
        clock.begin(now - 2_000_000);
        clock.awaiting();
        assert_eq!(oldest.load(Ordering::Relaxed), now - 2_000_000, "L3");
        for created_at_ms in [now / 1000 - 5_000, now / 1000 - 5_000, now / 1000 - 1_000] {
            clock.awaiting();
            clock.acked(created_at_ms);
        }
        clock.commit();
        assert_eq!(
            oldest.load(Ordering::Relaxed),
            0,
            "L3: cleared at the commit"
        );
        assert_eq!(commit.snapshot().count, 1, "once per transaction");
        let created = created.snapshot();
        assert_eq!(created.count, 3, "every event counts");
        assert!(
            (10.9..12.5).contains(&created.sum_seconds),
            "5 + 5 + 1 s, give or take: {}",
            created.sum_seconds
        );

        // L1: a replayed transaction whose events were all skipped is not timed.
        clock.begin(now);
        clock.awaiting();
        clock.commit();
        assert_eq!(commit.snapshot().count, 1);
    }
}
