//! A throwaway nats-server with JetStream.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::cleanup::{self, Managed};

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
    log_path: PathBuf,
    child: Mutex<Option<Managed>>,
    // Declared last: removed after the server is gone.
    dir: tempfile::TempDir,
}

enum LaunchError {
    PortInUse(String),
    Failed(String),
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
        let bin = nats_bin();
        let dir = tempfile::Builder::new()
            .prefix("testkit-nats-")
            .tempdir_in(std::env::temp_dir())
            .expect("testkit: create a temporary directory for nats-server");
        cleanup::register_dir(dir.path());
        let store_dir = dir.path().join("store");
        let log_path = dir.path().join("nats-server.log");
        File::create(&log_path)
            .unwrap_or_else(|e| panic!("testkit: create {}: {e}", log_path.display()));
        let mut nats = Nats {
            bin,
            port: 0,
            monitor_port: 0,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            store_dir,
            log_path,
            child: Mutex::new(None),
            dir,
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            nats.port = crate::free_port();
            nats.monitor_port = crate::free_port();
            match nats.launch() {
                Ok(()) => return nats,
                Err(LaunchError::PortInUse(_)) if attempts < 5 => continue,
                Err(LaunchError::PortInUse(msg) | LaunchError::Failed(msg)) => panic!("{msg}"),
            }
        }
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
        self.shut_down(libc::SIGTERM, "SIGTERM");
    }

    /// SIGKILL; returns once the server has exited.
    pub fn kill(&mut self) {
        if let Some(child) = self.lock_child().as_mut() {
            child.kill();
        }
    }

    /// Start the server again with the same ports and store directory;
    /// returns once it accepts clients and JetStream is ready. Panics if it
    /// is still running.
    pub fn start_again(&mut self) {
        assert!(
            !self.is_running(),
            "testkit: Nats::start_again called while nats-server is running"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.launch() {
                Ok(()) => return,
                Err(LaunchError::PortInUse(msg)) if Instant::now() >= deadline => panic!("{msg}"),
                Err(LaunchError::PortInUse(_)) => thread::sleep(Duration::from_millis(200)),
                Err(LaunchError::Failed(msg)) => panic!("{msg}"),
            }
        }
    }

    /// Whether the nats-server process is alive.
    pub fn is_running(&self) -> bool {
        self.lock_child().as_mut().is_some_and(Managed::is_running)
    }

    /// Pid of the (current) nats-server process.
    pub fn pid(&self) -> u32 {
        self.lock_child()
            .as_ref()
            .map(Managed::pid)
            .expect("testkit: nats-server was never started")
    }

    /// Server log (all starts).
    pub fn log(&self) -> String {
        crate::read_lossy(&self.log_path)
    }

    /// JetStream store directory (`-sd`).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    fn lock_child(&self) -> MutexGuard<'_, Option<Managed>> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shut_down(&mut self, signal: i32, what: &str) {
        let log_path = self.log_path.clone();
        crate::stop_child(
            &mut self.lock_child(),
            signal,
            "nats-server",
            what,
            STOP_TIMEOUT,
            || crate::read_lossy(&log_path),
        );
    }

    fn launch(&mut self) -> Result<(), LaunchError> {
        let log_offset = crate::file_len(&self.log_path);
        let log = OpenOptions::new()
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("testkit: open {}: {e}", self.log_path.display()));
        let log2 = log
            .try_clone()
            .expect("testkit: duplicate the nats-server log file handle");
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
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = Managed::spawn(&mut command, None)
            .unwrap_or_else(|e| panic!("testkit: spawn {}: {e}", self.bin.display()));
        *self.lock_child() = Some(child);

        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let exited = self.lock_child().as_mut().and_then(Managed::try_wait);
            if let Some(status) = exited {
                let log = crate::read_from(&self.log_path, log_offset);
                let msg = format!(
                    "testkit: nats-server exited with {status} while starting on port {}; log:\n{}",
                    self.port,
                    crate::tail(&log, 40)
                );
                return Err(if log.contains("address already in use") {
                    LaunchError::PortInUse(msg)
                } else {
                    LaunchError::Failed(msg)
                });
            }
            // "Server is ready" in *our* log proves our process bound the
            // ports (not some other server that grabbed them).
            if crate::read_from(&self.log_path, log_offset).contains("Server is ready")
                && TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && matches!(
                    http_get(self.monitor_port, "/healthz?js-enabled-only=true"),
                    Ok((200, _))
                )
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                if let Some(child) = self.lock_child().as_mut() {
                    child.kill();
                }
                return Err(LaunchError::Failed(format!(
                    "testkit: timed out after {START_TIMEOUT:?} waiting for nats-server (port {}, monitor {}) \
                     to accept clients with JetStream ready; log tail:\n{}",
                    self.port,
                    self.monitor_port,
                    crate::tail(&crate::read_from(&self.log_path, log_offset), 40)
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        if let Some(child) = self.lock_child().as_mut() {
            child.kill();
        }
        cleanup::unregister_dir(self.dir.path());
    }
}

pub(crate) fn nats_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("TESTKIT_NATS_SERVER") {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "testkit: TESTKIT_NATS_SERVER={} does not exist",
            bin.display()
        );
        return bin;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("nats-server"))
        .find(|bin| bin.is_file())
        .unwrap_or_else(|| {
            panic!(
                "testkit: `nats-server` not found on PATH: install it with `apt-get install nats-server` \
                 (or point TESTKIT_NATS_SERVER at the binary)"
            )
        })
}

/// Minimal HTTP/1.0 GET against 127.0.0.1:{port}.
pub(crate) fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
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
