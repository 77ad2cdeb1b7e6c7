//! The relay inside the model: its process memory, its session, and each of its steps.
//! Every decision is the relay's own code, called as the relay calls it:
//! [`sink::resume::plan`] (what the tail is trusted for), [`sink::resume::Walk`] and
//! [`sink::resume::seek`] (what a session skips; [`sink::resume::vouch`] for the rules
//! before), [`sink::resume::Doubt`] (the fence after
//! duplicates), [`sink::AckTracker`] (what may be confirmed),
//! [`sink::resume::Claim::is_row`] (P8's check of a duplicate's original). What this module
//! writes itself is the glue the relay keeps in async I/O code: the order of those calls
//! (`sink::vouch::Vouching::holds`, `sink::publisher`'s `publish_item` and `settle`, the
//! acker's `acknowledge`), mirrored line by line and named where it is.
//!
//! Each step takes the parts of the world it reads and writes ([`Relay`], and
//! [`crate::world`]'s [`Pg`] and [`Stream`]), not the model's whole state: [`crate::model`]
//! holds the state and calls down into this module, never the other way.
//!
//! # Invariants
//! - MR1 A session starts from the slot's confirmed position with a fresh tracker, and skips
//!   nothing on an earlier session's word (S2). In [`Rules::Current`] the process remembers
//!   the newest event a session that ended with an error published (`failed_through`), which
//!   only widens the next sessions' doubt (S6); a crash loses it, a Postgres restore keeps
//!   it (and records nothing: the session's sink is aborted). [`Rules::OldTableCheck`] and
//!   [`Rules::NoRowCheckOld`] keep old S2's memory of what the process saw acknowledged,
//!   lost when the process crashes.
//! - MR2 A session ends (its in-flight publishes landing or not) on a refusal, a P8 halt, a
//!   crash or a Postgres restore; a halt stops the relay for good (`PoisonPolicy::Halt`).
//! - MR3 At most `window` publishes are unanswered (P2); in [`Rules::Current`] and
//!   [`Rules::BeforeFixes`] an event in doubt waits for every earlier answer (P15), and in
//!   [`Rules::Current`] so does the first publish after one in doubt.

use std::collections::VecDeque;
use std::fmt::Write as _;

use outbox::{EventId, Lsn, OutboxEvent, Position};
use sink::resume::{plan, seek, vouch, walks_past, Distrust, Doubt, Lineage, Mark, Tail, Walk};
use sink::{AckTracker, Ticket};

use crate::world::{at, event, mark_of, Answer, Pg, Publish, Row, Stream, Txn, SOURCE};
use crate::{Fix, Rules};

/// Where a session's comparison of replayed events with the stream is (`sink::vouch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vouching {
    /// Nothing to compare (no tail of this history, or the old rules).
    Off,
    /// The run is found when the first event to compare arrives.
    Unlocated,
    /// The run's next message to read is at this sequence.
    Reading(u64),
    /// The comparison ended (RV2).
    Ended,
}

/// A publish handed to the connection and the tracker's ticket for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sent {
    /// What the server gets.
    pub publish: Publish,
    /// The tracker's ticket.
    pub ticket: Ticket,
}

/// One session of the relay: everything a crash loses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Session {
    /// The stream's last sequence when it started (`SinkOptions::fence`).
    pub start: u64,
    /// `Nats-Expected-Last-Sequence` of the next publish.
    pub fence: u64,
    /// `Nats-Expected-Last-Msg-Id` of the next publish: the previous publish's (P5).
    pub chain: Option<i64>,
    /// S6 (current rules).
    pub doubt: Doubt,
    /// Old rules: replayed events at or before this are skipped unseen.
    pub skip_through: Option<Position>,
    /// S4: events at or before this are compared with the stream (`Compare::through`).
    pub compare: Option<Position>,
    /// Where the comparison is.
    pub vouching: Vouching,
    /// The next event the replication stream delivers: a WAL transaction and an index in it.
    pub next_txn: usize,
    /// See `next_txn`.
    pub next_event: usize,
    /// The session's tracker (A1–A4).
    pub tracker: AckTracker<u64>,
    /// Publishes handed to the connection, not yet answered by the server.
    pub in_flight: VecDeque<Sent>,
    /// Answers the acker has not handled yet, in order.
    pub answers: VecDeque<(Sent, Answer)>,
    /// The stream sequence of the session's newest publish stored as new (P15's
    /// `Answered`).
    pub stored: Option<u64>,
    /// P15 ([`Rules::Current`]): the newest publish was in doubt, so the next one settles
    /// first (the publisher's `settling`).
    pub settling: bool,
    /// P15 ([`Rules::Current`]): the newest event the session published (the publisher's
    /// `last_framed`).
    pub last_framed: Option<Position>,
}

