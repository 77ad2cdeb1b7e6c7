//! Rows real deployments bring that NATS cannot take as they are, each with a clear outcome
//! and nothing lost silently:
//! - an `event_type` longer than the server's protocol line (`max_control_line`): the poison
//!   policy, never a reconnect loop;
//! - `entity_id`/`event_type` values containing NATS header names: percent-encoded, so
//!   de-duplication and strict mode's fence still hold, and consumers decode the exact values;
//! - a dead-letter record larger than the stream accepts: cut to fit;
//! - outbox ids reused after `TRUNCATE … RESTART IDENTITY` within the duplicate window:
//!   detected (the duplicate's original is another event), never dropped silently.
//!
//! Real Postgres and nats-server, shared by the tests of this binary; one case each.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::new_case;

use async_nats::jetstream;
use support::{
    assert_contains_all, assert_matches_row, eventually, rows_by_id, Case, Stored, DEADLINE,
};
use testkit::Process;

fn ids(messages: &[Stored]) -> Vec<i64> {
    messages.iter().map(Stored::outbox_id).collect()
}

fn start_relay(case: &Case) -> Process {
    tokio::task::block_in_place(|| case.start_relay())
}

/// Waits for the relay process to exit on its own (it must not need a signal).
fn wait_for_exit(relay: &mut Process) -> std::process::ExitStatus {
    tokio::task::block_in_place(|| relay.wait_exit(DEADLINE))
}

/// Waits for the relay, under `halt`, to exit on its own; asserts that it failed and
/// returns what it printed.
fn halted(relay: &mut Process) -> String {
    let status = wait_for_exit(relay);
    let output = relay.output();
    assert!(
        !status.success(),
        "halt exits non-zero: {status:?}\n{output}"
    );
    output
}

/// A case named `name` whose relay streams: the case, a JetStream context, the relay and a
/// SQL connection.
async fn streaming(name: &str) -> (Case, jetstream::Context, Process, tokio_postgres::Client) {
    let case = new_case(name);
    let js = case.jetstream().await;
    let relay = start_relay(&case);
    let sql = case.sql().await;
    (case, js, relay, sql)
}

/// Starts the relay again under `dead-letter` and waits until the stream holds `n` messages
/// and the slot confirmed past the tail; returns the relay and the stream's messages.
async fn restarted_under_dead_letter(
    case: &mut Case,
    js: &jetstream::Context,
    sql: &tokio_postgres::Client,
    n: usize,
) -> (Process, Vec<Stored>) {
    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let relay = start_relay(case);
    case.wait_for_count(js, n as u64, DEADLINE).await;
    wait_confirmed_past_the_tail(case, js, sql).await;
    (relay, case.messages(js).await)
}

