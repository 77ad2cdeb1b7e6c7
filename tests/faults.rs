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

use support::servers;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgoutput::Lsn;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use support::{assert_matches_row, eventually, insert_transaction, rows, Case, Stored, DEADLINE};
use testkit::{Nats, Postgres, Process, Proxy};

/// The torture test owns the machine while it runs; the dedupe-window tests may run
/// together.
static SERIAL: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A SQL connection, or `None` while the server is unreachable.
async fn try_connect(url: &str) -> Option<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Some(client)
}

/// A SQL connection, retried (Postgres may be restarting) until `timeout`.
async fn connect(url: &str, timeout: Duration) -> tokio_postgres::Client {
    eventually("a SQL connection", timeout, || try_connect(url)).await
}

/// A JetStream context whose requests give up after a second (the sampler and the fault
/// injector poll through nats-server restarts).
async fn jetstream_with_timeout(url: &str) -> jetstream::Context {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client)
}

fn parse_lsn(text: &str) -> Lsn {
    text.parse().expect("an LSN")
}

fn tx_index(message: &Stored) -> u32 {
    message
        .header("Outbox-Tx-Index")
        .parse()
        .expect("Outbox-Tx-Index is an integer")
}

// -----------------------------------------------------------------------------------------
// Writers: transactions of 1, 10, 100 and 1000 rows, committed or rolled back, each recorded
// with what its client knows about its outcome.
// -----------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// COMMIT returned success.
    Committed,
    /// The writer rolled it back.
    RolledBack,
    /// The connection failed before COMMIT was sent: it cannot have committed.
    Aborted,
    /// The connection failed during COMMIT: resolved afterwards by looking for its rows.
    InDoubt,
}

#[derive(Debug, Clone)]
struct TxRecord {
    writer: usize,
    /// The writer's n-th transaction: a writer's transactions commit in this order.
    seq: usize,
    /// The rows' ids, in insert order.
    ids: Vec<i64>,
    outcome: Outcome,
    /// `pg_current_wal_insert_lsn()` inside the transaction right before COMMIT: its commit
    /// record starts at or after this.
    before_commit: Option<Lsn>,
    /// The same right after COMMIT returned: its commit record starts before this.
    after_commit: Option<Lsn>,
}

type Ledger = Arc<Mutex<Vec<TxRecord>>>;

const INSERT_SQL: &str = "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
     select 'entity-' || ((i + $4) % $2), (array['OrderPaid', 'OrderShipped', 'order.refunded'])[1 + (i + $4) % 3], \
            'tmp-' || gen_random_uuid(), 'tmp', 'tmp', jsonb_build_object('n', i, 'tag', $3::text) \
       from generate_series(1, $1::int) as i \
     returning id";
const WAL_INSERT_LSN_SQL: &str = "select pg_current_wal_insert_lsn()::text";

/// The ids, outcome and commit bounds of one attempted transaction.
#[derive(Debug)]
struct Attempt {
    ids: Vec<i64>,
    outcome: Outcome,
    before_commit: Option<Lsn>,
    after_commit: Option<Lsn>,
}

/// Writes one transaction of `size` rows and commits it (or rolls it back). `Err` means the
/// connection failed, with what is known about the transaction if it got as far as inserting.
async fn attempt(
    sql: &mut tokio_postgres::Client,
    size: i32,
    entities: i32,
    offset: i32,
    tag: &str,
    commit: bool,
) -> Result<Attempt, Option<Attempt>> {
    let tx = sql.transaction().await.map_err(|_| None)?;
    let ids: Vec<i64> = tx
        .query(INSERT_SQL, &[&size, &entities, &tag, &offset])
        .await
        .map_err(|_| None)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut attempt = Attempt {
        ids,
        outcome: Outcome::RolledBack,
        before_commit: None,
        after_commit: None,
    };
    if !commit {
        return match tx.rollback().await {
            Ok(()) => Ok(attempt),
            Err(_) => Err(Some(attempt)),
        };
    }
    match tx.query_one(WAL_INSERT_LSN_SQL, &[]).await {
        Ok(row) => attempt.before_commit = Some(parse_lsn(row.get(0))),
        Err(_) => {
            attempt.outcome = Outcome::Aborted;
            return Err(Some(attempt));
        }
    }
    if tx.commit().await.is_err() {
        attempt.outcome = Outcome::InDoubt;
        return Err(Some(attempt));
    }
    attempt.outcome = Outcome::Committed;
    attempt.after_commit = sql
        .query_one(WAL_INSERT_LSN_SQL, &[])
        .await
        .ok()
        .map(|row| parse_lsn(row.get(0)));
    Ok(attempt)
}

