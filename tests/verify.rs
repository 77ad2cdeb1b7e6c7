//! End-to-end tests of `outbox-relay verify` against real Postgres 15 and nats-server
//! processes (testkit): zero problems after a healthy run (exit 0); a message deleted from
//! the stream, a message published twice and a message with a wrong key, each found by its
//! outbox id (exit 5); and the range flags. After the documented migration (issue 18 case
//! 10) verify expects exactly the relay's rows: those already published when the slot was
//! created are left out on one line, and a deleted message is named by its id. Rows deleted
//! from the table after relaying (issue 36) are one line and no discrepancy.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_column;

use std::time::Duration;

use async_nats::HeaderMap;
use support::{
    exits_with, insert_oversized_row, insert_row, insert_transaction, new_case, publish_acked,
    servers, Case, CommandRun, Row, Stored, DEADLINE, ROW_COLUMNS,
};

fn verify(case: &Case, args: &[&str]) -> CommandRun {
    case.run_command("verify", args)
}

/// Relays 3 transactions of 10 rows over 4 entities, then stops the relay (so tampering
/// with the stream does not meet its fence); returns the stored messages.
async fn relayed(case: &Case) -> Vec<Stored> {
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    for tag in ["a", "b", "c"] {
        insert_transaction(&mut sql, 10, 4, tag).await;
    }
    let js = case.jetstream().await;
    case.wait_for_count(&js, 30, DEADLINE).await;
    relay.terminate(Duration::from_secs(10));
    case.messages(&js).await
}

/// The headers of a stored message, without the relay's strict-mode fence.
fn header_map(stored: &Stored) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in &stored.headers {
        // The stored copy keeps the relay's fence headers; a copy published by hand must not.
        if name.starts_with("Nats-Expected-") {
            continue;
        }
        map.insert(name.as_str(), value.as_str());
    }
    map
}

