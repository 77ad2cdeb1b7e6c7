//! `--fast-ingest` (issue 23), on by default: the relay chooses fast-ingest batches by itself,
//! from the server's version and the stream's settings, per session (`stream::atomic` AT3).
//!
//! - [`chosen_on_a_current_server_for_the_stream_it_creates`]: on a current nats-server the
//!   relay creates its stream with `allow_batched` and publishes fast-ingest batches
//!   (`outbox_relay_publish_mode{mode="fast_batches"}` is 1, `outbox_relay_fast_batches_total`
//!   rises, one log line says so); transactions of 1, 1 500 and 10 rows are stored once each,
//!   in commit order, and confirmed.
//! - [`per_message_where_the_server_or_the_stream_does_not_allow_it`]: on the shared server
//!   (Debian's 2.9.10 unless `TESTKIT_NATS_SERVER` says otherwise) the choice follows its
//!   version; on a current server with an operator's stream without `allow_batched`, one
//!   acknowledged message per event, with the reason logged once, and after
//!   docs/upgrading.md's one-time update of the stream, fast batches.
//! - [`a_fast_batch_of_replayed_ids_is_never_taken_as_stored`] (F3, F4): rows `replay --force`
//!   already published go into a fast batch, which the server skips without a word (or
//!   refuses by the fence); the session ends, the next ones publish them one message at a
//!   time (each duplicate checked), then the next transaction (500 rows) goes fast again:
//!   every row once, in order, confirmed.
//!
//! Every test prints what it found.

#![allow(clippy::unwrap_used)]
use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream;
use support::{eventually, insert_transaction, lines_with, servers, Case, DEADLINE};
use testkit::Nats;

/// A case on `nats` with the relay's default `--fast-ingest` (whatever `TESTKIT_RELAY_ENV`
/// says) and its metrics served; returns the metrics' address too.
fn default_case(nats: &Nats, name: &str) -> (Case, SocketAddr) {
    let mut case = Case::new(&servers().pg, nats, name);
    case.extra_env
        .retain(|(key, _)| key != "OUTBOX_RELAY_FAST_INGEST");
    let addr: SocketAddr = format!("127.0.0.1:{}", testkit::free_port())
        .parse()
        .unwrap();
    case.extra_env
        .push(("OUTBOX_RELAY_METRICS_ADDR".into(), addr.to_string()));
    (case, addr)
}

/// The value of the series `series` (name and labels, as rendered) at the relay's
/// `/metrics`, once it is there.
async fn metric(addr: SocketAddr, series: &str) -> f64 {
    eventually(&format!("metric {series}"), DEADLINE, || async move {
        let (_, text) = outbox_relay::observe::http::get(addr, "/metrics", Duration::from_secs(5))
            .await
            .ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    })
    .await
}

/// The stream's `allow_batched`, read through the API's JSON.
async fn allow_batched(js: &jetstream::Context, stream: &str) -> bool {
    let info: serde_json::Value = js
        .request(format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await
        .unwrap();
    info["config"]["allow_batched"].as_bool().unwrap_or(false)
}

const FAST: &str = r#"outbox_relay_publish_mode{mode="fast_batches"}"#;
const PER_MESSAGE: &str = r#"outbox_relay_publish_mode{mode="per_message"}"#;
const BATCHES: &str = "outbox_relay_fast_batches_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chosen_on_a_current_server_for_the_stream_it_creates() {
    let nats = Nats::start_current(&[]);
    let (case, addr) = default_case(&nats, "fast_default");
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let js = case.jetstream().await;
    assert!(
        allow_batched(&js, &case.stream).await,
        "set on the stream it created"
    );
    let mut sql = case.sql().await;
    let mut ids = Vec::new();
    for (size, tag) in [(1, "one"), (10, "ten")] {
        ids.extend(insert_transaction(&mut sql, size, 7, tag).await);
    }
    // Batches of at most 1 000 (and half the window); rows that arrive one at a time go
    // out as plain messages (B6).
    let ids = relay_until_a_fast_batch(&case, &js, &mut sql, addr, ids, 1500).await;
    assert_eq!(metric(addr, FAST).await, 1.0);
    assert_eq!(metric(addr, PER_MESSAGE).await, 0.0);
    let batches = metric(addr, BATCHES).await;
    let output = relay.output();
    assert_eq!(
        lines_with(&output, &["publishing fast-ingest batches"]),
        1,
        "{output}"
    );
    println!(
        "fast default: nats-server {}, stream created with allow_batched, {} rows in {batches} fast batches, once each, in order, confirmed",
        nats_version(&js),
        ids.len()
    );
    drop(relay);
}

