//! End-to-end tests of `outbox-relay run` against a real Postgres 15 (`wal_level=logical`)
//! and a real `nats-server -js`, both started by the harness on free ports and shared by the
//! tests of this binary; each test has its own database, slot, publication and stream.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::servers;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use support::{
    assert_matches_row, eventually, exits_with, insert_row, insert_transaction, new_case, rows,
    Case, Relayed, DEADLINE,
};
use testkit::Postgres;

/// What a test continues from after [`kill_relay_mid_backlog`].
struct Interrupted {
    sql: tokio_postgres::Client,
    js: async_nats::jetstream::Context,
    /// Rows committed.
    committed: u64,
    /// Messages the stream held after the kill.
    stored_at_kill: u64,
}

/// Starts the relay on `case`, commits `transactions` transactions of 250 rows, and SIGKILLs
/// the relay while that backlog flows (once the stream holds some of it).
async fn kill_relay_mid_backlog(case: &Case, transactions: usize) -> Interrupted {
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    let committed = insert_batches(&mut sql, 0..transactions).await;
    case.wait_for_count(&js, 1, DEADLINE).await;
    relay.kill();
    let stored_at_kill = case.stream_count(&js).await;
    Interrupted {
        sql,
        js,
        committed,
        stored_at_kill,
    }
}

/// Commits the transactions numbered `range`, 250 rows each over 20 entities (tagged
/// `batch-{i}`); returns how many rows.
async fn insert_batches(sql: &mut tokio_postgres::Client, range: std::ops::Range<usize>) -> u64 {
    let mut committed = 0;
    for i in range {
        let tag = format!("batch-{i}");
        committed += insert_transaction(sql, 250, 20, &tag).await.len() as u64;
    }
    committed
}

/// (a) + (f): transactions of 1, 100 and 10 000 rows → exactly one message per row, with
/// the seed's keys, subject shard = shard_for_key(12, entity_id), payload = the jsonb text;
/// the stream's order is the commit order (globally, hence per entity).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_1_100_and_10000_row_transactions_arrives_once_with_the_seed_keys() {
    let case = new_case("sizes");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let mut committed = Vec::new();
    for i in 0..20 {
        committed.extend(insert_transaction(&mut sql, 1, 7, &format!("single-{i}")).await);
    }
    for i in 0..5 {
        committed.extend(insert_transaction(&mut sql, 100, 7, &format!("hundred-{i}")).await);
    }
    committed.extend(insert_transaction(&mut sql, 10_000, 50, "ten-thousand").await);
    let js = case.jetstream().await;
    case.wait_for_count(&js, committed.len() as u64, DEADLINE)
        .await;

    let messages = case.messages(&js).await;
    let table = rows(&sql).await;
    assert_eq!(messages.len(), table.len(), "one message per committed row");
    let by_id: HashMap<i64, _> = table.iter().map(|r| (r.id, r)).collect();
    let mut seen = HashSet::new();
    for message in &messages {
        assert!(
            seen.insert(message.header("Nats-Msg-Id").to_owned()),
            "duplicate {}",
            message.header("Nats-Msg-Id")
        );
        assert_matches_row(&case, message, by_id[&message.outbox_id()]);
    }
    // One writer committed these in id order, so commit order is id order here.
    let stream_ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(stream_ids, committed, "stream order is commit order");
    assert!(messages
        .windows(2)
        .all(|w| w[0].commit_lsn() <= w[1].commit_lsn()));
    eprintln!(
        "sizes: {} rows in {} transactions relayed once each, in commit order",
        messages.len(),
        26
    );
    drop(relay);
}

/// (f) Commit order, not id order: two transactions that commit in the opposite order of
/// their ids appear in commit order, for the same entity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_order_is_commit_order_not_id_order() {
    let case = new_case("commit_order");
    let relay = case.start_relay();
    let mut first = case.sql().await;
    let mut second = case.sql().await;
    let mut expected = Vec::new();
    for round in 0..5 {
        let t1 = first.transaction().await.unwrap();
        let id1 = insert_row(
            &t1,
            "('entity-x', 'A', gen_random_uuid()::text, '', '', '{}')",
        )
        .await;
        let t2 = second.transaction().await.unwrap();
        let id2 = insert_row(
            &t2,
            "('entity-x', 'B', gen_random_uuid()::text, '', '', '{}')",
        )
        .await;
        assert!(id1 < id2, "round {round}");
        t2.commit().await.unwrap();
        t1.commit().await.unwrap();
        expected.extend([id2, id1]);
    }
    let js = case.jetstream().await;
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    let ids: Vec<i64> = case.outbox_ids(&js).await;
    assert_eq!(
        ids, expected,
        "the later id committed first and must come first"
    );
    drop(relay);
}

