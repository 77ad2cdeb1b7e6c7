//! Support for the end-to-end tests: a test *case* is one database (with the seed's table),
//! one slot, one publication, one stream and one subject prefix on shared or private
//! servers, plus helpers to run the real `outbox-relay` binary, write rows, and read back
//! what the stream holds.
//!
//! Waiting is always on a condition with a deadline ([`eventually`]); nothing sleeps and hopes.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::future::Future;
use std::num::NonZeroU64;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use pgoutput::Lsn;
use testkit::{Nats, Postgres, Process};

/// The seed's schema, applied to every case's database.
pub const SCHEMA_SQL: &str = include_str!("../../sql/schema.sql");
/// The optional key-filling trigger.
pub const TRIGGER_SQL: &str = include_str!("../../sql/trigger.sql");

/// How long any single wait may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Waits until `check` returns `Some`, polling every 50 ms; panics after `timeout` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A JetStream context on the NATS server(s) at `url` (e.g. bypassing a case's proxy).
pub async fn jetstream_at(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.expect("connect to NATS"))
}

/// A Postgres and a nats-server shared by the tests of one test binary (each test binary
/// compiles this module, so each gets its own pair), started on first use.
pub struct Servers {
    pub pg: Postgres,
    pub nats: Nats,
}

/// This test binary's shared servers.
pub fn servers() -> &'static Servers {
    static SERVERS: std::sync::OnceLock<Servers> = std::sync::OnceLock::new();
    testkit::shared(&SERVERS, || Servers {
        pg: Postgres::start(),
        nats: Nats::start(),
    })
}

/// One test's slice of the servers.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub database: String,
    pub pg_url: String,
    pub nats_url: String,
    pub stream: String,
    pub prefix: String,
    pub slot: String,
    pub publication: String,
    pub extra_env: Vec<(String, String)>,
}

static CASE_COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Case {
    /// Creates a database with the seed's table on `pg`, and names for everything else.
    pub fn new(pg: &Postgres, nats: &Nats, name: &str) -> Case {
        Case::with_nats_url(pg, &nats.url(), name)
    }

    /// The relay binary, configured through environment variables for this case.
    pub fn relay_command(&self, subcommand: &str) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        command.arg(subcommand);
        for (key, _) in std::env::vars() {
            if key.starts_with("OUTBOX_RELAY_") || key == "DATABASE_URL" || key == "NATS_URL" {
                command.env_remove(key);
            }
        }
        command.envs(self.relay_env());
        command
    }

    /// The environment that configures the relay for this case (`extra_env` last).
    pub fn relay_env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            ("DATABASE_URL", &self.pg_url),
            ("NATS_URL", &self.nats_url),
            ("OUTBOX_RELAY_SLOT", &self.slot),
            ("OUTBOX_RELAY_PUBLICATION", &self.publication),
            ("OUTBOX_RELAY_STREAM", &self.stream),
            ("OUTBOX_RELAY_SUBJECT_PREFIX", &self.prefix),
            ("RUST_LOG", &"info,outbox_relay=debug".to_owned()),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.clone()))
        .collect();
        env.extend(self.extra_env.iter().cloned());
        env
    }

    /// Starts `outbox-relay run` and waits until it streams.
    pub fn start_relay(&self) -> Process {
        let relay = Process::spawn(&format!("relay-{}", self.name), self.relay_command("run"));
        relay.wait_for_output("streaming outbox events", DEADLINE);
        relay
    }

    /// A SQL connection to the case's database.
    pub async fn sql(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.pg_url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
    }

    /// A JetStream context.
    pub async fn jetstream(&self) -> jetstream::Context {
        jetstream_at(&self.nats_url).await
    }

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush_lsn(&self, sql: &tokio_postgres::Client) -> Lsn {
        let row = sql
            .query_one(
                "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = $1",
                &[&self.slot],
            )
            .await
            .expect("slot exists");
        row.get::<_, Option<String>>(0)
            .unwrap_or_else(|| "0/0".into())
            .parse()
            .expect("lsn")
    }

    /// The number of messages in the stream (0 if it does not exist yet).
    pub async fn stream_count(&self, js: &jetstream::Context) -> u64 {
        match js.get_stream(&self.stream).await {
            Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        }
    }

    /// Waits until the stream holds at least `n` messages.
    pub async fn wait_for_count(&self, js: &jetstream::Context, n: u64, timeout: Duration) {
        eventually(
            &format!("{n} messages in stream {}", self.stream),
            timeout,
            || async { (self.stream_count(js).await >= n).then_some(()) },
        )
        .await;
    }

    /// The `Outbox-Id` of every message in the stream, in stream order.
    pub async fn outbox_ids(&self, js: &jetstream::Context) -> Vec<i64> {
        self.messages(js)
            .await
            .iter()
            .map(Stored::outbox_id)
            .collect()
    }

    /// Every message in the stream, in stream order.
    pub async fn messages(&self, js: &jetstream::Context) -> Vec<Stored> {
        let stream = js.get_stream(&self.stream).await.expect("stream exists");
        let total = stream.cached_info().state.messages as usize;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ack_policy: jetstream::consumer::AckPolicy::None,
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .expect("consumer");
        let mut out = Vec::with_capacity(total);
        let mut messages = consumer.messages().await.expect("messages");
        let deadline = Instant::now() + DEADLINE;
        while out.len() < total {
            let next = tokio::time::timeout_at(deadline.into(), messages.next())
                .await
                .expect("reading the stream timed out");
            let message = next.expect("stream ended").expect("message");
            let info = message.info().expect("jetstream message");
            let sequence = info.stream_sequence;
            let headers: HashMap<String, String> = message
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| {
                            (
                                k.to_string(),
                                v.first().map(|v| v.as_str().to_owned()).unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Stored {
                sequence,
                subject: message.subject.to_string(),
                headers,
                payload: message.payload.to_vec(),
            });
        }
        out
    }
}

