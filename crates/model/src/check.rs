//! The explorer: every state reachable within the bounds, breadth first, each checked
//! against the invariants, and from each, every fault-free continuation checked to end.
//!
//! # Invariants
//! - MC1 Every reachable state is visited once: a state's 64-bit fingerprint (SipHash with
//!   fixed keys, so runs repeat) goes into a table with its parent's and the action that
//!   reached it (parent pointers). A collision would hide a state; at 10⁷ states its
//!   chance is below 10⁻⁵, as in TLC's and stateright's fingerprinting.
//! - MC2 The safety invariants ([`Violation`]) hold in every visited state; the first state
//!   that breaks one ends the search, and its trace is the shortest (breadth first).
//! - MC3 Progress: from every visited state, every run of relay steps alone (no fault, no
//!   commit) reaches a goal state (every committed event stored and confirmed, or a halt
//!   the relay names, P8) — no cycle, no dead end. Checked by a depth-first search of the
//!   fault-free steps with a memo of states known good; a state met again on the search's
//!   own path is a cycle (a session loop). The search stops at a state that breaks a safety
//!   invariant: that state is reachable, and MC2 reports it.
//! - MC4 A counterexample is printed as a numbered trace, replayed from the initial state
//!   (MM1), each step with what the relay decided and the state after it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::{self, Write as _};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use crate::model::{Action, Model, State};
use crate::world::{at, Row};

/// A broken invariant, numbered as docs/architecture.md numbers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// I1: the slot confirmed a transaction whose event the stream does not hold.
    I1 {
        /// The event.
        row: Row,
    },
    /// I5: two events of the current history stored out of commit order.
    I5 {
        /// The later event stored first.
        first: Row,
        /// The earlier event stored after it.
        then: Row,
    },
    /// I6: an event stored twice.
    I6Twice {
        /// The event.
        row: Row,
    },
    /// I6: the stream holds an event but not an earlier one (a gap).
    I6Gap {
        /// The event missing.
        missing: Row,
        /// A later event stored.
        stored: Row,
    },
    /// Nothing rolled back is published.
    RolledBack {
        /// The event.
        row: Row,
    },
    /// Progress: a fault-free run of the relay comes back to a state it was in.
    Loop,
    /// Progress: a fault-free run of the relay stops short of storing and confirming
    /// everything.
    Stuck,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::I1 { row } => write!(
                f,
                "I1 (confirm only what is stored): the slot confirmed past {row}, which the stream does not hold"
            ),
            Violation::I5 { first, then } => write!(
                f,
                "I5 (commit order): {first} stored before {then}, committed earlier"
            ),
            Violation::I6Twice { row } => {
                write!(f, "I6 (exactly once): {row} is stored twice")
            }
            Violation::I6Gap { missing, stored } => write!(
                f,
                "I6 (a gap-free prefix of the commit order): {stored} is stored, {missing} before it is not"
            ),
            Violation::RolledBack { row } => {
                write!(f, "nothing rolled back: {row} was rolled back and is stored")
            }
            Violation::Loop => write!(
                f,
                "progress: without any further fault the relay comes back to a state it was in (a session loop)"
            ),
            Violation::Stuck => write!(
                f,
                "progress: without any further fault the relay stops short of storing and confirming every committed event"
            ),
        }
    }
}

/// The safety invariants (MC2) of `state`: the first broken, if any.
pub fn safety(state: &State) -> Option<Violation> {
    let committed: Vec<(Row, outbox::Position, u64)> = state.pg.events().collect();
    let count = |row: Row| {
        state
            .stream
            .messages
            .iter()
            .filter(|m| m.row == row)
            .count()
    };
    for &(row, _, end) in &committed {
        if end <= state.pg.confirmed && count(row) == 0 {
            return Some(Violation::I1 { row });
        }
    }
    for message in &state.stream.messages {
        if state.rolled_back.contains(&message.row) {
            return Some(Violation::RolledBack { row: message.row });
        }
    }
    for &(row, ..) in &committed {
        if count(row) > 1 {
            return Some(Violation::I6Twice { row });
        }
    }
    let mut stored_yet: Option<(Row, outbox::Position)> = None;
    for message in &state.stream.messages {
        let Some(&(row, position, _)) = committed.iter().find(|(row, ..)| *row == message.row)
        else {
            continue;
        };
        if let Some((first, before)) = stored_yet {
            if position == before {
                return Some(Violation::I6Twice { row });
            }
            if position < before {
                return Some(Violation::I5 { first, then: row });
            }
        }
        stored_yet = Some((row, position));
    }
    let mut missing = None;
    for &(row, ..) in &committed {
        match (count(row), missing) {
            (0, None) => missing = Some(row),
            (0, Some(_)) => {}
            (n, _) if n > 1 => return Some(Violation::I6Twice { row }),
            (_, Some(missing)) => {
                return Some(Violation::I6Gap {
                    missing,
                    stored: row,
                })
            }
            _ => {}
        }
    }
    None
}

