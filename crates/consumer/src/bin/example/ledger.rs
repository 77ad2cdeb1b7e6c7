//! The example's side effect, the README's handler: also compiled into the benchmark
//! (`crates/bench`), so that the figures are this code's.

use outbox_consumer::{BatchHandler, BoxError, Event, Transaction};

/// The side effect: one ledger row per event, a batch's rows in one statement (the README's
/// handler; a per-event `Handler` costs about 1.6 times its CPU per side effect,
/// docs/performance.md, "The consumer side").
pub struct Ledger;

impl BatchHandler for Ledger {
    async fn handle_batch(
        &self,
        tx: &mut Transaction<'_>,
        events: &[Event],
    ) -> Result<(), BoxError> {
        let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
        let entities: Vec<&str> = events.iter().map(|e| e.entity_id.as_str()).collect();
        let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        let payloads = events
            .iter()
            .map(Event::payload_str)
            .collect::<Result<Vec<_>, _>>()?;
        tx.execute(
            "insert into ledger (outbox_id, entity_id, event_type, payload) \
             select i, e, t, p::jsonb from unnest($1::text[], $2::text[], $3::text[], $4::text[]) u(i, e, t, p)",
            &[&ids, &entities, &types, &payloads],
        )
        .await?;
        Ok(())
    }
}

/// The ledger table, created if missing.
pub const LEDGER_SQL: &str = "create table if not exists ledger (
    outbox_id text not null,
    entity_id text not null,
    event_type text not null,
    payload jsonb not null,
    applied_at timestamptz not null default clock_timestamp()
)";
