//! The user's own outbox table (issue 22), end to end on real servers: a Debezium-shaped
//! table through `--table-preset debezium`, and a text-id table with a `bytea` payload,
//! header columns, a trace-context column, a custom subject template and an excluded event
//! type, each under relay kills: every row exactly once, in commit order, with the keys,
//! subject and headers the mapping gives, and `verify` clean; a stream of one mapping refused
//! under another.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_value;

use std::num::NonZeroU64;

use support::{
    assert_contains_all, eventually, Case, Stored, DEADLINE, DEBEZIUM_ENV, DEBEZIUM_TABLE,
    TEXT_ENV, TEXT_TABLE,
};

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Runs `write` (which commits rows and returns how many the stream must hold) while the
/// relay is SIGKILLed twice mid-stream and restarted; returns the stream once it holds them.
async fn relay_under_kills<F, Fut>(case: &Case, write: F) -> Vec<Stored>
where
    F: FnOnce(tokio_postgres::Client) -> Fut,
    Fut: std::future::Future<Output = u64> + Send + 'static,
{
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let sql = case.sql().await;
    let writer = tokio::spawn(write(sql));
    let trusted = |log: String| {
        assert!(
            !log.contains("does not hold this replayed event at its place"),
            "every restart finds its replay in the stream: {log}"
        );
    };
    for kill in 1..=2u64 {
        case.wait_for_count(&js, kill * 50, DEADLINE).await;
        relay.kill();
        trusted(relay.output());
        relay = case.start_relay();
    }
    let expected = writer.await.unwrap();
    case.wait_for_count(&js, expected, DEADLINE).await;
    let sql = case.sql().await;
    let (messages, _) = case.wait_confirmed(&js, &sql, expected).await;
    relay.terminate(DEADLINE);
    trusted(relay.output());
    assert_eq!(
        messages.len() as u64,
        expected,
        "the stream holds exactly one message per relayed row"
    );
    // verify reads the table through the same mapping: after the kills, nothing to report.
    let verify = case.run_command("verify", &[]);
    verify.assert_code(0);
    verify.assert_stdout_has(&["0 missing, 0 duplicated, 0 mismatched, 0 out of order"]);
    messages
}

fn shard(entity: &str) -> u64 {
    outbox::shard_for_key(NonZeroU64::new(12).unwrap(), entity)
}

/// (a) Debezium's outbox table (and its Quarkus extension's `timestamp`), uuid ids, a
/// `tracingspancontext` column in Java properties form, through the preset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_table_through_the_preset_arrives_once_in_order_with_its_trace_context() {
    let case = Case::with_table("debezium", DEBEZIUM_TABLE, &[DEBEZIUM_ENV]);
    // Written by Java's Properties.store, as Debezium's outbox extension writes the column:
    // the '=' inside tracestate's members escaped (`congo\=t61rcWkgMzE`).
    let props =
        include_str!("../crates/outbox/tests/fixtures/java-properties/two-vendors.properties");
    assert!(props.contains(TRACEPARENT) && props.contains("congo\\="));
    let messages = relay_under_kills(&case, |mut sql| async move {
        let mut n = 0u64;
        for t in 0..60 {
            let tx = sql.transaction().await.unwrap();
            for i in 0..10 {
                let aggregate_type = if i % 2 == 0 { "Order" } else { "Customer.Account" };
                let trace = (i % 3 == 0).then_some(props);
                tx.execute(
                    "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tracingspancontext) \
                     VALUES (gen_random_uuid(), $1, $2, $3, jsonb_build_object('t', $4::int, 'i', $5::int), \
                             replace($6::text, '\\n', E'\\n'))",
                    &[&aggregate_type, &format!("agg-{}", (t * 10 + i) % 17), &"OrderPlaced", &t, &i, &trace],
                )
                .await
                .unwrap();
                n += 1;
            }
            tx.commit().await.unwrap();
        }
        n
    })
    .await;

    let sql = case.sql().await;
    // Commit order is the writer's order: one connection, one transaction after another.
    let rows = sql
        .query(
            "SELECT id::text, aggregatetype, aggregateid, type, payload::text, tracingspancontext IS NOT NULL, \
                    floor(extract(epoch FROM timestamp) * 1000)::int8 \
               FROM outboxevent ORDER BY (payload->>'t')::int, (payload->>'i')::int",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), messages.len());
    let prefix = &case.prefix;
    for (row, message) in rows.iter().zip(&messages) {
        let id: String = row.get(0);
        let aggregate_type: String = row.get(1);
        let aggregate_id: String = row.get(2);
        let event_type: String = row.get(3);
        let payload: String = row.get(4);
        let traced: bool = row.get(5);
        let ms: i64 = row.get(6);
        assert_eq!(
            message.header("Outbox-Id"),
            id,
            "stream order is commit order"
        );
        assert_eq!(message.header("Outbox-Id-Kind"), "uuid");
        assert_eq!(
            message.header("Nats-Msg-Id"),
            format!("{event_type}:{aggregate_id}:{id}")
        );
        assert_eq!(message.header("Outbox-Entity-Id"), aggregate_id);
        assert_eq!(
            message.header("Outbox-Ordering-Key"),
            format!("{ms:013}:{id}")
        );
        let token = outbox::subject::escape_token(&aggregate_type);
        assert_eq!(
            message.subject,
            format!("{prefix}.{token}.{}", shard(&aggregate_id))
        );
        assert_eq!(
            message.header("Outbox-Shard"),
            shard(&aggregate_id).to_string()
        );
        assert_eq!(String::from_utf8(message.payload.clone()).unwrap(), payload);
        if traced {
            assert_eq!(message.header("traceparent"), TRACEPARENT);
            assert_eq!(
                message.header("tracestate"),
                "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
                "tracestate unescaped, as OpenTelemetry reads it"
            );
        } else {
            assert!(!message.headers.contains_key("traceparent"));
        }
    }
}