/// The goal of progress (MC3): every committed event stored and confirmed, or the relay
/// halted naming why (P8).
pub fn goal(state: &State) -> bool {
    state.relay.halted.is_some()
        || state
            .pg
            .last_end()
            .is_none_or(|end| state.pg.confirmed >= end)
}

/// A counterexample: the broken invariant and the steps to it.
#[derive(Debug, Clone)]
pub struct Counterexample {
    /// What broke.
    pub violation: Violation,
    /// The steps from the initial state.
    pub actions: Vec<Action>,
    /// Where the fault-free run starts (progress), or the trace's end.
    pub fault_free_from: usize,
    /// For a loop: the step after which the run came back to the state it had.
    pub back_to: Option<usize>,
    /// The numbered trace, in words (MC4).
    pub trace: String,
}

impl fmt::Display for Counterexample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "counterexample: {}", self.violation)?;
        f.write_str(&self.trace)
    }
}

/// What a check found.
#[derive(Debug, Clone)]
pub struct Report {
    /// States visited.
    pub states: usize,
    /// Transitions taken.
    pub transitions: usize,
    /// The longest trace (breadth-first depth).
    pub depth: usize,
    /// Visited states where the relay halted (P8), with the first's trace.
    pub halted: usize,
    /// States the progress search visited.
    pub progress_states: usize,
    /// How long it took.
    pub elapsed: Duration,
    /// The first invariant broken, if any.
    pub counterexample: Option<Counterexample>,
}

impl Report {
    /// The report of a search that has seen the initial state alone.
    fn empty() -> Report {
        Report {
            states: 1,
            transitions: 0,
            depth: 0,
            halted: 0,
            progress_states: 0,
            elapsed: Duration::ZERO,
            counterexample: None,
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} states, {} transitions, depth {}, {} halted (P8), progress searched {} states, {:.1?}",
            self.states, self.transitions, self.depth, self.halted, self.progress_states, self.elapsed
        )?;
        if let Some(counterexample) = &self.counterexample {
            write!(f, "\n{counterexample}")?;
        }
        Ok(())
    }
}

fn fingerprint(state: &State) -> u64 {
    let mut hasher = DefaultHasher::new();
    state.hash(&mut hasher);
    hasher.finish()
}

/// Explores every state of `model` (MC1–MC4).
pub fn check(model: &Model) -> Report {
    check_with(model, Options::default())
}

/// Explores every state of `model` for the safety invariants alone (MC1, MC2, MC4): a
/// counterexample to safety behind a shorter one to progress.
pub fn check_safety(model: &Model) -> Report {
    check_with(model, Options { progress: false })
}

/// What [`check_with`] checks.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// MC3, progress (on by default).
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { progress: true }
    }
}

/// Explores every state of `model` as `options` say (MC1–MC4).
pub fn check_with(model: &Model, options: Options) -> Report {
    let check_progress = options.progress;
    let started = Instant::now();
    let init = model.init();
    let root = fingerprint(&init);
    let mut seen = Seen::new();
    seen.insert(root, (root, None, 0));
    let mut queue = VecDeque::from([(init, root)]);
    let mut progress = Progress::new(model);
    let mut report = Report::empty();
    let mut actions = Vec::new();
    while let Some((state, fp)) = queue.pop_front() {
        let path = || path_to(&seen, fp);
        if let Some(violation) = safety(&state) {
            let actions = path();
            let end = actions.len();
            report.counterexample = Some(narrate(model, violation, actions, end, None));
            break;
        }
        if state.relay.halted.is_some() {
            report.halted += 1;
        }
        let progressed = if check_progress {
            progress.good(&state, fp)
        } else {
            Ok(())
        };
        if let Err((violation, suffix, back_to)) = progressed {
            let mut actions = path();
            let from = actions.len();
            let back_to = back_to.map(|i| from + i);
            actions.extend(suffix);
            report.counterexample = Some(narrate(model, violation, actions, from, back_to));
            break;
        }
        expand(
            model,
            &state,
            fp,
            &mut seen,
            &mut queue,
            &mut report,
            &mut actions,
        );
    }
    report.states = seen.len();
    report.progress_states = progress.memo.len();
    report.elapsed = started.elapsed();
    report
}

