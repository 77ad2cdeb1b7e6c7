//! Where a session resumes (P6): what the stream's tail, and what this process already saw
//! acknowledged, show stored; so what the session may skip, and where strict mode's fence
//! starts.
//!
//! Reading is [`read_tail`] (JetStream I/O); deciding is [`plan`], a pure function of what
//! was read and of the session, unit-tested here.
//!
//! # Invariants
//! - S1 A stored position is used to skip only if it belongs to the session's own history:
//!   the stored message carries the session's `Outbox-Source` (cluster, timeline, database,
//!   slot: `outbox::source`), and its commit LSN lies below the server's WAL end. Anything
//!   else is a [`Distrust`] for the caller to report; the session then relies on
//!   `Nats-Msg-Id` de-duplication for what it replays.
//! - S2 What an earlier session of the process saw acknowledged counts only for the source
//!   it was learned from, and only below the WAL end too.
//! - S3 Strict mode's fence starts at the stream's last sequence whatever the tail says:
//!   fencing never depends on trusting a position.

use std::time::Duration;

use async_nats::jetstream::{self, message::StreamMessage};
use outbox::{headers, Lsn, Position};

/// What the relay wrote into a stored message to identify it: its position in the commit
/// order and the history it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mark {
    /// `Outbox-Commit-Lsn` and `Outbox-Tx-Index`, when both are present and valid.
    pub position: Option<Position>,
    /// `Outbox-Source`.
    pub source: Option<String>,
}

impl Mark {
    /// The mark of a message read back from the stream.
    pub fn of(message: &StreamMessage) -> Mark {
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str());
        Mark {
            position: match (
                header(headers::OUTBOX_COMMIT_LSN),
                header(headers::OUTBOX_TX_INDEX),
            ) {
                (Some(lsn), Some(index)) => Position::from_headers(lsn, index),
                _ => None,
            },
            source: header(headers::OUTBOX_SOURCE).map(str::to_owned),
        }
    }
}

/// What a session reads of the stream before publishing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    /// The stream's last sequence.
    pub last_sequence: u64,
    /// The stream's `max_msg_size`, if limited.
    pub max_msg_size: Option<usize>,
    /// The stream's duplicate window.
    pub duplicate_window: Duration,
    /// The last message's mark, or why it could not be read; `None` for an empty stream or
    /// when it was not asked for.
    pub last: Option<Result<Mark, String>>,
}

impl Tail {
    /// The last message's position, whatever its source (for the guard against a slot
    /// dropped under a stream with history).
    pub fn last_position(&self) -> Option<Position> {
        self.last.as_ref()?.as_ref().ok()?.position
    }
}

/// The stream's state could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the state of stream {stream}: {reason}")]
pub struct TailError {
    /// The stream.
    pub stream: String,
    /// What JetStream reported.
    pub reason: String,
}

impl TailError {
    /// Always transient: the stream exists (bootstrap checked it) and the next session
    /// reads it again.
    pub fn is_transient(&self) -> bool {
        true
    }
}

/// Reads the stream's state and, with `read_last`, the mark of its last message.
pub async fn read_tail(
    jetstream: &jetstream::Context,
    stream: &str,
    read_last: bool,
) -> Result<Tail, TailError> {
    let failed = |e: &dyn std::fmt::Display| TailError {
        stream: stream.to_owned(),
        reason: e.to_string(),
    };
    let mut handle = jetstream.get_stream(stream).await.map_err(|e| failed(&e))?;
    let info = handle.info().await.map_err(|e| failed(&e))?;
    let last_sequence = info.state.last_sequence;
    let mut tail = Tail {
        last_sequence,
        max_msg_size: usize::try_from(info.config.max_message_size)
            .ok()
            .filter(|&n| n > 0),
        duplicate_window: info.config.duplicate_window,
        last: None,
    };
    if read_last && last_sequence > 0 {
        tail.last = Some(
            handle
                .get_raw_message(last_sequence)
                .await
                .map(|message| Mark::of(&message))
                .map_err(|e| e.to_string()),
        );
    }
    Ok(tail)
}

/// What the session is, for [`plan`].
#[derive(Debug, Clone, Copy)]
pub struct Session<'a> {
    /// Its `Outbox-Source`.
    pub source: &'a str,
    /// The server's WAL end when the session started (`IDENTIFY_SYSTEM`).
    pub wal_end: Lsn,
    /// What earlier sessions of this process saw acknowledged from `source`.
    pub acknowledged: Option<Position>,
    /// Strict mode (the relay is the stream's only writer).
    pub strict: bool,
}

/// Which stored position a [`Distrust`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The stream's last message.
    Tail,
    /// What an earlier session of this process saw acknowledged.
    Acknowledged,
}

/// Why a stored position was not used to skip (S1, S2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Distrust {
    /// The last message could not be read (purged, aged out).
    Unreadable {
        /// What JetStream reported.
        error: String,
    },
    /// The last message carries no outbox position (another writer).
    NoPosition,
    /// The last message came from another source: another timeline of the database (after
    /// a fail-over or a point-in-time restore), or another database or slot.
    OtherSource {
        /// The tail's `Outbox-Source`, if any.
        theirs: Option<String>,
    },
    /// The position's commit LSN lies at or beyond the server's WAL end: not this server's
    /// history (a restored-older database, or a message the relay did not write).
    BeyondWalEnd {
        /// Which position.
        stored: Stored,
        /// Its commit LSN.
        commit_lsn: Lsn,
    },
}

/// A session's resume plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Strict mode: the stream's last sequence, where the fence starts (S3).
    pub fence: Option<u64>,
    /// Events at or before this position are stored already: skip them (P6).
    pub skip_through: Option<Position>,
    /// Stored positions not used, and why (to be reported by the caller).
    pub distrust: Vec<Distrust>,
}

