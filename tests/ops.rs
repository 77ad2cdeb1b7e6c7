//! End-to-end tests of what operators see, against real Postgres 15 and nats-server
//! processes (testkit): `outbox-relay status` on a running relay (JSON field by field, the
//! table's key lines, exit 0), after the relay stopped with a backlog (lag, exit 3 with a
//! tiny `--max-lag-bytes`), with the slot dropped (exit 4) and with the servers unreachable
//! (exit 1); and the stream settings (`stream_*` options): a created stream has them, and an
//! existing stream's risky settings are warned about at start and in `status`.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::assert_contains_all;

use support::sql_value;

use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::jetstream::stream::{DiscardPolicy, StorageType};
use serde_json::Value;
use support::{
    eventually, exits_with, insert_transaction, new_case, parse_rfc3339_utc, rows, servers, Case,
    CommandRun, Relayed, DEADLINE,
};

/// What a `outbox-relay status --json` run printed, read.
trait StatusJson {
    fn json(&self) -> Value;
    /// The messages of the findings of `level`.
    fn findings(&self, level: &str) -> Vec<String>;
}

impl StatusJson for CommandRun {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "status --json is not JSON ({e}):\n{}\n{}",
                self.stdout, self.stderr
            )
        })
    }

    fn findings(&self, level: &str) -> Vec<String> {
        self.json()["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["level"] == level)
            .map(|f| f["message"].as_str().unwrap().to_owned())
            .collect()
    }
}

fn status(case: &Case, args: &[&str]) -> CommandRun {
    case.run_command("status", args)
}

/// `outbox-relay init` for the case; returns its stderr (the log) after asserting exit 0.
fn init(case: &Case) -> String {
    exits_with(&mut case.relay_command("init"), 0)
}

