//! Writing outbox rows the way the seed does (placeholder key columns: the relay derives the
//! keys itself) and reading them back.
//!
//! Every attempted transaction can be recorded in a [`Ledger`] as a [`TxRecord`] with what
//! its client knows of its outcome (committed, rolled back, cut off before COMMIT, or in
//! doubt because the connection failed during COMMIT) and the WAL positions around its
//! COMMIT; [`Ledger::settle`] resolves the doubtful ones from the table, so
//! [`super::faithful`] can compare the stream with exactly what was committed.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use outbox::OutboxRow;
use pgoutput::Lsn;

use super::case::{eventually, sql_connect, Case, Relayed, DEADLINE};
use super::stream::Stored;
use crate::Process;

/// The columns [`Row::from_sql`] reads, in its order.
pub const ROW_COLUMNS: &str = "id, entity_id, event_type, payload::text, \
     floor(extract(epoch from created_at) * 1000)::bigint";

/// A committed outbox row as the table holds it, with what the relay must derive.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub entity_id: String,
    pub event_type: String,
    pub payload: String,
    pub created_at_ms: i64,
}

impl Row {
    /// A row selected with [`ROW_COLUMNS`].
    pub fn from_sql(row: &tokio_postgres::Row) -> Row {
        Row {
            id: row.get(0),
            entity_id: row.get(1),
            event_type: row.get(2),
            payload: row.get(3),
            created_at_ms: row.get(4),
        }
    }
}

/// The row as the outbox crate takes it, to build the event the relay publishes for it
/// ([`OutboxRow::into_event`]) without decoding WAL.
impl From<Row> for OutboxRow {
    fn from(row: Row) -> OutboxRow {
        OutboxRow::seed(
            row.id,
            row.entity_id,
            row.event_type,
            Bytes::from(row.payload),
            row.created_at_ms,
        )
    }
}

/// Every row of the case's outbox table, by id.
pub async fn rows(sql: &tokio_postgres::Client) -> Vec<Row> {
    sql.query(
        &format!("select {ROW_COLUMNS} from outbox_events order by id"),
        &[],
    )
    .await
    .expect("select rows")
    .iter()
    .map(Row::from_sql)
    .collect()
}

/// Every row of the case's outbox table, keyed by id.
pub async fn rows_by_id(sql: &tokio_postgres::Client) -> HashMap<i64, Row> {
    rows(sql).await.into_iter().map(|r| (r.id, r)).collect()
}

/// Asserts that `message` is exactly what the relay must publish for `row`: the seed's
/// keys, shard `shard_for_key(12, entity_id)` in the subject, the jsonb text as payload.
pub fn assert_matches_row(case: &Case, message: &Stored, row: &Row) {
    let keys = outbox::compute_keys(row.id, &row.entity_id, &row.event_type, row.created_at_ms);
    let shard = outbox::shard_for_key(NonZeroU64::new(12).expect("12"), &row.entity_id);
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

/// `$1` rows for entities `entity-{(i + $4) % $2}`, event types cycling through `$5`,
/// payload `{"n": i, "tag": $3}`, placeholder key columns.
const INSERT_SQL: &str = "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
     select 'entity-' || ((i + $4) % $2), ($5::text[])[1 + (i + $4) % cardinality($5::text[])], \
            'tmp-' || gen_random_uuid(), 'tmp', 'tmp', jsonb_build_object('n', i, 'tag', $3::text) \
       from generate_series(1, $1::int) as i \
     returning id";
const WAL_INSERT_LSN_SQL: &str = "select pg_current_wal_insert_lsn()::text";
/// The event type of [`write_transaction`]'s rows and of [`Writers::start`]'s.
const ORDER_PAID: &[&str] = &["OrderPaid"];

/// One transaction to write: its rows, and what to do after it.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub size: usize,
    /// Rows go to entities `entity-{(i + offset) % entities}`.
    pub entities: usize,
    pub offset: usize,
    /// Row `i` gets `event_types[(i + offset) % len]`.
    pub event_types: &'static [&'static str],
    /// Commit it (else roll it back).
    pub commit: bool,
    /// Delete the rows again in the same transaction (Debezium's remove-after-insert): only
    /// the WAL carries them. The transaction also records its tag in `writer_commits`
    /// (which the test creates), so that [`Ledger::settle`] can tell whether it committed.
    pub delete: bool,
    /// How long the writer pauses after it (its pace, not a wait for anything).
    pub pause: Duration,
}

