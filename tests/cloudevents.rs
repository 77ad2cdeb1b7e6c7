//! CloudEvents binary mode (`--cloudevents`, issue 40) on real servers: the relay's messages
//! read with the official CloudEvents SDK (`cloudevents-sdk`; its HTTP binding's
//! binary-mode reader takes the `ce-*` headers NATS carries the same way), every attribute
//! checked against its row; the relay's own headers unchanged beside them; `verify` clean.

#![allow(clippy::unwrap_used)]

use crate::support;

use cloudevents::{AttributesReader, Data};
use support::{Case, Stored, DEADLINE};

/// The SDK's reading of a stored message: its headers as the binding's header map, its
/// payload as the body.
fn sdk_event(message: &Stored) -> cloudevents::Event {
    let mut headers = http::HeaderMap::new();
    for (name, value) in &message.headers {
        headers.insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            http::HeaderValue::from_str(value).unwrap(),
        );
    }
    cloudevents::binding::http::to_event(&headers, message.payload.clone())
        .unwrap_or_else(|e| panic!("the SDK reads message {}: {e}", message.sequence))
}

/// The event's data as JSON, however the SDK holds it.
fn json_data(event: &cloudevents::Event) -> serde_json::Value {
    match event.data() {
        Some(Data::Json(value)) => value.clone(),
        Some(Data::Binary(bytes)) => serde_json::from_slice(bytes).unwrap(),
        Some(Data::String(text)) => serde_json::from_str(text).unwrap(),
        None => panic!("event {} has no data", event.id()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_reads_every_attribute_of_every_event_from_its_row() {
    let s = support::servers();
    let mut case = Case::new(&s.pg, &s.nats, "cloudevents");
    case.set_env(&[("OUTBOX_RELAY_CLOUDEVENTS", "true")]);
    let js = case.jetstream().await;
    let mut relay = case.start_relay();
    let mut sql = case.sql().await;
    for t in 0..5 {
        let tx = sql.transaction().await.unwrap();
        for i in 0..8 {
            tx.execute(
                "INSERT INTO outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload, created_at) \
                 VALUES ($1, $2, gen_random_uuid()::text, '', '', jsonb_build_object('t', $3::int, 'i', $4::int, 'note', 'café'), \
                         '2026-03-01 10:00:00.123456+00'::timestamptz + make_interval(secs => $3::int * 8 + $4::int))",
                &[&format!("order-{}", i % 3), &"order.created", &t, &i],
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let (messages, _) = case.wait_confirmed(&js, &sql, 40).await;
    relay.terminate(DEADLINE);
    let rows = sql
        .query(
            "SELECT id, entity_id, event_type, payload::text, \
                    floor(extract(epoch FROM created_at) * 1000)::bigint \
             FROM outbox_events ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(messages.len(), rows.len(), "one message per row");
    let source = format!("/{}/public/outbox_events", case.database);
    for (row, message) in rows.iter().zip(&messages) {
        let (id, entity, kind): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
        let payload: serde_json::Value = serde_json::from_str(row.get::<_, &str>(3)).unwrap();
        let created_ms: i64 = row.get(4);
        let event = sdk_event(message);
        assert_eq!(event.specversion(), cloudevents::event::SpecVersion::V10);
        let dedupe_key = format!("{kind}:{entity}:{id}");
        assert_eq!(event.id(), dedupe_key, "ce-id is the dedupe key");
        assert_eq!(message.header("Nats-Msg-Id"), dedupe_key);
        assert_eq!(event.source().to_string(), source);
        assert_eq!(event.ty(), kind);
        assert_eq!(event.subject(), Some(entity.as_str()));
        assert_eq!(
            event.time().map(|t| t.timestamp_millis()),
            Some(created_ms),
            "ce-time is created_at, to the millisecond"
        );
        assert_eq!(event.datacontenttype(), Some("application/json"));
        assert_eq!(json_data(&event), payload, "the data is the row's payload");
        // The relay's own headers stay beside the attributes.
        assert_eq!(message.outbox_id(), id);
        assert_eq!(message.header("Outbox-Entity-Id"), entity);
    }
    let verify = case.run_command("verify", &[]);
    verify.assert_code(0);
    verify.assert_stdout_has(&["0 missing, 0 duplicated, 0 mismatched, 0 out of order"]);
}
