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
    /// A transient error.
    pub fn transient(error: impl Into<anyhow::Error>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            error: error.into(),
        }
    }

    /// A permanent error.
    pub fn permanent(error: impl Into<anyhow::Error>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            error: error.into(),
        }
    }

    /// A setup error: permanent, and the process exits with status 2.
    pub fn setup(error: impl Into<anyhow::Error>) -> Self {
        Self {
            kind: ErrorKind::Setup,
            error: error.into(),
        }
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
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#}", self.error)
    }
}

impl From<replication::Error> for RelayError {
    fn from(error: replication::Error) -> Self {
        let kind = if error.is_transient() {
            ErrorKind::Transient
        } else {
            ErrorKind::Permanent
        };
        Self {
            kind,
            error: error.into(),
        }
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
        if transient {
            Self::transient(error)
        } else {
            Self::permanent(error)
        }
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
