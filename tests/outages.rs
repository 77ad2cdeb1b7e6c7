//! Server outages under a running relay: nats-server stopped (nothing confirmed past what
//! JetStream stored; everything arrives when it returns) and Postgres crashed (the relay
//! reconnects and resumes from the slot). These tests stop servers, so they get their own,
//! started in this test binary only.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::HashSet;

use std::time::{Duration, Instant};

use pgoutput::Lsn;
use support::{insert_transaction, Case, DEADLINE, STREAMING};
use testkit::{Nats, Postgres};

/// These tests restart servers: run them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// (d) With nats-server stopped, new events are not confirmed (the slot's
/// `confirmed_flush_lsn` stays at or below their commit LSN); when it returns they arrive
/// and the slot advances past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_while_nats_is_down_are_not_confirmed_until_stored() {
    let _serial = SERIAL.lock().await;
    let pg = Postgres::start();
    let mut nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "nats_down");
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "2s")]);
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    insert_transaction(&mut sql, 10, 2, "before").await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    drop(js);

    nats.kill();
    let during = insert_transaction(&mut sql, 200, 5, "during").await;
    // Watch the slot over several status intervals (the relay reports at least every
    // second) while the broker is down.
    let mut samples = Vec::new();
    let watch_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < watch_until {
        samples.push(case.confirmed_flush_lsn(&sql).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    nats.start_again();
    let js = case.jetstream().await;
    case.wait_for_count(&js, 210, DEADLINE).await;
    let messages = case.messages(&js).await;
    assert_eq!(messages.len(), 210, "each event once");
    let stored_ids: Vec<i64> = messages[10..].iter().map(|m| m.outbox_id()).collect();
    assert_eq!(stored_ids, during);
    let commit_lsn = messages[10].commit_lsn();
    let highest_sample = samples.iter().copied().max().unwrap();
    assert!(
        highest_sample <= commit_lsn,
        "while NATS was down the slot confirmed {highest_sample}, past the unstored transaction at {commit_lsn}"
    );
    let advanced: Lsn = support::eventually(
        "the slot to confirm the stored events",
        DEADLINE,
        || async {
            let confirmed = case.confirmed_flush_lsn(&sql).await;
            (confirmed > commit_lsn).then_some(confirmed)
        },
    )
    .await;
    eprintln!(
        "nats_down: {} samples while down, highest {highest_sample} <= commit {commit_lsn}; after restart confirmed {advanced}",
        samples.len()
    );
    drop(relay);
}

/// An idle relay whose nats-server dies ends its session when its publishing connection
/// closes, not at its next event: the error is logged while nothing is being published, a
/// new session streams once the server is back, and what comes next is stored once, in
/// order, after what came before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_ends_its_session_when_nats_goes_away_not_at_its_next_event() {
    let _serial = SERIAL.lock().await;
    let pg = Postgres::start();
    let mut nats = Nats::start();
    let case = Case::new(&pg, &nats, "nats_idle");
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = case.jetstream().await;
    let mut ids = insert_transaction(&mut sql, 10, 2, "before").await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    drop(js);

    // Nothing is inserted from here until a new session streams.
    nats.kill();
    support::eventually(
        "the idle relay to end its session on the closed publishing connection",
        DEADLINE,
        || async {
            relay
                .output()
                .contains("the publishing connection to NATS closed:")
                .then_some(())
        },
    )
    .await;
    nats.start_again();
    support::eventually("a new session to stream", DEADLINE, || async {
        (relay.output().matches(STREAMING).count() >= 2).then_some(())
    })
    .await;

    let js = case.jetstream().await;
    ids.extend(insert_transaction(&mut sql, 5, 1, "after").await);
    case.wait_for_count(&js, 15, DEADLINE).await;
    let stored: Vec<i64> = case
        .messages(&js)
        .await
        .iter()
        .map(|m| m.outbox_id())
        .collect();
    assert_eq!(stored, ids, "every event once, in commit order");
    drop(relay);
}

/// Postgres crashes (immediate shutdown) twice while events flow: the relay reconnects,
/// resumes from the slot, and every committed row is in the stream exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_and_restart_loses_nothing_and_duplicates_nothing() {
    let _serial = SERIAL.lock().await;
    let mut pg = Postgres::start();
    let nats = Nats::start();
    let case = Case::new(&pg, &nats, "pg_crash");
    let relay = case.start_relay();
    let js = case.jetstream().await;
    let mut committed = Vec::new();
    for round in 0..3 {
        let mut sql = case.sql().await;
        for i in 0..10 {
            committed.extend(insert_transaction(&mut sql, 100, 10, &format!("r{round}-{i}")).await);
        }
        drop(sql);
        if round < 2 {
            pg.crash();
            pg.start_again();
        }
    }
    case.wait_for_count(&js, committed.len() as u64, DEADLINE)
        .await;
    let messages = case.messages(&js).await;
    let keys: HashSet<&str> = messages.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(keys.len(), messages.len(), "no duplicates");
    let ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    assert_eq!(ids, committed, "every committed row, in commit order");
    assert!(
        relay
            .output()
            .contains("resuming from the slot's confirmed position"),
        "the relay reconnected"
    );
    eprintln!("pg_crash: 2 crashes, {} rows once each", ids.len());
}