/// (c) Debezium's outbox with the Quarkus extension's default `remove-after-insert` (issue 36):
/// each row is deleted in the transaction that inserts it, so the table is always empty and
/// only the WAL carries the insert. 30 transactions of 10 rows, the relay SIGKILLed once 100
/// are stored and started again: every row once, in commit order, in a few sessions (before
/// the replay was compared with the stream, each restart checked the tail against the empty
/// table: hundreds of sessions, then the rows stored twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_table_emptied_by_remove_after_insert_arrives_once_in_order() {
    let case = Case::with_table("debezium_rai", DEBEZIUM_TABLE, &[DEBEZIUM_ENV]);
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    let writer = tokio::spawn(async move {
        let mut ids: Vec<String> = Vec::new();
        for t in 0..30 {
            let tx = sql.transaction().await.unwrap();
            for i in 0..10 {
                let row = tx
                    .query_one(
                        "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) \
                         VALUES (gen_random_uuid(), 'Order', $1, 'OrderPlaced', jsonb_build_object('t', $2::int, 'i', $3::int)) \
                         RETURNING id::text",
                        &[&format!("agg-{}", i % 4), &t, &i],
                    )
                    .await
                    .unwrap();
                let id: String = row.get(0);
                tx.execute("DELETE FROM outboxevent WHERE id = $1::text::uuid", &[&id])
                    .await
                    .unwrap();
                ids.push(id);
            }
            tx.commit().await.unwrap();
        }
        ids
    });
    case.wait_for_count(&js, 100, DEADLINE).await;
    relay.kill();
    let mut output = relay.output();
    let relay = case.start_relay();
    let ids = writer.await.unwrap();
    let sql = case.sql().await;
    let (messages, _) = case.wait_confirmed(&js, &sql, 300).await;
    output.push_str(&relay.output());
    let left: i64 = sql_value(&sql, "SELECT count(*) FROM outboxevent", &[]).await;
    assert_eq!(left, 0, "the table stays empty");
    let stored: Vec<&str> = messages.iter().map(|m| m.header("Outbox-Id")).collect();
    assert_eq!(stored, ids, "every row once, in commit order");
    let sessions = support::lines_with(&output, &[support::STREAMING]);
    assert!(sessions <= 3, "{sessions} sessions for one kill:\n{output}");
    assert!(
        output.contains("replayed events the stream holds, compared one by one, skipped")
            || !output.contains("compare_through=Some"),
        "the restart compared its replay with the stream:\n{output}"
    );
}

