//! An explicit-state model checker of the relay's restart decisions (issue 37).
//!
//! The world around the relay is modelled, small and explicit ([`world`], [`model`]): an
//! outbox table whose rows others delete or TRUNCATE at any time, the WAL in commit order
//! with transactions of 1–2 events (some rolled back), the slot's confirmed position, a
//! cold backup that rewinds WAL, slot and table and is then written past with reused ids and
//! LSNs (another `created_at`, so another ordering key), and the JetStream stream with the
//! relay's marks on each message, its last sequence, a duplicate window that expires, and
//! its answer to each publish (stored, duplicate, or refused by the fence). The relay
//! ([`relay`]) crashes between any two steps, losing its session and the process's memory.
//! Every decision the relay takes is its own code: `sink::resume::plan`, `Walk`, `seek`
//! (`vouch`), `Doubt`, `AckTracker`, `Claim::is_row`.
//!
//! [`check()`] explores every interleaving up to [`Bounds`] breadth first and checks, in every
//! state, the invariants as docs/architecture.md numbers them: I1 (the slot never confirms
//! past an event the stream does not hold), I5 (commit order), I6 (exactly once, a gap-free
//! prefix of the commit order), nothing rolled back; and progress: from every state, every
//! run of the relay without further faults reaches a state where every committed event is
//! stored and confirmed (or the relay halted naming a reused id, P8), never a loop.
//!
//! # Why an explorer of our own, not stateright
//! stateright 0.31 (crates.io) would do, but the checker needs three things it does not give
//! as directly: the progress property as "every fault-free continuation of every reachable
//! state ends" (a search over a sub-graph from each state, with a memo; stateright's
//! `eventually` properties are checked per path and are documented as incomplete), traces
//! replayed with the relay's own words for each decision, and no dependency tree for a
//! test (stateright brings an HTTP explorer, crossbeam, dashmap, parking_lot, serde). The
//! explorer is 200 lines: a table of visited fingerprints with parent pointers, a queue,
//! and a memoised depth-first search for progress ([`mod@check`] MC1–MC4).
//!
//! # Rules
//! [`Rules::Current`] are main's rules (resume by seeking each replayed event in the stream's
//! run, S1–S6; the fence counting only what the stream stores, P15, with the first publish
//! after one in doubt settled too; the process's memory of what a failed session published,
//! `Doubt::at_start`'s `failed_through`). [`Rules::BeforeFixes`] are the rules the model was
//! first written against, before the fixes of its findings: a tail beyond the WAL end gives
//! nothing to compare through, the walk back from the tail stops at a message out of commit
//! order and the run is aligned with the replay message by message (both replicated in
//! [`relay`], since main no longer has them), P15 settles only before an event in doubt, and
//! the process keeps no memory. [`Rules::OldTableCheck`] re-implements the rules before issue
//! 37 (commit 739aa4d): skip through the tail's position once its row checks out against the
//! table (old S4), or through what the process saw acknowledged (old S2), and a fence that
//! predicts one more sequence per publish, duplicate or not. [`Rules::NoRowCheckOld`] is the
//! old rules without S4's row check. [`Rules::Without`] is the current rules without one
//! of MF1's two fixes ([`Fix`]). The checker must fail on each of these earlier or weakened
//! rule sets with the counterexample each is known for (mutation tests of the checker
//! itself: `tests/check.rs`), and pass on the current rules.
//!
//! Two parts of the current rules are reached but not needed within the bounds: with MF2's
//! walk gone (the seek), the current rules without the settle after a publish in doubt
//! still pass at the CI bounds and in MF2's world, and no session of the current rules ends
//! with an error but a P8 halt (after which no session starts), so `failed_through` is set
//! but never read. Neither is a mutation the checker can tell.
//!
//! # Findings, fixed on main
//! - MF1 ([`finding_mf1`]): after a restore and a window expiry, an event of the current
//!   history the stream holds is stored twice. Two causes: a restored WAL end at or below the
//!   stream's tail made `plan` compare nothing (`Distrust::BeyondWalEnd`; fixed in d2a8769:
//!   such a tail is reported and still compared through), and the walk back stopped at a lost
//!   history's message at a position the new history reuses, the aligned run then missing
//!   the current history's messages (fixed in 30dd6ee: the walk has no commit-order stop and
//!   each event is sought in the run, passing over what is not it).
//! - MF2: after a restore written past the old tail and a crash, a session loop (4
//!   transactions): the last event in doubt is answered as a duplicate and the first event
//!   past the doubt carries a fence that counted it (fixed in 109424d: the first publish after
//!   one in doubt settles too).
//!
//! # Decisions the model cannot call
//! Mirrored in [`relay`], each named there: the order of `sink::vouch::Vouching::holds` (when
//! the run is located, how the search goes on, when the comparison ends), the publisher's
//! `publish_item` and `settle` (skip, then settle when in doubt or after a publish in doubt,
//! then publish), `sink::publisher::publish`'s `fail_through` (a session ending with an
//! error), the acker's P8 judgement (`Duplicates::other_event`, private; the model calls
//! `Claim::is_row` and `Claim::is_anonymous` as it does), the fence's advance
//! (`Fence::advance`, `pub(crate)`), and where the slot's replay starts (Postgres).
//!
//! # What the model leaves out
//! One source and timeline (no fail-over, no timeline history: S5 is not exercised), no
//! lease or standby, no second writer, no shared mode, no atomic or fast batches, no
//! dead-letter policy (P8 halts), no stream limits, purges or deleted messages, no idle
//! positions or keepalives, no slot invalidation, no `--mark-published` and no identity
//! checks. With no other writer (no `outbox-relay replay --force`, the case
//! `failed_through` is for), the process's memory widens a doubt only to what a failed
//! session published and the stream did not store (its refused publish, publishes that never
//! landed) or to a lost history's positions after a restore. A session's start (slot, WAL end, tail, plan) is one step, and a dead session's
//! in-flight publishes land (a prefix of them) before anything else happens. The status
//! update may come at any time or never within a session (its timing is free). A TRUNCATE
//! does not restart identity (reused ids come from the restore). `Nats-Msg-Id` is a function
//! of the outbox id alone.
//!
//! # Invariants
//! - MW1–MW4 ([`world`]): what the environment is and how the stream answers.
//! - MM1–MM2 ([`model`]): steps are functions; faults are bounded, the relay's steps not.
//! - MR1–MR3 ([`relay`]): what a session keeps, how it ends, the window and P15.
//! - MC1–MC4 ([`mod@check`]): every state once; safety in each; progress from each; traces.

