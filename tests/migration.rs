//! Migration from a polling publisher (issue 11 parts 1 and 2): rows already in the table
//! when the relay first runs are backfilled in the slot's exported snapshot (`--backfill
//! pending|all|none`), exactly once, while writers keep inserting; a backfill killed midway
//! resumes without publishing a row twice; and the seed's polling publisher, running beside
//! the relay in shared-stream mode, leaves each event in the stream once.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::new_case;

use support::sql_value;

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use pgoutput::Lsn;
use support::{eventually, servers, Case, Stored, WriterLog, Writers, DEADLINE};

/// Rows in the table before the relay ever ran: enough that the backfill takes a while.
const HISTORY_ROWS: i64 = 30_000;
/// Every third history row was already published by the polling publisher.
const PUBLISHED_EVERY: i64 = 3;

/// Inserts the history the way the seed's application and poller left it: `pending` rows,
/// and every `PUBLISHED_EVERY`th one `published`, for entities `history-{0..50}` written one
/// at a time (so id order is their commit order). Returns (pending ids, published ids).
async fn insert_history(case: &Case, rows: i64) -> (HashSet<i64>, HashSet<i64>) {
    let sql = case.sql().await;
    for chunk in 0..(rows / 5_000).max(1) {
        sql.execute(
            "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, status, published_at) \
             select 'history-' || (i % 50), 'OrderCreated', 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', \
                    jsonb_build_object('n', i), \
                    case when i % $2::int8 = 0 then 'published' else 'pending' end, \
                    case when i % $2::int8 = 0 then now() end \
               from generate_series($1::int8 * 5000 + 1, $1::int8 * 5000 + least($3::int8, 5000)) as i",
            &[&chunk, &PUBLISHED_EVERY, &rows],
        )
        .await
        .unwrap();
    }
    let mut pending = HashSet::new();
    let mut published = HashSet::new();
    for row in sql
        .query("select id, status from outbox_events", &[])
        .await
        .unwrap()
    {
        let (id, status): (i64, String) = (row.get(0), row.get(1));
        if status == "pending" {
            pending.insert(id);
        } else {
            published.insert(id);
        }
    }
    (pending, published)
}

/// The consistent point the relay logged when it created its slot.
fn consistent_point(output: &str) -> Lsn {
    let start = output
        .find("consistent_point=")
        .expect("the relay logs the slot's consistent point")
        + "consistent_point=".len();
    let text: String = output[start..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit() || *c == '/')
        .collect();
    text.parse().unwrap()
}

/// Every id in the stream once, exactly `expected`; positions strictly increasing (the
/// backfilled rows at commit LSN 0/0 in id order, then the streamed events in commit
/// order); each writer's transactions in its commit order; each history entity's rows in
/// id order (its commit order); every message carries the keys derived from its row.
async fn assert_exactly_once_in_order(
    case: &Case,
    messages: &[Stored],
    expected: &HashSet<i64>,
    log: Option<&WriterLog>,
) {
    let mut seen = HashMap::new();
    for message in messages {
        *seen.entry(message.outbox_id()).or_insert(0) += 1;
    }
    let twice: Vec<_> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    let ids: HashSet<i64> = seen.keys().copied().collect();
    let missing: Vec<_> = expected.difference(&ids).take(10).collect();
    let extra: Vec<_> = ids.difference(expected).take(10).collect();
    assert!(missing.is_empty(), "missing from the stream: {missing:?}…");
    assert!(extra.is_empty(), "published but not selected: {extra:?}…");

    for pair in messages.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            (a.commit_lsn(), a.tx_index()) < (b.commit_lsn(), b.tx_index()),
            "positions out of order: id {} at {}/{} before id {} at {}/{}",
            a.outbox_id(),
            a.commit_lsn(),
            a.tx_index(),
            b.outbox_id(),
            b.commit_lsn(),
            b.tx_index()
        );
    }
    let position: HashMap<i64, usize> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| (m.outbox_id(), i))
        .collect();
    // Each writer commits its transactions one after the other.
    let mut last_of_writer: HashMap<usize, usize> = HashMap::new();
    let mut committed: Vec<_> = log
        .iter()
        .flat_map(|log| log.transactions.iter())
        .filter(|t| t.outcome == support::Outcome::Committed)
        .collect();
    committed.sort_by_key(|t| (t.writer, t.seq));
    for tx in committed {
        let Some(first) = tx.ids.iter().filter_map(|id| position.get(id)).min() else {
            continue;
        };
        if let Some(previous) = last_of_writer.get(&tx.writer) {
            assert!(
                first > previous,
                "writer {} transaction {} stored before its predecessor",
                tx.writer,
                tx.seq
            );
        }
        let last = tx
            .ids
            .iter()
            .filter_map(|id| position.get(id))
            .max()
            .unwrap();
        last_of_writer.insert(tx.writer, *last);
    }
    // Per entity, the stream's order is the rows' order.
    let rows = support::rows_by_id(&case.sql().await).await;
    let mut last_of_entity: HashMap<&str, i64> = HashMap::new();
    for message in messages {
        let row = &rows[&message.outbox_id()];
        support::assert_matches_row(case, message, row);
        if row.entity_id.starts_with("history-") {
            if let Some(previous) = last_of_entity.insert(&row.entity_id, row.id) {
                assert!(previous < row.id, "entity {} out of order", row.entity_id);
            }
        }
    }
}

