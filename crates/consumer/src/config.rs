//! What a consumer consumes, and how.

use std::num::NonZeroU64;
use std::time::Duration;

use crate::error::SetupError;

/// [`Config::batch_size`]'s default.
pub const DEFAULT_BATCH_SIZE: usize = 100;

/// The largest accepted [`Config::batch_size`].
pub const MAX_BATCH_SIZE: usize = 10_000;

/// A consumer's configuration. [`Config::new`] gives the relay's defaults (stream `OUTBOX`,
/// prefix `outbox`, 12 partitions) for a consumer name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The application's consumer name: shard `n` is consumed through the durable JetStream
    /// consumer `{name}-{n}`. Letters, digits, `_` and `-`.
    pub name: String,
    /// The relay's stream (`OUTBOX_RELAY_STREAM`).
    pub stream: String,
    /// The relay's subject prefix (`OUTBOX_RELAY_SUBJECT_PREFIX`): shard `n` is
    /// `{prefix}.{n}.>`.
    pub subject_prefix: String,
    /// The relay's partition count (`OUTBOX_RELAY_PARTITIONS`). Every message is checked
    /// against it: a mismatch stops the consumer rather than leaving shards unconsumed.
    pub partitions: NonZeroU64,
    /// The shards this process consumes (`None`: all). Split shards between processes to
    /// scale out; each shard must be consumed by exactly one process at a time for its order
    /// to hold (two are still safe from duplicates).
    pub shards: Option<Vec<u64>>,
    /// The table recording processed `dedupe_key`s (`sql/consumer.sql`), optionally
    /// schema-qualified. One per consuming application.
    pub processed_table: String,
    /// How long JetStream waits for an ack before redelivering (the consumer's `ack_wait`).
    pub ack_wait: Duration,
    /// How long a message whose handler failed waits before its redelivery.
    pub retry_delay: Duration,
    /// How many entities each shard remembers for the ordering check.
    pub order_capacity: usize,
    /// At most this many messages of a shard are handled in one transaction (and are
    /// delivered but not yet acknowledged: the shard consumer's `max_ack_pending`). 1 is
    /// the unbatched consumer: one transaction and one ack per event.
    pub batch_size: usize,
    /// How long a shard waits for more messages once it holds one, before it handles what
    /// it holds. Zero (the default): a batch is what has been delivered when the shard is
    /// ready for it, so a lone event is handled at once and batches grow with the load.
    pub batch_wait: Duration,
}

impl Config {
    /// The relay's defaults, for the consumer `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Config {
            name: name.into(),
            stream: "OUTBOX".into(),
            subject_prefix: "outbox".into(),
            partitions: NonZeroU64::new(12).unwrap_or(NonZeroU64::MIN),
            shards: None,
            processed_table: "processed_events".into(),
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_secs(5),
            order_capacity: 100_000,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_wait: Duration::ZERO,
        }
    }

    /// The shards to consume, checked against the partition count.
    pub fn shard_list(&self) -> Result<Vec<u64>, SetupError> {
        let partitions = self.partitions.get();
        let mut shards = match &self.shards {
            None => (0..partitions).collect(),
            Some(shards) => shards.clone(),
        };
        if let Some(bad) = shards.iter().find(|&&s| s >= partitions) {
            return Err(SetupError::Config(format!(
                "shard {bad} does not exist with {partitions} partitions (shards are 0..{})",
                partitions - 1
            )));
        }
        shards.sort_unstable();
        shards.dedup();
        if shards.is_empty() {
            return Err(SetupError::Config(
                "no shard to consume: list at least one, or none for all".into(),
            ));
        }
        Ok(shards)
    }

    /// The durable consumer of `shard`.
    pub fn durable(&self, shard: u64) -> String {
        format!("{}-{shard}", self.name)
    }

    /// The subjects of `shard`.
    pub fn filter_subject(&self, shard: u64) -> String {
        format!("{}.{shard}.>", self.subject_prefix)
    }

    /// Checks every value; the error names the value and what is accepted.
    pub fn validate(&self) -> Result<(), SetupError> {
        let bad = |message: String| Err(SetupError::Config(message));
        if self.name.is_empty()
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return bad(format!(
                "consumer name {:?} must be non-empty letters, digits, '_' or '-'",
                self.name
            ));
        }
        if self.stream.is_empty()
            || self
                .stream
                .bytes()
                .any(|b| matches!(b, b'.' | b'*' | b'>' | b'/' | b'\\') || b <= b' ')
        {
            return bad(format!(
                "stream name {:?} must be non-empty, without '.', '*', '>', slashes or whitespace",
                self.stream
            ));
        }
        outbox::subject::validate_prefix(&self.subject_prefix).or_else(bad)?;
        let table_ok = !self.processed_table.is_empty()
            && self.processed_table.split('.').count() <= 2
            && self.processed_table.split('.').all(|part| {
                part.chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
        if !table_ok {
            return bad(format!(
                "processed_table {:?} must be a plain table name, optionally schema-qualified \
                 (letters, digits, '_')",
                self.processed_table
            ));
        }
        if self.ack_wait < Duration::from_millis(100) {
            return bad(format!(
                "ack_wait {:?} is too short: at least 100ms (JetStream redelivers unacked \
                 messages after it)",
                self.ack_wait
            ));
        }
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return bad(format!(
                "batch_size {} must be between 1 and {MAX_BATCH_SIZE}",
                self.batch_size
            ));
        }
        if self.batch_wait > self.ack_wait / 2 {
            return bad(format!(
                "batch_wait {:?} must be at most half of ack_wait {:?} (messages waiting in a \
                 batch would be redelivered)",
                self.batch_wait, self.ack_wait
            ));
        }
        if self.order_capacity == 0 {
            return bad("order_capacity must be at least 1".into());
        }
        self.shard_list().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_relays_and_valid() {
        let config = Config::new("ledger");
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.shard_list().unwrap(), (0..12).collect::<Vec<_>>());
        assert_eq!(config.durable(3), "ledger-3");
        assert_eq!(config.filter_subject(3), "outbox.3.>");
    }

    #[test]
    fn invalid_values_are_named() {
        let with = |change: fn(&mut Config)| {
            let mut config = Config::new("ledger");
            change(&mut config);
            config.validate().unwrap_err().to_string()
        };
        assert!(with(|c| c.name = "a.b".into()).contains("consumer name \"a.b\""));
        assert!(with(|c| c.stream = "A B".into()).contains("stream name"));
        assert!(with(|c| c.subject_prefix = "a.>".into()).contains("wildcard"));
        assert!(with(|c| c.processed_table = "x; drop".into()).contains("processed_table"));
        assert!(with(|c| c.shards = Some(vec![12])).contains("shard 12 does not exist"));
        assert!(with(|c| c.shards = Some(vec![])).contains("no shard"));
        assert!(with(|c| c.ack_wait = Duration::ZERO).contains("ack_wait"));
        assert!(with(|c| c.batch_size = 0).contains("batch_size 0"));
        assert!(with(|c| c.batch_wait = Duration::from_secs(20)).contains("batch_wait"));
        let mut schema = Config::new("ledger");
        schema.processed_table = "billing.processed_events".into();
        assert_eq!(schema.validate(), Ok(()));
    }
}
