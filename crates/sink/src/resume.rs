//! Where a session resumes (P6): which replayed events the stream already holds, so what the
//! session skips, and where strict mode's fence starts. And what a stored message says it is
//! ([`Claim`]), so that no decision rests on a message read back from the stream before it is
//! checked.
//!
//! Reading is [`read_tail`] and [`crate::vouch`] (JetStream I/O); deciding is [`plan`],
//! [`vouch`] and [`walks_past`], pure functions of what was read and of the session,
//! unit-tested here.
//!
//! # Invariants
//! - S1 A stored position is of the session's own history only when the stored message
//!   carries the session's `Outbox-Source` (cluster, timeline, database, slot:
//!   `outbox::source`). Anything else is a [`Distrust`] for the caller to report; the session
//!   then compares nothing with the stream and relies on `Nats-Msg-Id` de-duplication for
//!   what it replays (S6). A tail whose commit LSN lies at or beyond the server's WAL end (a
//!   database restored from an older backup) is reported too, but still compared through:
//!   S4 skips only what the stream holds at its place, so the events the restored history
//!   replays unchanged are skipped, and the first new one ends the comparison.
//! - S2 Nothing but the stream vouches for a replayed event: not the table (outbox tables are
//!   emptied by design: Debezium's remove-after-insert, a poller's clean-up, retention,
//!   TRUNCATE, dropped partitions), not what an earlier session of the process saw
//!   acknowledged (a stream can lose what it acknowledged: a purge, a restore of the NATS
//!   server's store).
//! - S3 Strict mode's fence starts at the stream's last sequence whatever the tail says:
//!   fencing never depends on trusting a position.
//! - S4 A replayed event is skipped only when the stream holds it ([`vouch`]): the session's
//!   replayed events at or before the tail's position ([`Resume::compare_through`]) are
//!   sought, in order, in the stream's run of messages that ends at the tail and starts after
//!   the last message, walking back from the tail, that is not of this history at or after
//!   the first replayed event's position ([`walks_past`]). Each search goes on from where the
//!   last one ended and passes over messages that are not the event ([`seek`]: a lost
//!   history's messages after a restore, at positions the new history reuses). The message
//!   must carry the event's position, a source of its history (S1, S5), its `Outbox-Id`,
//!   `Nats-Msg-Id` (the event's, or its dead-letter record's) and ordering key. The first
//!   event the run does not hold (a database restored from a backup and written past the old
//!   tail reuses ids, LSNs, source and timeline; another writer's message; a message deleted
//!   from the stream) ends the comparison for the session: nothing after it is skipped, so
//!   nothing is skipped that the replay did not vouch for, and no event is skipped after one
//!   the stream lacks. The table is read for nothing.
//! - S5 After a fail-over or a point-in-time restore (a new timeline), a stored position from
//!   an ancestor timeline counts as the session's own history (S1) only below the switch
//!   point where the current timeline's history ([`Lineage::history`], the server's
//!   `TIMELINE_HISTORY`, [`parse_timeline_history`]) left that timeline: the same cluster,
//!   database and slot, and its commit record starts before the switch point, so it was
//!   replayed into the new timeline unchanged. At or past the switch point (WAL the old
//!   primary wrote that the promoted server never received) it is never used to skip
//!   ([`Distrust::PastSwitchPoint`]), and a timeline not in the history (a sibling) is
//!   another source. S4 still compares what S5 admits.
//! - S6 The fence counts only what the stream stores (`crate::publisher` P5): an event the
//!   stream may hold already (at or before the tail's position and not vouched for by S4, or
//!   any event while the tail gave no position of this history, until the session's first
//!   publish stored as new) is published alone and its answer awaited; a duplicate answer
//!   leaves the fence at the stream's last sequence.

use std::time::Duration;

use async_nats::jetstream::{self, message::StreamMessage};
use outbox::{headers, EventId, Lsn, OutboxEvent, Position};

/// What the relay wrote into a stored message to identify it: its position in the commit
/// order, the history it belongs to, and the row it was published for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mark {
    /// `Outbox-Commit-Lsn` and `Outbox-Tx-Index`, when both are present and valid.
    pub position: Option<Position>,
    /// `Outbox-Source`.
    pub source: Option<String>,
    /// The row it claims to be.
    pub claim: Claim,
}

impl Mark {
    /// The mark of a message read back from the stream.
    pub fn of(message: &StreamMessage) -> Mark {
        let header = |name: &str| header(message, name);
        Mark {
            position: match (
                header(headers::OUTBOX_COMMIT_LSN),
                header(headers::OUTBOX_TX_INDEX),
            ) {
                (Some(lsn), Some(index)) => Position::from_headers(lsn, index),
                _ => None,
            },
            source: header(headers::OUTBOX_SOURCE).map(str::to_owned),
            claim: Claim::of(message),
        }
    }
}

/// Header `name` of `message`.
fn header<'a>(message: &'a StreamMessage, name: &str) -> Option<&'a str> {
    message.headers.get(name).map(|v| v.as_str())
}