/// Inserts one row per `(entity_id, event_type)` in one transaction; returns the ids.
async fn insert_rows(sql: &mut tokio_postgres::Client, rows: &[(String, String)]) -> Vec<i64> {
    let tx = sql.transaction().await.unwrap();
    let mut ids = Vec::with_capacity(rows.len());
    for (n, (entity_id, event_type)) in rows.iter().enumerate() {
        let row = tx
            .query_one(
                "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
                 values ($1, $2, 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', jsonb_build_object('n', $3::int)) returning id",
                &[entity_id, event_type, &(n as i32)],
            )
            .await
            .unwrap();
        ids.push(row.get(0));
    }
    tx.commit().await.unwrap();
    ids
}

/// `count` ordinary rows in one transaction.
async fn insert_ordinary(sql: &mut tokio_postgres::Client, count: usize, tag: &str) -> Vec<i64> {
    let rows: Vec<(String, String)> = (0..count)
        .map(|i| (format!("{tag}-{i}"), "OrderPaid".to_owned()))
        .collect();
    insert_rows(sql, &rows).await
}

/// Waits until the slot confirmed past the stream's last message; returns that message's
/// commit LSN.
async fn wait_confirmed_past_the_tail(
    case: &Case,
    js: &jetstream::Context,
    sql: &tokio_postgres::Client,
) -> pgoutput::Lsn {
    eventually(
        "the slot to confirm the stream's last event",
        DEADLINE,
        || async {
            let messages = case.messages(js).await;
            let last = messages.last()?.commit_lsn();
            (case.confirmed_flush_lsn(sql).await > last).then_some(last)
        },
    )
    .await
}

/// The header's value as the row had it: decoded when the message says it is encoded.
fn decoded(message: &Stored, name: &str) -> String {
    let raw = message.header(name);
    match message.headers.get("Outbox-Encoding").map(String::as_str) {
        Some("percent") => outbox::encoding::decode(raw).unwrap_or_else(|| {
            panic!(
                "{name} of message {} does not decode: {raw:?}",
                message.sequence
            )
        }),
        Some(other) => panic!("unknown Outbox-Encoding {other:?}"),
        None => raw.to_owned(),
    }
}

/// A 5 000-character event type makes the publish line longer than nats-server's
/// `max_control_line`. Under `halt` the relay exits naming the row (no reconnect loop), with
/// everything before it in the stream and nothing after it confirmed; restarted under
/// `dead-letter`, a record takes its place and the events after it flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_type_longer_than_the_control_line_goes_to_the_poison_policy() {
    let (mut case, js, mut relay, mut sql) = streaming("control_line").await;

    let before = insert_ordinary(&mut sql, 3, "before").await;
    let long_type = "E".repeat(5000);
    let tx_rows = vec![
        ("same-tx-before".to_owned(), "OrderPaid".to_owned()),
        ("long".to_owned(), long_type.clone()),
        ("same-tx-after".to_owned(), "OrderPaid".to_owned()),
    ];
    let tx_ids = insert_rows(&mut sql, &tx_rows).await;
    let long_id = tx_ids[1];
    let after = insert_ordinary(&mut sql, 2, "after").await;

    let output = halted(&mut relay);
    let needle = format!("outbox event id={long_id}");
    assert!(
        output.contains(&needle),
        "the error names {needle:?}:\n{output}"
    );
    assert!(
        output.contains("max_control_line"),
        "the error names the limit:\n{output}"
    );
    assert!(
        !output.contains("resuming from the slot's confirmed position"),
        "the relay stopped at once, no reconnect loop:\n{output}"
    );
    let messages = case.messages(&js).await;
    let mut expected: Vec<i64> = before.clone();
    expected.push(tx_ids[0]);
    assert_eq!(
        ids(&messages),
        expected,
        "everything before the row, nothing after"
    );
    let tx_commit = messages.last().unwrap().commit_lsn();
    let confirmed = case.confirmed_flush_lsn(&sql).await;
    assert!(
        confirmed <= tx_commit,
        "the slot confirmed {confirmed}, past the long row's transaction (commit {tx_commit})"
    );

    let mut all = before.clone();
    all.extend(&tx_ids);
    all.extend(&after);
    let (relay, messages) = restarted_under_dead_letter(&mut case, &js, &sql, all.len()).await;
    assert_eq!(
        ids(&messages),
        all,
        "the record stands in the row's place, later rows flow"
    );
    let table = rows_by_id(&sql).await;
    let at = before.len() + 1;
    for (i, message) in messages.iter().enumerate() {
        if i != at {
            assert_matches_row(&case, message, &table[&message.outbox_id()]);
        }
    }
    let record = &messages[at];
    assert_eq!(record.subject, format!("{}.dlq", case.prefix));
    assert_eq!(record.header("Outbox-Id"), long_id.to_string());
    assert!(
        record
            .header("Outbox-Dead-Letter-Reason")
            .contains("max_control_line"),
        "{:?}",
        record.headers
    );
    let body: serde_json::Value = serde_json::from_slice(&record.payload).unwrap();
    assert_eq!(body["outbox_id"], serde_json::json!(long_id));
    assert_eq!(body["event_type"], serde_json::json!(long_type));
    assert_eq!(body["truncated"], serde_json::json!(false));
    eprintln!(
        "control_line: a {}-byte event type (id={long_id}): halt exited naming it with {} rows stored before it; \
         under dead-letter the record took its place ({} on {}) and {} rows after it flowed",
        long_type.len(),
        expected.len(),
        record.sequence,
        record.subject,
        all.len() - at - 1
    );
    drop(relay);
}

