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
        let n = CASE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let database = format!("{name}_{n}");
        pg.create_database(&database);
        pg.psql(&database, SCHEMA_SQL);
        Case {
            name: name.to_owned(),
            pg_url: pg.url(&database),
            nats_url: nats.url(),
            stream: format!("OUTBOX_{}", database.to_uppercase()),
            prefix: format!("t{n}.{name}"),
            slot: format!("slot_{database}"),
            publication: format!("pub_{database}"),
            database,
            extra_env: vec![],
        }
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
        command
            .env("DATABASE_URL", &self.pg_url)
            .env("NATS_URL", &self.nats_url)
            .env("OUTBOX_RELAY_SLOT", &self.slot)
            .env("OUTBOX_RELAY_PUBLICATION", &self.publication)
            .env("OUTBOX_RELAY_STREAM", &self.stream)
            .env("OUTBOX_RELAY_SUBJECT_PREFIX", &self.prefix)
            .env("RUST_LOG", "info,outbox_relay=debug");
        for (key, value) in &self.extra_env {
            command.env(key, value);
        }
        command
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
        jetstream::new(
            async_nats::connect(&self.nats_url)
                .await
                .expect("connect to NATS"),
        )
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
    tx.commit().await.expect("commit");
    rows.iter().map(|r| r.get(0)).collect()
}