/// A message read back from the stream.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub subject: String,
    pub headers: HashMap<String, String>,
    pub payload: Vec<u8>,
}

impl Stored {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("message {} has no {name} header", self.sequence))
    }

    pub fn outbox_id(&self) -> i64 {
        self.header("Outbox-Id")
            .parse()
            .expect("Outbox-Id is an integer")
    }

    pub fn commit_lsn(&self) -> Lsn {
        self.header("Outbox-Commit-Lsn")
            .parse()
            .expect("Outbox-Commit-Lsn is an LSN")
    }
}

/// A committed outbox row as the table holds it, with what the relay must derive.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub entity_id: String,
    pub event_type: String,
    pub payload: String,
    pub created_at_ms: i64,
}

/// Every row of the case's outbox table, by id.
pub async fn rows(sql: &tokio_postgres::Client) -> Vec<Row> {
    sql.query(
        "select id, entity_id, event_type, payload::text, floor(extract(epoch from created_at) * 1000)::bigint \
           from outbox_events order by id",
        &[],
    )
    .await
    .expect("select rows")
    .iter()
    .map(|r| Row { id: r.get(0), entity_id: r.get(1), event_type: r.get(2), payload: r.get(3), created_at_ms: r.get(4) })
    .collect()
}

/// Asserts that `message` is exactly what the relay must publish for `row`: the seed's
/// keys, shard `shard_for_key(12, entity_id)` in the subject, the jsonb text as payload.
pub fn assert_matches_row(case: &Case, message: &Stored, row: &Row) {
    let keys = outbox::compute_keys(row.id, &row.entity_id, &row.event_type, row.created_at_ms);
    let shard = outbox::shard_for_key(NonZeroU64::new(12).unwrap(), &row.entity_id);
    assert_eq!(message.header("Nats-Msg-Id"), keys.dedupe_key);
    assert_eq!(message.header("Outbox-Id"), row.id.to_string());
    assert_eq!(message.header("Outbox-Entity-Id"), row.entity_id);
    assert_eq!(message.header("Outbox-Event-Type"), row.event_type);
    assert_eq!(message.header("Outbox-Partition-Key"), keys.partition_key);
    assert_eq!(message.header("Outbox-Ordering-Key"), keys.ordering_key);
    assert_eq!(message.header("Outbox-Shard"), shard.to_string());
    assert_eq!(
        message.subject,
        outbox::subject::subject(&case.prefix, shard, &row.event_type)
    );
    assert_eq!(
        String::from_utf8_lossy(&message.payload),
        row.payload,
        "payload of id {}",
        row.id
    );
}

/// Inserts `count` rows in one transaction, seed-style (placeholder key columns), for
/// entities `entity-{0..entities}`; returns their ids.
pub async fn insert_transaction(
    sql: &mut tokio_postgres::Client,
    count: usize,
    entities: usize,
    tag: &str,
) -> Vec<i64> {
    write_transaction(sql, count, entities, tag, true).await
}

// ---------------------------------------------------------------------------------------
// Continuous writers, a faithful-copy check and relay log timestamps (cluster and standby
// tests).
// ---------------------------------------------------------------------------------------

