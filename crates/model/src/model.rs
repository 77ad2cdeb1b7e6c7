//! The model's state, its bounds and its steps: the environment's (commits, rollbacks,
//! deletes, a TRUNCATE, the duplicate window's expiry, a cold backup and its restore, a
//! crash of the relay) and the relay's ([`crate::relay`]).
//!
//! # Invariants
//! - MM1 [`Model::step`] is a function of the state and the action: a trace replays to the
//!   same states, which is how counterexamples are printed.
//! - MM2 Faults are bounded by [`Bounds`] and counted down in the state ([`Left`]); the
//!   relay's own steps ([`Action::is_relay`]) are never bounded: a state space is finite
//!   because every fault-free run of the relay ends (or the checker says it does not).

use std::fmt;

use crate::relay::{Context, Relay};
use crate::world::{Pg, Row, Stream, Txn};
use crate::Rules;

/// How much of each fault the environment may inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Transactions (committed or rolled back).
    pub transactions: u8,
    /// Events per committed transaction, at most (1 or 2).
    pub max_events: u8,
    /// Whether a transaction may roll back.
    pub rollbacks: bool,
    /// Relay crashes (process deaths: in-flight state and process memory lost).
    pub crashes: u8,
    /// Restores of a cold backup (each after one backup).
    pub restores: u8,
    /// Deletes of one row, or TRUNCATEs, by others.
    pub deletes: u8,
    /// Whether a delete may be a TRUNCATE of the whole table.
    pub truncate: bool,
    /// Expiries of the duplicate window.
    pub expiries: u8,
    /// `max_in_flight`.
    pub window: usize,
    /// P5's id chain (a one-replica stream).
    pub id_chain: bool,
}

impl Bounds {
    /// The bounds CI checks: 3 transactions of up to 2 events (or rolled back), a crash, a
    /// backup and its restore, a delete or TRUNCATE, a window expiry, 2 publishes in flight,
    /// the id chain.
    pub fn ci() -> Bounds {
        Bounds {
            transactions: 3,
            max_events: 2,
            rollbacks: true,
            crashes: 1,
            restores: 1,
            deletes: 1,
            truncate: true,
            expiries: 1,
            window: 2,
            id_chain: true,
        }
    }

    /// `OUTBOX_MODEL_DEEP=1`: [`Bounds::ci`] with 2 crashes.
    pub fn deep() -> Bounds {
        Bounds {
            crashes: 2,
            ..Bounds::ci()
        }
    }

    /// `OUTBOX_MODEL_DEEP=1`'s second run: 4 transactions and 2 crashes, no restore (4
    /// transactions with a restore are checked only in MF2's smaller world, `tests/check.rs`).
    pub fn deep_without_restore() -> Bounds {
        Bounds {
            transactions: 4,
            restores: 0,
            ..Bounds::deep()
        }
    }

    /// No faults at all: only transactions.
    pub fn none() -> Bounds {
        Bounds {
            transactions: 0,
            max_events: 2,
            rollbacks: false,
            crashes: 0,
            restores: 0,
            deletes: 0,
            truncate: false,
            expiries: 0,
            window: 2,
            id_chain: true,
        }
    }
}

/// Faults and transactions still allowed (MM2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Left {
    /// Transactions.
    pub transactions: u8,
    /// Crashes.
    pub crashes: u8,
    /// Backups.
    pub backups: u8,
    /// Restores.
    pub restores: u8,
    /// Deletes or TRUNCATEs.
    pub deletes: u8,
    /// Window expiries.
    pub expiries: u8,
}

/// The whole world.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// Postgres.
    pub pg: Pg,
    /// A cold backup, once taken.
    pub backup: Option<Pg>,
    /// The stream.
    pub stream: Stream,
    /// The relay.
    pub relay: Relay,
    /// The wall clock: `created_at` of the next transaction (never rewinds).
    pub clock: u32,
    /// Rows of rolled-back transactions.
    pub rolled_back: Vec<Row>,
    /// What the environment may still do.
    pub left: Left,
}

/// One step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A transaction of n events commits.
    Commit(u8),
    /// A transaction of one event rolls back.
    Rollback,
    /// Another client deletes the row with this id.
    Delete(i64),
    /// Another client truncates the table.
    Truncate,
    /// The duplicate window expires.
    Expire,
    /// A cold backup of Postgres is taken.
    Backup,
    /// Postgres is restored from the backup; the session ends, `landed` of its in-flight
    /// publishes reaching the server.
    Restore(u8),
    /// The relay crashes, `landed` of its in-flight publishes reaching the server.
    Crash(u8),
    /// The relay starts a session.
    Start,
    /// The relay's publisher takes the next replicated event.
    Take,
    /// The server answers the oldest in-flight publish.
    Process,
    /// The relay's acker handles the oldest answer (`landed`: if it ends the session).
    Ack(u8),
    /// The relay confirms its watermark to the slot.
    Confirm,
}

