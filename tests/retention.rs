//! Issue 11 parts 3 and 4: `--mark-published` sets acknowledged rows `published` once each,
//! without feeding the UPDATEs back into the stream (even through a publication that
//! publishes updates), and refuses to start without the columns or the privilege;
//! `--retention-grace` deletes old rows only once the slot confirmed them, never a row whose
//! event JetStream has not acknowledged.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::partitioned_outbox_table;

use support::sql_value;

use std::collections::{HashMap, HashSet};
use support::{eventually, insert_transaction, servers, Case, DEADLINE};

/// Every id of the stream, each exactly once, and exactly `expected`.
async fn assert_each_once(
    case: &Case,
    js: &async_nats::jetstream::Context,
    expected: &HashSet<i64>,
) {
    let mut seen: HashMap<i64, usize> = HashMap::new();
    for id in case.outbox_ids(js).await {
        *seen.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    let ids: HashSet<i64> = seen.into_keys().collect();
    assert_eq!(
        &ids, expected,
        "the stream holds every relayed row, nothing else"
    );
}

/// (status, attempts, published_at is set) by id.
async fn marks(sql: &tokio_postgres::Client) -> HashMap<i64, (String, i32, bool)> {
    sql.query(
        "select id, status, attempts, published_at is not null from outbox_events",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|row| (row.get(0), (row.get(1), row.get(2), row.get(3))))
    .collect()
}

/// Waits until every row is marked published (and, with `count`, there are that many): on
/// timeout fails naming the rows not marked, with the relay's log. (This wait timed out once
/// in CI, 2026-12-06, with no more said; the next time says more.)
async fn wait_marked(
    sql: &tokio_postgres::Client,
    relay: &testkit::Process,
    count: Option<usize>,
    what: &str,
) {
    let start = std::time::Instant::now();
    loop {
        let marks = marks(sql).await;
        let mut unmarked: Vec<i64> = marks
            .iter()
            .filter(|(_, (status, _, _))| status != "published")
            .map(|(id, _)| *id)
            .collect();
        if unmarked.is_empty() && count.is_none_or(|n| marks.len() == n) {
            return;
        }
        if start.elapsed() > DEADLINE {
            unmarked.sort_unstable();
            panic!(
                "timed out after {DEADLINE:?} waiting for {what}: {} of {} rows not marked \
                 (first {:?}); the relay's log:\n{}",
                unmarked.len(),
                marks.len(),
                &unmarked[..unmarked.len().min(10)],
                relay.output()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Waits until the slot confirmed everything written so far (the marking UPDATEs included):
/// the relay decoded past them, so whatever they could have fed back would be stored.
async fn wait_confirmed_now(case: &Case, sql: &tokio_postgres::Client) {
    let now: String = sql_value(sql, "select pg_current_wal_insert_lsn()::text", &[]).await;
    let now: pgoutput::Lsn = now.parse().unwrap();
    eventually("the slot to confirm past the marking", DEADLINE, || async {
        (case.confirmed_flush_lsn(sql).await >= now).then_some(())
    })
    .await;
}

/// U1–U4: every relayed row ends `published` with `attempts` 1 and `published_at` set,
/// through a restart (the replay after it does not mark twice); the relay's publication is
/// the DBA's and publishes updates and deletes too, yet the stream holds each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_published_marks_each_relayed_row_once_and_nothing_feeds_back() {
    let servers = servers();
    let mut case = Case::new(&servers.pg, &servers.nats, "mark");
    servers.pg.psql(
        &case.database,
        &format!(
            "create publication {} for table outbox_events with (publish = 'insert, update, delete')",
            case.publication
        ),
    );
    case.set_env(&[("OUTBOX_RELAY_MARK_PUBLISHED", "true")]);
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    let mut ids = HashSet::new();
    for i in 0..20 {
        ids.extend(insert_transaction(&mut sql, 50, 7, &format!("a{i}")).await);
    }
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    wait_marked(&sql, &relay, None, "every relayed row to be marked").await;

    // A restart replays what was acknowledged but not yet confirmed: not marked twice.
    relay.terminate(DEADLINE);
    let relay = case.start_relay();
    for i in 0..5 {
        ids.extend(insert_transaction(&mut sql, 40, 7, &format!("b{i}")).await);
    }
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    let what = "the rows after the restart to be marked";
    wait_marked(&sql, &relay, Some(ids.len()), what).await;
    wait_confirmed_now(&case, &sql).await;
    for (id, (status, attempts, published_at)) in marks(&sql).await {
        assert_eq!(
            (status.as_str(), attempts, published_at),
            ("published", 1, true),
            "row {id}"
        );
    }
    assert_each_once(&case, &js, &ids).await;
    let marked = relay
        .output()
        .lines()
        .filter(|line| line.contains("cannot mark"))
        .count();
    assert_eq!(marked, 0, "no marking failed:\n{}", relay.output());
    eprintln!(
        "mark: {} rows marked once each, through a restart; the stream holds each once",
        ids.len()
    );
}

/// U5, RET6: without the columns, or without UPDATE on them (or, for retention, DELETE), the
/// relay refuses to start (exit 2) naming what is missing and the fix.
#[test]
fn mark_published_and_retention_refuse_to_start_without_the_columns_or_the_privilege() {
    let servers = servers();
    let case = Case::with_table(
        "mark_refused",
        "create role mark_reader login replication; grant select on outbox_events to mark_reader;",
        &[&[("OUTBOX_RELAY_MARK_PUBLISHED", "true")]],
    );
    let mut reader = case.clone();
    reader.pg_url = reader
        .pg_url
        .replacen("postgres://postgres@", "postgres://mark_reader@", 1);
    let stderr = reader.relay_exits("run", 2);
    assert!(
        stderr.contains("may not UPDATE (status), UPDATE (published_at), UPDATE (attempts)")
            && stderr.contains("GRANT UPDATE (status)"),
        "{stderr}"
    );

    // Retention needs DELETE.
    let mut retaining = reader.clone();
    retaining.extra_env = vec![("OUTBOX_RELAY_RETENTION_GRACE".into(), "7d".into())];
    let stderr = retaining.relay_exits("run", 2);
    assert!(
        stderr.contains("--retention-grace") && stderr.contains("GRANT DELETE ON"),
        "{stderr}"
    );

    servers.pg.psql(
        &case.database,
        "alter table outbox_events drop column attempts",
    );
    let stderr = case.relay_exits("run", 2);
    assert!(
        stderr.contains("no column attempts")
            && stderr.contains("ADD COLUMN attempts integer")
            && stderr.contains("--mark-published"),
        "{stderr}"
    );
    let slots: String = servers.pg.psql(
        &case.database,
        &format!(
            "select count(*) from pg_replication_slots where slot_name = '{}'",
            case.slot
        ),
    );
    assert_eq!(slots, "0", "the refusal comes before the slot is created");
}

/// RET1: with JetStream's acks held back (a black-holed proxy), rows past the grace period
/// whose events are not acknowledged survive every retention round; rows acknowledged
/// before are deleted; once the acks flow the held rows are stored and then deleted too; the
/// stream holds every event exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_confirmed_rows_and_never_an_unconfirmed_one() {
    const UNCONFIRMED: &str = "retention: the slot has not confirmed everything committed";
    let servers = servers();
    let mut case = Case::new(&servers.pg, &servers.nats, "retention");
    let proxy = case.nats_through_proxy(servers.nats.port());
    case.set_env(&[
        ("OUTBOX_RELAY_RETENTION_GRACE", "1s"),
        ("OUTBOX_RELAY_RETENTION_INTERVAL", "200ms"),
        ("OUTBOX_RELAY_ACK_TIMEOUT", "60s"),
    ]);
    let relay = case.start_relay();
    let mut writer = case.sql().await;
    let sql = case.sql().await;
    let js = support::jetstream_at(&servers.nats.url()).await;
    let mut confirmed = HashSet::new();
    for i in 0..3 {
        confirmed.extend(insert_transaction(&mut writer, 10, 3, &format!("old{i}")).await);
    }
    case.wait_for_count(&js, 30, DEADLINE).await;
    let present = |ids: Vec<i64>| {
        let sql = &sql;
        async move {
            let rows = sql
                .query("select id from outbox_events where id = any($1)", &[&ids])
                .await
                .unwrap();
            rows.iter()
                .map(|row| row.get::<_, i64>(0))
                .collect::<HashSet<i64>>()
        }
    };
    eventually("the confirmed old rows to be deleted", DEADLINE, || async {
        present(confirmed.iter().copied().collect())
            .await
            .is_empty()
            .then_some(())
    })
    .await;

    proxy.set_blackhole(true);
    let mut held = Vec::new();
    for i in 0..2 {
        held.extend(insert_transaction(&mut writer, 5, 3, &format!("held{i}")).await);
    }
    eventually("the held rows to pass the grace period", DEADLINE, || async {
        let old: bool = sql_value(
            &sql,
            "select bool_and(created_at < now() - interval '1 second') from outbox_events where id = any($1)",
            &[&held],
        )
        .await;
        old.then_some(())
    })
    .await;
    // Rounds that saw the held rows past the grace period, unconfirmed.
    let rounds_before = support::lines_with(&relay.output(), &[UNCONFIRMED]);
    eventually(
        "five retention rounds with the held rows old",
        DEADLINE,
        || async {
            (support::lines_with(&relay.output(), &[UNCONFIRMED]) >= rounds_before + 5)
                .then_some(())
        },
    )
    .await;
    let survivors = present(held.clone()).await;
    assert_eq!(
        survivors,
        held.iter().copied().collect::<HashSet<_>>(),
        "a row whose event JetStream has not acknowledged was deleted"
    );
    // (The proxy may pass the publishes on: JetStream may store the held events already,
    // but their acks do not reach the relay, which confirms nothing past them.)

    proxy.set_blackhole(false);
    case.wait_for_count(&js, 40, DEADLINE).await;
    eventually(
        "the held rows to be deleted once confirmed",
        DEADLINE,
        || async { present(held.clone()).await.is_empty().then_some(()) },
    )
    .await;
    let left: i64 = sql_value(&sql, "select count(*) from outbox_events", &[]).await;
    assert_eq!(left, 0);
    let mut all = confirmed;
    all.extend(held);
    assert_each_once(&case, &js, &all).await;
    relay.assert_output_contains("retention deleted old confirmed rows");
    eprintln!(
        "retention: 30 confirmed rows deleted; 10 held rows survived {} rounds past the grace period, then were stored once and deleted",
        support::lines_with(&relay.output(), &[UNCONFIRMED]) - rounds_before
    );
}

/// Retention with a short interval while something else in the cluster writes all the
/// time (another database: the other tests of a file, any busy server). Each round waits for
/// the slot to confirm the WAL position its snapshot saw; the relay reports progress at
/// most once a second, so a round that waited only its 200 ms interval never saw it and
/// nothing was ever deleted (the flaky marking-and-retention test in own_table_tools.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_while_the_cluster_is_written_all_the_time() {
    let servers = servers();
    let mut case = Case::new(&servers.pg, &servers.nats, "retention_busy");
    case.set_env(&[
        ("OUTBOX_RELAY_RETENTION_GRACE", "1s"),
        ("OUTBOX_RELAY_RETENTION_INTERVAL", "200ms"),
        ("OUTBOX_RELAY_MARK_PUBLISHED", "true"),
    ]);
    let busy = format!("{}_busy", case.database);
    servers.pg.create_database(&busy);
    let relay = case.start_relay();
    let busy_sql = support::sql_connect(&servers.pg.url(&busy)).await.unwrap();
    busy_sql
        .batch_execute("create table churn (n bigint)")
        .await
        .unwrap();
    // WAL in another database every few milliseconds, until the test ends.
    let churn = tokio::spawn(async move {
        loop {
            let _ = busy_sql.execute("insert into churn values (1)", &[]).await;
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    });
    let mut writer = case.sql().await;
    let sql = case.sql().await;
    let js = case.jetstream().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.extend(insert_transaction(&mut writer, 10, 3, &format!("busy{i}")).await);
    }
    case.wait_for_count(&js, 30, DEADLINE).await;
    eventually(
        "the old rows deleted while another database is written",
        DEADLINE,
        || async {
            let left: i64 = sql_value(
                &sql,
                "select count(*) from outbox_events where id = any($1)",
                &[&ids],
            )
            .await;
            (left == 0).then_some(())
        },
    )
    .await;
    churn.abort();
    let churned: i64 = support::sql_connect(&servers.pg.url(&busy))
        .await
        .unwrap()
        .query_one("select count(*) from churn", &[])
        .await
        .unwrap()
        .get(0);
    assert!(churned > 0, "the other database was written meanwhile");
    eprintln!("retention busy: 30 old rows deleted while another database took {churned} inserts");
    drop(relay);
}

/// A time-partitioned outbox: marking and retention work through the root. Rows from 2020
/// (past the grace period) are deleted from their partition once confirmed; today's rows
/// (within it) stay, marked `published` once each; the stream holds every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_and_retention_work_through_a_partitioned_tables_root() {
    let case = Case::with_table(
        "retention_partitioned",
        &(partitioned_outbox_table("primary key (id, created_at)", "created_at")
            + "create table outbox_events_2020 partition of outbox_events
                 for values from ('2020-01-01') to ('2021-01-01');
               create table outbox_events_rest partition of outbox_events default;"),
        &[&[
            ("OUTBOX_RELAY_MARK_PUBLISHED", "true"),
            ("OUTBOX_RELAY_RETENTION_GRACE", "1h"),
            ("OUTBOX_RELAY_RETENTION_INTERVAL", "200ms"),
        ]],
    );
    let relay = case.start_relay();
    let sql = case.sql().await;
    let insert = "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) \
                  select 'entity-' || (i % 3), 'OrderPaid', gen_random_uuid()::text, 'tmp', 'tmp', \
                         jsonb_build_object('n', i), $1::text::timestamptz \
                    from generate_series(1, $2::int) i returning id";
    let mut old = HashSet::new();
    let mut recent = HashSet::new();
    for _ in 0..3 {
        for row in sql
            .query(insert, &[&"2020-06-01 12:00:00+00", &20])
            .await
            .unwrap()
        {
            old.insert(row.get::<_, i64>(0));
        }
        for row in sql.query(insert, &[&"now", &10]).await.unwrap() {
            recent.insert(row.get::<_, i64>(0));
        }
    }
    let js = case.jetstream().await;
    let all: HashSet<i64> = old.union(&recent).copied().collect();
    case.wait_for_count(&js, all.len() as u64, DEADLINE).await;
    eventually("the 2020 partition to be emptied", DEADLINE, || async {
        let left: i64 = sql_value(&sql, "select count(*) from outbox_events_2020", &[]).await;
        (left == 0).then_some(())
    })
    .await;
    eventually("today's rows to be marked", DEADLINE, || async {
        let marks = marks(&sql).await;
        (marks.len() == recent.len() && marks.values().all(|(status, _, _)| status == "published"))
            .then_some(())
    })
    .await;
    wait_confirmed_now(&case, &sql).await;
    let marks = marks(&sql).await;
    assert_eq!(
        marks.keys().copied().collect::<HashSet<_>>(),
        recent,
        "today's rows stay"
    );
    for (id, mark) in marks {
        assert_eq!(mark, ("published".to_owned(), 1, true), "row {id}");
    }
    assert_each_once(&case, &js, &all).await;
    relay.assert_output_contains("retention deleted old confirmed rows");
}
