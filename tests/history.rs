//! WAL histories (I6, issue 7 case 5): the stream's tail is used to skip replayed events
//! only when it belongs to the server's own history. A restore from an older backup, or a
//! fail-over that starts a new timeline, reuses LSNs: a tail from the lost history must
//! never make the relay skip the new history's events. But what a promotion keeps of the old
//! timeline, below the switch point its timeline history names, is the new history too
//! (sink::resume S5): a tail there is used to skip. These tests stop, restore and promote
//! their own Postgres.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_value;

use std::time::Duration;

use pgoutput::Lsn;
use support::{eventually, insert_transaction, wal_lsn, Case, Stored, DEADLINE};
use testkit::{Nats, Postgres, Proxy};

/// Rows the lost history relays: enough WAL that its tail lies well beyond what the new
/// history writes before the relay starts again.
const LOST_ROWS: usize = 3_000;
/// Rows of the new history, written before the relay restarts.
const NEW_ROWS: usize = 20;

/// Which way the history is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Restore {
    /// Back to a cold backup, same timeline: the tail lies beyond the WAL end.
    SameTimeline,
    /// Back to a cold backup, then promoted: timeline 2, WAL end pushed past the tail. The old
    /// primary wrote past the switch point (the lost rows, as async replication loses WAL):
    /// the tail lies past it, on timeline 1 (S5).
    NewTimeline,
    /// Back to a cold backup, same timeline, then written past the old tail before the
    /// relay restarts (issue 18 case 1): same source, WAL end beyond the tail, the tail's
    /// outbox id reused by a new row; only the rows tell the histories apart.
    WrittenPastTheTail,
}

/// Takes a cold backup of `pg` (stopped for it), then relays the history a restore of it
/// loses: [`LOST_ROWS`] more rows, until the stream holds `total` messages and the slot
/// confirmed them. Returns the backup and the stream's tail (its last commit), the relay
/// stopped.
async fn back_up_then_relay_the_lost_history(
    pg: &mut Postgres,
    case: &Case,
    js: &async_nats::jetstream::Context,
    total: usize,
) -> (testkit::Backup, Lsn) {
    pg.stop();
    let backup = pg.backup();
    pg.start_again();

    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, LOST_ROWS, 7, "lost").await;
    case.wait_confirmed(js, &sql, total as u64).await;
    relay.terminate(DEADLINE);
    let tail = case.messages(js).await.last().unwrap().commit_lsn();
    (backup, tail)
}

/// Relays some rows, takes a cold backup, relays `LOST_ROWS` more (the stream's tail now
/// lies in that history), restores the backup as `restore` says, writes `NEW_ROWS` rows
/// with keys of their own, and checks that the restarted relay publishes every one of them.
async fn relay_after_losing_history(restore: Restore) {
    let mut pg = Postgres::start();
    let nats = Nats::start();
    let case = Case::new(&pg, &nats, "history");
    let js = case.jetstream().await;

    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 10, 3, "kept").await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    relay.terminate(DEADLINE);
    drop(sql);
    let (backup, tail) =
        back_up_then_relay_the_lost_history(&mut pg, &case, &js, 10 + LOST_ROWS).await;

    pg.stop();
    pg.restore(&backup);
    match restore {
        Restore::SameTimeline | Restore::WrittenPastTheTail => pg.start_again(),
        Restore::NewTimeline => pg.start_on_new_timeline(),
    }
    let sql = case.sql().await;
    if restore == Restore::WrittenPastTheTail {
        relay_after_writing_past_the_tail(&case, &js, &sql, tail).await;
        return;
    }
    let new_ids = insert_after_restore(&sql, NEW_ROWS).await;
    let last_new_commit = wal_lsn(&sql).await;
    assert!(
        last_new_commit < tail,
        "the new history's events ({last_new_commit}) must lie below the lost tail ({tail}) for this test to mean anything"
    );
    if restore == Restore::NewTimeline {
        // Past the tail, so only the timeline tells the histories apart.
        sql.batch_execute("create table filler (n int)")
            .await
            .unwrap();
        eventually("the WAL end to pass the lost tail", DEADLINE, || async {
            sql.batch_execute("insert into filler select generate_series(1, 20000)")
                .await
                .unwrap();
            (wal_lsn(&sql).await > tail).then_some(())
        })
        .await;
        let timeline: i32 =
            sql_value(&sql, "select timeline_id from pg_control_checkpoint()", &[]).await;
        let current: String =
            sql_value(&sql, "select pg_walfile_name(pg_current_wal_lsn())", &[]).await;
        assert!(
            current.starts_with("00000002"),
            "a new timeline (WAL file {current}, checkpoint timeline {timeline})"
        );
    }

    let relay = case.start_relay();
    let expected = 10 + LOST_ROWS + NEW_ROWS;
    case.wait_for_count(&js, expected as u64, DEADLINE).await;
    let messages = case.messages(&js).await;
    assert_eq!(
        after_restore(&messages),
        new_ids,
        "every event of the new history, once, in order"
    );
    let output = relay.output();
    let why = match restore {
        Restore::NewTimeline => "at or past the point where this server's history left it",
        _ => "beyond the server's WAL end",
    };
    assert!(
        output.contains(why),
        "the relay says why it does not skip by the tail ({why}):\n{output}"
    );
    eprintln!(
        "{restore:?}: tail of the lost history at {tail}, new history's {NEW_ROWS} events below it all published"
    );
}