impl Session {
    /// A session fenced at `fence` that replays from the slot's confirmed position with a
    /// fresh tracker (MR1), skipping and comparing nothing yet.
    fn fresh(fence: u64, pg: &Pg) -> Session {
        Session {
            start: fence,
            fence,
            chain: None,
            doubt: Doubt::None,
            skip_through: None,
            compare: None,
            vouching: Vouching::Off,
            next_txn: pg
                .wal
                .iter()
                .position(|txn| txn.end > pg.confirmed)
                .unwrap_or(pg.wal.len()),
            next_event: 0,
            tracker: AckTracker::new(pg.confirmed),
            in_flight: VecDeque::new(),
            answers: VecDeque::new(),
            stored: None,
            settling: false,
            last_framed: None,
        }
    }

    /// `settle`: with every earlier answer in (else `None`: the publish waits), the doubt is
    /// settled and the fence moves to what the stream stored. What it did, in words.
    fn settle(&mut self) -> Option<String> {
        if !self.in_flight.is_empty() || !self.answers.is_empty() {
            return None;
        }
        let settled = self.doubt.settle(self.start, self.fence, self.stored);
        self.doubt = settled.doubt;
        if let Some(sequence) = settled.fence {
            self.fence = sequence;
            self.chain = None;
        }
        Some(format!("settles (doubt {:?}), ", self.doubt))
    }

    /// Past the event just taken from `txn`: its transaction's commit goes to the tracker
    /// after its last event.
    fn advance(&mut self, txn: &Txn) {
        if self.next_event + 1 == txn.rows.len() {
            tracker(self.tracker.commit(txn.end));
            self.next_txn += 1;
            self.next_event = 0;
        } else {
            self.next_event += 1;
        }
    }
}

/// The relay process.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Relay {
    /// The session streaming, if any.
    pub session: Option<Session>,
    /// Old S2: the newest event this process saw acknowledged (lost on a crash).
    pub memory: Option<(Position, Row)>,
    /// P15 ([`Rules::Current`], `SinkStats::failed_through`): the newest event a session of
    /// this process that ended with an error (a refusal, a P8 halt) published; lost on a
    /// crash, kept across a Postgres restore (the session's sink is then aborted, not
    /// failed, so it records nothing).
    pub failed_through: Option<Position>,
    /// The relay stopped for good (P8 under `PoisonPolicy::Halt`), and why.
    pub halted: Option<Halt>,
}

impl Relay {
    /// The server answers the session's oldest in-flight publish.
    pub fn process(&mut self, stream: &mut Stream, log: &mut Option<String>) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        let Some(sent) = session.in_flight.pop_front() else {
            return false;
        };
        let answer = stream.answer(&sent.publish);
        session.answers.push_back((sent, answer));
        if let Some(log) = log {
            let _ = write!(log, "nats: publish of {} -> {answer}", sent.publish.row);
        }
        true
    }

    /// The session ends (MR2): the first `landed` in-flight publishes reach the server (their
    /// answers unread), the rest never do.
    pub fn end_session(&mut self, stream: &mut Stream, landed: usize, log: &mut Option<String>) {
        let Some(session) = self.session.take() else {
            return;
        };
        for sent in session.in_flight.iter().take(landed) {
            let answer = stream.answer(&sent.publish);
            if let Some(log) = log {
                let _ = write!(
                    log,
                    "; its in-flight publish of {} lands: {answer}",
                    sent.publish.row
                );
            }
        }
    }
}

