//! Partitioned outbox tables and publications the relay did not create, against a real
//! Postgres 15 and nats-server (shared by this binary's tests; each test has its own
//! database, slot, publication and stream).
//!
//! A publication that would hide an outbox insert is refused at every session start (exit
//! status 2, naming the publication, the problem and the exact SQL that fixes it; nothing
//! created, confirmed or published), and the SQL the message gives is run as given to show
//! that it fixes the problem. Inserts into partitions arrive as inserts into the table,
//! including those committed before the publication published partitions as the table.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_column;

use std::collections::{HashMap, HashSet};
use std::process::ExitStatus;
use std::time::Duration;

use support::{assert_matches_row, new_case, rows, servers, strip_ansi, Case, Row, DEADLINE};
use testkit::Process;

/// The seed's table, range-partitioned by `created_at` (a primary or unique key must
/// include the partition key), with partitions for 2020 and 2021.
const PARTITIONED: &str = "
    drop table outbox_events;
    create table outbox_events (
      id bigserial,
      entity_id text not null,
      event_type text not null,
      dedupe_key text not null,
      partition_key text not null,
      ordering_key text not null,
      payload jsonb not null,
      status text not null default 'pending',
      attempts integer not null default 0,
      last_error text,
      created_at timestamptz not null default now(),
      published_at timestamptz,
      primary key (id, created_at),
      unique (dedupe_key, created_at)
    ) partition by range (created_at);
    create table outbox_events_2020 partition of outbox_events
      for values from ('2020-01-01') to ('2021-01-01');
    create table outbox_events_2021 partition of outbox_events
      for values from ('2021-01-01') to ('2022-01-01');";

fn partitioned_case(name: &str) -> Case {
    let case = new_case(name);
    servers().pg.psql(&case.database, PARTITIONED);
    case
}

/// [`insert_rows`] into the outbox table itself (its partitions take the rows).
async fn insert_into_table(
    sql: &mut tokio_postgres::Client,
    created_at: &[&str],
    tag: &str,
) -> Vec<i64> {
    insert_rows(sql, "outbox_events", created_at, tag).await
}

/// Inserts one row per `created_at` into `target` (the table or one of its partitions) in
/// one transaction, seed-style; returns the ids in insert order.
async fn insert_rows(
    sql: &mut tokio_postgres::Client,
    target: &str,
    created_at: &[&str],
    tag: &str,
) -> Vec<i64> {
    let tx = sql.transaction().await.unwrap();
    let insert = format!(
        "insert into {target} (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) \
         values ('entity-' || ($1::int % 3), 'OrderPaid', gen_random_uuid()::text, 'tmp', 'tmp', \
                 jsonb_build_object('tag', $2::text, 'n', $1::int), $3::text::timestamptz) \
         returning id"
    );
    let mut ids = Vec::new();
    for (n, at) in created_at.iter().enumerate() {
        let row = tx
            .query_one(&insert, &[&(n as i32), &tag, at])
            .await
            .unwrap();
        ids.push(row.get(0));
    }
    tx.commit().await.unwrap();
    ids
}

/// Asserts that the stream holds exactly `expected` (ids in commit order), each once and
/// with the seed's keys for its row in `table`.
async fn assert_stream_is(case: &Case, expected: &[i64], table: &HashMap<i64, Row>) {
    let js = case.jetstream().await;
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    let messages = case.messages(&js).await;
    let ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(ids, expected, "every row once, in commit order");
    let keys: HashSet<&str> = messages.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(keys.len(), messages.len(), "each dedupe key once");
    for message in &messages {
        assert_matches_row(case, message, &table[&message.outbox_id()]);
    }
}

async fn table_rows(sql: &tokio_postgres::Client) -> HashMap<i64, Row> {
    rows(sql).await.into_iter().map(|r| (r.id, r)).collect()
}

/// How long a relay that must stop at start may take to exit.
const EXIT_DEADLINE: Duration = Duration::from_secs(20);

/// Runs `outbox-relay run` until it exits by itself (failing the test if it runs on);
/// returns its exit status and output.
fn run_to_exit(case: &Case) -> (ExitStatus, String) {
    let mut relay = Process::spawn(&format!("relay-{}", case.name), case.relay_command("run"));
    let status = relay.wait_exit(EXIT_DEADLINE);
    (status, strip_ansi(&relay.output()))
}