impl Action {
    /// A step of the relay (or of the server answering it): no fault, no new commit.
    pub fn is_relay(self) -> bool {
        matches!(
            self,
            Action::Start | Action::Take | Action::Process | Action::Ack(_) | Action::Confirm
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Commit(n) => write!(f, "commit a transaction of {n}"),
            Action::Rollback => write!(f, "roll back a transaction"),
            Action::Delete(id) => write!(f, "delete row {id} from the table"),
            Action::Truncate => write!(f, "TRUNCATE the table"),
            Action::Expire => write!(f, "the duplicate window expires"),
            Action::Backup => write!(f, "take a cold backup"),
            Action::Restore(n) => write!(f, "restore the cold backup ({n} in flight land)"),
            Action::Crash(n) => write!(f, "the relay crashes ({n} in flight land)"),
            Action::Start => write!(f, "start a session"),
            Action::Take => write!(f, "take the next event"),
            Action::Process => write!(f, "the server answers a publish"),
            Action::Ack(n) => write!(f, "the acker takes an answer ({n} land if it ends)"),
            Action::Confirm => write!(f, "confirm"),
        }
    }
}

/// The model: the rules deciding, the bounds of the environment.
#[derive(Debug, Clone)]
pub struct Model {
    /// Which rules decide.
    pub rules: Rules,
    /// The bounds.
    pub bounds: Bounds,
    context: Context,
}

impl Model {
    /// A model of `rules` under `bounds`.
    pub fn new(rules: Rules, bounds: Bounds) -> Model {
        Model {
            rules,
            bounds,
            context: Context::new(rules, bounds.window, bounds.id_chain),
        }
    }

    /// The initial state: an empty table, a slot just created, an empty stream.
    pub fn init(&self) -> State {
        let b = self.bounds;
        State {
            pg: Pg::new(),
            backup: None,
            stream: Stream::default(),
            relay: Relay::default(),
            clock: 1,
            rolled_back: Vec::new(),
            left: Left {
                transactions: b.transactions,
                crashes: b.crashes,
                backups: b.restores,
                restores: b.restores,
                deletes: b.deletes,
                expiries: b.expiries,
            },
        }
    }

    /// The actions to try in `state` (the environment's only with `faults`); a step may
    /// still not be enabled ([`Model::step`] says `None`).
    pub fn actions(&self, state: &State, faults: bool, out: &mut Vec<Action>) {
        out.clear();
        let in_flight = state
            .relay
            .session
            .as_ref()
            .map_or(0, |s| u8::try_from(s.in_flight.len()).unwrap_or(u8::MAX));
        if state.relay.halted.is_none() {
            match &state.relay.session {
                None => out.push(Action::Start),
                Some(session) => {
                    out.push(Action::Take);
                    if !session.in_flight.is_empty() {
                        out.push(Action::Process);
                    }
                    if !session.answers.is_empty() {
                        out.extend((0..=in_flight).map(Action::Ack));
                    }
                    out.push(Action::Confirm);
                }
            }
        }
        if !faults {
            return;
        }
        let left = state.left;
        if left.transactions > 0 {
            out.extend((1..=self.bounds.max_events).map(Action::Commit));
            if self.bounds.rollbacks {
                out.push(Action::Rollback);
            }
        }
        if left.deletes > 0 {
            out.extend(state.pg.table.iter().map(|row| Action::Delete(row.id)));
            if self.bounds.truncate && !state.pg.table.is_empty() {
                out.push(Action::Truncate);
            }
        }
        if left.expiries > 0 && !state.stream.window.is_empty() {
            out.push(Action::Expire);
        }
        if left.backups > 0 {
            out.push(Action::Backup);
        }
        if left.restores > 0 && state.backup.is_some() {
            out.extend((0..=in_flight).map(Action::Restore));
        }
        if left.crashes > 0 && state.relay.session.is_some() {
            out.extend((0..=in_flight).map(Action::Crash));
        }
    }

    /// The state after `action`, or `None` when it is not enabled. With `log`, what
    /// happened, in words.
    pub fn step(&self, state: &State, action: Action, log: &mut Option<String>) -> Option<State> {
        let mut next = state.clone();
        let relay = &self.context;
        let done = match action {
            Action::Start => {
                relay.start(&mut next.relay, &next.pg, &next.stream, log);
                true
            }
            Action::Take => relay.take(&mut next.relay, &next.pg.wal, &next.stream, log),
            Action::Process => next.relay.process(&mut next.stream, log),
            Action::Ack(landed) => relay.ack(&mut next.relay, &mut next.stream, landed.into(), log),
            Action::Confirm => relay.confirm(&next.relay, &mut next.pg, log),
            Action::Commit(n) => next.commit(n, log),
            Action::Rollback => next.roll_back(log),
            Action::Delete(id) => next.delete(id, log),
            Action::Truncate => next.truncate(log),
            Action::Expire => next.expire(log),
            Action::Backup => next.take_backup(log),
            Action::Restore(landed) => next.restore(landed, log),
            Action::Crash(landed) => next.crash(landed, log),
        };
        done.then_some(next)
    }
}

