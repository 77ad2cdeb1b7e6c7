//! End-to-end tests of how the relay connects and what it prints, against real Postgres 15
//! and nats-server processes (testkit): Postgres configured the libpq way (`PG*` variables,
//! a password file, `sslrootcert=system`) without `DATABASE_URL`; secrets kept out of every
//! output (logs at debug level included, TOML errors, `outbox-relay config`); logs without
//! colour codes when stderr is not a terminal; SIGTERM while a connection hangs.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{
    assert_contains_all, assert_relay_sessions_use_tls,
    assert_wrong_password_fails_without_printing_it, eventually, exits_with, insert_transaction,
    new_case, relay_one_row_as_superuser, servers, sql_value, Case, Relayed, DEADLINE,
};
use testkit::{PgAuth, PgOptions, Postgres, Process};

/// A TCP server that accepts connections and never sends a byte, like a host whose
/// Postgres or NATS hangs. Counts the connections it accepted.
struct Silent {
    port: u16,
    accepted: Arc<AtomicUsize>,
}

impl Silent {
    fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        });
        Silent { port, accepted }
    }

    fn wait_for_a_connection(&self) {
        testkit::wait_until(
            "the relay to connect to the silent server",
            DEADLINE,
            || self.accepted.load(Ordering::SeqCst) > 0,
        );
    }
}

/// SIGTERM to a relay stuck in session set-up; asserts exit 0 within the shutdown timeout.
fn terminate_within(relay: &mut Process, shutdown_timeout: Duration) {
    let start = Instant::now();
    let status = relay.terminate(shutdown_timeout);
    assert!(
        status.success(),
        "exit status {status:?} after SIGTERM\n{}",
        relay.output()
    );
    assert!(start.elapsed() < shutdown_timeout, "{:?}", start.elapsed());
}

/// The server a relay of [`relay_connecting_to_silence`] finds silent.
enum Hanging {
    Postgres,
    Nats,
}

/// Starts the relay of case `name` (shutdown timeout 2 s) with the `hanging` server replaced
/// by a [`Silent`] one; returns it once it connected there, and the silent server.
fn relay_connecting_to_silence(name: &str, hanging: Hanging) -> (Process, Silent) {
    let case = new_case(name);
    let silent = Silent::start();
    let port = silent.port;
    let (variable, url) = match hanging {
        Hanging::Postgres => (
            "DATABASE_URL",
            format!("postgres://relay:pw@127.0.0.1:{port}/app"),
        ),
        Hanging::Nats => ("NATS_URL", format!("nats://127.0.0.1:{port}")),
    };
    let mut command = case.relay_command("run");
    command
        .env(variable, url)
        .env("OUTBOX_RELAY_SHUTDOWN_TIMEOUT", "2s");
    let relay = Process::spawn(&format!("relay-{name}"), command);
    silent.wait_for_a_connection();
    (relay, silent)
}

/// Item 10 of issue 7: SIGTERM while connecting to a Postgres that accepts the connection
/// and never answers ends the relay at once, exit 0 (it used to wait for the connect, which
/// had no timeout).
#[test]
fn sigterm_while_a_postgres_connect_hangs_exits_0_within_the_shutdown_timeout() {
    let (mut relay, _silent) = relay_connecting_to_silence("hang_pg", Hanging::Postgres);
    terminate_within(&mut relay, Duration::from_secs(2));
}

/// Item 10 of issue 7: the same while connecting to NATS (after the lease was taken on a
/// real Postgres); async-nats' own connect timeout is 5 s, longer than the shutdown timeout.
#[test]
fn sigterm_while_a_nats_connect_hangs_exits_0_within_the_shutdown_timeout() {
    let (mut relay, _silent) = relay_connecting_to_silence("hang_nats", Hanging::Nats);
    relay.wait_for_output("holding the lease", DEADLINE);
    terminate_within(&mut relay, Duration::from_secs(2));
}

