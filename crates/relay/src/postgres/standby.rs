//! Decoding on a standby (PostgreSQL 16+, issue 39): `DATABASE_URL` names a standby, where
//! the slot lives and is decoded, and `--primary-url` the primary, for what a standby cannot
//! do: create the publication, write heartbeats and the boundary record, mark rows, and log
//! the standby snapshots a slot's creation on the standby waits for.
//!
//! # Invariants
//! - SB1 A standby is decoded on only when asked (`--primary-url`), on PostgreSQL 16 or newer,
//!   with `hot_standby_feedback = on` on the standby and `wal_level = logical` on the
//!   primary; otherwise the relay refuses at start, exit 2, naming the fix, before anything
//!   is created on either server ([`check`]).
//! - SB2 The lease stays with the slot, on the standby (advisory locks work in recovery), so
//!   every lease invariant (LS1–LS3) holds as on a primary.
//! - SB3 What the primary wrote for the relay (the publication) is on the standby before the
//!   relay reads it there: the standby has replayed past the primary's WAL position taken
//!   after the write ([`replayed`]).
//! - SB4 While a slot is created on the standby the primary logs a standby snapshot every
//!   [`NUDGE`] ([`Nudge`]): the creation waits for one, which an idle primary writes only
//!   every 15 s; a promotion keeps the slot, and the relay goes on from it (timeline rules,
//!   `sink::resume` S5).

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;

use crate::config::Config;
use crate::error::{RelayError, Result};
use crate::postgres::error::describe;

/// The server's WAL position in SQL: `pg_current_wal_lsn()` on a primary, the replay
/// position on a standby (where `pg_current_wal_lsn()` fails: "recovery is in progress").
/// One expression for every query that measures or vouches against the server's position.
macro_rules! wal_position {
    () => {
        "(CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() \
          ELSE pg_catalog.pg_current_wal_lsn() END)"
    };
}
pub(crate) use wal_position;

/// How often the primary logs a standby snapshot while a slot is created (SB4).
pub const NUDGE: Duration = Duration::from_millis(500);
/// The longest the standby may take to replay what the primary wrote for the relay (SB3).
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(30);

fn setup(message: String) -> RelayError {
    RelayError::setup(anyhow::anyhow!(message))
}

fn transient(message: String) -> RelayError {
    RelayError::transient(anyhow::anyhow!(message))
}

/// A failed query's error: transient, naming `what` and Postgres's words.
fn failed(what: &'static str) -> impl Fn(tokio_postgres::Error) -> RelayError {
    move |e| transient(format!("cannot read {what}: {}", describe(&e)))
}

/// The one text value `sql` returns, or why not (`what` names it).
async fn text(client: &Client, sql: &str, what: &'static str) -> Result<String> {
    Ok(client
        .query_one(sql, &[])
        .await
        .map_err(failed(what))?
        .get(0))
}

/// Whether the server is a standby (in recovery): PG4, a primary unless decoding on a
/// standby was asked for (SB1).
pub async fn in_recovery(client: &Client) -> Result<bool> {
    Ok(text(
        client,
        "SELECT pg_catalog.pg_is_in_recovery()::text",
        "whether the server is in recovery",
    )
    .await?
        == "true")
}

/// Why a standby is refused when decoding on it was not asked for (PG4), and the fix.
pub fn standby_refused() -> String {
    "DATABASE_URL reaches a standby (pg_is_in_recovery() is true): point DATABASE_URL at the \
     primary (with several hosts, add target_session_attrs=read-write), or, to decode on this \
     standby (PostgreSQL 16+), give the primary with --primary-url. Nothing was created on \
     the standby"
        .to_owned()
}

/// A connection to the primary (`--primary-url`).
pub async fn connect_primary(config: &Config) -> Result<Client> {
    replication::connect_sql(config.primary())
        .await
        .map_err(|e| {
            transient(format!(
                "cannot connect to the primary at {} (--primary-url): {e}",
                config.primary().redacted()
            ))
        })
}

