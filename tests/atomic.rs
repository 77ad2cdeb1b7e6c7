//! `--atomic-transactions` (issue 23) on a current nats-server ([`testkit::current_nats_bin`]):
//! each Postgres transaction is one JetStream atomic batch, split at the server's limit of
//! 1 000 messages.
//!
//! - [`no_reader_sees_part_of_a_transaction_under_kills`]: one writer commits transactions of
//!   1, 10, 999, 1 000, 1 001 and 5 000 rows over and over while the relay is SIGKILLed and
//!   nats-server killed with SIGKILL (and started again) at moments chosen so that batches are
//!   in flight. A watcher reads the stream's last message the whole time through the
//!   server's isolated read (`STREAM.MSG.GET`, last by subject), which never shows an atomic
//!   batch half applied: every message it sees is its transaction's last, or (a transaction
//!   above the limit) a batch's last. At the end the stream holds every committed row
//!   exactly once, in commit order, nothing rolled back, no gap, and the slot never
//!   confirmed past an unstored event (`check_stream`).
//! - [`refusals`]: the relay refuses `--atomic-transactions` on nats-server 2.9.10 (naming
//!   the version) and on an existing stream without `allow_atomic`, and with a shared stream.
//! - Poison: under `halt` nothing of the poison row's transaction is stored
//!   ([`poison_under_halt_stores_nothing_of_its_transaction`]); under `dead-letter` the record
//!   stands inside the transaction's batch ([`poison_under_dead_letter_keeps_its_transaction_whole`]).
//! - B4: a transaction whose message ids the stream already holds is refused as a batch once,
//!   then published message by message
//!   ([`a_batch_holding_stored_message_ids_is_published_message_by_message`]).
//!
//! Every test prints what it injected and what it found.

#![allow(clippy::unwrap_used)]
use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgoutput::Lsn;
use support::{
    check_stream, eventually, read_stream, servers, Case, Ledger, Plan, Relay, Sampler, Writers,
    DEADLINE,
};
use testkit::{Nats, Process};

/// The server's default limit of messages per atomic batch.
const LIMIT: u32 = 1000;

/// The transaction sizes the issue names, in the order the writer cycles through them.
const SIZES: [usize; 6] = [1, 10, 999, 1000, 1001, 5000];

/// A JetStream context whose requests give up after a second (the watcher polls through
/// nats-server restarts).
async fn jetstream_with_timeout(url: &str) -> jetstream::Context {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client)
}

/// What the watcher saw: the (commit LSN, index in transaction) of the stream's last
/// message, each distinct one once.
type Seen = Arc<Mutex<Vec<(Lsn, u32)>>>;

/// Reads the stream's last message (last by subject `{prefix}.>`: the isolated read, which
/// waits for an atomic batch being applied) until `stop`, recording its position.
fn watch_tail(case: &Case, stop: Arc<AtomicBool>) -> (Seen, tokio::task::JoinHandle<usize>) {
    let seen: Seen = Arc::default();
    let (url, stream, subject) = (
        case.nats_url.clone(),
        case.stream.clone(),
        format!("{}.>", case.prefix),
    );
    let out = seen.clone();
    let task = tokio::spawn(async move {
        let mut reads = 0usize;
        let mut js = None;
        while !stop.load(Ordering::Relaxed) {
            if js.is_none() {
                js = async_nats::connect(&url).await.ok().map(|client| {
                    jetstream::context::ContextBuilder::new()
                        .timeout(Duration::from_secs(1))
                        .build(client)
                });
            }
            let Some(context) = js.as_ref() else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let last = match context.get_stream_no_info(&stream).await {
                Ok(s) => s.get_last_raw_message_by_subject(&subject).await.ok(),
                Err(_) => None,
            };
            let Some(message) = last else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            reads += 1;
            let header = |name: &str| {
                message
                    .headers
                    .get(name)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            };
            let (Ok(lsn), Ok(index)) = (
                header("Outbox-Commit-Lsn").parse::<Lsn>(),
                header("Outbox-Tx-Index").parse::<u32>(),
            ) else {
                continue;
            };
            let mut seen = out.lock().unwrap();
            if seen.last() != Some(&(lsn, index)) {
                seen.push((lsn, index));
            }
        }
        reads
    });
    (seen, task)
}