/// Why the relay halted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Halt {
    /// P8: a duplicate of another row's message (a reused outbox id within the window).
    ReusedId {
        /// The event's row.
        row: Row,
        /// The original's.
        original: Row,
    },
    /// P8: a duplicate of a message without a row identity (cannot happen in the model: only
    /// the relay writes).
    ForeignDuplicate,
}

/// What the relay needs to know of itself.
#[derive(Debug, Clone)]
pub struct Context {
    /// Which rules decide.
    pub rules: Rules,
    /// The session's history (one source, timeline 1).
    pub lineage: Lineage,
    /// `max_in_flight`.
    pub window: usize,
    /// P5's id chain (a one-replica stream).
    pub id_chain: bool,
}

impl Context {
    /// A context for `rules`.
    pub fn new(rules: Rules, window: usize, id_chain: bool) -> Context {
        Context {
            rules,
            lineage: Lineage {
                source: SOURCE.to_owned(),
                history: Vec::new(),
            },
            window,
            id_chain,
        }
    }

    /// A session starts (`relay::process::pipeline`'s `prepare`): the slot's position, the
    /// WAL end, the stream's tail, the plan.
    pub fn start(&self, relay: &mut Relay, pg: &Pg, stream: &Stream, log: &mut Option<String>) {
        let tail = tail_of(stream);
        let wal_end = Lsn(pg.next_lsn);
        let resume = plan(
            &tail,
            &sink::resume::Session {
                lineage: &self.lineage,
                wal_end,
                strict: true,
            },
        );
        let fence = resume.fence.unwrap_or(0);
        let mut session = Session::fresh(fence, pg);
        match self.rules {
            rules if rules.compares() => self.compare_and_doubt(&mut session, relay, &resume),
            _ => {
                session.skip_through = self.old_skip_through(relay, pg, &tail, &resume, wal_end);
            }
        }
        if let Some(log) = log {
            let _ = write!(
                log,
                "relay: session starts from slot {} (WAL end {}), tail seq {}; plan: fence {}, ",
                pg.confirmed, wal_end.0, tail.last_sequence, fence
            );
            self.say_plan(log, &session, &resume);
        }
        relay.session = Some(session);
    }

    /// The rules that compare (S4, S6): what the session compares through and the doubt it
    /// starts with, after `plan`'s `resume`, as the rules' fixes have it.
    fn compare_and_doubt(
        &self,
        session: &mut Session,
        relay: &Relay,
        resume: &sink::resume::Resume,
    ) {
        let rules = self.rules;
        session.compare = resume.compare_through;
        if !rules.has(Fix::CompareBeyondWalEnd)
            && resume
                .distrust
                .iter()
                .any(|why| matches!(why, Distrust::BeyondWalEnd { .. }))
        {
            // Before d2a8769, `plan` gave no position to compare through for a tail
            // at or beyond the WAL end.
            session.compare = None;
        }
        // Before 109424d, `Doubt::at_start` had no memory of the process.
        let failed_through = relay.failed_through.filter(|_| rules.current());
        session.doubt = Doubt::at_start(resume.fence, session.compare, failed_through);
        if session.compare.is_some() {
            session.vouching = Vouching::Unlocated;
        }
    }

    /// The plan a session starts with, in words.
    fn say_plan(&self, log: &mut String, session: &Session, resume: &sink::resume::Resume) {
        match self.rules {
            rules if rules.compares() => {
                let _ = write!(
                    log,
                    "compare through {}, doubt {:?}",
                    session.compare.map_or_else(|| "-".to_owned(), at),
                    session.doubt
                );
            }
            _ => {
                let _ = write!(
                    log,
                    "skip through {}",
                    session.skip_through.map_or_else(|| "-".to_owned(), at)
                );
            }
        }
        if !resume.distrust.is_empty() {
            let _ = write!(log, " (distrust: {:?})", resume.distrust);
        }
    }

