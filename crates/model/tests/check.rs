//! The model checker on main's rules (it must pass) and on earlier rules (it must fail, with
//! the counterexample each is known for: mutation tests of the checker): the rules before
//! the fixes of findings MF1 and MF2, and the rules before issue 37.
//!
//! `OUTBOX_MODEL_DEEP=1` checks the current rules at larger bounds.

use outbox_model::{
    check, check_safety, finding_mf1, Action, Bounds, Fix, Model, Report, Rules, Violation,
};

fn run(rules: Rules, bounds: Bounds) -> Report {
    let report = check(&Model::new(rules, bounds));
    eprintln!("{rules:?} at {bounds:?}:\n{report}");
    report
}

fn passes(report: &Report) {
    assert!(
        report.counterexample.is_none(),
        "{}",
        report
            .counterexample
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default()
    );
}

/// The current rules keep I1, I5, I6, nothing rolled back, and progress in every state
/// within the CI bounds (`Bounds::ci`: 3 transactions of up to 2 events or rolled back, a
/// crash, a backup and its restore, a delete or TRUNCATE, a window expiry, 2 in flight, the
/// id chain), or with `OUTBOX_MODEL_DEEP=1` within `Bounds::deep` (2 crashes) and
/// `Bounds::deep_without_restore` (4 transactions, 2 crashes, no restore).
#[test]
fn the_current_rules_keep_every_invariant_and_always_progress() {
    let deep = std::env::var("OUTBOX_MODEL_DEEP").is_ok_and(|v| v == "1");
    let runs = if deep {
        vec![
            ("deep", Bounds::deep()),
            (
                "deep, 4 transactions, no restore",
                Bounds::deep_without_restore(),
            ),
        ]
    } else {
        vec![("CI", Bounds::ci())]
    };
    let mut total = 0;
    for (mode, bounds) in runs {
        let report = check(&Model::new(Rules::Current, bounds));
        eprintln!("Current at {bounds:?}:\n{report}");
        eprintln!(
            "model checker ({mode} mode): {} states explored, {} transitions, {} states with the relay halted (P8), {:.1?}",
            report.states, report.transitions, report.halted, report.elapsed
        );
        passes(&report);
        assert!(report.states >= 100_000, "too few states: {report}");
        // With a restore, the P8 halts (a restored id reused within the window) are
        // reached: the search went through restores written past the old tail.
        assert!(bounds.restores == 0 || report.halted > 0, "{report}");
        total += report.states;
    }
    eprintln!("model checker: {total} states explored in all");
    if deep {
        assert!(
            total >= 1_000_000,
            "the deep mode explores at least a million states"
        );
    }
}

/// MF1's world: 2 transactions of 1 event, a backup and its restore, a window expiry.
fn mf1_bounds() -> Bounds {
    only(|b| {
        b.restores = 1;
        b.expiries = 1;
    })
}

/// Finding MF1 on the rules before its fixes (a mutation test of the checker): after a
/// restore past the stream's tail and a window expiry, an event of the current history the
/// stream holds is stored twice (the tail beyond the WAL end compared nothing).
#[test]
fn the_rules_before_the_fixes_store_an_event_twice_after_a_restore_finding_mf1() {
    let report = check_safety(&Model::new(Rules::BeforeFixes, mf1_bounds()));
    eprintln!("{report}");
    let found = report
        .counterexample
        .expect("the rules before the fixes must store an event twice");
    assert!(finding_mf1(&found.violation, &found.actions), "{found}");
    assert!(found.trace.contains("BeyondWalEnd"), "{found}");
}

/// MF1 is fixed: in MF1's world, the current rules store every event once and progress.
#[test]
fn the_current_rules_store_once_after_a_restore_and_the_window() {
    passes(&run(Rules::Current, mf1_bounds()));
}

/// MF1's first cause alone (a mutation: main's rules without d2a8769): a tail beyond the
/// restored WAL end gives nothing to compare through, and the replay is stored again after
/// the window.
#[test]
fn without_comparing_beyond_the_wal_end_the_checker_finds_f1() {
    let report = check_safety(&Model::new(
        Rules::Without(Fix::CompareBeyondWalEnd),
        mf1_bounds(),
    ));
    eprintln!("{report}");
    let found = report
        .counterexample
        .expect("MF1's first cause must be found");
    assert!(finding_mf1(&found.violation, &found.actions), "{found}");
    assert!(found.trace.contains("BeyondWalEnd"), "{found}");
}

/// MF1's second cause's world: 3 transactions of 1 event, a crash, a backup and its restore,
/// a window expiry.
fn mf1_walk_bounds() -> Bounds {
    only(|b| {
        b.transactions = 3;
        b.crashes = 1;
        b.restores = 1;
        b.expiries = 1;
    })
}

