//! With the `opentelemetry` feature, against a real Postgres and nats-server (testkit): an
//! event published with the producer's W3C trace context is handled in a span of the
//! producer's trace (TR2 in `outbox_consumer::trace`), seen through OpenTelemetry's
//! in-memory exporter.

#![allow(clippy::unwrap_used)]

use std::num::NonZeroU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::{EventId, OutboxEvent, Position};
use outbox_consumer::{BoxError, Config, Consumer, Event, Handler, Postgres, Transaction};
use tracing_subscriber::layer::SubscriberExt as _;

const DEADLINE: Duration = Duration::from_secs(60);
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN_ID: &str = "00f067aa0ba902b7";

/// The spans the test binary's tracing ends, exported in memory.
fn exported() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("consumer-test")));
        tracing::subscriber::set_global_default(subscriber).unwrap();
        (exporter, provider)
    })
}

/// A handler doing its work in a span of its own.
struct Traced;

impl Handler for Traced {
    async fn handle(&self, _tx: &mut Transaction<'_>, event: &Event) -> Result<(), BoxError> {
        tracing::info_span!("ledger.apply", outbox_id = %event.id).in_scope(|| {});
        Ok(())
    }
}

/// Every span ended so far.
fn finished_spans() -> Vec<SpanData> {
    let (exporter, provider) = exported();
    provider.force_flush().unwrap();
    exporter.get_finished_spans().unwrap()
}

