//! Metrics and health (issue 10 parts 1 and 2), against the real binary, real servers and a
//! real Prometheus (Debian's `prometheus`, started by `testkit::Prometheus`, scraping every
//! second) whose HTTP API the assertions query:
//! - while events flow, the stored counter equals the events written and the latency
//!   histograms count what they should; while NATS is down the slot lag grows with the WAL
//!   written meanwhile, and after the relay caught up it is back near 0;
//! - `/readyz` turns unready when nats-server is stopped and ready again once it is back,
//!   and a standby's readiness says `standby`; `outbox-relay probe` exits 0 and 1 on them;
//! - every metric the relay exposes is explained in docs/operations.md, and the alert rules
//!   of docs/alerts.yml and the Grafana dashboard (deploy/grafana/outbox-relay.json) use
//!   only metrics it exposes, the dashboard every one the alerts use;
//! - every query of the dashboard, its panels' and its template variables', answers from
//!   Prometheus scraping a running relay, with the labels its legends name;
//! - idle and slow connections cannot starve the endpoint (issue 18 case 7): `/healthz`
//!   answers at once beside 100 idle and 10 dribbling ones, and with every exchange busy a
//!   probe is told `503` at once rather than left waiting.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use support::{eventually, insert_transaction, servers, Case, DEADLINE};
use testkit::{Nats, Postgres, Process, Prometheus, Sample};

/// A case whose relay serves metrics on a free port; returns the address.
fn with_metrics(case: &mut Case) -> SocketAddr {
    let addr: SocketAddr = format!("127.0.0.1:{}", testkit::free_port())
        .parse()
        .unwrap();
    case.extra_env
        .push(("OUTBOX_RELAY_METRICS_ADDR".into(), addr.to_string()));
    addr
}

/// `GET path` from the relay at `addr`.
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    outbox_relay::observe::http::get(addr, path, Duration::from_secs(5)).await
}

/// The server's current WAL position, in bytes.
async fn wal_lsn(sql: &tokio_postgres::Client) -> u64 {
    let row = sql
        .query_one("select pg_current_wal_lsn()::text", &[])
        .await
        .unwrap();
    row.get::<_, String>(0).parse::<pgoutput::Lsn>().unwrap().0
}