/// A case on `nats` whose relay runs with `--atomic-transactions`.
fn atomic_case(nats: &Nats, name: &str) -> Case {
    let mut case = Case::new(&servers().pg, nats, name);
    case.set_env(&[("OUTBOX_RELAY_ATOMIC_TRANSACTIONS", "true")]);
    case
}

/// The writer: the sizes over and over, committed, over 40 entities.
fn plans() -> impl FnMut() -> Plan + Send + 'static {
    let mut k = 0usize;
    move || {
        let plan = Plan {
            size: SIZES[k % SIZES.len()],
            entities: 40,
            offset: k,
            event_types: &["OrderPaid", "order.refunded"],
            commit: true,
            delete: false,
            pause: Duration::from_millis(50),
        };
        k += 1;
        plan
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_reader_sees_part_of_a_transaction_under_kills() {
    let mut nats = Nats::start_current(&[]);
    let case = atomic_case(&nats, "atomic");
    let mut relay = Relay::new(case.clone());
    relay.start();
    relay.wait_streaming(DEADLINE).await;
    let js = jetstream_with_timeout(&case.nats_url).await;
    let sampler = Sampler::start(&case, js.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let (seen, watcher) = watch_tail(&case, stop.clone());
    let writers = Writers::start_with(&case.pg_url, Ledger::default(), [plans()]);

    let started = Instant::now();
    let (mut relay_kills, mut nats_kills) = (0, 0);
    // The faults: relay SIGKILLs at staggered moments after each start (so that some land
    // inside a batch), and a nats-server SIGKILL every third round.
    for round in 0..12u64 {
        let before = writers.committed_rows();
        eventually("the writer to commit more", DEADLINE, || async {
            (writers.committed_rows() > before + 2000).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(37 * (round % 7) + 5)).await;
        if round % 3 == 2 {
            nats.kill();
            nats_kills += 1;
            nats.start_again();
        } else {
            relay.kill();
            relay_kills += 1;
            relay.start();
        }
    }
    let log = writers.stop().await;
    let committed = log.committed_rows() as u64;
    relay.assert_alive();
    let js = jetstream_with_timeout(&case.nats_url).await;
    let case_ref = &case;
    eventually(
        "the stream to hold every committed row",
        Duration::from_secs(180),
        || {
            let js = js.clone();
            async move { (case_ref.stream_count(&js).await >= committed).then_some(()) }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let reads = watcher.await.unwrap();
    let samples = sampler.stop().await;
    let js = case.jetstream().await;
    let messages = read_stream(&js, &case.stream, committed, DEADLINE).await;
    let findings = check_stream(&messages, &log, &samples);

    // Every tail the watcher saw is a transaction's last message, or a full batch's.
    let mut sizes: HashMap<Lsn, u32> = HashMap::new();
    for message in &messages {
        *sizes.entry(message.commit_lsn()).or_default() += 1;
    }
    let seen = seen.lock().unwrap().clone();
    let partial: Vec<_> = seen
        .iter()
        .filter(|(lsn, index)| {
            let size = sizes.get(lsn).copied().unwrap_or(0);
            index + 1 != size && (index + 1) % LIMIT != 0
        })
        .collect();
    let output = relay.output();
    let ended = support::lines_with(&output, &[support::SESSION_ENDED]);
    let incomplete = support::lines_with(&output, &["batch is incomplete"]);
    let mut transactions: Vec<u32> = sizes.values().copied().collect();
    transactions.sort_unstable();
    transactions.dedup();
    println!(
        "atomic under kills: {committed} rows in {} transactions (sizes {transactions:?}), {relay_kills} relay SIGKILLs, {nats_kills} nats-server SIGKILLs, {} relay starts, {:.0?}; watcher: {reads} reads, {} distinct tails, {} inside a batch; relay sessions ended {ended} times ({incomplete} on an abandoned batch); stream: {}",
        sizes.len(),
        relay.starts(),
        started.elapsed(),
        seen.len(),
        partial.len(),
        findings.summary(),
    );
    if std::env::var_os("ATOMIC_ECHO").is_some() {
        println!("{}", support::strip_ansi(&output));
    }
    assert!(
        partial.is_empty(),
        "the watcher saw the stream end inside a batch: {partial:?}"
    );
    findings.assert_faithful();
    // The batch headers are kept on the stored messages: a consumer can tell a batch's end.
    // Batches end at the limit and at a transaction's end; a batch of one (a one-event
    // transaction, the 1 001st event of a 1 001-event one) is a plain message (B6).
    let commits: Vec<(Lsn, u32)> = messages
        .iter()
        .filter(|m| m.headers.contains_key("Nats-Batch-Commit"))
        .map(|m| (m.commit_lsn(), m.tx_index()))
        .collect();
    let expected: Vec<(Lsn, u32)> = messages
        .iter()
        .filter(|m| {
            let (size, end) = (sizes[&m.commit_lsn()], m.tx_index() + 1);
            let batch_start = (end - 1) / LIMIT * LIMIT;
            (end % LIMIT == 0 || end == size) && end - batch_start > 1
        })
        .map(|m| (m.commit_lsn(), m.tx_index()))
        .collect();
    assert_eq!(commits, expected, "batch commits where batches end");
    // B7: each transaction's last event is marked Outbox-Tx-End (unless the relay published
    // the transaction message by message, B4), and no other event is; a reader of the whole
    // stream hands every transaction back whole, at its marked end.
    let per_message = support::lines_with(&output, &["refused an atomic batch"]);
    let ends = positions(
        messages
            .iter()
            .filter(|m| m.headers.contains_key("Outbox-Tx-End")),
    );
    let lasts = positions(
        messages
            .iter()
            .filter(|m| m.tx_index() + 1 == sizes[&m.commit_lsn()]),
    );
    if per_message == 0 {
        assert_eq!(
            ends, lasts,
            "Outbox-Tx-End on each transaction's last event"
        );
    } else {
        assert!(
            ends.iter().all(|end| lasts.contains(end)),
            "Outbox-Tx-End on last events only"
        );
    }
    let (whole, open) = whole_transactions(&messages);
    let mut in_order: Vec<(Lsn, usize)> = Vec::new();
    for message in &messages {
        if in_order.last().map(|(lsn, _)| *lsn) != Some(message.commit_lsn()) {
            in_order.push((message.commit_lsn(), sizes[&message.commit_lsn()] as usize));
        }
    }
    let left_open = usize::from(open > 0);
    assert_eq!(
        whole,
        in_order[..in_order.len() - left_open],
        "whole transactions, in commit order"
    );
    assert!(
        per_message > 0 || open == 0,
        "the last transaction is marked whole too"
    );
    println!(
        "atomic whole transactions: {} handed back whole by outbox_consumer::Transactions, {open} events left open, {} marked ends",
        whole.len(),
        ends.len()
    );
}

/// The (commit LSN, index) of `messages`.
fn positions<'a>(messages: impl Iterator<Item = &'a support::Stored>) -> Vec<(Lsn, u32)> {
    messages.map(|m| (m.commit_lsn(), m.tx_index())).collect()
}

/// `messages` read as a consumer of the whole stream would, through outbox-consumer's
/// [`outbox_consumer::Transactions`]: the transactions it handed back whole (commit LSN,
/// size), and how many events it left open.
fn whole_transactions(messages: &[support::Stored]) -> (Vec<(Lsn, usize)>, usize) {
    let mut assembler = outbox_consumer::Transactions::new();
    let mut whole = Vec::new();
    for message in messages {
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        let event = outbox_consumer::Event::decode(
            &message.subject,
            Some(&headers),
            message.payload.clone().into(),
            message.sequence,
            1,
        )
        .unwrap();
        for transaction in assembler.push(event).unwrap() {
            whole.push((transaction.commit_lsn.unwrap(), transaction.events.len()));
        }
    }
    (whole, assembler.open().len())
}

/// The relay's output when it refuses to start, and its exit code.
fn refused(case: &Case) -> (String, Option<i32>) {
    let mut relay = Process::spawn(&format!("relay-{}", case.name), case.relay_command("run"));
    let status = relay.wait_exit(DEADLINE);
    (relay.output(), status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals() {
    // nats-server 2.9.10 (Debian's, on PATH, the shared server): no atomic batches.
    let old = atomic_case(&servers().nats, "atomic_old");
    let (output, status) = refused(&old);
    assert_ne!(status, Some(0), "{output}");
    assert!(
        output.contains("needs nats-server 2.12 or newer"),
        "{output}"
    );
    // A current server, but the operator's stream does not allow atomic publish.
    let nats = Nats::start_current(&[]);
    let existing = atomic_case(&nats, "atomic_existing");
    let js = existing.jetstream().await;
    existing.create_stream(&js, Default::default()).await;
    let (output, status) = refused(&existing);
    assert_ne!(status, Some(0), "{output}");
    assert!(output.contains("allow_atomic"), "{output}");
    // With a shared stream: a configuration error.
    let mut shared = atomic_case(&nats, "atomic_shared");
    shared
        .extra_env
        .push(("OUTBOX_RELAY_SHARED_STREAM".into(), "true".into()));
    let (output, status) = refused(&shared);
    assert_ne!(status, Some(0), "{output}");
    assert!(output.contains("needs strict mode"), "{output}");
    println!(
        "atomic refusals: 2.9.10, a stream without allow_atomic, a shared stream: each refused"
    );
}

/// The poison tests' stream, created before the relay (which adopts it): atomic publish
/// allowed, messages of at most 4 096 bytes (an ordinary event is a few hundred).
async fn create_small_atomic_stream(case: &Case, js: &jetstream::Context, max_msg_size: i64) {
    let config = serde_json::json!({
        "name": case.stream,
        "subjects": [format!("{}.>", case.prefix)],
        "storage": "file",
        "max_msg_size": max_msg_size,
        "allow_atomic": true,
    });
    let subject = if max_msg_size == 4096 {
        "CREATE"
    } else {
        "UPDATE"
    };
    let answer: serde_json::Value = js
        .request(format!("STREAM.{subject}.{}", case.stream), &config)
        .await
        .unwrap();
    assert!(answer.get("error").is_none(), "{answer}");
}

/// Commits A (5 ordinary rows), then B: 2 ordinary rows, a ~10 KB row, 2 ordinary rows, in
/// one statement; returns (A's ids, B's ids, the big row's id).
async fn write_around_poison(sql: &mut tokio_postgres::Client) -> (Vec<i64>, Vec<i64>, i64) {
    let before = support::insert_transaction(sql, 5, 5, "before").await;
    let rows = sql
        .query(
            "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
             select 'order-' || i, 'OrderPaid', 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', \
                    case when i = 3 then jsonb_build_object('blob', repeat('x', 10000)) else jsonb_build_object('n', i) end \
               from generate_series(1, 5) as i order by i returning id",
            &[],
        )
        .await
        .unwrap();
    let mut batch: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    batch.sort_unstable();
    let poison = batch[2];
    (before, batch, poison)
}

/// Poison under `halt` with atomic transactions: the relay stops naming the row, and nothing
/// of its transaction is stored (its batch is never committed), not even the rows before it;
/// the transactions before it are. With the limit raised, a restart relays the rest once, in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_under_halt_stores_nothing_of_its_transaction() {
    let nats = Nats::start_current(&[]);
    let case = atomic_case(&nats, "atomic_halt");
    let js = case.jetstream().await;
    create_small_atomic_stream(&case, &js, 4096).await;
    let mut relay = tokio::task::block_in_place(|| case.start_relay());
    let mut sql = case.sql().await;
    let (before, batch, poison) = write_around_poison(&mut sql).await;
    let status = tokio::task::block_in_place(|| relay.wait_exit(DEADLINE));
    let output = relay.output();
    assert!(!status.success(), "{output}");
    assert!(
        output.contains(&format!("outbox event id={poison}")),
        "{output}"
    );
    let ids = |messages: &[support::Stored]| -> Vec<i64> {
        messages.iter().map(support::Stored::outbox_id).collect()
    };
    let messages = case.messages(&js).await;
    assert_eq!(
        ids(&messages),
        before,
        "A only: nothing of the poison row's transaction"
    );
    create_small_atomic_stream(&case, &js, 1024 * 1024).await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let mut all = before.clone();
    all.extend(&batch);
    let (messages, _) = case.wait_confirmed(&js, &sql, all.len() as u64).await;
    assert_eq!(
        ids(&messages),
        all,
        "after raising the limit: every row once, in order"
    );
    println!(
        "atomic poison halt: the relay halted naming id={poison}; the stream held the {} rows before its transaction and none of its {}; after raising the limit, all {} once, in order",
        before.len(),
        batch.len(),
        all.len()
    );
    drop(relay);
}

/// Poison under `dead-letter` with atomic transactions: the record takes the row's place
/// inside its transaction's batch, and the whole transaction is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_under_dead_letter_keeps_its_transaction_whole() {
    let nats = Nats::start_current(&[]);
    let mut case = atomic_case(&nats, "atomic_dlq");
    case.set_env(&[("OUTBOX_RELAY_ON_POISON", "dead-letter")]);
    let js = case.jetstream().await;
    create_small_atomic_stream(&case, &js, 4096).await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let mut sql = case.sql().await;
    let (before, batch, poison) = write_around_poison(&mut sql).await;
    let mut all = before.clone();
    all.extend(&batch);
    let (messages, _) = case.wait_confirmed(&js, &sql, all.len() as u64).await;
    let ids: Vec<i64> = messages.iter().map(support::Stored::outbox_id).collect();
    assert_eq!(ids, all);
    let record = &messages[before.len() + 2];
    assert_eq!(record.subject, format!("{}.dlq", case.prefix));
    assert_eq!(record.outbox_id(), poison);
    let last = messages.last().unwrap();
    assert_eq!(last.header("Nats-Batch-Commit"), "1");
    assert_eq!(last.header("Nats-Batch-Sequence"), "5");
    assert_eq!(record.header("Nats-Batch-Id"), last.header("Nats-Batch-Id"));
    assert_eq!(last.header("Outbox-Tx-End"), "1", "B7");
    println!(
        "atomic poison dead-letter: the record stood in id={poison}'s place inside its transaction's batch of 5; all {} rows once, in order",
        all.len()
    );
    drop(relay);
}

/// B4: a transaction whose message ids the stream already holds (`outbox-relay replay
/// --force` published its rows before the relay streamed them) is refused as a batch
/// (10201), never taken as stored; the next session publishes it one message at a time,
/// where each duplicate's original is checked to be the same row's event, and everything
/// is in the stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holding_stored_message_ids_is_published_message_by_message() {
    let nats = Nats::start_current(&[]);
    let case = atomic_case(&nats, "atomic_ahead");
    let mut sql = case.sql().await;
    let (relay, messages) = support::replay_ahead_then_relay(&case, &mut sql).await;
    let output = relay.output();
    assert_eq!(
        support::lines_with(&output, &["refused an atomic batch"]),
        1,
        "{output}"
    );
    // C, after the refused transaction, is a batch again.
    assert_eq!(messages.last().unwrap().header("Nats-Batch-Commit"), "1");
    // B7: the atomic transactions' last events are marked; the replayed rows, stored by
    // `replay` message by message, are not.
    let marked: Vec<usize> = (0..messages.len())
        .filter(|&i| messages[i].headers.contains_key("Outbox-Tx-End"))
        .collect();
    // `gap`, a transaction of one (a plain publish, B6), ends at 20.
    assert_eq!(
        marked,
        [9, 20, 25],
        "Outbox-Tx-End where a transaction ended in a batch"
    );
    println!(
        "atomic ahead: the relay's batch of the 10 replayed rows was refused once (10201), then published message by message as duplicates of the same rows; 26 rows once, in order"
    );
    drop(relay);
}