/// Which outbox row a stored message says it was published for: what the relay writes into
/// every event message (`Outbox-Id`, `Nats-Msg-Id`, `Outbox-Ordering-Key`) and every
/// dead-letter record (the ordering key in its body). Anyone who may publish on the stream's
/// subjects can write these too, so a claim is only believed once checked against the event
/// the replay or the acker has for it ([`Claim::check`], [`Claim::is_row`]; S4, P8).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Claim {
    /// `Outbox-Id`.
    pub id: Option<EventId>,
    /// `Nats-Msg-Id`, as stored (percent-encoded for a header-hostile row).
    pub msg_id: Option<String>,
    /// `Outbox-Ordering-Key`, or a dead-letter record's `ordering_key`.
    pub ordering_key: Option<String>,
    /// A dead-letter record (it carries `Outbox-Dead-Letter-Reason`).
    pub dead_letter: bool,
}

impl Claim {
    /// The claim of a message read back from the stream.
    pub fn of(message: &StreamMessage) -> Claim {
        let header = |name: &str| header(message, name);
        let dead_letter = header(headers::OUTBOX_DEAD_LETTER_REASON).is_some();
        let ordering_key = if dead_letter {
            serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|body| body.get("ordering_key")?.as_str().map(str::to_owned))
        } else {
            header(headers::OUTBOX_ORDERING_KEY).map(str::to_owned)
        };
        // A uuid or text id (and the ordering key holding it) is percent-encoded on a
        // hostile row's message: read back decoded, as the row gives them.
        let kind = header(headers::OUTBOX_ID_KIND);
        let percent = header(headers::OUTBOX_ENCODING) == Some(outbox::encoding::PERCENT);
        let ordering_key = match (kind.is_some() && percent && !dead_letter, ordering_key) {
            (true, Some(key)) => outbox::encoding::decode(&key),
            (_, key) => key,
        };
        Claim {
            id: EventId::from_headers(header),
            msg_id: header(headers::NATS_MSG_ID).map(str::to_owned),
            ordering_key,
            dead_letter,
        }
    }

    /// Whether the message carries no row identity at all (not written by the relay).
    pub fn is_anonymous(&self) -> bool {
        self.id.is_none() && self.ordering_key.is_none()
    }

    /// Whether the message is the event of the row with `id` created at `created_at_ms` (or
    /// its dead-letter record): the same id and ordering key. With the `Nats-Msg-Id` the
    /// server matched (event type, entity, id), that is every key of the row (P8).
    pub fn is_row(&self, id: &EventId, created_at_ms: i64) -> bool {
        self.id.as_ref() == Some(id)
            && self.ordering_key.as_deref() == Some(id.ordering_key(created_at_ms).as_str())
    }

    /// Whether the message is what the relay publishes for `event` (S4): the same
    /// `Outbox-Id`, `Nats-Msg-Id` (of the event, or of its dead-letter record) and ordering
    /// key. `Err` says what differs, for the log.
    pub fn check(&self, event: &OutboxEvent) -> Result<(), String> {
        let msg_id = if self.dead_letter {
            crate::message::dead_letter_msg_id(event)
        } else {
            crate::message::msg_id(event)
        };
        let ordering_key = &event.keys.ordering_key;
        if self.id.as_ref() == Some(&event.id)
            && self.msg_id.as_deref() == Some(msg_id.as_str())
            && self.ordering_key.as_deref() == Some(ordering_key.as_str())
        {
            return Ok(());
        }
        Err(format!(
            "outbox id {} gives Nats-Msg-Id {msg_id:?} and ordering key {ordering_key}, \
             the message carries outbox id {}, {:?} and {}",
            event.id,
            self.id
                .as_ref()
                .map_or_else(|| "none".to_owned(), ToString::to_string),
            self.msg_id.as_deref().unwrap_or("none"),
            self.ordering_key.as_deref().unwrap_or("none"),
        ))
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
    /// The stream's replicas (`SinkOptions::id_chain`: the id chain on one only).
    pub replicas: usize,
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
        replicas: info.config.num_replicas,
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

/// One line of a timeline history file (`parent_tli switchpoint reason`): the history of
/// the current timeline left `timeline` at `switch_point`. WAL of `timeline` below the switch
/// point is part of the current history; from the switch point on, the current history
/// continues on the next timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    /// The ancestor timeline.
    pub timeline: u32,
    /// Where the current history left it (exclusive).
    pub switch_point: Lsn,
}