/// Stops `writers` once they committed `rows` more rows (after the relay started streaming).
async fn stop_after(writers: Writers, rows: u64) -> WriterLog {
    let at_start = writers.committed_rows();
    eventually(
        "writers to commit after the relay streams",
        DEADLINE,
        || async { (writers.committed_rows() > at_start + rows).then_some(()) },
    )
    .await;
    writers.stop().await
}

/// Writers that commit a transaction every few milliseconds while the relay starts.
async fn writers(case: &Case) -> Writers {
    Writers::start(case, 2, Duration::from_millis(5)).await
}

/// What one backfill run left.
struct Run {
    messages: Vec<Stored>,
    log: WriterLog,
    output: String,
    expected: HashSet<i64>,
}

/// Runs the relay with `mode` over a table holding history while writers insert (from
/// before the slot exists when `mode` backfills, else from when the relay streams) until
/// they committed 200 rows after the relay started streaming; waits until the stream holds
/// every row `mode` selects and every writer row.
async fn backfill_with_writers(case: &mut Case, mode: &str) -> Run {
    let (pending, published) = insert_history(case, HISTORY_ROWS).await;
    case.extra_env
        .push(("OUTBOX_RELAY_BACKFILL".into(), mode.into()));
    let js = case.jetstream().await;
    let early = mode != "none";
    let mut writing = if early {
        let writers = writers(case).await;
        eventually(
            "writers to commit before the relay starts",
            DEADLINE,
            || async { (writers.committed_rows() > 0).then_some(()) },
        )
        .await;
        Some(writers)
    } else {
        None
    };
    let mut relay = case.start_relay();
    let writers = match writing.take() {
        Some(writers) => writers,
        None => writers(case).await,
    };
    let log = stop_after(writers, 200).await;
    let mut expected: HashSet<i64> = log.committed_ids();
    if mode != "none" {
        expected.extend(&pending);
    }
    if mode == "all" {
        expected.extend(&published);
    }
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    relay.terminate(DEADLINE);
    Run {
        messages: case.messages(&js).await,
        log,
        output: relay.output(),
        expected,
    }
}

/// The boundary was exercised: writers committed both before and after the slot's
/// consistent point.
fn assert_writers_straddle_the_boundary(log: &WriterLog, output: &str) {
    let point = consistent_point(output);
    let committed = || {
        log.transactions
            .iter()
            .filter(|t| t.outcome == support::Outcome::Committed)
    };
    assert!(
        committed().any(|t| t.after_commit.is_some_and(|l| l <= point)),
        "no writer committed before the consistent point {point}"
    );
    assert!(
        committed().any(|t| t.before_commit.is_some_and(|l| l >= point)),
        "no writer committed after the consistent point {point}"
    );
}