/// A writer's next transaction: its size, entities, entity offset and whether it commits.
#[derive(Debug, Clone, Copy)]
struct Plan {
    size: i32,
    entities: i32,
    offset: i32,
    commit: bool,
}

/// One writer: until `stop`, transactions of random size (1, 10, 100 or 1000 rows) over a
/// random number of entities, one in five rolled back, at a random pace. After a Postgres
/// crash it reconnects and retries a transaction only when its outcome is known (it failed
/// before COMMIT was sent); one whose COMMIT was cut off is in doubt and is not retried.
async fn writer(writer: usize, url: String, seed: u64, stop: Arc<AtomicBool>, ledger: Ledger) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut client: Option<tokio_postgres::Client> = None;
    let mut seq = 0;
    let mut retry: Option<Plan> = None;
    while !stop.load(Ordering::Relaxed) {
        let sql = match client.as_mut() {
            Some(sql) if !sql.is_closed() => sql,
            _ => {
                client = try_connect(&url).await;
                if client.is_none() {
                    // Postgres is down (the crash fault): try again shortly.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let plan = retry.take().unwrap_or_else(|| Plan {
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
            commit: rng.random_bool(0.8),
        });
        let tag = format!("w{writer}-{seq}");
        let result = attempt(
            sql,
            plan.size,
            plan.entities,
            plan.offset,
            &tag,
            plan.commit,
        )
        .await;
        let recorded = match result {
            Ok(attempt) => Some(attempt),
            Err(attempt) => {
                client = None;
                // Known not committed (nothing inserted, or COMMIT never sent): retry it.
                if plan.commit
                    && attempt
                        .as_ref()
                        .is_none_or(|a| a.outcome == Outcome::Aborted)
                {
                    retry = Some(plan);
                }
                attempt
            }
        };
        if let Some(attempt) = recorded {
            lock(&ledger).push(TxRecord {
                writer,
                seq,
                ids: attempt.ids,
                outcome: attempt.outcome,
                before_commit: attempt.before_commit,
                after_commit: attempt.after_commit,
            });
            seq += 1;
        }
        if retry.is_none() {
            // Pace: the writers' load, not a wait for anything.
            tokio::time::sleep(Duration::from_millis(rng.random_range(30..250))).await;
        }
    }
}

/// A crash-time writer: one-row transactions back to back on one connection until the
/// connection fails, so that the crash cuts off some INSERT or COMMIT (whose outcome the
/// final check then resolves).
async fn storm_writer(writer: usize, url: String, ledger: Ledger, stop: Arc<AtomicBool>) {
    let Some(mut sql) = try_connect(&url).await else {
        return;
    };
    let mut seq = 0;
    while !stop.load(Ordering::Relaxed) {
        let result = attempt(&mut sql, 1, 1, 0, &format!("storm{writer}-{seq}"), true).await;
        let failed = result.is_err();
        if let Some(attempt) = result.map_or_else(|attempt| attempt, Some) {
            lock(&ledger).push(TxRecord {
                writer,
                seq,
                ids: attempt.ids,
                outcome: attempt.outcome,
                before_commit: attempt.before_commit,
                after_commit: attempt.after_commit,
            });
            seq += 1;
        }
        if failed {
            return;
        }
    }
}

