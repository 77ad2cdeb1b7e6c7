//! End-to-end tests of `outbox-relay replay` against real Postgres 15 and nats-server
//! processes (testkit): a strict-mode stream is refused without `--force` (exit 2); inside
//! the duplicate window a replay is acknowledged as duplicates and stores nothing; a forced
//! replay past the window into a running strict-mode relay stores second copies (verify
//! names them as duplicated) and loses nothing: the relay re-syncs and relays what follows.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::{sql_column, sql_value};

use std::time::Duration;

use support::{counted, eventually, insert_transaction, Case, Relayed, DEADLINE};

fn new_case(name: &str, env: &[(&str, &str)]) -> Case {
    let mut case = support::new_case(name);
    case.set_env(env);
    case
}

/// Relays one transaction of 10 rows over 2 entities (`a`) and stops the relay; returns the
/// SQL connection, a JetStream context and the rows' ids.
async fn relay_ten_rows_and_stop(
    case: &Case,
) -> (
    tokio_postgres::Client,
    async_nats::jetstream::Context,
    Vec<i64>,
) {
    let Relayed {
        mut relay,
        sql,
        js,
        ids,
    } = case.relay_transaction(10, 2, "a").await;
    relay.terminate(Duration::from_secs(10));
    (sql, js, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_refuses_a_strict_mode_stream_without_force() {
    let case = new_case("replay_strict", &[]);
    case.init();
    let replay = case.run_command("replay", &["--entity", "entity-0"]);
    replay.assert_code(2);
    replay.assert_stderr_has(&["is in strict mode", "pass --force to replay anyway"]);
    assert_eq!(replay.stdout, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_inside_the_duplicate_window_is_acknowledged_as_duplicates_and_stores_nothing() {
    let case = new_case("replay_window", &[("OUTBOX_RELAY_SHARED_STREAM", "true")]);
    let (_sql, js, _) = relay_ten_rows_and_stop(&case).await;

    let replay = case.run_command("replay", &["--entity", "entity-1"]);
    replay.assert_code(0);
    assert!(
        replay.stdout.starts_with("replay: published 5 events"),
        "{}",
        replay.stdout
    );
    assert_eq!(counted(&replay.stdout, "stored again"), 0);
    assert_eq!(counted(&replay.stdout, "acknowledged as duplicates"), 5);
    assert_eq!(counted(&replay.stdout, "without an original"), 0);
    replay.assert_stdout_has(&["duplicate window of 2m"]);
    assert_eq!(case.stream_count(&js).await, 10);
    case.run_command("verify", &[]).assert_code(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_replay_is_refused_while_a_relay_holds_the_lease() {
    let case = new_case("replay_leased", &[]);
    let mut relay = case.start_relay();
    let replay = case.run_command("replay", &["--force"]);
    replay.assert_code(2);
    replay.assert_stderr_has(&[
        &format!(
            "a relay holds the lease of slot {} (backend pid ",
            case.slot
        ),
        "stop it before a forced replay",
    ]);
    assert!(relay.try_status().is_none(), "{}", relay.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_replay_past_the_window_into_a_strict_stream_loses_nothing() {
    let case = new_case("replay_forced", &[("OUTBOX_RELAY_DUPLICATE_WINDOW", "1s")]);
    let (mut sql, js, first) = relay_ten_rows_and_stop(&case).await;
    // Postgres ends the stopped relay's lease session a moment after it exits.
    eventually(
        "the stopped relay's lease is released",
        DEADLINE,
        || async {
            let held: i64 = sql_value(
                &sql,
                "select count(*) from pg_locks where locktype = 'advisory' and granted \
             and database = (select oid from pg_database where datname = current_database())",
                &[],
            )
            .await;
            (held == 0).then_some(())
        },
    )
    .await;

    // Until the originals leave the 1 s duplicate window, each replay is acknowledged as
    // duplicates and stores nothing; then one stores its copies.
    let stored = eventually("a replay stores copies", DEADLINE, || async {
        let replay = case.run_command("replay", &["--entity", "entity-0", "--force"]);
        replay.assert_code(0);
        let stored = counted(&replay.stdout, "stored again");
        (stored > 0).then_some(stored)
    })
    .await;

    // The relay, started again, does not trust the replayed tail, and relays what follows.
    let relay = case.start_relay();
    let second = insert_transaction(&mut sql, 10, 2, "b").await;
    eventually("the relay relays after the replay", DEADLINE, || async {
        let ids = case.outbox_ids(&js).await;
        second.iter().all(|id| ids.contains(id)).then_some(())
    })
    .await;
    relay.assert_output_contains("the stream's last message was published from another source");

    let verify = case.run_command("verify", &[]);
    verify.assert_code(5);
    verify.assert_stdout_has(&[
        &format!(
            "20 rows (ids {}..={}), {} stream messages",
            first[0],
            second[9],
            20 + stored
        ),
        "0 missing, ",
        "0 mismatched, 0 out of order, 0 unexpected",
    ]);
    let duplicated: Vec<&str> = verify
        .stdout
        .lines()
        .filter(|l| l.starts_with("duplicated: "))
        .collect();
    assert_eq!(duplicated.len() as u64, stored, "{}", verify.stdout);
    // Only entity-0's rows were replayed.
    let entity_0: Vec<i64> = sql_column(
        &sql,
        "select id from outbox_events where entity_id = 'entity-0' and id <= $1",
        &[&first[9]],
    )
    .await;
    assert_eq!(entity_0.len(), 5);
    for line in duplicated {
        assert!(
            entity_0
                .iter()
                .any(|id| line.starts_with(&format!("duplicated: id={id} 2 messages"))),
            "{line}: not a replayed row of entity-0 ({entity_0:?})"
        );
    }
}

/// P5, found while testing replay: another writer stores k messages in a strict-mode stream
/// while the relay is idle; the relay then pipelines a transaction of more than k events. With
/// the sequence fence alone the first k were refused, the rest lined up with the shifted
/// sequence again and were stored behind the gap, and the next session, trusting the tail,
/// skipped the k refused events (ids 11–15 of 20 lost). Every publish after a session's first
/// now also expects its predecessor's `Nats-Msg-Id`, so all of them are refused and the
/// re-synced session publishes the whole transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_relay_beside_another_writer_skips_no_event() {
    let case = new_case("fence_gap", &[]);
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 10, 2, "a").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    for i in 0..5 {
        js.publish(format!("{}.other", case.prefix), format!("{i}").into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let second = insert_transaction(&mut sql, 10, 2, "b").await;
    eventually(
        "every event of the second transaction is stored",
        DEADLINE,
        || async {
            let ids: Vec<i64> = case
                .messages(&js)
                .await
                .iter()
                .filter_map(|m| m.headers.get("Outbox-Id").and_then(|id| id.parse().ok()))
                .collect();
            second.iter().all(|id| ids.contains(id)).then_some(())
        },
    )
    .await;
    drop(relay);
}

/// Issue 18 case 4: rows replayed (`--force`) before the relay streamed them, then streamed
/// within the duplicate window. The originals are `replay`'s messages, at position 0/0
/// without a source; the sink recognises each as the same row's event (P8) instead of
/// reporting reused ids, and every row ends up in the stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_replayed_before_the_relay_streams_them_are_recognised_as_the_same_events() {
    let case = new_case("replay_ahead", &[]);
    let (mut sql, js, first) = relay_ten_rows_and_stop(&case).await;
    let ahead = insert_transaction(&mut sql, 10, 2, "b").await;
    // The stopped relay's lease goes a moment after it exits: replay until it is free.
    let replayed = eventually(
        "a forced replay of the unstreamed rows",
        DEADLINE,
        || async {
            let replay =
                case.run_command("replay", &["--from-id", &ahead[0].to_string(), "--force"]);
            (replay.code == 0).then(|| counted(&replay.stdout, "stored again"))
        },
    )
    .await;
    assert_eq!(replayed, 10);

    let mut relay = case.start_relay();
    let after = insert_transaction(&mut sql, 5, 2, "c").await;
    case.wait_for_count(&js, 25, DEADLINE).await;
    let mut expected = first.clone();
    expected.extend(&ahead);
    expected.extend(&after);
    let mut ids = case.outbox_ids(&js).await;
    assert_eq!(
        ids, expected,
        "every row once, the replayed ones where replay put them"
    );
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 25);
    let output = relay.output();
    assert!(
        !output.contains("ids were reused")
            && !output.contains("reused_id")
            && relay.try_status().is_none(),
        "no false 'reused id', the relay goes on:\n{output}"
    );
}