async fn insert_rows(
    tx: &tokio_postgres::Transaction<'_>,
    plan: &Plan,
    tag: &str,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let as_int = |n: usize| i32::try_from(n).expect("fits an integer");
    let rows = tx
        .query(
            INSERT_SQL,
            &[
                &as_int(plan.size),
                &as_int(plan.entities.max(1)),
                &tag,
                &as_int(plan.offset),
                &plan.event_types,
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
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

/// The stream ahead of the slot (issue 23's B4, F3): the case's relay streams 10 rows (`a`)
/// and is stopped; one row (`gap`) is committed, then 10 more (`b`), which `outbox-relay
/// replay --force` publishes before any relay streamed them; a relay started again streams
/// `gap` (published alone and stored: `sink::resume` S6 ends its doubt), then `b` as if new
/// (a batch where batches are on), and, once `b` is confirmed, 5 more rows (`c`). Returns that relay and the stream's
/// messages once all 26 rows are confirmed, checked to be there once each, in order (`b`
/// where replay put them). On a multi-threaded runtime (it starts relays in place).
pub async fn replay_ahead_then_relay(
    case: &Case,
    sql: &mut tokio_postgres::Client,
) -> (Process, Vec<Stored>) {
    let mut relay = tokio::task::block_in_place(|| case.start_relay());
    let mut expected = insert_transaction(sql, 10, 2, "a").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 10, DEADLINE).await;
    relay.terminate(Duration::from_secs(10));
    let gap = insert_transaction(sql, 1, 1, "gap").await;
    let ahead = insert_transaction(sql, 10, 2, "b").await;
    // The stopped relay's lease goes a moment after it exits: replay until it is free.
    let from = ahead[0].to_string();
    eventually("a forced replay of the unstreamed rows", DEADLINE, || {
        let output = case
            .relay_command("replay")
            .args(["--from-id", &from, "--force"])
            .output()
            .expect("run outbox-relay replay");
        async move { output.status.success().then_some(()) }
    })
    .await;
    assert_eq!(case.stream_count(&js).await, 20);
    let past_b = super::case::wal_lsn(sql).await;
    let relay = tokio::task::block_in_place(|| case.start_relay());
    // `c` once `b` is confirmed: no session that published `b` also published `c`.
    eventually(
        "the slot to confirm the replayed rows",
        DEADLINE,
        || async { (case.confirmed_flush_lsn(sql).await >= past_b).then_some(()) },
    )
    .await;
    expected.extend(&ahead);
    expected.extend(&gap);
    expected.extend(insert_transaction(sql, 5, 2, "c").await);
    let (messages, _) = case.wait_confirmed(&js, sql, 26).await;
    let ids: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    assert_eq!(
        ids, expected,
        "every row once, the replayed ones where replay put them"
    );
    (relay, messages)
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
    let plan = Plan {
        size: count,
        entities,
        offset: 0,
        event_types: ORDER_PAID,
        commit,
        delete: false,
        pause: Duration::ZERO,
    };
    let tx = sql.transaction().await.expect("begin");
    let ids = insert_rows(&tx, &plan, tag).await.expect("insert");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    ids
}

/// What the client of a transaction knows about its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// COMMIT returned success.
    Committed,
    /// The writer rolled it back.
    RolledBack,
    /// The connection failed before COMMIT was sent: it cannot have committed.
    Aborted,
    /// The connection failed during COMMIT: resolved by [`Ledger::settle`].
    InDoubt,
}

/// The ids, outcome and commit bounds of one attempted transaction.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The rows' ids, in insert order.
    pub ids: Vec<i64>,
    /// The tag in the rows' payloads: with the ids, what identifies them (a server that
    /// crashed may hand out the ids of a transaction in doubt again).
    pub tag: String,
    pub outcome: Outcome,
    /// `pg_current_wal_insert_lsn()` inside the transaction right before COMMIT: its commit
    /// record starts at or after this.
    pub before_commit: Option<Lsn>,
    /// The same right after COMMIT returned: its commit record starts before this.
    pub after_commit: Option<Lsn>,
    /// Its rows were deleted in it ([`Plan::delete`]).
    pub deleted: bool,
}