/// Publishes a copy of `stored` with `headers` (and waits for the server's ack).
async fn publish_copy(js: &async_nats::jetstream::Context, stored: &Stored, headers: HeaderMap) {
    publish_acked(js, stored.subject.clone(), headers, stored.payload.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_no_problem_after_a_healthy_run() {
    let case = new_case("verify_healthy");
    relayed(&case).await;
    let run = verify(&case, &[]);
    run.assert_code(0);
    let summary = run.only_line("verify: OK: 30 rows");
    assert!(
        summary.contains("0 missing, 0 duplicated, 0 mismatched, 0 out of order, 0 unexpected"),
        "{}",
        run.stdout
    );
    assert_eq!(run.stdout.lines().count(), 1, "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_a_deleted_a_doubled_and_a_doctored_message_by_outbox_id() {
    let case = new_case("verify_tampered");
    let messages = relayed(&case).await;
    let js = case.jetstream().await;
    let stream = js.get_stream(&case.stream).await.unwrap();
    let (deleted, doubled, doctored) = (&messages[3], &messages[12], &messages[25]);

    // Deleted from the stream.
    stream.delete_message(deleted.sequence).await.unwrap();
    // Published twice: a copy under another Nats-Msg-Id.
    let mut copy = header_map(doubled);
    copy.insert("Nats-Msg-Id", "a-copy");
    publish_copy(&js, doubled, copy).await;
    // A wrong key: deleted and republished with another ordering key.
    stream.delete_message(doctored.sequence).await.unwrap();
    let mut wrong = header_map(doctored);
    wrong.insert("Nats-Msg-Id", "doctored");
    wrong.insert("Outbox-Ordering-Key", "0000000000000:00000000000000000000");
    publish_copy(&js, doctored, wrong).await;

    let run = verify(&case, &[]);
    run.assert_code(5);
    let missing = run.lines("missing: ");
    assert_eq!(
        missing,
        [format!(
            "missing: id={} no message on the stream",
            deleted.outbox_id()
        )],
        "{}",
        run.stdout
    );
    run.only_line_starting(&format!(
        "duplicated: id={} 2 messages on the stream: sequences {}, ",
        doubled.outbox_id(),
        doubled.sequence
    ));
    let mismatched = run.only_line_starting(&format!("mismatched: id={} ", doctored.outbox_id()));
    assert!(
        mismatched.contains(&format!(
            "Outbox-Ordering-Key is \"0000000000000:00000000000000000000\", the row gives \"{}\"",
            doctored.header("Outbox-Ordering-Key")
        )),
        "{}",
        run.stdout
    );
    // The republished copy sits at the tail, after events of its entity committed later.
    run.only_line_starting(&format!(
        "out of order: id={} at sequence {}: entity {:?} ",
        doctored.outbox_id(),
        messages.last().unwrap().sequence + 2,
        doctored.header("Outbox-Entity-Id")
    ));
    run.assert_stdout_has(&[
        "DISCREPANCIES (exit 5): 30 rows",
        "1 missing, 1 duplicated, 1 mismatched",
    ]);

    // A range that leaves the damaged ids out is consistent.
    let first = messages[0].outbox_id();
    let run = verify(
        &case,
        &[
            "--from-id",
            &first.to_string(),
            "--to-id",
            &(deleted.outbox_id() - 1).to_string(),
        ],
    );
    run.assert_code(0);
    run.assert_stdout_has(&["verify: OK: 3 rows"]);
}

/// Header-hostile rows are percent-encoded by the relay (`Outbox-Encoding: percent`): verify
/// decodes them and finds them consistent. A row too large for the stream, dead-lettered, is
/// reported as such by id, and is not a discrepancy (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_decodes_hostile_rows_and_reports_a_dead_lettered_row_without_failing() {
    let mut case = new_case("verify_dlq");
    case.extra_env.extend([
        (
            "OUTBOX_RELAY_ON_POISON".to_owned(),
            "dead-letter".to_owned(),
        ),
        (
            "OUTBOX_RELAY_STREAM_MAX_MSG_SIZE".to_owned(),
            "4KiB".to_owned(),
        ),
    ]);
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 5, 2, "a").await;
    let hostile = insert_row(
        &sql,
        "(E'order\r\nNats-Msg-Id: x', E'Paid Nats-Expected-Last-Sequence: 0 %', 'tmp-h', 'tmp', 'tmp', '{}')",
    )
    .await;
    let poison = insert_oversized_row(&sql, "tmp-p").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 7, DEADLINE).await;
    relay.terminate(Duration::from_secs(10));
    let messages = case.messages(&js).await;
    let stored_hostile = messages.iter().find(|m| m.outbox_id() == hostile).unwrap();
    assert_eq!(stored_hostile.header("Outbox-Encoding"), "percent");

    let run = verify(&case, &[]);
    run.assert_code(0);
    let dlq = messages.iter().find(|m| m.outbox_id() == poison).unwrap();
    assert_eq!(
        run.lines("dead-lettered: "),
        [format!(
            "dead-lettered: id={poison} a dead-letter record at sequence {} in its place",
            dlq.sequence
        )],
        "{}",
        run.stdout
    );
    run.assert_stdout_has(&["verify: OK: 7 rows", "0 missing, 0 duplicated, 0 mismatched, 0 out of order, 0 unexpected, 0 unpublishable, 1 dead-lettered"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_refuses_an_invalid_time_with_exit_2() {
    let case = new_case("verify_bad_time");
    let run = verify(&case, &["--since", "yesterday-ish"]);
    run.assert_code(2);
    run.assert_stderr_has(&["--since \"yesterday-ish\" is neither a timestamp nor a duration"]);
}

/// Throughput of `verify` on `VERIFY_ROWS` rows (default 100 000): the rows are inserted with
/// one `INSERT … SELECT`, read back and published directly with the relay's own message
/// builder (`sink::publish_message`, positions in id order) instead of through the relay, to
/// save time. Prints the summary line (rows/s); `VERIFY_WORKER_THREADS` sets verify's
/// `--worker-threads`. Not run by default:
/// `VERIFY_ROWS=1000000 cargo test --release -p outbox-relay --test e2e verify::verify_throughput -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it on a quiet machine"]
async fn verify_throughput() {
    use futures::{StreamExt as _, TryStreamExt as _};
    use std::future::IntoFuture as _;
    let rows: i64 = std::env::var("VERIFY_ROWS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let mut case = new_case("verify_throughput");
    if let Ok(threads) = std::env::var("VERIFY_WORKER_THREADS") {
        case.extra_env
            .push(("OUTBOX_RELAY_WORKER_THREADS".into(), threads));
    }
    let js = case.jetstream().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: case.stream.clone(),
        subjects: vec![format!("{}.>", case.prefix)],
        ..Default::default()
    })
    .await
    .unwrap();
    let sql = case.sql().await;
    sql.execute(
        "INSERT INTO outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         SELECT 'entity-' || (n % 1000), 'OrderPaid', 'k' || n, 'p', 'o', \
                jsonb_build_object('n', n, 'note', repeat('x', 60)) \
           FROM generate_series(1, $1::int8) AS n",
        &[&rows],
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let query = format!("SELECT {ROW_COLUMNS} FROM outbox_events ORDER BY id");
    let stream = sql
        .query_raw(&query, std::iter::empty::<i64>())
        .await
        .unwrap();
    let prefix = case.prefix.clone();
    let partitions = std::num::NonZeroU64::new(12).unwrap();
    // Sent one after the other (stream order = id order = position order); acks awaited
    // 4096 at a time: the send yields the ack's future on purpose.
    #[allow(clippy::async_yields_async)]
    stream
        .then(|row| {
            let row = outbox::OutboxRow::from(Row::from_sql(&row.unwrap()));
            let position = outbox::Position {
                commit_lsn: outbox::Lsn(u64::try_from(row.id.as_int().unwrap()).unwrap()),
                index: 0,
            };
            let event = row.into_event(&prefix, partitions, position);
            let js = js.clone();
            async move {
                js.send_publish(event.subject.clone(), sink::publish_message(&event))
                    .await
                    .unwrap()
                    .into_future()
            }
        })
        .buffer_unordered(4096)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    eprintln!("published {rows} rows in {:?}", started.elapsed());
    let run = verify(&case, &[]);
    eprintln!("{}{}", run.stderr, run.stdout);
    run.assert_code(0);
    run.assert_stdout_has(&[&format!("verify: OK: {rows} rows")]);
}

/// Issue 18 case 10, the documented migration (docs/migration.md): 1 000 rows in the table
/// when the slot is created, 500 `pending` and 500 already `published` by the poller (the
/// oldest 300, then every other one of the next 400, so the left-out ids come in many runs),
/// and 100 new rows after it. The stream holds the relay's 600 messages: verify is
/// consistent and says, on one line, that the 500 were left out and why; once one
/// backfilled message is deleted it names exactly that id, first. A slot without a recorded
/// boundary (an older relay's) is verified as before, and verify says so once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_after_the_documented_migration_expects_exactly_the_relays_rows() {
    let mut case = new_case("verify_migrated");
    let sql = case.sql().await;
    sql.execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, status, published_at) \
         select 'history-' || (i % 20), 'OrderCreated', 'tmp-' || i, 'tmp', 'tmp', jsonb_build_object('n', i), \
                case when p then 'published' else 'pending' end, case when p then now() end \
           from (select i, i <= 300 or (i <= 700 and i % 2 = 1) as p from generate_series(1, 1000) as i) as rows \
          order by i",
        &[],
    )
    .await
    .unwrap();
    let published: Vec<i64> = sql_column(
        &sql,
        "select id from outbox_events where status = 'published' order by id",
        &[],
    )
    .await;
    assert_eq!(published.len(), 500);
    // Step 3 of the migration: the slot created with the default backfill (pending), in
    // shared-stream mode.
    case.set_env(&[("OUTBOX_RELAY_SHARED_STREAM", "true")]);
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let new = insert_transaction(&mut sql, 100, 5, "new").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 600, DEADLINE).await;
    relay.terminate(Duration::from_secs(10));
    let messages = case.messages(&js).await;
    assert_eq!(messages.len(), 600);

    let left_out = format!(
        "left out: 500 rows (ids {}..={}), already published when slot {:?} was created with --backfill pending (it streams from ",
        published[0],
        published[499],
        case.slot
    );
    let run = verify(&case, &[]);
    run.assert_code(0);
    assert_eq!(run.lines(&left_out).len(), 1, "{}", run.stdout);
    assert_eq!(run.stdout.lines().count(), 2, "{}", run.stdout);
    assert!(
        run.stdout.contains("verify: OK: 600 rows (ids 1..=1100)")
            && run.stdout.contains(": 0 missing,")
            && run.stdout.ends_with(", 500 left out\n"),
        "{}",
        run.stdout
    );

    // One backfilled message deleted, in the stretch where left-out and backfilled ids
    // alternate: a pending row between two published ones.
    let between = (published[0]..published[499])
        .find(|id| {
            !published.contains(id)
                && published.contains(&(id - 1))
                && published.contains(&(id + 1))
        })
        .unwrap();
    let deleted = messages
        .iter()
        .find(|m| m.outbox_id() == between)
        .expect("a pending row is backfilled");
    let stream = js.get_stream(&case.stream).await.unwrap();
    stream.delete_message(deleted.sequence).await.unwrap();
    let run = verify(&case, &[]);
    run.assert_code(5);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    assert_eq!(
        lines[0],
        format!("missing: id={between} no message on the stream")
    );
    assert!(lines[1].starts_with(&left_out), "{}", run.stdout);
    assert!(
        lines[2].starts_with(
            "verify: DISCREPANCIES (exit 5): 600 rows (ids 1..=1100), 599 stream messages"
        ) && lines[2]
            .contains(" 1 missing, 0 duplicated, 0 mismatched, 0 out of order, 0 unexpected")
            && lines[2].ends_with(", 500 left out"),
        "{}",
        run.stdout
    );
    // A streamed row's message deleted too: named as well, in id order.
    let streamed = messages.iter().find(|m| m.outbox_id() == new[50]).unwrap();
    stream.delete_message(streamed.sequence).await.unwrap();
    let run = verify(&case, &[]);
    run.assert_code(5);
    assert_eq!(
        run.lines("missing: "),
        [
            format!("missing: id={between} no message on the stream"),
            format!("missing: id={} no message on the stream", new[50]),
        ],
        "{}",
        run.stdout
    );

    // A slot whose boundary was never recorded (created by an older relay): every row is
    // expected, as before, and verify says why once.
    sql.execute("delete from outbox_relay_boundary", &[])
        .await
        .unwrap();
    let run = verify(&case, &[]);
    run.assert_code(5);
    assert_eq!(
        run.lines(&format!(
            "note: no boundary is recorded for slot {:?} (",
            case.slot
        ))
        .len(),
        1,
        "{}",
        run.stdout
    );
    run.assert_stdout_has(&[" 502 missing,", ", 0 left out\n"]);
}

