//! Outbox tables are emptied by design (issue 36): the relay resumes by comparing its replay
//! with the stream, never with the table (`sink::resume` S2, S4), so rows deleted in their
//! inserting transaction (Debezium's remove-after-insert), by a poller's clean-up that takes
//! the stream's tail row too, by the relay's own retention, by TRUNCATE, or with a dropped
//! partition change nothing: every committed row once, in commit order, under relay kills,
//! nats-server restarts and a Postgres restart, with sessions no more than the faults plus a
//! few.
//!
//! Each run writes for two phases on private servers with a 2 s duplicate window (so most
//! restarts replay events published longer ago than the window: a replay the stream's tail
//! did not vouch for would be stored twice): 10 relay SIGKILLs and 2 nats-server restarts at
//! random moments, the writers stopped and Postgres restarted, then 10 more kills and 1 more
//! nats-server restart. `EMPTIED_SEED=<n>` replays a schedule.

use super::*;
use support::{check_faithful, last_lines, partitioned_outbox_table, WriterLog};

/// How the rows leave the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    /// Each row deleted in the transaction that inserts it (Debezium's remove-after-insert).
    DeletedInTransaction,
    /// A poller's clean-up: every row up to the stream's last message's id deleted, tail row
    /// included, every 20–80 ms (with concurrent writers, rows not yet relayed too), while the
    /// relay marks what it relayed `published` (`--mark-published`, the documented migration).
    PollerCleanup,
    /// The relay's own retention, with a 1 s grace. It deletes only rows the slot confirmed,
    /// so it never took the stream's tail row with unconfirmed events behind it: a guard, not
    /// a case the table check got wrong.
    Retention,
    /// `TRUNCATE outbox_events` every 300–800 ms.
    Truncate,
    /// A table partitioned by id range (100 rows a partition), its oldest partition detached
    /// and dropped as soon as rows go to the next one: rows not yet relayed, the stream's tail
    /// row among them, go with it.
    DroppedPartition,
}

/// Rows per partition of [`Lifecycle::DroppedPartition`]'s table.
const PARTITION_ROWS: i64 = 100;
/// Partitions created ahead (a default partition takes the rest).
const PARTITIONS: i64 = 150;

/// The seed's table partitioned by id (a unique key must include the partition key).
fn partitioned_by_id() -> String {
    let mut sql = partitioned_outbox_table("primary key (id), unique (dedupe_key, id)", "id");
    sql.push_str("create table outbox_events_default partition of outbox_events default;");
    for k in 0..PARTITIONS {
        sql.push_str(&format!(
            "create table outbox_events_p{k} partition of outbox_events for values from ({}) to ({});",
            k * PARTITION_ROWS,
            (k + 1) * PARTITION_ROWS
        ));
    }
    sql
}

/// A writer's transactions: 1–20 rows over 1–10 entities, one in ten rolled back.
fn lifecycle_plans(seed: u64, delete: bool) -> impl FnMut() -> Plan + Send + 'static {
    let mut rng = StdRng::seed_from_u64(seed);
    move || Plan {
        size: rng.random_range(1..=20),
        entities: rng.random_range(1..=10),
        offset: rng.random_range(0..1000),
        event_types: EVENT_TYPES,
        commit: rng.random_bool(0.9),
        delete,
        pause: Duration::from_millis(rng.random_range(10..60)),
    }
}