/// Writes one transaction as `plan` says and commits it (or rolls it back). `Err` means the
/// connection failed, with what is known about the transaction if it got as far as
/// inserting.
pub async fn attempt(
    sql: &mut tokio_postgres::Client,
    plan: &Plan,
    tag: &str,
) -> Result<Attempt, Option<Attempt>> {
    let tx = sql.transaction().await.map_err(|_| None)?;
    let ids = insert_rows(&tx, plan, tag).await.map_err(|_| None)?;
    if plan.delete {
        tx.execute("delete from outbox_events where id = any($1)", &[&ids])
            .await
            .map_err(|_| None)?;
        tx.execute("insert into writer_commits (tag) values ($1)", &[&tag])
            .await
            .map_err(|_| None)?;
    }
    let mut attempt = Attempt {
        ids,
        tag: tag.to_owned(),
        outcome: Outcome::RolledBack,
        before_commit: None,
        after_commit: None,
        deleted: plan.delete,
    };
    if !plan.commit {
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

fn parse_lsn(text: &str) -> Lsn {
    text.parse().expect("an LSN")
}

/// One attempted transaction, as its writer recorded it: the [`Attempt`] (its fields read
/// through the record) and whose it was.
#[derive(Debug, Clone)]
pub struct TxRecord {
    pub writer: usize,
    /// The writer's n-th transaction: a writer's transactions commit in this order.
    pub seq: usize,
    pub attempt: Attempt,
}

impl TxRecord {
    pub fn new(writer: usize, seq: usize, attempt: Attempt) -> TxRecord {
        TxRecord {
            writer,
            seq,
            attempt,
        }
    }
}

impl std::ops::Deref for TxRecord {
    type Target = Attempt;
    fn deref(&self) -> &Attempt {
        &self.attempt
    }
}

impl std::ops::DerefMut for TxRecord {
    fn deref_mut(&mut self) -> &mut Attempt {
        &mut self.attempt
    }
}

/// Every attempted transaction of any number of writers, shared between them.
#[derive(Debug, Clone, Default)]
pub struct Ledger(Arc<Mutex<Vec<TxRecord>>>);

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, Vec<TxRecord>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn record(&self, record: TxRecord) {
        self.lock().push(record);
    }

    /// How many records `matches`.
    pub fn count(&self, matches: impl Fn(&TxRecord) -> bool) -> usize {
        self.lock().iter().filter(|r| matches(r)).count()
    }

    /// Rows committed so far.
    pub fn committed_rows(&self) -> u64 {
        let ledger = self.lock();
        let committed = ledger.iter().filter(|r| r.outcome == Outcome::Committed);
        committed.map(|r| r.ids.len() as u64).sum()
    }

    /// Takes the records and resolves each transaction in doubt by looking for its rows, by
    /// id and tag (all there: committed; none: not), or, for one that deleted its rows, for
    /// its tag in `writer_commits`. The tag matters: after a crash (the test servers run with
    /// `fsync = off`) the sequence may hand a transaction in doubt's ids to a later one.
    pub async fn settle(&self, sql: &tokio_postgres::Client) -> WriterLog {
        let mut transactions = std::mem::take(&mut *self.lock());
        let mut settled_in_doubt = (0, 0);
        for record in transactions
            .iter_mut()
            .filter(|r| r.outcome == Outcome::InDoubt)
        {
            let present: i64 = if record.deleted {
                let marked: i64 = sql
                    .query_one(
                        "select count(*) from writer_commits where tag = $1",
                        &[&record.tag],
                    )
                    .await
                    .expect("look for a transaction's tag")
                    .get(0);
                marked * record.ids.len() as i64
            } else {
                sql.query_one(
                    "select count(*) from outbox_events where id = any($1) and payload->>'tag' = $2",
                    &[&record.ids, &record.tag],
                )
                .await
                .expect("count a transaction's rows")
                .get(0)
            };
            record.outcome = if present == 0 {
                settled_in_doubt.1 += 1;
                Outcome::Aborted
            } else {
                assert_eq!(
                    present as usize,
                    record.ids.len(),
                    "a transaction is atomic"
                );
                settled_in_doubt.0 += 1;
                Outcome::Committed
            };
        }
        WriterLog::new(transactions, settled_in_doubt)
    }
}

/// What the writers did.
#[derive(Debug, Default, Clone)]
pub struct WriterLog {
    /// Every attempted transaction; none in doubt.
    pub transactions: Vec<TxRecord>,
    /// Ids of rows whose transactions did not commit (rolled back, or cut off).
    pub rolled_back: Vec<i64>,
    /// Transactions whose COMMIT was cut off: (found committed, found not committed).
    pub settled_in_doubt: (usize, usize),
}

impl WriterLog {
    fn new(transactions: Vec<TxRecord>, settled_in_doubt: (usize, usize)) -> WriterLog {
        let rolled_back = transactions
            .iter()
            .filter(|r| r.outcome != Outcome::Committed)
            .flat_map(|r| r.ids.iter().copied())
            .collect();
        WriterLog {
            transactions,
            rolled_back,
            settled_in_doubt,
        }
    }

    /// (transactions, rows) with `outcome`.
    pub fn count(&self, outcome: Outcome) -> (usize, usize) {
        let records = self.transactions.iter().filter(|r| r.outcome == outcome);
        records.fold((0, 0), |(tx, rows), r| (tx + 1, rows + r.ids.len()))
    }

    pub fn committed_rows(&self) -> usize {
        self.count(Outcome::Committed).1
    }

    pub fn committed_transactions(&self) -> usize {
        self.count(Outcome::Committed).0
    }

    /// The ids of every committed row.
    pub fn committed_ids(&self) -> HashSet<i64> {
        let committed = self
            .transactions
            .iter()
            .filter(|r| r.outcome == Outcome::Committed);
        committed.flat_map(|r| r.ids.iter().copied()).collect()
    }
}

/// Transaction sizes the writers cycle through (mixed: single rows up to a few hundred).
pub const MIXED_SIZES: [usize; 10] = [1, 7, 40, 2, 150, 1, 20, 3, 300, 12];
/// Every this many transactions a writer rolls one back instead of committing it.
pub const ROLLBACK_EVERY: usize = 9;

/// Writers committing (and now and then rolling back) transactions continuously, each on
/// its own connection, until [`Writers::stop`]. A writer whose connection fails (a Postgres
/// crash) reconnects; it retries a transaction only when it is known not to have
/// committed, and records one whose COMMIT was cut off as in doubt.
#[derive(Debug)]
pub struct Writers {
    url: String,
    stop: Arc<AtomicBool>,
    ledger: Ledger,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    /// Starts `writers` writers on the case's database, cycling through [`MIXED_SIZES`]
    /// (over 10 entities, `OrderPaid`) and rolling back every [`ROLLBACK_EVERY`]th
    /// transaction; each pauses `pause` between transactions.
    pub async fn start(case: &Case, writers: usize, pause: Duration) -> Writers {
        let plans = (0..writers).map(|w| {
            let mut k = 0usize;
            move || {
                let plan = Plan {
                    size: MIXED_SIZES[(k + 3 * w) % MIXED_SIZES.len()],
                    entities: 10,
                    offset: 0,
                    event_types: ORDER_PAID,
                    commit: (k + 1) % ROLLBACK_EVERY != 0,
                    delete: false,
                    pause,
                };
                k += 1;
                plan
            }
        });
        Writers::start_with(&case.pg_url, Ledger::default(), plans)
    }

    /// Starts one writer per plan source (writer `w` draws its transactions from the `w`th),
    /// recording into `ledger`.
    pub fn start_with<P>(url: &str, ledger: Ledger, plans: impl IntoIterator<Item = P>) -> Writers
    where
        P: FnMut() -> Plan + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = plans
            .into_iter()
            .enumerate()
            .map(|(w, plans)| {
                let task = write_until(w, url.to_owned(), plans, stop.clone(), ledger.clone());
                tokio::spawn(task)
            })
            .collect();
        Writers {
            url: url.to_owned(),
            stop,
            ledger,
            tasks,
        }
    }

    /// Where the writers record.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Rows committed so far.
    pub fn committed_rows(&self) -> u64 {
        self.ledger.committed_rows()
    }

    /// Stops the writers (each finishes its current transaction) and returns what they did
    /// ([`Ledger::settle`]d).
    pub async fn stop(self) -> WriterLog {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.expect("writer task");
        }
        let sql = eventually("a SQL connection", DEADLINE, || async {
            sql_connect(&self.url).await.ok()
        })
        .await;
        self.ledger.settle(&sql).await
    }
}

