//! The end-to-end tests' harness is testkit's ([`testkit::harness`]): cases (a database with
//! the seed's table, a slot, a publication, a stream and a prefix on the servers) running the
//! real `outbox-relay` binary (which cargo builds for these tests), writers, the faithfulness
//! check and the relay's log. This module only makes it `support::…` for the test files.

#![allow(unused_imports)]

pub use testkit::harness::*;

#[allow(dead_code)]
pub mod nats_jwt;

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
    .unwrap()
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