/// (b) A text-id table with a `bytea` payload, its own column names, a header column, a
/// bare `traceparent` column, a custom template and an excluded event type; hostile values
/// are percent-encoded under `Outbox-Encoding: percent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_id_bytea_table_with_a_template_and_header_columns_arrives_once_in_order() {
    let case = Case::with_table("texttable", TEXT_TABLE, &[TEXT_ENV]);
    let messages = relay_under_kills(&case, |mut sql| async move {
        let mut published = 0u64;
        for t in 0..50 {
            let tx = sql.transaction().await.unwrap();
            for i in 0..8u8 {
                let kind = if i == 7 { "Noise" } else { "Moved" };
                let id = if i == 3 { format!("nats-evt-{t}-{i}") } else { format!("evt:{t}:{i}") };
                let body: Vec<u8> = vec![0, 0xff, t as u8, i, b'\n'];
                let tenant = if i == 5 { Some("acme\r\nNats-Msg-Id: x") } else if i == 6 { None } else { Some("acme") };
                let region = if i % 2 == 0 { "eu.west" } else { "us" };
                tx.execute(
                    "INSERT INTO app_events (event_id, stream_id, kind, body, region, tenant, trace) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    &[&id, &format!("stream-{}", i % 3), &kind, &body, &region, &tenant, &TRACEPARENT],
                )
                .await
                .unwrap();
                if kind != "Noise" {
                    published += 1;
                }
            }
            tx.commit().await.unwrap();
        }
        published
    })
    .await;

    let sql = case.sql().await;
    let rows = sql
        .query(
            "SELECT event_id, stream_id, kind, body, tenant, region FROM app_events WHERE kind <> 'Noise' ORDER BY seq",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        rows.len(),
        messages.len(),
        "excluded events are not published"
    );
    let prefix = &case.prefix;
    for (row, message) in rows.iter().zip(&messages) {
        let id: String = row.get(0);
        let entity: String = row.get(1);
        let kind: String = row.get(2);
        let body: Vec<u8> = row.get(3);
        let tenant: Option<String> = row.get(4);
        let region: String = row.get(5);
        let percent = message.headers.get("Outbox-Encoding").map(String::as_str) == Some("percent");
        let decoded = |name: &str| {
            let v = message.header(name);
            if percent {
                outbox::encoding::decode(v).unwrap()
            } else {
                v.to_owned()
            }
        };
        assert_eq!(decoded("Outbox-Id"), id, "stream order is commit order");
        assert_eq!(message.header("Outbox-Id-Kind"), "text");
        assert_eq!(decoded("Nats-Msg-Id"), format!("{kind}:{entity}:{id}"));
        assert_eq!(message.payload, body, "the bytea's bytes, as stored");
        let hostile =
            id.starts_with("nats-") || tenant.as_deref().is_some_and(|t| t.contains('\n'));
        assert_eq!(percent, hostile, "only hostile rows are encoded");
        let token = outbox::subject::escape_token(&region);
        assert_eq!(
            message.subject,
            format!("{prefix}.{token}.{}.{kind}", shard(&entity))
        );
        match &tenant {
            Some(tenant) => assert_eq!(decoded("X-Tenant"), *tenant),
            None => assert!(
                !message.headers.contains_key("X-Tenant"),
                "a NULL column gives no header"
            ),
        }
        assert_eq!(decoded("traceparent"), TRACEPARENT);
    }
    assert!(
        messages
            .iter()
            .all(|m| m.subject.split('.').count() == prefix.split('.').count() + 3),
        "every row-derived token is one subject token"
    );
}

