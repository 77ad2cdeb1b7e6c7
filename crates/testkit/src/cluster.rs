//! A three-node JetStream cluster of real `nats-server` processes on loopback.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::cleanup;
use crate::nats::{http_get, nats_bin};
use crate::server::{self, LaunchError, Server};

const NODES: usize = 3;
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a started (or restarted) cluster may take to agree on a meta leader and
/// report healthy (a restarted node: caught up with its streams).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Three `nats-server -js` processes with routes to each other and JetStream clustering
/// (cluster name `testkit`, server names `n0`, `n1`, `n2`), each on free loopback ports for
/// clients, routes and HTTP monitoring and with its own store directory.
///
/// Every process is registered with the testkit's cleanup registry: dropping the cluster
/// SIGKILLs all nodes and removes the directory, and whatever is still running when the test
/// process exits is killed by the `atexit` handler.
pub struct NatsCluster {
    bin: PathBuf,
    cluster_name: String,
    nodes: Vec<Node>,
    // Declared last: removed after the servers are gone.
    dir: tempfile::TempDir,
}

struct Node {
    name: String,
    port: u16,
    route_port: u16,
    monitor_port: u16,
    store_dir: PathBuf,
    server: Server,
}

impl Node {
    fn is_running(&self) -> bool {
        self.server.is_running()
    }
}

impl fmt::Debug for NatsCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| {
                format!(
                    "{} (client {}, route {}, monitor {}, {})",
                    n.name,
                    n.port,
                    n.route_port,
                    n.monitor_port,
                    if n.is_running() { "running" } else { "down" }
                )
            })
            .collect();
        f.debug_struct("NatsCluster")
            .field("cluster_name", &self.cluster_name)
            .field("nodes", &nodes)
            .finish_non_exhaustive()
    }
}

impl NatsCluster {
    /// Starts the three nodes and returns once every node accepts clients, all agree on a
    /// JetStream meta leader, and every node reports healthy.
    pub fn start() -> NatsCluster {
        let bin = nats_bin();
        let dir = cleanup::temp_dir(
            "testkit-nats-cluster-",
            &std::env::temp_dir(),
            "the nats-server cluster",
        );
        let nodes = (0..NODES)
            .map(|i| {
                let name = format!("n{i}");
                let log_path = dir.path().join(format!("{name}.log"));
                Node {
                    store_dir: dir.path().join(&name),
                    server: Server::new(format!("cluster node {name}"), log_path, None),
                    name,
                    port: 0,
                    route_port: 0,
                    monitor_port: 0,
                }
            })
            .collect();
        let mut cluster = NatsCluster {
            bin,
            cluster_name: "testkit".to_string(),
            nodes,
            dir,
        };
        server::start_on_free_ports(|| {
            for node in &mut cluster.nodes {
                node.port = crate::free_port();
                node.route_port = crate::free_port();
                node.monitor_port = crate::free_port();
            }
            // All nodes first: each waits for its routes to the others.
            let offsets: Vec<u64> = (0..NODES).map(|i| cluster.spawn(i)).collect();
            let accepting = offsets
                .iter()
                .enumerate()
                .try_for_each(|(i, &offset)| cluster.wait_accepting(i, offset));
            if accepting.is_err() {
                cluster.nodes.iter().for_each(|node| node.server.kill());
            }
            accepting
        });
        cluster.wait_ready(&[0, 1, 2]);
        cluster
    }

    /// The client URLs of all nodes, comma-separated (`nats://127.0.0.1:a,nats://…`): what
    /// async-nats and the relay's `NATS_URL` accept as a server list.
    pub fn urls(&self) -> String {
        (0..NODES)
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// The server names, by node index (`n0`, `n1`, `n2`).
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// The index of the node called `name`.
    pub fn node_index_by_name(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// HTTP monitoring port of node `i`.
    pub fn monitor_port(&self, i: usize) -> u16 {
        self.nodes[i].monitor_port
    }

    /// Plain HTTP GET of `path` on node `i`'s monitoring port: `(status, body)`.
    pub fn monitor_get(&self, i: usize, path: &str) -> Result<(u16, String), String> {
        http_get(self.nodes[i].monitor_port, path)
    }

    /// Whether node `i`'s process is alive.
    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].is_running()
    }