/// (b) A rolled-back transaction publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_transactions_publish_nothing() {
    let case = new_case("rollback");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let tx = sql.transaction().await.unwrap();
    tx.execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         select 'e', 'RolledBack', 'rb-' || i, '', '', '{}' from generate_series(1, 500) i",
        &[],
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    // A big rolled-back transaction may be spilled to disk by the walsender; still nothing.
    let marker = insert_transaction(&mut sql, 1, 1, "marker").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 1, DEADLINE).await;
    // The marker committed after the rollback, so once it is stored anything of the
    // rolled-back transaction would have been stored before it.
    let messages = case.messages(&js).await;
    assert_eq!(messages.len(), 1, "only the committed marker: {messages:?}");
    assert_eq!(messages[0].outbox_id(), marker[0]);
    drop(relay);
}

/// The relay turns transparent huge pages off for itself (docs/performance.md, "Transparent
/// huge pages": 6 % of its samples went to zeroing huge pages it faulted in again, and its
/// peak RSS is 24 MiB without them against 38 with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_runs_without_transparent_huge_pages() {
    let case = new_case("no_thp");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 1, 1, "thp").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 1, DEADLINE).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", relay.pid())).unwrap();
    let thp = status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .unwrap_or_else(|| panic!("no THP_enabled in /proc/<relay>/status: {status}"));
    assert_eq!(
        thp.trim(),
        "0",
        "the relay runs with transparent huge pages"
    );
    drop(relay);
}

/// (c) UPDATE, DELETE and TRUNCATE of outbox rows, and writes to other tables, publish nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_deletes_truncates_and_other_tables_publish_nothing() {
    let case = new_case("non_inserts");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let inserted = insert_transaction(&mut sql, 3, 3, "initial").await;
    sql.batch_execute(
        "create table other_table (id int primary key, note text);
         insert into other_table values (1, 'a'), (2, 'b');
         update outbox_events set status = 'published', attempts = attempts + 1;
         delete from outbox_events where id = (select min(id) from outbox_events);
         update other_table set note = 'c';
         delete from other_table where id = 1;
         truncate outbox_events;",
    )
    .await
    .unwrap();
    let marker = insert_transaction(&mut sql, 1, 1, "marker").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 4, DEADLINE).await;
    let ids: Vec<i64> = case.outbox_ids(&js).await;
    let mut expected = inserted;
    expected.extend(marker);
    assert_eq!(ids, expected, "only the four inserts");
    drop(relay);
}

/// (e) SIGKILL mid-stream, restart: every row arrives, each dedupe key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_then_restart_loses_nothing_and_duplicates_nothing() {
    let case = new_case("sigkill");
    // Kill while the backlog is flowing: some but not all of it stored.
    let Interrupted {
        mut sql,
        js,
        mut committed,
        stored_at_kill,
    } = kill_relay_mid_backlog(&case, 40).await;
    committed += insert_batches(&mut sql, 40..50).await;
    let relay = case.start_relay();
    case.wait_for_count(&js, committed, DEADLINE).await;
    let messages = case.messages(&js).await;
    let keys: HashSet<&str> = messages.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(keys.len(), messages.len(), "each dedupe key once");
    assert_eq!(messages.len() as u64, committed, "every committed row");
    let ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "commit order kept across the kill"
    );
    eprintln!("sigkill: killed with {stored_at_kill}/{} stored; after restart {committed} stored once each", committed - 2500);
    drop(relay);
}