/// 200 rows whose `entity_id`/`event_type` contain `Nats-Msg-Id` and
/// `Nats-Expected-Last-Sequence`:
/// - published with their exact values recoverable (decoded header values equal the row's);
/// - fenced: each time another writer slips a message into the stream, the relay's next
///   publish (a hostile row, stale expected sequence) is refused, never stored over it;
/// - de-duplicated: a second slot created at the same point replays all of them into the
///   same stream (shared mode) and every replay is acknowledged as a duplicate, so the
///   stream holds each row exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_with_nats_header_names_are_deduplicated_and_fenced() {
    const ROWS: usize = 200;
    const FENCE_ROUNDS: usize = 5;
    let (case, js, mut relay, mut sql) = streaming("header_names").await;
    // Slot B at the same point as the relay's slot A: it will replay everything A relays.
    let slot_b = format!("{}_b", case.slot);
    sql.execute(
        "select pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&slot_b],
    )
    .await
    .unwrap();

    let hostile = |n: usize| {
        let entity_id = format!("order-{n} Nats-Msg-Id: fake-{n} Nats-Expected-Last-Sequence: 0");
        let event_type = match n % 3 {
            0 => "Nats-Expected-Last-Sequence".to_owned(),
            1 => "OrderPaid Nats-Msg-Id: x".to_owned(),
            _ => "nats-msg-id\r\nNATS-EXPECTED-LAST-SEQUENCE: 1".to_owned(),
        };
        (entity_id, event_type)
    };
    let mut written = Vec::new();
    for chunk in (0..ROWS).collect::<Vec<_>>().chunks(50) {
        let rows: Vec<_> = chunk.iter().map(|&n| hostile(n)).collect();
        written.extend(insert_rows(&mut sql, &rows).await);
    }
    case.wait_for_count(&js, ROWS as u64, DEADLINE).await;
    wait_confirmed_past_the_tail(&case, &js, &sql).await;
    let messages = case.messages(&js).await;
    assert_eq!(ids(&messages), written, "every row once, in commit order");
    let table = rows_by_id(&sql).await;
    for message in &messages {
        let row = &table[&message.outbox_id()];
        let keys = outbox::compute_keys(row.id, &row.entity_id, &row.event_type, row.created_at_ms);
        assert_eq!(message.header("Outbox-Encoding"), "percent");
        assert_eq!(decoded(message, "Outbox-Entity-Id"), row.entity_id);
        assert_eq!(decoded(message, "Outbox-Event-Type"), row.event_type);
        assert_eq!(decoded(message, "Outbox-Partition-Key"), keys.partition_key);
        assert_eq!(decoded(message, "Nats-Msg-Id"), keys.dedupe_key);
        assert_eq!(
            message.subject,
            outbox::subject::subject(
                &case.prefix,
                message.header("Outbox-Shard").parse().unwrap(),
                &row.event_type
            )
        );
    }

    // The fence: another writer's message makes the relay's expected sequence stale.
    let refusal = "the stream's last message is not what this relay published last";
    let mut expected_count = ROWS as u64;
    for round in 0..FENCE_ROUNDS {
        js.publish(format!("{}.foreign", case.prefix), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        written.extend(insert_rows(&mut sql, &[hostile(ROWS + round)]).await);
        expected_count += 2;
        case.wait_for_count(&js, expected_count, DEADLINE).await;
        let refusals = relay.output().matches(refusal).count();
        assert_eq!(
            refusals,
            round + 1,
            "round {round}: the hostile row's stale expected sequence must be refused before it is stored:\n{}",
            relay.output()
        );
    }
    wait_confirmed_past_the_tail(&case, &js, &sql).await;
    assert!(relay.terminate(DEADLINE).success());

    // The forced replay: slot B, shared mode, the same stream.
    let mut replay = case.clone();
    replay.slot = slot_b;
    replay
        .extra_env
        .push(("OUTBOX_RELAY_SHARED_STREAM".into(), "true".into()));
    let relay_b = start_relay(&replay);
    let last_commit = case.messages(&js).await.last().unwrap().commit_lsn();
    eventually("slot B to confirm every replayed row", DEADLINE, || async {
        (replay.confirmed_flush_lsn(&sql).await > last_commit).then_some(())
    })
    .await;
    let messages = case.messages(&js).await;
    let stored: Vec<i64> = messages
        .iter()
        .filter(|m| m.headers.contains_key("Outbox-Id"))
        .map(Stored::outbox_id)
        .collect();
    assert_eq!(
        stored, written,
        "every hostile row exactly once after the replay: each replayed publish was a duplicate"
    );
    assert_eq!(messages.len() as u64, expected_count);
    assert_eq!(messages.last().unwrap().sequence, expected_count);
    assert!(
        !relay_b.output().contains("outbox_relay_reused_id_total"),
        "the replays are the same events, not reused ids:\n{}",
        relay_b.output()
    );
    eprintln!(
        "header_names: {} hostile rows relayed, {FENCE_ROUNDS} stale fences refused, then replayed from a second slot: \
         the stream holds {} messages ({} rows once each, {FENCE_ROUNDS} foreign)",
        written.len(),
        messages.len(),
        stored.len()
    );
    drop(relay_b);
}