    /// Pid of node `i`'s (current) process.
    pub fn pid(&self, i: usize) -> u32 {
        self.nodes[i].server.pid()
    }

    /// Node `i`'s log (all starts).
    pub fn log(&self, i: usize) -> String {
        self.nodes[i].server.log()
    }

    /// Node `i`'s store directory (`-sd`).
    pub fn store_dir(&self, i: usize) -> &Path {
        &self.nodes[i].store_dir
    }

    /// Puts node `i` into lame-duck mode (SIGUSR2, what `nats-server --signal ldm=<pid>`
    /// sends): it stops accepting clients, tells its clients and routes (`INFO` with
    /// `"ldm": true`), closes its clients after its grace period (10 s) and exits after its
    /// lame-duck duration (2 min).
    pub fn lame_duck(&self, i: usize) {
        let pid = libc::pid_t::try_from(self.pid(i)).expect("a pid fits pid_t");
        // SAFETY: kill(2) on the node's own process id; no memory is involved.
        let sent = unsafe { libc::kill(pid, libc::SIGUSR2) };
        assert_eq!(
            sent, 0,
            "testkit: cannot signal node {i} ({pid}) into lame-duck mode"
        );
    }

    /// SIGKILL node `i`; returns once it has exited.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].server.kill();
    }

    /// Starts node `i` again with the same ports and store directory; returns once it
    /// accepts clients, knows the meta leader and reports healthy (`/healthz`: its streams
    /// have caught up). Panics if it is still running.
    pub fn start_again(&mut self, i: usize) {
        assert!(
            !self.is_running(i),
            "testkit: NatsCluster::start_again({i}) called while the node is running"
        );
        server::start_again(|| {
            let offset = self.spawn(i);
            self.wait_accepting(i, offset)
        });
        self.wait_ready(&[i]);
    }

    /// The JetStream meta leader as the running nodes see it, if they agree on one.
    pub fn meta_leader(&self) -> Option<String> {
        let mut seen: Option<String> = None;
        for i in (0..NODES).filter(|&i| self.is_running(i)) {
            let leader = self.jsz(i, "/jsz").and_then(|jsz| {
                jsz.get("meta_cluster")?
                    .get("leader")?
                    .as_str()
                    .map(str::to_owned)
            })?;
            if leader.is_empty() || seen.as_ref().is_some_and(|s| *s != leader) {
                return None;
            }
            seen = Some(leader);
        }
        seen
    }

    /// The name of the node leading `stream` (in the global account): a running node whose
    /// own monitoring (`/jsz?accounts=true&streams=true`) names itself the stream's leader.
    /// `None` while no running node does (e.g. during an election).
    pub fn stream_leader(&self, stream: &str) -> Option<String> {
        (0..NODES)
            .filter(|&i| self.is_running(i))
            .find(|&i| {
                self.stream_leader_seen_by(i, stream).as_deref() == Some(&self.nodes[i].name)
            })
            .map(|i| self.nodes[i].name.clone())
    }

    /// The leader of `stream` as node `i` reports it (its view may be stale).
    pub fn stream_leader_seen_by(&self, i: usize, stream: &str) -> Option<String> {
        let jsz = self.jsz(i, "/jsz?accounts=true&streams=true")?;
        let accounts = jsz.get("account_details")?.as_array()?;
        accounts
            .iter()
            .filter_map(|account| account.get("stream_detail")?.as_array())
            .flatten()
            .find(|detail| detail.get("name").and_then(Json::as_str) == Some(stream))
            .and_then(|detail| detail.get("cluster")?.get("leader")?.as_str())
            .filter(|leader| !leader.is_empty())
            .map(str::to_owned)
    }

    fn jsz(&self, i: usize, path: &str) -> Option<Json> {
        match self.monitor_get(i, path) {
            Ok((200, body)) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    }

    /// Spawns node `i`; returns its log's length before the start.
    fn spawn(&self, i: usize) -> u64 {
        let node = &self.nodes[i];
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, other)| format!("nats://127.0.0.1:{}", other.route_port))
            .collect();
        let mut command = Command::new(&self.bin);
        command
            .arg("-js")
            .arg("-sd")
            .arg(&node.store_dir)
            .args(["-n", &node.name])
            .args(["--cluster_name", &self.cluster_name])
            .arg("--cluster")
            .arg(format!("nats://127.0.0.1:{}", node.route_port))
            .arg("--routes")
            .arg(routes.join(","))
            .args(["-a", "127.0.0.1"])
            .arg("-p")
            .arg(node.port.to_string())
            .arg("-m")
            .arg(node.monitor_port.to_string())
            .current_dir(self.dir.path());
        node.server.spawn(&mut command)
    }

    /// Waits until node `i` (started with its log at `log_offset`) accepts clients.
    fn wait_accepting(&self, i: usize, log_offset: u64) -> Result<(), LaunchError> {
        let node = &self.nodes[i];
        let where_ = format!(
            "(client {}, route {}, monitor {})",
            node.port, node.route_port, node.monitor_port
        );
        node.server
            .wait_ready(log_offset, START_TIMEOUT, &where_, |log| {
                // "Server is ready" in *our* log proves our process bound the ports.
                log.contains("Server is ready") && server::accepts(node.port)
            })
    }

    /// Waits until the running nodes agree on a meta leader and each of `nodes` reports
    /// healthy.
    fn wait_ready(&self, nodes: &[usize]) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let leader = self.meta_leader();
            let healthy = nodes
                .iter()
                .all(|&i| matches!(self.monitor_get(i, "/healthz"), Ok((200, _))));
            if leader.is_some() && healthy {
                return;
            }
            if Instant::now() >= deadline {
                let logs: Vec<String> = nodes
                    .iter()
                    .map(|&i| {
                        format!(
                            "--- {} /healthz: {:?}; log tail:\n{}",
                            self.nodes[i].name,
                            self.monitor_get(i, "/healthz"),
                            crate::process::last_lines(&self.log(i), 20)
                        )
                    })
                    .collect();
                panic!(
                    "testkit: timed out after {READY_TIMEOUT:?} waiting for the cluster to elect a JetStream meta leader \
                     (seen: {leader:?}) and nodes {nodes:?} to report healthy\n{}",
                    logs.join("\n")
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        self.nodes.iter().for_each(|node| node.server.kill());
        cleanup::unregister_dir(self.dir.path());
    }
}