/// Writer `writer`: transactions drawn from `plans` until `stop`, tagged `w{writer}-{seq}`.
async fn write_until(
    writer: usize,
    url: String,
    mut plans: impl FnMut() -> Plan,
    stop: Arc<AtomicBool>,
    ledger: Ledger,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut seq = 0;
    let mut retry: Option<Plan> = None;
    while !stop.load(Ordering::SeqCst) {
        let sql = match client.as_mut() {
            Some(sql) if !sql.is_closed() => sql,
            _ => {
                client = sql_connect(&url).await.ok();
                if client.is_none() {
                    // Postgres is down: try again shortly.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let plan = retry.take().unwrap_or_else(&mut plans);
        let recorded = match attempt(sql, &plan, &format!("w{writer}-{seq}")).await {
            Ok(attempt) => Some(attempt),
            Err(attempt) => {
                client = None;
                // Known not committed (nothing inserted, or COMMIT never sent): retry it.
                let aborted = attempt
                    .as_ref()
                    .is_none_or(|a| a.outcome == Outcome::Aborted);
                if plan.commit && aborted {
                    retry = Some(plan);
                }
                attempt
            }
        };
        if let Some(attempt) = recorded {
            ledger.record(TxRecord::new(writer, seq, attempt));
            seq += 1;
        }
        if retry.is_none() {
            tokio::time::sleep(plan.pause).await;
        }
    }
}

/// The first column of the one row `query` returns.
pub async fn sql_value<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    sql: &impl tokio_postgres::GenericClient,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> T {
    sql.query_one(query, params)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .get(0)
}

/// The first column of every row `query` returns, in its order.
pub async fn sql_column<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    sql: &impl tokio_postgres::GenericClient,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Vec<T> {
    sql.query(query, params)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Inserts one outbox row whose columns `(entity_id, event_type, dedupe_key, partition_key,
/// ordering_key, payload)` are the SQL expressions `values` (parenthesised), on a client or
/// in a transaction; returns its id.
pub async fn insert_row(sql: &impl tokio_postgres::GenericClient, values: &str) -> i64 {
    sql.query_one(
        &format!(
            "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
             values {values} returning id"
        ),
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("insert {values}: {e}"))
    .get(0)
}

/// Inserts the poison tests' oversized row: `OrderPaid` of `order-poison` with a payload of
/// about 10 KB (`{"blob": "xxx…"}`), under the placeholder dedupe key `dedupe_key`; returns
/// its id.
pub async fn insert_oversized_row(
    sql: &impl tokio_postgres::GenericClient,
    dedupe_key: &str,
) -> i64 {
    insert_row(
        sql,
        &format!(
            "('order-poison', 'OrderPaid', '{dedupe_key}', 'tmp', 'tmp', jsonb_build_object('blob', repeat('x', 10000)))"
        ),
    )
    .await
}

impl Case {
    /// Starts the relay, commits one transaction of `rows` rows over `entities` entities
    /// (tagged `tag`, [`insert_transaction`]) and waits until the stream holds `rows`
    /// messages.
    pub async fn relay_transaction(&self, rows: usize, entities: usize, tag: &str) -> Relayed {
        let relay = self.start_relay();
        let mut sql = self.sql().await;
        let ids = insert_transaction(&mut sql, rows, entities, tag).await;
        let js = self.jetstream().await;
        self.wait_for_count(&js, rows as u64, DEADLINE).await;
        Relayed {
            relay,
            sql,
            js,
            ids,
        }
    }
}