    /// Old S4 and S2 (`git show 739aa4d:crates/sink/src/resume.rs`): skip through the
    /// further of the tail's position (S1 by `plan`, then its row checked against the table)
    /// and what the process saw acknowledged (below the WAL end, its row checked against the
    /// table by id and `created_at`). [`Rules::NoRowCheckOld`] checks no row.
    fn old_skip_through(
        &self,
        relay: &Relay,
        pg: &Pg,
        tail: &Tail,
        resume: &sink::resume::Resume,
        wal_end: Lsn,
    ) -> Option<Position> {
        let check_rows = self.rules == Rules::OldTableCheck;
        let from_tail = resume.compare_through.filter(|&position| {
            !check_rows
                || match &tail.last {
                    Some(Ok(mark)) => tail_row_checks_out(pg, mark, position),
                    _ => false,
                }
        });
        let acknowledged = relay
            .memory
            .filter(|(position, _)| position.commit_lsn < wal_end)
            .filter(|(_, row)| !check_rows || pg.table.iter().any(|r| r.id == row.id && r == row))
            .map(|(position, _)| position);
        from_tail.max(acknowledged)
    }

    /// The publisher takes the replication stream's next event (`publish_item`): skipped
    /// when the stream holds it (P6), else published, alone after every earlier answer when
    /// in doubt (P15). `false` when there is none or it must wait (the window, P15).
    pub fn take(
        &self,
        relay: &mut Relay,
        wal: &[Txn],
        stream: &Stream,
        log: &mut Option<String>,
    ) -> bool {
        let Some(current) = &relay.session else {
            return false;
        };
        let Some(txn) = wal.get(current.next_txn) else {
            return false;
        };
        let index = current.next_event;
        let row = txn.rows[index];
        let position = txn.position(index);
        let mut session = current.clone();
        let skip = self.skips(&mut session, row, position, stream);
        if index == 0 {
            tracker(session.tracker.begin());
        }
        let said = if skip {
            self.skip(&mut session, row, position)
        } else {
            let Some(said) = self.publish(&mut session, row, position) else {
                return false;
            };
            said
        };
        session.advance(txn);
        if let Some(log) = log {
            let _ = write!(log, "relay: {said}");
        }
        relay.session = Some(session);
        true
    }

    /// Whether the session skips `row`'s event at `position`: the stream holds it (S4, by
    /// the rules' comparison), or the old rules skip through it.
    fn skips(&self, session: &mut Session, row: Row, position: Position, stream: &Stream) -> bool {
        match self.rules {
            rules if rules.has(Fix::Seek) => {
                holds(session, &event(row, position), stream, &self.lineage)
            }
            rules if rules.compares() => {
                holds_aligned(session, &event(row, position), stream, &self.lineage)
            }
            _ => session
                .skip_through
                .is_some_and(|through| position <= through),
        }
    }

    /// A skip (`AckItem::Stored`): counted as acknowledged unseen. What it did, in words.
    fn skip(&self, session: &mut Session, row: Row, position: Position) -> String {
        let ticket = tracker(session.tracker.publish());
        tracker(session.tracker.ack(ticket));
        match self.rules {
            rules if rules.compares() => format!(
                "skips {row} at {} (vouched for by the stream's message at its place)",
                at(position)
            ),
            _ => format!(
                "skips {row} at {} (at or before the skip-through position)",
                at(position)
            ),
        }
    }

    /// A publish (`publish_item`), settled first when P15 says so; what it did, in words, or
    /// `None` when it must wait (for earlier answers, or the window).
    fn publish(&self, session: &mut Session, row: Row, position: Position) -> Option<String> {
        let mut said = String::new();
        if self.settles(session, position) {
            said = session.settle()?;
        }
        if self.rules.current() {
            session.settling = session.doubt.covers(position);
        }
        if session.in_flight.len() + session.answers.len() >= self.window {
            return None;
        }
        let ticket = tracker(session.tracker.publish());
        let publish = Publish {
            row,
            position,
            expect_sequence: session.fence,
            expect_last: if self.id_chain { session.chain } else { None },
        };
        session.fence += 1;
        session.chain = Some(row.id);
        if self.rules.current() {
            // `frame`.
            session.last_framed = Some(position);
        }
        session.in_flight.push_back(Sent { publish, ticket });
        let _ = write!(
            said,
            "publishes {row} at {} expecting last seq {}{}",
            at(position),
            publish.expect_sequence,
            publish
                .expect_last
                .map_or_else(String::new, |id| format!(" and last msg id of id {id}"))
        );
        Some(said)
    }