/// Item 9 of issue 7: with stderr a pipe (as under systemd, docker or a log file), the
/// relay's log has no ANSI escape codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_written_to_a_pipe_carry_no_colour_codes() {
    let mut case = new_case("no_colour");
    // Whatever the test's environment says, the decision must come from stderr itself.
    case.extra_env.push(("NO_COLOR".into(), String::new()));
    let Relayed { mut relay, .. } = case.relay_transaction(3, 1, "colourless").await;
    assert!(relay.terminate(DEADLINE).success());
    let output = relay.output();
    assert!(output.contains(" INFO "), "{output}");
    assert!(!output.contains('\u{1b}'), "escape codes in:\n{output:?}");
}

const PG_PASSWORD: &str = "Pg?pw=s3cret-Ab9";
const NATS_PASSWORD: &str = "Nats-s3cret-Qx7";

/// One SCRAM + TLS server for the tests below, whose password has an unencoded '?' and '='.
fn scram_tls() -> &'static Postgres {
    static PG: std::sync::OnceLock<Postgres> = std::sync::OnceLock::new();
    testkit::shared(&PG, || {
        Postgres::start_with(PgOptions {
            auth: PgAuth::Scram,
            password: Some(PG_PASSWORD.to_owned()),
            tls: true,
            ..Default::default()
        })
    })
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in [
        PG_PASSWORD,
        NATS_PASSWORD,
        "s3cret-Ab9",
        "Pg%3Fpw%3Ds3cret",
        "s3cret-Qx7",
    ] {
        assert!(!text.contains(secret), "{what} shows a secret:\n{text}");
    }
}

/// Item 8 of issue 7 and part 3 of issue 8: secrets appear nowhere the relay writes: not in
/// its logs even at debug level (where async-nats prints server URLs, credentials
/// included), not in a failing connection's error, not in a TOML syntax error, not in
/// `outbox-relay config`. The Postgres password has an unencoded '?' and '=' (parsed whole),
/// the NATS URL has no scheme.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_reach_any_output() {
    let pg = scram_tls();
    let nats = &servers().nats;
    let mut case = Case::new(pg, nats, "secrets");
    case.pg_url = format!(
        "postgres://postgres:{PG_PASSWORD}@127.0.0.1:{}/{}",
        pg.port(),
        case.database
    );
    case.nats_url = format!("relay:{NATS_PASSWORD}@127.0.0.1:{}", nats.port());
    case.set_env(&[("RUST_LOG", "debug,tokio_postgres=info")]);

    // Running, at debug level.
    let mut relay = case.start_relay();
    relay_one_row_as_superuser(pg, &case).await;
    assert!(relay.terminate(DEADLINE).success());
    let output = relay.output();
    assert_no_secret("the debug log", &output);
    // async-nats logs its server URL at debug level: the relay hands it the URL without the
    // user information (relay::config::nats NATS1), so there is nothing to scrub there.
    assert!(
        output.contains("password: None"),
        "async-nats logged its server URL without the credentials:\n{output}"
    );

    // A wrong password: the error names the problem, not the password.
    assert_wrong_password_fails_without_printing_it(&case, PG_PASSWORD, "Pg?pw=wr0ng-Ab9");

    // A TOML syntax error on the line with the password.
    let dir = testkit::scratch_dir("secrets");
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!("database_url = \"{}\n", case.pg_url.replace("\"", "")),
    )
    .unwrap();
    let mut command = case.relay_command("run");
    command
        .env_remove("DATABASE_URL")
        .arg("--config")
        .arg(&file);
    let stderr = exits_with(&mut command, 2);
    assert!(stderr.contains("not valid TOML at line 1"), "{stderr}");
    assert_no_secret("the TOML error", &stderr);

    // `outbox-relay config`: every value and its origin, the URLs without their secrets.
    let output = case.relay_command("config").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert_no_secret("outbox-relay config", &stdout);
    assert_contains_all(
        &stdout,
        [
            &format!(
                "database_url = \"postgres://postgres@127.0.0.1:{}/{}\"",
                pg.port(),
                case.database
            ),
            "# environment variable DATABASE_URL; the password not written: give it as PGPASSWORD",
            &format!("nats_url = \"127.0.0.1:{}\"", nats.port()),
            "the credentials not written",
            "# password = \"<redacted>\"",
            "# database_url (environment variable DATABASE_URL)",
            &format!("# dbname = \"{}\"", case.database),
            "# default",
        ],
    );
}