/// Runs `outbox-relay run`, expects it to refuse the publication (exit status 2, naming
/// it), and returns its error message.
fn refused(case: &Case) -> String {
    let (status, output) = run_to_exit(case);
    assert_eq!(status.code(), Some(2), "{output}");
    refusal_of(case, &output)
}

/// The relay's final error line in `output`, checked to refuse the case's publication.
fn refusal_of(case: &Case, output: &str) -> String {
    let message = output
        .lines()
        .find_map(|line| line.strip_prefix("outbox-relay: "))
        .unwrap_or_else(|| panic!("no error line in:\n{output}"));
    assert!(
        message.starts_with(&format!(
            "publication {:?} would hide inserts into public.outbox_events from the relay: it ",
            case.publication
        )),
        "{message}"
    );
    message.to_owned()
}

/// The SQL the refusal says to run.
fn fix_sql(message: &str) -> String {
    let start = message.find("To fix it, run ").expect("a fix to run") + "To fix it, run ".len();
    let end = message
        .find(" (or choose another OUTBOX_RELAY_PUBLICATION)")
        .unwrap();
    message[start..end].to_owned()
}

async fn slot_exists(case: &Case, sql: &tokio_postgres::Client) -> bool {
    sql.query_opt(
        "select 1 from pg_replication_slots where slot_name = $1",
        &[&case.slot],
    )
    .await
    .unwrap()
    .is_some()
}

/// PG1: a refused start created no slot and no stream, so it confirmed and published nothing.
async fn assert_nothing_created(case: &Case, sql: &tokio_postgres::Client) {
    assert!(!slot_exists(case, sql).await, "a slot was created");
    let js = case.jetstream().await;
    assert!(
        js.get_stream(&case.stream).await.is_err(),
        "a stream was created"
    );
}

/// Runs the refusal's fix as given, starts the relay and shows inserts flowing.
async fn fix_and_relay(case: &Case, sql: &mut tokio_postgres::Client, message: &str) -> Process {
    sql.batch_execute(&fix_sql(message)).await.unwrap();
    let relay = case.start_relay();
    let ids = insert_into_table(sql, &["2021-03-01", "2020-03-01"], "fixed").await;
    assert_stream_is(case, &ids, &table_rows(sql).await).await;
    relay
}

/// The publication, made as `create publication {name} {definition}`.
async fn create_publication(case: &Case, sql: &tokio_postgres::Client, definition: &str) {
    sql.batch_execute(&format!(
        "create publication {} {definition}",
        case.publication
    ))
    .await
    .unwrap();
}

/// A publication made as `definition` is refused at start naming `problem` and, as the
/// exact SQL to run, `fix` (`{p}` standing for the quoted publication name); nothing is
/// created; the fix, run as the message gives it, lets the relay go on.
async fn assert_refused_then_fixed(case: &Case, definition: &str, problem: &str, fix: &str) {
    let mut sql = case.sql().await;
    create_publication(case, &sql, definition).await;
    let message = refused(case);
    let fix = fix.replace("{p}", &format!("\"{}\"", case.publication));
    assert!(
        message.contains(problem) && message.contains(&format!("To fix it, run {fix} (or")),
        "{message}"
    );
    assert_nothing_created(case, &sql).await;
    drop(fix_and_relay(case, &mut sql, &message).await);
}