/// (g) After 30 s of writes to other tables only, the slot's confirmed position is within a
/// few MB of the WAL end: unrelated WAL does not pile up behind the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrelated_writes_do_not_hold_wal_behind_the_slot() {
    let case = new_case("idle_wal");
    let relay = case.start_relay();
    let sql = case.sql().await;
    sql.batch_execute("create table unrelated (id bigserial primary key, body text)")
        .await
        .unwrap();
    let start = Instant::now();
    let mut written = 0u64;
    while start.elapsed() < Duration::from_secs(30) {
        sql.execute(
            "insert into unrelated (body) select repeat('x', 500) from generate_series(1, 200)",
            &[],
        )
        .await
        .unwrap();
        written += 200;
    }
    let wal_end: pgoutput::Lsn = sql
        .query_one("select pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
        .parse()
        .unwrap();
    let lag = eventually("the slot to confirm unrelated WAL", DEADLINE, || async {
        let confirmed = case.confirmed_flush_lsn(&sql).await;
        let lag = confirmed.bytes_until(wal_end);
        (lag < 4 * 1024 * 1024).then_some(lag)
    })
    .await;
    eprintln!("idle_wal: {written} unrelated rows in 30 s; slot lag behind WAL end {lag} bytes");
    drop(relay);
}

/// (h) A bad configuration value fails at start-up with a message naming it.
#[test]
fn bad_config_value_fails_at_startup_naming_the_key() {
    let case = new_case("bad_config");
    let mut command = case.relay_command("run");
    let stderr = exits_with(command.env("OUTBOX_RELAY_PARTITIONS", "twelve"), 2);
    assert!(
        stderr.contains("OUTBOX_RELAY_PARTITIONS") && stderr.contains("positive integer"),
        "{stderr}"
    );

    let mut command = case.relay_command("run");
    let stderr = exits_with(command.env("OUTBOX_RELAY_MAX_IN_FLIHGT", "10"), 2);
    assert!(
        stderr.contains("unknown environment variable OUTBOX_RELAY_MAX_IN_FLIHGT"),
        "{stderr}"
    );
}

/// (h) A table missing a column fails at start-up (a setup error: exit status 2) with a message naming the column.
#[test]
fn table_missing_a_column_fails_at_startup_naming_it() {
    let case = new_case("bad_table");
    servers().pg.psql(
        &case.database,
        "alter table outbox_events drop column event_type",
    );
    let stderr = case.relay_exits("run", 2);
    assert!(stderr.contains("missing column(s) event_type"), "{stderr}");

    let no_table = new_case("no_table");
    servers()
        .pg
        .psql(&no_table.database, "drop table outbox_events");
    let stderr = no_table.relay_exits("run", 2);
    assert!(
        stderr.contains(
            "table \"public\".\"outbox_events\" (read as schema \"public\", table \"outbox_events\") does not exist"
        ),
        "{stderr}"
    );
}

/// As a new user would: rows written exactly the way the seed's `seed.py` writes them
/// (placeholder key columns) arrive with the derived keys; with sql/trigger.sql installed
/// the table's key columns equal the published headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_style_rows_get_derived_keys_and_the_trigger_makes_table_and_wire_agree() {
    let case = new_case("seed_style");
    let relay = case.start_relay();
    let sql = case.sql().await;
    // seed.py, verbatim values.
    sql.execute(
        "insert into outbox_events(entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) values ($1,$2,$3,$4,$5,$6::text::jsonb)",
        &[&"order:A-1", &"OrderCreated", &"OrderCreated:order:A-1:tmp1", &"order:A-1", &"0000000000000:00000000000000000001", &r#"{"order_id": "A-1", "amount": 10}"#],
    )
    .await
    .unwrap();
    sql.execute(
        "insert into outbox_events(entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) values ($1,$2,$3,$4,$5,$6::text::jsonb)",
        &[&"order:A-1", &"OrderUpdated", &"OrderUpdated:order:A-1:tmp2", &"order:A-1", &"0000000000000:00000000000000000002", &r#"{"order_id": "A-1", "amount": 20}"#],
    )
    .await
    .unwrap();
    sql.batch_execute(support::TRIGGER_SQL).await.unwrap();
    // Odd but legal values: pre-1970, an event type NATS must escape, unicode.
    sql.batch_execute(
        "insert into outbox_events(entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) values
           ('заказ:7', 'order.refunded', 'x1', 'x', 'x', '{\"a\": 1}', '1969-12-31 23:59:59.9995+00'),
           ('tab\there', 'type> *', 'x2', 'x', 'x', '[]', '2026-11-30 09:30:42.174849+02')",
    )
    .await
    .unwrap();
    let js = case.jetstream().await;
    case.wait_for_count(&js, 4, DEADLINE).await;
    let messages = case.messages(&js).await;
    let table = rows(&sql).await;
    for (message, row) in messages.iter().zip(&table) {
        assert_matches_row(&case, message, row);
    }
    assert_eq!(
        messages[0].header("Nats-Msg-Id"),
        format!("OrderCreated:order:A-1:{}", table[0].id)
    );
    assert_eq!(
        messages[2].header("Outbox-Ordering-Key"),
        format!("-000000000001:{:020}", table[2].id)
    );
    let triggered = sql
        .query("select dedupe_key, partition_key, ordering_key from outbox_events where id > $1 order by id", &[&table[1].id])
        .await
        .unwrap();
    for (row, message) in triggered.iter().zip(&messages[2..]) {
        assert_eq!(row.get::<_, String>(0), message.header("Nats-Msg-Id"));
        assert_eq!(
            row.get::<_, String>(1),
            message.header("Outbox-Partition-Key")
        );
        assert_eq!(
            row.get::<_, String>(2),
            message.header("Outbox-Ordering-Key")
        );
    }
    drop(relay);
}

/// SIGTERM drains: exit 0, and the slot confirms the relayed transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_acks_and_confirms_before_exiting() {
    let case = new_case("sigterm");
    let Relayed {
        mut relay, sql, js, ..
    } = case.relay_transaction(500, 5, "before-term").await;
    let last_commit = case.messages(&js).await.last().unwrap().commit_lsn();
    let status = relay.terminate(DEADLINE);
    assert!(
        status.success(),
        "exit status {status:?}\n{}",
        relay.output()
    );
    assert!(
        case.confirmed_flush_lsn(&sql).await > last_commit,
        "the final status confirmed the relayed transaction"
    );
}

