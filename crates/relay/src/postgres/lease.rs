//! The lease: at most one relay streams a slot; the others wait as hot standbys.
//!
//! Postgres allows one walsender per slot, and a second relay started "for HA" would spin
//! on "replication slot is active for PID …". Instead every relay first takes a session
//! advisory lock keyed by the slot name on a control connection of its own. The holder
//! streams; the others poll the lock every [`POLL`] and take over as soon as the holder's
//! session ends, which Postgres notices at once when the holder's process dies (the kernel
//! closes its sockets) and within the keepalive settings below when its host vanishes.
//!
//! # Invariants
//! - LS1 A relay streams only while it holds the lease: the session is abandoned the moment
//!   the lease connection closes or stops answering, before anything else is published.
//!   (Strict mode fences the stream even against a relay that lost its lease unknowingly:
//!   its next publish carries a stale expected sequence and is refused.)
//! - LS2 The holder may end a walsender that still holds the slot (a dead relay's
//!   connection not yet noticed by Postgres): whoever that is, it does not hold the lease.
//! - LS3 Between a failed session and its next attempt a relay does not hold the lease (a
//!   standby may take over), but says that it is retrying: it holds the slot's *retry
//!   marker*, a shared advisory lock, on a connection of its own whose last statement is a
//!   comment with the next attempt's time and the last error, scrubbed of secrets
//!   ([`RetryMarker`]). `status` reads both ([`retrying`]) and tells a stall from an
//!   absence. The marker is best-effort: it never delays the next attempt by more than
//!   [`MARKER_TIMEOUT`], and a relay that cannot reach Postgres cannot leave one.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::error::{RelayError, Result};
use crate::observe::metrics::{Metrics, Phase};
use crate::postgres::error::describe;

/// How often a standby tries the lock.
pub const POLL: Duration = Duration::from_millis(250);
/// How often the holder checks that its lease session is alive.
const PROBE: Duration = Duration::from_secs(1);
/// How long a probe may take before the lease counts as lost.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The advisory lock key of the slot `$1`, in SQL: stable across relays and versions.
macro_rules! lock_key {
    () => {
        "pg_catalog.hashtextextended('outbox-relay/' || $1, 0)"
    };
}

/// The condition on `pg_locks l` that picks the granted advisory lock of `key` (a SQL
/// expression over the slot `$1`) in this database: a `bigint` advisory key shows as its high
/// half in `classid`, its low half in `objid`, and `objsubid` 1.
macro_rules! granted {
    ($key:expr) => {
        concat!(
            "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
               AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()) \
               AND l.classid = ((",
            $key,
            " >> 32) & 4294967295)::oid AND l.objid = (",
            $key,
            " & 4294967295)::oid"
        )
    };
}

/// The retry marker's advisory lock key of the slot `$1` (LS3).
macro_rules! retry_key {
    () => {
        "pg_catalog.hashtextextended('outbox-relay-retrying/' || $1, 0)"
    };
}

/// How long leaving the retry marker may take (LS3).
pub const MARKER_TIMEOUT: Duration = Duration::from_secs(5);

/// The note a retrying relay leaves as its marker session's last statement (LS3).
const MARKER_NOTE: &str = "outbox-relay retrying: ";

/// The relays retrying the slot `$1`: the sessions holding its retry marker, and their
/// last statement.
const RETRYING_SQL: &str = concat!(
    "SELECT l.pid, a.query, \
            pg_catalog.to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
       FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
      WHERE l.mode = 'ShareLock' AND ",
    granted!(retry_key!()),
    " ORDER BY l.pid"
);

/// A relay between a failed session and its next attempt, as `status` sees it (LS3).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Retrying {
    /// The marker session's backend.
    pub pid: i32,
    /// `next attempt at …; last error: …`, when this role may read the session's statement.
    pub note: Option<String>,
    /// Since when it has been waiting (the marker session's start, UTC).
    pub since: Option<String>,
}

/// The relays retrying `slot` (LS3), seen from any session of the slot's database.
pub async fn retrying(client: &Client, slot: &str) -> Result<Vec<Retrying>> {
    let rows = client
        .query(RETRYING_SQL, &[&slot])
        .await
        .map_err(failed("cannot read the retrying relays"))?;
    Ok(rows
        .iter()
        .map(|row| Retrying {
            pid: row.get(0),
            note: row.get::<_, Option<String>>(1).and_then(|query| {
                let (_, note) = query.split_once(MARKER_NOTE)?;
                Some(note.trim_end_matches("*/").trim().to_owned())
            }),
            since: row.get(2),
        })
        .collect())
}

/// The retry marker a relay holds between a failed session and its next attempt (LS3):
/// dropping it closes its session, which releases the lock.
#[derive(Debug)]
pub struct RetryMarker {
    _client: Client,
}

