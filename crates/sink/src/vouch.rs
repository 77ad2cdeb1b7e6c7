//! What the stream holds of a session's replay (`crate::resume` S4): the run of messages the
//! replayed events at or before the tail's position are compared with, read from JetStream.
//!
//! # Invariants
//! - RV1 An event is vouched for only by a message of the run that is it
//!   ([`crate::resume::seek`], [`crate::resume::vouch`]), sought from where the search for the
//!   event before it ended; the run is found by walking back from the tail
//!   ([`crate::resume::walks_past`]) once the first replayed event is known, and read forward
//!   in order, once. Reads go [`READ_AHEAD`] messages at a time, so memory is bounded whatever the
//!   run's length.
//! - RV2 The first event the run does not hold (the run's end reached without it, or a
//!   message that cannot be read) ends the comparison for the session, logged once with what
//!   differed: nothing after it is skipped (S4). A read that fails is never taken for a
//!   message that vouches.

use std::collections::VecDeque;

use async_nats::jetstream::{self, stream::Stream};
use futures::future::join_all;
use outbox::{OutboxEvent, Position};
use tracing::{info, warn};

use crate::resume::{seek, Lineage, Mark, Walk};

/// Messages read at once, walking back or reading the run forward.
pub const READ_AHEAD: u64 = 64;

/// Where a session compares replayed events with the stream (S4).
#[derive(Debug, Clone)]
pub struct Compare {
    /// The stream.
    pub stream: String,
    /// Events at or before this position (the tail's) are compared.
    pub through: Position,
    /// The stream's last sequence (the tail's).
    pub last_sequence: u64,
    /// The session's history.
    pub lineage: Lineage,
}

/// A session's comparison of its replayed events with the stream's run (RV1, RV2).
pub(crate) struct Vouching {
    compare: Compare,
    jetstream: jetstream::Context,
    state: State,
    /// Events vouched for so far.
    vouched: u64,
}

enum State {
    /// The run is found when the first event to compare arrives.
    Unlocated,
    /// The run's messages from `next` on; `read` holds those read ahead.
    Reading {
        handle: Box<Stream<()>>,
        next: u64,
        read: VecDeque<(u64, Result<Mark, String>)>,
    },
    /// The comparison ended (RV2), or every event it covers was vouched for.
    Ended,
}

impl Vouching {
    pub(crate) fn new(compare: Compare, jetstream: jetstream::Context) -> Self {
        Vouching {
            compare,
            jetstream,
            state: State::Unlocated,
            vouched: 0,
        }
    }

    /// Whether the comparison is over (RV2).
    pub(crate) fn ended(&self) -> bool {
        matches!(self.state, State::Ended)
    }

    /// Whether the stream's run holds `event` (S4), sought from where the search for the event
    /// before it ended: `true` means it is stored and is skipped. `false` for an event past the tail's position, and from the
    /// first event the run does not vouch for on (RV2).
    pub(crate) async fn holds(&mut self, event: &OutboxEvent) -> bool {
        if event.position > self.compare.through || matches!(self.state, State::Ended) {
            self.end_quietly();
            return false;
        }
        if matches!(self.state, State::Unlocated) {
            match self.locate(event.position).await {
                Ok(state) => self.state = state,
                Err(why) => {
                    self.end(event, &why);
                    return false;
                }
            }
        }
        let found = self.search(event).await;
        match found {
            Ok(()) => {
                self.vouched += 1;
                if event.position == self.compare.through {
                    self.end_quietly();
                }
                true
            }
            Err(why) => {
                self.end(event, &why);
                false
            }
        }
    }