async fn backfill_mode_publishes_its_rows_exactly_once(mode: &str) {
    let s = servers();
    let mut case = Case::new(&s.pg, &s.nats, &format!("backfill_{mode}"));
    let run = backfill_with_writers(&mut case, mode).await;
    assert_writers_straddle_the_boundary(&run.log, &run.output);
    assert_exactly_once_in_order(&case, &run.messages, &run.expected, Some(&run.log)).await;
    assert!(run.output.contains("backfill done"), "{}", run.output);
    let backfilled = run
        .messages
        .iter()
        .filter(|m| m.commit_lsn() == Lsn::ZERO)
        .count();
    let history = HISTORY_ROWS
        - if mode == "pending" {
            HISTORY_ROWS / PUBLISHED_EVERY
        } else {
            0
        };
    assert!(
        backfilled as i64 > history,
        "the snapshot holds the history's {history} selected rows and the writers' first rows: {backfilled} backfilled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_pending_publishes_pending_rows_and_concurrent_writes_exactly_once() {
    backfill_mode_publishes_its_rows_exactly_once("pending").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_all_publishes_every_row_and_concurrent_writes_exactly_once() {
    backfill_mode_publishes_its_rows_exactly_once("all").await;
}

/// `--backfill none`, and `pending` on a table without a status column (which the log
/// says): only what commits after the slot's consistent point is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_none_and_a_table_without_status_publish_only_what_commits_after_the_slot() {
    let s = servers();
    let mut case = Case::new(&s.pg, &s.nats, "backfill_none");
    let run = backfill_with_writers(&mut case, "none").await;
    assert!(!run.output.contains("exported snapshot"), "{}", run.output);
    assert!(
        run.messages.iter().all(|m| m.commit_lsn() > Lsn::ZERO),
        "nothing backfilled"
    );
    assert_exactly_once_in_order(&case, &run.messages, &run.expected, Some(&run.log)).await;

    let case = Case::new(&s.pg, &s.nats, "backfill_nostatus");
    case.sql()
        .await
        .batch_execute("alter table outbox_events drop column status")
        .await
        .unwrap();
    let mut sql = case.sql().await;
    support::insert_transaction(&mut sql, 100, 5, "before").await;
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    support::insert_transaction(&mut sql, 10, 5, "after").await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    relay.terminate(DEADLINE);
    let output = relay.output();
    assert!(
        output.contains(
            "the table has no status column, so no row is pending and nothing is backfilled"
        ),
        "{output}"
    );
    let messages = case.messages(&js).await;
    assert_eq!(messages.len(), 10, "only the rows committed after the slot");
}

/// A relay killed (SIGKILL) in the middle of its backfill, then restarted: the backfill
/// runs again from a new snapshot, skipping what the strict stream already holds, and
/// every row is in the stream exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_killed_midway_resumes_and_publishes_every_row_exactly_once() {
    let mut case = new_case("backfill_crash");
    let (pending, _) = insert_history(&case, HISTORY_ROWS).await;
    // A narrow window makes the backfill slow enough to be killed midway.
    case.set_env(&[("OUTBOX_RELAY_MAX_IN_FLIGHT", "8")]);
    let js = case.jetstream().await;
    let writers = writers(&case).await;
    let mut relay = case.spawn_relay();
    relay.wait_for_output(
        "created logical replication slot with an exported snapshot",
        DEADLINE,
    );
    eventually("part of the backfill in the stream", DEADLINE, || async {
        (case.stream_count(&js).await >= 2_000).then_some(())
    })
    .await;
    relay.kill();
    assert!(
        !relay.output().contains("backfill done"),
        "the backfill finished before the kill"
    );
    let before = case.stream_count(&js).await;
    assert!(
        before < pending.len() as u64,
        "killed midway: {before} stored"
    );

    let mut relay = case.start_relay();
    let log = stop_after(writers, 100).await;
    let mut expected = log.committed_ids();
    expected.extend(&pending);
    case.wait_for_count(&js, expected.len() as u64, DEADLINE * 2)
        .await;
    relay.terminate(DEADLINE);
    let output = relay.output();
    assert!(output.contains("a backfill was interrupted"), "{output}");
    assert!(output.contains("backfill done"), "{output}");
    let messages = case.messages(&js).await;
    assert_exactly_once_in_order(&case, &messages, &expected, Some(&log)).await;
}

