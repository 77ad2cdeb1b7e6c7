//! Hot standby: two relays on the same slot, one active (it holds the lease), one waiting.
//! While writers commit continuously the active relay is SIGKILLed again and again, and a
//! fresh relay is started as the new standby each time, so two always run. Each takeover
//! (SIGKILL → the standby logs "streaming outbox events") must take under 10 s; the stream
//! must hold every committed row exactly once, in commit order; and, from the relays' own
//! timestamped logs, at no time did two relays hold the lease (a relay only streams while
//! it holds it).

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_value;

use std::time::{Duration, Instant, SystemTime};

use support::{
    check_faithful, eventually, insert_transaction, min_median_max, timed_log_lines, Case, Writers,
    DEADLINE,
};
use testkit::{Nats, Postgres, Process};

/// SIGKILLs of the active relay in one run.
const KILLS: usize = 6;
/// Messages the active relay must store before it is killed.
const FLOW: u64 = 200;
/// The bound on a takeover.
const TAKEOVER_LIMIT: Duration = Duration::from_secs(10);

const HOLDING: &str = "holding the lease: this relay is active";
const WAITING: &str = "another relay holds the lease for this slot; waiting as a standby";
const STREAMING: &str = "streaming outbox events";
const ENDED: &str = "relay session ended";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Holding,
    Waiting,
    Streaming,
    Ended,
}

#[derive(Debug)]
struct Relay {
    name: String,
    process: Process,
    killed_at: Option<SystemTime>,
}

impl Relay {
    fn spawn(case: &Case, n: usize) -> Relay {
        let name = format!("relay-{n}");
        let mut command = case.relay_command("run");
        command.env("NO_COLOR", "1");
        Relay {
            process: Process::spawn(&name, command),
            name,
            killed_at: None,
        }
    }

    fn running(&self) -> bool {
        self.killed_at.is_none()
    }

    /// The lease-related lines of its log, with the relay's own timestamps.
    fn marks(&self) -> Vec<(SystemTime, Mark)> {
        timed_log_lines(&self.process.output())
            .into_iter()
            .filter_map(|(time, line)| {
                let mark = if line.contains(HOLDING) {
                    Mark::Holding
                } else if line.contains(WAITING) {
                    Mark::Waiting
                } else if line.contains(STREAMING) {
                    Mark::Streaming
                } else if line.contains(ENDED) {
                    Mark::Ended
                } else {
                    return None;
                };
                Some((time, mark))
            })
            .collect()
    }

    /// Whether, by its log, it holds the lease now.
    fn holds(&self) -> bool {
        self.running()
            && self
                .marks()
                .iter()
                .rev()
                .find(|(_, m)| matches!(m, Mark::Holding | Mark::Ended))
                .is_some_and(|(_, m)| *m == Mark::Holding)
    }

    /// Its latest lease-related mark.
    fn last_mark(&self) -> Option<Mark> {
        self.marks().last().map(|&(_, mark)| mark)
    }

    /// When it first logged `mark` after `after`.
    fn first_after(&self, mark: Mark, after: SystemTime) -> Option<SystemTime> {
        self.marks()
            .into_iter()
            .find(|&(time, m)| m == mark && time > after)
            .map(|(time, _)| time)
    }

