//! Issue 18 cases 6, 8 and 9, end to end with the real binary: malformed URLs refused without
//! quoting a secret's part, a ',' in NATS credentials and `ws://` URLs refused at start
//! (exit 2); the start-up warnings (secrets on the command line, readable secret files,
//! secrets too weak for the scrubber, credentials without verified TLS), each once, from a
//! relay that still streams; and the pg_hba line sql/role.sql gives, proven on a real
//! Postgres 15: the relay's role streams with only that database line, and is refused with
//! only a `replication` keyword line.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::io::Write;
use std::path::Path;
use std::process::Output;

use support::{relay_one_row_as_superuser, servers, Case, DEADLINE};
use testkit::{PgAuth, PgOptions, Postgres};

/// `outbox-relay {subcommand}` configured by `env` alone (no servers needed: the
/// configuration is refused before any connection).
fn relay_with(subcommand: &str, env: &[(&str, &str)]) -> Output {
    testkit::harness::relay_command(
        &testkit::harness::relay_bin(),
        &[],
        subcommand,
        env.iter().copied(),
    )
    .output()
    .unwrap()
}

/// Issue 18 cases 6 and 8: `run` and `config` refuse a malformed `DATABASE_URL`, a NATS
/// password with a ',' and WebSocket URLs at start, exit 2, naming the problem and the
/// fix, and print no part of the secrets (the password's tail `ter2` used to be quoted,
/// and `config` printed `nats://relay:2024,<redacted>@…`).
#[test]
fn malformed_urls_and_websocket_nats_urls_are_refused_at_start_without_quoting_secrets() {
    const DB: &str = "postgres://relay@127.0.0.1:9/app";
    for (env, expected, secrets) in [
        (
            [
                ("DATABASE_URL", "postgres://u@h/db?password=hun&ter2"),
                ("NATS_URL", "nats://127.0.0.1:9"),
            ],
            "query parameter 2 of the URL has no '='",
            &["hun", "ter2"][..],
        ),
        (
            [
                ("DATABASE_URL", "postgres://u@h/db?password=hun&ter2=x"),
                ("NATS_URL", "nats://127.0.0.1:9"),
            ],
            "query parameter 2 of the URL is not a libpq parameter",
            &["hun", "ter2"],
        ),
        (
            [
                ("DATABASE_URL", DB),
                ("NATS_URL", "nats://relay:2024,Spring!@127.0.0.1:4222"),
            ],
            "percent-encoded as %2C",
            &["2024", "Spring"],
        ),
        (
            [("DATABASE_URL", DB), ("NATS_URL", "ws://127.0.0.1:8080")],
            "WebSocket URL (ws:// or wss://), which the relay cannot use",
            &[],
        ),
        (
            [
                ("DATABASE_URL", DB),
                ("NATS_URL", "wss://relay:Wss-s3cret@127.0.0.1:443"),
            ],
            "as nats://host:4222, or tls://host:4222 for TLS",
            &["Wss-s3cret"],
        ),
    ] {
        for subcommand in ["run", "config"] {
            let output = relay_with(subcommand, &env);
            let stderr = String::from_utf8_lossy(&output.stderr);
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert_eq!(
                output.status.code(),
                Some(2),
                "{env:?} {subcommand}: {stderr}"
            );
            assert!(
                stderr.contains("configuration error") && stderr.contains(expected),
                "{env:?} {subcommand}: {stderr}"
            );
            for secret in secrets {
                assert!(
                    !stderr.contains(secret) && !stdout.contains(secret),
                    "{env:?} {subcommand} shows {secret:?}:\n{stderr}\n{stdout}"
                );
            }
        }
    }
}

/// Issue 18 cases 6 and 9: a relay given secrets on the command line, a config file others
/// can read holding a secret, a 3-character token, a common word as password, `sslmode`
/// prefer with a password and a token over `nats://` says each of those once, at start, in
/// one line naming the fix, and streams all the same; no warning shows a secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn risky_secrets_are_warned_about_once_at_start() {
    let s = servers();
    let case = Case::new(&s.pg, &s.nats, "warnings");
    let dir = testkit::scratch_dir("warnings");
    let file = dir.path().join("relay.toml");
    // The file's token is overridden by the flag: the file still holds a secret.
    testkit::write_file_mode(&file, "nats_token = \"File-t0ken-9\"\n", 0o644);
    // Trust authentication ignores the password; nats-server without authorization the
    // token: what matters is how the relay treats them.
    let database_url =
        case.pg_url
            .replacen("postgres://postgres@", "postgres://postgres:relay@", 1);
    let mut command = case.relay_command("run");
    command
        .env_remove("DATABASE_URL")
        .args([
            "--database-url",
            &database_url,
            "--token",
            "Zq9",
            "--config",
        ])
        .arg(&file);
    let relay = testkit::Process::spawn("relay-warnings", command);
    relay.wait_for_output("streaming outbox events", DEADLINE);
    relay_one_row_as_superuser(&s.pg, &case).await;
    let output = relay.output();
    drop(relay);

    let warnings: Vec<&str> = output.lines().filter(|l| l.contains(" WARN ")).collect();
    for expected in [
        "--token is given on the command line",
        "--database-url holds a password and is given on the command line",
        &format!("config file {} has group or world access", file.display()),
        "the NATS token (of --token) is shorter than 4 characters (3)",
        "the Postgres password (from the connection string) is a common word",
        "Postgres: sslmode=prefer does not verify the server's certificate",
        "NATS: the credentials of --token are sent as written",
    ] {
        let found = warnings.iter().filter(|w| w.contains(expected)).count();
        assert_eq!(found, 1, "{expected:?} once among the warnings:\n{output}");
    }
    assert_eq!(warnings.len(), 7, "{warnings:#?}");
    for secret in ["Zq9", "File-t0ken-9", ":relay@"] {
        assert!(
            !output.contains(secret),
            "the log shows {secret:?}:\n{output}"
        );
    }
    // The common word is not scrubbed from ordinary text (`outbox_<redacted>::pipeline`
    // would break the log and show it all the same).
    assert!(
        output.contains("outbox_relay::process::pipeline: streaming outbox events"),
        "{output}"
    );
}

