//! End-to-end tests of `--failover-slot` (PG 17 fail-over slots, `bootstrap::ensure_slot`):
//! on Postgres 15 (the default test server) `outbox-relay init` refuses, says why and what to
//! set up, and creates nothing; on Postgres 17 (Debian's `postgresql-17`, when installed) it
//! creates the slot with `pg_replication_slots.failover = true`. Without the PG 17 binaries
//! that test is skipped, printing why.

#![allow(clippy::unwrap_used)]

mod support;

use support::{servers, Case};
use testkit::{installed_bin_dir, PgOptions, Postgres};

fn init_with_failover(case: &Case) -> std::process::Output {
    let mut command = case.relay_command("init");
    command.env("OUTBOX_RELAY_FAILOVER_SLOT", "true");
    command.output().unwrap()
}

#[test]
fn failover_slot_on_postgres_15_is_refused_naming_what_17_and_the_standby_need() {
    let s = servers();
    let case = Case::new(&s.pg, &s.nats, "failover15");
    let output = init_with_failover(&case);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(2),
        "setup error expected:\n{stderr}"
    );
    for needle in [
        "--failover-slot needs Postgres 17",
        "synchronized_standby_slots",
        "sync_replication_slots",
    ] {
        assert!(
            stderr.contains(needle),
            "{needle:?} missing from:\n{stderr}"
        );
    }
    // B1: nothing created.
    let slots = s.pg.psql(
        &case.database,
        &format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            case.slot
        ),
    );
    assert_eq!(
        slots.trim(),
        "0",
        "the slot was created despite the refusal"
    );
}

#[test]
fn failover_slot_on_postgres_17_creates_the_slot_with_failover() {
    let Some(bin_dir) = installed_bin_dir(17) else {
        println!(
            "SKIPPED: PostgreSQL 17 is not installed (/usr/lib/postgresql/17/bin): \
             `apt-get install postgresql-17` (.ci/run tries it) to run this test"
        );
        return;
    };
    let pg = Postgres::start_with(PgOptions {
        bin_dir: Some(bin_dir),
        ..PgOptions::default()
    });
    let case = Case::new(&pg, &servers().nats, "failover17");
    let output = init_with_failover(&case);
    assert!(
        output.status.success(),
        "init failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let failover = pg.psql(
        &case.database,
        &format!(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = '{}'",
            case.slot
        ),
    );
    assert_eq!(failover.trim(), "t", "the slot is not a fail-over slot");
}
