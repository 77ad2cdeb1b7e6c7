//! Poison events: an outbox row whose message (headers and payload) is larger than what
//! JetStream accepts (the stream's `max_msg_size` here) is never dropped silently.
//! - `halt` (default): the relay exits non-zero naming `outbox event id=N`; everything
//!   before the event is in the stream, nothing after it, and the slot never confirms past
//!   its transaction. Once the limit is raised, a restarted relay relays it and what follows
//!   exactly once, in order.
//! - `dead-letter`: a small record on `{prefix}.dlq` takes the event's place in the stream,
//!   in order between its neighbours, and the events after it flow.
//!
//! Real Postgres and nats-server, shared by the tests of this binary; each test creates its
//! own stream (limited to 4096-byte messages) before starting the relay, which adopts it.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::new_case;

use async_nats::jetstream;
use pgoutput::Lsn;
use std::collections::HashMap;

use support::{
    assert_matches_row, insert_oversized_row, insert_transaction, rows_by_id, Case, Row, Stored,
    DEADLINE,
};
use testkit::Process;

/// The stream's message size limit: far above an ordinary event (a few hundred bytes),
/// far below the poison row's ~10 KB.
const MAX_MESSAGE_SIZE: i32 = 4096;

/// Creates the case's stream before the relay does, with [`MAX_MESSAGE_SIZE`]; on
/// nats-server 2.14 or newer with `allow_batched` too, so that a relay with `--fast-ingest`
/// (the default) has the poison row inside a fast-ingest batch (`sink::batch` F6).
async fn create_limited_stream(case: &Case, js: &jetstream::Context) {
    let fast = testkit::has_fast_ingest(&js.client().server_info().version);
    let mut config = serde_json::json!({
        "name": case.stream,
        "subjects": [format!("{}.>", case.prefix)],
        "storage": "file",
        "max_msg_size": MAX_MESSAGE_SIZE,
    });
    // Servers before 2.14 refuse a field they do not know, even set to false.
    if fast {
        config["allow_batched"] = true.into();
    }
    let answer: serde_json::Value = js
        .request(format!("STREAM.CREATE.{}", case.stream), &config)
        .await
        .expect("create the limited stream");
    assert!(answer.get("error").is_none(), "{answer}");
}

/// What the test wrote: three transactions, the poison row in the middle one.
#[derive(Debug)]
struct Written {
    /// Transaction A: ordinary rows, committed first.
    before_tx: Vec<i64>,
    /// Transaction B: ordinary rows before the poison row.
    same_tx_before: Vec<i64>,
    /// Transaction B: the oversized row.
    poison: i64,
    /// Transaction B: ordinary rows after the poison row.
    same_tx_after: Vec<i64>,
    /// Transaction C: ordinary rows, committed last.
    after_tx: Vec<i64>,
}

impl Written {
    /// Every row in commit order.
    fn all(&self) -> Vec<i64> {
        let mut all = self.before_tx.clone();
        all.extend(&self.same_tx_before);
        all.push(self.poison);
        all.extend(&self.same_tx_after);
        all.extend(&self.after_tx);
        all
    }
}