    /// S4: seeks `event` in the run from where the last search ended, passing over messages
    /// that are not it; `Err` says why the run does not hold it (RV2).
    async fn search(&mut self, event: &OutboxEvent) -> Result<(), String> {
        let mut first_miss: Option<String> = None;
        loop {
            match self.next().await {
                Some((sequence, Ok(mark))) => match seek(&mark, event, &self.compare.lineage) {
                    Ok(()) => return Ok(()),
                    Err(why) => {
                        first_miss.get_or_insert_with(|| {
                            let id = mark
                                .claim
                                .id
                                .as_ref()
                                .map_or_else(|| "none".to_owned(), ToString::to_string);
                            format!(
                                "the message at stream sequence {sequence} (outbox id {id}) is not it: {why}"
                            )
                        });
                    }
                },
                // A read that fails is never taken for a message that vouches (RV2).
                Some((sequence, Err(why))) => {
                    return Err(format!(
                        "its message at stream sequence {sequence} cannot be read: {why}"
                    ))
                }
                None => {
                    return Err(format!(
                        "the stream's run of replayed events, to its last sequence {}, does not hold it{}",
                        self.compare.last_sequence,
                        first_miss
                            .as_deref()
                            .map_or_else(String::new, |miss| format!("; {miss}"))
                    ))
                }
            }
        }
    }

    /// Walks back from the tail to the run's first message: the one after the first message
    /// not of this history at or after `first` (RV1).
    async fn locate(&self, first: Position) -> Result<State, String> {
        let handle = self
            .jetstream
            .get_stream_no_info(&self.compare.stream)
            .await
            .map_err(|e| format!("cannot open stream {}: {e}", self.compare.stream))?;
        let mut walk = Walk::from_tail(self.compare.last_sequence, first);
        let mut sequence = self.compare.last_sequence;
        'walk: while sequence > 0 {
            let low = sequence.saturating_sub(READ_AHEAD - 1).max(1);
            for (at, mark) in read(&handle, low..=sequence).await.into_iter().rev() {
                if !walk.step(at, &mark, &self.compare.lineage) {
                    break 'walk;
                }
            }
            sequence = low - 1;
        }
        Ok(State::Reading {
            handle: Box::new(handle),
            next: walk.start(),
            read: VecDeque::new(),
        })
    }

    /// The run's next message, reading [`READ_AHEAD`] at a time; `None` past the tail.
    async fn next(&mut self) -> Option<(u64, Result<Mark, String>)> {
        let last = self.compare.last_sequence;
        let State::Reading { handle, next, read } = &mut self.state else {
            return None;
        };
        if read.is_empty() && *next <= last {
            let to = (*next + READ_AHEAD - 1).min(last);
            read.extend(self::read(handle, *next..=to).await);
            *next = to + 1;
        }
        read.pop_front()
    }

    /// RV2: the comparison ends at `event`, with what differed.
    fn end(&mut self, event: &OutboxEvent, why: &str) {
        warn!(
            outbox_id = %event.id,
            commit_lsn = %event.position.commit_lsn,
            index = event.position.index,
            vouched = self.vouched,
            reason = %why,
            "the stream does not hold this replayed event at its place (a database restored from a backup and written since, another writer's message, or a message deleted from the stream): it and every later event are published, one at a time while the stream may hold them already (duplicates are answered as such within the duplicate window)"
        );
        self.state = State::Ended;
    }

    /// The comparison is over: every event it covered was vouched for.
    fn end_quietly(&mut self) {
        if !matches!(self.state, State::Ended) && self.vouched > 0 {
            info!(
                vouched = self.vouched,
                "replayed events the stream holds, compared one by one, skipped"
            );
        }
        self.state = State::Ended;
    }
}

/// The marks of `sequences` in `handle`, in order, read concurrently.
async fn read(
    handle: &Stream<()>,
    sequences: std::ops::RangeInclusive<u64>,
) -> Vec<(u64, Result<Mark, String>)> {
    join_all(sequences.map(|sequence| async move {
        let mark = handle
            .get_raw_message(sequence)
            .await
            .map(|message| Mark::of(&message))
            .map_err(|e| e.to_string());
        (sequence, mark)
    }))
    .await
}