/// Parses a timeline history file's content (the reply to `TIMELINE_HISTORY n`) as
/// Postgres's `readTimeLineHistory` does: blank lines and `#` comments are skipped; each
/// other line is `parent_tli<TAB>switchpoint<TAB>reason`, with increasing timelines. `Err`
/// names the line that is not.
pub fn parse_timeline_history(content: &str) -> Result<Vec<Switch>, String> {
    let mut switches: Vec<Switch> = Vec::new();
    for (n, line) in content.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: &str| format!("timeline history line {}: {why}: {line:?}", n + 1);
        let mut fields = line.split_whitespace();
        let timeline = fields
            .next()
            .and_then(|field| field.parse::<u32>().ok())
            .ok_or_else(|| bad("expected a timeline number"))?;
        let switch_point = fields
            .next()
            .and_then(|field| field.parse::<Lsn>().ok())
            .ok_or_else(|| bad("expected a switch point X/X after the timeline"))?;
        if let Some(previous) = switches.last() {
            if timeline <= previous.timeline {
                return Err(bad("timelines must increase"));
            }
            if switch_point < previous.switch_point {
                return Err(bad("switch points must not decrease"));
            }
        }
        switches.push(Switch {
            timeline,
            switch_point,
        });
    }
    Ok(switches)
}

/// `theirs` and `ours` name the same cluster, database and slot (SRC1) on different
/// timelines: `theirs`'s timeline.
fn other_timeline(theirs: &str, ours: &str) -> Option<u32> {
    let split = |source: &str| {
        let (cluster, rest) = source.split_once('/')?;
        let (timeline, rest) = rest.split_once('/')?;
        Some((
            cluster.to_owned(),
            timeline.parse::<u32>().ok()?,
            rest.to_owned(),
        ))
    };
    let (their_cluster, their_timeline, their_rest) = split(theirs)?;
    let (our_cluster, our_timeline, our_rest) = split(ours)?;
    (their_cluster == our_cluster && their_rest == our_rest && their_timeline != our_timeline)
        .then_some(their_timeline)
}

/// The history a session's events belong to (S1, S5): its `Outbox-Source` and the history of
/// the server's current timeline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lineage {
    /// The session's `Outbox-Source`.
    pub source: String,
    /// The history of the server's current timeline (S5): empty on timeline 1.
    pub history: Vec<Switch>,
}

impl Lineage {
    /// Whether a message from `theirs` at `position` is of this history (S1's source, S5's
    /// switch point; the WAL end is the caller's): `Err` says why not.
    pub fn owns(&self, theirs: Option<&str>, position: Position) -> Result<(), Distrust> {
        if theirs == Some(self.source.as_str()) {
            return Ok(());
        }
        let ancestor = theirs.and_then(|theirs| {
            let timeline = other_timeline(theirs, &self.source)?;
            let switch = self.history.iter().find(|s| s.timeline == timeline)?;
            Some((theirs, switch.switch_point))
        });
        match ancestor {
            // S5: the commit record starts before the switch point, so the current history
            // holds it unchanged.
            Some((_, switch_point)) if position.commit_lsn < switch_point => Ok(()),
            Some((theirs, switch_point)) => Err(Distrust::PastSwitchPoint {
                theirs: theirs.to_owned(),
                commit_lsn: position.commit_lsn,
                switch_point,
            }),
            None => Err(Distrust::OtherSource {
                theirs: theirs.map(str::to_owned),
            }),
        }
    }
}

/// What the session is, for [`plan`].
#[derive(Debug, Clone)]
pub struct Session<'a> {
    /// Its history (S1, S5).
    pub lineage: &'a Lineage,
    /// The server's WAL end when the session started (`IDENTIFY_SYSTEM`).
    pub wal_end: Lsn,
    /// Strict mode (the relay is the stream's only writer).
    pub strict: bool,
}

/// Why the stream's tail gives no position to compare replayed events up to (S1, S5).
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
    /// The position's commit LSN lies at or beyond the server's WAL end: WAL this server does
    /// not have (a restored-older database, or a message the relay did not write). Reported;
    /// the replay is still compared with the stream (S1, S4).
    BeyondWalEnd {
        /// Its commit LSN.
        commit_lsn: Lsn,
    },
    /// The position is of an ancestor timeline of the session's (S5), at or past the switch
    /// point where the current history left it: WAL the old primary wrote that the promoted
    /// server never received, whose LSNs the new timeline reuses for other commits.
    PastSwitchPoint {
        /// The tail's `Outbox-Source`.
        theirs: String,
        /// Its commit LSN.
        commit_lsn: Lsn,
        /// Where the current history left the tail's timeline.
        switch_point: Lsn,
    },
}

/// A session's resume plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Strict mode: the stream's last sequence, where the fence starts (S3).
    pub fence: Option<u64>,
    /// Replayed events at or before this position are compared with the stream's messages
    /// (S4): each the stream holds at its place is skipped (P6).
    pub compare_through: Option<Position>,
    /// Why the tail gave no such position (to be reported by the caller).
    pub distrust: Vec<Distrust>,
}

