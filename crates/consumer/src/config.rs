//! What a consumer consumes, and how.

use std::num::NonZeroU64;
use std::time::Duration;

use outbox::template::{SubjectTemplate, DEFAULT_TEMPLATE};

use crate::error::SetupError;

/// [`Config::batch_size`]'s default.
pub const DEFAULT_BATCH_SIZE: usize = 100;

/// [`Config::max_attempts`]'s default.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;

/// What happens to an event whose handler failed [`Config::max_attempts`] times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFailure {
    /// Park it: record it with its dedupe key in [`Config::parked_table`], acknowledge it and
    /// go on; later events of its entity are parked behind it (not handled) until an operator
    /// re-drives or discards the entity's parked events (docs/consumers.md). The default: an
    /// unattended consumer keeps its shard's other entities flowing, loses nothing, and shows
    /// the parked events in a table and a metric.
    #[default]
    Park,
    /// Stop: [`crate::Consumer::run`] returns [`crate::Error::Handler`] naming the event,
    /// which is not acknowledged (the next start tries it again).
    Stop,
}

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
    /// The relay's subject template (`OUTBOX_RELAY_SUBJECT_TEMPLATE`, `--subject-template`;
    /// the default [`DEFAULT_TEMPLATE`], `{prefix}.{shard}.{event_type}`; the debezium
    /// preset's is `{prefix}.{aggregatetype}.{shard}`). It must equal the relay's: shard
    /// `n`'s durable consumer filters the template's subjects of shard `n`
    /// ([`Config::filter_subject`]), and with another template it would receive nothing.
    pub subject_template: String,
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
    /// How long a message whose handler failed waits before its first redelivery; the
    /// delay doubles with each further failure, up to [`Config::retry_delay_max`].
    pub retry_delay: Duration,
    /// The longest delay between two attempts of a failing event.
    pub retry_delay_max: Duration,
    /// How many times the handler may fail on one event (counted by the shard worker since
    /// it started) before [`Config::on_failure`] decides. `u32::MAX`: retried forever,
    /// holding its shard.
    pub max_attempts: u32,
    /// What happens to an event once its handler failed `max_attempts` times.
    pub on_failure: OnFailure,
    /// The table parked events are recorded in (`sql/consumer.sql`), optionally
    /// schema-qualified; needed with [`OnFailure::Park`] only.
    pub parked_table: String,
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
            subject_template: DEFAULT_TEMPLATE.into(),
            partitions: NonZeroU64::new(12).unwrap_or(NonZeroU64::MIN),
            shards: None,
            processed_table: "processed_events".into(),
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_secs(5),
            retry_delay_max: Duration::from_secs(60),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            on_failure: OnFailure::Park,
            parked_table: "parked_events".into(),
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

    /// The subjects of `shard`: `{prefix}.{shard}.>` under the default template (the
    /// filter durable consumers always had), else the template's filter of the shard
    /// (`{prefix}.*.{shard}` for `{prefix}.{aggregatetype}.{shard}`).
    pub fn filter_subject(&self, shard: u64) -> String {
        match self.template() {
            Ok(template) if !template.is_default() => {
                template.shard_filter(&self.subject_prefix, Some(shard))
            }
            _ => format!("{}.{shard}.>", self.subject_prefix),
        }
    }

    /// [`Config::subject_template`], parsed; the error names the setting.
    pub fn template(&self) -> Result<SubjectTemplate, SetupError> {
        SubjectTemplate::parse(&self.subject_template).map_err(|error| {
            SetupError::Config(format!(
                "subject_template: {error}; set it to the relay's subject template \
                 (OUTBOX_RELAY_SUBJECT_TEMPLATE, default {DEFAULT_TEMPLATE})"
            ))
        })
    }

    /// Checks every value; the error names the value and what is accepted.
    pub fn validate(&self) -> Result<(), SetupError> {
        self.validate_names()?;
        self.validate_timing()?;
        self.shard_list().map(|_| ())
    }

    /// The names: consumer, stream, prefix, tables.
    fn validate_names(&self) -> Result<(), SetupError> {
        if self.name.is_empty()
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return invalid(format!(
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
            return invalid(format!(
                "stream name {:?} must be non-empty, without '.', '*', '>', slashes or whitespace",
                self.stream
            ));
        }
        outbox::subject::validate_prefix(&self.subject_prefix).or_else(invalid)?;
        self.template()?;
        for (field, table) in [
            ("processed_table", &self.processed_table),
            ("parked_table", &self.parked_table),
        ] {
            if !is_table_name(table) {
                return invalid(format!(
                    "{field} {table:?} must be a plain table name, optionally schema-qualified \
                     (letters, digits, '_')"
                ));
            }
        }
        Ok(())
    }

    /// The durations and sizes.
    fn validate_timing(&self) -> Result<(), SetupError> {
        if self.ack_wait < Duration::from_millis(100) {
            return invalid(format!(
                "ack_wait {:?} is too short: at least 100ms (JetStream redelivers unacked \
                 messages after it)",
                self.ack_wait
            ));
        }
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return invalid(format!(
                "batch_size {} must be between 1 and {MAX_BATCH_SIZE}",
                self.batch_size
            ));
        }
        if self.batch_wait > self.ack_wait / 2 {
            return invalid(format!(
                "batch_wait {:?} must be at most half of ack_wait {:?} (messages waiting in a \
                 batch would be redelivered)",
                self.batch_wait, self.ack_wait
            ));
        }
        if self.retry_delay_max < self.retry_delay {
            return invalid(format!(
                "retry_delay_max {:?} must be at least retry_delay {:?}",
                self.retry_delay_max, self.retry_delay
            ));
        }
        if self.max_attempts == 0 {
            return invalid("max_attempts must be at least 1".into());
        }
        if self.order_capacity == 0 {
            return invalid("order_capacity must be at least 1".into());
        }
        Ok(())
    }

    /// How long the event whose handler failed for the `attempts`-th time waits before its
    /// next attempt: `retry_delay` doubled per earlier failure, at most `retry_delay_max`.
    pub fn retry_delay_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(31);
        self.retry_delay
            .saturating_mul(1 << doublings)
            .min(self.retry_delay_max)
    }
}

