//! The slot monitor: while this relay holds the lease it polls the slot every [`POLL`] on
//! the lease's control connection (the server's own view: `pg_current_wal_lsn() -
//! confirmed_flush_lsn`, `wal_status`, `safe_wal_size`) for the metrics, and while a backlog
//! drains it logs the progress (events/s, bytes behind, an estimate of the time left) at
//! most every [`REPORT_EVERY`].
//!
//! # Invariants
//! - MON1 Read-only, on the lease's connection, beside the session: a failed poll is logged
//!   at debug and retried at the next one; it never ends the session (the lease probe and
//!   the session's own checks judge the connection).
//! - MON2 At most one progress line per [`REPORT_EVERY`], and only while the slot lags by at
//!   least [`BACKLOG_BYTES`]; one "caught up" line when it no longer does.
//! - MON3 The table's identity is checked on the same connection every
//!   [`crate::process::identity::CHECK`] once the session began ([`crate::process::identity`]
//!   TI1–TI4): a check that passes raises the reader's cap, one that cannot run is retried (like
//!   MON1), and a change ends the session with the refusal.
//! - MON4 Decoding on a standby (`postgres::standby`), a promotion of that standby ends the
//!   session within [`identity::CHECK`]: the session labelled its events with the timeline
//!   it started on, and the next one reads the new timeline and its history (`sink::resume`
//!   S5). Events it published in between carry the old timeline past the switch point: the
//!   next session does not skip by them, it de-duplicates (never a loss). These and MON3 are
//!   the only ways [`watch`] returns.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;
use tracing::{debug, info};

use crate::config::Config;
use crate::error::RelayError;
use crate::observe::metrics::{Metrics, Phase, SlotSample};
use crate::process::identity::{self, Checked};

/// How often the slot is polled.
pub const POLL: Duration = Duration::from_secs(5);
/// The shortest time between two progress lines (MON2).
pub const REPORT_EVERY: Duration = Duration::from_secs(10);
/// A slot lag from which the relay counts as draining a backlog (MON2).
pub const BACKLOG_BYTES: u64 = 16 << 20;

/// The slot's lag, `wal_status` and `safe_wal_size`: the last two read through `to_jsonb`
/// so that servers before Postgres 13, which lack them, answer NULL instead of failing.
const SLOT_SQL: &str = concat!(
    "SELECT pg_catalog.pg_wal_lsn_diff(",
    crate::postgres::standby::wal_position!(),
    ", s.confirmed_flush_lsn)::int8, \
       pg_catalog.to_jsonb(s) ->> 'wal_status', (pg_catalog.to_jsonb(s) ->> 'safe_wal_size')::int8 \
     FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1"
);

/// Polls `slot` on `client` every [`POLL`] for as long as it is awaited, the first time
/// one [`POLL`] from now (MON1), and checks the table's identity every
/// [`identity::CHECK`] (MON3); returns only when the identity changed, with the refusal
/// (`/readyz` is not ready from then on).
pub async fn watch(
    client: &Client,
    config: &Config,
    identity: &identity::Watch,
    metrics: &Metrics,
    progress: &mut Progress,
) -> RelayError {
    let mut next_sample = Instant::now() + POLL;
    let mut failing = false;
    // MON4: a session that started on a standby it decodes on.
    let on_standby = config.primary.is_some()
        && crate::postgres::checks::in_recovery(client)
            .await
            .unwrap_or(false);
    loop {
        let every = if metrics.phase() == Phase::ShuttingDown {
            identity::CHECK_DRAINING
        } else {
            identity::CHECK
        };
        tokio::time::sleep(every.min(next_sample.saturating_duration_since(Instant::now()))).await;
        match identity.check(client, config).await {
            Ok(Checked::Vouched(lsn)) => {
                if std::mem::take(&mut failing) {
                    debug!(vouched = %lsn, "the table's identity is checked again");
                }
            }
            Ok(Checked::NotBegun) => {}
            Ok(Checked::Failed(error)) => {
                if !std::mem::replace(&mut failing, true) {
                    debug!(error = %error, "cannot check the table's identity; the slot is not confirmed further until a check passes");
                }
            }
            Err(refusal) => {
                metrics.set_phase(Phase::ShuttingDown);
                return refusal;
            }
        }
        if on_standby
            && crate::postgres::checks::in_recovery(client)
                .await
                .is_ok_and(|recovering| !recovering)
        {
            return RelayError::transient(anyhow::anyhow!(
                "the standby this session decoded on was promoted: starting a session on its new timeline"
            ));
        }
        if Instant::now() >= next_sample {
            next_sample = Instant::now() + POLL;
            sample(client, &config.slot, metrics, progress).await;
        }
    }
}

/// Polls `slot` once (within [`POLL`]) and shows what it found (MON1, MON2).
pub async fn sample(client: &Client, slot: &str, metrics: &Metrics, progress: &mut Progress) {
    match tokio::time::timeout(POLL, poll(client, slot)).await {
        Ok(Ok(Some(sample))) => {
            let sink = metrics.sink();
            let events = sink.acked() + sink.skipped.load(Ordering::Relaxed);
            if let Some(report) = progress.observe(Instant::now(), sample.lag_bytes, events) {
                report.log();
            }
            metrics.set_slot(sample);
        }
        Ok(Ok(None)) => debug!(
            slot,
            "the slot has no confirmed position to measure lag from"
        ),
        Ok(Err(error)) => debug!(slot, error = %error, "cannot poll the slot"),
        Err(_) => debug!(slot, "polling the slot timed out"),
    }
}