/// BD2: a relay whose role may not create the boundary's table (Postgres 15 grants no CREATE
/// on `public` to other roles) warns once at the slot's creation, naming the fix, and relays
/// all the same; verify then expects every row, as before, and says why once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_cannot_record_the_boundary_warns_once_and_relays_all_the_same() {
    let case = new_case("verify_unrecorded");
    let role = format!("r_{}", case.database);
    servers().pg.psql(
        &case.database,
        &format!(
            "create role {role} login replication; grant select on outbox_events to {role};
             create publication {} for table outbox_events with (publish = 'insert');",
            case.publication
        ),
    );
    let sql = case.sql().await;
    sql.execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, status) \
         select 'history', 'OrderCreated', 'tmp-' || i, 'tmp', 'tmp', '{}', \
                case when i % 2 = 0 then 'published' else 'pending' end \
           from generate_series(1, 10) as i",
        &[],
    )
    .await
    .unwrap();
    let mut restricted = case.clone();
    restricted.pg_url =
        restricted
            .pg_url
            .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    let mut relay = restricted.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 3, 1, "new").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 8, DEADLINE).await;
    relay.terminate(Duration::from_secs(10));
    let output = relay.output();
    assert_eq!(
        output
            .matches("cannot record the slot's boundary in \"public\".\"outbox_relay_boundary\" (")
            .count(),
        1,
        "{output}"
    );
    assert!(
        output.contains("permission denied for schema public")
            && output.contains("sql/boundary.sql"),
        "{output}"
    );

    let run = verify(&case, &[]);
    run.assert_code(5);
    assert_eq!(run.lines("missing: ").len(), 5, "{}", run.stdout);
    let note = run.only_line("note: no boundary is recorded for slot ");
    assert!(
        note.contains("\"public\".\"outbox_relay_boundary\" does not exist"),
        "{}",
        run.stdout
    );
}

