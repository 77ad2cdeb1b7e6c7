//! Fail-over protection (issue 39): whether a promotion now would keep the relay's
//! fail-over slot. With `--failover-slot` a standby with `sync_replication_slots = on` keeps
//! a copy of the slot, but the copy survives a promotion only once it is synchronized and
//! persistent (`synced`, not `temporary`) and not invalidated; until then, and whenever its
//! synchronization stops, a fail-over loses the slot and the relay refuses on the new
//! primary. This module asks the standbys the relay knows, the other hosts of
//! `DATABASE_URL`, for their copy.
//!
//! # Invariants
//! - FP1 A copy protects only when a promotion would keep it: on a server in recovery,
//!   `synced` and not `temporary`, not invalidated. Anything else, a host that does not
//!   answer included, does not protect: nothing is assumed.
//! - FP2 Read-only, one short connection per host and check, each bounded by [`TIMEOUT`];
//!   a host that is not in recovery (the primary) is not a standby and is left out.
//! - FP3 Protection holds when at least one copy protects; its lag is the smallest of the
//!   protecting copies': the primary slot's `confirmed_flush_lsn` minus the copy's.

use std::time::Duration;

use replication::{ConnInfo, TargetSessionAttrs};
use serde::Serialize;

use crate::config::Config;
use crate::observe::metrics::FailoverState;
use crate::postgres::error::describe;

/// The longest a standby may take to connect and answer (FP2).
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// A standby's copy of the slot, as read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Copy {
    /// The standby, `host:port`.
    pub standby: String,
    /// Whether a promotion of this standby would keep the slot (FP1).
    pub protects: bool,
    /// How far the copy trails the primary's slot, in bytes, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<u64>,
    /// Why it does not protect.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why_not: Option<String>,
}

/// What the standbys hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Protection {
    /// One entry per standby asked (a host that did not answer included).
    pub copies: Vec<Copy>,
}

impl Protection {
    /// Whether a promotion of some standby would keep the slot (FP3).
    pub fn holds(&self) -> bool {
        self.copies.iter().any(|c| c.protects)
    }

    /// Whether any standby could be asked: `DATABASE_URL` lists more than the primary.
    pub fn watched(&self) -> bool {
        !self.copies.is_empty()
    }

    /// Protected, missing, or unwatched (no standby to ask), as the metric, the log and
    /// `status` say it.
    pub fn state(&self) -> FailoverState {
        if !self.watched() {
            FailoverState::Unwatched
        } else if self.holds() {
            FailoverState::Protected
        } else {
            FailoverState::Missing
        }
    }

    /// The smallest lag of the protecting copies (FP3).
    pub fn lag_bytes(&self) -> Option<u64> {
        self.copies
            .iter()
            .filter(|c| c.protects)
            .filter_map(|c| c.lag_bytes)
            .min()
    }

    /// One line: each standby and what its copy is.
    pub fn describe(&self, slot: &str) -> String {
        if !self.watched() {
            return format!(
                "DATABASE_URL names no standby, so nothing checks that one keeps a synced copy of \
                 slot {slot}: list the standbys after the primary \
                 (postgres://primary,standby/db?target_session_attrs=read-write)"
            );
        }
        let copies: Vec<String> = self
            .copies
            .iter()
            .map(|c| match (&c.why_not, c.lag_bytes) {
                (Some(why), _) => format!("standby {}: {why}", c.standby),
                (None, Some(lag)) => format!(
                    "standby {} holds a synced copy of slot {slot}, {lag} bytes behind",
                    c.standby
                ),
                (None, None) => format!("standby {} holds a synced copy of slot {slot}", c.standby),
            })
            .collect();
        copies.join("; ")
    }
}

/// The standby's slot and whether it is in recovery: one row, NULLs without the slot.
/// `synced` and `invalidation_reason` are Postgres 17's (what fail-over slots need).
const COPY_SQL: &str = "SELECT pg_catalog.pg_is_in_recovery(), s.synced, s.temporary, \
            s.invalidation_reason, s.confirmed_flush_lsn::text \
       FROM (VALUES (1)) AS one(x) \
       LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name = $1";