/// A row too large for the stream whose dead-letter record would be too large too (it
/// repeats the 3 000-character `entity_id`): the record is cut to fit and says so; the
/// events after it flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_dead_letter_record_is_cut_to_fit() {
    const MAX_MESSAGE_SIZE: i32 = 4096;
    let mut case = new_case("dlq_cut");
    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let js = case.jetstream().await;
    case.create_stream(
        &js,
        jetstream::stream::Config {
            max_message_size: MAX_MESSAGE_SIZE,
            ..Default::default()
        },
    )
    .await;
    let relay = start_relay(&case);
    let mut sql = case.sql().await;
    let before = insert_ordinary(&mut sql, 2, "before").await;
    let long_entity = "e".repeat(3000);
    let long = insert_rows(&mut sql, &[(long_entity.clone(), "OrderPaid".into())]).await[0];
    let after = insert_ordinary(&mut sql, 2, "after").await;

    let mut all = before.clone();
    all.push(long);
    all.extend(&after);
    case.wait_for_count(&js, all.len() as u64, DEADLINE).await;
    wait_confirmed_past_the_tail(&case, &js, &sql).await;
    let messages = case.messages(&js).await;
    assert_eq!(
        ids(&messages),
        all,
        "the record in the row's place, later rows flow"
    );
    let record = &messages[before.len()];
    assert_eq!(record.subject, format!("{}.dlq", case.prefix));
    assert!(
        record.payload.len() < MAX_MESSAGE_SIZE as usize,
        "the record fits"
    );
    let body: serde_json::Value = serde_json::from_slice(&record.payload).unwrap();
    assert_eq!(body["outbox_id"], serde_json::json!(long));
    assert_eq!(body["truncated"], serde_json::json!(true), "{body}");
    let kept = body["entity_id"].as_str().unwrap_or_default();
    assert!(
        !kept.is_empty() && long_entity.starts_with(kept) && kept.len() < long_entity.len(),
        "the entity id is cut, not altered: {body}"
    );
    assert!(record.header("Nats-Msg-Id").starts_with("dead-letter:"));
    assert!(
        relay.output().contains("publishing a dead-letter record"),
        "the relay logged the dead-lettering"
    );
    eprintln!(
        "dlq_cut: a row with a {}-byte entity id against max_msg_size {MAX_MESSAGE_SIZE}: a {}-byte record (truncated) took its place, {} rows after it flowed",
        long_entity.len(),
        record.payload.len(),
        after.len()
    );
    drop(relay);
}