/// Part 2 of issue 8: without DATABASE_URL, the `PG*` variables configure both connections
/// (replication and control), the password comes from a password file, and
/// `sslrootcert=system` verifies the server against the system's trust store (here
/// `SSL_CERT_FILE`, the test's CA). A password file others can read is ignored with a
/// warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_variables_and_a_password_file_configure_postgres_without_database_url() {
    let pg = scram_tls();
    let case = Case::new(pg, &servers().nats, "libpq_env");
    let dir = testkit::scratch_dir("libpq_env");
    let passfile = dir.path().join("pgpass");
    let escaped = PG_PASSWORD.replace('\\', "\\\\").replace(':', "\\:");
    testkit::write_file_mode(
        &passfile,
        &format!("localhost:{}:*:postgres:{escaped}\n", pg.port()),
        0o600,
    );
    let command = |subcommand: &str| {
        let mut command = case.relay_command(subcommand);
        command
            .env_remove("DATABASE_URL")
            .env("PGHOST", "localhost")
            .env("PGPORT", pg.port().to_string())
            .env("PGUSER", "postgres")
            .env("PGDATABASE", &case.database)
            .env("PGPASSFILE", &passfile)
            .env("PGSSLROOTCERT", "system")
            .env("SSL_CERT_FILE", pg.ca_cert_path().unwrap());
        for variable in ["PGPASSWORD", "PGSSLMODE", "PGSERVICE", "PGHOSTADDR"] {
            command.env_remove(variable);
        }
        command
    };

    let output = command("config").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert_contains_all(
        &stdout,
        [
            "# database_url is not set",
            "# environment variable PGHOST",
            &format!("# password file {}", passfile.display()),
            "# sslmode = \"verify-full\"",
            "# sslrootcert = \"system\"",
        ],
    );
    assert_no_secret("outbox-relay config", &stdout);

    let relay = Process::spawn("relay-libpq-env", command("run"));
    relay.wait_for_output("streaming outbox events", DEADLINE);
    assert_relay_sessions_use_tls(pg, &case);
    relay_one_row_as_superuser(pg, &case).await;
    drop(relay);

    testkit::write_file_mode(
        &passfile,
        &std::fs::read_to_string(&passfile).unwrap(),
        0o644,
    );
    let stderr = exits_with(&mut command("run"), 1);
    assert!(
        stderr.contains("has group or world access") && stderr.contains("none was given"),
        "{stderr}"
    );
}

/// A `DATABASE_URL` that reaches a standby is refused at start (checks PG4, issue 39):
/// exit status 2, one line naming the fix, and nothing created: no slot on the standby (it
/// would pin the primary's catalog through `hot_standby_feedback`), none on the primary,
/// no stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_refused_at_start_and_nothing_is_created() {
    let (primary, standby, nats) = tokio::task::block_in_place(|| {
        let primary = Postgres::start();
        let standby = primary.start_standby(None, vec![]);
        (primary, standby, testkit::Nats::start())
    });
    let case = Case::new(&primary, &nats, "standby_refused");
    standby.wait_for_database(&case.database);
    let on_standby = Case {
        pg_url: standby.url(&case.database),
        ..case.clone()
    };
    let log = on_standby.relay_exits("run", 2);
    assert_contains_all(
        &log,
        [
            "DATABASE_URL reaches a standby",
            "point DATABASE_URL at the primary",
        ],
    );
    assert_eq!(
        log.matches("reaches a standby").count(),
        1,
        "one line, once: {log}"
    );
    for (server, name) in [(&standby, "standby"), (&primary, "primary")] {
        let slots = server.psql("postgres", "select count(*) from pg_replication_slots");
        assert_eq!(slots.trim(), "0", "no slot on the {name}");
    }
    let js = case.jetstream().await;
    assert!(
        js.get_stream(&case.stream).await.is_err(),
        "no stream was created"
    );
}

