//! Issue 18 case 3: the outbox table dropped and created again, or swapped by rename (the
//! usual way to make it partitioned), under a running relay or while it was stopped, against
//! a real Postgres 15 and nats-server (`relay::process::identity` TI1–TI5).
//!
//! The publication names the old table's OID, so the new table's inserts are never decoded.
//! The relay notices on its identity check, stops with one error naming both OIDs and the
//! fix, and never confirms the slot past the first unrelayed insert; retention deletes none
//! of the new table's rows; the fix the message gives (the publication, `backfill`,
//! `verify`) leaves every row in the stream exactly once; and the conversion to a
//! partitioned table that docs/operations.md gives loses nothing.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::assert_contains_all;

use support::new_case;

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitStatus;
use std::time::Duration;

use pgoutput::Lsn;
use support::{insert_transaction, strip_ansi, succeeds, Case, DEADLINE, SCHEMA_SQL};
use testkit::Process;

/// How long a relay that must stop may take to exit: the identity is checked every second.
const EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// The outbox table's OID.
async fn table_oid(sql: &tokio_postgres::Client) -> u32 {
    sql.query_one("select 'outbox_events'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0)
}

/// Where the next WAL record goes.
async fn insert_lsn(sql: &tokio_postgres::Client) -> Lsn {
    sql.query_one("select pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get::<_, String>(0)
        .parse()
        .unwrap()
}

/// The ids in `table`.
async fn ids_in(sql: &tokio_postgres::Client, table: &str) -> BTreeSet<i64> {
    sql.query(&format!("select id from {table}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Drops the outbox table and creates it again (sql/schema.sql), its ids continuing where
/// the old table's stopped (`rows`: inserted in the same transaction, `created_at` an hour
/// ago).
fn drop_and_create_again(rows: usize) -> String {
    format!(
        "begin; \
         create temporary table last_id on commit drop as select coalesce(max(id), 0) as id from outbox_events; \
         drop table outbox_events; {SCHEMA_SQL}; \
         select setval('outbox_events_id_seq', (select id from last_id) + 1, false); \
         {} \
         commit;",
        old_rows(rows)
    )
}

/// A partitioned copy of the outbox table, `outbox_new`, sharing its id sequence.
const PARTITIONED_COPY: &str = "
    create table outbox_new (like outbox_events including defaults) partition by range (id);
    create table outbox_new_all partition of outbox_new for values from (minvalue) to (maxvalue);";

/// The rename swap that replaces the outbox table by `outbox_new`, the publication left as
/// it was.
const RENAME_SWAP: &str = "
    begin;
    alter table outbox_events rename to outbox_old;
    alter table outbox_new rename to outbox_events;
    commit;";

/// `rows` outbox rows written an hour ago (for retention), in SQL.
fn old_rows(rows: usize) -> String {
    if rows == 0 {
        return String::new();
    }
    format!(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) \
         select 'entity-' || n, 'OrderPaid', gen_random_uuid()::text, 'tmp', 'tmp', jsonb_build_object('n', n), \
                now() - interval '1 hour' \
           from generate_series(1, {rows}) n;"
    )
}

/// Waits for the relay to exit by itself; returns its status and output.
fn exited(relay: &mut Process) -> (ExitStatus, String) {
    let status = relay.wait_exit(EXIT_DEADLINE);
    (status, strip_ansi(&relay.output()))
}

/// The relay's final error line in `output`.
fn error_line(output: &str) -> String {
    output
        .lines()
        .find_map(|line| line.strip_prefix("outbox-relay: "))
        .unwrap_or_else(|| panic!("no error line in:\n{output}"))
        .to_owned()
}

/// Every id of the stream, by how many times it is there.
async fn stream_ids(case: &Case) -> BTreeMap<i64, usize> {
    let js = case.jetstream().await;
    let mut seen = BTreeMap::new();
    for id in case.outbox_ids(&js).await {
        *seen.entry(id).or_default() += 1;
    }
    seen
}

/// Asserts that the stream holds each of `relayed` once, and nothing else (`what` says why).
async fn assert_stream_holds_once(case: &Case, relayed: &[i64], what: &str) {
    let expected: BTreeMap<i64, usize> = relayed.iter().map(|id| (*id, 1)).collect();
    assert_eq!(stream_ids(case).await, expected, "{what}");
}

/// `outbox-relay verify`'s exit status, and what it printed.
fn verify(case: &Case) -> (Option<i32>, String) {
    let output = case.relay_command("verify").output().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// A relay streaming 3 rows, confirmed; returns it, the rows' ids and the table's OID.
async fn streaming(case: &Case, sql: &mut tokio_postgres::Client) -> (Process, Vec<i64>, u32) {
    let relay = case.start_relay();
    let js = case.jetstream().await;
    let relayed = insert_transaction(sql, 3, 3, "before").await;
    case.wait_confirmed(&js, sql, 3).await;
    (relay, relayed, table_oid(sql).await)
}

/// What a refused relay left: it exited with status 1 and one error that names the change
/// (`names`) and the fix, the stream holds `relayed` only, and the slot is confirmed no
/// further than `floor`, a position before the first unrelayed insert.
async fn assert_refused(
    case: &Case,
    sql: &tokio_postgres::Client,
    relay: &mut Process,
    names: &[String],
    relayed: &[i64],
    floor: Lsn,
) -> String {
    let (status, output) = exited(relay);
    assert_eq!(status.code(), Some(1), "{output}");
    let message = error_line(&output);
    for name in names {
        assert!(message.contains(name.as_str()), "{name:?} in {message}");
    }
    assert_contains_all(
        &message,
        [
            "outbox-relay verify",
            "outbox-relay backfill --from-id",
            "docs/operations.md",
        ],
    );
    assert_eq!(
        output
            .lines()
            .filter(|line| line.starts_with("outbox-relay: "))
            .count(),
        1,
        "one error: {output}"
    );
    assert_stream_holds_once(case, relayed, "only the rows relayed before the change").await;
    let confirmed = case.confirmed_flush_lsn(sql).await;
    assert!(
        confirmed <= floor,
        "the slot is confirmed at {confirmed}, past {floor}, before the first unrelayed insert"
    );
    message
}

/// The operator's fix, as the refusal gives it: the publication fixed in a transaction that
/// holds inserts back and reads the last id, `verify` (the hidden rows, `hidden`), `backfill
/// --from-id --to-id` them, the relay started again; then 2 more rows, and every row of
/// `tables` and `relayed` is in the stream exactly once, in order, and `verify` is
/// satisfied.
async fn fix_and_check(
    case: &Case,
    sql: &mut tokio_postgres::Client,
    hidden: &[i64],
    tables: &[&str],
    relayed: &[i64],
) {
    let last: i64 = sql
        .simple_query(&format!(
            "BEGIN; LOCK TABLE outbox_events IN SHARE MODE; \
             ALTER PUBLICATION {} ADD TABLE outbox_events; \
             SELECT max(id) FROM outbox_events; COMMIT;",
            case.publication
        ))
        .await
        .unwrap()
        .iter()
        .find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .unwrap();
    assert_eq!(last, hidden[hidden.len() - 1]);
    let (code, report) = verify(case);
    assert_eq!(code, Some(5), "verify lists the hidden rows: {report}");
    succeeds(
        case.relay_command("backfill")
            .args(["--from-id", &hidden[0].to_string()])
            .args(["--to-id", &last.to_string()])
            .arg("--force"),
    );
    let mut relay = case.start_relay();
    insert_transaction(sql, 2, 2, "after").await;
    let mut expected: BTreeSet<i64> = relayed.iter().copied().collect();
    for table in tables {
        expected.extend(ids_in(sql, table).await);
    }
    let js = case.jetstream().await;
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    relay.terminate(DEADLINE);
    assert_eq!(
        stream_ids(case).await,
        expected.iter().map(|id| (*id, 1)).collect(),
        "every row exactly once"
    );
    // Nothing missing or twice; backfilled rows carry commit LSN 0/0, which verify reports
    // as out of order when streamed rows of the same table precede them.
    let (code, report) = verify(case);
    assert!(
        code == Some(0) || report.contains(": 0 missing, 0 duplicated, 0 mismatched,"),
        "verify finds nothing missing: {report}"
    );
}

/// Under a running relay streaming 3 rows, `change` replaces the outbox table, and 5 rows
/// are inserted into the new one: the relay is refused naming both OIDs (`how` the table
/// changed) and the publication fix, nothing past the first new row is confirmed, and the
/// operator's fix leaves every row of `tables` in the stream once.
async fn replaced_under_a_running_relay(name: &str, change: &str, how: &str, tables: &[&str]) {
    let case = new_case(name);
    let mut sql = case.sql().await;
    let (mut relay, relayed, old_oid) = streaming(&case, &mut sql).await;

    sql.batch_execute(change).await.unwrap();
    let new_oid = table_oid(&sql).await;
    let floor = insert_lsn(&sql).await;
    let unrelayed = insert_transaction(&mut sql, 5, 5, "unrelayed").await;

    assert_refused(
        &case,
        &sql,
        &mut relay,
        &[
            format!(
                "table public.outbox_events is now OID {new_oid}, the relay streamed OID {old_oid} ({how})"
            ),
            format!(
                "BEGIN; LOCK TABLE \"public\".\"outbox_events\" IN SHARE MODE; ALTER PUBLICATION \"{}\" ADD TABLE \"public\".\"outbox_events\"; SELECT max(id) FROM \"public\".\"outbox_events\"; COMMIT;",
                case.publication
            ),
        ],
        &relayed,
        floor,
    )
    .await;
    fix_and_check(&case, &mut sql, &unrelayed, tables, &relayed).await;
}

/// (a) FOR TABLE publication: the table dropped and created again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_and_created_again_under_a_running_relay_is_refused_and_nothing_past_it_is_confirmed(
) {
    replaced_under_a_running_relay(
        "recreated",
        &drop_and_create_again(0),
        "dropped and created again, or swapped by rename",
        &["outbox_events"],
    )
    .await;
}

/// (b) The table renamed away and a partitioned copy renamed into its place, without the
/// publication knowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_swap_into_a_partitioned_table_under_a_running_relay_is_refused_and_nothing_past_it_is_confirmed(
) {
    replaced_under_a_running_relay(
        "swapped",
        &format!("{PARTITIONED_COPY} {RENAME_SWAP}"),
        "dropped and created again, or swapped by rename: now partitioned",
        &["outbox_old", "outbox_events"],
    )
    .await;
}

/// (c) With `--retention-grace`, retention deletes the relayed old rows, and none of a
/// recreated table's, not even rows older than the grace written with the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_none_of_a_recreated_tables_rows() {
    let mut case = new_case("retained");
    case.set_env(&[
        ("OUTBOX_RELAY_RETENTION_GRACE", "1s"),
        ("OUTBOX_RELAY_RETENTION_INTERVAL", "100ms"),
    ]);
    let mut sql = case.sql().await;
    let (mut relay, relayed, old_oid) = streaming(&case, &mut sql).await;
    // Retention works: the relayed rows go once older than the grace.
    support::eventually("retention to delete the relayed rows", DEADLINE, || async {
        ids_in(&sql, "outbox_events").await.is_empty().then_some(())
    })
    .await;

    let floor = insert_lsn(&sql).await;
    sql.batch_execute(&drop_and_create_again(5)).await.unwrap();
    let new_oid = table_oid(&sql).await;
    let written = ids_in(&sql, "outbox_events").await;
    assert_eq!(written.len(), 5);

    assert_refused(
        &case,
        &sql,
        &mut relay,
        &[format!(
            "is now OID {new_oid}, the relay streamed OID {old_oid}"
        )],
        &relayed,
        floor,
    )
    .await;
    assert_eq!(
        ids_in(&sql, "outbox_events").await,
        written,
        "retention deleted none of the new table's rows"
    );
}

/// The start-time variant: the relay stopped, the table dropped and created again, 5 rows
/// inserted; the relay refuses to start (exit 2: the publication does not cover the table)
/// with the fix, backfill and verify included, and confirms nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_created_again_while_the_relay_was_stopped_is_refused_at_start() {
    let case = new_case("recreated_stopped");
    let mut sql = case.sql().await;
    let (mut relay, relayed, _) = streaming(&case, &mut sql).await;
    relay.terminate(DEADLINE);
    let confirmed = case.confirmed_flush_lsn(&sql).await;

    sql.batch_execute(&drop_and_create_again(0)).await.unwrap();
    let unrelayed = insert_transaction(&mut sql, 5, 5, "unrelayed").await;

    let mut relay = case.spawn_relay();
    let (status, output) = exited(&mut relay);
    assert_eq!(status.code(), Some(2), "{output}");
    let message = error_line(&output);
    assert_contains_all(
        &message,
        [
            "does not publish public.outbox_events".to_owned(),
            format!(
                "ALTER PUBLICATION \"{}\" ADD TABLE \"public\".\"outbox_events\";",
                case.publication
            ),
            "outbox-relay verify".to_owned(),
            "outbox-relay backfill".to_owned(),
            "LOCK TABLE … IN SHARE MODE".to_owned(),
        ],
    );
    assert_eq!(case.confirmed_flush_lsn(&sql).await, confirmed);
    assert_stream_holds_once(&case, &relayed, "the rows relayed before, once each").await;
    fix_and_check(&case, &mut sql, &unrelayed, &["outbox_events"], &relayed).await;
}

/// docs/operations.md's conversion to a partitioned table: the partitioned copy added to
/// the publication (publish_via_partition_root) in the swap's transaction. The relay still
/// stops (it streamed another table), but nothing is missing: started again, it relays the
/// rows written since the swap from the slot, each once, with no backfill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_conversion_to_a_partitioned_table_loses_nothing() {
    let case = new_case("converted");
    let mut sql = case.sql().await;
    let (mut relay, relayed, old_oid) = streaming(&case, &mut sql).await;

    // docs/operations.md, "Converting the outbox table to a partitioned one", as given
    // (a DEFAULT partition for the test's dates).
    let publication = &case.publication;
    sql.batch_execute(&format!(
        "CREATE TABLE outbox_events_new (LIKE outbox_events INCLUDING DEFAULTS, \
                                         PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at); \
         CREATE TABLE outbox_events_rest PARTITION OF outbox_events_new DEFAULT; \
         ALTER SEQUENCE outbox_events_id_seq OWNED BY outbox_events_new.id; \
         BEGIN; \
         ALTER TABLE outbox_events RENAME TO outbox_events_old; \
         ALTER TABLE outbox_events_new RENAME TO outbox_events; \
         ALTER PUBLICATION {publication} ADD TABLE outbox_events; \
         ALTER PUBLICATION {publication} DROP TABLE outbox_events_old; \
         ALTER PUBLICATION {publication} SET (publish_via_partition_root = true); \
         COMMIT;"
    ))
    .await
    .unwrap();
    let new_oid = table_oid(&sql).await;
    let written = insert_transaction(&mut sql, 5, 5, "converted").await;

    let (status, output) = exited(&mut relay);
    assert_eq!(status.code(), Some(1), "{output}");
    let message = error_line(&output);
    assert!(
        message.contains(&format!(
            "is now OID {new_oid}, the relay streamed OID {old_oid}"
        )) && !message.contains("ADD TABLE"),
        "{message}"
    );

    let mut relay = case.start_relay();
    // The old table goes; the sequence, now the new table's, stays.
    sql.batch_execute("DROP TABLE outbox_events_old")
        .await
        .unwrap();
    insert_transaction(&mut sql, 2, 2, "after").await;
    let mut expected: BTreeSet<i64> = relayed.iter().copied().collect();
    expected.extend(written);
    expected.extend(ids_in(&sql, "outbox_events").await);
    let js = case.jetstream().await;
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    relay.terminate(DEADLINE);
    assert_eq!(
        stream_ids(&case).await,
        expected.iter().map(|id| (*id, 1)).collect(),
        "every row exactly once, without a backfill"
    );
    let (code, report) = verify(&case);
    assert_eq!(code, Some(0), "{report}");
}