/// `TRUNCATE … RESTART IDENTITY` within the duplicate window: the new row with id 1 gets the
/// dedupe key of the old row 1, and JetStream acknowledges it as a duplicate. The relay checks
/// the original and sees another event: under `halt` it exits naming the row and the cause;
/// restarted under `dead-letter`, a record takes the row's place and later rows flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_ids_after_restart_identity_are_not_dropped_silently() {
    let (mut case, js, mut relay, mut sql) = streaming("restart_identity").await;
    let first = insert_ordinary(&mut sql, 3, "order").await;
    assert_eq!(first, vec![1, 2, 3]);
    case.wait_for_count(&js, 3, DEADLINE).await;
    wait_confirmed_past_the_tail(&case, &js, &sql).await;

    sql.batch_execute("truncate outbox_events restart identity")
        .await
        .unwrap();
    // Id 1 again, with the same entity and type: the same dedupe key as the old row 1.
    let reused = insert_ordinary(&mut sql, 1, "order").await;
    assert_eq!(reused, vec![1]);
    let later = insert_rows(&mut sql, &[("fresh-entity".into(), "OrderPaid".into())]).await;

    let output = halted(&mut relay);
    assert!(
        output.contains("outbox event id=1"),
        "names the row:\n{output}"
    );
    assert!(
        output.contains("RESTART IDENTITY") && output.contains("duplicate"),
        "explains the cause and the fix:\n{output}"
    );
    assert_eq!(
        case.stream_count(&js).await,
        3,
        "nothing after the reused id was stored"
    );

    let (relay, messages) = restarted_under_dead_letter(&mut case, &js, &sql, 5).await;
    assert_eq!(ids(&messages), vec![1, 2, 3, 1, later[0]]);
    let record = &messages[3];
    assert_eq!(record.subject, format!("{}.dlq", case.prefix));
    assert!(
        record
            .header("Outbox-Dead-Letter-Reason")
            .contains("duplicate of stream sequence 1"),
        "{:?}",
        record.headers
    );
    assert!(
        record.commit_lsn() > messages[2].commit_lsn(),
        "the record carries the new row's position"
    );
    let table = rows_by_id(&sql).await;
    assert_matches_row(&case, &messages[4], &table[&later[0]]);
    let mut relay = relay;
    assert!(relay.terminate(DEADLINE).success());

    // Shared mode cannot stop for it (other writers' duplicates are legitimate there), but
    // it counts and warns: the reused id is never dropped without a word.
    case.set_env(&[("OUTBOX_RELAY_SHARED_STREAM", "true")]);
    let relay = start_relay(&case);
    sql.batch_execute("truncate outbox_events restart identity")
        .await
        .unwrap();
    assert_eq!(insert_ordinary(&mut sql, 1, "order").await, vec![1]);
    let last = insert_rows(&mut sql, &[("newest-entity".into(), "OrderPaid".into())]).await;
    case.wait_for_count(&js, 6, DEADLINE).await;
    wait_confirmed_past_the_tail(&case, &js, &sql).await;
    let messages = case.messages(&js).await;
    assert_eq!(ids(&messages), vec![1, 2, 3, 1, later[0], last[0]]);
    let output = support::strip_ansi(&relay.output());
    // Shared mode warns with the metric and the row.
    assert_contains_all(
        &output,
        [
            "outbox_relay_reused_id_total",
            "outbox_id=1",
            "this event is not in the stream",
        ],
    );
    eprintln!(
        "restart_identity: the reused id 1 halted the relay naming it; under dead-letter a record (seq {}) took its place and the later row flowed; \
         in shared mode the next reuse was counted and warned about",
        record.sequence
    );
    drop(relay);
}