/// Waits until Prometheus answers `promql` with samples that `ok` accepts; returns them.
async fn prometheus_answer(
    prometheus: &Prometheus,
    promql: &str,
    ok: impl Fn(&[Sample]) -> bool,
) -> Vec<Sample> {
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let answer = prometheus.query(promql);
        if let Ok(samples) = &answer {
            if ok(samples) {
                return answer.unwrap();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting for Prometheus to answer {promql} as expected; its last answer: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until Prometheus evaluates `promql` to one value that `ok` accepts; returns it.
async fn prometheus_until(prometheus: &Prometheus, promql: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let samples = prometheus_answer(
        prometheus,
        promql,
        |samples| matches!(samples, [sample] if ok(sample.value)),
    )
    .await;
    samples[0].value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_sees_events_latencies_and_the_lag_grow_while_nats_is_down_then_shrink() {
    let pg = Postgres::start();
    let mut nats = Nats::start();
    let mut case = Case::new(&pg, &nats, "prom");
    let addr = with_metrics(&mut case);
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "2s")]);
    let relay = case.start_relay();
    let prometheus = Prometheus::start(&[addr.to_string()]);
    let js = case.jetstream().await;
    let mut sql = case.sql().await;

    // Events flow: 10 transactions of 1, 8, 15, … rows.
    let mut written = 0;
    for i in 0..10 {
        written += insert_transaction(&mut sql, 1 + 7 * i, 5, "flow")
            .await
            .len();
    }
    case.wait_for_count(&js, written as u64, DEADLINE).await;
    let stored = r#"outbox_relay_events_total{outcome="stored"}"#;
    prometheus_until(&prometheus, stored, |v| v == written as f64).await;
    // Once per transaction; once per event.
    prometheus_until(
        &prometheus,
        "outbox_relay_commit_to_ack_seconds_count",
        |v| v == 10.0,
    )
    .await;
    prometheus_until(
        &prometheus,
        "outbox_relay_created_to_ack_seconds_count",
        |v| v == written as f64,
    )
    .await;
    // Every transaction was stored within a minute of its commit.
    let within_a_minute = r#"outbox_relay_commit_to_ack_seconds_count - ignoring(le) outbox_relay_commit_to_ack_seconds_bucket{le="60"}"#;
    prometheus_until(&prometheus, within_a_minute, |v| v == 0.0).await;
    prometheus_until(&prometheus, "outbox_relay_lease_held", |v| v == 1.0).await;
    prometheus_until(&prometheus, "outbox_relay_in_flight_events", |v| v == 0.0).await;
    prometheus_until(
        &prometheus,
        r#"outbox_relay_slot_wal_status{status="reserved"}"#,
        |v| v == 1.0,
    )
    .await;
    prometheus_until(&prometheus, "outbox_relay_build_info", |v| v == 1.0).await;
    let last_commit = case.messages(&js).await.last().unwrap().commit_lsn().0 as f64;
    prometheus_until(&prometheus, "outbox_relay_confirmed_lsn", |v| {
        v >= last_commit
    })
    .await;
    prometheus_until(
        &prometheus,
        "outbox_relay_received_lsn - outbox_relay_confirmed_lsn",
        |v| v >= 0.0,
    )
    .await;

    // NATS goes away: the relay cannot confirm, and the slot retains the WAL written since.
    nats.kill();
    let before = wal_lsn(&sql).await;
    let mut outage = 0;
    for _ in 0..3 {
        outage += insert_transaction(&mut sql, 1000, 10, "outage").await.len();
    }
    let written_meanwhile = wal_lsn(&sql).await - before;
    // Keepalives may let the relay confirm WAL of the first transaction before its commit
    // is decoded (I2), never anything after: the last two stay retained.
    let lag = prometheus_until(&prometheus, "outbox_relay_slot_lag_bytes", |v| {
        v >= (written_meanwhile / 2) as f64
    })
    .await;
    prometheus_until(
        &prometheus,
        r#"outbox_relay_reconnects_total{target="nats"}"#,
        |v| v >= 1.0,
    )
    .await;

    // NATS is back: everything is stored and the lag returns near 0.
    nats.start_again();
    case.wait_for_count(&js, (written + outage) as u64, DEADLINE)
        .await;
    let total = (written + outage) as f64;
    assert_eq!(case.stream_count(&js).await, total as u64, "exactly once");
    // Publishes whose acks the outage swallowed count as skipped or duplicate when replayed,
    // not as stored again.
    let acknowledged = r#"sum(outbox_relay_events_total{outcome=~"stored|duplicate|skipped"})"#;
    prometheus_until(&prometheus, acknowledged, |v| v >= total).await;
    prometheus_until(&prometheus, stored, |v| v <= total).await;
    let near_zero = (written_meanwhile / 8).min(64 << 10) as f64;
    let after = prometheus_until(&prometheus, "outbox_relay_slot_lag_bytes", |v| {
        v < near_zero
    })
    .await;
    assert!(
        lag >= (written_meanwhile / 2) as f64 && after < near_zero,
        "lag {lag} while NATS was down ({written_meanwhile} bytes written), {after} after"
    );
    prometheus_until(
        &prometheus,
        "outbox_relay_oldest_unconfirmed_event_age_seconds",
        |v| v == 0.0,
    )
    .await;
    drop(relay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_unready_while_nats_is_down_and_a_standby_says_standby() {
    let mut nats = Nats::start();
    let mut case = Case::new(&servers().pg, &nats, "readyz");
    let first = with_metrics(&mut case);
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "2s")]);
    let _first_relay = case.start_relay();
    assert_eq!(get(first, "/healthz").await, Ok((200, "ok\n".into())));
    assert_eq!(get(first, "/readyz").await, Ok((200, "ready\n".into())));

    // A second relay on the same slot waits as a standby, and says so.
    let mut standby_case = case.clone();
    standby_case
        .extra_env
        .retain(|(k, _)| k != "OUTBOX_RELAY_METRICS_ADDR");
    let second = with_metrics(&mut standby_case);
    let second_relay = Process::spawn("relay-standby", standby_case.relay_command("run"));
    second_relay.wait_for_output("waiting as a standby", DEADLINE);
    let (status, body) = get(second, "/readyz").await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (503, "standby: another relay holds the lease\n")
    );
    assert_eq!(get(second, "/healthz").await.unwrap().0, 200);
    // `outbox-relay probe` (the image's HEALTHCHECK) agrees with both.
    let probe = |case: &Case| case.relay_command("probe").output().unwrap();
    let ready = probe(&case);
    assert_eq!(ready.status.code(), Some(0), "{ready:?}");
    assert_eq!(String::from_utf8_lossy(&ready.stdout), "ready\n");
    let standing_by = probe(&standby_case);
    assert_eq!(standing_by.status.code(), Some(1), "{standing_by:?}");
    assert!(String::from_utf8_lossy(&standing_by.stdout).starts_with("standby"));

    // NATS stops: no relay is ready; whichever holds the lease says why, not "standby".
    nats.kill();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 3, 1, "while-down").await;
    let why = eventually("both relays unready", DEADLINE, || async {
        let a = get(first, "/readyz").await.ok()?;
        let b = get(second, "/readyz").await.ok()?;
        (a.0 == 503 && b.0 == 503 && !a.1.starts_with("ready")).then_some(a.1)
    })
    .await;
    assert!(
        why.starts_with("not streaming") || why.starts_with("standby"),
        "{why}"
    );
    eventually(
        "an unready relay that holds the lease says why",
        DEADLINE,
        || async {
            let bodies = [
                get(first, "/readyz").await.ok()?.1,
                get(second, "/readyz").await.ok()?.1,
            ];
            bodies
                .iter()
                .any(|body| body.starts_with("not streaming"))
                .then_some(())
        },
    )
    .await;

    // NATS is back: one relay is ready again, the other one a standby.
    nats.start_again();
    eventually("one relay ready, the other a standby", DEADLINE, || async {
        let mut bodies = vec![
            get(first, "/readyz").await.ok()?,
            get(second, "/readyz").await.ok()?,
        ];
        bodies.sort();
        (bodies
            == [
                (200, "ready\n".to_owned()),
                (503, "standby: another relay holds the lease\n".to_owned()),
            ])
        .then_some(())
    })
    .await;
    drop(second_relay);
}