    /// The periods in which it held the lease, by its log: from "holding the lease" to the end
    /// of that session, its SIGKILL, or `now`. Panics if it streamed without holding it.
    fn lease_periods(&self, now: SystemTime) -> Vec<(SystemTime, SystemTime)> {
        let mut periods = Vec::new();
        let mut open: Option<SystemTime> = None;
        for (time, mark) in self.marks() {
            match mark {
                Mark::Holding => {
                    assert!(open.is_none(), "{} took the lease twice", self.name);
                    open = Some(time);
                }
                Mark::Ended => {
                    if let Some(start) = open.take() {
                        periods.push((start, time));
                    }
                }
                Mark::Streaming => assert!(
                    open.is_some(),
                    "{} streamed without holding the lease; output:\n{}",
                    self.name,
                    self.process.output()
                ),
                Mark::Waiting => {}
            }
        }
        if let Some(start) = open {
            periods.push((start, self.killed_at.unwrap_or(now)));
        }
        periods
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_from_a_killed_relay_within_10s_and_the_stream_stays_exact() {
    let started = Instant::now();
    let pg = Postgres::start();
    let nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "standby");
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "2s")]);
    let js = case.jetstream().await;

    // Two relays started together: exactly one takes the lease, the other waits.
    let mut relays = vec![Relay::spawn(&case, 0), Relay::spawn(&case, 1)];
    let first = eventually(
        "one relay to hold the lease and the other to wait",
        DEADLINE,
        || async {
            let holding: Vec<usize> = (0..2).filter(|&i| relays[i].holds()).collect();
            assert!(holding.len() <= 1, "both relays hold the lease");
            let waiting: Vec<usize> = (0..2)
                .filter(|&i| relays[i].marks().iter().any(|(_, m)| *m == Mark::Waiting))
                .collect();
            (holding.len() == 1 && waiting.len() == 1 && holding != waiting).then(|| holding[0])
        },
    )
    .await;
    relays[first].process.wait_for_output(STREAMING, DEADLINE);
    eprintln!(
        "standby: {} active, {} waiting",
        relays[first].name,
        relays[1 - first].name
    );

    let writers = Writers::start(&case, 2, Duration::from_millis(100)).await;
    let mut takeovers: Vec<Duration> = Vec::new();
    let mut lease_waits: Vec<Duration> = Vec::new();
    for round in 0..KILLS {
        let base = case.stream_count(&js).await;
        case.wait_for_count(&js, base + FLOW, DEADLINE).await;
        // The active relay: the one running relay that holds the lease and streams.
        let active = eventually(
            "one relay to hold the lease and stream",
            DEADLINE,
            || async {
                let holding: Vec<usize> =
                    (0..relays.len()).filter(|&i| relays[i].holds()).collect();
                assert!(holding.len() <= 1, "two relays hold the lease: {holding:?}");
                let active = *holding.first()?;
                (relays[active].last_mark() == Some(Mark::Streaming)).then_some(active)
            },
        )
        .await;
        let running: Vec<usize> = (0..relays.len()).filter(|&i| relays[i].running()).collect();
        assert_eq!(running.len(), 2, "two relays run");
        let standby = running.into_iter().find(|&i| i != active).unwrap();
        let stored = case.stream_count(&js).await;

        let killed_at = SystemTime::now();
        relays[active].process.kill();
        relays[active].killed_at = Some(killed_at);

        let streaming_at = eventually(
            &format!(
                "{} to take over from {}",
                relays[standby].name, relays[active].name
            ),
            DEADLINE,
            || async { relays[standby].first_after(Mark::Streaming, killed_at) },
        )
        .await;
        let holding_at = relays[standby]
            .first_after(Mark::Holding, killed_at)
            .expect("took the lease before streaming");
        let takeover = streaming_at.duration_since(killed_at).unwrap();
        let lease_wait = holding_at.duration_since(killed_at).unwrap();
        eprintln!(
            "standby: kill {round}: SIGKILL {} ({stored} stored); {} held the lease after {lease_wait:?}, streamed after {takeover:?}",
            relays[active].name, relays[standby].name
        );
        assert!(
            takeover < TAKEOVER_LIMIT,
            "takeover {round} took {takeover:?}; {} output:\n{}",
            relays[standby].name,
            relays[standby].process.output()
        );
        takeovers.push(takeover);
        lease_waits.push(lease_wait);

        // A fresh relay becomes the new standby.
        let n = relays.len();
        relays.push(Relay::spawn(&case, n));
        eventually(
            &format!("relay-{n} to join the lease protocol"),
            DEADLINE,
            || async {
                relays[n]
                    .marks()
                    .iter()
                    .any(|(_, m)| matches!(m, Mark::Waiting | Mark::Holding))
                    .then_some(())
            },
        )
        .await;
    }

    let base = case.stream_count(&js).await;
    case.wait_for_count(&js, base + FLOW, DEADLINE).await;
    let log = writers.stop().await;
    let committed = log.committed_rows() as u64;
    case.wait_for_count(&js, committed, DEADLINE).await;
    let messages = case.messages(&js).await;
    let findings = check_faithful(&messages, &log);

    // At no time did two relays hold the lease.
    let now = SystemTime::now();
    let mut periods: Vec<(SystemTime, SystemTime, &str)> = relays
        .iter()
        .flat_map(|relay| {
            relay
                .lease_periods(now)
                .into_iter()
                .map(|(start, end)| (start, end, relay.name.as_str()))
        })
        .collect();
    periods.sort();
    let overlaps: Vec<String> = periods
        .windows(2)
        .filter(|w| w[1].0 < w[0].1)
        .map(|w| format!("{} took the lease while {} held it", w[1].2, w[0].2))
        .collect();
    let sessions: usize = relays
        .iter()
        .map(|r| r.process.output().matches(STREAMING).count())
        .sum();

    let walsenders_ended: usize = relays
        .iter()
        .map(|r| r.process.output().matches("ended a walsender").count())
        .sum();

    let (min, median, max) = min_median_max(&takeovers);
    let (lease_min, lease_median, lease_max) = min_median_max(&lease_waits);
    eprintln!(
        "standby: injected {} SIGKILLs of the active relay ({} relays started); {} lease periods, {sessions} streaming sessions, {} overlapping; {walsenders_ended} lingering walsenders ended",
        takeovers.len(),
        relays.len(),
        periods.len(),
        overlaps.len()
    );
    eprintln!(
        "standby: takeover (SIGKILL -> streaming) min {min:?} / median {median:?} / max {max:?}; \
         lease taken min {lease_min:?} / median {lease_median:?} / max {lease_max:?}; all: {takeovers:?}"
    );
    eprintln!(
        "standby: {} transactions committed, {} rows rolled back; found {} ({:?} in all)",
        log.committed_transactions(),
        log.rolled_back.len(),
        findings.summary(),
        started.elapsed()
    );
    assert!(overlaps.is_empty(), "lease overlaps: {overlaps:?}");
    assert_eq!(takeovers.len(), KILLS);
    findings.assert_faithful();
    drop(relays);
}

