//! Fault injection against the real servers (issue 3): the stream stays a faithful copy of
//! the committed outbox rows (each exactly once, in commit order, nothing of a rolled-back
//! transaction) whatever fails, and the slot never confirms past an event that was not
//! stored.
//!
//! - [`torture`]: one run on private servers; the relay reaches NATS and Postgres through
//!   `testkit::Proxy`s so connections can be cut at chosen moments. While writers commit and
//!   roll back transactions of 1 to 1000 rows, the relay is SIGKILLed and restarted 20+ times,
//!   nats-server restarted 3 times, Postgres crashed once, the NATS connection cut with acks
//!   held back mid-window and the replication connection cut mid-transaction; the slot's
//!   `confirmed_flush_lsn` and the stream's last sequence are sampled every ~100 ms.
//! - The dedupe-window outage: a relay killed after publishing part of a 10 000-row
//!   transaction and before confirming it stays down 15 s with a 5 s duplicate window: strict
//!   mode adds no duplicate; shared mode (dedupe only) is shown to duplicate, and warns.
//!
//! Every test prints what it injected and what it found. The torture test's seed is printed;
//! `FAULTS_SEED=<n>` replays a schedule.

#![allow(clippy::unwrap_used)]
mod support;

/// Issue 36: the same faults while the table is emptied, every way users empty it.
#[path = "faults/emptied.rs"]
mod emptied;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgoutput::Lsn;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use support::{
    assert_matches_row, attempt, check_stream, eventually, insert_transaction,
    jetstream_with_timeout, last_lines, lines_with, rows, servers, sql_connect,
    sql_connect_retrying, stream_tail, strip_ansi, Case, Ledger, Outcome, Plan, Relay, Sampler,
    Stored, TxRecord, Writers, DEADLINE,
};
use testkit::{Nats, Postgres, Proxy};

/// The torture test owns the machine while it runs; the dedupe-window tests and the emptied
/// lifecycles run beside each other (each on private servers, mostly waiting on them: the
/// binary kept the two cores 37 % busy), at most [`emptied::EMPTIED_AT_ONCE`] lifecycles at
/// a time.
static SERIAL: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

// -----------------------------------------------------------------------------------------
// Writers: transactions of 1, 10, 100 and 1000 rows, committed or rolled back, each recorded
// in the ledger with what its client knows about its outcome.
// -----------------------------------------------------------------------------------------

/// The event types the torture test's rows cycle through (one the subject must escape).
const EVENT_TYPES: &[&str] = &["OrderPaid", "OrderShipped", "order.refunded"];

/// A writer's transactions: random size (1, 10, 100 or 1000 rows) over a random number of
/// entities, one in five rolled back, at a random pace.
fn random_plans(seed: u64) -> impl FnMut() -> Plan + Send + 'static {
    let mut rng = StdRng::seed_from_u64(seed);
    move || Plan {
        size: *[1, 10, 100, 1000]
            .choose_weighted(&mut rng, |&size| match size {
                1 => 40,
                10 => 30,
                100 => 25,
                _ => 5,
            })
            .unwrap(),
        entities: rng.random_range(1..=25),
        offset: rng.random_range(0..1000),
        event_types: EVENT_TYPES,
        commit: rng.random_bool(0.8),
        delete: false,
        pause: Duration::from_millis(rng.random_range(30..250)),
    }
}

/// One transaction of `size` rows from the fault injector, committed.
fn injector_plan(size: usize) -> Plan {
    Plan {
        size,
        entities: 40,
        offset: 0,
        event_types: EVENT_TYPES,
        commit: true,
        delete: false,
        pause: Duration::ZERO,
    }
}