/// The resume plan for `session` given `tail` (S1, S3, S5). Shared mode compares nothing and
/// fences nothing.
pub fn plan(tail: &Tail, session: &Session<'_>) -> Resume {
    let mut resume = Resume {
        fence: session.strict.then_some(tail.last_sequence),
        compare_through: None,
        distrust: Vec::new(),
    };
    if !session.strict {
        return resume;
    }
    match tail_position(tail, session) {
        Ok(position) => resume.compare_through = position,
        Err(why) => resume.distrust.push(why),
    }
    // S1: a tail beyond the WAL end (a database restored from an older backup) is reported,
    // and still compared through: the comparison skips only what the stream holds at its
    // place (S4), so the events the restored history replays unchanged are not stored twice.
    if let Some(position) = resume.compare_through {
        if position.commit_lsn >= session.wal_end {
            resume.distrust.push(Distrust::BeyondWalEnd {
                commit_lsn: position.commit_lsn,
            });
        }
    }
    resume
}

/// The tail's position, if it is of this session's history (S1, S5); `Ok(None)` for an
/// empty stream.
fn tail_position(tail: &Tail, session: &Session<'_>) -> Result<Option<Position>, Distrust> {
    let (position, source) = match &tail.last {
        None => return Ok(None),
        Some(Err(error)) => {
            return Err(Distrust::Unreadable {
                error: error.clone(),
            })
        }
        Some(Ok(Mark { position: None, .. })) => return Err(Distrust::NoPosition),
        Some(Ok(Mark {
            position: Some(position),
            source,
            ..
        })) => (*position, source),
    };
    session.lineage.owns(source.as_deref(), position)?;
    Ok(Some(position))
}

/// S4: whether `mark`, the stream's message at the place of replayed `event` in the run, is
/// that event: its position, a source of `lineage` (S1, S5), its `Outbox-Id`, `Nats-Msg-Id`
/// and ordering key (of the event, or of its dead-letter record). `Err` says what differs.
pub fn vouch(mark: &Mark, event: &OutboxEvent, lineage: &Lineage) -> Result<(), String> {
    if mark.position != Some(event.position) {
        return Err(format!(
            "it is at {}, the replayed event (outbox id {}) at {}",
            mark.position
                .map_or_else(|| "no outbox position".to_owned(), place),
            event.id,
            place(event.position)
        ));
    }
    lineage
        .owns(mark.source.as_deref(), event.position)
        .map_err(|why| format!("its source is not this history's: {why:?}"))?;
    mark.claim.check(event)
}

/// S4: the walk back from the tail to the first message of the run, one message at a time
/// (the caller reads them, newest first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    first: Position,
    start: u64,
}

impl Walk {
    /// A walk from the tail at `last_sequence`, for a replay whose first event is at
    /// `first`.
    pub fn from_tail(last_sequence: u64, first: Position) -> Walk {
        Walk {
            first,
            start: last_sequence + 1,
        }
    }

    /// Takes `mark`, the message at `sequence` (the one before the last taken): `false` when
    /// the walk stops there ([`walks_past`]), the run starting after it.
    pub fn step(&mut self, sequence: u64, mark: &Result<Mark, String>, lineage: &Lineage) -> bool {
        if !walks_past(mark, self.first, lineage) {
            return false;
        }
        self.start = sequence;
        true
    }

    /// The run's first sequence, as far as the walk went (past the tail: an empty run).
    pub fn start(&self) -> u64 {
        self.start
    }
}

/// S6: which replayed events the stream may hold already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Doubt {
    /// None: the stream was empty, the session stored a publish as new, or not strict mode.
    None,
    /// Those at or before the tail's position that S4 did not vouch for.
    Through(Position),
    /// Every event, until the session stores a publish as new (the tail gave no position of
    /// the session's history).
    UntilStored,
}

/// What [`Doubt::settle`] leaves: the doubt from now on, and the fence's sequence when it
/// must be set again (a duplicate consumed none), the id chain then started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// The doubt from now on.
    pub doubt: Doubt,
    /// The fence's new sequence, if it changes.
    pub fence: Option<u64>,
}

impl Doubt {
    /// A session's doubt (S6): none without a fence or on an empty stream; through the
    /// tail's position when it is of the session's history (`compare_through`), or through
    /// the newest event a failed session of the process had published (`failed_through`:
    /// its answer may never have come, and the stream may hold events past its tail another
    /// writer such as `outbox-relay replay --force` put there), whichever is later;
    /// otherwise until the session stores a publish as new. Doubt only makes the session
    /// publish alone, never skip, so a memory of the process may widen it.
    pub fn at_start(
        fence: Option<u64>,
        compare_through: Option<Position>,
        failed_through: Option<Position>,
    ) -> Doubt {
        match (fence, compare_through) {
            (None | Some(0), _) => Doubt::None,
            (Some(_), Some(through)) => {
                Doubt::Through(through.max(failed_through.unwrap_or(through)))
            }
            (Some(_), None) => Doubt::UntilStored,
        }
    }

    /// Whether the stream may hold the event at `position` already: then it is published
    /// alone, once every earlier answer is in.
    pub fn covers(&self, position: Position) -> bool {
        match self {
            Doubt::None => false,
            Doubt::Through(through) => position <= *through,
            Doubt::UntilStored => true,
        }
    }