/// MC1's table: fingerprint -> (parent's fingerprint, action, depth).
type Seen = HashMap<u64, (u64, Option<Action>, u32)>;

/// Every state one step from `state` (fingerprint `fp`) counted as a transition, and those
/// not seen before recorded with their parent and queued (MC1).
fn expand(
    model: &Model,
    state: &State,
    fp: u64,
    seen: &mut Seen,
    queue: &mut VecDeque<(State, u64)>,
    report: &mut Report,
    actions: &mut Vec<Action>,
) {
    let depth = seen.get(&fp).map_or(0, |s| s.2);
    model.actions(state, true, actions);
    for &action in actions.iter() {
        let Some(next) = model.step(state, action, &mut None) else {
            continue;
        };
        report.transitions += 1;
        let next_fp = fingerprint(&next);
        if let std::collections::hash_map::Entry::Vacant(entry) = seen.entry(next_fp) {
            entry.insert((fp, Some(action), depth + 1));
            report.depth = report.depth.max(depth as usize + 1);
            queue.push_back((next, next_fp));
        }
    }
}

/// The actions from the initial state to the state `fp`.
fn path_to(seen: &Seen, mut fp: u64) -> Vec<Action> {
    let mut actions = Vec::new();
    while let Some(&(parent, Some(action), _)) = seen.get(&fp) {
        actions.push(action);
        fp = parent;
    }
    actions.reverse();
    actions
}

/// MC3's search: a memo of states whose every fault-free run reaches the goal.
struct Progress<'m> {
    model: &'m Model,
    memo: HashSet<u64>,
    actions: Vec<Vec<Action>>,
}

/// A progress failure: the violation, the fault-free actions from the state searched, and
/// for a loop the index of the step after which the state recurs (`None`: the start).
type Failure = (Violation, Vec<Action>, Option<usize>);

impl<'m> Progress<'m> {
    fn new(model: &'m Model) -> Self {
        Progress {
            model,
            memo: HashSet::new(),
            actions: Vec::new(),
        }
    }

    /// Whether every fault-free run from `state` reaches the goal (MC3).
    fn good(&mut self, state: &State, fp: u64) -> Result<(), Failure> {
        let mut path = Vec::new();
        let mut on_path = vec![fp];
        self.search(state, fp, &mut path, &mut on_path)
    }

    fn search(
        &mut self,
        state: &State,
        fp: u64,
        path: &mut Vec<Action>,
        on_path: &mut Vec<u64>,
    ) -> Result<(), Failure> {
        // A state breaking a safety invariant ends the search: the breadth-first search
        // reports it (it is reachable), with its own, shorter, trace.
        if self.memo.contains(&fp) || goal(state) || safety(state).is_some() {
            self.memo.insert(fp);
            return Ok(());
        }
        let depth = path.len();
        if self.actions.len() <= depth {
            self.actions.push(Vec::new());
        }
        let mut actions = std::mem::take(&mut self.actions[depth]);
        self.model.actions(state, false, &mut actions);
        let mut none = None;
        let mut any = false;
        for &action in &actions {
            let Some(next) = self.model.step(state, action, &mut none) else {
                continue;
            };
            any = true;
            let next_fp = fingerprint(&next);
            path.push(action);
            if let Some(at) = on_path.iter().position(|&f| f == next_fp) {
                // A state on the search's own path: a cycle (MC3).
                let back_to = at.checked_sub(1);
                return Err((Violation::Loop, path.clone(), back_to));
            }
            on_path.push(next_fp);
            self.search(&next, next_fp, path, on_path)?;
            on_path.pop();
            path.pop();
        }
        self.actions[depth] = actions;
        if !any {
            return Err((Violation::Stuck, path.clone(), None));
        }
        self.memo.insert(fp);
        Ok(())
    }
}