/// Inserts into two partitions (through the table, directly, and both in one transaction),
/// into a partition attached and one created while the relay runs (the attached one with
/// its columns in another order), and around a partition detached and dropped: every row
/// arrives once, with the seed's keys, in commit order; the row written into the detached
/// table (no longer an outbox insert) does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_outbox_table_relays_inserts_into_every_partition() {
    let case = partitioned_case("partitioned");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let mut committed = Vec::new();
    committed.extend(insert_into_table(&mut sql, &["2020-02-01"; 3], "2020").await);
    committed.extend(insert_into_table(&mut sql, &["2021-02-01"; 3], "2021").await);
    let both = ["2020-03-01", "2021-03-01", "2020-04-01", "2021-04-01"];
    committed.extend(insert_into_table(&mut sql, &both, "both").await);
    committed
        .extend(insert_rows(&mut sql, "outbox_events_2020", &["2020-05-01"; 2], "direct").await);

    sql.batch_execute(
        "create table outbox_events_2022 (
           created_at timestamptz not null default now(),
           payload jsonb not null,
           published_at timestamptz,
           last_error text,
           attempts integer not null default 0,
           status text not null default 'pending',
           ordering_key text not null,
           partition_key text not null,
           dedupe_key text not null,
           event_type text not null,
           entity_id text not null,
           id bigint not null default nextval('outbox_events_id_seq'));
         alter table outbox_events attach partition outbox_events_2022
           for values from ('2022-01-01') to ('2023-01-01');
         create table outbox_events_2023 partition of outbox_events
           for values from ('2023-01-01') to ('2024-01-01');",
    )
    .await
    .unwrap();
    committed.extend(insert_into_table(&mut sql, &["2022-02-01", "2023-02-01"], "attached").await);
    committed.extend(
        insert_rows(
            &mut sql,
            "outbox_events_2022",
            &["2022-03-01"; 2],
            "attached-direct",
        )
        .await,
    );
    committed.extend(
        insert_rows(
            &mut sql,
            "outbox_events_2023",
            &["2023-03-01"],
            "created-direct",
        )
        .await,
    );
    // The detached partition's rows leave the table: keep them for the comparison.
    let mut table = table_rows(&sql).await;

    sql.batch_execute("alter table outbox_events detach partition outbox_events_2020")
        .await
        .unwrap();
    insert_rows(&mut sql, "outbox_events_2020", &["2020-06-01"], "detached").await;
    committed
        .extend(insert_into_table(&mut sql, &["2021-05-01", "2022-05-01"], "after-detach").await);
    sql.batch_execute("drop table outbox_events_2020")
        .await
        .unwrap();
    committed
        .extend(insert_into_table(&mut sql, &["2023-05-01", "2021-06-01"], "after-drop").await);
    table.extend(table_rows(&sql).await);

    assert_stream_is(&case, &committed, &table).await;
    assert!(
        !relay.output().contains("session ended"),
        "the relay ran one session throughout:\n{}",
        relay.output()
    );
    eprintln!(
        "partitioned: {} rows in 10 transactions across 5 partitions relayed once each, in commit order",
        committed.len()
    );
}

/// The publication the relay creates publishes inserts only, partitions as the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publication_the_relay_creates_publishes_partitions_as_the_table() {
    let case = partitioned_case("created_publication");
    case.init();
    let sql = case.sql().await;
    let row = sql
        .query_one(
            "select pubviaroot, pubinsert, pubupdate or pubdelete or pubtruncate, puballtables \
               from pg_publication where pubname = $1",
            &[&case.publication],
        )
        .await
        .unwrap();
    let flags: (bool, bool, bool, bool) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        flags,
        (true, true, false, false),
        "publish_via_partition_root, inserts only, not all tables"
    );
    let tables: Vec<String> = sql_column(
        &sql,
        "select tablename::text from pg_publication_tables where pubname = $1",
        &[&case.publication],
    )
    .await;
    assert_eq!(tables, ["outbox_events"], "the table, not its partitions");
}

/// A publication of a partitioned table without publish_via_partition_root is refused
/// before anything is created; the SQL the message gives fixes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_publication_without_partition_root_is_refused() {
    assert_refused_then_fixed(
        &partitioned_case("no_via_root"),
        "for table outbox_events with (publish = 'insert')",
        "under each partition's name",
        "ALTER PUBLICATION {p} SET (publish_via_partition_root = true);",
    )
    .await;
}

/// How far the slot confirmed and how many messages the stream holds.
async fn progress(case: &Case, sql: &tokio_postgres::Client) -> (pgoutput::Lsn, u64) {
    let js = case.jetstream().await;
    (
        case.confirmed_flush_lsn(sql).await,
        case.stream_count(&js).await,
    )
}

/// A [`partitioned_case`] named `name` with a publication of the table `with (publish =
/// 'insert')` (partitions published under their own names) and the slot, created as
/// `sql/publication.sql` does; returns the case, a SQL connection and the [`progress`] then.
async fn published_by_partition(
    name: &str,
) -> (Case, tokio_postgres::Client, (pgoutput::Lsn, u64)) {
    let case = partitioned_case(name);
    let sql = case.sql().await;
    create_publication(
        &case,
        &sql,
        "for table outbox_events with (publish = 'insert')",
    )
    .await;
    sql.execute(
        "select pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&case.slot],
    )
    .await
    .unwrap();
    let before = progress(&case, &sql).await;
    (case, sql, before)
}

