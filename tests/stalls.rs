//! A relay that cannot go on for a while retries, and `outbox-relay status` says so (issue
//! 39, lease LS3): between two attempts it is reported running and retrying, with the next
//! attempt and the last error, never as "no relay is running"; and the cause JetStream
//! gives (a full stream, a deleted stream, JetStream out of storage) is named beside it. When
//! the cause is gone the relay goes on and nothing is lost.

use crate::support;

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::stream::DiscardPolicy;
use serde_json::Value;
use support::{eventually, insert_transaction, servers, update_stream_setting, Case, DEADLINE};

/// `outbox-relay status` for `case` (`args`: e.g. `--json`): its exit status and stdout.
fn status(case: &Case, args: &[&str]) -> (i32, String) {
    let run = case.run_command("status", args);
    (run.code, run.stdout)
}

/// Waits for a `status` taken between two of the stalled relay's attempts that says each of
/// `said`, and checks it: exit `code`, a relay running and retrying (never "no relay is
/// running").
async fn stalled_status(case: &Case, code: i32, said: &[String]) -> String {
    // The first retry's last error may be the one that ended the session: wait for the cause.
    let (exit, table) = eventually("a status between two attempts", DEADLINE, || async {
        let (exit, table) = status(case, &[]);
        (table.contains("retrying") && said.iter().all(|s| table.contains(s.as_str())))
            .then_some((exit, table))
    })
    .await;
    assert_eq!(exit, code, "{table}");
    assert!(
        table.contains("is running and retrying after a failed session"),
        "{table}"
    );
    for said in said {
        assert!(table.contains(said.as_str()), "{said:?} in:\n{table}");
    }
    assert!(!table.contains("no relay is running"), "{table}");
    table
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stalled_on_a_full_stream_is_reported_retrying_with_its_error_then_goes_on() {
    let s = servers();
    let case = Case::new(&s.pg, &s.nats, "stall_full");
    let js = case.jetstream().await;
    js.create_stream(jetstream::stream::Config {
        name: case.stream.clone(),
        subjects: vec![format!("{}.>", case.prefix)],
        max_messages: 3,
        discard: DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 10, 1, "stall").await;

    // Between two attempts: running and retrying, the next attempt and JetStream's words.
    let retrying = eventually("status to see the relay retrying", DEADLINE, || async {
        let (_, stdout) = status(&case, &["--json"]);
        let json: Value = serde_json::from_str(&stdout).ok()?;
        let relays = json["lease"]["retrying"].as_array()?.clone();
        (!relays.is_empty()).then_some(relays)
    })
    .await;
    let note = retrying[0]["note"].as_str().unwrap_or_default().to_owned();
    assert!(
        note.starts_with("next attempt at ") && note.contains("; last error: "),
        "{note}"
    );
    assert!(
        note.to_lowercase().contains("maximum messages"),
        "the last error is JetStream's: {note}"
    );
    // A full discard-new stream is broken (exit 4).
    let said = [
        format!("stream {} is full", case.stream),
        "held by no relay; retrying: pid ".to_owned(),
    ];
    stalled_status(&case, 4, &said).await;

    // Room again: the relay goes on, every row once, in order, and status is healthy.
    update_stream_setting(&js, &case.stream, "max_msgs", Value::from(1000)).await;
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    assert_eq!(case.outbox_ids(&js).await, ids);
    let (code, table) = eventually("status healthy again", DEADLINE, || async {
        let (code, table) = status(&case, &[]);
        (code == 0).then_some((code, table))
    })
    .await;
    assert!(!table.contains("retrying"), "{code}: {table}");
    drop(relay);
}

/// The stream deleted under a running relay: its sessions fail and it retries; status says the
/// relay is retrying and the stream is missing, with the fix (`outbox-relay init`), which lets
/// the relay go on with what was committed since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stalled_on_a_deleted_stream_is_reported_retrying_with_the_stream_missing() {
    let s = servers();
    let case = Case::new(&s.pg, &s.nats, "stall_deleted");
    let js = case.jetstream().await;
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 3, 1, "before").await;
    case.wait_confirmed(&js, &sql, 3).await;
    js.delete_stream(&case.stream).await.unwrap();
    let after = insert_transaction(&mut sql, 4, 1, "after").await;

    let said = [format!(
        "stream {} does not exist: nothing is relayed; create it with outbox-relay init",
        case.stream
    )];
    stalled_status(&case, 4, &said).await;

    case.init();
    case.wait_for_count(&js, after.len() as u64, DEADLINE).await;
    assert_eq!(
        case.outbox_ids(&js).await,
        after,
        "what was committed since, once, in order"
    );
    drop(relay);
}