impl Case {
    /// A database with the seed's table on `pg`, and names for everything else, for NATS at
    /// `nats_url` (several servers may be listed, comma-separated, e.g. a
    /// `testkit::cluster::NatsCluster`).
    pub fn with_nats_url(pg: &Postgres, nats_url: &str, name: &str) -> Case {
        let n = CASE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let database = format!("{name}_{n}");
        pg.create_database(&database);
        pg.psql(&database, SCHEMA_SQL);
        Case {
            name: name.to_owned(),
            pg_url: pg.url(&database),
            nats_url: nats_url.to_owned(),
            stream: format!("OUTBOX_{}", database.to_uppercase()),
            prefix: format!("t{n}.{name}"),
            slot: format!("slot_{database}"),
            publication: format!("pub_{database}"),
            database,
            extra_env: vec![],
        }
    }
}

/// Inserts `count` rows in one transaction, seed-style (placeholder key columns), for
/// entities `entity-{0..entities}`, then commits it or rolls it back; returns the ids either way.
pub async fn write_transaction(
    sql: &mut tokio_postgres::Client,
    count: usize,
    entities: usize,
    tag: &str,
    commit: bool,
) -> Vec<i64> {
    let tx = sql.transaction().await.expect("begin");
    let rows = tx
        .query(
            "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
             select 'entity-' || (i % $2), 'OrderPaid', 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', \
                    jsonb_build_object('n', i, 'tag', $3::text) \
               from generate_series(1, $1::int) as i \
             returning id",
            &[&(count as i32), &(entities.max(1) as i32), &tag],
        )
        .await
        .expect("insert");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    rows.iter().map(|r| r.get(0)).collect()
}

/// Transaction sizes the writers cycle through (mixed: single rows up to a few hundred).
pub const MIXED_SIZES: [usize; 10] = [1, 7, 40, 2, 150, 1, 20, 3, 300, 12];
/// Every this many transactions a writer rolls one back instead of committing it.
pub const ROLLBACK_EVERY: usize = 9;

/// What the writers did, per writer in the order they did it.
#[derive(Debug, Default, Clone)]
pub struct WriterLog {
    /// Per writer: its committed transactions in commit order, each the ids in insert order.
    pub committed: Vec<Vec<Vec<i64>>>,
    /// Ids of rows whose transactions were rolled back.
    pub rolled_back: Vec<i64>,
}

impl WriterLog {
    pub fn committed_rows(&self) -> usize {
        self.committed.iter().flatten().map(Vec::len).sum()
    }

    pub fn committed_transactions(&self) -> usize {
        self.committed.iter().map(Vec::len).sum()
    }
}

/// Writers committing (and now and then rolling back) transactions of [`MIXED_SIZES`]
/// continuously, each on its own connection, until [`Writers::stop`].
#[derive(Debug)]
pub struct Writers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    committed_rows: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<WriterResult>>,
}

/// One writer's committed transactions and rolled-back ids.
type WriterResult = (Vec<Vec<i64>>, Vec<i64>);

impl Writers {
    /// Starts `writers` writers; each pauses `pause` between transactions.
    pub async fn start(case: &Case, writers: usize, pause: Duration) -> Writers {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let committed_rows = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks = Vec::new();
        for w in 0..writers {
            let mut sql = case.sql().await;
            let stop = stop.clone();
            let counter = committed_rows.clone();
            tasks.push(tokio::spawn(async move {
                let mut committed = Vec::new();
                let mut rolled_back = Vec::new();
                let mut k = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let size = MIXED_SIZES[(k + 3 * w) % MIXED_SIZES.len()];
                    let commit = (k + 1) % ROLLBACK_EVERY != 0;
                    let tag = format!("w{w}-{k}");
                    let ids = write_transaction(&mut sql, size, 10, &tag, commit).await;
                    if commit {
                        counter.fetch_add(ids.len() as u64, Ordering::Relaxed);
                        committed.push(ids);
                    } else {
                        rolled_back.extend(ids);
                    }
                    k += 1;
                    tokio::time::sleep(pause).await;
                }
                (committed, rolled_back)
            }));
        }
        Writers {
            stop,
            committed_rows,
            tasks,
        }
    }

    /// Rows committed so far.
    pub fn committed_rows(&self) -> u64 {
        self.committed_rows.load(Ordering::Relaxed)
    }

    /// Stops the writers (each finishes its current transaction) and returns what they did.
    pub async fn stop(self) -> WriterLog {
        self.stop.store(true, Ordering::SeqCst);
        let mut log = WriterLog::default();
        for task in self.tasks {
            let (committed, rolled_back) = task.await.expect("writer task");
            log.committed.push(committed);
            log.rolled_back.extend(rolled_back);
        }
        log
    }
}