/// The table dropped from the publication under a running relay: refused within seconds by
/// the start-up check's own message (exit status 2, PG3), nothing confirmed past the first
/// hidden insert, and the fix it gives leaves every row in the stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_from_the_publication_under_a_running_relay_is_refused_at_once() {
    let case = new_case("unpublished");
    let mut sql = case.sql().await;
    let (mut relay, relayed, _) = streaming(&case, &mut sql).await;

    sql.batch_execute(&format!(
        "alter publication {} drop table outbox_events",
        case.publication
    ))
    .await
    .unwrap();
    let floor = insert_lsn(&sql).await;
    let hidden = insert_transaction(&mut sql, 5, 5, "hidden").await;

    let (status, output) = exited(&mut relay);
    assert_eq!(status.code(), Some(2), "{output}");
    let message = error_line(&output);
    assert_contains_all(
        &message,
        [
            "does not publish public.outbox_events",
            "LOCK TABLE … IN SHARE MODE",
            "outbox-relay backfill",
        ],
    );
    assert!(case.confirmed_flush_lsn(&sql).await <= floor);
    assert_stream_holds_once(&case, &relayed, "the rows relayed before, once each").await;
    fix_and_check(&case, &mut sql, &hidden, &["outbox_events"], &relayed).await;
}

/// The table dropped from the publication and added again between two checks (here in one
/// transaction, with inserts between): the coverage alone cannot show it; the membership's
/// OID does, and the relay stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_from_the_publication_and_added_again_is_refused() {
    let case = new_case("readded");
    let mut sql = case.sql().await;
    let (mut relay, relayed, _) = streaming(&case, &mut sql).await;

    let publication = &case.publication;
    let floor = insert_lsn(&sql).await;
    sql.batch_execute(&format!(
        "alter publication {publication} drop table outbox_events; \
         {} \
         alter publication {publication} add table outbox_events;",
        old_rows(5)
    ))
    .await
    .unwrap();

    assert_refused(
        &case,
        &sql,
        &mut relay,
        &["it was removed from its publication and added again".to_owned()],
        &relayed,
        floor,
    )
    .await;
}