/// JetStream out of storage (the server's max_file_store used up): the relay's publishes are
/// refused ("insufficient resources") and it retries; status says it is retrying and names
/// JetStream's storage limit as the cause. Room made, the relay goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stalled_on_jetstream_storage_is_reported_retrying_with_the_limit_named() {
    let s = servers();
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("limited.conf");
    std::fs::write(&conf, "jetstream {\n  max_file_store: 512KB\n}\n").unwrap();
    let nats = testkit::Nats::start_with_args(&["-c", conf.to_str().unwrap()]);
    let case = Case::new(&s.pg, &nats, "stall_storage");
    let js = case.jetstream().await;
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 1500, 4, "storage").await;

    let said = ["JetStream has no storage left for the stream (insufficient resources".to_owned()];
    stalled_status(&case, 4, &said).await;
    let stored = case.stream_count(&js).await;
    assert!(stored > 0 && stored < ids.len() as u64, "{stored} stored");

    // Room made: the stream's stored events are consumed and purged; the rest follow, in order.
    let held = case.outbox_ids(&js).await;
    assert_eq!(held[..], ids[..held.len()], "stored in commit order");
    js.get_stream(&case.stream)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let rest = &ids[held.len()..];
    let deadline = std::time::Instant::now() + DEADLINE;
    while case.stream_count(&js).await < rest.len() as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} rows after the purge; relay log:\n{}",
            case.stream_count(&js).await,
            rest.len(),
            support::last_lines(&relay.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        case.outbox_ids(&js).await,
        rest,
        "the rest, once each, in order"
    );
    drop(relay);
}

/// `DATABASE_URL` reaching a standby after the relay's first session (a name or a virtual IP
/// moved to a demoted primary): the relay retries (PG4) and status says it is running and
/// retrying, with the standby's refusal as its last error, never "no relay is running"; the
/// name back on the primary, the relay goes on, every row once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stalled_on_a_standby_is_reported_retrying_with_the_standby_named() {
    let (primary, standby, nats) = tokio::task::block_in_place(|| {
        let primary = testkit::Postgres::start();
        let standby = primary.start_standby(None, vec![]);
        (primary, standby, testkit::Nats::start())
    });
    let mut case = Case::new(&primary, &nats, "stall_standby");
    standby.wait_for_database(&case.database);
    let at = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let proxy = testkit::Proxy::start(at(primary.port()));
    case.pg_url = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        proxy.port(),
        case.database
    );
    let js = case.jetstream().await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let mut sql = support::sql_connect_retrying(&primary.url(&case.database)).await;
    let mut ids = insert_transaction(&mut sql, 3, 1, "before").await;
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;

    proxy.redirect(at(standby.port()));
    proxy.cut();
    let said = ["last error: DATABASE_URL reaches a standby".to_owned()];
    stalled_status(&case, 4, &said).await;

    proxy.redirect(at(primary.port()));
    proxy.cut();
    ids.extend(insert_transaction(&mut sql, 4, 1, "after").await);
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    assert_eq!(case.outbox_ids(&js).await, ids, "once each, in order");
    drop(relay);
}