/// Deletes rows as `lifecycle` says until `stop`; returns how many rounds deleted something.
async fn delete_rows(
    lifecycle: Lifecycle,
    case: Case,
    js: jetstream::Context,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rounds = 0;
    let mut oldest = 0;
    let mut sql: Option<tokio_postgres::Client> = None;
    while !stop.load(Ordering::SeqCst) {
        let pause = match lifecycle {
            Lifecycle::Truncate => rng.random_range(300..800),
            _ => rng.random_range(20..80),
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let client = match sql.as_ref() {
            Some(client) if !client.is_closed() => client,
            _ => {
                sql = sql_connect(&case.pg_url).await.ok();
                continue;
            }
        };
        let deleted = match lifecycle {
            Lifecycle::PollerCleanup => match stream_tail(&js, &case.stream).await {
                Some((_, Some((tail_id, _)))) => client
                    .execute("delete from outbox_events where id <= $1", &[&tail_id])
                    .await
                    .map(|n| n > 0),
                _ => Ok(false),
            },
            Lifecycle::Truncate => client
                .batch_execute("truncate outbox_events")
                .await
                .map(|()| true),
            Lifecycle::DroppedPartition => {
                let newest: Result<Option<i64>, _> = client
                    .query_one("select max(id) from outbox_events", &[])
                    .await
                    .map(|row| row.get(0));
                match newest {
                    Ok(Some(newest))
                        if oldest < PARTITIONS && newest >= (oldest + 2) * PARTITION_ROWS =>
                    {
                        let dropped = client
                            .batch_execute(&format!(
                                "alter table outbox_events detach partition outbox_events_p{oldest}; \
                                 drop table outbox_events_p{oldest}"
                            ))
                            .await;
                        if dropped.is_ok() {
                            oldest += 1;
                        }
                        dropped.map(|()| true)
                    }
                    Ok(_) => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Lifecycle::DeletedInTransaction | Lifecycle::Retention => Ok(false),
        };
        match deleted {
            Ok(true) => rounds += 1,
            Ok(false) => {}
            // Postgres restarting: connect again.
            Err(_) => sql = None,
        }
    }
    rounds
}

/// What one phase injected.
#[derive(Debug, Default)]
struct Injected {
    relay_kills: usize,
    nats_restarts: usize,
}

/// One phase: writers, and `kills` relay SIGKILLs and `nats_restarts` nats-server restarts
/// at random moments; returns what the writers did, their writer numbers from `first_writer`.
#[allow(clippy::too_many_arguments)]
async fn phase(
    relay: &mut Relay,
    nats: &mut Nats,
    case: &Case,
    rng: &mut StdRng,
    delete: bool,
    first_writer: usize,
    (kills, nats_restarts): (usize, usize),
    injected: &mut Injected,
) -> WriterLog {
    let plans: Vec<_> = (0..2)
        .map(|_| lifecycle_plans(rng.random(), delete))
        .collect();
    let writers = Writers::start_with(&case.pg_url, Ledger::default(), plans);
    let mut schedule = vec![true; kills];
    schedule.extend(vec![false; nats_restarts]);
    schedule.shuffle(rng);
    for kill in schedule {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1200))).await;
        if kill {
            relay.kill();
            relay.start();
            injected.relay_kills += 1;
        } else {
            tokio::task::block_in_place(|| {
                nats.kill();
                nats.start_again();
            });
            injected.nats_restarts += 1;
        }
    }
    let mut log = writers.stop().await;
    for record in &mut log.transactions {
        record.writer += first_writer;
    }
    log
}

/// How many lifecycles run at once (their relay kills and server restarts overlap, which is
/// more load and more interleavings, never a weaker check: each has its own servers).
pub(super) const EMPTIED_AT_ONCE: usize = 2;
static EMPTIED: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(EMPTIED_AT_ONCE);