/// Commits transactions of `rows` rows (after the `relayed` ids) until the relay has published
/// at least one fast batch, each confirmed in full and in order; returns every id relayed.
/// F1 commits a fast batch when the relay's input has nothing more ready: how many events
/// queue up, and so whether a transaction goes out in batches or one message at a time, is the
/// machine's timing (a loaded machine may publish a whole transaction event by event, seen
/// once in CI): the test waits, with a deadline, for the batches it names.
async fn relay_until_a_fast_batch(
    case: &Case,
    js: &jetstream::Context,
    sql: &mut tokio_postgres::Client,
    addr: SocketAddr,
    mut relayed: Vec<i64>,
    rows: usize,
) -> Vec<i64> {
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        relayed.extend(insert_transaction(sql, rows, 7, "batched").await);
        let (messages, _) = case.wait_confirmed(js, sql, relayed.len() as u64).await;
        let stored: Vec<i64> = messages.iter().map(support::Stored::outbox_id).collect();
        assert_eq!(stored, relayed, "every row once, in commit order");
        if metric(addr, BATCHES).await >= 1.0 {
            return relayed;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no fast batch in {} rows relayed",
            relayed.len()
        );
    }
}

/// The server's version, as it announced it.
fn nats_version(js: &jetstream::Context) -> String {
    js.client().server_info().version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_where_the_server_or_the_stream_does_not_allow_it() {
    // The shared server: its version decides.
    let (shared, addr) = default_case(&servers().nats, "fast_shared_server");
    let relay = tokio::task::block_in_place(|| shared.start_relay());
    let js = shared.jetstream().await;
    let version = nats_version(&js);
    let mut sql = shared.sql().await;
    let ids = insert_transaction(&mut sql, 20, 3, "old").await;
    let (messages, _) = shared.wait_confirmed(&js, &sql, ids.len() as u64).await;
    assert_eq!(messages.len(), ids.len());
    let fast = testkit::has_fast_ingest(&version);
    assert_eq!(
        metric(addr, FAST).await,
        f64::from(u8::from(fast)),
        "{version}"
    );
    let output = relay.output();
    if !fast {
        assert_eq!(metric(addr, BATCHES).await, 0.0);
        let reason = format!("nats-server {version} has no fast-ingest batches");
        assert_eq!(lines_with(&output, &[&reason]), 1, "{output}");
    }
    drop(relay);

    // A current server and an operator's stream without allow_batched: left as it is.
    let nats = Nats::start_current(&[]);
    let (case, addr) = default_case(&nats, "fast_operator_stream");
    let js = case.jetstream().await;
    case.create_stream(&js, Default::default()).await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 20, 3, "operator").await;
    let (messages, _) = case.wait_confirmed(&js, &sql, ids.len() as u64).await;
    let stored: Vec<i64> = messages.iter().map(support::Stored::outbox_id).collect();
    assert_eq!(stored, ids);
    assert_eq!(metric(addr, PER_MESSAGE).await, 1.0);
    assert_eq!(metric(addr, BATCHES).await, 0.0);
    assert!(
        !allow_batched(&js, &case.stream).await,
        "the operator's setting stands"
    );
    let output = relay.output();
    assert_eq!(
        lines_with(&output, &["not fast-ingest batches", "allow_batched"]),
        1,
        "{output}"
    );
    drop(relay);

    // docs/upgrading.md's one-time update (the stream's configuration with allow_batched, to
    // STREAM.UPDATE): the relay started again publishes fast batches to the same stream.
    support::update_stream_setting(&js, &case.stream, "allow_batched", true.into()).await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let all = relay_until_a_fast_batch(&case, &js, &mut sql, addr, ids.clone(), 30).await;
    assert_eq!(metric(addr, FAST).await, 1.0);
    println!(
        "fast fallback: nats-server {version} (shared) chose {}; a current server with a stream without allow_batched published {} rows one message each, the reason logged once; after the documented update {} more rows in fast batches",
        if fast { "fast batches" } else { "one message per event" },
        ids.len(),
        all.len() - ids.len()
    );
    drop(relay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_batch_of_replayed_ids_is_never_taken_as_stored() {
    let nats = Nats::start_current(&[]);
    let (case, addr) = default_case(&nats, "fast_ahead");
    let mut sql = case.sql().await;
    let (relay, _) = support::replay_ahead_then_relay(&case, &mut sql).await;
    let js = case.jetstream().await;
    let output = relay.output();
    // The batch holding the replayed ids ends its session, however the server answers it
    // (its commit a duplicate or short of the fence, or a message refused by the fence).
    let ended = lines_with(&output, &[support::SESSION_ENDED]);
    assert!(ended >= 1, "{output}");
    // F4: once past what the failed session batched, fast batches again.
    assert_eq!(metric(addr, FAST).await, 1.0);
    // Enough rows to arrive more than one at a time (a batch of one is a plain message, B6).
    let later = insert_transaction(&mut sql, 500, 2, "d").await;
    let (messages, _) = case.wait_confirmed(&js, &sql, 526).await;
    assert_eq!(messages.last().unwrap().outbox_id(), *later.last().unwrap());
    let batches = metric(addr, BATCHES).await;
    assert!(batches >= 1.0, "{batches}");
    println!(
        "fast ahead: the fast batch holding the 10 replayed rows ended {ended} session(s), then they went message by message as duplicates of the same rows; 26 rows once, in order; then 500 more fast again ({batches} batches)"
    );
    drop(relay);
}