impl RetryMarker {
    /// Leaves the marker for `slot`: the next attempt at `next_attempt`, after `error`
    /// (already scrubbed of secrets). `None` when Postgres cannot be reached in
    /// [`MARKER_TIMEOUT`]: the marker is best-effort.
    pub async fn leave(config: &Config, next_attempt: &str, error: &str) -> Option<RetryMarker> {
        let leave = async {
            let client = replication::connect_sql(&config.database).await.ok()?;
            let lock = concat!(
                "SELECT pg_catalog.pg_advisory_lock_shared(",
                retry_key!(),
                ")"
            );
            client.query_one(lock, &[&config.slot]).await.ok()?;
            // A comment cannot end early: `*/` in the error is broken up.
            let error: String = error.replace("*/", "* /").chars().take(700).collect();
            let note = format!(
                "SELECT 1 /* {MARKER_NOTE}next attempt at {next_attempt}; last error: {error} */"
            );
            client.simple_query(&note).await.ok()?;
            Some(RetryMarker { _client: client })
        };
        tokio::time::timeout(MARKER_TIMEOUT, leave)
            .await
            .ok()
            .flatten()
    }
}

/// Takes the lease of the slot `$1` if free.
const LOCK_SQL: &str = concat!("SELECT pg_catalog.pg_try_advisory_lock(", lock_key!(), ")");

/// The backend holding the lease of the slot `$1` in this database, from `pg_locks`.
const HOLDER_SQL: &str = concat!(
    "SELECT l.pid FROM pg_catalog.pg_locks l WHERE ",
    granted!(lock_key!())
);

/// The pid of the backend holding the lease of `slot`, if any, seen from any session of the
/// slot's database: only reads `pg_locks`, never tries the lock.
pub async fn holder(client: &Client, slot: &str) -> Result<Option<i32>> {
    let row = client
        .query_opt(HOLDER_SQL, &[&slot])
        .await
        .map_err(failed("cannot read the lease holder"))?;
    Ok(row.map(|row| row.get(0)))
}

/// A query of the lease's that failed: transient, with Postgres's words.
fn failed(what: &'static str) -> impl Fn(tokio_postgres::Error) -> RelayError {
    move |e| RelayError::transient(anyhow::anyhow!("{what}: {}", describe(&e)))
}

/// Tries the lease of `slot` once on `client`'s session: whether it holds it now.
pub async fn try_take(client: &Client, slot: &str) -> Result<bool> {
    Ok(client
        .query_one(LOCK_SQL, &[&slot])
        .await
        .map_err(failed("cannot take the lease"))?
        .get(0))
}

/// A held lease.
#[derive(Debug)]
pub struct Lease {
    client: Arc<Client>,
}

impl Lease {
    /// Waits until this relay holds the lease for the configured slot (`metrics` shows it a
    /// standby meanwhile). `Ok(None)` if `shutdown` fired first.
    pub async fn acquire(
        config: &Config,
        shutdown: &CancellationToken,
        metrics: &Metrics,
    ) -> Result<Option<Lease>> {
        let client = replication::connect_sql(&config.database).await?;
        // Let Postgres notice a vanished holder within ~15 s rather than hours, so a
        // standby is not blocked by a half-open connection.
        client
            .batch_execute("SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; SET tcp_keepalives_count = 5")
            .await
            .map_err(|e| RelayError::transient(anyhow::anyhow!("cannot configure the lease session: {}", describe(&e))))?;
        let mut announced = false;
        loop {
            if try_take(&client, &config.slot).await? {
                info!(slot = %config.slot, "holding the lease: this relay is active");
                return Ok(Some(Lease {
                    client: Arc::new(client),
                }));
            }
            if !announced {
                info!(slot = %config.slot, "another relay holds the lease for this slot; waiting as a standby");
                metrics.set_phase(Phase::Standby);
                announced = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = shutdown.cancelled() => return Ok(None),
            }
        }
    }

    /// The lease's control connection, for the session's other control-plane queries.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The control connection, for a task of the session's (the heartbeat) that must own it.
    pub fn shared_client(&self) -> Arc<Client> {
        Arc::clone(&self.client)
    }

    /// Completes when the lease is lost (LS1): the session closed or stopped answering.
    pub async fn lost(&self) {
        loop {
            tokio::time::sleep(PROBE).await;
            if self.client.is_closed() {
                return;
            }
            match tokio::time::timeout(PROBE_TIMEOUT, self.client.simple_query("SELECT 1")).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    warn!(error = %error, "the lease session failed");
                    return;
                }
                Err(_) => {
                    warn!("the lease session stopped answering");
                    return;
                }
            }
        }
    }

    /// Ends the walsender that still holds `slot`, if any (LS2). Returns its pid.
    pub async fn end_lingering_walsender(&self, slot: &str) -> Result<Option<i32>> {
        let row = self
            .client
            .query_opt(
                "SELECT active_pid, pg_catalog.pg_terminate_backend(active_pid) \
                   FROM pg_catalog.pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await
            .map_err(|e| RelayError::transient(anyhow::anyhow!("cannot end the walsender holding slot {slot}: {}", describe(&e))))?;
        let pid = row.map(|row| row.get::<_, i32>(0));
        if let Some(pid) = pid {
            warn!(
                slot,
                pid, "ended a walsender still holding the slot (a previous relay's connection)"
            );
        }
        Ok(pid)
    }
}