async fn emptied(lifecycle: Lifecycle) {
    let _serial = SERIAL.read().await;
    let _one_of_few = EMPTIED.acquire().await.unwrap();
    let started = Instant::now();
    let seed = seed_from_env("EMPTIED_SEED", &format!("emptied {lifecycle:?}"));
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut pg, mut nats) = tokio::task::block_in_place(|| (Postgres::start(), Nats::start()));
    let mut case = Case::new(&pg, &nats, &format!("{lifecycle:?}").to_lowercase());
    case.extra_env.extend(
        [
            ("OUTBOX_RELAY_DUPLICATE_WINDOW", "2s"),
            ("OUTBOX_RELAY_ACK_TIMEOUT", "2s"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    if lifecycle == Lifecycle::PollerCleanup {
        case.extra_env
            .push(("OUTBOX_RELAY_MARK_PUBLISHED".into(), "true".into()));
    }
    if lifecycle == Lifecycle::Retention {
        case.extra_env.extend(
            [
                ("OUTBOX_RELAY_RETENTION_GRACE", "1s"),
                ("OUTBOX_RELAY_RETENTION_INTERVAL", "1s"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
        );
    }
    pg.psql(
        &case.database,
        "create table writer_commits (tag text primary key)",
    );
    if lifecycle == Lifecycle::DroppedPartition {
        pg.psql(&case.database, &partitioned_by_id());
    }
    let mut relay = Relay::new(case.clone());
    relay.start();
    relay.wait_streaming(DEADLINE).await;
    let js = jetstream_with_timeout(&case.nats_url).await;
    let stop = Arc::new(AtomicBool::new(false));
    let deleter = tokio::spawn(delete_rows(
        lifecycle,
        case.clone(),
        js.clone(),
        stop.clone(),
        rng.random(),
    ));

    let delete = lifecycle == Lifecycle::DeletedInTransaction;
    let mut injected = Injected::default();
    let mut log = phase(
        &mut relay,
        &mut nats,
        &case,
        &mut rng,
        delete,
        0,
        (10, 2),
        &mut injected,
    )
    .await;
    if lifecycle == Lifecycle::Retention {
        // Retention deletes only while a session streams (its rounds wait at least 6 s for
        // the slot to confirm): with the kills stopped, it empties the table of the first
        // phase's rows, so the second phase's restarts meet a tail whose row is gone.
        let sql = sql_connect_retrying(&case.pg_url).await;
        eventually(
            "retention to empty the table",
            Duration::from_secs(90),
            || async {
                let left: i64 = sql
                    .query_one("select count(*) from outbox_events", &[])
                    .await
                    .ok()?
                    .get(0);
                (left == 0).then_some(())
            },
        )
        .await;
    }
    tokio::task::block_in_place(|| pg.restart());
    let second = phase(
        &mut relay,
        &mut nats,
        &case,
        &mut rng,
        delete,
        2,
        (10, 1),
        &mut injected,
    )
    .await;
    log.transactions.extend(second.transactions);
    log.rolled_back.extend(second.rolled_back);

    // Every committed row in the stream, and the slot confirmed past the last one.
    let sql = sql_connect_retrying(&case.pg_url).await;
    let expected = log.committed_rows() as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        relay.assert_alive();
        let count = case.stream_count(&js).await;
        let confirmed = match stream_tail(&js, &case.stream).await {
            Some((_, Some((_, last_lsn)))) => case.confirmed_flush_lsn(&sql).await > last_lsn,
            _ => false,
        };
        if (count >= expected && confirmed) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let deleting_rounds = deleter.await.unwrap();
    let messages = case.messages(&js).await;
    let findings = check_faithful(&messages, &log);
    let output = relay.output();
    let sessions = lines_with(&output, &[support::STREAMING]);
    let faults = injected.relay_kills + injected.nats_restarts + 1;
    let left_in_table: i64 = sql
        .query_one("select count(*) from outbox_events", &[])
        .await
        .unwrap()
        .get(0);
    let (committed_tx, committed_rows) = log.count(Outcome::Committed);
    eprintln!(
        "emptied {lifecycle:?}: seed {seed}; {committed_rows} rows committed in {committed_tx} transactions, \
         {left_in_table} left in the table ({deleting_rounds} deleting rounds); injected {} relay SIGKILLs, \
         {} nats-server restarts, 1 Postgres restart; {sessions} sessions; stream holds {}; found: {}; {:.1}s",
        injected.relay_kills,
        injected.nats_restarts,
        messages.len(),
        findings.summary(),
        started.elapsed().as_secs_f64()
    );
    if !findings.is_faithful() {
        eprintln!("relay output ends:\n{}", last_lines(&output, 80));
    }
    findings.assert_faithful();
    assert!(committed_rows > 0, "the writers committed nothing");
    assert!(
        sessions <= 1 + faults + 6,
        "{sessions} sessions for {faults} faults: a session loop?\n{}",
        last_lines(&output, 60)
    );
    if lifecycle != Lifecycle::Retention {
        assert!(
            delete || deleting_rounds > 0,
            "the {lifecycle:?} deleter never deleted anything"
        );
    } else {
        assert!(
            (left_in_table as usize) < committed_rows,
            "retention deleted nothing"
        );
    }
}

/// One test per [`Lifecycle`], each running [`emptied`].
macro_rules! lifecycles {
    ($($(#[$doc:meta])* $name:ident: $lifecycle:ident;)*) => {$(
        $(#[$doc])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            emptied(Lifecycle::$lifecycle).await;
        }
    )*};
}

lifecycles! {
    /// Debezium's remove-after-insert: every row deleted in its inserting transaction.
    rows_deleted_in_their_inserting_transaction_are_relayed_once_in_order: DeletedInTransaction;
    /// A poller's clean-up deleting what the stream holds, the tail's row included.
    a_pollers_clean_up_deleting_the_tails_row_changes_nothing: PollerCleanup;
    /// The relay's own retention with a short grace.
    the_relays_own_retention_with_a_short_grace_changes_nothing: Retention;
    /// TRUNCATE while the relay streams, is killed and restarts.
    a_truncated_table_changes_nothing: Truncate;
    /// The oldest partition of a partitioned outbox table detached and dropped.
    dropped_partitions_change_nothing: DroppedPartition;
}