/// The resume plan for `session` given `tail` (S1–S3). Shared mode skips nothing and fences
/// nothing.
pub fn plan(tail: &Tail, session: &Session<'_>) -> Resume {
    let mut resume = Resume {
        fence: session.strict.then_some(tail.last_sequence),
        skip_through: None,
        distrust: Vec::new(),
    };
    if !session.strict {
        return resume;
    }
    // The tail's position, if it is of this session's source (S1).
    let from_tail = match &tail.last {
        None => Ok(None),
        Some(Err(error)) => Err(Distrust::Unreadable {
            error: error.clone(),
        }),
        Some(Ok(Mark { position: None, .. })) => Err(Distrust::NoPosition),
        Some(Ok(Mark {
            position: Some(position),
            source,
        })) => {
            if source.as_deref() == Some(session.source) {
                Ok(Some((Stored::Tail, *position)))
            } else {
                Err(Distrust::OtherSource {
                    theirs: source.clone(),
                })
            }
        }
    };
    let from_tail = from_tail.unwrap_or_else(|why| {
        resume.distrust.push(why);
        None
    });
    let acknowledged = session.acknowledged.map(|p| (Stored::Acknowledged, p));
    // Both only below the WAL end (S1, S2).
    let trusted =
        [from_tail, acknowledged]
            .into_iter()
            .flatten()
            .filter_map(|(stored, position)| {
                if position.commit_lsn < session.wal_end {
                    Some(position)
                } else {
                    resume.distrust.push(Distrust::BeyondWalEnd {
                        stored,
                        commit_lsn: position.commit_lsn,
                    });
                    None
                }
            });
    // Skip through the further of the two (P6).
    resume.skip_through = trusted.max();
    resume
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "7301/1/app/slot";

    fn at(lsn: u64, index: u32) -> Position {
        Position {
            commit_lsn: Lsn(lsn),
            index,
        }
    }

    fn tail(last: Option<Result<Mark, String>>) -> Tail {
        Tail {
            last_sequence: 42,
            max_msg_size: None,
            duplicate_window: Duration::from_secs(120),
            last,
        }
    }

    fn ours(position: Position) -> Option<Result<Mark, String>> {
        Some(Ok(Mark {
            position: Some(position),
            source: Some(SOURCE.to_owned()),
        }))
    }

    fn session(acknowledged: Option<Position>) -> Session<'static> {
        Session {
            source: SOURCE,
            wal_end: Lsn(1_000),
            acknowledged,
            strict: true,
        }
    }

    #[test]
    fn a_tail_of_our_own_history_is_skipped_through_and_the_fence_starts_at_it() {
        let resume = plan(&tail(ours(at(500, 3))), &session(None));
        assert_eq!(resume.fence, Some(42));
        assert_eq!(resume.skip_through, Some(at(500, 3)));
        assert!(resume.distrust.is_empty());
    }

    #[test]
    fn the_further_of_tail_and_acknowledged_is_skipped_through() {
        let resume = plan(&tail(ours(at(500, 3))), &session(Some(at(600, 0))));
        assert_eq!(resume.skip_through, Some(at(600, 0)));
        let resume = plan(&tail(ours(at(500, 3))), &session(Some(at(400, 9))));
        assert_eq!(resume.skip_through, Some(at(500, 3)));
    }

    #[test]
    fn a_tail_of_another_source_or_timeline_is_not_used() {
        let other = Some(Ok(Mark {
            position: Some(at(500, 3)),
            source: Some("7301/2/app/slot".to_owned()),
        }));
        let resume = plan(&tail(other), &session(None));
        assert_eq!(resume.skip_through, None);
        assert_eq!(
            resume.fence,
            Some(42),
            "the fence never depends on the tail"
        );
        assert_eq!(
            resume.distrust,
            vec![Distrust::OtherSource {
                theirs: Some("7301/2/app/slot".to_owned())
            }]
        );
    }

    #[test]
    fn positions_at_or_beyond_the_wal_end_are_not_used() {
        let resume = plan(&tail(ours(at(1_000, 0))), &session(Some(at(2_000, 0))));
        assert_eq!(resume.skip_through, None);
        assert_eq!(
            resume.distrust,
            vec![
                Distrust::BeyondWalEnd {
                    stored: Stored::Tail,
                    commit_lsn: Lsn(1_000)
                },
                Distrust::BeyondWalEnd {
                    stored: Stored::Acknowledged,
                    commit_lsn: Lsn(2_000)
                },
            ]
        );
    }

    #[test]
    fn an_unreadable_or_unpositioned_tail_is_reported_and_acknowledged_still_counts() {
        let resume = plan(
            &tail(Some(Err("no message found".into()))),
            &session(Some(at(7, 1))),
        );
        assert_eq!(resume.skip_through, Some(at(7, 1)));
        assert_eq!(
            resume.distrust,
            vec![Distrust::Unreadable {
                error: "no message found".into()
            }]
        );
        let resume = plan(&tail(Some(Ok(Mark::default()))), &session(None));
        assert_eq!(resume.distrust, vec![Distrust::NoPosition]);
    }

    #[test]
    fn an_empty_stream_skips_nothing_and_says_nothing() {
        let resume = plan(&tail(None), &session(None));
        assert_eq!(resume.skip_through, None);
        assert!(resume.distrust.is_empty());
    }

    #[test]
    fn shared_mode_neither_skips_nor_fences() {
        let mut shared = session(Some(at(7, 1)));
        shared.strict = false;
        let resume = plan(&tail(ours(at(500, 3))), &shared);
        assert_eq!(
            resume,
            Resume {
                fence: None,
                skip_through: None,
                distrust: vec![]
            }
        );
    }
}