    /// `publish_item`, P15: whether the publish at `position` goes alone, once every earlier
    /// answer is in; and (current rules) the first publish after one in doubt too, so that
    /// its fence counts only what the stream stored.
    fn settles(&self, session: &Session, position: Position) -> bool {
        match self.rules {
            rules if rules.current() => session.settling || session.doubt.covers(position),
            Rules::BeforeFixes => session.doubt.covers(position),
            _ => false,
        }
    }

    /// The acker handles the oldest answer (`acknowledge`): stored or a duplicate of the
    /// same row (P8) counts (P1); a duplicate of another row halts (P8, Halt); a refusal
    /// ends the session (P3), `landed` of its in-flight publishes reaching the server.
    pub fn ack(
        &self,
        relay: &mut Relay,
        stream: &mut Stream,
        landed: usize,
        log: &mut Option<String>,
    ) -> bool {
        let Some(session) = relay.session.as_mut() else {
            return false;
        };
        let Some((sent, answer)) = session.answers.pop_front() else {
            return false;
        };
        let counts = match answer {
            Answer::Stored(sequence) => {
                session.stored = Some(sequence);
                Ok(())
            }
            Answer::Duplicate(sequence) => p8(stream, sequence, sent.publish.row),
            Answer::WrongLastSequence | Answer::WrongLastMsgId => Err(None),
        };
        match counts {
            Ok(()) => self.count(session, &mut relay.memory, (sent, answer), landed, log),
            Err(halt) => self.end_on(relay, stream, (sent, answer), halt, landed, log),
        }
    }

    /// An answer that counts (P1): the tracker acknowledges it, and the old rules remember
    /// the newest event acknowledged (old S2). Not enabled with `landed` publishes: the
    /// session goes on.
    fn count(
        &self,
        session: &mut Session,
        memory: &mut Option<(Position, Row)>,
        (sent, answer): (Sent, Answer),
        landed: usize,
        log: &mut Option<String>,
    ) -> bool {
        if landed != 0 {
            return false;
        }
        let row = sent.publish.row;
        tracker(session.tracker.ack(sent.ticket));
        if !self.rules.compares() {
            let newest = (sent.publish.position, row);
            *memory = Some(match *memory {
                Some(known) if known.0 > newest.0 => known,
                _ => newest,
            });
        }
        if let Some(log) = log {
            let _ = write!(log, "relay: acker takes {row}'s answer ({answer}): counts");
        }
        true
    }

    /// An answer that ends the session with an error (a refusal, P3; or a P8 halt, `halt`),
    /// `landed` of its in-flight publishes reaching the server (not enabled with more than
    /// are in flight).
    fn end_on(
        &self,
        relay: &mut Relay,
        stream: &mut Stream,
        (sent, answer): (Sent, Answer),
        halt: Option<Halt>,
        landed: usize,
        log: &mut Option<String>,
    ) -> bool {
        let Some(last_framed) = relay
            .session
            .as_ref()
            .filter(|session| landed <= session.in_flight.len())
            .map(|session| session.last_framed)
        else {
            return false;
        };
        if let Some(log) = log {
            let _ = write!(
                log,
                "relay: acker takes {}'s answer ({answer}): the session ends{}",
                sent.publish.row,
                match halt {
                    Some(halt) => format!(", the relay HALTS ({halt:?})"),
                    None => String::new(),
                }
            );
        }
        relay.halted = halt;
        // `sink::publisher::publish`: the session ended with an error, so what it
        // published may be in the stream without its answer (`fail_through`).
        if self.rules.current() {
            if let Some(position) = last_framed {
                let failed = &mut relay.failed_through;
                *failed = Some(failed.map_or(position, |known| known.max(position)));
            }
        }
        relay.end_session(stream, landed, log);
        true
    }