/// The monitoring endpoints' JSON.
type Json = serde_json::Value;

#[cfg(test)]
mod tests {
    use super::Json;

    #[test]
    fn reads_the_stream_leader_out_of_jsz() {
        let body = r#"{"meta_cluster":{"name":"C","leader":"n2","cluster_size":3},
            "account_details":[{"name":"$G","reserved_memory":18446744073709551615,
            "stream_detail":[{"name":"S","cluster":{"name":"C","leader":"n1","replicas":[{"name":"n0","current":true,"lag":-1.5e3}]},
            "config":{"subjects":["p.\u003e"]}}]}]}"#;
        let jsz: Json = serde_json::from_str(body).expect("valid JSON");
        let meta = jsz.get("meta_cluster").and_then(|m| m.get("leader"));
        assert_eq!(meta.and_then(Json::as_str), Some("n2"));
        let detail = &jsz
            .get("account_details")
            .and_then(Json::as_array)
            .expect("accounts")[0]
            .get("stream_detail")
            .and_then(Json::as_array)
            .expect("streams")[0];
        let leader = detail.get("cluster").and_then(|c| c.get("leader"));
        assert_eq!(leader.and_then(Json::as_str), Some("n1"));
        let subjects = detail
            .get("config")
            .and_then(|c| c.get("subjects"))
            .and_then(Json::as_array)
            .expect("subjects");
        assert_eq!(subjects[0].as_str(), Some("p.>"));
    }
}