/// SB1: whether `client`'s server (`DATABASE_URL`) is a standby the relay may decode on:
/// then a connection to the primary (checked on the way), `None` for a primary, a refusal
/// (exit 2, nothing created) for a standby it may not decode on.
pub async fn check(client: &Client, config: &Config) -> Result<Option<Client>> {
    if !in_recovery(client).await? {
        return Ok(None);
    }
    if config.primary.is_none() {
        return Err(setup(standby_refused()));
    }
    let version: i32 = text(client, "SHOW server_version_num", "the server version")
        .await?
        .parse()
        .unwrap_or(0);
    if version < 160_000 {
        return Err(setup(format!(
            "DATABASE_URL reaches a standby of PostgreSQL {}, and decoding on a standby needs \
             PostgreSQL 16 or newer: upgrade, or point DATABASE_URL at the primary and unset \
             --primary-url. Nothing was created",
            version / 10_000
        )));
    }
    if text(
        client,
        "SHOW hot_standby_feedback",
        "hot_standby_feedback on the standby",
    )
    .await?
        != "on"
    {
        return Err(setup(
            "DATABASE_URL reaches a standby with hot_standby_feedback = off: the primary could \
             remove catalog rows the slot still needs, and Postgres would invalidate the slot; \
             set it on the standby (ALTER SYSTEM SET hot_standby_feedback = on; SELECT \
             pg_reload_conf()), with a primary_slot_name so it holds across restarts. Nothing \
             was created"
                .to_owned(),
        ));
    }
    let primary = connect_primary(config).await?;
    let level = text(&primary, "SHOW wal_level", "wal_level on the primary").await?;
    if level != "logical" {
        return Err(setup(format!(
            "the primary (--primary-url) has wal_level = {level}, and decoding on its standby \
             needs wal_level = logical there (and on the standby): ALTER SYSTEM SET wal_level = \
             logical; on both, then restart them. Nothing was created"
        )));
    }
    if in_recovery(&primary).await? {
        return Err(transient(format!(
            "--primary-url reaches a standby ({}), not the primary: list every node with \
             target_session_attrs=read-write",
            config.primary().redacted()
        )));
    }
    Ok(Some(primary))
}

/// SB3: waits until the standby (`client`) has replayed the primary's WAL up to where it is
/// now, so that what the primary just wrote for the relay can be read on the standby.
pub async fn replayed(client: &Client, primary: &Client) -> Result<()> {
    let target = text(
        primary,
        "SELECT pg_catalog.pg_current_wal_lsn()::text",
        "the primary's WAL position",
    )
    .await?;
    let caught_up = "SELECT pg_catalog.pg_last_wal_replay_lsn() >= $1::text::pg_lsn";
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    loop {
        let done: Option<bool> = client
            .query_one(caught_up, &[&target])
            .await
            .map_err(failed("the standby's replay position"))?
            .get(0);
        if done == Some(true) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(transient(format!(
                "the standby has not replayed the primary's WAL up to {target} within {} s: \
                 is it streaming from the primary?",
                REPLAY_TIMEOUT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SB4: standby snapshots logged on the primary every [`NUDGE`] while it lives.
#[derive(Debug)]
pub struct Nudge {
    _task: AbortOnDropHandle<()>,
}

impl Nudge {
    /// Starts nudging when the relay decodes on a standby (`--primary-url`); `None` otherwise.
    /// A failure is retried at the next nudge: the creation then waits for the primary's own
    /// snapshot, no longer.
    pub fn start(config: &Config) -> Option<Nudge> {
        let primary = config.primary.clone()?;
        let task = tokio::spawn(async move {
            let mut client = None;
            loop {
                if client.is_none() {
                    client = replication::connect_sql(&primary).await.ok();
                }
                if let Some(c) = &client {
                    if c.execute("SELECT pg_catalog.pg_log_standby_snapshot()", &[])
                        .await
                        .is_err()
                    {
                        client = None;
                    }
                }
                tokio::time::sleep(NUDGE).await;
            }
        });
        Some(Nudge {
            _task: AbortOnDropHandle::new(task),
        })
    }
}