/// Asks every host of `config`'s `DATABASE_URL` but the primary for its copy of the slot;
/// `primary` is the primary slot's `confirmed_flush_lsn` (for the lag), when read.
pub async fn read(config: &Config, primary: Option<replication::Lsn>) -> Protection {
    let mut copies = Vec::new();
    if config.database.hosts().len() < 2 {
        return Protection { copies };
    }
    for target in config.database.targets() {
        let standby = format!("{}:{}", target.host(), target.port());
        let target = target.with_target_session_attrs(TargetSessionAttrs::Any);
        let answer = tokio::time::timeout(TIMEOUT, ask(&target, &config.slot)).await;
        let copy = match answer {
            Err(_) => Some(Err(format!(
                "did not answer within {} s",
                TIMEOUT.as_secs()
            ))),
            Ok(Err(why)) => Some(Err(why)),
            Ok(Ok(None)) => None,
            Ok(Ok(Some(row))) => Some(Ok(row)),
        };
        if let Some(copy) = copy {
            copies.push(judge(standby, copy, primary));
        }
    }
    Protection { copies }
}

/// A standby's answer: `(synced, temporary, invalidation_reason, confirmed_flush_lsn)`, each
/// `None` without the slot.
type Row = (Option<bool>, Option<bool>, Option<String>, Option<String>);

/// The copy on `target`, `None` when `target` is not in recovery (FP2), or why it could not
/// be read.
async fn ask(target: &ConnInfo, slot: &str) -> Result<Option<Row>, String> {
    let client = replication::connect_sql(target)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let row = client
        .query_one(COPY_SQL, &[&slot])
        .await
        .map_err(|e| format!("cannot read its slots: {}", describe(&e)))?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    Ok(Some((row.get(1), row.get(2), row.get(3), row.get(4))))
}

/// FP1: whether `copy` protects, and how far it trails `primary`.
fn judge(standby: String, copy: Result<Row, String>, primary: Option<replication::Lsn>) -> Copy {
    let (protects, why_not, confirmed) = match copy {
        Err(why) => (false, Some(why), None),
        Ok((None, ..)) => (false, Some("has no copy of the slot (is sync_replication_slots on, and the slot a fail-over slot?)".to_owned()), None),
        Ok((_, _, Some(reason), _)) => (false, Some(format!("its copy is invalidated ({reason})")), None),
        Ok((Some(false), ..)) => (false, Some("its copy is not synchronized from the primary (synced = false: a slot of its own)".to_owned()), None),
        Ok((_, Some(true), _, confirmed)) => (false, Some("its copy is not yet persistent (temporary until its first synchronization catches up): a promotion now would drop it".to_owned()), confirmed),
        Ok((_, _, _, confirmed)) => (true, None, confirmed),
    };
    let lag_bytes = confirmed
        .and_then(|lsn| lsn.parse::<replication::Lsn>().ok())
        .zip(primary)
        .map(|(copy, primary)| primary.0.saturating_sub(copy.0));
    Copy {
        standby,
        protects,
        lag_bytes,
        why_not,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn copy(row: Result<Row, String>) -> Copy {
        judge("h:5433".into(), row, Some(replication::Lsn(0x3000)))
    }

    #[test]
    fn only_a_synced_persistent_valid_copy_protects() {
        let lsn = |s: &str| Some(s.to_owned());
        let synced = copy(Ok((Some(true), Some(false), None, lsn("0/2000"))));
        assert!(synced.protects);
        assert_eq!(synced.lag_bytes, Some(0x1000));
        for (row, why) in [
            (Ok((None, None, None, None)), "has no copy"),
            (
                Ok((Some(true), Some(true), None, lsn("0/2000"))),
                "not yet persistent",
            ),
            (
                Ok((Some(true), Some(false), lsn("wal_removed"), None)),
                "invalidated (wal_removed)",
            ),
            (
                Ok((Some(false), Some(false), None, lsn("0/1"))),
                "not synchronized",
            ),
            (Err("cannot connect: refused".to_owned()), "cannot connect"),
        ] {
            let c = copy(row);
            assert!(!c.protects, "{c:?}");
            assert!(c.why_not.as_deref().unwrap().contains(why), "{c:?}");
        }
        let protection = Protection {
            copies: vec![copy(Err("down".into())), synced],
        };
        assert!(protection.holds() && protection.watched());
        assert_eq!(protection.lag_bytes(), Some(0x1000));
        let line = protection.describe("s");
        assert!(
            line.contains("standby h:5433: down") && line.contains("4096 bytes behind"),
            "{line}"
        );
        let unwatched = Protection { copies: vec![] };
        assert!(!unwatched.holds() && unwatched.describe("s").contains("names no standby"));
    }
}
