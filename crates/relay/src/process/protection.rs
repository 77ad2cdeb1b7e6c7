//! Fail-over protection watched while a session streams (issue 39): with `--failover-slot`,
//! every [`CHECK`] the lease holder asks the standbys of `DATABASE_URL` for their copy of
//! the slot ([`crate::postgres::failover`]) and shows the answer in
//! `outbox_relay_failover_protection` and the log.
//!
//! # Invariants
//! - PW1 The task is owned by the session and aborted with it (dropping [`Protection`]
//!   aborts it): only the lease holder checks, and a check never ends the session.
//! - PW2 The log says each change once: a warning when protection goes missing (or cannot
//!   be watched), naming each standby and why, and one line when it holds again; the same
//!   state found again is logged at debug.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::observe::metrics::{FailoverState, Metrics};
use crate::postgres::failover;

/// How often the standbys are asked.
pub const CHECK: Duration = Duration::from_secs(5);

/// The primary slot's confirmed position, for the copies' lag.
const CONFIRMED_SQL: &str =
    "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = $1";

/// A running watch; dropping it stops the task (PW1).
#[derive(Debug)]
pub struct Protection {
    _task: AbortOnDropHandle<()>,
}

/// Starts the watch on the lease's `client` when the slot is a fail-over slot.
pub fn start(config: &Config, client: Arc<Client>, metrics: Arc<Metrics>) -> Option<Protection> {
    if !config.failover_slot {
        return None;
    }
    let config = config.clone();
    let task = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(CHECK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<FailoverState> = None;
        loop {
            ticker.tick().await;
            let primary = match client.query_opt(CONFIRMED_SQL, &[&config.slot]).await {
                Ok(row) => row
                    .and_then(|row| row.get::<_, Option<String>>(0))
                    .and_then(|lsn| lsn.parse().ok()),
                Err(error) => {
                    debug!(error = %error, "cannot read the slot's confirmed position for the fail-over check");
                    None
                }
            };
            let protection = failover::read(&config, primary).await;
            let state = protection.state();
            metrics.set_failover(state, protection.lag_bytes());
            let line = protection.describe(&config.slot);
            // PW2: each change once.
            if last.replace(state) == Some(state) {
                debug!(state = ?state, "fail-over protection: {line}");
            } else if state == FailoverState::Protected {
                info!("fail-over protection holds: {line}");
            } else if state == FailoverState::Unwatched {
                warn!("fail-over protection is not watched: {line}");
            } else {
                warn!("fail-over protection missing: a promotion now would lose slot {} and the relay would refuse on the new primary; {line} (docs/operations.md, \"Fail-over protection\")", config.slot);
            }
        }
    });
    Some(Protection {
        _task: AbortOnDropHandle::new(task),
    })
}