/// D5: inserts committed while the publication published partitions under their own names
/// (here: the relay refused to start meanwhile) still arrive so after the fix, because
/// Postgres decodes each transaction with the catalog of its commit. They are relayed as
/// inserts into the table, in commit order with what follows, and nothing was confirmed
/// while the relay refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_committed_before_publish_via_partition_root_are_relayed() {
    let (case, mut sql, before) = published_by_partition("before_via_root").await;
    let mut committed = insert_into_table(&mut sql, &["2020-02-01", "2021-02-01"], "before").await;
    committed.extend(
        insert_rows(
            &mut sql,
            "outbox_events_2021",
            &["2021-03-01"; 2],
            "before-direct",
        )
        .await,
    );

    let message = refused(&case);
    assert!(
        message.contains("publish_via_partition_root = true"),
        "{message}"
    );
    assert_eq!(
        progress(&case, &sql).await,
        before,
        "nothing confirmed or published"
    );

    sql.batch_execute(&fix_sql(&message)).await.unwrap();
    committed.extend(insert_into_table(&mut sql, &["2021-04-01", "2020-04-01"], "after").await);
    let relay = case.start_relay();
    assert_stream_is(&case, &committed, &table_rows(&sql).await).await;
    relay.assert_output_contains("arrive under the partition's own name");
}

/// D6: an insert committed before the fix into a partition dropped since arrives under a
/// name the relay cannot place: it stops naming it (never skips it) and confirms nothing
/// past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_into_a_partition_dropped_before_the_fix_stops_the_relay_naming_it() {
    let (case, mut sql, before) = published_by_partition("dropped_partition").await;
    insert_into_table(&mut sql, &["2020-02-01"], "lost-partition").await;
    sql.batch_execute(&format!(
        "alter table outbox_events detach partition outbox_events_2020;
         drop table outbox_events_2020;
         alter publication {} set (publish_via_partition_root = true);",
        case.publication
    ))
    .await
    .unwrap();

    let (status, stderr) = run_to_exit(&case);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr
            .contains("an insert into public.outbox_events_2020, in the transaction committed at")
            && stderr.contains("The relay stops rather than skip it"),
        "{stderr}"
    );
    assert_eq!(
        progress(&case, &sql).await,
        before,
        "nothing confirmed or published"
    );
}

/// A publication of some partitions, not the table, is refused naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_covering_only_leaves_is_refused() {
    assert_refused_then_fixed(
        &partitioned_case("leaves_only"),
        "for table outbox_events_2020, outbox_events_2021 \
         with (publish = 'insert', publish_via_partition_root = true)",
        "publishes only partitions of public.outbox_events (public.outbox_events_2020, \
         public.outbox_events_2021), not the table itself",
        "ALTER PUBLICATION {p} ADD TABLE \"public\".\"outbox_events\";",
    )
    .await;
}

/// A row filter would hide the rows it excludes: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_filtered_publication_is_refused() {
    assert_refused_then_fixed(
        &new_case("row_filter"),
        "for table outbox_events where (event_type <> 'Hidden') with (publish = 'insert')",
        "row filter WHERE (event_type <> 'Hidden'::text)",
        RELIST,
    )
    .await;
}

/// A column list without a column the relay reads: refused naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_list_omitting_a_read_column_is_refused() {
    assert_refused_then_fixed(
        &new_case("column_list"),
        "for table outbox_events (id, entity_id, event_type, created_at, status) \
         with (publish = 'insert')",
        "without payload, which the relay reads",
        RELIST,
    )
    .await;
}

/// A column list of exactly the columns the relay reads (what docs/operations.md suggests to
/// spare the walsender the polling publisher's columns): accepted, and every row is relayed
/// with the seed's keys, each once, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_list_of_the_read_columns_is_accepted_and_relays_every_row() {
    let case = new_case("read_columns");
    let mut sql = case.sql().await;
    create_publication(
        &case,
        &sql,
        "for table outbox_events (id, entity_id, event_type, payload, created_at) \
         with (publish = 'insert')",
    )
    .await;
    let relay = case.start_relay();
    let mut ids = insert_into_table(&mut sql, &["2021-01-01", "2021-02-01"], "a").await;
    ids.extend(insert_into_table(&mut sql, &["2021-03-01"], "b").await);
    assert_stream_is(&case, &ids, &table_rows(&sql).await).await;
    drop(relay);
}

/// A publication of updates and deletes but not inserts: refused; the fix keeps the
/// other actions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_without_insert_is_refused() {
    assert_refused_then_fixed(
        &new_case("no_insert"),
        "for table outbox_events with (publish = 'update, delete')",
        "does not publish inserts (publish = 'update, delete')",
        "ALTER PUBLICATION {p} SET (publish = 'insert, update, delete');",
    )
    .await;
}