    /// The status update: the tracker's watermark goes to the slot (I1).
    pub fn confirm(&self, relay: &Relay, pg: &mut Pg, log: &mut Option<String>) -> bool {
        let Some(session) = &relay.session else {
            return false;
        };
        let watermark = session.tracker.watermark();
        if watermark <= pg.confirmed {
            return false;
        }
        pg.confirmed = watermark;
        if let Some(log) = log {
            let _ = write!(log, "relay: confirms {watermark} to the slot");
        }
        true
    }
}

/// The stream's tail as a session reads it when it starts (`sink::resume::Tail`).
fn tail_of(stream: &Stream) -> Tail {
    Tail {
        last_sequence: stream.last_sequence(),
        max_msg_size: None,
        duplicate_window: std::time::Duration::from_secs(120),
        replicas: 1,
        last: (stream.last_sequence() > 0).then(|| stream.mark(stream.last_sequence())),
    }
}

/// `sink::vouch::Vouching::holds`, over the model's stream: whether the stream holds `event`
/// in the run (S4, RV1, RV2), the comparison's state advanced. Line by line: past the
/// tail's position or ended, nothing; the run located on the first event (`locate`, the
/// walk back from the tail); then the run read on from where the last search ended, passing
/// over messages that are not the event (`seek`), until one is (vouched for, the search
/// goes on after it) or the run ends (the comparison ends: RV2).
fn holds(session: &mut Session, event: &OutboxEvent, stream: &Stream, lineage: &Lineage) -> bool {
    let Some((through, mut next)) = reading(session, event, |last_sequence| {
        locate(
            Walk::from_tail(last_sequence, event.position),
            last_sequence,
            stream,
            |walk, sequence, mark| walk.step(sequence, mark, lineage),
            Walk::start,
        )
    }) else {
        return false;
    };
    let last_sequence = session.start;
    let found = loop {
        // `next`: the run's next message, none past the tail.
        if next > last_sequence {
            break false;
        }
        let mark = stream.mark(next);
        next += 1;
        match mark {
            // `seek`: the event, or passed over.
            Ok(mark) => {
                if seek(&mark, event, lineage).is_ok() {
                    break true;
                }
            }
            // A read that fails is never taken for a message that vouches (RV2).
            Err(_) => break false,
        }
    };
    session.vouching = Vouching::Reading(next);
    judged(session, event, through, found)
}

/// What [`holds`] and [`holds_aligned`] do before the run is read: `None` when the
/// comparison is off, or ended (for good once `event` is past the tail's position);
/// otherwise where it ends and the run's next sequence, the run located first
/// (`locate_run`, from the tail's sequence) for the first event compared.
fn reading(
    session: &mut Session,
    event: &OutboxEvent,
    locate_run: impl FnOnce(u64) -> u64,
) -> Option<(Position, u64)> {
    let through = session.compare?;
    if session.vouching == Vouching::Off {
        return None;
    }
    if event.position > through || session.vouching == Vouching::Ended {
        session.vouching = Vouching::Ended;
        return None;
    }
    if session.vouching == Vouching::Unlocated {
        session.vouching = Vouching::Reading(locate_run(session.start));
    }
    let Vouching::Reading(next) = session.vouching else {
        return None;
    };
    Some((through, next))
}

/// The comparison after `event` was `found` in the run or not: an event not found ends it,
/// and so does the last one it compares (`through`).
fn judged(session: &mut Session, event: &OutboxEvent, through: Position, found: bool) -> bool {
    if !found || event.position == through {
        session.vouching = Vouching::Ended;
    }
    found
}

/// `locate`: the walk back from the tail at `last_sequence`, one message at a time, until
/// `step` says it stops; the run's first sequence, as `start` says.
fn locate<W>(
    mut walk: W,
    last_sequence: u64,
    stream: &Stream,
    mut step: impl FnMut(&mut W, u64, &Result<Mark, String>) -> bool,
    start: impl Fn(&W) -> u64,
) -> u64 {
    let mut sequence = last_sequence;
    while sequence > 0 {
        if !step(&mut walk, sequence, &stream.mark(sequence)) {
            break;
        }
        sequence -= 1;
    }
    start(&walk)
}