/// LS1, issue 7 case 6: the moment a relay learns that its lease is gone it publishes nothing
/// more. Its sink task once outlived the session and went on publishing its buffered backlog
/// after another relay (here: the test) had taken the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_publish_after_the_lease_is_lost() {
    let pg = Postgres::start();
    let nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "lease_lost");
    // Acks can be held back while publishes still reach the server.
    let proxy = case.nats_through_proxy(nats.port());
    case.set_env(&[
        ("OUTBOX_RELAY_MAX_IN_FLIGHT", "64"),
        ("OUTBOX_RELAY_ACK_TIMEOUT", "60s"),
        ("NO_COLOR", "1"),
    ]);
    let relay = case.start_relay();
    let mut sql = case.sql().await;
    let js = support::jetstream_at(&nats.url()).await;
    const ROWS: u64 = 20_000;
    insert_transaction(&mut sql, ROWS as usize, 50, "backlog").await;
    case.wait_for_count(&js, 500, DEADLINE).await;

    // Hold the acks: the relay fills its window (64 publishes, stored) and its channel, and
    // stalls with a backlog buffered.
    proxy.set_blackhole(true);
    let stalled_at = eventually("the relay to stall on its window", DEADLINE, || async {
        let before = last_sequence(&case, &js).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        (last_sequence(&case, &js).await == before).then_some(before)
    })
    .await;
    assert!(stalled_at < ROWS, "the backlog must outlast the window");

    // Take the lease away: end the relay's lease session and hold the lock ourselves.
    let thief = case.sql().await;
    eventually("the test to hold the relay's lease", DEADLINE, || async {
        thief
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks \
                  WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        let held: bool = sql_value(
            &thief,
            "SELECT pg_try_advisory_lock(hashtextextended('outbox-relay/' || $1, 0))",
            &[&case.slot],
        )
        .await;
        held.then_some(())
    })
    .await;
    relay.wait_for_output(&format!("lost the lease for slot {}", case.slot), DEADLINE);
    relay.wait_for_output(WAITING, DEADLINE);
    let at_loss = last_sequence(&case, &js).await;

    // Release the acks. A sink that outlived its session would now publish its buffered
    // items; the stream must not grow while the test holds the lease.
    proxy.set_blackhole(false);
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        assert_eq!(
            last_sequence(&case, &js).await,
            at_loss,
            "the relay published after it lost the lease"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Give the lease back: the relay takes over again and the stream ends exact.
    drop(thief);
    case.wait_for_count(&js, ROWS, DEADLINE).await;
    let messages = case.messages(&js).await;
    let ids: Vec<i64> = messages.iter().map(|m| m.outbox_id()).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "each event once");
    assert_eq!(ids.len() as u64, ROWS);
    eprintln!(
        "lease lost: {stalled_at} of {ROWS} stored when the relay stalled, {at_loss} at the loss; no publish in the 3 s after it; all {ROWS} once after the takeover"
    );
}

async fn last_sequence(case: &Case, js: &async_nats::jetstream::Context) -> u64 {
    let mut stream = js.get_stream(&case.stream).await.expect("stream exists");
    stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence
}
