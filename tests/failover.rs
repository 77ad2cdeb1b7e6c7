//! Postgres fail-over (issue 21), on a primary and a streaming standby of PostgreSQL 17 or
//! newer (`testkit::pg_at_least`: the PostgreSQL 18 `tests/setup` installs; never skipped).
//!
//! - Multi-host connection strings with libpq's semantics: with `target_session_attrs`, both
//!   of the relay's connections (`ReplicationConnection::connect`, `connect_sql`) take the
//!   first listed host whose server is what is asked for, wherever it is in the list; a host
//!   that does not answer is passed over; with none suitable, the error names each host and
//!   why.
//! - A fail-over under a steady write load: a primary with `synchronized_standby_slots` and
//!   `synchronous_standby_names` (so "committed" is what the standby has), a standby with
//!   `sync_replication_slots = on`, the relay with `--failover-slot` and both hosts with
//!   `target_session_attrs=read-write`. kill -9 the primary, wait past the duplicate window,
//!   promote the standby; the writers and the relay move on their own. The stream holds every
//!   committed row exactly once, in commit order; the test prints the events re-sent after
//!   the promotion and the time to resume. Without fail-over slots (the Postgres 15 way) the
//!   relay refuses to invent a position on the new primary and says how to recover.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::assert_contains_all;

use support::sql_value;

use replication::{ConnInfo, ReplicationConnection, TargetSessionAttrs};
use std::time::{Duration, Instant};

use support::{check_faithful, eventually, insert_transaction, Case, Writers, DEADLINE};
use testkit::{Nats, PgOptions, Postgres};

/// A server of 17 or newer (fail-over slots), or a failure that says how to install one.
fn pg_options() -> PgOptions {
    let bin_dir = testkit::pg_at_least(17);
    PgOptions {
        bin_dir: Some(bin_dir),
        ..PgOptions::default()
    }
}

fn setting(name: &str, value: &str) -> (String, String) {
    (name.to_owned(), value.to_owned())
}

/// `postgres://postgres@127.0.0.1:p1,127.0.0.1:p2/{database}?{query}`.
fn multi_host_url(ports: &[u16], database: &str, query: &str) -> String {
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    format!("postgres://postgres@{}/{database}?{query}", hosts.join(","))
}