/// `GET path` that must answer within `PROMPTLY`; returns the answer and how long it took.
async fn get_promptly(addr: SocketAddr, path: &str) -> ((u16, String), Duration) {
    let started = std::time::Instant::now();
    let answer = outbox_relay::observe::http::get(addr, path, PROMPTLY).await;
    let took = started.elapsed();
    match answer {
        Ok(answer) => (answer, took),
        Err(error) => panic!("{path} did not answer promptly: {error} (after {took:?})"),
    }
}

/// How soon a probe must be answered (the endpoint's exchange deadline is 5 s: an answer
/// that waited for an idle connection to time out comes too late).
const PROMPTLY: Duration = Duration::from_secs(2);

/// `n` connections to `addr` that send nothing.
async fn idle_connections(addr: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut idle = Vec::with_capacity(n);
    for _ in 0..n {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    idle
}

/// Issue 18 case 7: 20 idle connections kept `/healthz` from answering for seconds (a
/// permit was taken before `accept`, and held 5 s by a client sending nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_at_once_beside_idle_and_slow_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut case = Case::new(&servers().pg, &servers().nats, "starved");
    let addr = with_metrics(&mut case);
    let _relay = case.start_relay();
    assert_eq!(get(addr, "/healthz").await, Ok((200, "ok\n".into())));

    // 100 idle connections, and 10 clients that dribble a request a byte at a time and never
    // finish it.
    let idle = idle_connections(addr, 100).await;
    let mut slow = Vec::new();
    for _ in 0..10 {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.push(tokio::spawn(async move {
            let started = std::time::Instant::now();
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
                .iter()
                .cycle()
            {
                if stream.write_all(&[*byte]).await.is_err() {
                    break;
                }
                // The server closes the connection at its exchange deadline.
                let mut buffer = [0u8; 64];
                let read =
                    tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buffer))
                        .await;
                if let Ok(Ok(0) | Err(_)) = read {
                    break;
                }
                assert!(
                    started.elapsed() < DEADLINE,
                    "a dribbling client was never closed"
                );
            }
            started.elapsed()
        }));
    }
    for path in ["/healthz", "/readyz", "/healthz"] {
        let ((status, body), took) = get_promptly(addr, path).await;
        assert_eq!(
            (status, body.as_str()),
            (
                200,
                if path == "/healthz" {
                    "ok\n"
                } else {
                    "ready\n"
                }
            ),
            "{path} after {took:?}"
        );
    }
    let ((status, body), _) = get_promptly(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("outbox_relay_events_total"), "{body}");

    // One exchange deadline bounds a dribbling client, however steadily it sends.
    for client in slow {
        let lasted = client.await.unwrap();
        assert!(
            lasted < Duration::from_secs(8),
            "a dribbling client was served for {lasted:?}"
        );
    }

    // Every exchange busy (128): a probe is told so at once, not queued behind them.
    let more = idle_connections(addr, 140).await;
    let ((status, body), took) = get_promptly(addr, "/healthz").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "busy: every metrics connection is in use, retry\n"),
        "after {took:?}"
    );

    // The idle clients leave: served again.
    drop((idle, more));
    eventually("/healthz served again", DEADLINE, || async {
        (get(addr, "/healthz").await == Ok((200, "ok\n".into()))).then_some(())
    })
    .await;
}