    /// S6, once every earlier answer of the session is in: `start` is the stream's last
    /// sequence when the session started, `fence` the sequence the fence predicts now (one
    /// more per publish), `stored` the stream sequence of the session's newest publish
    /// stored as new, if any. The fence goes to the stream's last sequence as the answers
    /// left it (a duplicate consumes none). A session that stored a publish as new is in
    /// doubt no more: what it publishes after it is new, the stream being in commit order.
    pub fn settle(self, start: u64, fence: u64, stored: Option<u64>) -> Settled {
        let last = stored.unwrap_or(start);
        let doubt = match self {
            // S6: what comes after a publish stored as new is new (the stream in commit
            // order), unless the doubt names a later event.
            Doubt::UntilStored if stored.is_some() => Doubt::None,
            other => other,
        };
        Settled {
            doubt,
            fence: (fence != last).then_some(last),
        }
    }
}

/// A position as the log says it.
fn place(position: Position) -> String {
    format!(
        "commit LSN {}, index {}",
        position.commit_lsn, position.index
    )
}

/// S4: whether the walk back from the tail goes on past `mark` (read at a sequence, or why
/// not): a message of `lineage` at or after `first`, the first replayed event's position. The
/// run starts after the first message the walk does not go past. A lost history's messages
/// (after a restore, at positions the new history reuses) are of the run too: the search
/// passes over them ([`seek`]).
pub fn walks_past(mark: &Result<Mark, String>, first: Position, lineage: &Lineage) -> bool {
    let Ok(Mark {
        position: Some(position),
        source,
        ..
    }) = mark
    else {
        return false;
    };
    *position >= first && lineage.owns(source.as_deref(), *position).is_ok()
}

