//! Trust nothing unverified (issue 18, cases 2 and 5), against real Postgres 15 and
//! nats-server processes: a message the relay did not write never makes it skip a real event
//! (`sink::resume` S4, `sink::publisher` P8), and a payload no consumer
//! could decode goes to the poison policy naming its id (P7).

#![allow(clippy::unwrap_used)]

use crate::support;

use async_nats::HeaderMap;
use support::{
    assert_contains_all, insert_row, insert_transaction, new_case, publish_acked, servers, wal_lsn,
    Case, Stored, DEADLINE,
};
use testkit::{Postgres, Process};

fn start_relay(case: &Case) -> Process {
    tokio::task::block_in_place(|| case.start_relay())
}

/// Waits for the relay process to exit on its own.
fn wait_for_exit(relay: &mut Process) -> std::process::ExitStatus {
    tokio::task::block_in_place(|| relay.wait_exit(DEADLINE))
}

/// The dead-letter record among `messages` (the first message with a reason).
fn dead_letter_record(messages: &[Stored]) -> &Stored {
    messages
        .iter()
        .find(|m| m.headers.contains_key("Outbox-Dead-Letter-Reason"))
        .expect("a dead-letter record")
}

/// Runs the relay until it exits on its own; asserts that it halted (exited non-zero) and
/// returns what it printed.
fn halted(case: &Case) -> String {
    let mut relay = case.spawn_relay();
    let status = wait_for_exit(&mut relay);
    let output = relay.output();
    assert!(!status.success(), "the relay halts: {status:?}\n{output}");
    output
}

fn stop(relay: &mut Process) {
    tokio::task::block_in_place(|| relay.terminate(DEADLINE));
}

/// The outbox ids of the relay's event messages (what carries an `Outbox-Ordering-Key`), in
/// stream order.
fn event_ids(messages: &[Stored]) -> Vec<i64> {
    messages
        .iter()
        .filter(|m| m.headers.contains_key("Outbox-Ordering-Key"))
        .map(Stored::outbox_id)
        .collect()
}

/// Case 2, the tail: a message of another writer that carries the relay's own
/// `Outbox-Source` and a position past every unrelayed event, below the server's WAL end. It
/// is not the replayed event at its place in the stream, so the session skips nothing by it
/// (`sink::resume` S4): every row is published once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_tail_with_the_relays_own_source_skips_no_real_event() {
    let case = new_case("forged_tail");
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let mut relay = start_relay(&case);
    let mut expected = insert_transaction(&mut sql, 10, 3, "before").await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    stop(&mut relay);
    let source = case.messages(&js).await[0]
        .header("Outbox-Source")
        .to_owned();
    assert!(!source.is_empty());

    // Rows the slot has not confirmed, then a message claiming to be past all of them.
    for i in 0..4 {
        expected.extend(insert_transaction(&mut sql, 5, 3, &format!("after{i}")).await);
    }
    let past_them = wal_lsn(&sql).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "copied-by-a-tool-1");
    headers.insert("Outbox-Source", source.as_str());
    headers.insert("Outbox-Commit-Lsn", past_them.to_string().as_str());
    headers.insert("Outbox-Tx-Index", "0");
    headers.insert("Outbox-Id", "999999");
    headers.insert("Outbox-Ordering-Key", "1700000000000:00000000000000999999");
    publish_acked(&js, format!("{}.0.Forged", case.prefix), headers, "{}").await;
    // The WAL end moves past the forged position, so only the row check can tell.
    sql.batch_execute("create table filler (n int); insert into filler values (1)")
        .await
        .unwrap();

    let relay = start_relay(&case);
    case.wait_for_count(&js, expected.len() as u64 + 1, DEADLINE)
        .await;
    let messages = case.messages(&js).await;
    let published: Vec<i64> = event_ids(&messages)
        .into_iter()
        .filter(|&id| id != 999_999)
        .collect();
    assert_eq!(published, expected, "every row once, in order");
    let output = relay.output();
    assert!(
        output.contains("the stream does not hold this replayed event at its place")
            && output.contains("(outbox id 999999) is not it"),
        "the relay says why it does not skip by the tail:\n{output}"
    );
}

