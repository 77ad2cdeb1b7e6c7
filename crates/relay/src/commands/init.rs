//! `outbox-relay init`: the checks and creations of a first session alone
//! ([`crate::setup::ensure`]), without `guard_history`: creating a slot over a stream that
//! already holds relayed events is the operator's deliberate act.

use crate::config::Config;
use crate::connect::{connect_nats, jetstream_context};
use crate::error::Result;
use crate::postgres::checks::SlotState;

/// Checks and creates the publication, slot and stream (and backfills when it creates the
/// slot); returns the slot's state.
pub async fn run(config: &Config) -> Result<SlotState> {
    let client = replication::connect_sql(&config.database).await?;
    let jetstream = jetstream_context(connect_nats(config).await?, config);
    crate::setup::ensure(&client, &jetstream, config, false).await
}