/// The port of the server each connection of `url` lands on.
async fn landed_on(url: &str) -> Result<(u16, u16), replication::Error> {
    let info: ConnInfo = url.parse()?;
    let sql = replication::connect_sql(&info).await?;
    let sql_port: i32 = sql_value(&sql, "select inet_server_port()", &[]).await;
    let mut replication = ReplicationConnection::connect(&info).await?;
    let rows = replication.simple_query("SHOW port").await?;
    let replication_port: u16 = rows[0][0].as_deref().unwrap().parse().unwrap();
    replication.close().await?;
    Ok((u16::try_from(sql_port).unwrap(), replication_port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_host_read_write_with_the_standby_listed_first_connects_to_the_primary() {
    let primary = Postgres::start_with(pg_options());
    let standby = primary.start_standby(None, vec![]);
    let nats = Nats::start();
    let case = Case::new(&primary, &nats, "multihost");
    standby.wait_for_database(&case.database);
    let (p, s) = (primary.port(), standby.port());
    // Nothing listens there: libpq passes over a host that does not answer.
    let dead = testkit::free_port();

    for (ports, attrs, expected) in [
        (vec![s, p], "read-write", p),
        (vec![dead, s, p], "primary", p),
        (vec![p, s], "read-only", s),
        (vec![p, s], "standby", s),
        (vec![p, s], "prefer-standby", s),
        (vec![p], "prefer-standby", p),
        (vec![s, p], "any", s),
    ] {
        let url = multi_host_url(
            &ports,
            &case.database,
            &format!("target_session_attrs={attrs}"),
        );
        assert_eq!(
            landed_on(&url).await.unwrap(),
            (expected, expected),
            "{attrs} over {ports:?}"
        );
    }
    // None suitable: each host and why, and retrying may help (a promotion).
    let url = multi_host_url(
        &[dead, s],
        &case.database,
        "target_session_attrs=read-write",
    );
    let error = landed_on(&url).await.unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains(&format!(
            "127.0.0.1:{s} is read-only (transaction_read_only = on)"
        )) && text.contains(&format!("127.0.0.1:{dead}: could not connect"))
            && text.contains("target_session_attrs=read-write"),
        "{text}"
    );
    assert!(error.is_transient(), "{text}");
    assert!(matches!(
        error,
        replication::Error::NoServer {
            attrs: TargetSessionAttrs::ReadWrite,
            ..
        }
    ));

    // The relay: both connections (and `config`) take the list; events flow from the primary.
    let relay_case = Case {
        pg_url: multi_host_url(&[s, p], &case.database, "target_session_attrs=read-write"),
        ..case.clone()
    };
    let config = relay_case.relay_command("config").output().unwrap();
    let shown = String::from_utf8_lossy(&config.stdout);
    assert_contains_all(
        &shown,
        [
            "# host = \"127.0.0.1,127.0.0.1\"".to_owned(),
            format!("# port = \"{s},{p}\""),
            "# target_session_attrs = \"read-write\"".to_owned(),
            "# load_balance_hosts = \"disable\"".to_owned(),
        ],
    );
    let relay = tokio::task::block_in_place(|| relay_case.start_relay());
    let js = case.jetstream().await;
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 50, 5, "multihost").await;
    case.wait_for_count(&js, ids.len() as u64, DEADLINE).await;
    assert_eq!(case.outbox_ids(&js).await, ids);
    drop(relay);
}

/// The standby's physical slot on the primary.
const STANDBY_SLOT: &str = "standby_slot";
/// The stream's duplicate window: the primary stays down longer than this.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);
/// Rows the stream must hold before the kill, and rows committed after the promotion.
const FLOW: u64 = 300;
const STREAMING: &str = "streaming outbox events";

/// A streaming standby of `primary` (on `STANDBY_SLOT`); with `failover_slots`, it synchronizes
/// fail-over slots and the primary's logical decoding waits for it. Commits wait for the
/// standby (`synchronous_standby_names`): what a writer saw committed survives the fail-over,
/// so the stream can be checked against it exactly.
fn start_standby(primary: &Postgres, failover_slots: bool) -> Postgres {
    let mut settings = vec![setting("hot_standby_feedback", "on")];
    if failover_slots {
        settings.push(setting("sync_replication_slots", "on"));
    }
    let standby = primary.start_standby(Some(STANDBY_SLOT), settings);
    let mut system = vec![("synchronous_standby_names", "'*'")];
    if failover_slots {
        system.push(("synchronized_standby_slots", "'standby_slot'"));
    }
    for (name, value) in system {
        primary.psql("postgres", &format!("ALTER SYSTEM SET {name} = {value}"));
    }
    primary.psql("postgres", "SELECT pg_reload_conf()");
    standby
}

/// `outbox_relay_events_total{outcome="{outcome}"}` of the relay's metrics.
fn events_total(port: u16, outcome: &str) -> u64 {
    let (_, body) = testkit::http_get(port, "/metrics").unwrap();
    let name = format!("outbox_relay_events_total{{outcome=\"{outcome}\"}} ");
    body.lines()
        .find_map(|line| line.strip_prefix(name.as_str()))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{body}")) as u64
}

/// A case on `primary` and its new standby (see [`start_standby`]), the relay given both hosts
/// with `target_session_attrs=read-write`, and with `failover_slots` its slot created with
/// `--failover-slot` before the standby (whose synchronization then finds it at once).
fn failover_case(
    primary: &Postgres,
    nats: &Nats,
    failover_slots: bool,
    extra_env: Vec<(String, String)>,
) -> (Case, Postgres) {
    let mut case = Case::new(primary, nats, "failover");
    case.extra_env = extra_env;
    if failover_slots {
        case.extra_env
            .push(setting("OUTBOX_RELAY_FAILOVER_SLOT", "true"));
        case.init();
    }
    let standby = start_standby(primary, failover_slots);
    standby.wait_for_database(&case.database);
    case.pg_url = multi_host_url(
        &[primary.port(), standby.port()],
        &case.database,
        "target_session_attrs=read-write",
    );
    (case, standby)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_load_with_failover_slots_stores_every_committed_row_once_in_order() {
    let mut primary = Postgres::start_with(pg_options());
    let nats = Nats::start();
    let metrics_port = testkit::free_port();
    let env = vec![
        setting("OUTBOX_RELAY_DUPLICATE_WINDOW", "2s"),
        setting(
            "OUTBOX_RELAY_METRICS_ADDR",
            &format!("127.0.0.1:{metrics_port}"),
        ),
    ];
    let (case, mut standby) = failover_case(&primary, &nats, true, env);
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let js = case.jetstream().await;

    let writers = Writers::start(&case, 2, Duration::from_millis(20)).await;
    case.wait_for_count(&js, FLOW, DEADLINE).await;
    // The standby holds a synchronized copy of the relay's slot.
    let synced = format!(
        "select count(*) from pg_replication_slots where slot_name = '{}' and synced and not temporary",
        case.slot
    );
    testkit::wait_until("the standby to synchronize the slot", DEADLINE, || {
        standby
            .try_psql("postgres", &synced)
            .is_ok_and(|out| out.trim() == "1")
    });

    let (duplicates, skipped) = (
        events_total(metrics_port, "duplicate"),
        events_total(metrics_port, "skipped"),
    );
    let streamed = relay.output().matches(STREAMING).count();
    let before = case.stream_count(&js).await;
    let killed = Instant::now();
    tokio::task::block_in_place(|| primary.kill());
    // Down for longer than the duplicate window: de-duplication cannot hide a re-sent event.
    tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_secs(1)).await;
    let promoting = Instant::now();
    tokio::task::block_in_place(|| standby.promote());
    eventually(
        "the relay to stream from the new primary",
        DEADLINE,
        || async { (relay.output().matches(STREAMING).count() > streamed).then_some(()) },
    )
    .await;
    let resumed = Instant::now();
    let committed_then = writers.committed_rows();
    eventually(
        "the writers to commit on the new primary",
        DEADLINE,
        || async { (writers.committed_rows() >= committed_then + FLOW).then_some(()) },
    )
    .await;
    let log = writers.stop().await;
    let committed = log.committed_rows() as u64;
    case.wait_for_count(&js, committed, DEADLINE).await;
    let messages = case.messages(&js).await;
    let findings = check_faithful(&messages, &log);
    let resent = events_total(metrics_port, "duplicate") - duplicates;
    let skipped = events_total(metrics_port, "skipped") - skipped;
    let output = relay.output();
    drop(relay);
    eprintln!(
        "fail-over: {before} events stored before the kill; promoted {:.1} s after it; the relay \
         streamed again {:.1} s after the promotion ({:.1} s after the kill); {resent} events \
         re-sent after the promotion, {skipped} replayed events skipped by the stored position; \
         {}",
        (promoting - killed).as_secs_f64(),
        (resumed - promoting).as_secs_f64(),
        (resumed - killed).as_secs_f64(),
        findings.summary()
    );
    assert!(
        findings.is_faithful(),
        "{}\n{:#?}\nrelay log:\n{}",
        findings.summary(),
        findings.problems,
        support::last_lines(&output, 60)
    );
    assert_eq!(resent, 0, "no event re-sent after the promotion");
    assert!(
        !output.contains("not skipping by"),
        "the stored position is trusted across the promotion:\n{output}"
    );
}

/// Without fail-over slots (Postgres 15, or 17+ without `--failover-slot`) the slot stays
/// behind on the dead primary. The relay follows the hosts to the new primary, finds no slot
/// there and refuses: it does not create one (which would start at the WAL end and skip what
/// was committed meanwhile), and says how to recover. Nothing is published from a made-up
/// position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_without_failover_slots_refuses_to_invent_a_position_and_says_how_to_recover() {
    let mut primary = Postgres::start();
    let nats = Nats::start();
    let (case, mut standby) = failover_case(&primary, &nats, false, vec![]);
    let mut relay = tokio::task::block_in_place(|| case.start_relay());
    let js = case.jetstream().await;
    let writers = Writers::start(&case, 2, Duration::from_millis(20)).await;
    case.wait_for_count(&js, FLOW, DEADLINE).await;

    tokio::task::block_in_place(|| primary.kill());
    tokio::task::block_in_place(|| standby.promote());
    let status = tokio::task::block_in_place(|| relay.wait_exit(DEADLINE));
    let log = writers.stop().await;
    let output = relay.output();
    assert_eq!(status.code(), Some(2), "a setup error:\n{output}");
    assert_contains_all(
        &output,
        [
            &format!(
                "replication slot \"{}\" does not exist on the server",
                case.slot
            ),
            "the relay does not invent a position",
            "outbox-relay init",
            "outbox-relay verify --from-id",
            "outbox-relay backfill --from-id",
            "--failover-slot",
        ],
    );
    // Nothing created on the new primary, nothing published from it.
    assert_eq!(
        standby.slots_named(&case.slot),
        0,
        "the relay created a slot on the new primary"
    );
    // Nothing published from the new primary: every event carries the old timeline.
    let messages = case.messages(&js).await;
    let timelines: std::collections::BTreeSet<String> = messages
        .iter()
        .map(|m| {
            m.header("Outbox-Source")
                .split('/')
                .nth(1)
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(timelines.into_iter().collect::<Vec<_>>(), ["1"]);
    // Without synchronized_standby_slots the relay may have published commits the standby
    // never received (they are gone from the new primary): what `verify` then reports as
    // unexpected, and why the runbook asks for it.
    let committed = log.committed_ids();
    let gone = messages
        .iter()
        .filter(|m| !committed.contains(&m.outbox_id()))
        .count();
    eprintln!(
        "fail-over without fail-over slots: the relay refused on the new primary after {} \
         events ({gone} of them for rows the fail-over lost); {} rows committed in all",
        messages.len(),
        log.committed_rows()
    );
}

/// The state `outbox_relay_failover_protection` shows (the label of the series at 1), if any.
fn protection_state(port: u16) -> Option<String> {
    let (_, body) = testkit::http_get(port, "/metrics").ok()?;
    body.lines().find_map(|line| {
        let state = line.strip_prefix("outbox_relay_failover_protection{state=\"")?;
        let (state, value) = state.split_once("\"} ")?;
        (value.trim().parse::<f64>().ok()? == 1.0).then(|| state.to_owned())
    })
}

/// Waits until the relay's metric says fail-over protection is `state`; the relay's log
/// tells why not when it does not.
async fn protection_becomes(port: u16, state: &str, relay: &testkit::Process) {
    let deadline = Instant::now() + DEADLINE;
    while protection_state(port).as_deref() != Some(state) {
        assert!(
            Instant::now() < deadline,
            "fail-over protection is {:?}, not {state}, after {DEADLINE:?}; relay log:\n{}",
            protection_state(port),
            support::last_lines(&relay.output(), 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Fail-over protection watched (issue 39): with `--failover-slot` and the standby listed in
/// `DATABASE_URL`, the metric, `status` and the log say when no standby holds a copy of the
/// slot a promotion would keep (here: the standby is down), and clear once it does again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_protection_missing_is_said_by_the_metric_status_and_log_then_clears() {
    let primary = Postgres::start_with(pg_options());
    let nats = Nats::start();
    let metrics_port = testkit::free_port();
    let env = vec![setting(
        "OUTBOX_RELAY_METRICS_ADDR",
        &format!("127.0.0.1:{metrics_port}"),
    )];
    let (case, mut standby) = failover_case(&primary, &nats, true, env);
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let standby_at = format!("standby 127.0.0.1:{}", standby.port());

    // The copy may be temporary at first (its first synchronization), then it protects.
    protection_becomes(metrics_port, "protected", &relay).await;
    let (missing, holds) = ("fail-over protection missing", "fail-over protection holds");
    let said = |what: &str| relay.output().matches(what).count();
    let (missing_before, holds_before) = (said(missing), said(holds));
    assert_eq!(holds_before, 1, "{}", relay.output());
    let status = case.run_command("status", &[]);
    status.assert_code(0);
    status.assert_stdout_has(&[&format!(
        "{standby_at} holds a synced copy of slot {}",
        case.slot
    )]);

    tokio::task::block_in_place(|| standby.stop());
    protection_becomes(metrics_port, "missing", &relay).await;
    let status = case.run_command("status", &[]);
    status.assert_code(3);
    status.assert_stdout_has(&[
        "fail-over protection missing: a promotion now would lose slot",
        &format!("{standby_at}: cannot connect"),
    ]);
    eventually("the log to say protection is missing", DEADLINE, || async {
        (said(missing) == missing_before + 1).then_some(())
    })
    .await;

    tokio::task::block_in_place(|| standby.start_again());
    protection_becomes(metrics_port, "protected", &relay).await;
    eventually(
        "the log to say protection holds again",
        DEADLINE,
        || async { (said(holds) == holds_before + 1).then_some(()) },
    )
    .await;
    assert_eq!(
        said(missing),
        missing_before + 1,
        "each change said once:\n{}",
        relay.output()
    );
    let status = case.run_command("status", &[]);
    status.assert_code(0);
}