// -----------------------------------------------------------------------------------------
// Sampling the slot's confirmed position and, right after it, the stream's last sequence.
// -----------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Sample {
    confirmed: Lsn,
    last_sequence: u64,
}

async fn sampler(
    url: String,
    slot: String,
    stream: String,
    js: jetstream::Context,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let Some(sql) = client.as_ref().filter(|c| !c.is_closed()) else {
            client = try_connect(&url).await;
            continue;
        };
        let confirmed = tokio::time::timeout(
            Duration::from_secs(2),
            sql.query_opt(
                "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = $1",
                &[&slot],
            ),
        )
        .await;
        let confirmed = match confirmed {
            Ok(Ok(Some(row))) => match row.get::<_, Option<String>>(0) {
                Some(text) => parse_lsn(&text),
                None => continue,
            },
            Ok(Ok(None)) => continue,
            _ => {
                client = None;
                continue;
            }
        };
        // Strictly after the slot's position was read.
        let Ok(info) = js.get_stream(&stream).await else {
            continue;
        };
        lock(&samples).push(Sample {
            confirmed,
            last_sequence: info.cached_info().state.last_sequence,
        });
    }
}

// -----------------------------------------------------------------------------------------
// The relay under test: a process that is killed and restarted; its output is kept.
// -----------------------------------------------------------------------------------------

struct Relay {
    case: Case,
    current: Option<Process>,
    starts: usize,
    log: String,
}

impl Relay {
    fn new(case: Case) -> Relay {
        Relay {
            case,
            current: None,
            starts: 0,
            log: String::new(),
        }
    }

    fn start(&mut self) {
        assert!(self.current.is_none());
        self.starts += 1;
        let name = format!("relay-{}#{}", self.case.name, self.starts);
        self.current = Some(Process::spawn(&name, self.case.relay_command("run")));
    }

    fn kill(&mut self) {
        if let Some(mut process) = self.current.take() {
            tokio::task::block_in_place(|| process.kill());
            self.log.push_str(&format!(
                "===== relay start #{} (SIGKILLed) =====\n",
                self.starts
            ));
            self.log.push_str(&process.output());
        }
    }

    fn output(&self) -> String {
        let mut all = self.log.clone();
        if let Some(process) = &self.current {
            all.push_str(&format!(
                "===== relay start #{} (running) =====\n",
                self.starts
            ));
            all.push_str(&process.output());
        }
        all
    }

    /// Panics (with the tail of its output) if the relay exited on its own.
    fn assert_alive(&mut self) {
        if let Some(process) = self.current.as_mut() {
            if let Some(status) = process.try_status() {
                let output = self.output();
                panic!(
                    "the relay exited on its own ({status}); its output ends:\n{}",
                    last_lines(&output, 60)
                );
            }
        }
    }

    /// Whether the current process's latest session is streaming.
    fn streaming(&self) -> bool {
        self.current.as_ref().is_some_and(|process| {
            // The latest session announced itself, and no session ended since.
            let output = process.output();
            output.rfind("streaming outbox events") > output.rfind("relay session ended")
        })
    }