/// Inserts `count` ordinary rows (seed-style placeholders) inside `tx`.
async fn insert_ordinary(tx: &tokio_postgres::Transaction<'_>, count: i32, tag: &str) -> Vec<i64> {
    tx.query(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         select 'order-' || i, 'OrderPaid', 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', jsonb_build_object('n', i, 'tag', $2::text) \
           from generate_series(1, $1::int) as i returning id",
        &[&count, &tag],
    )
    .await
    .expect("insert ordinary rows")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Commits A (5 rows), B (2 rows, the ~10 KB poison row, 2 rows) and C (3 rows) back to
/// back, without waiting for the relay in between.
async fn write_three_transactions(sql: &mut tokio_postgres::Client) -> Written {
    let before_tx = insert_transaction(sql, 5, 5, "before").await;
    let tx = sql.transaction().await.unwrap();
    let same_tx_before = insert_ordinary(&tx, 2, "same-tx-before").await;
    let poison = insert_oversized_row(&tx, "tmp-poison").await;
    let same_tx_after = insert_ordinary(&tx, 2, "same-tx-after").await;
    tx.commit().await.unwrap();
    let after_tx = insert_transaction(sql, 3, 3, "after").await;
    Written {
        before_tx,
        same_tx_before,
        poison,
        same_tx_after,
        after_tx,
    }
}

fn ids(messages: &[Stored]) -> Vec<i64> {
    messages.iter().map(Stored::outbox_id).collect()
}

/// Waits until the stream holds a message for every row of `written` and the slot confirmed
/// the last; asserts that they are those rows' (`what` says why), in commit order. Returns
/// the messages, the last one's commit and the table's rows.
async fn every_row_confirmed(
    case: &Case,
    js: &jetstream::Context,
    sql: &tokio_postgres::Client,
    written: &Written,
    what: &str,
) -> (Vec<Stored>, Lsn, HashMap<i64, Row>) {
    let all = written.all();
    let (messages, last_commit) = case.wait_confirmed(js, sql, all.len() as u64).await;
    assert_eq!(ids(&messages), all, "{what}");
    (messages, last_commit, rows_by_id(sql).await)
}

/// Waits for the relay process to exit on its own (it must not need a signal).
fn wait_for_exit(relay: &mut Process) -> std::process::ExitStatus {
    tokio::task::block_in_place(|| relay.wait_exit(DEADLINE))
}

fn start_relay(case: &Case) -> Process {
    tokio::task::block_in_place(|| case.start_relay())
}

/// `halt`: the relay stops with an error naming the row; the stream holds everything before
/// it and nothing after; the slot confirms nothing past its transaction. Raising the limit
/// and restarting relays the rest exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_event_under_halt_stops_the_relay_naming_it_and_confirms_nothing_past_it() {
    let case = new_case("poison_halt");
    let js = case.jetstream().await;
    create_limited_stream(&case, &js).await;
    let mut relay = start_relay(&case);
    let mut sql = case.sql().await;
    let written = write_three_transactions(&mut sql).await;

    let status = wait_for_exit(&mut relay);
    let output = relay.output();
    assert!(
        !status.success(),
        "the relay must exit non-zero on a poison event under halt: {status:?}\n{output}"
    );
    let needle = format!("outbox event id={}", written.poison);
    assert!(
        output.contains(&needle),
        "the relay's error must name {needle:?}:\n{output}"
    );

    // The relay is gone: what the stream holds now is final.
    let messages = case.messages(&js).await;
    let mut expected_before = written.before_tx.clone();
    expected_before.extend(&written.same_tx_before);
    assert_eq!(
        ids(&messages),
        expected_before,
        "the stream holds every row before the poison row (its own transaction's included), none after it"
    );
    let poison_commit = messages.last().unwrap().commit_lsn();
    assert!(
        messages[..written.before_tx.len()]
            .iter()
            .all(|m| m.commit_lsn() < poison_commit),
        "transaction A committed before B"
    );
    let confirmed = case.confirmed_flush_lsn(&sql).await;
    assert!(
        confirmed <= poison_commit,
        "the slot confirmed {confirmed}, past the poison row's transaction (commit {poison_commit})"
    );
    eprintln!(
        "poison_halt: injected 1 oversized row (id={}, ~10 KB against max_msg_size {MAX_MESSAGE_SIZE}) between {} and {} ordinary rows; \
         relay exited with {status}; stream holds the {} rows before it, 0 after; slot confirmed {confirmed} <= commit {poison_commit}; published {}",
        written.poison,
        expected_before.len(),
        written.same_tx_after.len() + written.after_tx.len(),
        messages.len(),
        if output.contains("publishing fast-ingest batches") {
            "in fast-ingest batches"
        } else {
            "one message per event"
        },
    );

    // Nothing was lost by halting: with the limit raised, a restart relays the poison row and
    // everything after it, exactly once, in commit order.
    // Through the API's JSON, which keeps allow_batched (async-nats' config lacks it).
    support::update_stream_setting(&js, &case.stream, "max_msg_size", (1024 * 1024).into()).await;
    let relay = start_relay(&case);
    let (messages, last_commit, table) = every_row_confirmed(
        &case,
        &js,
        &sql,
        &written,
        "after raising the limit: every row once, in commit order",
    )
    .await;
    for message in &messages {
        assert_matches_row(&case, message, &table[&message.outbox_id()]);
    }
    assert!(
        relay.output().contains("streaming outbox events"),
        "the restarted relay streams"
    );
    eprintln!(
        "poison_halt: after raising max_msg_size and restarting, {} rows once each, in order; slot confirmed past {last_commit}",
        messages.len()
    );
    drop(relay);
}

