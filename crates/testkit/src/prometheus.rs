//! A throwaway Prometheus server that scrapes given targets every second.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cleanup::{self, Managed};
use crate::nats::http_get;

const START_TIMEOUT: Duration = Duration::from_secs(60);

/// `prometheus` (Debian's package: `/usr/bin/prometheus`, or `TESTKIT_PROMETHEUS`) on a
/// free loopback port, its TSDB in a temporary directory, scraping its targets every
/// second. Dropping it SIGKILLs the server and removes the directory.
#[derive(Debug)]
pub struct Prometheus {
    port: u16,
    log_path: PathBuf,
    child: Managed,
    // Declared last: removed after the server is gone.
    dir: tempfile::TempDir,
}

/// One sample of an instant query's result: the series' labels and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The series' labels (`__name__` included when the query keeps it).
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`host:port`, path `/metrics`) every second;
    /// returns once it is ready. Panics naming the package to install when the binary is
    /// missing: a test never skips silently.
    pub fn start(targets: &[String]) -> Prometheus {
        let bin = prometheus_bin();
        let dir = tempfile::Builder::new()
            .prefix("testkit-prometheus-")
            .tempdir_in(std::env::temp_dir())
            .expect("testkit: create a temporary directory for prometheus");
        cleanup::register_dir(dir.path());
        let config = dir.path().join("prometheus.yml");
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: testkit\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ),
        )
        .unwrap_or_else(|e| panic!("testkit: write {}: {e}", config.display()));
        let log_path = dir.path().join("prometheus.log");
        let log = File::create(&log_path)
            .unwrap_or_else(|e| panic!("testkit: create {}: {e}", log_path.display()));
        let log2 = log
            .try_clone()
            .expect("testkit: duplicate the prometheus log file handle");
        let port = crate::free_port();
        let mut command = Command::new(&bin);
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = Managed::spawn(&mut command, None)
            .unwrap_or_else(|e| panic!("testkit: spawn {}: {e}", bin.display()));
        let mut prometheus = Prometheus {
            port,
            log_path,
            child,
            dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = prometheus.child.try_wait() {
                panic!(
                    "testkit: prometheus exited with {status} while starting on port {port}; log:\n{}",
                    crate::process::last_lines(&prometheus.log(), 40)
                );
            }
            if matches!(http_get(port, "/-/ready"), Ok((200, _))) {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "testkit: prometheus not ready on port {port} within {START_TIMEOUT:?}; log:\n{}",
                crate::process::last_lines(&prometheus.log(), 40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its HTTP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its log.
    pub fn log(&self) -> String {
        crate::read_lossy(&self.log_path)
    }

    /// Evaluates `promql` now (`/api/v1/query`): the samples of a vector result, the one
    /// sample of a scalar result.
    pub fn query(&self, promql: &str) -> Result<Vec<Sample>, String> {
        let path = format!("/api/v1/query?query={}", percent_encode(promql));
        let (status, body) = http_get(self.port, &path)?;
        let json: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| format!("prometheus answered {status} with no JSON ({e}): {body}"))?;
        if json["status"] != "success" {
            return Err(format!("prometheus refused {promql:?}: {body}"));
        }
        let value = |pair: &serde_json::Value| {
            pair[1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| format!("a sample without a value in {body}"))
        };
        let result = &json["data"]["result"];
        match json["data"]["resultType"].as_str() {
            Some("vector") => result
                .as_array()
                .into_iter()
                .flatten()
                .map(|series| {
                    let labels = series["metric"]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                        .collect();
                    Ok(Sample {
                        labels,
                        value: value(&series["value"])?,
                    })
                })
                .collect(),
            Some("scalar") => Ok(vec![Sample {
                labels: BTreeMap::new(),
                value: value(result)?,
            }]),
            other => Err(format!("unexpected result type {other:?}: {body}")),
        }
    }

    /// The value of `promql` when it yields exactly one sample.
    pub fn value(&self, promql: &str) -> Option<f64> {
        match self.query(promql) {
            Ok(samples) if samples.len() == 1 => Some(samples[0].value),
            _ => None,
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.child.kill();
        cleanup::unregister_dir(self.dir.path());
    }
}

/// Every byte outside `[A-Za-z0-9_.~-]` as `%XX`.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'~' | b'-' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn prometheus_bin() -> PathBuf {
    crate::find_binary(
        "TESTKIT_PROMETHEUS",
        "prometheus",
        &["/usr/bin"],
        "`prometheus`",
    )
}