/// MF1's second cause alone (a mutation: main's rules without 30dd6ee): after a restore
/// written past the old tail and a crash, the walk back from the tail stops at the lost
/// history's message at the tail's LSN, the aligned run misses the current history's earlier
/// message, and it is stored again after the window, though the session compares through
/// the tail.
#[test]
fn without_the_seek_the_checker_finds_f1() {
    let report = check_safety(&Model::new(Rules::Without(Fix::Seek), mf1_walk_bounds()));
    eprintln!("{report}");
    let found = report
        .counterexample
        .expect("MF1's second cause must be found");
    assert!(finding_mf1(&found.violation, &found.actions), "{found}");
    let last_start = found
        .trace
        .lines()
        .rfind(|line| line.contains("session starts"))
        .unwrap_or_default();
    assert!(
        !last_start.contains("compare through -"),
        "the session compares: {found}"
    );
    passes(&run(Rules::Current, mf1_walk_bounds()));
}

/// A fault that takes rows out of the table.
fn empties(action: &Action) -> bool {
    matches!(action, Action::Delete(_) | Action::Truncate)
}

/// A cold-backup restore.
fn restores(action: &Action) -> bool {
    matches!(action, Action::Restore(_))
}

/// Bounds with only the faults named.
fn only(f: impl FnOnce(&mut Bounds)) -> Bounds {
    let mut bounds = Bounds::none();
    bounds.transactions = 2;
    bounds.max_events = 1;
    f(&mut bounds);
    bounds
}

/// Old S4 + the always-advancing fence, with the tail's row deleted: a restart replays what
/// the stream holds, the replays are duplicates, the fence runs ahead and refuses the first
/// new event, and the next session does it all again (the emptied-table loop).
#[test]
fn the_old_rules_loop_on_an_emptied_table() {
    let bounds = only(|b| {
        b.crashes = 1;
        b.deletes = 1;
        b.truncate = true;
    });
    let report = run(Rules::OldTableCheck, bounds);
    let found = report.counterexample.expect("the old rules must loop");
    assert_eq!(found.violation, Violation::Loop, "{found}");
    let faults = &found.actions[..found.fault_free_from];
    assert!(faults.iter().any(empties), "{found}");
    assert!(
        found.trace.contains("refused: wrong last sequence"),
        "{found}"
    );
    // The same world under the current rules: no loop.
    passes(&run(Rules::Current, bounds));
}

/// Old S4 with the tail's row deleted and the window expired: the replay is stored again.
#[test]
fn the_old_rules_store_twice_after_the_window() {
    let bounds = only(|b| {
        b.crashes = 1;
        b.deletes = 1;
        b.expiries = 1;
    });
    // Safety alone: the loop (above) comes first in the same world.
    let report = check_safety(&Model::new(Rules::OldTableCheck, bounds));
    eprintln!("{report}");
    let found = report
        .counterexample
        .expect("the old rules must store twice");
    assert!(
        matches!(found.violation, Violation::I6Twice { .. }),
        "{found}"
    );
    assert!(found.actions.contains(&Action::Expire), "{found}");
    assert!(found.actions.iter().any(empties), "{found}");
    passes(&run(Rules::Current, bounds));
}

/// The old rules without S4's row check, after a cold-backup restore written past the old
/// tail: the tail's position (the same source, below the new WAL end) skips events of the
/// new history, and the slot confirms past them.
#[test]
fn the_old_rules_without_the_row_check_skip_after_a_restore() {
    let bounds = only(|b| {
        b.transactions = 2;
        b.restores = 1;
    });
    let report = run(Rules::NoRowCheckOld, bounds);
    let found = report
        .counterexample
        .expect("the old rules without the row check must lose an event");
    assert!(matches!(found.violation, Violation::I1 { .. }), "{found}");
    assert!(found.actions.iter().any(restores), "{found}");
    assert!(found.trace.contains("skips"), "{found}");
    passes(&run(Rules::Current, bounds));
}

/// Finding MF2's world: 4 transactions of up to 2 events (one rolled back, so the new rows
/// after the restore do not reuse the lost history's ids), a crash, a backup and its restore.
fn mf2_bounds() -> Bounds {
    only(|b| {
        b.transactions = 4;
        b.max_events = 2;
        b.rollbacks = true;
        b.crashes = 1;
        b.restores = 1;
    })
}

/// Finding MF2 on the rules before its fixes (a mutation test of the checker): after a
/// restore written past the old tail and a crash, a session replays events the stream holds
/// outside its (aligned) run in doubt (S6), the last of them is answered as a duplicate, and
/// the first event past the doubt carries a fence that counted it: refused, and the next
/// session does the same (a loop).
#[test]
fn the_rules_before_the_fixes_loop_after_a_restore_finding_mf2() {
    let report = run(Rules::BeforeFixes, mf2_bounds());
    let found = report
        .counterexample
        .expect("the rules before the fixes must loop");
    assert_eq!(found.violation, Violation::Loop, "{found}");
    assert!(
        found.actions[..found.fault_free_from].iter().any(restores),
        "{found}"
    );
    assert!(
        !found.actions.contains(&Action::Expire),
        "MF2 needs no window expiry: {found}"
    );
    assert!(
        found.trace.contains("refused: wrong last sequence"),
        "{found}"
    );
}

/// MF2 is fixed: in MF2's world, every fault-free run after a restore and a crash ends with
/// every event stored and confirmed, and nothing is stored twice.
#[test]
fn the_current_rules_progress_after_a_restore_and_a_crash() {
    passes(&run(Rules::Current, mf2_bounds()));
}