/// How faithful a copy of the committed rows the stream is.
#[derive(Debug, Default)]
pub struct Findings {
    /// Messages in the stream.
    pub events: usize,
    /// Committed rows.
    pub committed: usize,
    /// Committed rows missing from the stream.
    pub lost: usize,
    /// Messages beyond the first for the same row.
    pub duplicated: usize,
    /// Order violations: commit LSN going backwards, a transaction split or interleaved,
    /// `Outbox-Tx-Index` not consecutive from 0, a writer's transactions out of its commit
    /// order.
    pub reordered: usize,
    /// Messages for rows that were never committed (rolled back, or unknown).
    pub unexpected: usize,
    /// Gaps in the stream's sequence numbers.
    pub sequence_gaps: usize,
    /// The first few problems, described.
    pub problems: Vec<String>,
}

impl Findings {
    fn note(&mut self, problem: String) {
        if self.problems.len() < 20 {
            self.problems.push(problem);
        }
    }

    pub fn is_faithful(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.reordered == 0
            && self.unexpected == 0
            && self.sequence_gaps == 0
            && self.events == self.committed
    }

    pub fn summary(&self) -> String {
        format!(
            "events {}, committed {}, lost {}, duplicated {}, reordered {}, unexpected {}, sequence gaps {}",
            self.events,
            self.committed,
            self.lost,
            self.duplicated,
            self.reordered,
            self.unexpected,
            self.sequence_gaps
        )
    }

    /// Panics with the summary and the first problems unless the copy is faithful.
    pub fn assert_faithful(&self) {
        assert!(
            self.is_faithful(),
            "the stream is not a faithful copy: {}\n{}",
            self.summary(),
            self.problems.join("\n")
        );
    }
}

/// Compares the stream with what the writers committed: every committed row exactly once,
/// each transaction contiguous with `Outbox-Tx-Index` 0, 1, …, commit LSNs strictly
/// increasing from one transaction to the next, each writer's transactions in the order it
/// committed them, nothing rolled back, no gap in the stream's sequences.
pub fn check_faithful(messages: &[Stored], log: &WriterLog) -> Findings {
    use std::collections::HashSet;
    let mut findings = Findings {
        events: messages.len(),
        committed: log.committed_rows(),
        ..Findings::default()
    };
    // Where each committed id belongs: (writer, transaction of that writer).
    let mut owner: HashMap<i64, (usize, usize)> = HashMap::new();
    for (w, transactions) in log.committed.iter().enumerate() {
        for (t, ids) in transactions.iter().enumerate() {
            for &id in ids {
                owner.insert(id, (w, t));
            }
        }
    }
    let rolled_back: HashSet<i64> = log.rolled_back.iter().copied().collect();

    let mut seen: HashMap<i64, usize> = HashMap::new();
    for (i, message) in messages.iter().enumerate() {
        let id = message.outbox_id();
        *seen.entry(id).or_default() += 1;
        if seen[&id] > 1 {
            findings.duplicated += 1;
            findings.note(format!("seq {}: id {id} again", message.sequence));
        }
        if !owner.contains_key(&id) {
            findings.unexpected += 1;
            let what = if rolled_back.contains(&id) {
                "rolled back"
            } else {
                "never written"
            };
            findings.note(format!("seq {}: id {id} was {what}", message.sequence));
        }
        // A fresh stream: sequences 1, 2, … with nothing missing.
        let expected_sequence = 1 + i as u64;
        if message.sequence != expected_sequence {
            findings.sequence_gaps += 1;
            findings.note(format!(
                "seq {} where {expected_sequence} was expected",
                message.sequence
            ));
        }
    }
    for (&id, _) in owner.iter().filter(|(id, _)| !seen.contains_key(id)) {
        findings.lost += 1;
        findings.note(format!("id {id} is not in the stream"));
    }

    // Runs of equal commit LSN are transactions.
    let mut previous_lsn: Option<Lsn> = None;
    let mut next_of_writer: Vec<usize> = vec![0; log.committed.len()];
    let mut start = 0;
    while start < messages.len() {
        let lsn = messages[start].commit_lsn();
        let mut end = start;
        while end < messages.len() && messages[end].commit_lsn() == lsn {
            end += 1;
        }
        let run = &messages[start..end];
        if previous_lsn.is_some_and(|previous| previous >= lsn) {
            findings.reordered += 1;
            findings.note(format!(
                "seq {}: commit LSN {lsn} after {}",
                run[0].sequence,
                previous_lsn.unwrap()
            ));
        }
        previous_lsn = Some(lsn);
        for (index, message) in run.iter().enumerate() {
            let tx_index: usize = message
                .header("Outbox-Tx-Index")
                .parse()
                .expect("Outbox-Tx-Index is an integer");
            if tx_index != index {
                findings.reordered += 1;
                findings.note(format!(
                    "seq {}: Outbox-Tx-Index {tx_index} at position {index} of its commit LSN {lsn}",
                    message.sequence
                ));
            }
        }
        let ids: Vec<i64> = run.iter().map(Stored::outbox_id).collect();
        if let Some(&(w, t)) = owner.get(&ids[0]) {
            if log.committed[w][t] != ids {
                findings.reordered += 1;
                findings.note(format!(
                    "seq {}: the messages at commit LSN {lsn} are not writer {w}'s transaction {t} in insert order",
                    run[0].sequence
                ));
            }
            if t < next_of_writer[w] {
                findings.reordered += 1;
                findings.note(format!(
                    "seq {}: writer {w}'s transaction {t} after its transaction {}",
                    run[0].sequence,
                    next_of_writer[w] - 1
                ));
            }
            next_of_writer[w] = next_of_writer[w].max(t + 1);
        }
        start = end;
    }
    findings
}