/// A crash-time writer: one-row transactions back to back on one connection until the
/// connection fails, so that the crash cuts off some INSERT or COMMIT (whose outcome the
/// ledger then settles).
async fn storm_writer(writer: usize, url: String, ledger: Ledger, stop: Arc<AtomicBool>) {
    let Ok(mut sql) = sql_connect(&url).await else {
        return;
    };
    let plan = Plan {
        size: 1,
        entities: 1,
        ..injector_plan(1)
    };
    let mut seq = 0;
    while !stop.load(Ordering::Relaxed) {
        let result = attempt(&mut sql, &plan, &format!("storm{writer}-{seq}")).await;
        let failed = result.is_err();
        if let Some(attempt) = result.map_or_else(|attempt| attempt, Some) {
            ledger.record(TxRecord::new(writer, seq, attempt));
            seq += 1;
        }
        if failed {
            return;
        }
    }
}

// -----------------------------------------------------------------------------------------
// The torture test.
// -----------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fault {
    KillRelay,
    RestartNats,
    CrashPostgres,
    CutNatsMidWindow,
    CutReplicationMidTransaction,
}

/// Counters of what was injected.
#[derive(Debug, Default)]
struct Injected {
    relay_kills: usize,
    relay_kills_mid_transaction: usize,
    nats_restarts: usize,
    nats_restarts_mid_transaction: usize,
    postgres_crashes: usize,
    nats_cuts: usize,
    nats_cuts_caught_mid_transaction: usize,
    nats_cuts_with_acks_held: usize,
    replication_cuts: usize,
    replication_cuts_caught_mid_transaction: usize,
    /// How long the relay took, on its own, to store the rest of a transaction caught by a
    /// fault.
    recoveries: Vec<(&'static str, Duration)>,
}

/// Everything the fault injector needs.
struct Rig {
    pg: Postgres,
    nats: Nats,
    pg_proxy: Proxy,
    nats_proxy: Proxy,
    case: Case,
    relay: Relay,
    js: jetstream::Context,
    ledger: Ledger,
    rng: StdRng,
    injector_seq: usize,
    injected: Injected,
}

/// The fault injector's own transactions are recorded as this writer's.
const INJECTOR: usize = 99;
/// The crash-time writers are these and the next few.
const STORM: usize = 100;
const STORM_WRITERS: usize = 4;

impl Rig {
    /// Commits a `size`-row transaction from the injector (retrying while Postgres is
    /// unreachable) and returns its record.
    async fn commit_big_transaction(&mut self, size: usize) -> TxRecord {
        let mut sql = sql_connect_retrying(&self.case.pg_url).await;
        loop {
            let tag = format!("injector-{}", self.injector_seq);
            let result = attempt(&mut sql, &injector_plan(size), &tag).await;
            let (done, record) = match result {
                Ok(attempt) => (true, Some(attempt)),
                Err(attempt) => (false, attempt),
            };
            if let Some(attempt) = record {
                let record = TxRecord::new(INJECTOR, self.injector_seq, attempt);
                self.injector_seq += 1;
                self.ledger.record(record.clone());
                if done {
                    return record;
                }
            }
            sql = sql_connect_retrying(&self.case.pg_url).await;
        }
    }

