//! What a running consumer shows: Prometheus metrics ([`Metrics::encode`], the text format)
//! and its readiness ([`Metrics::readiness`]). docs/consumers.md lists every metric.
//!
//! # Invariants
//! - CM1 Counters only grow and count what [`crate::Stats`] counts, per shard where the label
//!   says so; `outbox_consumer_pending` is JetStream's `num_pending` as the shard's last
//!   delivered message reported it (messages of the shard not yet delivered to it).
//! - CM2 Ready means every shard this process consumes has a running session (its durable
//!   consumer exists and it pulls, with a Postgres connection when it started): a shard
//!   waiting on Postgres or NATS is named in the answer.
//! - CM3 Nothing served carries a payload or a secret: labels are shard numbers and fixed
//!   kinds.

use std::sync::atomic::AtomicI64;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The label of a per-shard metric.
type Shard = [(&'static str, String); 1];
/// The label of a metric by kind.
type Kind = [(&'static str, &'static str); 1];

fn shard(shard: u64) -> Shard {
    [("shard", shard.to_string())]
}

/// What failed (`outbox_consumer_failures_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failed {
    /// A handler's error or panic (the transaction rolled back).
    Handler,
    /// Postgres (a statement, a commit, a connection).
    Postgres,
    /// NATS or JetStream (a shard session ended).
    Nats,
    /// A message that is not a valid event of its shard (the consumer stops).
    Message,
}

/// What is tried again (`outbox_consumer_retries_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// An event whose handler failed, released for redelivery after `retry_delay`.
    Event,
    /// A batch kept in hand after Postgres failed.
    Batch,
    /// A shard session restarted after NATS failed.
    Session,
}

/// Why events were parked (`outbox_consumer_parked_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parked {
    /// The handler failed on it `max_attempts` times.
    Failed,
    /// An earlier event of its entity is parked.
    Behind,
}

impl Parked {
    fn label(self) -> [(&'static str, &'static str); 1] {
        [(
            "reason",
            match self {
                Parked::Failed => "failed",
                Parked::Behind => "behind",
            },
        )]
    }
}

impl Failed {
    fn label(self) -> Kind {
        [(
            "kind",
            match self {
                Failed::Handler => "handler",
                Failed::Postgres => "postgres",
                Failed::Nats => "nats",
                Failed::Message => "message",
            },
        )]
    }
}

impl Retry {
    fn label(self) -> Kind {
        [(
            "kind",
            match self {
                Retry::Event => "event",
                Retry::Batch => "batch",
                Retry::Session => "session",
            },
        )]
    }
}

