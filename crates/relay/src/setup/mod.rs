//! Setup: what must exist and hold on both servers before a slot is streamed, checked and
//! created when missing (and allowed): the Postgres checks and creations
//! ([`crate::postgres`]), the stream's ([`crate::stream`]), and the [`backfill`] when the
//! slot is created. [`ensure`] is what `outbox-relay init` does (`crate::commands::init`) and
//! what the first session of `outbox-relay run` does before it streams
//! (`crate::process::pipeline`).
//!
//! May use: `config`, `error`, `observe`, `connect`, `postgres`, `stream`. Never uses
//! `process` or `commands`: both use it.

use async_nats::jetstream;

use crate::config::Config;
use crate::error::{RelayError, Result, Target};
use crate::postgres::checks::{self, SlotState};
use crate::stream::policy;

pub mod backfill;

/// Checks and creates everything the relay needs, on connections the caller already has
/// (`outbox-relay init`, and the first session of `run`).
///
/// With `guard_history`, a missing slot is created only if the stream holds no relayed
/// event: a stream with events but no slot means the slot was dropped or invalidated, and a
/// new one would silently skip everything committed since. `outbox-relay init` (an
/// operator's deliberate act) passes `false`.
pub async fn ensure(
    client: &tokio_postgres::Client,
    jetstream: &jetstream::Context,
    config: &Config,
    guard_history: bool,
) -> Result<SlotState> {
    // PG1: a slot option the server cannot honour is refused before anything is created.
    checks::check_failover_support(client, config).await?;
    // U5: the columns --mark-published sets, and the privilege to set them.
    crate::postgres::privileges::marking(client, config).await?;
    // RET6: the privilege --retention-grace needs.
    crate::postgres::privileges::retention(client, config).await?;
    // Issue 11: a slot created with a backfill, or a backfill interrupted
    // (crate::setup::backfill).
    let backfill = crate::setup::backfill::needed(client, jetstream, config).await?;
    if guard_history
        && !backfill_interrupted(client, config, backfill).await?
        && config.create
        && !checks::slot_exists(client, &config.slot).await?
    {
        if let Ok(tail) = sink::resume::read_tail(jetstream, &config.stream, true).await {
            if let Some(position) = tail.last_position() {
                return Err(RelayError::permanent(anyhow::anyhow!(
                    "replication slot {:?} does not exist, but stream {} already holds relayed events (the last at commit LSN {}): \
                     the slot was dropped or invalidated, so events committed since may be missing from the stream. \
                     Create the slot deliberately with `outbox-relay init`, then reconcile the table and the stream",
                    config.slot,
                    config.stream,
                    position.commit_lsn
                )));
            }
        }
    }
    if backfill {
        checks::publication(client, config).await?;
        policy::stream(jetstream, config)
            .await
            .map_err(|e| e.at(Target::Nats))?;
        crate::setup::backfill::at_slot_creation(client, jetstream, config).await?;
    }
    let slot = checks::postgres(client, config).await?;
    policy::stream(jetstream, config)
        .await
        .map_err(|e| e.at(Target::Nats))?;
    Ok(slot)
}

/// An interrupted backfill's stream holds its rows while the slot is gone: that is no
/// dropped slot, the backfill resumes (`crate::setup::backfill` BF3).
async fn backfill_interrupted(
    client: &tokio_postgres::Client,
    config: &Config,
    backfill: bool,
) -> Result<bool> {
    Ok(backfill && crate::setup::backfill::interrupted(client, config).await?)
}