/// A dropped slot is not silently recreated when the stream already holds relayed events
/// (events committed meanwhile would be skipped); `outbox-relay init` recreates it deliberately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_not_silently_recreated_over_a_stream_with_history() {
    let case = new_case("dropped_slot");
    let Relayed {
        mut relay,
        mut sql,
        js,
        ..
    } = case.relay_transaction(5, 1, "history").await;
    assert!(relay.terminate(DEADLINE).success());
    sql.execute("select pg_drop_replication_slot($1)", &[&case.slot])
        .await
        .unwrap();

    let stderr = case.relay_exits("run", 1);
    assert!(
        stderr.contains("does not exist, but stream") && stderr.contains("outbox-relay init"),
        "{stderr}"
    );

    case.init();
    let relay = case.start_relay();
    insert_transaction(&mut sql, 1, 1, "after").await;
    case.wait_for_count(&js, 6, DEADLINE).await;
    drop(relay);
}

/// The whole path over TLS with SCRAM-SHA-256: `sslmode=verify-full` against the server's CA,
/// for the replication stream and the control connections alike; a wrong password is a
/// permanent error that does not print the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_over_tls_verify_full_with_scram() {
    let pg = Postgres::start_with(testkit::PgOptions {
        auth: testkit::PgAuth::Scram,
        password: Some("s3cret-pw".into()),
        tls: true,
        ..Default::default()
    });
    let mut case = Case::new(&pg, &servers().nats, "tls");
    let ca = pg.ca_cert_path().unwrap().display().to_string();
    case.pg_url = format!(
        "postgres://postgres:s3cret-pw@localhost:{}/{}?sslmode=verify-full&sslrootcert={ca}",
        pg.port(),
        case.database
    );
    let relay = case.start_relay();
    support::assert_relay_sessions_use_tls(&pg, &case);
    support::relay_one_row_as_superuser(&pg, &case).await;
    drop(relay);

    support::assert_wrong_password_fails_without_printing_it(&case, "s3cret-pw", "wrong-pw");
}

/// Strict mode converges when the stream's tail cannot tell what is stored (here another
/// writer's message is last): replayed events come back as duplicates, which consume no
/// sequence and so break the fence of the publishes behind them; the session learns how far
/// the stream holds every event and the next one skips it. Every row ends up stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_converges_when_the_tail_carries_no_position() {
    let case = new_case("no_position");
    let Interrupted {
        js,
        committed,
        stored_at_kill: stored,
        ..
    } = kill_relay_mid_backlog(&case, 20).await;
    // Another writer's message (no outbox position) becomes the tail.
    js.publish(format!("{}.foreign", case.prefix), "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let relay = case.start_relay();
    case.wait_for_count(&js, committed + 1, DEADLINE).await;
    let messages = case.messages(&js).await;
    let ours: Vec<_> = messages
        .iter()
        .filter(|m| m.headers.contains_key("Outbox-Id"))
        .collect();
    let keys: HashSet<&str> = ours.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(ours.len() as u64, committed, "every row once");
    assert_eq!(keys.len(), ours.len(), "no duplicates");
    assert!(
        relay
            .output()
            .contains("outbox_relay_tail_unreadable_total"),
        "the fallback was logged"
    );
    eprintln!("no_position: {stored} stored before the kill; {committed} rows stored once each after the restart");
}