fn finished(name: &str) -> Option<SpanData> {
    finished_spans().into_iter().find(|s| s.name == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handled_event_continues_the_producers_trace() {
    exported();
    let pg = testkit::Postgres::start();
    let nats = testkit::Nats::start();
    pg.create_database("consumer_trace");
    let pg_url = pg.url("consumer_trace");
    let (sql, connection) = tokio_postgres::connect(&pg_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    sql.batch_execute(outbox_consumer::SCHEMA_SQL)
        .await
        .unwrap();
    let client = async_nats::connect(&nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "OUTBOX_TRACE".into(),
        subjects: vec!["trace.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();

    let partitions = NonZeroU64::new(4).unwrap();
    let (id, entity_id, event_type, created_at_ms) = (EventId::Int(1), "order-1", "OrderPaid", 1);
    let shard = outbox::shard_for_key(partitions, entity_id);
    let traceparent = format!("00-{TRACE_ID}-{PRODUCER_SPAN_ID}-01");
    let event = OutboxEvent {
        keys: id.keys(entity_id, event_type, created_at_ms),
        id,
        entity_id: entity_id.into(),
        event_type: event_type.into(),
        subject: outbox::subject::subject("trace", shard, event_type),
        shard,
        payload: Bytes::from_static(b"{}"),
        position: Position {
            commit_lsn: pgoutput::Lsn(0x100),
            index: 0,
        },
        created_at_ms,
        headers: vec![
            (Arc::from("traceparent"), traceparent),
            (Arc::from("tracestate"), "rojo=00f067aa0ba902b7".to_owned()),
        ],
        binary: false,
    };
    js.send_publish(event.subject.clone(), sink::publish_message(&event))
        .await
        .unwrap()
        .await
        .unwrap();

    let mut config = Config::new("traced");
    config.stream = "OUTBOX_TRACE".into();
    config.subject_prefix = "trace".into();
    config.partitions = partitions;
    config.shards = Some(vec![shard]);
    let consumer = Consumer::new(
        config,
        client,
        Postgres::new(pg_url.parse().unwrap(), tokio_postgres::NoTls),
    );
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(Traced, async {
        let _ = stopped.await;
    }));
    let start = Instant::now();
    while stats.processed() < 1 || finished("outbox.handle").is_none() {
        assert!(
            start.elapsed() < DEADLINE,
            "the event was not handled in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    let handle = finished("outbox.handle").unwrap();
    let trace_id = TraceId::from_hex(TRACE_ID).unwrap();
    assert_eq!(
        handle.span_context.trace_id(),
        trace_id,
        "the producer's trace"
    );
    assert_eq!(
        handle.parent_span_id,
        SpanId::from_hex(PRODUCER_SPAN_ID).unwrap(),
        "the producer's span is the parent"
    );
    assert_eq!(
        handle.span_context.trace_state().header(),
        "rojo=00f067aa0ba902b7"
    );
    let apply = finished("ledger.apply").unwrap();
    assert_eq!(apply.span_context.trace_id(), trace_id);
    assert_eq!(apply.parent_span_id, handle.span_context.span_id());
}

/// A handler applying each event once: a duplicate would break `applied`'s primary key.
struct Applied;

impl Handler for Applied {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), BoxError> {
        tx.execute(
            "INSERT INTO applied (outbox_id, entity_id) VALUES ($1, $2)",
            &[&event.id.to_string(), &event.entity_id],
        )
        .await?;
        Ok(())
    }
}

/// A user's own outbox table for [`relayed_and_applied_once_in_the_producers_spans`].
struct Table {
    name: &'static str,
    create: &'static str,
    env: &'static [(&'static str, &'static str)],
    template: &'static str,
    /// The producer's trace (each table's its own: the tests share the exporter).
    trace_id: &'static str,
    /// Inserts row `$1` (a number) with the trace context `$2`.
    insert: &'static str,
    /// The trace context of row `n` (trace `trace_id`, span id `n`) as the table holds it.
    context: fn(&str, u64) -> String,
    /// Every row's id and entity id, as text.
    rows: &'static str,
}

/// Issue 22 end to end: `table` through the relay (its subjects by `table.template`), the
/// relay SIGKILLed mid-stream and restarted, and the consumer library applying every row
/// exactly once, each handled in a span whose parent is the producer's span its row names
/// (TR2).
async fn relayed_and_applied_once_in_the_producers_spans(table: Table) {
    use testkit::harness::{built_relay, servers, Case};
    exported();
    let mut case = Case::with_table(table.name, table.create, &[table.env]);
    case.relay_bin = built_relay(None, env!("CARGO_PKG_NAME")).unwrap();
    let pg = &servers().pg;
    pg.psql(&case.database, outbox_consumer::SCHEMA_SQL);
    pg.psql(
        &case.database,
        "CREATE TABLE applied (outbox_id text PRIMARY KEY, entity_id text NOT NULL);",
    );
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let rows = 200u64;
    let (insert, context, trace) = (table.insert, table.context, table.trace_id);
    let writer = tokio::spawn(async move {
        for t in 0..20u64 {
            let tx = sql.transaction().await.unwrap();
            for i in 0..10u64 {
                let n = t * 10 + i + 1;
                let n_sql = i64::try_from(n).unwrap();
                tx.execute(insert, &[&n_sql, &context(trace, n)])
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        }
    });
    case.wait_for_count(&js, 50, DEADLINE).await;
    relay.kill();
    let mut relay = case.start_relay();
    writer.await.unwrap();
    case.wait_for_count(&js, rows, DEADLINE).await;
    relay.terminate(DEADLINE);
    assert_eq!(case.stream_count(&js).await, rows, "one message per row");

    let mut config = Config::new("applier");
    config.stream = case.stream.clone();
    config.subject_prefix = case.prefix.clone();
    config.subject_template = table.template.into();
    let client = async_nats::connect(&case.nats_url).await.unwrap();
    let consumer = Consumer::new(
        config,
        client,
        Postgres::new(case.pg_url.parse().unwrap(), tokio_postgres::NoTls),
    );
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(Applied, async {
        let _ = stopped.await;
    }));
    let trace_id = TraceId::from_hex(table.trace_id).unwrap();
    let start = Instant::now();
    while stats.processed() < rows {
        assert!(
            start.elapsed() < DEADLINE,
            "{} of {rows} events handled in time",
            stats.processed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    let sql = case.sql().await;
    let applied: i64 = sql
        .query_one(
            &format!(
                "SELECT count(*) FROM applied a JOIN ({}) r(id, entity_id) \
                  ON r.id = a.outbox_id AND r.entity_id = a.entity_id",
                table.rows
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied as u64, rows, "every row applied exactly once");
    let mut parents: Vec<String> = finished_spans()
        .iter()
        .filter(|s| s.name == "outbox.handle" && s.span_context.trace_id() == trace_id)
        .map(|s| s.parent_span_id.to_string())
        .collect();
    parents.sort();
    let expected: Vec<String> = (1..=rows).map(|n| format!("{n:016x}")).collect();
    assert_eq!(
        parents, expected,
        "every row handled in a span of its own producer span's trace"
    );
}

/// (a) Debezium's table through the preset: uuid ids, `tracingspancontext` in Java
/// properties, subjects `{prefix}.{aggregatetype}.{shard}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_tables_events_are_applied_once_each_continuing_its_producers_span() {
    relayed_and_applied_once_in_the_producers_spans(Table {
        name: "dbztrace",
        create: testkit::harness::DEBEZIUM_TABLE,
        env: testkit::harness::DEBEZIUM_ENV,
        template: "{prefix}.{aggregatetype}.{shard}",
        trace_id: "0af7651916cd43dd8448eb211c80319c",
        insert: "INSERT INTO outboxevent (aggregatetype, aggregateid, type, payload, tracingspancontext) \
                 VALUES (CASE WHEN $1::int8 % 2 = 0 THEN 'Order' ELSE 'Order.Line' END, \
                         'order-' || ($1::int8 % 13), 'Placed', '{}', $2)",
        context: |trace, n| {
            format!("#Wed Dec 02 05:00:00 UTC 2026\ntraceparent=00-{trace}-{n:016x}-01\n")
        },
        rows: "SELECT id::text, aggregateid::text FROM outboxevent",
    })
    .await;
}

/// (b) A text-id table with a `bytea` payload, a bare `traceparent` column and the template
/// `{prefix}.{region}.{shard}.{event_type}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_id_tables_events_are_applied_once_each_continuing_its_producers_span() {
    relayed_and_applied_once_in_the_producers_spans(Table {
        name: "texttrace",
        create: testkit::harness::TEXT_TABLE,
        env: testkit::harness::TEXT_ENV,
        template: "{prefix}.{region}.{shard}.{event_type}",
        trace_id: "6e0c63257de34c926f9efcd03927272e",
        insert: "INSERT INTO app_events (event_id, stream_id, kind, body, region, tenant, trace) \
                 VALUES ('evt:' || $1::int8, 'stream-' || ($1::int8 % 5), 'Moved', '\\x00ff'::bytea, \
                         CASE WHEN $1::int8 % 2 = 0 THEN 'eu.west' ELSE 'us' END, 'acme', $2)",
        context: |trace, n| format!("00-{trace}-{n:016x}-01"),
        rows: "SELECT event_id, stream_id FROM app_events",
    })
    .await;
}