const ADMIN_PASSWORD: &str = "Adm1n-hba-pw";
const RELAY_PASSWORD: &str = "R3lay-hba-pw";

/// pg_hba.conf with the testkit's superuser lines and `relay_line` for sql/role.sql's role,
/// loaded; waits until a connection as that role gives `expect_refusal`'s outcome.
fn set_hba(pg: &Postgres, database: &str, relay_line: &str, expect_refusal: bool) {
    let mut hba = String::from(
        "local all all trust\n\
         local replication all trust\n\
         host all postgres 127.0.0.1/32 scram-sha-256\n\
         host all postgres ::1/128 scram-sha-256\n",
    );
    hba.push_str(relay_line);
    hba.push('\n');
    let path = pg.data_dir().join("pg_hba.conf");
    // Truncating keeps the file's owner (the server's user).
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.write_all(hba.as_bytes()).unwrap();
    drop(file);
    pg.psql("postgres", "select pg_reload_conf()");
    // Whether the role may connect to `database`: Some(true) yes, Some(false) no line for it.
    let connects = |database: &str| {
        let url = format!(
            "postgres://outbox_relay:{RELAY_PASSWORD}@127.0.0.1:{}/{database}",
            pg.port()
        );
        let result = std::process::Command::new(pg.bin_dir().join("psql"))
            .args(["-X", "-w", "-A", "-t", "-c", "select 1", "-d", &url])
            .output()
            .unwrap();
        if result.status.success() {
            Some(true)
        } else {
            String::from_utf8_lossy(&result.stderr)
                .contains("no pg_hba.conf entry")
                .then_some(false)
        }
    };
    // The testkit's own lines let the role into every database: the new file is loaded
    // when it no longer reaches `postgres` (and, with the database line, reaches its own).
    testkit::wait_until("the server to load the new pg_hba.conf", DEADLINE, || {
        connects("postgres") == Some(false) && connects(database) == Some(!expect_refusal)
    });
}

/// Issue 18 case 9: sql/role.sql, run as its comment says (the password in a psql
/// variable), makes a role the relay streams as with the one pg_hba line the file gives
/// (the outbox database's name, SCRAM only); a line with the `replication` keyword instead
/// matches none of the relay's connections (logical replication connections match by
/// database): refused, exit 1, with a fix naming a database line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_sql_streams_with_a_database_pg_hba_line_and_not_with_the_replication_keyword() {
    let pg = Postgres::start_with(PgOptions {
        auth: PgAuth::Scram,
        password: Some(ADMIN_PASSWORD.to_owned()),
        ..Default::default()
    });
    let case = Case::new(&pg, &servers().nats, "hba");
    pg.psql(
        &case.database,
        &format!(
            "create publication {} for table outbox_events with (publish = 'insert')",
            case.publication
        ),
    );
    let role_sql = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sql/role.sql");
    let output = std::process::Command::new(pg.bin_dir().join("psql"))
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-v"])
        .arg(format!("relay_password={RELAY_PASSWORD}"))
        .arg("-f")
        .arg(&role_sql)
        .arg("-d")
        .arg(pg.url(&case.database))
        .output()
        .unwrap();
    assert!(output.status.success(), "sql/role.sql: {output:?}");

    let mut relay_case = case.clone();
    relay_case.pg_url = format!(
        "postgres://outbox_relay:{RELAY_PASSWORD}@127.0.0.1:{}/{}?require_auth=scram-sha-256",
        pg.port(),
        case.database
    );

    // Only the database line: both connections (replication=database, control) match.
    set_hba(
        &pg,
        &case.database,
        &format!(
            "host {} outbox_relay 127.0.0.1/32 scram-sha-256",
            case.database
        ),
        false,
    );
    let relay = relay_case.start_relay();
    relay_one_row_as_superuser(&pg, &case).await;
    drop(relay);

    // Only the `replication` keyword: that is physical replication; the relay is refused.
    set_hba(
        &pg,
        &case.database,
        "host replication outbox_relay 127.0.0.1/32 scram-sha-256",
        true,
    );
    let stderr = relay_case.relay_exits("run", 1);
    assert!(
        stderr.contains("no pg_hba.conf entry")
            && stderr.contains(&format!("{}\"", case.database))
            && stderr.contains("host <database> outbox_relay"),
        "{stderr}"
    );
    assert!(!stderr.contains(RELAY_PASSWORD), "{stderr}");
}