/// Case 2, a duplicate's original: another writer published a message under a row's
/// `Nats-Msg-Id` (no row identity) before the relay streamed the row. Strict mode does not
/// take it for the event: `halt` stops naming the row and confirms nothing past it; with
/// `dead-letter` a record takes its place and later events flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_original_without_a_position_is_poison_not_a_stored_event() {
    let mut case = new_case("forged_original");
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let mut relay = start_relay(&case);
    let before = insert_transaction(&mut sql, 5, 2, "before").await;
    case.wait_for_count(&js, 5, DEADLINE).await;
    stop(&mut relay);

    let below_victim = wal_lsn(&sql).await;
    let victim = insert_transaction(&mut sql, 1, 1, "victim").await[0];
    let (dedupe_key,): (String,) = {
        let row = sql
            .query_one(
                "select event_type || ':' || entity_id || ':' || id from outbox_events where id = $1",
                &[&victim],
            )
            .await
            .unwrap();
        (row.get(0),)
    };
    let after = insert_transaction(&mut sql, 3, 1, "after").await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", dedupe_key.as_str());
    publish_acked(&js, format!("{}.0.Forged", case.prefix), headers, "{}").await;

    let output = halted(&case);
    // The halt names the row and the other writer.
    assert_contains_all(
        &output,
        [
            format!("outbox event id={victim}"),
            "another writer".to_owned(),
        ],
    );
    let confirmed = case.confirmed_flush_lsn(&sql).await;
    assert!(
        confirmed <= below_victim,
        "nothing confirmed past the row: confirmed {confirmed}, the row's transaction after {below_victim}"
    );
    assert_eq!(event_ids(&case.messages(&js).await), before);

    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let _relay = start_relay(&case);
    case.wait_for_count(&js, 5 + 1 + 1 + 3, DEADLINE).await;
    let messages = case.messages(&js).await;
    let record = dead_letter_record(&messages);
    assert_eq!(record.outbox_id(), victim);
    let mut relayed = before.clone();
    relayed.extend(&after);
    assert_eq!(
        event_ids(&messages),
        relayed,
        "every other row once, in order"
    );
}

/// Case 5: a payload that is not valid UTF-8 (a `SQL_ASCII` database stores any bytes) goes
/// to the poison policy naming its id, never to consumers as is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_is_not_utf8_goes_to_the_poison_policy_naming_its_id() {
    let s = servers();
    let mut case = new_case("not_utf8");
    let database = format!("{}_ascii", case.database);
    s.pg.psql(
        "postgres",
        &format!(
            "CREATE DATABASE {database} ENCODING 'SQL_ASCII' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'"
        ),
    );
    s.pg.psql(&database, support::SCHEMA_SQL);
    case.pg_url = Postgres::url(&s.pg, &database);
    case.database = database;
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    // The slot exists before the rows: they are streamed, not backfilled.
    case.init();
    let before = insert_transaction(&mut sql, 3, 1, "before").await;
    let below_poison = wal_lsn(&sql).await;
    let poison = insert_row(
        &sql,
        "('latin1', 'Latin1', 'tmp', 'tmp', 'tmp', E'{\"name\": \"Jos\\351\"}'::jsonb)",
    )
    .await;
    let after = insert_transaction(&mut sql, 3, 1, "after").await;

    let output = halted(&case);
    // The halt names the row and the cause.
    assert_contains_all(
        &output,
        [
            format!("outbox event id={poison}"),
            "not valid UTF-8".to_owned(),
        ],
    );
    assert!(case.confirmed_flush_lsn(&sql).await <= below_poison);
    assert_eq!(event_ids(&case.messages(&js).await), before);

    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let _relay = start_relay(&case);
    case.wait_for_count(&js, 3 + 1 + 3, DEADLINE).await;
    let messages = case.messages(&js).await;
    let record = dead_letter_record(&messages);
    assert_eq!(record.outbox_id(), poison);
    assert!(record.header("Outbox-Dead-Letter-Reason").contains("UTF-8"));
    let mut relayed = before.clone();
    relayed.extend(&after);
    assert_eq!(event_ids(&messages), relayed);
    for message in &messages {
        assert!(
            std::str::from_utf8(&message.payload).is_ok(),
            "every message consumers get decodes"
        );
    }
}