/// `dead-letter`: a record on `{prefix}.dlq` takes the poison row's place, in order, with the
/// row's id, keys and the reason; the rows after it flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_event_under_dead_letter_is_replaced_in_order_and_later_events_flow() {
    let mut case = new_case("poison_dlq");
    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let js = case.jetstream().await;
    create_limited_stream(&case, &js).await;
    let relay = start_relay(&case);
    let mut sql = case.sql().await;
    let written = write_three_transactions(&mut sql).await;
    let (messages, after_commit, table) = every_row_confirmed(
        &case,
        &js,
        &sql,
        &written,
        "the dead-letter record stands in the poison row's place, in commit order, and the rows after it flow",
    )
    .await;
    let dlq_at = written.before_tx.len() + written.same_tx_before.len();
    for (i, message) in messages.iter().enumerate() {
        if i != dlq_at {
            assert_matches_row(&case, message, &table[&message.outbox_id()]);
        }
    }

    // The record itself.
    let record = &messages[dlq_at];
    let row = &table[&written.poison];
    let keys = outbox::compute_keys(row.id, &row.entity_id, &row.event_type, row.created_at_ms);
    assert_eq!(record.subject, format!("{}.dlq", case.prefix));
    assert_eq!(
        record.header("Nats-Msg-Id"),
        format!("dead-letter:{}", keys.dedupe_key)
    );
    assert_eq!(record.header("Outbox-Id"), written.poison.to_string());
    let neighbour = &messages[dlq_at - 1];
    assert_eq!(
        record.commit_lsn(),
        neighbour.commit_lsn(),
        "the record carries its transaction's commit LSN"
    );
    assert_eq!(
        record.header("Outbox-Tx-Index"),
        written.same_tx_before.len().to_string(),
        "the record carries the row's index in its transaction"
    );
    let reason = record.header("Outbox-Dead-Letter-Reason");
    assert!(
        reason.contains(&MAX_MESSAGE_SIZE.to_string()),
        "the reason names the limit: {reason}"
    );
    let body: serde_json::Value =
        serde_json::from_slice(&record.payload).expect("the record's body is JSON");
    assert_eq!(body["outbox_id"], serde_json::json!(written.poison));
    assert_eq!(body["dedupe_key"], serde_json::json!(keys.dedupe_key));
    assert_eq!(body["partition_key"], serde_json::json!(keys.partition_key));
    assert_eq!(body["ordering_key"], serde_json::json!(keys.ordering_key));
    assert_eq!(body["entity_id"], serde_json::json!(row.entity_id));
    assert_eq!(body["event_type"], serde_json::json!(row.event_type));
    assert_eq!(body["payload_bytes"], serde_json::json!(row.payload.len()));
    assert!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.contains(&MAX_MESSAGE_SIZE.to_string())),
        "{body}"
    );
    assert!(
        record.payload.len() < MAX_MESSAGE_SIZE as usize,
        "the record is small"
    );
    assert!(
        relay.output().contains("publishing a dead-letter record"),
        "the relay logged the dead-lettering"
    );

    let order_ok = messages.windows(2).all(|w| {
        let (a, b) = (position(&w[0]), position(&w[1]));
        a < b
    });
    assert!(order_ok, "positions strictly increase along the stream");
    eprintln!(
        "poison_dlq: injected 1 oversized row (id={}, {} payload bytes against max_msg_size {MAX_MESSAGE_SIZE}); \
         stream: {} messages, the dead-letter record at position {} on {}, {} rows after it flowed; \
         lost 0, duplicated 0, reordered 0; slot confirmed past {after_commit}",
        written.poison,
        row.payload.len(),
        messages.len(),
        dlq_at + 1,
        record.subject,
        written.same_tx_after.len() + written.after_tx.len(),
    );
    drop(relay);
}

fn position(message: &Stored) -> (Lsn, u32) {
    (
        message.commit_lsn(),
        message.header("Outbox-Tx-Index").parse().unwrap(),
    )
}