/// The walsender never times the relay out while its pipeline is backpressured: with
/// `wal_sender_timeout = 2s` and JetStream's acks held back (the window fills, the reader stops
/// taking data), the replication session survives 4× the timeout, because status updates go
/// out on schedule whatever the backpressure; when the acks flow again everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backpressured_relay_is_not_timed_out_by_the_walsender() {
    let _serial = SERIAL.lock().await;
    let pg = Postgres::start_with(testkit::PgOptions {
        settings: vec![("wal_sender_timeout".into(), "2s".into())],
        ..Default::default()
    });
    let nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "backpressure");
    let proxy = case.nats_through_proxy(nats.port());
    case.set_env(&[
        ("OUTBOX_RELAY_ACK_TIMEOUT", "60s"),
        ("OUTBOX_RELAY_MAX_IN_FLIGHT", "64"),
    ]);
    // Every standby status update the relay sends, with its time.
    case.extra_env.push((
        "RUST_LOG".into(),
        "info,outbox_relay=debug,replication::stream=trace".into(),
    ));
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = support::jetstream_at(&nats.url()).await;

    proxy.set_blackhole(true);
    // Far more than the window and the channel hold: the reader is backpressured.
    insert_transaction(&mut sql, 20_000, 10, "held").await;
    // The scenario itself: 4 × wal_sender_timeout with the acks held back.
    tokio::time::sleep(Duration::from_secs(8)).await;
    proxy.set_blackhole(false);
    case.wait_for_count(&js, 20_000, DEADLINE).await;

    let log = pg.log();
    assert!(
        !log.contains("replication timeout"),
        "the walsender timed the relay out:\n{log}"
    );
    // The mechanism (I3): updates go out every status interval (1 s here), never a whole
    // wal_sender_timeout apart. A ticker that aliased with the due time once spaced them
    // 2 s apart and the walsender timed the relay out in half of the runs.
    let sent: Vec<std::time::SystemTime> = support::timed_log_lines(&relay.output())
        .into_iter()
        .filter(|(_, line)| line.contains("standby status update sent"))
        .map(|(time, _)| time)
        .collect();
    assert!(
        sent.len() >= 8,
        "too few status updates logged: {}",
        sent.len()
    );
    let widest = sent
        .windows(2)
        .map(|pair| pair[1].duration_since(pair[0]).unwrap_or_default())
        .max()
        .unwrap();
    assert!(
        widest < Duration::from_millis(1500),
        "two status updates were {widest:?} apart (wal_sender_timeout 2 s, interval 1 s)"
    );
    assert!(
        !relay.output().contains("relay session ended"),
        "the session had to restart:\n{}",
        relay.output()
    );
    eprintln!("backpressure: acks held 8 s (4 × wal_sender_timeout) with 20 000 events behind a window of 64; no timeout, no restart; {} status updates, at most {widest:?} apart", sent.len());
}

/// I7, bounded memory: with the acks held back and a backlog far larger than the relay's
/// buffers (100 000 events of 2 KiB: 200 MiB of payload), the relay stops reading instead of
/// buffering; its peak resident memory over the whole run, the drain included, stays far
/// below the backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_under_a_backlog_larger_than_the_buffers() {
    const ROWS: i32 = 100_000;
    /// Far above what the relay needs (about 30 MiB, docs/performance.md), far below the
    /// backlog it would hold if intake were not bounded.
    const LIMIT: u64 = 128 * 1024 * 1024;
    let _serial = SERIAL.lock().await;
    let pg = Postgres::start();
    let nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "memory");
    let proxy = case.nats_through_proxy(nats.port());
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "60s")]);
    let relay = case.start_relay();
    let sql = case.sql().await;
    let js = support::jetstream_at(&nats.url()).await;

    proxy.set_blackhole(true);
    sql.execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
         select 'entity-' || (i % 97), 'Bulk', 'tmp-' || i, 'tmp', 'tmp', \
                jsonb_build_object('pad', repeat('x', 2048)) \
           from generate_series(1, $1::int) as i",
        &[&ROWS],
    )
    .await
    .unwrap();
    // The relay is stalled on its window with the backlog committed behind it.
    support::eventually(
        "the relay to stall with the backlog pending",
        DEADLINE,
        || async {
            let before = case.stream_count(&js).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let after = case.stream_count(&js).await;
            (after == before && after < ROWS as u64).then_some(())
        },
    )
    .await;
    let stalled = relay.peak_rss_bytes().unwrap();
    proxy.set_blackhole(false);
    case.wait_for_count(&js, ROWS as u64, DEADLINE).await;
    let peak = relay.peak_rss_bytes().unwrap();
    assert!(
        peak < LIMIT,
        "the relay's peak RSS was {} MiB with a 200 MiB backlog (limit {} MiB)",
        peak >> 20,
        LIMIT >> 20
    );
    eprintln!(
        "memory: 100 000 events of 2 KiB behind held acks; relay peak RSS {} MiB while stalled, {} MiB after draining all",
        stalled >> 20,
        peak >> 20
    );
}