/// The metric families of a `/metrics` text.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The workspace's root.
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Grafana dashboard's path, from the workspace's root.
const DASHBOARD: &str = "deploy/grafana/outbox-relay.json";

/// The `outbox_relay_…` metrics a text names (a histogram's `_bucket`, `_sum` and `_count`
/// series as the histogram).
fn used_metrics(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("outbox_relay_"))
        .map(|word| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .fold(word, |word, suffix| {
                    word.strip_suffix(suffix).unwrap_or(word)
                })
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_documented_and_the_alert_rules_and_the_dashboard_use_only_exposed_metrics()
{
    let mut case = Case::new(&servers().pg, &servers().nats, "documented");
    let addr = with_metrics(&mut case);
    let _relay = case.start_relay();
    let mut sql = case.sql().await;
    insert_transaction(&mut sql, 2, 1, "documented").await;
    // Every family, the slot's (after the first poll) and the session's included.
    let text = eventually("the slot's metrics", DEADLINE, || async {
        let (_, text) = get(addr, "/metrics").await.ok()?;
        (text.contains("outbox_relay_slot_lag_bytes ")
            && text.contains("outbox_relay_nats_connected "))
        .then_some(text)
    })
    .await;
    let exposed = families(&text);
    assert!(exposed.len() >= 20, "{exposed:?}");
    let operations = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let undocumented: Vec<&String> = exposed
        .iter()
        .filter(|name| !operations.contains(&format!("`{name}")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "docs/operations.md does not explain {undocumented:?}"
    );
    // The alert rules and the dashboard (its queries, legends and descriptions) name only
    // metrics the relay exposes.
    let alerts = used_metrics(&std::fs::read_to_string(root().join("docs/alerts.yml")).unwrap());
    let dashboard = used_metrics(&std::fs::read_to_string(root().join(DASHBOARD)).unwrap());
    for (file, used) in [("docs/alerts.yml", &alerts), (DASHBOARD, &dashboard)] {
        assert!(used.len() >= 10, "{file} names only {used:?}");
        let unknown: Vec<&String> = used.difference(&exposed).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the relay does not expose: {unknown:?}"
        );
    }
    // Whatever an alert fires on, the dashboard shows.
    let not_shown: Vec<&String> = alerts.difference(&dashboard).collect();
    assert!(
        not_shown.is_empty(),
        "{DASHBOARD} has no panel for the alerts' {not_shown:?}"
    );
}

/// One query of the dashboard: a panel's target, or a template variable's `label_values`.
#[derive(Debug)]
struct PanelQuery {
    panel: String,
    expr: String,
    legend: String,
}

/// Every panel target of `dashboard`, rows' (collapsed or not) included; checks that each
/// panel and target asks the `datasource` variable's Prometheus.
fn panel_queries(panels: &serde_json::Value, into: &mut Vec<PanelQuery>) {
    let datasource = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    for panel in panels.as_array().unwrap() {
        let title = panel["title"].as_str().unwrap().to_owned();
        if panel["type"] == "row" {
            panel_queries(&panel["panels"], into);
            continue;
        }
        assert_eq!(panel["datasource"], datasource, "panel {title:?}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            assert_eq!(target["datasource"], datasource, "panel {title:?}");
            into.push(PanelQuery {
                panel: title.clone(),
                expr: target["expr"].as_str().unwrap().to_owned(),
                legend: target["legendFormat"].as_str().unwrap_or("").to_owned(),
            });
        }
    }
}

/// `text` with Grafana's variables replaced by `values` (`$name` and `${name}`); panics on
/// a variable it does not know.
fn fill(text: &str, values: &[(&str, &str)]) -> String {
    let mut filled = text.to_owned();
    for (name, value) in values {
        filled = filled
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    assert!(
        !filled.contains('$'),
        "{text:?} uses a variable the test does not fill: {filled:?}"
    );
    filled
}

/// Waits until Prometheus answers `promql` (`what` of the dashboard) with at least one
/// sample, none of them NaN (a quantile of no observations, a ratio of nothing).
async fn prometheus_answers(prometheus: &Prometheus, what: &str, promql: &str) -> Vec<Sample> {
    eprintln!("dashboard: {what}");
    prometheus_answer(prometheus, promql, |samples| {
        !samples.is_empty() && samples.iter().all(|s| !s.value.is_nan())
    })
    .await
}

/// The dashboard of deploy/grafana imports into any Grafana (a `datasource` variable, no
/// data source of ours) and every query of it, panels and template variables, answers from a
/// real Prometheus scraping a running relay, with the labels its legend names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_answers_from_prometheus_scraping_a_relay() {
    let text = std::fs::read_to_string(root().join(DASHBOARD)).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        dashboard["schemaVersion"].as_u64().unwrap() >= 36,
        "{dashboard:#}"
    );
    assert!(dashboard["id"].is_null(), "an exported id would clash");
    assert!(!text.contains("${DS_"), "no import-time data source input");
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables.iter().any(|v| v["type"] == "datasource"
            && v["name"] == "datasource"
            && v["query"] == "prometheus"),
        "a `datasource` variable of type prometheus: {variables:#?}"
    );
    let mut queries = Vec::new();
    panel_queries(&dashboard["panels"], &mut queries);
    assert!(queries.len() >= 20, "{queries:#?}");

    let mut case = Case::new(&servers().pg, &servers().nats, "dashboard");
    let addr = with_metrics(&mut case);
    let _relay = case.start_relay();
    let prometheus = Prometheus::start(&[addr.to_string()]);
    let instance = addr.to_string();
    let values = [
        ("__rate_interval", "1m"),
        ("__interval", "15s"),
        ("__range", "5m"),
        ("datasource", "prometheus"),
        ("job", "testkit"),
        ("instance", instance.as_str()),
    ];
    // Prometheus sees the counters at 0 before the events, so rate() sees them rise.
    let stored = r#"outbox_relay_events_total{outcome="stored"}"#;
    prometheus_until(&prometheus, stored, |v| v == 0.0).await;
    let mut sql = case.sql().await;
    let mut written = 0;
    for i in 0..5 {
        written += insert_transaction(&mut sql, 1 + 3 * i, 5, "dashboard")
            .await
            .len();
    }
    prometheus_until(&prometheus, stored, |v| v == written as f64).await;

    // The template variables find this relay.
    for variable in variables.iter().filter(|v| v["type"] == "query") {
        let name = variable["name"].as_str().unwrap();
        let query = variable["query"]["query"].as_str().unwrap();
        let (selector, label) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .and_then(|q| q.rsplit_once(','))
            .unwrap_or_else(|| panic!("variable {name}: {query:?} is not label_values(…, …)"));
        let label = label.trim();
        let expected = values.iter().find(|(n, _)| *n == name).unwrap().1;
        let samples = prometheus_answers(&prometheus, name, &fill(selector, &values)).await;
        assert!(
            samples
                .iter()
                .any(|s| s.labels.get(label).map(String::as_str) == Some(expected)),
            "variable {name}: {query:?} does not offer {expected:?}: {samples:?}"
        );
    }
    // Every panel's every query answers, with the labels its legend names.
    for query in &queries {
        let promql = fill(&query.expr, &values);
        let samples = prometheus_answers(&prometheus, &query.panel, &promql).await;
        let legend_labels = query
            .legend
            .split("{{")
            .skip(1)
            .filter_map(|part| part.split_once("}}"))
            .map(|(label, _)| label.trim());
        for label in legend_labels {
            assert!(
                samples.iter().all(|s| s.labels.contains_key(label)),
                "panel {:?}: its legend {:?} names {label:?}, which {promql} does not keep: {samples:?}",
                query.panel,
                query.legend
            );
        }
    }
}