/// Asserts that the relay's sessions on the case's database (replication and lease, at
/// least two) use TLS; psql's own session does not count.
pub fn assert_relay_sessions_use_tls(pg: &Postgres, case: &Case) {
    let encrypted: i64 = pg
        .psql(
            &case.database,
            "select count(*) from pg_stat_ssl s join pg_stat_activity a using (pid) \
             where s.ssl and a.application_name not in ('psql', 'testkit-psql')",
        )
        .parse()
        .unwrap();
    assert!(
        encrypted >= 2,
        "replication and lease sessions use TLS ({encrypted})"
    );
}

/// Inserts one outbox row as `pg`'s superuser (whatever credentials the relay uses) and
/// waits until the case's stream holds it.
pub async fn relay_one_row_as_superuser(pg: &Postgres, case: &Case) {
    let (sql, connection) = tokio_postgres::connect(&pg.url(&case.database), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    sql.batch_execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) values ('e', 'T', 'x', '', '', '{}')",
    )
    .await
    .unwrap();
    let js = case.jetstream().await;
    case.wait_for_count(&js, 1, DEADLINE).await;
}

/// Runs the relay with `right` replaced by `wrong` in the case's DATABASE_URL: it must stop
/// (exit 1) saying that password authentication failed, printing neither password.
pub fn assert_wrong_password_fails_without_printing_it(case: &Case, right: &str, wrong: &str) {
    let mut case = case.clone();
    case.pg_url = case.pg_url.replace(right, wrong);
    let output = case.relay_command("run").output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(
        !stderr.contains(wrong) && !stderr.contains(right),
        "{stderr}"
    );
}

/// Removes ANSI colour escapes (`ESC [ … letter`).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
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

/// The lines of a relay's log that start with a timestamp (tracing's
/// `2024-05-01T12:34:56.123456Z`), with that time; colour escapes removed.
pub fn timed_log_lines(output: &str) -> Vec<(std::time::SystemTime, String)> {
    strip_ansi(output)
        .lines()
        .filter_map(|line| {
            let stamp = line.split_whitespace().next()?;
            Some((parse_rfc3339_utc(stamp)?, line.to_owned()))
        })
        .collect()
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z`.
pub fn parse_rfc3339_utc(stamp: &str) -> Option<std::time::SystemTime> {
    let stamp = stamp.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut date = date.split('-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (date.next()??, date.next()??, date.next()??);
    let (clock, fraction) = time.split_once('.').unwrap_or((time, ""));
    let mut clock = clock.split(':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (clock.next()??, clock.next()??, clock.next()??);
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        let digits: String = fraction
            .chars()
            .chain(std::iter::repeat('0'))
            .take(9)
            .collect();
        digits.parse().ok()?
    };
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days * 86_400 + hour * 3600 + minute * 60 + second).ok()?;
    Some(std::time::UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Minimum, median and maximum of `durations` (all zero when empty).
pub fn min_median_max(durations: &[Duration]) -> (Duration, Duration, Duration) {
    let mut sorted = durations.to_vec();
    sorted.sort();
    match sorted.len() {
        0 => Default::default(),
        n if n % 2 == 1 => (sorted[0], sorted[n / 2], sorted[n - 1]),
        n => (
            sorted[0],
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
            sorted[n - 1],
        ),
    }
}