/// After the restore (same timeline): rows of the new history in small transactions until
/// the WAL end lies past the lost tail and the tail's outbox id names a new row, so that new
/// events lie on both sides of the tail's position. The restarted relay must publish every
/// one of them once, in order: before the replay was compared with the stream (`sink::resume`
/// S4), every new event at or below the tail was skipped and confirmed.
async fn relay_after_writing_past_the_tail(
    case: &Case,
    js: &async_nats::jetstream::Context,
    sql: &tokio_postgres::Client,
    tail: Lsn,
) {
    let lost = case.messages(js).await;
    let tail_id = lost.last().unwrap().outbox_id();
    let mut new_ids: Vec<i64> = Vec::new();
    let (mut below, mut above) = (0, 0);
    while wal_lsn(sql).await <= tail || new_ids.last().is_none_or(|&id| id < tail_id) {
        new_ids.extend(insert_after_restore(sql, 10).await);
        if wal_lsn(sql).await <= tail {
            below += 1;
        } else {
            above += 1;
        }
    }
    assert!(
        below > 0 && above > 0,
        "new transactions on both sides of the lost tail ({below} below, {above} above)"
    );

    let relay = case.start_relay();
    let expected = lost.len() + new_ids.len();
    case.wait_for_count(js, expected as u64, DEADLINE).await;
    let messages = case.messages(js).await;
    assert_eq!(
        after_restore(&messages),
        new_ids,
        "every event of the new history, once, in order"
    );
    let output = relay.output();
    assert!(
        output.contains("the stream does not hold this replayed event at its place"),
        "the relay says why it does not skip by the tail:\n{output}"
    );
    eprintln!(
        "WrittenPastTheTail: tail of the lost history at {tail} (outbox id {tail_id}); {} new events ({below} transactions below it, {above} above) all published once",
        new_ids.len()
    );
}

/// Inserts `rows` rows of the new history (event type `AfterRestore`, keys of their own) in
/// one transaction; returns their ids.
async fn insert_after_restore(sql: &tokio_postgres::Client, rows: usize) -> Vec<i64> {
    sql.query(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         select 'restored-' || i, 'AfterRestore', 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', '{}'::jsonb \
           from generate_series(1, $1::int) as i returning id",
        &[&(rows as i32)],
    )
    .await
    .unwrap()
    .iter()
    .map(|row| row.get(0))
    .collect()
}

/// The outbox ids of the new history's events, in stream order.
fn after_restore(messages: &[Stored]) -> Vec<i64> {
    messages
        .iter()
        .filter(|m| m.header("Outbox-Event-Type") == "AfterRestore")
        .map(Stored::outbox_id)
        .collect()
}