/// Positions compare only within one WAL history: after the database moves to a new cluster
/// (a major-version upgrade by dump and restore, docs/upgrading.md), the new cluster's LSNs
/// start again lower and its `Outbox-Source` differs. The stream's order is still the commit
/// order, and verify says so (found by the recorded upgrade run: 50 rows reported out of
/// order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_compares_positions_within_one_wal_history_only() {
    let mut case = new_case("verify_histories");
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    let mut relay = tokio::task::block_in_place(|| case.start_relay());
    insert_transaction(&mut sql, 30, 3, "old").await;
    case.wait_for_count(&js, 30, DEADLINE).await;
    tokio::task::block_in_place(|| relay.terminate(DEADLINE));

    // A new cluster with the table's rows, as a dump and restore leaves it.
    let new_cluster = testkit::Postgres::start();
    new_cluster.create_database(&case.database);
    new_cluster.psql(&case.database, support::SCHEMA_SQL);
    let new_sql = support::sql_connect(&new_cluster.url(&case.database))
        .await
        .unwrap();
    for row in sql
        .query(
            "select id, entity_id, event_type, dedupe_key, partition_key, ordering_key, payload::text, created_at::text from outbox_events order by id",
            &[],
        )
        .await
        .unwrap()
    {
        let (id, entity, kind, dedupe, partition, ordering, payload, created): (
            i64, String, String, String, String, String, String, String,
        ) = (
            row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5), row.get(6), row.get(7),
        );
        new_sql
            .execute(
                "insert into outbox_events (id, entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) \
                 values ($1, $2, $3, $4, $5, $6, $7::text::jsonb, $8::text::timestamptz)",
                &[&id, &entity, &kind, &dedupe, &partition, &ordering, &payload, &created],
            )
            .await
            .unwrap();
    }
    new_sql
        .batch_execute("select setval(pg_get_serial_sequence('outbox_events', 'id'), (select max(id) from outbox_events))")
        .await
        .unwrap();
    case.pg_url = new_cluster.url(&case.database);
    // testkit's clusters share an initdb template, so their system identifiers match: a slot
    // of another name makes the new history's `Outbox-Source` differ as a real new cluster's
    // does.
    case.slot = format!("{}_upgraded", case.slot);
    let init = case
        .relay_command("init")
        .args(["--backfill", "none"])
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let _relay = tokio::task::block_in_place(|| case.start_relay());
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 20, 3, "new").await;
    case.wait_for_count(&js, 50, DEADLINE).await;

    let run = verify(&case, &[]);
    run.assert_code(0);
    run.assert_stdout_has(&["0 out of order"]);
}