fn invalid(message: String) -> Result<(), SetupError> {
    Err(SetupError::Config(message))
}

/// A plain table name, optionally schema-qualified: letters, digits and `_`.
fn is_table_name(table: &str) -> bool {
    !table.is_empty()
        && table.split('.').count() <= 2
        && table.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_delay_doubles_up_to_its_cap() {
        let config = Config::new("ledger");
        let delays: Vec<u64> = (1..=7)
            .map(|attempts| config.retry_delay_after(attempts).as_secs())
            .collect();
        assert_eq!(delays, [5, 10, 20, 40, 60, 60, 60]);
        assert_eq!(config.retry_delay_after(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn defaults_are_the_relays_and_valid() {
        let config = Config::new("ledger");
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.shard_list().unwrap(), (0..12).collect::<Vec<_>>());
        assert_eq!(config.durable(3), "ledger-3");
        assert_eq!(config.filter_subject(3), "outbox.3.>");
    }

    #[test]
    fn a_subject_template_gives_the_shard_filters_and_a_bad_one_is_named() {
        let mut config = Config::new("ledger");
        config.subject_prefix = "app".into();
        config.subject_template = "{prefix}.{aggregatetype}.{shard}".into();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.filter_subject(3), "app.*.3");
        config.subject_template = "{prefix}.events.{shard}.{event_type}".into();
        assert_eq!(config.filter_subject(0), "app.events.0.*");
        // The default spelled out keeps the durable consumers' filter.
        config.subject_template = "{prefix}.{shard}.{event_type}".into();
        assert_eq!(config.filter_subject(3), "app.3.>");
        config.subject_template = "{prefix}.{event_type}".into();
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("subject_template"), "{error}");
        assert!(error.contains("{shard}"), "{error}");
        assert!(error.contains("OUTBOX_RELAY_SUBJECT_TEMPLATE"), "{error}");
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
        assert!(with(|c| c.parked_table = "a b".into()).contains("parked_table"));
        assert!(with(|c| c.max_attempts = 0).contains("max_attempts"));
        assert!(with(|c| c.retry_delay_max = Duration::from_secs(1)).contains("retry_delay_max"));
        let mut schema = Config::new("ledger");
        schema.processed_table = "billing.processed_events".into();
        assert_eq!(schema.validate(), Ok(()));
    }
}
