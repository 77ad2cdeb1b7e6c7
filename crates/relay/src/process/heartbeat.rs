//! Heartbeats: a tiny WAL record in the outbox database every `--heartbeat-interval` while
//! a session streams, so that the slot can advance when only other databases of the
//! cluster write.
//!
//! A logical slot advances only as far as the relay confirms, and the relay confirms what
//! the walsender reports (an idle keepalive's WAL end, framer D3). WAL written by other
//! databases is decoded and filtered out by the walsender, and on a quiet outbox database
//! the slot's confirmed position may then trail the server's WAL end by everything those
//! databases wrote, which the slot keeps on disk (up to `max_slot_wal_keep_size`).
//! `pg_logical_emit_message(false, …)` writes a non-transactional message record in the
//! outbox database itself: the walsender decodes it at its own LSN, so its next keepalive
//! carries a position past everything written before, and the relay confirms it. The
//! message is not sent to the relay (pgoutput's `messages` option stays off), and the framer
//! ignores logical messages anyway.
//!
//! # Invariants
//! - HB1 Heartbeats run on the lease's control connection and only while the session streams:
//!   the task is owned by the session and aborted with it (dropping [`Heartbeat`] aborts
//!   it), so a relay without the lease writes none.
//! - HB2 A heartbeat that fails is logged and retried at the next interval; it never ends the
//!   session (the lease probe, [`crate::postgres::lease`] LS1, judges the connection).
//! - HB3 A heartbeat carries no data: the prefix [`PREFIX`] and an empty content.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

/// The logical message's prefix: names who wrote it, for anyone decoding the WAL.
pub const PREFIX: &str = "outbox-relay-heartbeat";

/// The heartbeat, in SQL: non-transactional, so it is decoded at once at its own LSN.
const HEARTBEAT_SQL: &str = "SELECT pg_catalog.pg_logical_emit_message(false, $1::text, ''::text)";

/// A running heartbeat task; dropping it stops the task (HB1).
#[derive(Debug)]
pub struct Heartbeat {
    _task: AbortOnDropHandle<()>,
}

/// Starts heartbeats every `interval` on `client`; `None` when heartbeats are off.
pub fn start(client: Arc<Client>, interval: Option<Duration>) -> Option<Heartbeat> {
    let interval = interval?;
    let task = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick completes at once: the session starts with a heartbeat.
        let mut failing = false;
        loop {
            ticker.tick().await;
            match client.execute(HEARTBEAT_SQL, &[&PREFIX]).await {
                Ok(_) => {
                    if failing {
                        warn!("heartbeats work again");
                    }
                    failing = false;
                    debug!("heartbeat written");
                }
                // HB2: said once per failing spell, not every interval.
                Err(error) if !failing => {
                    failing = true;
                    warn!(error = %error, "cannot write a heartbeat (pg_logical_emit_message) in the outbox database; retrying every {interval:?}");
                }
                Err(error) => debug!(error = %error, "heartbeat failed again"),
            }
        }
    });
    Some(Heartbeat {
        _task: AbortOnDropHandle::new(task),
    })
}