/// The statement that re-adds the table without its row filter or column list.
const RELIST: &str = "BEGIN; ALTER PUBLICATION {p} DROP TABLE \"public\".\"outbox_events\"; \
                      ALTER PUBLICATION {p} ADD TABLE \"public\".\"outbox_events\"; COMMIT;";

/// The publication checks run at every session start, not only when the relay created the
/// publication: each way of hiding inserts, applied to the relay's own publication after it
/// ran fine, is refused at the next session (of the running process, or of a restarted
/// one) without confirming or publishing anything; the fix it names lets the relay go on,
/// and in the end every row is in the stream once, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_changed_under_a_relay_is_refused_at_its_next_session_start() {
    let case = partitioned_case("changed_publication");
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut committed = insert_into_table(&mut sql, &["2020-02-01", "2021-02-01"], "first").await;
    case.wait_for_count(&js, committed.len() as u64, DEADLINE)
        .await;

    let publication = &case.publication;
    let changes = [
        (
            format!("alter publication {publication} set (publish_via_partition_root = false)"),
            "under each partition's name",
        ),
        (
            format!("alter publication {publication} set table outbox_events_2020, outbox_events_2021"),
            "publishes only partitions of public.outbox_events",
        ),
        (
            format!("alter publication {publication} set table outbox_events where (event_type <> 'Hidden')"),
            "row filter WHERE (event_type <> 'Hidden'::text)",
        ),
        (
            format!("alter publication {publication} set table outbox_events (id, entity_id, event_type, created_at)"),
            "without payload, which the relay reads",
        ),
        (
            format!("alter publication {publication} set (publish = 'update')"),
            "does not publish inserts (publish = 'update')",
        ),
    ];
    for (i, (change, problem)) in changes.iter().enumerate() {
        let (message, before) = if i == 0 {
            // A new session of the same process: end its walsender (and wait for it to go).
            // The running session's identity watch (relay::process::identity TI3) may see the change
            // first and refuse it with the same check: either way, exit status 2 and PG3's
            // message.
            sql.batch_execute(change).await.unwrap();
            sql.execute(
                "select pg_terminate_backend(active_pid, 30000) from pg_replication_slots where slot_name = $1",
                &[&case.slot],
            )
            .await
            .unwrap();
            let before = progress(&case, &sql).await;
            let status = relay.wait_exit(DEADLINE);
            let output = strip_ansi(&relay.output());
            assert_eq!(status.code(), Some(2), "{output}");
            (refusal_of(&case, &output), before)
        } else {
            // A restart.
            assert!(relay.terminate(DEADLINE).success());
            sql.batch_execute(change).await.unwrap();
            let before = progress(&case, &sql).await;
            (refused(&case), before)
        };
        assert!(message.contains(problem), "{change}: {message}");
        assert_eq!(
            progress(&case, &sql).await,
            before,
            "{change}: nothing confirmed or published"
        );

        sql.batch_execute(&fix_sql(&message)).await.unwrap();
        relay = case.start_relay();
        let tag = format!("after-fix-{i}");
        committed.extend(insert_into_table(&mut sql, &["2021-03-01", "2020-03-01"], &tag).await);
        case.wait_for_count(&js, committed.len() as u64, DEADLINE)
            .await;
    }
    assert_stream_is(&case, &committed, &table_rows(&sql).await).await;
    drop(relay);
}

/// A publication that also publishes other tables (one of them shaped like the outbox) is
/// accepted, with a line saying what it costs; only the outbox table's inserts are relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_that_also_publishes_other_tables_is_accepted() {
    let case = new_case("other_tables");
    let mut sql = case.sql().await;
    sql.batch_execute(
        "create table orders (id bigserial primary key, total bigint);
         create table other_outbox (like outbox_events including all);",
    )
    .await
    .unwrap();
    create_publication(
        &case,
        &sql,
        "for table outbox_events, orders, other_outbox \
         with (publish = 'insert, update, delete, truncate', publish_via_partition_root = true)",
    )
    .await;
    let relay = case.start_relay();
    relay.assert_output_contains("the publication also publishes other tables");
    sql.batch_execute("insert into orders (total) values (1), (2); update orders set total = 3")
        .await
        .unwrap();
    insert_rows(&mut sql, "other_outbox", &["2021-01-01"], "other").await;
    let ids = insert_into_table(&mut sql, &["2021-02-01", "2021-03-01"], "ours").await;
    assert_stream_is(&case, &ids, &table_rows(&sql).await).await;
    drop(relay);
}