/// [`Rules::BeforeFixes`]: `sink::vouch::Vouching::holds` as it was before 30dd6ee, over
/// the model's stream: the run (found by [`OldWalk`]) is aligned with the replay, each event
/// compared with the run's next message alone ([`vouch`]); the first that is not it ends
/// the comparison.
fn holds_aligned(
    session: &mut Session,
    event: &OutboxEvent,
    stream: &Stream,
    lineage: &Lineage,
) -> bool {
    let Some((through, next)) = reading(session, event, |last_sequence| {
        locate(
            OldWalk::from_tail(last_sequence, event.position),
            last_sequence,
            stream,
            |walk, sequence, mark| walk.step(sequence, mark, lineage),
            |walk| walk.start,
        )
    }) else {
        return false;
    };
    let found = next <= session.start && {
        session.vouching = Vouching::Reading(next + 1);
        stream
            .mark(next)
            .is_ok_and(|mark| vouch(&mark, event, lineage).is_ok())
    };
    judged(session, event, through, found)
}

/// [`Rules::BeforeFixes`]: `sink::resume::Walk` as it was before 30dd6ee (`git show
/// 30dd6ee^:crates/sink/src/resume.rs`): the walk back also stops at a message not before
/// the one after it (the run in commit order), so it stops at a lost history's message at
/// a position the new history reuses.
struct OldWalk {
    first: Position,
    later: Option<Position>,
    start: u64,
}

impl OldWalk {
    fn from_tail(last_sequence: u64, first: Position) -> OldWalk {
        OldWalk {
            first,
            later: None,
            start: last_sequence + 1,
        }
    }

    fn step(&mut self, sequence: u64, mark: &Result<Mark, String>, lineage: &Lineage) -> bool {
        if !old_walks_past(mark, self.first, self.later, lineage) {
            return false;
        }
        self.later = mark.as_ref().ok().and_then(|mark| mark.position);
        self.start = sequence;
        true
    }
}

/// `sink::resume::walks_past` before 30dd6ee: a message of `lineage` at or after `first`
/// and before `later`.
fn old_walks_past(
    mark: &Result<Mark, String>,
    first: Position,
    later: Option<Position>,
    lineage: &Lineage,
) -> bool {
    walks_past(mark, first, lineage)
        && later.is_none_or(|later| {
            mark.as_ref()
                .is_ok_and(|mark| mark.position.is_some_and(|position| position < later))
        })
}

/// P8 (`Duplicates::other_event`, not callable: a private method): the original at
/// `sequence` must be `row`'s event by `Claim::is_row`. `Err(Some(halt))` when it is not.
fn p8(stream: &Stream, sequence: u64, row: Row) -> Result<(), Option<Halt>> {
    let Some(original) = stream.at(sequence) else {
        // Gone from the stream: nothing to check (cannot happen: MW4).
        return Ok(());
    };
    let mark: Mark = mark_of(original);
    if mark
        .claim
        .is_row(&EventId::Int(row.id), row.created_at_ms())
    {
        return Ok(());
    }
    if mark.claim.is_anonymous() {
        return Err(Some(Halt::ForeignDuplicate));
    }
    Err(Some(Halt::ReusedId {
        row,
        original: original.row,
    }))
}

/// Old S4's check of the tail's row (`relay::process::stored::check_tail`): the row with the
/// mark's `Outbox-Id` exists and yields its `Nats-Msg-Id` and ordering key.
fn tail_row_checks_out(pg: &Pg, mark: &Mark, position: Position) -> bool {
    let Some(EventId::Int(id)) = mark.claim.id else {
        return false;
    };
    pg.table
        .iter()
        .find(|row| row.id == id)
        .is_some_and(|row| mark.claim.check(&event(*row, position)).is_ok())
}

/// The tracker's protocol is kept by construction (begin, publish, commit, ack in order):
/// misuse is a bug in the model, and panics.
#[allow(clippy::unwrap_used)]
fn tracker<T>(result: Result<T, sink::TrackerError>) -> T {
    result.unwrap()
}