    /// Commits a `size`-row transaction and returns as soon as the stream's last message is
    /// one of its rows but not its last one: the relay is in the middle of publishing it.
    /// `None` if it was stored entirely before that was seen.
    ///
    /// With `--atomic-transactions` (`TESTKIT_RELAY_ENV`) the transaction has at least 2 500
    /// rows: an atomic batch is never seen half stored, but a transaction above the batch
    /// limit is several batches, and the tail stands between them while the relay publishes.
    async fn catch_mid_transaction(&mut self, size: usize) -> Option<Caught> {
        let size = if self.case.atomic_transactions() {
            size.max(2500)
        } else {
            size
        };
        self.relay.wait_streaming(DEADLINE).await;
        let record = self.commit_big_transaction(size).await;
        let ids: HashSet<i64> = record.ids.iter().copied().collect();
        let caught = Caught {
            last_id: *record.ids.last().unwrap(),
            after_commit: record.after_commit.unwrap_or(Lsn(u64::MAX)),
            sequence: 0,
        };
        let deadline = Instant::now() + DEADLINE;
        while Instant::now() < deadline {
            if let Some((sequence, Some((id, lsn)))) =
                stream_tail(&self.js, &self.case.stream).await
            {
                if ids.contains(&id) {
                    return (id != caught.last_id).then_some(Caught { sequence, ..caught });
                }
                if lsn >= caught.after_commit {
                    return None;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!(
            "the relay did not publish the injector's transaction within {DEADLINE:?}; relay output ends:\n{}",
            last_lines(&self.relay.output(), 60)
        );
    }

    /// [`Rig::catch_mid_transaction`], up to five times.
    async fn catch_mid_transaction_retrying(&mut self, size: usize) -> Option<Caught> {
        for _ in 0..5 {
            if let Some(caught) = self.catch_mid_transaction(size).await {
                return Some(caught);
            }
        }
        None
    }

    /// Waits until the relay, on its own, stored the rest of the caught transaction: it
    /// recovered from the fault. Returns how long that took.
    async fn wait_recovered(&mut self, caught: &Caught, since: Instant) -> Duration {
        let deadline = since + DEADLINE;
        loop {
            self.relay.assert_alive();
            if let Some((_, Some((id, lsn)))) = stream_tail(&self.js, &self.case.stream).await {
                if id == caught.last_id || lsn >= caught.after_commit {
                    return since.elapsed();
                }
            }
            assert!(
                Instant::now() < deadline,
                "the relay did not recover within {DEADLINE:?}; its output ends:\n{}",
                last_lines(&self.relay.output(), 60)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn inject(&mut self, fault: Fault) {
        self.relay.assert_alive();
        match fault {
            Fault::KillRelay => {
                // Half of the kills at a random moment, half while a transaction is being
                // published (publishes in flight, nothing of it confirmed).
                if self.rng.random_bool(0.5) && self.catch_mid_transaction(1000).await.is_some() {
                    self.injected.relay_kills_mid_transaction += 1;
                }
                self.relay.kill();
                self.injected.relay_kills += 1;
                let down = self.rng.random_range(0..1000);
                tokio::time::sleep(Duration::from_millis(down)).await;
                self.relay.start();
            }
            Fault::RestartNats => {
                // While a big transaction is being published, if that can be caught at once.
                let caught = self.catch_mid_transaction(5000).await;
                let down = Duration::from_millis(self.rng.random_range(200..2000));
                let since = Instant::now();
                let nats = &mut self.nats;
                tokio::task::block_in_place(|| {
                    nats.kill();
                    std::thread::sleep(down);
                    nats.start_again();
                });
                self.injected.nats_restarts += 1;
                if let Some(caught) = caught {
                    self.injected.nats_restarts_mid_transaction += 1;
                    let took = self.wait_recovered(&caught, since).await;
                    self.injected.recoveries.push(("nats-server restart", took));
                }
            }
            Fault::CrashPostgres => {
                // Commits back to back while Postgres crashes: some are cut off mid-COMMIT.
                let stop = Arc::new(AtomicBool::new(false));
                let storms: Vec<_> = (0..STORM_WRITERS)
                    .map(|i| {
                        tokio::spawn(storm_writer(
                            STORM + i,
                            self.case.pg_url.clone(),
                            self.ledger.clone(),
                            stop.clone(),
                        ))
                    })
                    .collect();
                eventually("the storm writers to commit", DEADLINE, || async {
                    let storms = self.ledger.count(|r| r.writer >= STORM);
                    (storms >= 10 * STORM_WRITERS).then_some(())
                })
                .await;
                let down = Duration::from_millis(self.rng.random_range(500..2000));
                let pg = &mut self.pg;
                tokio::task::block_in_place(|| {
                    pg.crash();
                    stop.store(true, Ordering::Relaxed);
                    std::thread::sleep(down);
                    pg.start_again();
                });
                for storm in storms {
                    storm.await.unwrap();
                }
                self.injected.postgres_crashes += 1;
            }
            Fault::CutNatsMidWindow => {
                self.injected.nats_cuts += 1;
                let caught = self.catch_mid_transaction_retrying(1000).await;
                let since = Instant::now();
                if let Some(caught) = &caught {
                    self.injected.nats_cuts_caught_mid_transaction += 1;
                    // Replies (acks) are held from here: whatever the relay publishes now is
                    // stored but never acknowledged.
                    self.nats_proxy.set_blackhole(true);
                    let deadline = Instant::now() + Duration::from_secs(2);
                    while Instant::now() < deadline {
                        if stream_tail(&self.js, &self.case.stream)
                            .await
                            .is_some_and(|(sequence, _)| sequence > caught.sequence)
                        {
                            self.injected.nats_cuts_with_acks_held += 1;
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                self.nats_proxy.cut();
                self.nats_proxy.set_blackhole(false);
                if let Some(caught) = caught {
                    let took = self.wait_recovered(&caught, since).await;
                    self.injected.recoveries.push(("NATS connection cut", took));
                }
            }
            Fault::CutReplicationMidTransaction => {
                self.injected.replication_cuts += 1;
                let caught = self.catch_mid_transaction_retrying(1000).await;
                let since = Instant::now();
                self.pg_proxy.cut();
                if let Some(caught) = caught {
                    self.injected.replication_cuts_caught_mid_transaction += 1;
                    let took = self.wait_recovered(&caught, since).await;
                    self.injected
                        .recoveries
                        .push(("replication connection cut", took));
                }
            }
        }
    }
}

/// A transaction caught while the relay was publishing it.
#[derive(Debug, Clone, Copy)]
struct Caught {
    /// The stream's last sequence when it was caught.
    sequence: u64,
    /// Its last row.
    last_id: i64,
    /// Its commit record starts before this.
    after_commit: Lsn,
}

/// The torture test: see the module docs.
/// The table where a writer that deletes its rows records its committed transactions
/// (`Plan::delete`).
fn rig_deleting_writer(pg: &Postgres, case: &Case) {
    pg.psql(
        &case.database,
        "create table writer_commits (tag text primary key)",
    );
}

/// The seed of a randomised test: `$var` when set (to replay a run), else a random one;
/// printed, after `what`, with how to replay the run.
fn seed_from_env(var: &str, what: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .map(|s| s.parse().unwrap_or_else(|_| panic!("{var} is a u64")))
        .unwrap_or_else(rand::random);
    eprintln!("{what}: seed {seed} (replay with {var}={seed})");
    seed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn torture() {
    let _serial = SERIAL.write().await;
    let started = Instant::now();
    let seed = seed_from_env("FAULTS_SEED", "torture");
    let mut rng = StdRng::seed_from_u64(seed);

    let (pg, nats) = tokio::task::block_in_place(|| (Postgres::start(), Nats::start()));
    let pg_proxy = Proxy::start(loopback(pg.port()));
    let nats_proxy = Proxy::start(loopback(nats.port()));
    let mut case = Case::new(&pg, &nats, "torture");
    case.extra_env
        .push(("OUTBOX_RELAY_ACK_TIMEOUT".into(), "2s".into()));
    // The relay's view: both servers through the proxies. The test's own connections (writers,
    // sampler, checks) go direct.
    let relay_case = Case {
        pg_url: format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            pg_proxy.port(),
            case.database
        ),
        nats_url: format!("nats://127.0.0.1:{}", nats_proxy.port()),
        ..case.clone()
    };
    let mut relay = Relay::new(relay_case);
    relay.start();
    relay.wait_streaming(DEADLINE).await;

    let js = jetstream_with_timeout(&case.nats_url).await;
    const WRITERS: usize = 3;
    let mut plans: Vec<Box<dyn FnMut() -> Plan + Send>> = (0..WRITERS)
        .map(|_| Box::new(random_plans(rng.random())) as Box<dyn FnMut() -> Plan + Send>)
        .collect();
    // Issue 36: a fourth writer deletes its rows in the transaction that inserts them
    // (Debezium's remove-after-insert), so the stream's tail is often a row that is gone.
    rig_deleting_writer(&pg, &case);
    let mut deleting = random_plans(rng.random());
    plans.push(Box::new(move || Plan {
        delete: true,
        ..deleting()
    }));
    let writers = Writers::start_with(&case.pg_url, Ledger::default(), plans);
    let sampler = Sampler::start(&case, js.clone());

    // The schedule: shuffled, with random gaps.
    let mut schedule = vec![Fault::KillRelay; 22];
    schedule.extend([Fault::RestartNats; 3]);
    schedule.push(Fault::CrashPostgres);
    schedule.extend([Fault::CutNatsMidWindow; 2]);
    schedule.extend([Fault::CutReplicationMidTransaction; 2]);
    schedule.shuffle(&mut rng);
    let mut rig = Rig {
        pg,
        nats,
        pg_proxy,
        nats_proxy,
        case: case.clone(),
        relay,
        js: js.clone(),
        ledger: writers.ledger().clone(),
        rng,
        injector_seq: 0,
        injected: Injected::default(),
    };
    for (n, fault) in schedule.iter().enumerate() {
        let gap = rig.rng.random_range(500..2500);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let at = started.elapsed();
        rig.inject(*fault).await;
        eprintln!(
            "torture: fault {}/{} at {:.1}s: {fault:?} ({:.1}s)",
            n + 1,
            schedule.len(),
            at.as_secs_f64(),
            (started.elapsed() - at).as_secs_f64()
        );
    }
    let faults_done = started.elapsed();
    // Stopped, and settled what the writers could not know: did the transactions whose
    // COMMIT was cut off by the crash commit?
    let log = writers.stop().await;
    rig.relay.assert_alive();
    let sql = sql_connect_retrying(&case.pg_url).await;
    let committed: HashSet<i64> = log
        .transactions
        .iter()
        .filter(|r| r.outcome == Outcome::Committed && !r.deleted)
        .flat_map(|r| r.ids.iter().copied())
        .collect();
    let table = rows(&sql).await;
    let table_ids: HashSet<i64> = table.iter().map(|r| r.id).collect();
    assert_eq!(
        table_ids, committed,
        "the ledger knows exactly the table's rows"
    );

    // With the relay running: wait until the stream holds every committed row and the slot
    // confirmed past the last one (or a deadline: then the check below says what is missing).
    let expected = log.committed_rows() as u64;
    let catch_up_deadline = Instant::now() + Duration::from_secs(180);
    loop {
        rig.relay.assert_alive();
        let count = case.stream_count(&js).await;
        if count >= expected {
            break;
        }
        if Instant::now() >= catch_up_deadline {
            eprintln!("torture: the stream holds {count} of {expected} rows at the deadline");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let caught_up = started.elapsed();
    let (last_lsn, final_confirmed) = match stream_tail(&js, &case.stream).await {
        Some((_, Some((_, last_lsn)))) => {
            let deadline = Instant::now() + DEADLINE;
            loop {
                let confirmed = case.confirmed_flush_lsn(&sql).await;
                if confirmed > last_lsn || Instant::now() >= deadline {
                    break (last_lsn, confirmed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        _ => panic!("the stream has no last message"),
    };
    let samples = sampler.stop().await;

    let messages = case.messages(&js).await;
    let findings = check_stream(&messages, &log, &samples);
    let by_id: HashMap<i64, &support::Row> = table.iter().map(|r| (r.id, r)).collect();
    for message in &messages {
        if let Some(row) = by_id.get(&message.outbox_id()) {
            assert_matches_row(&case, message, row);
        }
    }

    let output = rig.relay.output();
    let log_path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("faults-torture-{seed}.log"));
    std::fs::write(&log_path, &output).unwrap();
    let (committed_tx, committed_rows) = log.count(Outcome::Committed);
    let (rolled_back_tx, rolled_back_rows) = log.count(Outcome::RolledBack);
    let (aborted_tx, aborted_rows) = log.count(Outcome::Aborted);
    let injected = &rig.injected;
    eprintln!(
        "torture: seed {seed}; faults injected: relay SIGKILL+restart {} ({} while a transaction was being published), \
         nats-server SIGKILL+restart {} ({} while a transaction was being published), Postgres crashes {}, \
         NATS connection cuts {} ({} caught mid-transaction, {} with publishes stored while their acks were held), \
         replication connection cuts {} ({} caught mid-transaction); relay sessions ended and resumed {} \
         ({} on an ack timeout, {} on a fence refusal)",
        injected.relay_kills,
        injected.relay_kills_mid_transaction,
        injected.nats_restarts,
        injected.nats_restarts_mid_transaction,
        injected.postgres_crashes,
        injected.nats_cuts,
        injected.nats_cuts_caught_mid_transaction,
        injected.nats_cuts_with_acks_held,
        injected.replication_cuts,
        injected.replication_cuts_caught_mid_transaction,
        lines_with(&output, &["relay session ended"]),
        lines_with(&output, &["relay session ended", "ack in time"]),
        lines_with(&output, &["relay session ended", "is not what this relay published last"]),
    );
    eprintln!(
        "torture: events: {committed_rows} rows committed in {committed_tx} transactions ({} + {} in doubt after the crash: committed / not), \
         {rolled_back_rows} rows rolled back in {rolled_back_tx}, {aborted_rows} rows in {aborted_tx} transactions cut off by the crash (not committed); \
         stream holds {} messages; {} samples of (confirmed_flush_lsn, last_sequence); slot finally at {final_confirmed} \
         (last event's commit {last_lsn})",
        log.settled_in_doubt.0,
        log.settled_in_doubt.1,
        messages.len(),
        samples.len(),
    );
    eprintln!(
        "torture: found: lost {}, duplicated {} (by Nats-Msg-Id {}), reordered {} (out of position {}, split transactions {}, writer order {}), \
         rolled-back published {}, unknown published {}, commit LSN outside the writer's bounds {}, sequence gaps {}, \
         samples confirming past an unstored event {}",
        findings.lost,
        findings.duplicated,
        findings.duplicated_msg_ids,
        findings.reordered,
        findings.out_of_position,
        findings.split_transactions,
        findings.writer_order,
        findings.rolled_back_published,
        findings.unknown_published,
        findings.commit_lsn_outside_bounds,
        findings.sequence_gaps,
        findings.confirmed_past_unstored,
    );
    let recoveries: Vec<String> = injected
        .recoveries
        .iter()
        .map(|(what, took)| format!("{what} {:.1}s", took.as_secs_f64()))
        .collect();
    eprintln!(
        "torture: the relay recovered on its own (rest of the caught transaction stored) after: {}",
        recoveries.join(", ")
    );
    eprintln!(
        "torture: faults phase {:.1}s, caught up at {:.1}s, total {:.1}s; relay log: {}",
        faults_done.as_secs_f64(),
        caught_up.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        log_path.display()
    );
    findings.assert_faithful();
    assert!(
        final_confirmed > last_lsn,
        "the slot confirmed {final_confirmed}, not past the last stored transaction (commit {last_lsn})"
    );
    assert!(
        injected.relay_kills >= 20 && injected.nats_restarts >= 3 && injected.postgres_crashes >= 1
    );
    assert!(
        injected.nats_cuts_caught_mid_transaction >= 1,
        "no NATS cut landed while a transaction was being published"
    );
    assert!(
        injected.replication_cuts_caught_mid_transaction >= 1,
        "no replication cut landed while a transaction was being published"
    );
    assert!(committed_rows > 0 && rolled_back_rows > 0);
    assert!(
        samples.len() > 100,
        "too few samples of the slot and the stream"
    );
    drop(rig);
}

// -----------------------------------------------------------------------------------------
// The dedupe-window outage.
// -----------------------------------------------------------------------------------------

/// The relay's window in this scenario: exactly this many publishes of the big transaction
/// reach the stream while their acks are held.
const IN_FLIGHT: u64 = 500;
const ROWS: usize = 10_000;
/// The outage: three duplicate windows.
const OUTAGE: Duration = Duration::from_secs(15);

#[derive(Debug)]
struct OutageResult {
    case: Case,
    ids: Vec<i64>,
    stored_at_kill: u64,
    commit_lsn: Lsn,
    confirmed_at_kill: Lsn,
    messages: Vec<Stored>,
    output: String,
    /// (lost, duplicated, reordered) by [`tally`].
    tally: (usize, usize, usize),
    /// How long the run took.
    seconds: f64,
}

/// A relay publishes part of a 10 000-row transaction (acks held back by the proxy, so it
/// confirms nothing), is SIGKILLed, stays down for [`OUTAGE`] against a 5 s duplicate
/// window, and is restarted; returns what the stream holds once the slot confirmed the
/// transaction.
async fn outage_past_the_duplicate_window(name: &str, shared_stream: bool) -> OutageResult {
    let _serial = SERIAL.read().await;
    let started = Instant::now();
    let s = servers();
    let nats_proxy = Proxy::start(loopback(s.nats.port()));
    let mut case = Case::new(&s.pg, &s.nats, name);
    case.extra_env.extend([
        ("OUTBOX_RELAY_DUPLICATE_WINDOW".into(), "5s".into()),
        ("OUTBOX_RELAY_MAX_IN_FLIGHT".into(), IN_FLIGHT.to_string()),
        (
            "OUTBOX_RELAY_SHARED_STREAM".into(),
            shared_stream.to_string(),
        ),
        ("OUTBOX_RELAY_ACK_TIMEOUT".into(), "60s".into()),
    ]);
    let relay_case = Case {
        nats_url: format!("nats://127.0.0.1:{}", nats_proxy.port()),
        ..case.clone()
    };
    let mut relay = tokio::task::block_in_place(|| relay_case.start_relay());
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let mut stream = js.get_stream(&case.stream).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.duplicate_window,
        Duration::from_secs(5),
        "the relay created its stream with the configured duplicate window"
    );

    // From here the relay's publishes are stored, but no ack reaches it.
    nats_proxy.set_blackhole(true);
    let ids = insert_transaction(&mut sql, ROWS, 50, "ten-thousand").await;
    case.wait_for_count(&js, IN_FLIGHT, DEADLINE).await;
    tokio::task::block_in_place(|| relay.kill());
    let stored_at_kill = case.stream_count(&js).await;
    assert!(
        stored_at_kill > 0 && stored_at_kill < ROWS as u64,
        "the stream must hold part of the transaction at the kill: {stored_at_kill}"
    );
    let first = stream.get_raw_message(1).await.unwrap();
    let commit_lsn: Lsn = first
        .headers
        .get("Outbox-Commit-Lsn")
        .unwrap()
        .as_str()
        .parse()
        .unwrap();
    let confirmed_at_kill = case.confirmed_flush_lsn(&sql).await;
    assert!(
        confirmed_at_kill <= commit_lsn,
        "nothing of the transaction may be confirmed: the slot is at {confirmed_at_kill}, the transaction commits at {commit_lsn}"
    );
    nats_proxy.set_blackhole(false);

    // The outage itself: the relay is down for three duplicate windows.
    tokio::time::sleep(OUTAGE).await;
    let relay = tokio::task::block_in_place(|| relay_case.start_relay());
    eventually("the slot to confirm the transaction", DEADLINE, || async {
        (case.confirmed_flush_lsn(&sql).await > commit_lsn).then_some(())
    })
    .await;
    let messages = case.messages(&js).await;
    OutageResult {
        case,
        tally: tally(&messages, &ids),
        ids,
        stored_at_kill,
        commit_lsn,
        confirmed_at_kill,
        messages,
        output: relay.output(),
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// Counts (lost, duplicated, reordered) of `messages` against the transaction's `ids`.
fn tally(messages: &[Stored], ids: &[i64]) -> (usize, usize, usize) {
    let stored: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    let unique: HashSet<i64> = stored.iter().copied().collect();
    let lost = ids.iter().filter(|id| !unique.contains(id)).count();
    let duplicated = stored.len() - unique.len();
    let reordered = messages
        .windows(2)
        .filter(|w| (w[1].commit_lsn(), w[1].tx_index()) <= (w[0].commit_lsn(), w[0].tx_index()))
        .count();
    (lost, duplicated, reordered)
}

/// Strict mode (the default): the restarted relay resumes after the stream's last message,
/// whatever the duplicate window says: exactly 10 000 messages, no duplicate, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_15s_after_publishing_with_a_5s_duplicate_window_adds_no_duplicate() {
    let result = outage_past_the_duplicate_window("dedupe_strict", false).await;
    let (messages, (lost, duplicated, reordered)) = (&result.messages, result.tally);
    eprintln!(
        "dedupe_strict: injected: SIGKILL with {}/{ROWS} rows of one transaction stored and none acknowledged \
         (slot at {} <= commit {}), down {OUTAGE:?} with a 5s duplicate window; found: {} messages, \
         lost {lost}, duplicated {duplicated}, reordered {reordered} ({:.1}s)",
        result.stored_at_kill,
        result.confirmed_at_kill,
        result.commit_lsn,
        messages.len(),
        result.seconds
    );
    assert_eq!(messages.len(), ROWS, "exactly one message per row");
    let msg_ids: HashSet<&str> = messages.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(msg_ids.len(), ROWS, "no duplicate Nats-Msg-Id");
    let stored: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    assert_eq!(stored, result.ids, "in commit (insert) order");
    assert!(
        messages
            .iter()
            .enumerate()
            .all(|(i, m)| m.tx_index() as usize == i && m.commit_lsn() == result.commit_lsn),
        "Outbox-Tx-Index 0..10000 at one commit LSN"
    );
    assert_eq!((lost, duplicated, reordered), (0, 0, 0));
    let output = strip_ansi(&result.output);
    assert!(
        output.contains(&format!("last_sequence={}", result.stored_at_kill))
            && output.contains("compare_through=Some(")
            && output.contains(&format!("skipped vouched={}", result.stored_at_kill)),
        "the restarted relay resumed from the stream's tail:\n{output}"
    );
    let _ = result.case;
}

/// Shared mode is de-duplication only: after an outage longer than the duplicate window the
/// replayed events that were stored before the kill are stored again. The relay must say so
/// (`outbox_relay_dedupe_window_exceeded_total`); nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_stream_mode_after_the_same_outage_warns_and_duplicates_what_was_unconfirmed() {
    let result = outage_past_the_duplicate_window("dedupe_shared", true).await;
    let (messages, (lost, duplicated, reordered)) = (&result.messages, result.tally);
    let warned = result
        .output
        .contains("outbox_relay_dedupe_window_exceeded_total");
    eprintln!(
        "dedupe_shared: injected: SIGKILL with {}/{ROWS} rows of one transaction stored and none acknowledged, \
         down {OUTAGE:?} with a 5s duplicate window, OUTBOX_RELAY_SHARED_STREAM=true; found: {} messages, \
         lost {lost}, duplicated {duplicated}, reordered {reordered} (the replay appends what was already stored); \
         dedupe-window warning logged: {warned} ({:.1}s)",
        result.stored_at_kill,
        messages.len(),
        result.seconds
    );
    assert!(
        warned,
        "the relay must warn that replays fall outside the duplicate window:\n{}",
        result.output
    );
    assert_eq!(lost, 0, "shared mode loses nothing");
}
