//! Events built from pgoutput messages captured from a real Postgres 15 (the pgoutput
//! crate's golden fixtures): rows written the way the seed's `seed.py` writes them, with
//! placeholder key columns, get the keys derived from the row alone.

#![allow(clippy::unwrap_used)]

use std::num::NonZeroU64;

use bytes::Bytes;
use outbox::timestamp::{epoch_millis, parse_timestamptz};
use outbox::{compute_keys, shard_for_key, EventBuilder, OutboxColumns};
use pgoutput::{ColumnValue, LogicalMessage, Lsn};

fn messages(fixture: &str) -> Vec<LogicalMessage> {
    fixture
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let hex = line.split_whitespace().nth(1).expect("lsn hex");
            LogicalMessage::decode(Bytes::from(hex::decode(hex).expect("hex"))).expect("decodes")
        })
        .collect()
}

fn events(fixture: &str) -> Vec<(outbox::OutboxEvent, String)> {
    let mut builder = None;
    let mut commit_lsn = Lsn::ZERO;
    let mut index = 0;
    let mut out = Vec::new();
    for message in messages(fixture) {
        match message {
            LogicalMessage::Begin(begin) => {
                commit_lsn = begin.final_lsn;
                index = 0;
            }
            LogicalMessage::Relation(rel) if rel.name == "outbox_events" => {
                let columns =
                    OutboxColumns::from_relation(&rel).expect("the seed's table is relayable");
                builder = Some((
                    rel.rel_id,
                    EventBuilder::new(columns, "outbox", NonZeroU64::new(12).unwrap()),
                ));
            }
            LogicalMessage::Insert(insert) => {
                let Some((rel_id, builder)) = &builder else {
                    continue;
                };
                if insert.rel_id != *rel_id {
                    continue;
                }
                let ColumnValue::Text(created_at) = insert.new_tuple.get(10).expect("created_at")
                else {
                    panic!("created_at is text")
                };
                let event = builder
                    .build(&insert.new_tuple, outbox::Position { commit_lsn, index })
                    .expect("event")
                    .expect("no filter");
                index += 1;
                out.push((event, String::from_utf8(created_at.to_vec()).unwrap()));
            }
            _ => {}
        }
    }
    out
}

#[test]
fn seed_style_rows_get_derived_keys_not_the_placeholders() {
    let events = events(include_str!(
        "../../pgoutput/tests/fixtures/01_insert_single.hex"
    ));
    assert_eq!(events.len(), 1);
    let (event, created_at) = &events[0];
    assert_eq!(event.entity_id, "order-42");
    assert_eq!(event.event_type, "order.created");
    let ms = epoch_millis(parse_timestamptz(created_at.as_bytes()).unwrap());
    assert_eq!(
        event.keys,
        compute_keys(event.id.as_int().unwrap(), "order-42", "order.created", ms)
    );
    assert_eq!(
        event.keys.dedupe_key,
        format!("order.created:order-42:{}", event.id)
    );
    assert_ne!(
        event.keys.dedupe_key, "order-42:created",
        "the table's placeholder is not trusted"
    );
    assert_eq!(
        event.shard,
        shard_for_key(NonZeroU64::new(12).unwrap(), "order-42")
    );
    assert_eq!(
        event.subject,
        format!("outbox.{}.order%2Ecreated", event.shard)
    );
    assert_eq!(
        &event.payload[..],
        br#"{"amount": "9.99", "currency": "EUR", "order_id": 42}"#
    );
    assert_ne!(event.position.commit_lsn, Lsn::ZERO);
    assert_eq!(event.position.index, 0);
}

#[test]
fn multi_row_and_unicode_transactions() {
    let multi = events(include_str!(
        "../../pgoutput/tests/fixtures/02_insert_multi.hex"
    ));
    assert!(multi.len() >= 2);
    assert!(
        multi
            .windows(2)
            .all(|w| w[0].0.position.commit_lsn == w[1].0.position.commit_lsn
                && w[0].0.id < w[1].0.id)
    );
    let unicode = events(include_str!("../../pgoutput/tests/fixtures/06_unicode.hex"));
    assert_eq!(unicode[0].0.entity_id, "Zürich-東京-🚀");
    assert_eq!(unicode[0].0.keys.partition_key, "Zürich-東京-🚀");
    assert_eq!(
        unicode[0].0.shard,
        shard_for_key(NonZeroU64::new(12).unwrap(), "Zürich-東京-🚀")
    );
}

#[test]
fn missing_columns_are_listed() {
    let error = OutboxColumns::resolve(
        "public.t",
        [("id", 20), ("payload", 25), ("created_at", 1114)],
    )
    .unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("missing column(s) entity_id, event_type"),
        "{text}"
    );
    assert!(
        text.contains("column payload is text, expected jsonb or json"),
        "{text}"
    );
    assert!(
        text.contains("column created_at is timestamp (without time zone), expected timestamptz"),
        "{text}"
    );
}
