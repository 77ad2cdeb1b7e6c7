//! A relay that cannot go on for a while retries, and `outbox-relay status` says so (issue
//! 39, lease LS3): between two attempts it is reported running and retrying, with the next
//! attempt and the last error, never as "no relay is running"; and the cause JetStream
//! gives (a full stream) is named beside it. When the cause is gone the relay goes on and
//! nothing is lost.

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
    let (code, table) = eventually("a status between two attempts", DEADLINE, || async {
        let (code, table) = status(&case, &[]);
        table.contains("retrying").then_some((code, table))
    })
    .await;
    assert_eq!(code, 4, "a full discard-new stream is broken:\n{table}");
    for said in [
        "is running and retrying after a failed session".to_owned(),
        format!("stream {} is full", case.stream),
        "held by no relay; retrying: pid ".to_owned(),
    ] {
        assert!(table.contains(&said), "{said:?} in:\n{table}");
    }
    assert!(!table.contains("no relay is running"), "{table}");

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