/// A tail beyond the server's WAL end (a database restored from an older backup) is not
/// used to skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_beyond_the_wal_end_is_not_used_to_skip() {
    relay_after_losing_history(Restore::SameTimeline).await;
}

/// A tail from an earlier timeline past the switch point (the old primary wrote WAL the
/// promoted server never received) is not used to skip (S5), even once the new timeline's WAL
/// has passed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_from_another_timeline_is_not_used_to_skip() {
    relay_after_losing_history(Restore::NewTimeline).await;
}

/// A database restored from a cold backup and written past the old tail before the relay
/// restarts (issue 18 case 1): the tail has the session's own source and lies below the WAL
/// end, but its outbox id now names another row; it is not used to skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_of_a_restored_database_written_past_it_is_not_used_to_skip() {
    relay_after_losing_history(Restore::WrittenPastTheTail).await;
}

/// Rows relayed before the promotion in [`tail_below_the_switch_point_of_a_promotion_is_used_to_skip`].
const KEPT_ROWS: usize = 300;

/// A promotion that kept everything the relay published (a clean switch-over, or a standby
/// that had received it all): the stream's tail, on timeline 1, lies below the switch point of
/// timeline 2's history, so it is the new timeline's history too (S5). The slot is rewound to
/// before those rows (a copy taken earlier) and the duplicate window has passed, so only the
/// tail's position can keep the replayed events out of the stream: each is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_below_the_switch_point_of_a_promotion_is_used_to_skip() {
    let mut pg = Postgres::start();
    let nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "promoted");
    case.set_env(&[("OUTBOX_RELAY_DUPLICATE_WINDOW", "1s")]);
    let js = case.jetstream().await;

    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let behind = format!("{}_behind", case.slot);
    sql.execute(
        "select pg_copy_logical_replication_slot($1, $2)",
        &[&case.slot, &behind],
    )
    .await
    .unwrap();
    let mut ids = insert_transaction(&mut sql, KEPT_ROWS, 7, "kept").await;
    case.wait_for_count(&js, KEPT_ROWS as u64, DEADLINE).await;
    relay.terminate(DEADLINE);
    let tail = case.messages(&js).await.last().unwrap().commit_lsn();
    drop(sql);

    pg.stop();
    pg.start_on_new_timeline();
    let mut sql = case.sql().await;
    let history = pg.psql("postgres", "select pg_walfile_name(pg_current_wal_lsn())");
    assert!(
        history.trim().starts_with("00000002"),
        "timeline 2: {history}"
    );
    // Rewind the slot to before the kept rows: the relay replays all of them.
    sql.execute("select pg_drop_replication_slot($1)", &[&case.slot])
        .await
        .unwrap();
    sql.execute(
        "select pg_copy_logical_replication_slot($1, $2)",
        &[&behind, &case.slot],
    )
    .await
    .unwrap();
    sql.execute("select pg_drop_replication_slot($1)", &[&behind])
        .await
        .unwrap();
    assert!(case.confirmed_flush_lsn(&sql).await < tail);
    ids.extend(insert_transaction(&mut sql, NEW_ROWS, 3, "promoted").await);
    let last_commit = wal_lsn(&sql).await;
    // Past the duplicate window, so that de-duplication cannot hide a re-sent event: the
    // condition waited for is the window's age itself.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let relay = case.start_relay();
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    eventually("the slot to confirm the new rows", DEADLINE, || async {
        (case.confirmed_flush_lsn(&sql).await >= last_commit).then_some(())
    })
    .await;
    assert_eq!(
        case.outbox_ids(&js).await,
        ids,
        "every event once, in order, across the promotion"
    );
    let output = relay.output();
    assert!(
        !output.contains("not skipping by"),
        "the tail below the switch point is trusted:\n{output}"
    );
    eprintln!(
        "promotion: tail at {tail} on timeline 1, below the switch point; {KEPT_ROWS} events replayed on timeline 2 skipped, {NEW_ROWS} new ones published once"
    );
}

