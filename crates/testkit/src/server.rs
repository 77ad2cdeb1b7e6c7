//! One server process (a postmaster, a nats-server, a cluster node): spawned with its output
//! appended to a log file, waited on until it is ready, stopped, killed and started again.
//! The one piece behind [`crate::Postgres`], [`crate::Nats`] and
//! [`crate::cluster::NatsCluster`].

use std::fs::{File, OpenOptions};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::cleanup::Managed;

/// Why a start attempt failed.
pub(crate) enum LaunchError {
    /// Somebody else holds a port; try other ports (first start) or wait (restart).
    PortInUse(String),
    Failed(String),
}

/// A server child and its log.
#[derive(Debug)]
pub(crate) struct Server {
    /// What messages call it: `postgres`, `nats-server`, `cluster node n1`.
    name: String,
    log_path: PathBuf,
    /// The signal that ends it at once but cleanly (SIGQUIT for postgres, which then removes
    /// its shared memory); `None`: SIGKILL.
    quick_stop: Option<i32>,
    child: Mutex<Option<Managed>>,
}

impl Server {
    /// A server that is not running yet, logging to `log_path` (created empty).
    pub(crate) fn new(
        name: impl Into<String>,
        log_path: PathBuf,
        quick_stop: Option<i32>,
    ) -> Server {
        File::create(&log_path)
            .unwrap_or_else(|e| panic!("testkit: create {}: {e}", log_path.display()));
        Server {
            name: name.into(),
            log_path,
            quick_stop,
            child: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Managed>> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The whole log (all starts).
    pub(crate) fn log(&self) -> String {
        crate::read_lossy(&self.log_path)
    }

    /// Whether the process is alive.
    pub(crate) fn is_running(&self) -> bool {
        self.lock().as_mut().is_some_and(Managed::is_running)
    }

    /// Pid of the (current) process.
    pub(crate) fn pid(&self) -> u32 {
        self.lock()
            .as_ref()
            .map(Managed::pid)
            .unwrap_or_else(|| panic!("testkit: {} was never started", self.name))
    }

    /// SIGKILL; returns once the process has exited.
    pub(crate) fn kill(&self) {
        if let Some(child) = self.lock().as_mut() {
            child.kill();
        }
    }

    /// Ends the process at once (its quick-stop signal, SIGKILL after `grace`); for drops and
    /// failed starts.
    pub(crate) fn stop_now(&self, grace: Duration) {
        if let Some(child) = self.lock().as_mut() {
            match self.quick_stop {
                Some(signal) => {
                    child.stop_with(signal, grace);
                }
                None => {
                    child.kill();
                }
            }
        }
    }

    /// Sends `signal` and waits up to `timeout` for the exit; if it does not come, kills the
    /// process and panics with the tail of the log, saying `what` was attempted.
    pub(crate) fn shut_down(&self, signal: i32, what: &str, timeout: Duration) {
        let mut guard = self.lock();
        let Some(child) = guard.as_mut() else {
            return;
        };
        child.signal(signal);
        if child.wait_timeout(timeout).is_none() {
            child.kill();
            drop(guard);
            panic!(
                "testkit: {} did not exit within {timeout:?} after {what}; killed it. log tail:\n{}",
                self.name,
                crate::process::last_lines(&self.log(), 40)
            );
        }
    }

    /// Spawns `command` (stdin null, stdout and stderr appended to the log; registered for
    /// cleanup); returns the log's length before the start, for [`Server::wait_ready`].
    pub(crate) fn spawn(&self, command: &mut Command) -> u64 {
        let offset = crate::file_len(&self.log_path);
        let log = OpenOptions::new()
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("testkit: open {}: {e}", self.log_path.display()));
        let log2 = log
            .try_clone()
            .unwrap_or_else(|e| panic!("testkit: duplicate the {} log handle: {e}", self.name));
        command.stdin(Stdio::null()).stdout(log).stderr(log2);
        let child = Managed::spawn(command, self.quick_stop)
            .unwrap_or_else(|e| panic!("testkit: spawn {} ({command:?}): {e}", self.name));
        *self.lock() = Some(child);
        offset
    }

    /// Waits up to `timeout` until `ready(log written since the start at log_offset)`.
    /// `Err(PortInUse)` when the process exited complaining that an address is in use,
    /// `Err(Failed)` when it exited otherwise or timed out (then it is stopped); `where_`
    /// (e.g. `on port 5432`) goes into the messages.
    pub(crate) fn wait_ready(
        &self,
        log_offset: u64,
        timeout: Duration,
        where_: &str,
        mut ready: impl FnMut(&str) -> bool,
    ) -> Result<(), LaunchError> {
        let deadline = Instant::now() + timeout;
        loop {
            let exited = self.lock().as_mut().and_then(Managed::try_wait);
            let log = crate::read_from(&self.log_path, log_offset);
            if let Some(status) = exited {
                let msg = format!(
                    "testkit: {} exited with {status} while starting {where_}; log:\n{}",
                    self.name,
                    crate::process::last_lines(&log, 40)
                );
                return Err(if log.to_lowercase().contains("address already in use") {
                    LaunchError::PortInUse(msg)
                } else {
                    LaunchError::Failed(msg)
                });
            }
            if ready(&log) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop_now(Duration::from_secs(5));
                return Err(LaunchError::Failed(format!(
                    "testkit: timed out after {timeout:?} waiting for {} {where_} to accept clients; log tail:\n{}",
                    self.name,
                    crate::process::last_lines(&log, 40)
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A first start: `attempt` picks fresh ports and launches; tried again (up to five times)
/// while another process holds a port. Panics with the failure otherwise.
pub(crate) fn start_on_free_ports(mut attempt: impl FnMut() -> Result<(), LaunchError>) {
    for attempts in 1.. {
        match attempt() {
            Ok(()) => return,
            Err(LaunchError::PortInUse(_)) if attempts < 5 => continue,
            Err(LaunchError::PortInUse(msg) | LaunchError::Failed(msg)) => panic!("{msg}"),
        }
    }
}

/// A restart on the same ports: `launch` is tried again for up to ten seconds while another
/// process (or the previous run's socket) still holds a port. Panics with the failure
/// otherwise.
pub(crate) fn start_again(mut launch: impl FnMut() -> Result<(), LaunchError>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match launch() {
            Ok(()) => return,
            Err(LaunchError::PortInUse(msg)) if Instant::now() >= deadline => panic!("{msg}"),
            Err(LaunchError::PortInUse(_)) => thread::sleep(Duration::from_millis(200)),
            Err(LaunchError::Failed(msg)) => panic!("{msg}"),
        }
    }
}

/// Whether 127.0.0.1:{port} accepts a TCP connection.
pub(crate) fn accepts(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}