/// S4: the search of the run for replayed `event`, one message at a time from where the
/// search for the event before it ended: `Ok` when `mark` is the event ([`vouch`]), and the
/// search moves past it; `Err` (what differs) when it is not, and the search passes over it
/// to the run's next message. An event the run's end finds unmatched ends the comparison.
pub fn seek(mark: &Mark, event: &OutboxEvent, lineage: &Lineage) -> Result<(), String> {
    vouch(mark, event, lineage)
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
            replicas: 1,
            last,
        }
    }

    fn mark(source: &str, position: Position) -> Mark {
        Mark {
            position: Some(position),
            source: Some(source.to_owned()),
            claim: Claim::default(),
        }
    }

    fn ours(position: Position) -> Option<Result<Mark, String>> {
        Some(Ok(mark(SOURCE, position)))
    }

    fn lineage(source: &str, history: Vec<Switch>) -> Lineage {
        Lineage {
            source: source.to_owned(),
            history,
        }
    }

    fn session(lineage: &Lineage) -> Session<'_> {
        Session {
            lineage,
            wal_end: Lsn(1_000),
            strict: true,
        }
    }

    #[test]
    fn a_tail_of_our_own_history_is_compared_through_and_the_fence_starts_at_it() {
        let ours_only = lineage(SOURCE, vec![]);
        let resume = plan(&tail(ours(at(500, 3))), &session(&ours_only));
        assert_eq!(resume.fence, Some(42));
        assert_eq!(resume.compare_through, Some(at(500, 3)));
        assert!(resume.distrust.is_empty());
    }

    #[test]
    fn a_tail_of_another_source_or_timeline_is_not_used() {
        let ours_only = lineage(SOURCE, vec![]);
        let other = Some(Ok(mark("7301/2/app/slot", at(500, 3))));
        let resume = plan(&tail(other), &session(&ours_only));
        assert_eq!(resume.compare_through, None);
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

    /// S1: reported, and still compared through (S4 skips only what the stream holds).
    #[test]
    fn a_position_at_or_beyond_the_wal_end_is_reported_and_still_compared() {
        let ours_only = lineage(SOURCE, vec![]);
        let resume = plan(&tail(ours(at(1_000, 0))), &session(&ours_only));
        assert_eq!(resume.compare_through, Some(at(1_000, 0)));
        assert_eq!(
            resume.distrust,
            vec![Distrust::BeyondWalEnd {
                commit_lsn: Lsn(1_000)
            }]
        );
    }

    #[test]
    fn an_unreadable_or_unpositioned_tail_is_reported() {
        let ours_only = lineage(SOURCE, vec![]);
        let resume = plan(
            &tail(Some(Err("no message found".into()))),
            &session(&ours_only),
        );
        assert_eq!(resume.compare_through, None);
        assert_eq!(
            resume.distrust,
            vec![Distrust::Unreadable {
                error: "no message found".into()
            }]
        );
        let resume = plan(&tail(Some(Ok(Mark::default()))), &session(&ours_only));
        assert_eq!(resume.distrust, vec![Distrust::NoPosition]);
    }

    /// Timeline 4 of cluster 7301: timeline 1 until 100, 2 until 300, 3 until 600.
    const HISTORY4: &str = "1\t0/64\tno recovery target specified\n\n\
                            # a comment\n\
                            2\t0/12C\tbefore 2026-12-01 10:00:00+00\n\
                            3\t0/258\tno recovery target specified\n";

    fn from(source: &str, position: Position) -> Tail {
        tail(Some(Ok(mark(source, position))))
    }

    #[test]
    fn a_timeline_history_parses_as_postgres_reads_it() {
        let history = parse_timeline_history(HISTORY4).unwrap();
        assert_eq!(
            history,
            vec![
                Switch {
                    timeline: 1,
                    switch_point: Lsn(100)
                },
                Switch {
                    timeline: 2,
                    switch_point: Lsn(300)
                },
                Switch {
                    timeline: 3,
                    switch_point: Lsn(600)
                },
            ]
        );
        assert_eq!(parse_timeline_history(""), Ok(vec![]));
        for (bad, why) in [
            ("x\t0/1\tr\n", "expected a timeline number"),
            ("1\t01\tr\n", "expected a switch point"),
            ("1\n", "expected a switch point"),
            ("2\t0/5\tr\n1\t0/6\tr\n", "timelines must increase"),
            ("1\t0/5\tr\n2\t0/4\tr\n", "switch points must not decrease"),
        ] {
            let error = parse_timeline_history(bad).unwrap_err();
            assert!(error.contains(why), "{bad:?}: {error}");
        }
    }

    /// S5: each ancestor's positions count below where the current history left it, and
    /// never at or past it.
    #[test]
    fn an_ancestor_timeline_is_trusted_only_below_its_switch_point() {
        let timeline_4 = lineage("7301/4/app/slot", parse_timeline_history(HISTORY4).unwrap());
        let session = session(&timeline_4);
        for (timeline, switch_point) in [(1, 100), (2, 300), (3, 600)] {
            let theirs = format!("7301/{timeline}/app/slot");
            let below = plan(&from(&theirs, at(switch_point - 1, 7)), &session);
            assert_eq!(below.compare_through, Some(at(switch_point - 1, 7)));
            assert!(below.distrust.is_empty(), "{:?}", below.distrust);
            for past in [switch_point, switch_point + 1, 900] {
                let resume = plan(&from(&theirs, at(past, 0)), &session);
                assert_eq!(
                    resume.compare_through, None,
                    "timeline {timeline} at {past}"
                );
                assert_eq!(
                    resume.distrust,
                    vec![Distrust::PastSwitchPoint {
                        theirs: theirs.clone(),
                        commit_lsn: Lsn(past),
                        switch_point: Lsn(switch_point)
                    }]
                );
            }
        }
    }

    /// S5 admits only ancestors of the same cluster, database and slot.
    #[test]
    fn a_timeline_outside_the_history_or_another_database_is_another_source() {
        let timeline_4 = lineage("7301/4/app/slot", parse_timeline_history(HISTORY4).unwrap());
        let session = session(&timeline_4);
        for theirs in [
            // A sibling: timeline 5 branched off elsewhere.
            "7301/5/app/slot",
            "7302/2/app/slot",
            "7301/2/other/slot",
            "7301/2/app/other",
            "7301/x/app/slot",
            "garbage",
        ] {
            let resume = plan(&from(theirs, at(50, 0)), &session);
            assert_eq!(resume.compare_through, None, "{theirs}");
            assert_eq!(
                resume.distrust,
                vec![Distrust::OtherSource {
                    theirs: Some(theirs.to_owned())
                }]
            );
        }
        // Without a history (timeline 1, or none read), no ancestor is trusted.
        let no_history = lineage("7301/4/app/slot", vec![]);
        let resume = plan(
            &from("7301/3/app/slot", at(50, 0)),
            &self::session(&no_history),
        );
        assert_eq!(resume.compare_through, None);
        // The session's own timeline is S1's, whatever the history says.
        let resume = plan(&from("7301/4/app/slot", at(900, 0)), &session);
        assert_eq!(resume.compare_through, Some(at(900, 0)));
    }

    fn event(id: i64, entity_id: &str, event_type: &str, created_at_ms: i64) -> OutboxEvent {
        event_at(id, entity_id, event_type, created_at_ms, at(500, 0))
    }

    fn event_at(
        id: i64,
        entity_id: &str,
        event_type: &str,
        created_at_ms: i64,
        position: Position,
    ) -> OutboxEvent {
        outbox::OutboxRow::seed(
            id,
            entity_id,
            event_type,
            bytes::Bytes::from_static(b"{}"),
            created_at_ms,
        )
        .into_event("outbox", std::num::NonZeroU64::new(8).unwrap(), position)
    }

    fn claim_of(event: &OutboxEvent) -> Claim {
        Claim {
            id: Some(event.id.clone()),
            msg_id: Some(crate::message::msg_id(event)),
            ordering_key: Some(event.keys.ordering_key.clone()),
            dead_letter: false,
        }
    }

    /// What the relay wrote for `event` from `source`.
    fn written(event: &OutboxEvent, source: &str) -> Mark {
        Mark {
            position: Some(event.position),
            source: Some(source.to_owned()),
            claim: claim_of(event),
        }
    }

    /// S4, P8: what the relay wrote for a row checks out against that row, its
    /// dead-letter record too, and a hostile row's encoded id too; another row's does not.
    #[test]
    fn a_claim_checks_out_only_against_the_row_it_was_written_for() {
        let row = event(300, "order-1", "order.created", 1_700_000_000_123);
        assert_eq!(claim_of(&row).check(&row), Ok(()));
        assert!(claim_of(&row).is_row(&EventId::Int(300), 1_700_000_000_123));

        // The same id, written again after a restore: another time, or another entity.
        let later = event(300, "order-1", "order.created", 1_700_000_099_000);
        assert!(claim_of(&row).check(&later).is_err());
        assert!(!claim_of(&row).is_row(&EventId::Int(300), 1_700_000_099_000));
        let other = event(300, "order-2", "order.created", 1_700_000_000_123);
        let why = claim_of(&row).check(&other).unwrap_err();
        assert!(why.contains("order.created:order-2:300"), "{why}");

        let hostile = event(7, "nats-x", "t", 5);
        let claim = claim_of(&hostile);
        assert_ne!(
            claim.msg_id.as_deref(),
            Some(hostile.keys.dedupe_key.as_str())
        );
        assert_eq!(claim.check(&hostile), Ok(()));

        let record = Claim {
            msg_id: Some(crate::message::dead_letter_msg_id(&row)),
            dead_letter: true,
            ..claim_of(&row)
        };
        assert_eq!(record.check(&row), Ok(()));

        let forged = Claim {
            msg_id: Some(row.keys.dedupe_key.clone()),
            ..Claim::default()
        };
        assert!(forged.is_anonymous());
        assert!(forged.check(&row).is_err());
        assert!(!forged.is_row(&EventId::Int(300), 1_700_000_000_123));
    }

    /// S4: a replayed event is vouched for by the message the relay wrote for it, whatever
    /// the table now holds (the row may be gone), and by nothing else.
    #[test]
    fn a_replayed_event_is_vouched_for_only_by_its_own_message() {
        let ours_only = lineage(SOURCE, vec![]);
        let row = event_at(
            300,
            "order-1",
            "order.created",
            1_700_000_000_123,
            at(500, 2),
        );
        assert_eq!(vouch(&written(&row, SOURCE), &row, &ours_only), Ok(()));
        // Its dead-letter record takes its place.
        let record = Mark {
            claim: Claim {
                msg_id: Some(crate::message::dead_letter_msg_id(&row)),
                dead_letter: true,
                ..claim_of(&row)
            },
            ..written(&row, SOURCE)
        };
        assert_eq!(vouch(&record, &row, &ours_only), Ok(()));

        // A restored database written past the old tail: the same id and position, another
        // row (another time).
        let restored = event_at(
            300,
            "order-1",
            "order.created",
            1_700_000_099_000,
            at(500, 2),
        );
        let why = vouch(&written(&row, SOURCE), &restored, &ours_only).unwrap_err();
        assert!(why.contains("ordering key"), "{why}");
        // Another position.
        let moved = event_at(
            300,
            "order-1",
            "order.created",
            1_700_000_000_123,
            at(500, 3),
        );
        let why = vouch(&written(&row, SOURCE), &moved, &ours_only).unwrap_err();
        assert!(why.contains("commit LSN 0/1F4, index 2"), "{why}");
        // Another source.
        let why = vouch(&written(&row, "7301/2/app/slot"), &row, &ours_only).unwrap_err();
        assert!(why.contains("source"), "{why}");
        // A forged message without a row identity.
        let forged = Mark {
            claim: Claim {
                msg_id: Some(crate::message::msg_id(&row)),
                ..Claim::default()
            },
            ..written(&row, SOURCE)
        };
        assert!(vouch(&forged, &row, &ours_only).is_err());
        // S5: an ancestor's message below the switch point vouches, past it not.
        let timeline_2 = lineage(
            "7301/2/app/slot",
            parse_timeline_history("1\t0/258\tr\n").unwrap(),
        );
        assert_eq!(vouch(&written(&row, SOURCE), &row, &timeline_2), Ok(()));
        let past = event_at(
            300,
            "order-1",
            "order.created",
            1_700_000_000_123,
            at(700, 2),
        );
        assert!(vouch(&written(&past, SOURCE), &past, &timeline_2).is_err());
    }

    /// S4: the walk back from the tail goes past messages of this history at or after the
    /// first replayed event, and stops at anything else.
    #[test]
    fn the_walk_back_stops_at_the_first_message_outside_the_run() {
        let ours_only = lineage(SOURCE, vec![]);
        let first = at(500, 0);
        let walks = |mark: Result<Mark, String>| walks_past(&mark, first, &ours_only);
        assert!(walks(Ok(mark(SOURCE, at(500, 0)))));
        assert!(walks(Ok(mark(SOURCE, at(600, 1)))));
        // A lost history's message at a later position: of the run, passed over by the search.
        assert!(walks(Ok(mark(SOURCE, at(900, 0)))));
        // Before the first replayed event: confirmed before the session.
        assert!(!walks(Ok(mark(SOURCE, at(499, 9)))));
        // Another source, no position, a message that cannot be read.
        assert!(!walks(Ok(mark("7301/2/app/slot", at(600, 0)))));
        assert!(!walks(Ok(Mark::default())));
        assert!(!walks(Err("no message found".into())));
    }

    /// S4: the run is what the walk went past, newest first.
    #[test]
    fn a_walk_finds_the_run_after_the_first_message_outside_it() {
        let ours_only = lineage(SOURCE, vec![]);
        // Sequences 1..=6: confirmed before the session (1, 2), then a lost history's
        // message (3, at a position the new history reuses), then the new history (4..=6).
        let stream = [
            (1, Ok(mark(SOURCE, at(100, 0)))),
            (2, Ok(mark(SOURCE, at(200, 0)))),
            (3, Ok(mark(SOURCE, at(300, 0)))),
            (4, Ok(mark(SOURCE, at(300, 0)))),
            (5, Ok(mark(SOURCE, at(300, 1)))),
            (6, Ok(mark(SOURCE, at(400, 0)))),
        ];
        let walk_from = |first: Position| {
            let mut walk = Walk::from_tail(6, first);
            for (sequence, mark) in stream.iter().rev() {
                if !walk.step(*sequence, mark, &ours_only) {
                    break;
                }
            }
            walk.start()
        };
        assert_eq!(walk_from(at(300, 0)), 3);
        assert_eq!(walk_from(at(400, 0)), 6);
        assert_eq!(walk_from(at(500, 0)), 7, "past the tail: an empty run");
        assert_eq!(Walk::from_tail(0, at(1, 0)).start(), 1);
    }

    /// S4: the search passes over a lost history's message at a reused position and finds
    /// the event after it.
    #[test]
    fn the_search_passes_over_what_is_not_the_event() {
        let ours_only = lineage(SOURCE, vec![]);
        let new = event_at(
            12,
            "order-1",
            "order.created",
            1_700_000_099_000,
            at(300, 0),
        );
        let lost = event_at(
            12,
            "order-9",
            "order.created",
            1_700_000_000_000,
            at(300, 0),
        );
        assert!(seek(&written(&lost, SOURCE), &new, &ours_only).is_err());
        assert_eq!(seek(&written(&new, SOURCE), &new, &ours_only), Ok(()));
    }

    /// S6: what may be in the stream is published alone, and a duplicate leaves the fence at
    /// the stream's last sequence.
    #[test]
    fn doubt_ends_with_the_first_publish_stored_as_new() {
        assert_eq!(Doubt::at_start(None, Some(at(5, 0)), None), Doubt::None);
        assert_eq!(Doubt::at_start(Some(0), None, Some(at(5, 0))), Doubt::None);
        assert_eq!(Doubt::at_start(Some(9), None, None), Doubt::UntilStored);
        let through = Doubt::at_start(Some(9), Some(at(5, 0)), Some(at(4, 0)));
        assert_eq!(through, Doubt::Through(at(5, 0)));
        // A failed session's publishes past the tail stay in doubt.
        assert_eq!(
            Doubt::at_start(Some(9), Some(at(5, 0)), Some(at(7, 2))),
            Doubt::Through(at(7, 2))
        );
        assert!(through.covers(at(5, 0)) && !through.covers(at(5, 1)));
        assert!(Doubt::UntilStored.covers(at(u64::MAX, 0)));
        // One duplicate: the fence predicted 10, the stream still ends at 9.
        assert_eq!(
            through.settle(9, 10, None),
            Settled {
                doubt: through,
                fence: Some(9)
            }
        );
        // Nothing published yet, or every publish stored as new: nothing to set again.
        assert_eq!(
            through.settle(9, 9, None),
            Settled {
                doubt: through,
                fence: None
            }
        );
        assert_eq!(
            Doubt::UntilStored.settle(9, 10, Some(10)),
            Settled {
                doubt: Doubt::None,
                fence: None
            }
        );
        // Through a position, a stored publish ends nothing: the next may be in the stream.
        assert_eq!(
            through.settle(9, 11, Some(10)),
            Settled {
                doubt: through,
                fence: Some(10)
            }
        );
    }

    #[test]
    fn an_empty_stream_compares_nothing_and_says_nothing() {
        let ours_only = lineage(SOURCE, vec![]);
        let resume = plan(&tail(None), &session(&ours_only));
        assert_eq!(resume.compare_through, None);
        assert!(resume.distrust.is_empty());
    }

    #[test]
    fn shared_mode_neither_compares_nor_fences() {
        let ours_only = lineage(SOURCE, vec![]);
        let mut shared = session(&ours_only);
        shared.strict = false;
        let resume = plan(&tail(ours(at(500, 3))), &shared);
        assert_eq!(
            resume,
            Resume {
                fence: None,
                compare_through: None,
                distrust: vec![]
            }
        );
    }
}