pub mod check;
pub mod model;
pub mod relay;
pub mod world;

pub use check::{
    check, check_safety, check_with, finding_mf1, Counterexample, Options, Report, Violation,
};
pub use model::{Action, Bounds, Model, State};

/// Which rules decide what a session skips and how the fence moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rules {
    /// main's rules: `sink::resume` S1–S6 (a tail beyond the WAL end still compared
    /// through; each replayed event sought in the run, `seek`; the walk back without the
    /// commit-order stop), P15 with the first publish after one in doubt settled too, and
    /// the process's memory of what a failed session published (`Doubt`'s
    /// `failed_through`).
    Current,
    /// The rules the model was first written against (issue 37's rules, before the fixes of
    /// findings MF1 and MF2): a tail beyond the WAL end compares nothing, the run is aligned
    /// with the replay message by message after a walk back that stops at a message out of
    /// commit order, P15 settles only before an event in doubt, and no memory of a failed
    /// session. The checker must find MF1 and MF2 on them.
    BeforeFixes,
    /// [`Rules::Current`] without one fix of finding MF1 (a mutation: the checker must find
    /// MF1 on each).
    Without(Fix),
    /// The rules of 739aa4d: the tail's row checked against the table (old S4), the
    /// process's memory of what was acknowledged (old S2), the fence always advancing.
    OldTableCheck,
    /// [`Rules::OldTableCheck`] without the row check.
    NoRowCheckOld,
}

/// A fix of finding MF1 on main, for [`Rules::Without`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fix {
    /// d2a8769: a tail at or beyond the WAL end is still compared through (before, `plan`
    /// gave no position to compare through).
    CompareBeyondWalEnd,
    /// 30dd6ee: each replayed event is sought in the run after a walk back without the
    /// commit-order stop (before, the run was aligned with the replay message by message).
    Seek,
}

impl Rules {
    /// Whether these rules compare replayed events with the stream (S4) and fence by S6.
    pub fn compares(self) -> bool {
        matches!(
            self,
            Rules::Current | Rules::BeforeFixes | Rules::Without(_)
        )
    }

    /// Whether these rules are main's rules, but for at most one fix of MF1.
    pub fn current(self) -> bool {
        matches!(self, Rules::Current | Rules::Without(_))
    }

    /// Whether these rules have `fix` (the rules that compare).
    pub fn has(self, fix: Fix) -> bool {
        match self {
            Rules::Current => true,
            Rules::Without(without) => without != fix,
            _ => false,
        }
    }
}