/// LS2: a walsender still holding the slot (here `pg_recvlogical`, standing in for a dead
/// relay's connection Postgres has not noticed yet) is ended by the relay holding the lease,
/// which then streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_holder_ends_a_walsender_that_still_holds_the_slot() {
    let case = new_case("lingering");
    case.init();
    let pg = &servers().pg;
    let mut squatter = std::process::Command::new(pg.bin_dir().join("pg_recvlogical"));
    squatter.args([
        "-d",
        &case.pg_url,
        "--slot",
        &case.slot,
        "--start",
        "--no-loop",
        "-f",
        "/dev/null",
    ]);
    squatter.args([
        "-o",
        "proto_version=1",
        "-o",
        &format!("publication_names={}", case.publication),
    ]);
    let mut squatter = testkit::Process::spawn("pg_recvlogical", squatter);
    let sql = case.sql().await;
    eventually("pg_recvlogical to hold the slot", DEADLINE, || async {
        let row = sql
            .query_one(
                "select active from pg_replication_slots where slot_name = $1",
                &[&case.slot],
            )
            .await
            .unwrap();
        row.get::<_, bool>(0).then_some(())
    })
    .await;

    let relay = case.start_relay();
    relay.assert_output_contains("ended a walsender still holding the slot");
    let status = squatter.wait_exit(DEADLINE);
    assert!(!status.success(), "pg_recvlogical was disconnected");
    sql.batch_execute("insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) values ('e', 'T', 'x', '', '', '{}')")
        .await
        .unwrap();
    let js = case.jetstream().await;
    case.wait_for_count(&js, 1, DEADLINE).await;
}

/// Wrong permissions stop the relay at start with a message naming the missing privilege:
/// a role that is not the table's owner cannot create the publication; a role without
/// REPLICATION cannot create the slot or stream.
#[test]
fn wrong_permissions_fail_at_startup_naming_the_privilege() {
    let case = new_case("permissions");
    let pg = &servers().pg;
    pg.psql(
        &case.database,
        "create role plain login; grant select on outbox_events to plain;
         create role replicator login replication; grant select on outbox_events to replicator;",
    );
    let as_role = |role: &str, case: &Case| {
        let mut case = case.clone();
        case.pg_url =
            case.pg_url
                .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
        case
    };

    // Not the owner: the publication cannot be created.
    let stderr = as_role("plain", &case).relay_exits("run", 1);
    assert!(
        stderr.contains("cannot create the publication") && stderr.contains("sql/publication.sql"),
        "{stderr}"
    );

    // The owner created the publication (sql/publication.sql); still no REPLICATION.
    pg.psql(
        &case.database,
        &format!(
            "create publication {} for table outbox_events with (publish = 'insert')",
            case.publication
        ),
    );
    let stderr = as_role("plain", &case).relay_exits("run", 1);
    assert!(stderr.contains("REPLICATION"), "{stderr}");

    // With REPLICATION (and SELECT) it runs.
    let relay = as_role("replicator", &case).start_relay();
    drop(relay);
}

/// Issue 7 case 10: a database whose name holds a line break (Postgres allows it) is
/// relayed. The name reaches every message through `Outbox-Source`, where it once tripped
/// async-nats's header assertion and panicked the relay; it is percent-encoded now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_name_with_a_line_break_is_relayed() {
    let s = servers();
    let mut case = new_case("dbname");
    let database = format!("{}\nNats-Msg-Id: x", case.database);
    s.pg.create_database(&database);
    s.pg.psql(&database, support::SCHEMA_SQL);
    case.pg_url = s.pg.url(&database);
    case.database = database;
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 3, 2, "dbname").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 3, DEADLINE).await;
    let messages = case.messages(&js).await;
    let stored: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(stored, ids);
    let source = messages[0].header("Outbox-Source");
    assert!(
        source.contains("%0ANats%2DMsg%2DId:%20x/"),
        "the database name is percent-encoded in {source:?}"
    );
    assert!(!relay.output().contains("panicked"), "{}", relay.output());
}