async fn poll(client: &Client, slot: &str) -> Result<Option<SlotSample>, tokio_postgres::Error> {
    let Some(row) = client.query_opt(SLOT_SQL, &[&slot]).await? else {
        return Ok(None);
    };
    let lag: Option<i64> = row.get(0);
    Ok(lag.map(|lag| SlotSample {
        lag_bytes: u64::try_from(lag).unwrap_or(0),
        wal_status: row.get(1),
        safe_wal_size: row.get(2),
    }))
}

/// Backlog progress between polls (MON2); kept across sessions by the caller.
#[derive(Debug, Default)]
pub struct Progress {
    /// The sample the next report measures from.
    last: Option<Mark>,
    /// Whether a backlog was reported and not yet caught up.
    reporting: bool,
}

#[derive(Debug, Clone, Copy)]
struct Mark {
    at: Instant,
    lag_bytes: u64,
    events: u64,
}

/// A progress line.
#[derive(Debug, Clone, PartialEq)]
pub enum Report {
    /// A backlog was found.
    Behind {
        /// Slot lag.
        behind_bytes: u64,
    },
    /// A backlog drains (or grows).
    Draining {
        /// Events acknowledged (or skipped) per second since the last line.
        events_per_second: f64,
        /// Slot lag.
        behind_bytes: u64,
        /// How long until caught up at the rate the lag shrank since the last line; `None`
        /// when it did not shrink.
        eta: Option<Duration>,
    },
    /// The backlog is gone.
    CaughtUp,
}

impl Progress {
    /// Takes a sample (`lag_bytes`, events handled so far) at `now`; returns the line to
    /// log, if one is due (MON2).
    pub fn observe(&mut self, now: Instant, lag_bytes: u64, events: u64) -> Option<Report> {
        let mark = Mark {
            at: now,
            lag_bytes,
            events,
        };
        if lag_bytes < BACKLOG_BYTES {
            self.last = None;
            return std::mem::take(&mut self.reporting).then_some(Report::CaughtUp);
        }
        let Some(last) = self
            .last
            .filter(|last| now.duration_since(last.at) < 3 * REPORT_EVERY)
        else {
            // A first sample, or one after a gap (another relay held the lease): measure
            // from here.
            self.last = Some(mark);
            return (!std::mem::replace(&mut self.reporting, true)).then_some(Report::Behind {
                behind_bytes: lag_bytes,
            });
        };
        let elapsed = now.duration_since(last.at);
        if elapsed < REPORT_EVERY {
            return None;
        }
        self.last = Some(mark);
        self.reporting = true;
        let seconds = elapsed.as_secs_f64();
        let shrink_per_second = (last.lag_bytes as f64 - lag_bytes as f64) / seconds;
        Some(Report::Draining {
            events_per_second: events.saturating_sub(last.events) as f64 / seconds,
            behind_bytes: lag_bytes,
            eta: (shrink_per_second > 0.0)
                .then(|| Duration::from_secs_f64(lag_bytes as f64 / shrink_per_second)),
        })
    }
}

impl Report {
    fn log(&self) {
        match self {
            Report::Behind { behind_bytes } => {
                info!(behind_bytes, "the slot is behind: draining a backlog");
            }
            Report::Draining {
                events_per_second,
                behind_bytes,
                eta: Some(eta),
            } => info!(
                events_per_second = events_per_second.round() as u64,
                behind_bytes,
                eta_seconds = eta.as_secs(),
                "draining a backlog"
            ),
            Report::Draining {
                events_per_second,
                behind_bytes,
                eta: None,
            } => info!(
                events_per_second = events_per_second.round() as u64,
                behind_bytes,
                "draining a backlog: not catching up (the lag did not shrink since the last line)"
            ),
            Report::CaughtUp => info!("caught up: the backlog is drained"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn w2_a_backlog_is_reported_at_most_every_ten_seconds_then_caught_up_once() {
        let mut progress = Progress::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(progress.observe(at(0), 1 << 20, 0), None, "no backlog");
        assert_eq!(
            progress.observe(at(5), 200 << 20, 10),
            Some(Report::Behind {
                behind_bytes: 200 << 20
            })
        );
        assert_eq!(
            progress.observe(at(10), 150 << 20, 50_010),
            None,
            "5 s later"
        );
        let Some(Report::Draining {
            events_per_second,
            behind_bytes,
            eta: Some(eta),
        }) = progress.observe(at(15), 100 << 20, 100_010)
        else {
            panic!("a progress line 10 s after the first");
        };
        assert_eq!(events_per_second, 10_000.0);
        assert_eq!(behind_bytes, 100 << 20);
        assert_eq!(eta, Duration::from_secs(10), "100 MiB left at 10 MiB/s");
        let report = progress.observe(at(25), 120 << 20, 100_010);
        assert!(
            matches!(report, Some(Report::Draining { eta: None, .. })),
            "growing: no estimate: {report:?}"
        );
        assert_eq!(
            progress.observe(at(30), 1 << 20, 200_000),
            Some(Report::CaughtUp)
        );
        assert_eq!(progress.observe(at(35), 1 << 20, 200_000), None, "once");
    }
}