/// The seed's polling publisher (`publisher.py`'s `publish_batch`), in Rust: claim pending
/// rows `FOR UPDATE SKIP LOCKED` (status `publishing`), publish each with `Nats-Msg-Id` =
/// the seed's dedupe key to the relay's subject for it, mark it `published`, commit.
async fn poll_once(
    sql: &mut tokio_postgres::Client,
    js: &jetstream::Context,
    prefix: &str,
    limit: i64,
) -> usize {
    let tx = sql.transaction().await.unwrap();
    let rows = tx
        .query(
            "with cte as (
               select id
               from outbox_events
               where status = 'pending'
               order by created_at asc
               limit $1
               for update skip locked
             )
             update outbox_events
             set status = 'publishing'
             where id in (select id from cte)
             returning id, entity_id, event_type, payload::text,
                       floor(extract(epoch from created_at) * 1000)::bigint",
            &[&limit],
        )
        .await
        .unwrap();
    for row in &rows {
        let (id, entity_id, event_type, payload, epoch_ms): (i64, String, String, String, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let keys = outbox::compute_keys(id, &entity_id, &event_type, epoch_ms);
        let shard = outbox::shard_for_key(NonZeroU64::new(12).unwrap(), &keys.partition_key);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", keys.dedupe_key.as_str());
        support::publish_acked(
            js,
            outbox::subject::subject(prefix, shard, &event_type),
            headers,
            payload,
        )
        .await;
        tx.execute(
            "update outbox_events
             set status = 'published',
                 attempts = attempts + 1,
                 published_at = now()
             where id = $1",
            &[&id],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    rows.len()
}

/// Part 2: the seed's poller and the relay (shared-stream mode, `--backfill pending`) run
/// at the same time over the same rows while writers insert; the stream holds each event
/// once, whoever published it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_publisher_beside_the_relay_leaves_each_event_once_in_the_stream() {
    let mut case = new_case("poller");
    let (pending, published) = insert_history(&case, 5_000).await;
    case.set_env(&[("OUTBOX_RELAY_SHARED_STREAM", "true")]);
    let js = case.jetstream().await;
    case.create_stream(
        &js,
        jetstream::stream::Config {
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        },
    )
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let polled = Arc::new(AtomicU64::new(0));
    let poller = {
        let (stop, polled, js, prefix) = (
            stop.clone(),
            polled.clone(),
            js.clone(),
            case.prefix.clone(),
        );
        let mut sql = case.sql().await;
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let n = poll_once(&mut sql, &js, &prefix, 50).await;
                polled.fetch_add(n as u64, Ordering::Relaxed);
                if n == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
    };
    let writers = writers(&case).await;
    eventually("the poller to publish", DEADLINE, || async {
        (polled.load(Ordering::Relaxed) > 100).then_some(())
    })
    .await;
    let mut relay = case.start_relay();
    let log = stop_after(writers, 200).await;
    // Every row the poller has not yet claimed is published by it too, eventually.
    let sql = case.sql().await;
    eventually(
        "the poller to publish every pending row",
        DEADLINE,
        || async {
            let left: i64 = sql_value(
                &sql,
                "select count(*) from outbox_events where status <> 'published'",
                &[],
            )
            .await;
            (left == 0).then_some(())
        },
    )
    .await;
    let mut expected = log.committed_ids();
    expected.extend(&pending);
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    stop.store(true, Ordering::SeqCst);
    poller.await.unwrap();
    relay.terminate(DEADLINE);
    let output = relay.output();
    assert!(output.contains("backfill done"), "{output}");

    let messages = case.messages(&js).await;
    let mut by_key: HashMap<String, usize> = HashMap::new();
    for message in &messages {
        *by_key
            .entry(message.header("Nats-Msg-Id").to_owned())
            .or_insert(0) += 1;
    }
    let twice: Vec<_> = by_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "held more than once: {twice:?}");
    let rows = support::rows_by_id(&sql).await;
    let keys: HashSet<String> = expected
        .iter()
        .map(|id| {
            let row = &rows[id];
            outbox::compute_keys(row.id, &row.entity_id, &row.event_type, row.created_at_ms)
                .dedupe_key
        })
        .collect();
    let stored: HashSet<String> = by_key.into_keys().collect();
    assert_eq!(
        stored, keys,
        "the stream holds exactly the history's pending rows and the writers' rows"
    );
    assert!(published.iter().all(|id| !expected.contains(id)));
    // Both publishers did part of the work: the relay stored some events first.
    assert!(
        messages
            .iter()
            .any(|m| m.headers.contains_key("Outbox-Commit-Lsn")),
        "the relay stored no event first"
    );
}