/// A slot invalidated while the relay was down (`max_slot_wal_keep_size` passed): the relay
/// stops (exit 1) with one line carrying Postgres's words and the runbook's fix (issue 39;
/// docs/operations.md, "The slot is invalidated"), and creates no slot in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_stops_the_relay_naming_the_runbooks_fix() {
    let (pg, nats) = tokio::task::block_in_place(|| {
        let pg = Postgres::start_with(PgOptions {
            settings: vec![
                ("max_slot_wal_keep_size".into(), "1MB".into()),
                ("max_wal_size".into(), "32MB".into()),
                ("min_wal_size".into(), "32MB".into()),
            ],
            ..PgOptions::default()
        });
        (pg, testkit::Nats::start())
    });
    let case = Case::new(&pg, &nats, "invalidated");
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 5, 1, "before").await;
    case.wait_confirmed(&js, &sql, ids.len() as u64).await;
    drop(relay);
    // WAL the stopped slot cannot keep: past max_slot_wal_keep_size, a checkpoint drops it.
    sql.batch_execute("create table filler (n int, pad text)")
        .await
        .unwrap();
    eventually("the slot to be invalidated", DEADLINE, || async {
        sql.batch_execute(
            "insert into filler select n, repeat('x', 200) from generate_series(1, 50000) n; \
             select pg_switch_wal(); checkpoint",
        )
        .await
        .unwrap();
        let status: Option<String> = sql_value(
            &sql,
            "select wal_status from pg_replication_slots where slot_name = $1",
            &[&case.slot],
        )
        .await;
        (status.as_deref() == Some("lost")).then_some(())
    })
    .await;
    let log = case.relay_exits("run", 1);
    let errors: Vec<&str> = log
        .lines()
        .filter_map(|line| line.strip_prefix("outbox-relay: "))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {log}");
    // PostgreSQL 15's words, 16's and 17's, and 18's.
    assert!(
        [
            "cannot read from logical replication slot",
            "can no longer get changes from replication slot",
            "can no longer access replication slot",
        ]
        .iter()
        .any(|words| errors[0].contains(words)),
        "{}",
        errors[0]
    );
    assert_contains_all(
        errors[0],
        [
            "SQLSTATE 55000",
            "the slot was invalidated",
            "docs/operations.md, \"The slot is invalidated\"",
        ],
    );
    assert_eq!(
        pg.slots_named(&case.slot),
        1,
        "the lost slot stays, none made in its place"
    );
}

/// Postgres unreachable at start (issue 39): the relay retries, each attempt one line with the
/// server it tried (no password) and the cause once ("Connection refused" is not repeated by
/// the error's chain), saying it starts over, never that it resumes from a slot it has not
/// reached; SIGTERM ends it with exit 0, saying it confirmed nothing.
#[test]
fn an_unreachable_postgres_is_retried_one_line_per_attempt_naming_the_server() {
    let s = servers();
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut case = Case::new(&s.pg, &s.nats, "unreachable_pg");
    case.pg_url = format!("postgres://postgres:hunter2@127.0.0.1:{port}/app");
    let mut relay = case.spawn_relay();
    testkit::wait_until("three attempts", DEADLINE, || {
        relay.output().matches("starting over").count() >= 3
    });
    let status = relay.terminate(DEADLINE);
    let log = relay.output();
    assert_eq!(status.code(), Some(0), "{log}");
    let attempts: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("starting over"))
        .collect();
    for line in &attempts {
        assert_contains_all(
            line,
            [
                "relay session ended before it was set up; starting over",
                &format!("could not connect to postgres://postgres@127.0.0.1:{port}/app"),
                "Connection refused",
            ],
        );
        assert_eq!(line.matches("Connection refused").count(), 1, "{line}");
    }
    assert!(!log.contains("hunter2"), "{log}");
    assert!(
        !log.contains("resuming from the slot's confirmed position"),
        "{log}"
    );
    assert!(log.contains("this relay confirmed no position"), "{log}");
}
