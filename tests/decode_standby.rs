//! Decoding on a standby (PostgreSQL 16+, issue 39; `postgres::standby` SB1–SB4): the relay
//! given a standby as `DATABASE_URL` and the primary as `--primary-url` streams from a slot
//! on the standby while the application writes on the primary; under relay kills and a
//! promotion of that standby every committed row arrives once, in commit order. A standby
//! that cannot decode (no `hot_standby_feedback`, PostgreSQL 15) is refused at start, exit 2,
//! naming the fix, with no slot created on either server.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::Duration;

use support::{assert_contains_all, sql_connect_retrying, Case, DEADLINE};
use testkit::{Nats, PgOptions, Postgres};

/// The primary's physical slot for its standby.
const STANDBY_SLOT: &str = "decoding_standby";

fn setting(name: &str, value: &str) -> (String, String) {
    (name.to_owned(), value.to_owned())
}

/// A primary of `bin_dir` and its streaming standby (`hot_standby_feedback` as given), a case
/// on the primary whose relay decodes on the standby, with the primary (both hosts,
/// read-write: it follows a promotion) as `--primary-url`.
fn standby_case(
    bin_dir: std::path::PathBuf,
    feedback: &str,
    nats: &Nats,
) -> (Postgres, Postgres, Case) {
    let primary = Postgres::start_with(PgOptions {
        bin_dir: Some(bin_dir),
        ..PgOptions::default()
    });
    let standby = primary.start_standby(
        Some(STANDBY_SLOT),
        vec![setting("hot_standby_feedback", feedback)],
    );
    let mut case = Case::new(&primary, nats, "decode_standby");
    standby.wait_for_database(&case.database);
    case.pg_url = standby.url(&case.database);
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}?target_session_attrs=read-write",
        primary.port(),
        standby.port(),
        case.database
    );
    case.set_env(&[("OUTBOX_RELAY_PRIMARY_URL", &both)]);
    (primary, standby, case)
}

/// Commits `transactions` transactions of 5 rows on `url`'s primary; returns their ids in
/// commit order.
async fn write(url: &str, transactions: usize, pause: Duration) -> Vec<i64> {
    let mut sql = sql_connect_retrying(url).await;
    let mut ids = Vec::new();
    for _ in 0..transactions {
        ids.extend(support::insert_transaction(&mut sql, 5, 2, "standby").await);
        tokio::time::sleep(pause).await;
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_decoded_on_under_kills_and_its_promotion_every_row_once_in_order() {
    let nats = Nats::start();
    let (mut primary, mut standby, case) =
        tokio::task::block_in_place(|| standby_case(testkit::pg_at_least(16), "on", &nats));
    let js = case.jetstream().await;
    let mut relay = tokio::task::block_in_place(|| case.start_relay());
    assert_eq!(
        standby.slots_named(&case.slot),
        1,
        "the slot is on the standby"
    );
    assert_eq!(primary.slots_named(&case.slot), 0, "not on the primary");

    let primary_url = primary.url(&case.database);
    let writer =
        tokio::spawn(async move { write(&primary_url, 40, Duration::from_millis(20)).await });
    for kill in 1..=2u64 {
        case.wait_for_count(&js, kill * 40, DEADLINE).await;
        relay.kill();
        relay = tokio::task::block_in_place(|| case.start_relay());
    }
    let mut expected = writer.await.unwrap();

    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    assert_eq!(
        case.outbox_ids(&js).await,
        expected,
        "once each, in commit order"
    );

    // The primary goes away and the standby is promoted: the relay goes on from its slot
    // there, and the rows committed on the new primary follow.
    tokio::task::block_in_place(|| {
        primary.stop();
        standby.promote();
    });
    // MON4: the session that started on the standby ends; the next is on the new timeline.
    let promoted_said = "the standby this session decoded on was promoted";
    support::eventually("the relay to see the promotion", DEADLINE, || async {
        relay.output().contains(promoted_said).then_some(())
    })
    .await;
    let promoted = standby.url(&case.database);
    expected.extend(write(&promoted, 10, Duration::ZERO).await);
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    // A relay killed and started again on the new timeline resumes from the stream's tail,
    // which it trusts: the new timeline's own.
    relay.kill();
    relay = tokio::task::block_in_place(|| case.start_relay());
    let restarted = relay.output();
    assert!(!restarted.contains("not skipping by it"), "{restarted}");
    expected.extend(write(&promoted, 10, Duration::ZERO).await);
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    let output = relay.output();
    assert_eq!(
        case.outbox_ids(&js).await,
        expected,
        "once each, in commit order, across the promotion:\n{}",
        support::last_lines(&output, 40)
    );
    let verify = case.run_command("verify", &[]);
    verify.assert_code(0);
    verify.assert_stdout_has(&["0 missing, 0 duplicated, 0 mismatched, 0 out of order"]);
    let messages = case.messages(&js).await;
    let timeline = |m: &support::Stored| {
        m.header("Outbox-Source")
            .split('/')
            .nth(1)
            .unwrap()
            .to_owned()
    };
    let after: Vec<String> = messages[messages.len() - 20..]
        .iter()
        .map(timeline)
        .collect();
    assert!(
        after.iter().all(|t| t == "2"),
        "events committed after the promotion: {after:?}"
    );
    drop(relay);
}

/// SB1: the refusals, exit 2, each naming its fix; nothing created on either server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_that_cannot_decode_is_refused_and_nothing_is_created() {
    let nats = Nats::start();
    let pg15 = testkit::installed_bin_dir(15).unwrap_or_else(|| {
        panic!(
            "{}",
            testkit::missing(
                "PostgreSQL 15 in /usr/lib/postgresql/15/bin",
                "point TESTKIT_PG_BIN_DIR at it"
            )
        )
    });
    for (bin_dir, feedback, fix) in [
        (
            testkit::pg_at_least(16),
            "off",
            "hot_standby_feedback = off",
        ),
        (
            pg15,
            "on",
            "decoding on a standby needs PostgreSQL 16 or newer",
        ),
    ] {
        let (primary, standby, case) =
            tokio::task::block_in_place(|| standby_case(bin_dir, feedback, &nats));
        let log = case.relay_exits("run", 2);
        assert_contains_all(&log, [fix, "Nothing was created"]);
        for (server, name) in [(&standby, "standby"), (&primary, "primary")] {
            assert_eq!(
                server.slots_named(&case.slot),
                0,
                "no slot on the {name}: {log}"
            );
        }
        let js = case.jetstream().await;
        assert!(
            js.get_stream(&case.stream).await.is_err(),
            "no stream: {log}"
        );
    }
}