/// The consumer's metrics: shared, updated by the shard workers.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    processed: Family<Shard, Counter>,
    duplicates: Family<Shard, Counter>,
    out_of_order: Counter,
    failures: Family<Kind, Counter>,
    retries: Family<Kind, Counter>,
    parked: Family<Kind, Counter>,
    redriven: Counter,
    parked_events: Family<Shard, Gauge<i64, AtomicI64>>,
    failing_attempts: Family<Shard, Gauge<i64, AtomicI64>>,
    handler_seconds: Histogram,
    commit_seconds: Histogram,
    batch_events: Histogram,
    pending: Family<Shard, Gauge<i64, AtomicI64>>,
    up: Family<Shard, Gauge<i64, AtomicI64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let seconds = || Histogram::new(exponential_buckets(0.000_1, 2.0, 18));
        let mut metrics = Metrics {
            registry: Registry::with_prefix("outbox_consumer"),
            processed: Family::default(),
            duplicates: Family::default(),
            out_of_order: Counter::default(),
            failures: Family::default(),
            retries: Family::default(),
            parked: Family::default(),
            redriven: Counter::default(),
            parked_events: Family::default(),
            failing_attempts: Family::default(),
            handler_seconds: seconds(),
            commit_seconds: seconds(),
            batch_events: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            pending: Family::default(),
            up: Family::default(),
        };
        let registry = &mut metrics.registry;
        let m = (
            metrics.processed.clone(),
            metrics.duplicates.clone(),
            metrics.failures.clone(),
            metrics.retries.clone(),
            metrics.parked.clone(),
        );
        registry.register("processed", "Events whose handler ran and committed", m.0);
        registry.register(
            "duplicates",
            "Deliveries of events already processed: acknowledged without running the handler",
            m.1,
        );
        registry.register(
            "out_of_order",
            "Processed events whose ordering key did not increase for their entity",
            metrics.out_of_order.clone(),
        );
        registry.register(
            "failures",
            "Failures by kind: handler, postgres, nats, message",
            m.2,
        );
        registry.register(
            "retries",
            "What is tried again, by kind: event (released after its handler failed), batch (after postgres failed), session (after nats failed)",
            m.3,
        );
        registry.register(
            "parked",
            "Events parked, by reason: failed (the handler failed max_attempts times), behind (an earlier event of its entity is parked)",
            m.4,
        );
        registry.register(
            "redriven",
            "Parked events re-driven by an operator and committed",
            metrics.redriven.clone(),
        );
        registry.register(
            "parked_events",
            "Parked events of the shard in the parked table (at its last read, every 5 s)",
            metrics.parked_events.clone(),
        );
        registry.register(
            "failing_attempts",
            "Handler failures so far of the event the shard waits to retry (0: none)",
            metrics.failing_attempts.clone(),
        );
        registry.register(
            "handler_seconds",
            "Time the handler took per transaction",
            metrics.handler_seconds.clone(),
        );
        registry.register(
            "commit_seconds",
            "Time COMMIT took per transaction",
            metrics.commit_seconds.clone(),
        );
        registry.register(
            "batch_events",
            "Messages per transaction",
            metrics.batch_events.clone(),
        );
        registry.register(
            "pending",
            "Messages of the shard not yet delivered to it (JetStream num_pending at its last delivery)",
            metrics.pending.clone(),
        );
        registry.register(
            "shard_up",
            "1 while the shard's session runs",
            metrics.up.clone(),
        );
        metrics.zero_kinds();
        metrics
    }

    /// Every kind from 0, so that rates and alerts see the first one.
    fn zero_kinds(&self) {
        for kind in [
            Failed::Handler,
            Failed::Postgres,
            Failed::Nats,
            Failed::Message,
        ] {
            let _ = self.failures.get_or_create(&kind.label());
        }
        for kind in [Retry::Event, Retry::Batch, Retry::Session] {
            let _ = self.retries.get_or_create(&kind.label());
        }
        for reason in [Parked::Failed, Parked::Behind] {
            let _ = self.parked.get_or_create(&reason.label());
        }
    }

    /// The Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry);
        text
    }

    /// `Ok` when every shard of `shards` has a running session (CM2), else the reason.
    pub fn readiness(&self, shards: &[u64]) -> Result<(), String> {
        let down: Vec<String> = shards
            .iter()
            .filter(|&&s| self.up.get_or_create(&shard(s)).get() != 1)
            .map(u64::to_string)
            .collect();
        if down.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "shards without a running session (waiting for postgres or nats): {}",
                down.join(",")
            ))
        }
    }

    pub(crate) fn processed(&self, s: u64, n: u64) {
        if n > 0 {
            self.processed.get_or_create(&shard(s)).inc_by(n);
        }
    }

    pub(crate) fn duplicates(&self, s: u64, n: u64) {
        if n > 0 {
            self.duplicates.get_or_create(&shard(s)).inc_by(n);
        }
    }

    pub(crate) fn out_of_order(&self) {
        self.out_of_order.inc();
    }

    pub(crate) fn failed(&self, kind: Failed) {
        self.failures.get_or_create(&kind.label()).inc();
    }

    pub(crate) fn retried(&self, kind: Retry) {
        self.retries.get_or_create(&kind.label()).inc();
    }

    pub(crate) fn parked(&self, reason: Parked, n: u64) {
        self.parked.get_or_create(&reason.label()).inc_by(n);
    }

    pub(crate) fn redriven(&self) {
        self.redriven.inc();
    }

    pub(crate) fn parked_events(&self, s: u64, n: i64) {
        self.parked_events.get_or_create(&shard(s)).set(n);
    }

    pub(crate) fn failing_attempts(&self, s: u64, attempts: u32) {
        self.failing_attempts
            .get_or_create(&shard(s))
            .set(i64::from(attempts));
    }

    pub(crate) fn transaction(&self, events: usize, handler: Duration, commit: Duration) {
        self.batch_events.observe(events as f64);
        self.handler_seconds.observe(handler.as_secs_f64());
        self.commit_seconds.observe(commit.as_secs_f64());
    }

    pub(crate) fn pending(&self, s: u64, pending: u64) {
        self.pending
            .get_or_create(&shard(s))
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    pub(crate) fn up(&self, s: u64, up: bool) {
        self.up.get_or_create(&shard(s)).set(i64::from(up));
    }
}

/// The content type of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_encoded_and_readiness_names_the_shards_down() {
        let metrics = Metrics::new();
        metrics.processed(3, 5);
        metrics.failed(Failed::Handler);
        metrics.retried(Retry::Event);
        metrics.transaction(4, Duration::from_millis(2), Duration::from_millis(1));
        metrics.pending(3, 7);
        metrics.up(3, true);
        let text = metrics.encode();
        assert!(
            text.contains("outbox_consumer_processed_total{shard=\"3\"} 5"),
            "{text}"
        );
        assert!(text.contains("outbox_consumer_failures_total{kind=\"handler\"} 1"));
        assert!(text.contains("outbox_consumer_parked_total{reason=\"behind\"} 0"));
        assert!(text.contains("outbox_consumer_pending{shard=\"3\"} 7"));
        assert!(text.contains("outbox_consumer_batch_events_count 1"));
        assert_eq!(metrics.readiness(&[3]), Ok(()));
        let down = metrics.readiness(&[3, 4]).unwrap_err();
        assert!(down.ends_with(": 4"), "{down}");
    }
}