/// A database restored from a cold backup that holds events the relay published but the slot
/// had not confirmed (the model checker's finding MF1, `crates/model`): the stream's tail, of the
/// lost history, lies beyond the restored server's WAL end. The restored history replays those
/// events unchanged; they are compared with the stream and skipped (`sink::resume` S1, S4), so
/// nothing is stored twice although the duplicate window passed long ago, and the new
/// history's rows are published once after the tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_replaying_unconfirmed_events_the_stream_holds_stores_none_twice() {
    const UNCONFIRMED: usize = 20;
    let mut pg = Postgres::start();
    let nats = Nats::start();
    let proxy = Proxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], nats.port())));
    let mut case = Case::new(&pg, &nats, "restore_unconfirmed");
    case.extra_env.extend([
        ("OUTBOX_RELAY_DUPLICATE_WINDOW".into(), "1s".into()),
        ("OUTBOX_RELAY_ACK_TIMEOUT".into(), "60s".into()),
    ]);
    let proxied = Case {
        nats_url: format!("nats://127.0.0.1:{}", proxy.port()),
        ..case.clone()
    };
    let js = case.jetstream().await;
    let mut relay = proxied.start_relay();
    let mut sql = case.sql().await;
    let mut ids = insert_transaction(&mut sql, 10, 3, "kept").await;
    case.wait_confirmed(&js, &sql, 10).await;
    // Stored, never acknowledged to the relay: never confirmed.
    proxy.set_blackhole(true);
    let unconfirmed = insert_transaction(&mut sql, UNCONFIRMED, 3, "unconfirmed").await;
    case.wait_for_count(&js, (10 + UNCONFIRMED) as u64, DEADLINE)
        .await;
    tokio::task::block_in_place(|| relay.kill());
    proxy.set_blackhole(false);
    let commit = case.messages(&js).await.last().unwrap().commit_lsn();
    assert!(case.confirmed_flush_lsn(&sql).await <= commit);
    ids.extend(&unconfirmed);
    drop(sql);
    // The history the restore loses: enough WAL that its tail lies beyond the restored end.
    let lost_total = 10 + UNCONFIRMED + LOST_ROWS;
    let (backup, tail) = back_up_then_relay_the_lost_history(&mut pg, &case, &js, lost_total).await;
    pg.stop();
    pg.restore(&backup);
    pg.start_again();

    let sql = case.sql().await;
    let new_ids = insert_after_restore(&sql, NEW_ROWS).await;
    assert!(
        wal_lsn(&sql).await < tail,
        "the lost tail ({tail}) must lie beyond the restored server's WAL end"
    );
    let relay = case.start_relay();
    case.wait_for_count(&js, (lost_total + NEW_ROWS) as u64, DEADLINE)
        .await;
    eventually("the slot to confirm the new rows", DEADLINE, || async {
        let last = case.messages(&js).await.last()?.commit_lsn();
        (case.confirmed_flush_lsn(&sql).await > last).then_some(())
    })
    .await;
    let messages = case.messages(&js).await;
    assert_eq!(
        messages.len(),
        lost_total + NEW_ROWS,
        "the {UNCONFIRMED} events the restored history replays are not stored again"
    );
    let before: Vec<i64> = messages[..10 + UNCONFIRMED]
        .iter()
        .map(Stored::outbox_id)
        .collect();
    assert_eq!(before, ids);
    assert_eq!(
        after_restore(&messages),
        new_ids,
        "the new history once, in order"
    );
    let output = relay.output();
    // The slot the backup holds may have confirmed less than the relay sent (it is persisted
    // at checkpoints): the comparison covers at least the unconfirmed events.
    let vouched: usize = output
        .split("vouched=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        output.contains("beyond the server's WAL end") && vouched >= UNCONFIRMED,
        "the tail beyond the WAL end is reported and the replay compared with the stream \
         ({vouched} vouched):\n{output}"
    );
    eprintln!(
        "restore with unconfirmed events: the lost tail at {tail} beyond the WAL end; {UNCONFIRMED} replayed events skipped as stored, {NEW_ROWS} new ones published once"
    );
}