/// Replays `actions` from the initial state into a numbered trace (MC4).
fn narrate(
    model: &Model,
    violation: Violation,
    actions: Vec<Action>,
    fault_free_from: usize,
    back_to: Option<usize>,
) -> Counterexample {
    let mut trace = String::new();
    let mut state = model.init();
    let _ = writeln!(trace, "   0. initial: {}", summary(&state));
    for (i, &action) in actions.iter().enumerate() {
        if i == fault_free_from && fault_free_from < actions.len() {
            let _ = writeln!(trace, "      -- from here on, no fault and no commit --");
        }
        let mut log = Some(String::new());
        let Some(next) = model.step(&state, action, &mut log) else {
            let _ = writeln!(trace, "  {:>2}. {action}: NOT ENABLED (model bug)", i + 1);
            break;
        };
        state = next;
        let _ = writeln!(
            trace,
            "  {:>2}. {}\n      => {}",
            i + 1,
            log.unwrap_or_default(),
            summary(&state)
        );
    }
    match (&violation, back_to) {
        (Violation::Loop, Some(step)) => {
            let _ = writeln!(
                trace,
                "      (the state after step {} again: the relay loops)",
                step + 1
            );
        }
        (Violation::Loop, None) => {
            let _ = writeln!(
                trace,
                "      (the state after step {} again: the relay loops)",
                fault_free_from
            );
        }
        _ => {}
    }
    Counterexample {
        violation,
        actions,
        fault_free_from,
        back_to,
        trace,
    }
}

/// One line of the world: stream, window, slot, table, session.
pub fn summary(state: &State) -> String {
    let mut s = String::new();
    let messages: Vec<String> = state
        .stream
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| format!("{}:{}@{}", i + 1, m.row, at(m.position)))
        .collect();
    let window: Vec<String> = state
        .stream
        .window
        .keys()
        .map(ToString::to_string)
        .collect();
    let table: Vec<String> = state.pg.table.iter().map(ToString::to_string).collect();
    let _ = write!(
        s,
        "stream [{}] window {{{}}} | WAL end {} slot {} table [{}]",
        messages.join(" "),
        window.join(","),
        state.pg.next_lsn,
        state.pg.confirmed,
        table.join(" ")
    );
    match &state.relay.session {
        Some(session) => {
            let _ = write!(
                s,
                " | session: fence {} watermark {} in flight {} answers {}",
                session.fence,
                session.tracker.watermark(),
                session.in_flight.len(),
                session.answers.len()
            );
        }
        None if state.relay.halted.is_some() => s.push_str(" | relay HALTED"),
        None => s.push_str(" | no session"),
    }
    if let Some((position, row)) = state.relay.memory {
        let _ = write!(s, " | memory {row}@{}", at(position));
    }
    if let Some(position) = state.relay.failed_through {
        let _ = write!(s, " | failed through {}", at(position));
    }
    s
}

/// Finding MF1 (issue 37's model checker, against [`Rules::BeforeFixes`]; fixed on main):
/// after a Postgres restore, once the duplicate window has expired, an event of the current
/// history that the stream holds is stored a second time. Two causes: the restored WAL end
/// lay at or below the stream's tail (a lost history's message), so `sink::resume::plan`
/// gave no position to compare through (S1, `Distrust::BeyondWalEnd`; fixed in d2a8769); or
/// the walk back from the tail stopped at a lost history's message at the same position as
/// a new one (not in commit order), and the run, aligned message by message with the replay,
/// missed the current history's messages (fixed in 30dd6ee: each event is sought in the
/// run). Either way the event was replayed in doubt (S6) and only the window recognised it.
/// Whether a counterexample is this one: an event stored twice, on a trace with a restore
/// and a window expiry.
///
/// [`Rules::BeforeFixes`]: crate::Rules::BeforeFixes
pub fn finding_mf1(violation: &Violation, actions: &[Action]) -> bool {
    matches!(violation, Violation::I6Twice { .. })
        && actions.contains(&Action::Expire)
        && actions.iter().any(|a| matches!(a, Action::Restore(_)))
}