    async fn wait_streaming(&mut self, timeout: Duration) {
        let start = Instant::now();
        while !self.streaming() {
            self.assert_alive();
            assert!(
                start.elapsed() < timeout,
                "the relay did not start streaming within {timeout:?}; output ends:\n{}",
                last_lines(&self.output(), 60)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `text` without ANSI colour escapes (`ESC [ ... letter`): the relay's log fields are styled.
fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How many lines of `text` contain every one of `needles`.
fn lines_with(text: &str, needles: &[&str]) -> usize {
    text.lines()
        .filter(|line| needles.iter().all(|needle| line.contains(needle)))
        .count()
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The stream's last sequence and, if it has one, its last message's id and commit LSN.
async fn stream_tail(js: &jetstream::Context, stream: &str) -> Option<(u64, Option<(i64, Lsn)>)> {
    let stream = js.get_stream(stream).await.ok()?;
    let last = stream.cached_info().state.last_sequence;
    if last == 0 {
        return Some((0, None));
    }
    let message = stream.get_raw_message(last).await.ok()?;
    let id = message
        .headers
        .get("Outbox-Id")
        .and_then(|v| v.as_str().parse().ok());
    let lsn = message
        .headers
        .get("Outbox-Commit-Lsn")
        .and_then(|v| v.as_str().parse().ok());
    Some((last, id.zip(lsn)))
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
    async fn commit_big_transaction(&mut self, size: i32) -> TxRecord {
        let mut sql = connect(&self.case.pg_url, DEADLINE).await;
        loop {
            let tag = format!("injector-{}", self.injector_seq);
            let result = attempt(&mut sql, size, 40, 0, &tag, true).await;
            let (done, record) = match result {
                Ok(attempt) => (true, Some(attempt)),
                Err(attempt) => (false, attempt),
            };
            if let Some(attempt) = record {
                let record = TxRecord {
                    writer: INJECTOR,
                    seq: self.injector_seq,
                    ids: attempt.ids,
                    outcome: attempt.outcome,
                    before_commit: attempt.before_commit,
                    after_commit: attempt.after_commit,
                };
                self.injector_seq += 1;
                lock(&self.ledger).push(record.clone());
                if done {
                    return record;
                }
            }
            sql = connect(&self.case.pg_url, DEADLINE).await;
        }
    }

    /// Commits a `size`-row transaction and returns as soon as the stream's last message is
    /// one of its rows but not its last one: the relay is in the middle of publishing it.
    /// `None` if it was stored entirely before that was seen.
    async fn catch_mid_transaction(&mut self, size: i32) -> Option<Caught> {
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
    async fn catch_mid_transaction_retrying(&mut self, size: i32) -> Option<Caught> {
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
                    let ledger = lock(&self.ledger);
                    (ledger.iter().filter(|r| r.writer >= STORM).count() >= 10 * STORM_WRITERS)
                        .then_some(())
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

/// What the final check found.
#[derive(Debug, Default)]
struct Findings {
    lost: usize,
    duplicated_ids: usize,
    duplicated_msg_ids: usize,
    rolled_back_published: usize,
    unknown_published: usize,
    /// Adjacent messages whose (commit LSN, tx index) do not follow each other.
    out_of_position: usize,
    /// Transactions whose rows are not one contiguous run, in insert order.
    split_transactions: usize,
    /// A writer's transaction after its later one.
    writer_order: usize,
    /// Commit LSN headers outside the writer's [before COMMIT, after COMMIT) bounds.
    commit_lsn_outside_bounds: usize,
    /// Stream sequences that are not 1, 2, 3, ...
    sequence_gaps: usize,
    /// Samples (C, S) with an event whose commit LSN is < C stored after S.
    confirmed_past_unstored: usize,
    notes: Vec<String>,
}

impl Findings {
    fn note(&mut self, note: String) {
        if self.notes.len() < 30 {
            self.notes.push(note);
        }
    }

    fn reordered(&self) -> usize {
        self.out_of_position + self.split_transactions + self.writer_order
    }

    fn is_faithful(&self) -> bool {
        self.lost == 0
            && self.duplicated_ids == 0
            && self.duplicated_msg_ids == 0
            && self.rolled_back_published == 0
            && self.unknown_published == 0
            && self.reordered() == 0
            && self.commit_lsn_outside_bounds == 0
            && self.sequence_gaps == 0
            && self.confirmed_past_unstored == 0
    }
}

fn check(messages: &[Stored], ledger: &[TxRecord], samples: &[Sample]) -> Findings {
    let mut findings = Findings::default();
    // Which committed transaction each id belongs to.
    let mut owner: HashMap<i64, usize> = HashMap::new();
    let mut rolled_back: HashSet<i64> = HashSet::new();
    for (t, record) in ledger.iter().enumerate() {
        for &id in &record.ids {
            if record.outcome == Outcome::Committed {
                owner.insert(id, t);
            } else {
                rolled_back.insert(id);
            }
        }
    }

    // Exactly once, nothing else.
    let mut first_position: HashMap<i64, usize> = HashMap::new();
    let mut msg_ids: HashSet<&str> = HashSet::new();
    for (i, message) in messages.iter().enumerate() {
        let id = message.outbox_id();
        if let std::collections::hash_map::Entry::Vacant(entry) = first_position.entry(id) {
            entry.insert(i);
        } else {
            findings.duplicated_ids += 1;
            findings.note(format!("seq {}: id {id} again", message.sequence));
        }
        if !msg_ids.insert(message.header("Nats-Msg-Id")) {
            findings.duplicated_msg_ids += 1;
        }
        if !owner.contains_key(&id) {
            if rolled_back.contains(&id) {
                findings.rolled_back_published += 1;
                findings.note(format!(
                    "seq {}: id {id} was never committed",
                    message.sequence
                ));
            } else {
                findings.unknown_published += 1;
                findings.note(format!(
                    "seq {}: id {id} was never written",
                    message.sequence
                ));
            }
        }
        if message.sequence != i as u64 + 1 {
            findings.sequence_gaps += 1;
        }
    }
    for &id in owner.keys() {
        if !first_position.contains_key(&id) {
            findings.lost += 1;
            findings.note(format!("id {id} (committed) is not in the stream"));
        }
    }

    // Commit order: (commit LSN, tx index) steps from one event to the next.
    for (i, message) in messages.iter().enumerate() {
        let (lsn, index) = (message.commit_lsn(), tx_index(message));
        let follows = match i.checked_sub(1).map(|p| &messages[p]) {
            None => index == 0,
            Some(previous) => {
                let (plsn, pindex) = (previous.commit_lsn(), tx_index(previous));
                (lsn > plsn && index == 0) || (lsn == plsn && index == pindex + 1)
            }
        };
        if !follows {
            findings.out_of_position += 1;
            findings.note(format!(
                "seq {}: position ({lsn}, {index}) does not follow its predecessor",
                message.sequence
            ));
        }
    }

    // Each committed transaction: one contiguous run in insert order, with one commit LSN
    // inside the bounds its writer saw; each writer's transactions in its commit order.
    let mut last_of_writer: HashMap<usize, (usize, usize)> = HashMap::new();
    let mut committed: Vec<&TxRecord> = ledger
        .iter()
        .filter(|r| r.outcome == Outcome::Committed)
        .collect();
    committed.sort_by_key(|r| (r.writer, r.seq));
    for record in committed {
        let Some(&start) = record.ids.first().and_then(|id| first_position.get(id)) else {
            continue;
        };
        let run = &messages[start..(start + record.ids.len()).min(messages.len())];
        let run_ids: Vec<i64> = run.iter().map(Stored::outbox_id).collect();
        if run_ids != record.ids {
            findings.split_transactions += 1;
            findings.note(format!(
                "writer {} transaction {} ({} rows) is not one run in insert order from seq {}",
                record.writer,
                record.seq,
                record.ids.len(),
                messages[start].sequence
            ));
        }
        let lsn = messages[start].commit_lsn();
        let inside = record.before_commit.is_none_or(|b| b <= lsn)
            && record.after_commit.is_none_or(|a| lsn < a)
            && run.iter().all(|m| m.commit_lsn() == lsn);
        if !inside {
            findings.commit_lsn_outside_bounds += 1;
            findings.note(format!(
                "writer {} transaction {}: commit LSN {lsn} outside [{:?}, {:?})",
                record.writer, record.seq, record.before_commit, record.after_commit
            ));
        }
        if let Some(&(previous_seq, previous_start)) = last_of_writer.get(&record.writer) {
            if previous_start > start {
                findings.writer_order += 1;
                findings.note(format!(
                    "writer {}: transaction {} stored before its transaction {previous_seq}",
                    record.writer, record.seq
                ));
            }
        }
        last_of_writer.insert(record.writer, (record.seq, start));
    }

    // The slot never confirmed past an event that was not stored: for every sample (C, S),
    // every event with commit LSN < C has stream sequence <= S.
    let mut by_lsn: Vec<(Lsn, u64)> = messages
        .iter()
        .map(|m| (m.commit_lsn(), m.sequence))
        .collect();
    by_lsn.sort();
    let mut highest_sequence = Vec::with_capacity(by_lsn.len());
    let mut highest = 0;
    for &(_, sequence) in &by_lsn {
        highest = highest.max(sequence);
        highest_sequence.push(highest);
    }
    for sample in samples {
        let before = by_lsn.partition_point(|&(lsn, _)| lsn < sample.confirmed);
        if before > 0 && highest_sequence[before - 1] > sample.last_sequence {
            findings.confirmed_past_unstored += 1;
            findings.note(format!(
                "the slot confirmed {} while the stream's last sequence was {}, but an event before it is at sequence {}",
                sample.confirmed,
                sample.last_sequence,
                highest_sequence[before - 1]
            ));
        }
    }
    findings
}

/// The torture test: see the module docs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn torture() {
    let _serial = SERIAL.write().await;
    let started = Instant::now();
    let seed: u64 = std::env::var("FAULTS_SEED")
        .ok()
        .map(|s| s.parse().expect("FAULTS_SEED is a u64"))
        .unwrap_or_else(rand::random);
    eprintln!("torture: seed {seed} (replay with FAULTS_SEED={seed})");
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
    let ledger: Ledger = Arc::default();
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let stop_writers = Arc::new(AtomicBool::new(false));
    let stop_sampler = Arc::new(AtomicBool::new(false));
    const WRITERS: usize = 3;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            tokio::spawn(writer(
                w,
                case.pg_url.clone(),
                rng.random(),
                stop_writers.clone(),
                ledger.clone(),
            ))
        })
        .collect();
    let sampler = tokio::spawn(sampler(
        case.pg_url.clone(),
        case.slot.clone(),
        case.stream.clone(),
        js.clone(),
        stop_sampler.clone(),
        samples.clone(),
    ));

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
        ledger: ledger.clone(),
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
    stop_writers.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }
    rig.relay.assert_alive();

    // Settle what the writers could not know: did the transactions whose COMMIT was cut off
    // by the crash commit?
    let sql = connect(&case.pg_url, DEADLINE).await;
    let mut ledger = std::mem::take(&mut *lock(&ledger));
    let mut in_doubt = (0, 0);
    for record in ledger.iter_mut().filter(|r| r.outcome == Outcome::InDoubt) {
        let present: i64 = sql
            .query_one(
                "select count(*) from outbox_events where id = any($1)",
                &[&record.ids],
            )
            .await
            .unwrap()
            .get(0);
        record.outcome = if present == 0 {
            in_doubt.1 += 1;
            Outcome::Aborted
        } else {
            assert_eq!(
                present as usize,
                record.ids.len(),
                "a transaction is atomic"
            );
            in_doubt.0 += 1;
            Outcome::Committed
        };
    }
    let committed: HashSet<i64> = ledger
        .iter()
        .filter(|r| r.outcome == Outcome::Committed)
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
    let expected = committed.len() as u64;
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
    stop_sampler.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    let samples = std::mem::take(&mut *lock(&samples));

    let messages = case.messages(&js).await;
    let findings = check(&messages, &ledger, &samples);
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
    let count = |outcome: Outcome| {
        let records: Vec<&TxRecord> = ledger.iter().filter(|r| r.outcome == outcome).collect();
        (
            records.len(),
            records.iter().map(|r| r.ids.len()).sum::<usize>(),
        )
    };
    let (committed_tx, committed_rows) = count(Outcome::Committed);
    let (rolled_back_tx, rolled_back_rows) = count(Outcome::RolledBack);
    let (aborted_tx, aborted_rows) = count(Outcome::Aborted);
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
        in_doubt.0,
        in_doubt.1,
        messages.len(),
        samples.len(),
    );
    eprintln!(
        "torture: found: lost {}, duplicated {} (by Nats-Msg-Id {}), reordered {} (out of position {}, split transactions {}, writer order {}), \
         rolled-back published {}, unknown published {}, commit LSN outside the writer's bounds {}, sequence gaps {}, \
         samples confirming past an unstored event {}",
        findings.lost,
        findings.duplicated_ids,
        findings.duplicated_msg_ids,
        findings.reordered(),
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
    assert!(
        findings.is_faithful(),
        "the stream is not a faithful copy: {findings:#?}"
    );
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
}

/// A relay publishes part of a 10 000-row transaction (acks held back by the proxy, so it
/// confirms nothing), is SIGKILLed, stays down for [`OUTAGE`] against a 5 s duplicate
/// window, and is restarted; returns what the stream holds once the slot confirmed the
/// transaction.
async fn outage_past_the_duplicate_window(name: &str, shared_stream: bool) -> OutageResult {
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
        ids,
        stored_at_kill,
        commit_lsn,
        confirmed_at_kill,
        messages,
        output: relay.output(),
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
        .filter(|w| (w[1].commit_lsn(), tx_index(&w[1])) <= (w[0].commit_lsn(), tx_index(&w[0])))
        .count();
    (lost, duplicated, reordered)
}

/// Strict mode (the default): the restarted relay resumes after the stream's last message,
/// whatever the duplicate window says: exactly 10 000 messages, no duplicate, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_15s_after_publishing_with_a_5s_duplicate_window_adds_no_duplicate() {
    let _serial = SERIAL.read().await;
    let started = Instant::now();
    let result = outage_past_the_duplicate_window("dedupe_strict", false).await;
    let messages = &result.messages;
    let (lost, duplicated, reordered) = tally(messages, &result.ids);
    eprintln!(
        "dedupe_strict: injected: SIGKILL with {}/{ROWS} rows of one transaction stored and none acknowledged \
         (slot at {} <= commit {}), down {OUTAGE:?} with a 5s duplicate window; found: {} messages, \
         lost {lost}, duplicated {duplicated}, reordered {reordered} ({:.1}s)",
        result.stored_at_kill,
        result.confirmed_at_kill,
        result.commit_lsn,
        messages.len(),
        started.elapsed().as_secs_f64()
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
            .all(|(i, m)| tx_index(m) as usize == i && m.commit_lsn() == result.commit_lsn),
        "Outbox-Tx-Index 0..10000 at one commit LSN"
    );
    assert_eq!((lost, duplicated, reordered), (0, 0, 0));
    let output = without_ansi(&result.output);
    assert!(
        output.contains(&format!("last_sequence={}", result.stored_at_kill))
            && output.contains("resume_after=Some("),
        "the restarted relay resumed from the stream's tail:\n{output}"
    );
    let _ = result.case;
}

/// Shared mode is de-duplication only: after an outage longer than the duplicate window the
/// replayed events that were stored before the kill are stored again. The relay must say so
/// (`outbox_relay_dedupe_window_exceeded_total`); nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_stream_mode_after_the_same_outage_warns_and_duplicates_what_was_unconfirmed() {
    let _serial = SERIAL.read().await;
    let started = Instant::now();
    let result = outage_past_the_duplicate_window("dedupe_shared", true).await;
    let messages = &result.messages;
    let (lost, duplicated, reordered) = tally(messages, &result.ids);
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
        started.elapsed().as_secs_f64()
    );
    assert!(
        warned,
        "the relay must warn that replays fall outside the duplicate window:\n{}",
        result.output
    );
    assert_eq!(lost, 0, "shared mode loses nothing");
}