/// Issue 36: outbox tables are emptied by design. Rows deleted after relaying (inside the
/// table's id range, below it, and then every row) are one line, "rows deleted after
/// relaying", never `unexpected` and never a failing exit (`verify` VER7); `replay` and
/// `backfill` of a range whose rows are gone are refused naming why (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_table_is_one_line_and_no_discrepancy() {
    let case = new_case("verify_emptied");
    let messages = relayed(&case).await;
    let ids: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    let sql = case.sql().await;
    // Below the range (a clean-up), and inside it (remove-after-insert, a partition).
    let deleted: Vec<i64> = ids[..5].iter().chain(&ids[12..15]).copied().collect();
    sql.execute("delete from outbox_events where id = any($1)", &[&deleted])
        .await
        .unwrap();
    let run = verify(&case, &[]);
    run.assert_code(0);
    let line = run.only_line("rows deleted after relaying: 8 messages");
    assert!(
        line.contains(&format!("3 of them with ids {}..={}", ids[12], ids[14])),
        "{}",
        run.stdout
    );
    run.assert_stdout_has(&["verify: OK: 22 rows", " 0 unexpected"]);

    sql.batch_execute("truncate outbox_events").await.unwrap();
    let run = verify(&case, &[]);
    run.assert_code(0);
    assert_eq!(
        run.lines("rows deleted after relaying: 30 messages").len(),
        1,
        "{}",
        run.stdout
    );

    for (tool, args) in [("replay", vec!["--force"]), ("backfill", vec!["--force"])] {
        let stderr = exits_with(case.relay_command(tool).args(&args), 2);
        assert!(
            stderr.contains("holds no row in the range given")
                && stderr.contains("deleted after they were relayed"),
            "{tool} names why: {stderr}"
        );
    }
}