/// The environment's steps, one per kind of [`Action`]: each changes the state in place and
/// says whether it was enabled (when not, [`Model::step`] drops the changed state).
impl State {
    /// A transaction of `n` events commits.
    fn commit(&mut self, n: u8, log: &mut Option<String>) -> bool {
        let pg = &mut self.pg;
        let rows: Vec<Row> = (0..i64::from(n))
            .map(|i| Row {
                id: pg.next_id + i,
                created: self.clock,
            })
            .collect();
        pg.wal.push(Txn {
            commit: pg.next_lsn,
            end: pg.next_lsn + 1,
            rows: rows.clone(),
        });
        pg.next_lsn += 2;
        pg.next_id += i64::from(n);
        pg.table.extend(rows.iter().copied());
        self.clock += 1;
        self.left.transactions -= 1;
        say(log, || {
            let ids: Vec<String> = rows.iter().map(ToString::to_string).collect();
            format!(
                "postgres: commit at LSN {} (end {}): {}",
                self.pg.next_lsn - 2,
                self.pg.next_lsn - 1,
                ids.join(", ")
            )
        });
        true
    }

    /// A transaction of one event rolls back: it takes an id and a clock tick.
    fn roll_back(&mut self, log: &mut Option<String>) -> bool {
        let row = Row {
            id: self.pg.next_id,
            created: self.clock,
        };
        self.rolled_back.push(row);
        self.pg.next_id += 1;
        self.clock += 1;
        self.left.transactions -= 1;
        say(log, || {
            format!("postgres: a transaction inserting {row} rolls back")
        });
        true
    }

    /// Another client deletes the row with `id`.
    fn delete(&mut self, id: i64, log: &mut Option<String>) -> bool {
        self.pg.table.retain(|row| row.id != id);
        self.left.deletes -= 1;
        say(log, || {
            format!("others: DELETE row id {id} from the outbox table")
        });
        true
    }

    /// Another client truncates the table.
    fn truncate(&mut self, log: &mut Option<String>) -> bool {
        self.pg.table.clear();
        self.left.deletes -= 1;
        say(log, || "others: TRUNCATE the outbox table".to_owned());
        true
    }

    /// The duplicate window expires.
    fn expire(&mut self, log: &mut Option<String>) -> bool {
        self.stream.window.clear();
        self.left.expiries -= 1;
        say(log, || "nats: the duplicate window expires".to_owned());
        true
    }

    /// A cold backup of Postgres is taken.
    fn take_backup(&mut self, log: &mut Option<String>) -> bool {
        self.backup = Some(self.pg.clone());
        self.left.backups -= 1;
        say(log, || {
            format!(
                "postgres: cold backup taken (WAL end {}, slot {})",
                self.pg.next_lsn, self.pg.confirmed
            )
        });
        true
    }

    /// Postgres is restored from the backup; the session ends, `landed` of its in-flight
    /// publishes reaching the server. Not enabled without a backup or `landed` publishes.
    fn restore(&mut self, landed: u8, log: &mut Option<String>) -> bool {
        let Some(backup) = self.backup.take() else {
            return false;
        };
        say(log, || {
            format!(
                "postgres: RESTORED from the cold backup (WAL end {} -> {}, slot {} -> {})",
                self.pg.next_lsn, backup.next_lsn, self.pg.confirmed, backup.confirmed
            )
        });
        if !self.ends(landed) {
            return false;
        }
        self.relay.end_session(&mut self.stream, landed.into(), log);
        self.pg = backup;
        self.left.restores -= 1;
        true
    }

    /// The relay crashes, `landed` of its in-flight publishes reaching the server; the
    /// process's memory is lost.
    fn crash(&mut self, landed: u8, log: &mut Option<String>) -> bool {
        if !self.ends(landed) {
            return false;
        }
        say(log, || "relay: CRASH".to_owned());
        self.relay.end_session(&mut self.stream, landed.into(), log);
        self.relay.memory = None;
        self.relay.failed_through = None;
        self.left.crashes -= 1;
        true
    }

    /// Whether `landed` publishes can land when the session ends.
    fn ends(&self, landed: u8) -> bool {
        usize::from(landed) <= self.relay.session.as_ref().map_or(0, |s| s.in_flight.len())
    }
}

fn say(log: &mut Option<String>, what: impl FnOnce() -> String) {
    if let Some(log) = log {
        log.push_str(&what());
    }
}