/// The seed's table partitioned by id range (the original kept aside, its id sequence reused),
/// so that the history lies in both partitions.
const PARTITIONED: &str = "
    alter table outbox_events rename to outbox_events_seed;
    create table outbox_events (like outbox_events_seed including defaults) partition by range (id);
    alter table outbox_events add primary key (id);
    create table outbox_events_low partition of outbox_events for values from (1) to (1001);
    create table outbox_events_high partition of outbox_events for values from (1001) to (maxvalue);";

/// A partitioned outbox table is backfilled through its root: the rows of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_table_is_backfilled_from_every_partition() {
    let s = servers();
    let mut case = Case::new(&s.pg, &s.nats, "backfill_partitioned");
    s.pg.psql(&case.database, PARTITIONED);
    let (pending, published) = insert_history(&case, 3_000).await;
    case.set_env(&[("OUTBOX_RELAY_BACKFILL", "all")]);
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let streamed = support::insert_transaction(&mut sql, 20, 3, "after").await;
    let mut expected: HashSet<i64> = pending.union(&published).copied().collect();
    expected.extend(streamed);
    case.wait_for_count(&js, expected.len() as u64, DEADLINE)
        .await;
    relay.terminate(DEADLINE);
    let messages = case.messages(&js).await;
    assert_exactly_once_in_order(&case, &messages, &expected, None).await;
    assert!(
        messages.iter().any(|m| m.outbox_id() <= 1000)
            && messages
                .iter()
                .any(|m| m.outbox_id() > 1000 && m.commit_lsn() == Lsn::ZERO)
    );
}

/// `outbox-relay backfill` on an existing slot: refused into a strict stream without
/// --force, naming the fix; in shared mode (or forced) it publishes the range with the keys
/// the relay gave those rows, so JetStream drops every row it already holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backfill_command_publishes_a_range_that_jetstream_dedupes_and_refuses_a_strict_stream()
{
    let case = new_case("backfill_range");
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let ids = support::insert_transaction(&mut sql, 50, 5, "relayed").await;
    case.wait_for_count(&js, 50, DEADLINE).await;
    let (from, to) = (ids[10].to_string(), ids[20].to_string());
    let backfill = |extra: &[&str], env: &[(&str, &str)]| {
        let mut command = case.relay_command("backfill");
        command
            .args(["--from-id", from.as_str(), "--to-id", to.as_str()])
            .args(extra);
        command.envs(env.iter().copied());
        command.output().unwrap()
    };

    let refused = backfill(&[], &[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("is in strict mode") && stderr.contains("--force"),
        "{stderr}"
    );

    for (extra, env) in [
        (&[][..], &[("OUTBOX_RELAY_SHARED_STREAM", "true")][..]),
        (&["--force"][..], &[][..]),
    ] {
        let done = backfill(extra, env);
        let stdout = String::from_utf8_lossy(&done.stdout);
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
        assert!(
            stdout.contains("11 rows read, 0 published, 11 dropped by JetStream as duplicates"),
            "{stdout}"
        );
    }
    relay.terminate(DEADLINE);
    assert_eq!(case.stream_count(&js).await, 50);
}
