//! End-to-end test of heartbeats (`--heartbeat-interval`, crate `heartbeat`), against a
//! private Postgres 15 cluster (testkit) so that another database of it can be written: a
//! quiet outbox database on a cluster whose other databases write. Two relays stream two
//! outbox databases of that cluster, one with heartbeats and one without; only a third
//! database is written, then nothing at all.
//!
//! What it shows (the figures are printed): while the other database writes, both slots'
//! lag (`pg_current_wal_lsn() - confirmed_flush_lsn`) stays bounded, heartbeats or not: the
//! walsender decodes (and filters out) the other database's WAL and reports its position in
//! keepalives, which the relay confirms (framer D3). So on Postgres 15 the relay does not
//! need heartbeats for this; they are kept for a walsender that has nothing to decode (then
//! the test shows the slot with heartbeats confirming new positions while nothing else
//! writes, and a test_decoding slot shows the heartbeat messages in that database and none
//! in the other).

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_value;

use std::time::{Duration, Instant};

use pgoutput::Lsn;
use support::{eventually, insert_transaction, servers, Case, DEADLINE};
use testkit::Postgres;

/// What the busy database writes per statement (about 1 MiB of WAL).
const FILLER_SQL: &str =
    "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 1000)";
/// Statements [`FILLER_SQL`] the busy database runs.
const WRITES: usize = 48;
/// The pause between two statements.
const PACE: Duration = Duration::from_millis(100);
/// The lag no slot may reach while the busy database writes (it writes more than this).
const GROWN: i64 = 32 << 20;
/// The lag every slot must come back under once the writes stop.
const BOUNDED: i64 = 1 << 20;

/// The slot's lag in bytes as the server sees it.
async fn lag(sql: &tokio_postgres::Client, slot: &str) -> i64 {
    sql.query_one(
        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_outbox_databases_slot_stays_bounded_while_other_databases_write_and_heartbeats_are_confirmed(
) {
    let pg = Postgres::start();
    let nats = &servers().nats;
    let quiet = Case::new(&pg, nats, "quiet");
    let mut beating = Case::new(&pg, nats, "beating");
    beating
        .extra_env
        .push(("OUTBOX_RELAY_HEARTBEAT_INTERVAL".into(), "1s".into()));
    pg.create_database("busy");
    pg.psql("busy", "CREATE TABLE filler (payload text)");

    // A test_decoding slot in each outbox database shows the heartbeat messages written there.
    for case in [&quiet, &beating] {
        pg.psql(
            &case.database,
            "SELECT pg_create_logical_replication_slot('watch_' || current_database(), 'test_decoding')",
        );
    }

    let _quiet_relay = quiet.start_relay();
    let _beating_relay = beating.start_relay();
    // Both relay an event of their own database: they stream and confirm.
    let js = quiet.jetstream().await;
    for case in [&quiet, &beating] {
        let mut sql = case.sql().await;
        insert_transaction(&mut sql, 1, 1, "first").await;
        case.wait_confirmed(&js, &sql, 1).await;
    }
    let sql = pg_sql(&pg).await;
    let quiet_before = lag(&sql, &quiet.slot).await;
    let beating_before = lag(&sql, &beating.slot).await;
    println!("before the writes: lag without heartbeats {quiet_before} B, with {beating_before} B");

    // Only the busy database writes, about WRITES MiB of WAL.
    let busy = testkit::harness::sql_connect(&pg.url("busy"))
        .await
        .unwrap();
    let started = Instant::now();
    let (mut quiet_max, mut beating_max) = (0, 0);
    for _ in 0..WRITES {
        busy.execute(FILLER_SQL, &[]).await.unwrap();
        quiet_max = quiet_max.max(lag(&sql, &quiet.slot).await);
        beating_max = beating_max.max(lag(&sql, &beating.slot).await);
        // A steady 10 MiB/s or so, not a burst the walsender must catch up with.
        tokio::time::sleep(PACE).await;
    }
    println!(
        "{WRITES} MiB written to another database in {:?}: lag at most {quiet_max} B without heartbeats, \
         {beating_max} B with",
        started.elapsed()
    );
    for (what, max) in [("without", quiet_max), ("with", beating_max)] {
        assert!(
            max < GROWN,
            "the slot {what} heartbeats fell {max} B behind while another database wrote {WRITES} MiB"
        );
    }
    // The writes stop: both slots confirm past them.
    for (what, case) in [("without", &quiet), ("with", &beating)] {
        let after = eventually(
            &format!("the slot {what} heartbeats to confirm past the other database's writes"),
            DEADLINE,
            || async {
                let lag = lag(&sql, &case.slot).await;
                (lag < BOUNDED).then_some(lag)
            },
        )
        .await;
        println!("writes stopped: the slot {what} heartbeats lags {after} B");
    }

    // Nothing writes any more but the heartbeats: the slot with them confirms past the
    // server's WAL end of now, within a few intervals.
    let now: String = sql_value(&sql, "SELECT pg_current_wal_lsn()::text", &[]).await;
    let now: Lsn = now.parse().unwrap();
    let confirmed = eventually(
        "the slot with heartbeats to confirm a heartbeat written after every other write",
        Duration::from_secs(30),
        || async {
            let confirmed = beating.confirmed_flush_lsn(&sql).await;
            (confirmed > now).then_some(confirmed)
        },
    )
    .await;
    println!("idle cluster: WAL end was {now}, the slot with heartbeats confirmed {confirmed}");

    // The heartbeats were written in the database whose relay has them on, and only there.
    let beats = heartbeats(&beating).await;
    let stray = heartbeats(&quiet).await;
    println!("heartbeat messages: {beats} in the beating database, {stray} in the quiet one");
    assert!(
        beats >= 2,
        "only {beats} heartbeats in {:?}",
        started.elapsed()
    );
    assert_eq!(
        stray, 0,
        "heartbeats written by the relay that has them off"
    );
}

/// The heartbeat messages written in `case`'s database, from its test_decoding slot.
async fn heartbeats(case: &Case) -> i64 {
    case.sql()
        .await
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_changes('watch_' || current_database(), NULL, NULL) \
              WHERE data LIKE 'message: transactional: 0 prefix: outbox-relay-heartbeat%'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn pg_sql(pg: &Postgres) -> tokio_postgres::Client {
    testkit::harness::sql_connect(&pg.url("postgres"))
        .await
        .unwrap()
}
