//! The relay's errors, split by what happens next: a transient error restarts the pipeline
//! from the slot's confirmed position after a backoff; a permanent one stops the process
//! with a non-zero exit and a message that names the problem and the fix: exit status 2
//! for a setup error (a check at start found the database or stream set up wrongly, like
//! invalid configuration), 1 for any other.

use std::fmt;

/// An error of the relay.
#[derive(Debug)]
pub struct RelayError {
    /// Whether retrying can help.
    pub kind: ErrorKind,
    /// The message, with the fix where the operator can apply one.
    pub error: anyhow::Error,
    /// Which side failed (the `target` of `outbox_relay_reconnects_total`): Postgres unless
    /// said otherwise ([`RelayError::at`]); NATS for every sink error.
    pub target: Target,
}

/// The side of the relay an error comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Postgres: the lease, the control connection, the replication stream.
    Postgres,
    /// NATS: connecting, the stream's checks and tail, publishing and acks.
    Nats,
}

/// What the caller must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Reconnect and resume from the confirmed position.
    Transient,
    /// Stop for an operator.
    Permanent,
    /// Stop for an operator: a check at start found the setup wrong (exit status 2).
    Setup,
}

impl RelayError {
    fn new(kind: ErrorKind, error: impl Into<anyhow::Error>) -> Self {
        Self {
            kind,
            error: error.into(),
            target: Target::Postgres,
        }
    }

    /// A transient error.
    pub fn transient(error: impl Into<anyhow::Error>) -> Self {
        Self::new(ErrorKind::Transient, error)
    }

    /// A permanent error.
    pub fn permanent(error: impl Into<anyhow::Error>) -> Self {
        Self::new(ErrorKind::Permanent, error)
    }

    /// A setup error: permanent, and the process exits with status 2.
    pub fn setup(error: impl Into<anyhow::Error>) -> Self {
        Self::new(ErrorKind::Setup, error)
    }

    /// The same error, from `target`'s side.
    pub fn at(mut self, target: Target) -> Self {
        self.target = target;
        self
    }

    /// Whether strict mode's fence refused a publish: the next session re-syncs from the
    /// stream's tail.
    pub fn is_resync(&self) -> bool {
        self.error
            .downcast_ref::<sink::SinkError>()
            .is_some_and(sink::SinkError::is_fence_refusal)
    }

    /// Whether the session ended because its NATS server went into lame-duck mode (sink
    /// P12): not a failure.
    pub fn is_lame_duck(&self) -> bool {
        self.error
            .downcast_ref::<sink::SinkError>()
            .is_some_and(sink::SinkError::is_lame_duck)
    }

    /// Whether retrying can help.
    pub fn is_transient(&self) -> bool {
        self.kind == ErrorKind::Transient
    }

    /// The process's exit status when this error stops it: 2 for a setup error, else 1.
    pub fn exit_code(&self) -> u8 {
        match self.kind {
            ErrorKind::Setup => 2,
            ErrorKind::Transient | ErrorKind::Permanent => 1,
        }
    }
}

impl fmt::Display for RelayError {
    /// The error and its causes, `: `-separated, each said once: a cause whose text the
    /// line already holds (an error that prints its source and also returns it as its
    /// `source()`) is not repeated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.error.to_string();
        for cause in self.error.chain().skip(1) {
            let cause = cause.to_string();
            if !line.contains(&cause) {
                line.push_str(": ");
                line.push_str(&cause);
            }
        }
        f.write_str(&line)
    }
}

impl From<replication::Error> for RelayError {
    fn from(error: replication::Error) -> Self {
        let kind = if error.is_transient() {
            ErrorKind::Transient
        } else {
            ErrorKind::Permanent
        };
        Self::new(kind, error)
    }
}

impl From<sink::SinkError> for RelayError {
    /// Poison is permanent, everything else is retried; the sink's advice (the fix for
    /// poison, what a fence refusal means) goes with it.
    fn from(error: sink::SinkError) -> Self {
        let transient = error.is_transient();
        let advice = error.advice();
        let mut error = anyhow::Error::new(error);
        if let Some(advice) = advice {
            error = error.context(advice);
        }
        let error = if transient {
            Self::transient(error)
        } else {
            Self::permanent(error)
        };
        error.at(Target::Nats)
    }
}

impl From<outbox::FrameError> for RelayError {
    /// A protocol violation is retried (D7); everything else stops for an operator, with the
    /// ways forward for an insert the relay cannot place (D6).
    fn from(error: outbox::FrameError) -> Self {
        if error.is_transient() {
            return Self::transient(error);
        }
        let advice = match &error {
            outbox::FrameError::UnknownRelation(unplaced) => Some(format!(
                "it may be a partition of {table} detached or dropped since (its inserts committed \
                 before the publication had publish_via_partition_root = true), or one attached \
                 after the session started. The relay stops rather than skip it: if {relation} is a \
                 partition of {table} now, restart the relay; if it was one, attach it again \
                 (ALTER TABLE {table_sql} ATTACH PARTITION {relation_sql} FOR VALUES …) and \
                 restart; if it never was, publish it too (ALTER PUBLICATION {publication_sql} ADD \
                 TABLE {relation_sql};) and restart; if it was dropped, its events can only be \
                 skipped deliberately, with the rest of its transaction, by advancing the slot past \
                 {commit_lsn} (pg_replication_slot_advance)",
                table = unplaced.table,
                relation = unplaced.relation,
                commit_lsn = unplaced.commit_lsn,
                table_sql = crate::config::Table::new(unplaced.table.clone()).sql(),
                relation_sql = crate::config::Table::new(unplaced.relation.clone()).sql(),
                publication_sql = replication::quote_identifier(&unplaced.publication),
            )),
            _ => None,
        };
        let error = anyhow::Error::new(error);
        Self::permanent(match advice {
            Some(advice) => error.context(advice),
            None => error,
        })
    }
}

/// Shorthand.
pub type Result<T, E = RelayError> = std::result::Result<T, E>;

impl std::error::Error for RelayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // Display already prints the whole chain; expose the cause for callers that walk it.
        self.error.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("could not connect to h:1: {source}")]
    struct Connect {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = RelayError::transient(Connect { source: refused() });
        assert_eq!(error.to_string(), "could not connect to h:1: refused");
        let error =
            RelayError::transient(anyhow::Error::new(refused()).context("reading the slot"));
        assert_eq!(error.to_string(), "reading the slot: refused");
    }
}