/// A stream records the mapping it was made under (ST2): a run under another is refused
/// naming both, and a table without the preset's columns is named with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_one_mapping_is_refused_under_another_and_a_wrong_shape_is_named() {
    let case = Case::with_table(
        "remap",
        "CREATE TABLE ev (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregatetype text NOT NULL, \
         aggregateid text NOT NULL, type text NOT NULL, timestamp timestamptz NOT NULL DEFAULT now(), payload jsonb);",
        &[&[("OUTBOX_RELAY_TABLE", "public.ev"), ("OUTBOX_RELAY_TABLE_PRESET", "debezium")]],
    );
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let sql = case.sql().await;
    sql.batch_execute("INSERT INTO ev (aggregatetype, aggregateid, type, payload) VALUES ('Order', 'o-1', 'Placed', '{}')")
        .await
        .unwrap();
    case.wait_for_count(&js, 1, DEADLINE).await;
    relay.terminate(DEADLINE);

    // The same stream under another template: refused, naming both mappings.
    let mut other = case.clone();
    other.extra_env.push((
        "OUTBOX_RELAY_SUBJECT_TEMPLATE".into(),
        "{prefix}.{shard}.{event_type}".into(),
    ));
    let mut refused = other.spawn_relay();
    let status = refused.wait_exit(DEADLINE);
    assert!(!status.success());
    assert_contains_all(
        &refused.output(),
        [
            "holds events published under another table mapping",
            "subject={prefix}.{aggregatetype}.{shard}",
            "subject={prefix}.{shard}.{event_type}",
        ],
    );

    // The preset on the seed's table: the missing columns named, and the settings to fix it.
    let mut wrong = case.clone();
    wrong.extra_env.retain(|(k, _)| k != "OUTBOX_RELAY_TABLE");
    wrong.stream = format!("{}_SEED", case.stream);
    let mut refused = wrong.spawn_relay();
    assert!(!refused.wait_exit(DEADLINE).success());
    assert_contains_all(
        &refused.output(),
        [
            "missing column(s) aggregateid, type, timestamp, aggregatetype",
            "OUTBOX_RELAY_*_COLUMN",
        ],
    );

    // Still exactly one message: nothing was published by the refused runs.
    eventually("the stream to hold one message", DEADLINE, || async {
        (case.stream_count(&js).await == 1).then_some(())
    })
    .await;
}

/// (e) A table named as SQL writes it (issue 40, config CFG5): a schema and a table whose
/// names hold capitals, a space and a dot, set in double quotes as psql and every DBA write
/// them, relay every row once, in order. The same name written without its quotes is folded
/// to lower case as SQL folds it, and the relay refuses at start (exit 2), saying how it read
/// the name and which quoted name would have named the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_named_in_double_quotes_as_sql_writes_it_is_relayed_once_in_order() {
    const TABLE: &str = r#"create schema "Billing.Dept";
        create table "Billing.Dept"."Outbox Events" (like public.outbox_events including all);"#;
    const QUOTED: &str = r#""Billing.Dept"."Outbox Events""#;
    let case = Case::with_table("quoted_name", TABLE, &[&[("OUTBOX_RELAY_TABLE", QUOTED)]]);
    let relay = case.start_relay();
    let sql = case.sql().await;
    for t in 0..5 {
        sql.execute(
            r#"insert into "Billing.Dept"."Outbox Events"
                 (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload)
               select 'e' || (i % 3), 'Quoted', gen_random_uuid()::text, '', '', '{}'
                 from generate_series(1, 4) i"#,
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("transaction {t}: {e:?}"));
    }
    let js = case.jetstream().await;
    let (messages, _) = case.wait_confirmed(&js, &sql, 20).await;
    let ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    let mut in_order = ids.clone();
    in_order.sort_unstable();
    assert_eq!(ids.len(), 20, "every row once");
    assert_eq!(ids, in_order, "in commit order (one writer: id order)");
    drop(relay);

    let mut unquoted = case.clone();
    unquoted
        .extra_env
        .push(("OUTBOX_RELAY_TABLE".into(), "Billing.Dept.Outbox".into()));
    let refused = unquoted.run_command("run", &[]);
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("read 3 names"),
        "a dotted name unquoted reads as three names: {}",
        refused.stderr
    );
    unquoted.extra_env.pop();
    unquoted.extra_env.push((
        "OUTBOX_RELAY_TABLE".into(),
        r#""Billing.Dept"."OUTBOX EVENTS""#.into(),
    ));
    let refused = unquoted.run_command("run", &[]);
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains(r#"set OUTBOX_RELAY_TABLE='"Billing.Dept"."Outbox Events"'"#),
        "a quoted name keeps its case, and the table of another case is named: {}",
        refused.stderr
    );
    unquoted.extra_env.pop();
    unquoted.extra_env.push((
        "OUTBOX_RELAY_TABLE".into(),
        "public.OUTBOX_EVENTS_ARCHIVE".into(),
    ));
    sql.batch_execute(
        r#"create table public."Outbox_Events_Archive" (like public.outbox_events including all)"#,
    )
    .await
    .unwrap();
    let refused = unquoted.run_command("run", &[]);
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    for said in [
        r#"table "public"."outbox_events_archive" (read as schema "public", table "outbox_events_archive") does not exist"#,
        r#"set OUTBOX_RELAY_TABLE='public."Outbox_Events_Archive"'"#,
    ] {
        assert!(refused.stderr.contains(said), "{said}: {}", refused.stderr);
    }
}