/// The pid of the session holding an advisory lock in the case's database.
async fn advisory_lock_holder(sql: &tokio_postgres::Client) -> Option<i32> {
    sql.query_opt(
        "select pid from pg_locks where locktype = 'advisory' and granted \
            and database = (select oid from pg_database where datname = current_database())",
        &[],
    )
    .await
    .unwrap()
    .map(|row| row.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_a_streaming_relay_is_healthy_and_reports_every_part() {
    let mut case = new_case("status_healthy");
    // A password the server does not check (trust): status must not print it.
    case.pg_url = case
        .pg_url
        .replacen("postgres@", "postgres:hunter2-status@", 1);
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 3, 2, "first").await;
    let ids = insert_transaction(&mut sql, 5, 2, "second").await;
    let js = case.jetstream().await;
    case.wait_for_count(&js, 8, DEADLINE).await;
    let messages = case.messages(&js).await;
    let last = messages.last().unwrap();
    // The relay confirms at its next status update.
    eventually("the slot to confirm the last event", DEADLINE, || async {
        (case.confirmed_flush_lsn(&sql).await > last.commit_lsn()).then_some(())
    })
    .await;
    let row = rows(&sql)
        .await
        .into_iter()
        .find(|r| r.id == *ids.last().unwrap())
        .unwrap();

    // Caught up: the relay confirms idle positions too, but other tests' writes on the shared
    // server (a CREATE DATABASE logs its template, ~7 MiB) move the WAL between two of its
    // status updates: the status read once the lag is back under 1 MiB.
    let json = eventually("status to see the slot caught up", DEADLINE, || async {
        let run = status(&case, &["--json"]);
        run.assert_code(0);
        let json = run.json();
        (json["slot"]["lag_bytes"].as_u64()? < 1 << 20).then_some(json)
    })
    .await;
    assert_eq!(json["health"], "healthy");
    assert_eq!(json["exit_code"], 0);
    assert_eq!(json["findings"], serde_json::json!([]));
    assert!(!json["postgres"].as_str().unwrap().contains("hunter2"));

    // The slot: streamed by the relay's walsender, caught up.
    let slot = &json["slot"];
    let walsender: i32 = sql_value(
        &sql,
        "select active_pid from pg_replication_slots where slot_name = $1",
        &[&case.slot],
    )
    .await;
    assert_eq!(slot["name"], case.slot.as_str());
    assert_eq!(slot["exists"], true);
    assert_eq!(slot["plugin"], "pgoutput");
    assert_eq!(slot["database"], case.database.as_str());
    assert_eq!(slot["active"], true);
    assert_eq!(slot["active_pid"], walsender);
    assert_eq!(slot["walsender"]["pid"], walsender);
    assert_eq!(slot["walsender"]["client_addr"], "127.0.0.1");
    assert_eq!(slot["wal_status"], "reserved");
    assert_eq!(
        slot["safe_wal_size"],
        Value::Null,
        "max_slot_wal_keep_size is -1"
    );
    let lsn = |v: &Value| v.as_str().unwrap().parse::<pgoutput::Lsn>().unwrap();
    let confirmed = lsn(&slot["confirmed_flush_lsn"]);
    let current = lsn(&slot["current_wal_lsn"]);
    assert!(
        confirmed >= last.commit_lsn(),
        "the relay confirmed its events"
    );
    assert_eq!(slot["lag_bytes"], confirmed.bytes_until(current));
    assert!(slot["lag_bytes"].as_u64().unwrap() < 1 << 20, "{slot}");

    // The publication.
    let publication = &json["publication"];
    assert_eq!(publication["name"], case.publication.as_str());
    assert_eq!(publication["exists"], true);
    assert_eq!(publication["all_tables"], false);
    assert_eq!(publication["operations"], serde_json::json!(["insert"]));
    assert_eq!(publication["publish_via_partition_root"], true);
    assert_eq!(publication["includes_outbox_table"], true);
    assert_eq!(
        publication["tables"],
        serde_json::json!([{"name": "public.outbox_events", "row_filter": null, "columns": null}])
    );

    // The lease: the relay's control session, the one pg_locks shows.
    let holder = advisory_lock_holder(&sql).await.unwrap();
    assert_eq!(json["lease"]["held"], true);
    assert_eq!(json["lease"]["holder"]["pid"], holder);
    assert_ne!(holder, walsender);
    assert_eq!(json["lease"]["holder"]["client_addr"], "127.0.0.1");

    // The stream, as the relay created it.
    let stream = &json["stream"];
    assert_eq!(stream["name"], case.stream.as_str());
    assert_eq!(stream["exists"], true);
    assert_eq!(
        stream["subjects"],
        serde_json::json!([format!("{}.>", case.prefix)])
    );
    assert_eq!(stream["messages"], 8);
    assert_eq!(stream["first_sequence"], 1);
    assert_eq!(stream["last_sequence"], 8);
    assert!(stream["bytes"].as_u64().unwrap() > 0);
    assert_eq!(stream["duplicate_window_seconds"], 120.0);
    assert_eq!(stream["storage"], "file");
    assert_eq!(stream["replicas"], 1);
    assert_eq!(stream["retention"], "limits");
    assert_eq!(stream["discard"], "old");
    for unlimited in [
        "max_age_seconds",
        "max_bytes",
        "max_msgs",
        "max_msgs_per_subject",
        "max_msg_size",
    ] {
        assert_eq!(stream[unlimited], Value::Null, "{unlimited}");
    }
    assert_eq!(stream["server_max_payload"], 1_048_576);

    // The last event: the last row committed, aged from its created_at.
    let event = &json["last_event"];
    assert_eq!(event["sequence"], 8);
    assert_eq!(event["subject"], last.subject.as_str());
    assert_eq!(event["outbox_id"], row.id);
    let created = parse_rfc3339_utc(event["created_at"].as_str().unwrap()).unwrap();
    assert_eq!(
        created.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64,
        row.created_at_ms
    );
    assert_eq!(event["age_from"], "created_at");
    let age = event["age_seconds"].as_f64().unwrap();
    assert!((0.0..600.0).contains(&age), "{age}");
    assert_eq!(event["commit_lsn"], last.header("Outbox-Commit-Lsn"));
    assert_eq!(event["tx_index"], 4);
    assert_eq!(event["source"], last.header("Outbox-Source"));
    assert_eq!(event["dead_letter"], false);

    // The table for people.
    let run = status(&case, &[]);
    run.assert_code(0);
    let table = &run.stdout;
    assert_contains_all(
        table,
        [
            "outbox-relay status: healthy\n".to_owned(),
            format!("slot         {} (pgoutput, database {}): active, streamed by pid {walsender} (outbox-relay, 127.0.0.1:", case.slot, case.database),
            "  wal        wal_status reserved, safe_wal_size unlimited\n".to_owned(),
            format!("publication  {}: insert; publish_via_partition_root true\n", case.publication),
            "  tables     public.outbox_events\n".to_owned(),
            format!("lease        held by pid {holder} (outbox-relay, 127.0.0.1:"),
            format!("stream       {}: subjects {}.>\n", case.stream, case.prefix),
            "  messages   8 (".to_owned(),
            // A current nats-server names the stream's leader after the replicas, even alone.
            "  settings   file storage, 1 replica".to_owned(),
            ", duplicate window 2m, limits retention, discard old\n".to_owned(),
            format!("last event   outbox id {}, sequence 8, subject {}\n", row.id, last.subject),
            format!("  position   commit {} #4, source {}\n", last.header("Outbox-Commit-Lsn"), last.header("Outbox-Source")),
        ],
    );
    for output in [&run.stdout, &run.stderr] {
        assert!(!output.contains("hunter2"), "{output}");
    }
    relay.terminate(DEADLINE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_lagging_when_the_relay_stopped_with_a_backlog_and_broken_without_the_slot() {
    let case = new_case("status_lagging");
    let Relayed {
        mut relay, mut sql, ..
    } = case.relay_transaction(2, 1, "relayed").await;
    assert!(relay.terminate(DEADLINE).success());
    insert_transaction(&mut sql, 500, 5, "backlog").await;

    // Nobody relays: lagging, whatever the lag.
    let run = status(&case, &["--json"]);
    run.assert_code(3);
    let json = run.json();
    assert_eq!(json["health"], "lagging");
    assert_eq!(json["slot"]["active"], false);
    assert_eq!(json["lease"]["held"], false);
    assert_eq!(json["lease"]["holder"], Value::Null);
    let lag = json["slot"]["lag_bytes"].as_u64().unwrap();
    let server_lag: i64 = sql_value(
        &sql,
        "select pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint \
               from pg_replication_slots where slot_name = $1",
        &[&case.slot],
    )
    .await;
    assert!(lag > 500 * 50, "the backlog's WAL at least: {lag}");
    assert!(lag as i64 <= server_lag, "{lag} vs {server_lag} read later");
    let lagging = run.findings("lagging");
    assert_eq!(lagging.len(), 1, "{lagging:?}");
    assert!(
        lagging[0].contains("no relay holds the lease"),
        "{lagging:?}"
    );
    assert_eq!(json["stream"]["messages"], 2);

    // With a tiny threshold, the lag itself is reported too.
    let run = status(&case, &["--json", "--max-lag-bytes", "1"]);
    run.assert_code(3);
    let lagging = run.findings("lagging");
    assert!(
        lagging
            .iter()
            .any(|f| f
                .contains("behind the server's WAL, more than 1 B (OUTBOX_RELAY_MAX_LAG_BYTES)")),
        "{lagging:?}"
    );
    let run = status(&case, &[]);
    assert_eq!(run.code, 3);
    assert!(
        run.stdout
            .starts_with("outbox-relay status: LAGGING (exit 3)\n"),
        "{}",
        run.stdout
    );

    // Without the slot: broken.
    sql.execute("select pg_drop_replication_slot($1)", &[&case.slot])
        .await
        .unwrap();
    let run = status(&case, &["--json"]);
    run.assert_code(4);
    let json = run.json();
    assert_eq!(json["health"], "broken");
    assert_eq!(
        json["slot"],
        serde_json::json!({"name": case.slot, "exists": false})
    );
    let broken = run.findings("broken");
    assert!(
        broken
            .iter()
            .any(|f| f.contains(&format!("replication slot {} does not exist", case.slot))),
        "{broken:?}"
    );
    let run = status(&case, &[]);
    assert_eq!(run.code, 4);
    run.assert_stdout_has(&[&format!("slot         {}: does not exist\n", case.slot)]);
}

#[test]
fn status_exits_1_when_it_cannot_reach_postgres_or_nats_unless_what_it_read_is_broken() {
    let mut case = new_case("status_unreachable");
    init_slot_and_publication(&case);
    case.nats_url = format!("nats://127.0.0.1:{}", testkit::free_port());
    let run = status(&case, &["--json"]);
    run.assert_code(1);
    let json = run.json();
    assert_eq!(json["health"], "unknown");
    assert_eq!(json["stream"], Value::Null);
    assert_eq!(json["slot"]["exists"], true, "Postgres was read");
    let unknown = run.findings("unknown");
    assert!(unknown[0].contains("cannot connect to NATS"), "{unknown:?}");
    assert_eq!(run.findings("lagging").len(), 1, "no lease holder");

    // What was read is broken: that wins.
    servers().pg.psql(
        &case.database,
        &format!("drop publication {}", case.publication),
    );
    let run = status(&case, &["--json"]);
    assert_eq!(run.code, 4, "{}", run.stdout);
    assert_eq!(run.findings("unknown").len(), 1, "{}", run.stdout);

    case.pg_url = format!("postgres://postgres@127.0.0.1:{}/app", testkit::free_port());
    let run = status(&case, &[]);
    run.assert_code(1);
    run.assert_stdout_has(&["cannot connect to Postgres", "\nslot         unknown\n"]);
}

/// Creates the case's slot and publication as `init` would, without NATS.
fn init_slot_and_publication(case: &Case) {
    let pg = &servers().pg;
    pg.psql(
        &case.database,
        &format!(
            "create publication {} for table outbox_events with (publish = 'insert'); \
             select pg_create_logical_replication_slot('{}', 'pgoutput');",
            case.publication, case.slot
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_stream_has_the_configured_settings_and_warns_about_the_risky_ones() {
    let mut case = new_case("stream_settings");
    case.extra_env = [
        ("OUTBOX_RELAY_STREAM_REPLICAS", "1"),
        ("OUTBOX_RELAY_STREAM_STORAGE", "memory"),
        ("OUTBOX_RELAY_STREAM_MAX_AGE", "1h"),
        ("OUTBOX_RELAY_STREAM_MAX_BYTES", "64MiB"),
        ("OUTBOX_RELAY_STREAM_MAX_MSG_SIZE", "8MiB"),
        ("OUTBOX_RELAY_STREAM_DISCARD", "new"),
        ("OUTBOX_RELAY_DUPLICATE_WINDOW", "5m"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let log = init(&case);

    let js = case.jetstream().await;
    let mut stream = js.get_stream(&case.stream).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.subjects, vec![format!("{}.>", case.prefix)]);
    assert_eq!(config.num_replicas, 1);
    assert_eq!(config.storage, StorageType::Memory);
    assert_eq!(config.max_age, Duration::from_secs(3600));
    assert_eq!(config.max_bytes, 64 << 20);
    assert_eq!(config.max_message_size, 8 << 20);
    assert_eq!(config.discard, DiscardPolicy::New);
    assert_eq!(config.duplicate_window, Duration::from_secs(300));

    assert_contains_all(
        &log,
        [
            format!("stream {} keeps its events in memory: a nats-server restart loses every one of them", case.stream),
            format!("stream {} deletes events older than 1h (max_age), read or not", case.stream),
            format!("stream {} refuses new events beyond 64 MiB (max_bytes) (discard new): then every publish of the relay fails", case.stream),
            format!("stream {} accepts messages up to 8 MiB (max_msg_size), but the server's max_payload is 1 MiB", case.stream),
        ],
    );
    assert!(!log.contains("differs from the options given"), "{log}");

    // status shows the same settings, and the same warnings.
    let run = status(&case, &["--json"]);
    let json = run.json();
    let stream = &json["stream"];
    assert_eq!(stream["storage"], "memory");
    assert_eq!(stream["max_age_seconds"], 3600.0);
    assert_eq!(stream["max_bytes"], 64 << 20);
    assert_eq!(stream["max_msg_size"], 8 << 20);
    assert_eq!(stream["discard"], "new");
    assert_eq!(stream["duplicate_window_seconds"], 300.0);
    assert_eq!(run.findings("warning").len(), 4, "{}", run.stdout);
    // Nothing relays (init only): lagging, not broken.
    assert_eq!(run.code, 3, "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_in_memory_with_a_short_max_age_is_warned_about_and_left_alone() {
    let mut case = new_case("stream_existing");
    let js = case.jetstream().await;
    case.create_stream(
        &js,
        jetstream::stream::Config {
            storage: StorageType::Memory,
            max_age: Duration::from_secs(60),
            max_messages: 1000,
            duplicate_window: Duration::from_secs(30),
            ..Default::default()
        },
    )
    .await;
    case.extra_env = vec![
        ("OUTBOX_RELAY_STREAM_MAX_AGE".into(), "7d".into()),
        ("OUTBOX_RELAY_DUPLICATE_WINDOW".into(), "30s".into()),
    ];
    let log = init(&case);
    assert_contains_all(
        &log,
        [
            format!("stream {} keeps its events in memory: a nats-server restart loses every one of them", case.stream),
            format!("stream {} deletes events older than 1m (max_age), read or not: a consumer that falls further behind", case.stream),
            format!("stream {} deletes its oldest events beyond 1000 messages (max_msgs) (discard old)", case.stream),
            format!("stream {} differs from the options given for it: max_age 1m (OUTBOX_RELAY_STREAM_MAX_AGE: 7d)", case.stream),
        ],
    );
    // The relay never changes an existing stream.
    let mut stream = js.get_stream(&case.stream).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.max_age, Duration::from_secs(60));
    assert_eq!(config.storage, StorageType::Memory);
    let run = status(&case, &["--json"]);
    let warnings = run.findings("warning");
    assert_eq!(warnings.len(), 4, "{warnings:?}");
}

/// ST1 on a current nats-server (2.12+): an operator's stream that acknowledges a publish
/// before writing it (`persist_mode: async`) is warned about at start and in `status`, and
/// left as it is; a stream the relay creates there gets no such warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_persist_stream_is_warned_about_on_a_current_server() {
    let nats = testkit::Nats::start_current(&[]);
    let warning = "acknowledges events before writing them (persist_mode: async)";

    let created = Case::new(&servers().pg, &nats, "stream_persist_default");
    let log = init(&created);
    assert!(log.contains("created stream"), "{log}");
    assert!(!log.contains(warning), "{log}");

    let case = Case::new(&servers().pg, &nats, "stream_persist_async");
    let js = case.jetstream().await;
    let config = serde_json::json!({
        "name": case.stream, "subjects": [format!("{}.>", case.prefix)], "storage": "file",
        "duplicate_window": 120_000_000_000u64, "persist_mode": "async",
    });
    let answer: Value = js
        .request(format!("STREAM.CREATE.{}", case.stream), &config)
        .await
        .unwrap();
    assert!(answer.get("error").is_none(), "{answer}");
    let log = init(&case);
    let expected = format!(
        "stream {} {warning}: when nats-server is killed or crashes",
        case.stream
    );
    assert!(log.contains(&expected), "{expected:?} missing from\n{log}");
    assert!(
        log.contains("create the stream with persist_mode: default"),
        "{log}"
    );
    let run = status(&case, &["--json"]);
    let warnings = run.findings("warning");
    assert_eq!(
        warnings.iter().filter(|w| w.contains(warning)).count(),
        1,
        "{}",
        run.stdout
    );
    let info: Value = js
        .request(
            format!("STREAM.INFO.{}", case.stream),
            &serde_json::json!({}),
        )
        .await
        .unwrap();
    assert_eq!(info["config"]["persist_mode"], "async", "left as it is");
    println!(
        "persist_mode async: nats-server {}, warned at init and in status; a created stream not",
        js.client().server_info().version
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_discard_new_stream_is_broken_in_status() {
    let case = new_case("stream_full");
    let js = case.jetstream().await;
    case.create_stream(
        &js,
        jetstream::stream::Config {
            max_messages: 1,
            discard: DiscardPolicy::New,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        },
    )
    .await;
    js.publish(format!("{}.0.x", case.prefix), "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let log = init(&case);
    let full = format!("stream {} is full: it holds 1 message, ", case.stream);
    assert!(log.contains(&full), "{log}");
    let run = status(&case, &["--json"]);
    assert_eq!(run.code, 4, "{}", run.stdout);
    let broken = run.findings("broken");
    assert!(broken.iter().any(|f| f.contains(&full)), "{broken:?}");
    // A message without outbox headers is still shown as the last one.
    let json = run.json();
    assert_eq!(json["last_event"]["outbox_id"], Value::Null);
    assert_eq!(json["last_event"]["age_from"], "stored_at");
}

#[test]
fn replicas_a_single_server_cannot_keep_are_refused_naming_the_option() {
    let mut case = new_case("stream_replicas");
    case.extra_env = vec![("OUTBOX_RELAY_STREAM_REPLICAS".into(), "3".into())];
    let stderr = case.relay_exits("init", 1);
    assert!(
        stderr.contains(&format!("cannot create stream {}", case.stream))
            && stderr.contains(
                "a single nats-server keeps one replica: set OUTBOX_RELAY_STREAM_REPLICAS=1"
            ),
        "{stderr}"
    );
}
