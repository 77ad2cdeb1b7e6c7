//! Process hygiene: every child the testkit spawns is registered here, and an
//! `atexit` handler kills whatever is still registered when the test process
//! exits (this covers servers kept in a `static OnceLock`, whose `Drop` never
//! runs). Temporary directories of such servers are removed too.
//!
//! A test process that runs past `TESTKIT_DEADLINE_SECS` (set by `tests/run` and `.ci/run`)
//! ends itself, naming the tests whose children are still running: a hung test fails its
//! suite within that deadline instead of holding CI until CI's own limit.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Entry {
    pid: i32,
    /// The test that spawned it (libtest names each test's thread after it).
    test: Option<String>,
    /// Signal to try first at exit (SIGQUIT for postgres, so it removes its
    /// shared memory); SIGKILL follows for anything still alive.
    gentle: Option<i32>,
}

static PIDS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: `atexit` only stores the function pointer; the handler is a
        // plain `extern "C" fn` that never unwinds.
        let rc = unsafe { libc::atexit(cleanup_at_exit) };
        assert_eq!(
            rc, 0,
            "testkit: libc::atexit failed to register the cleanup handler"
        );
        arm_deadline();
    });
}

/// `TESTKIT_DEADLINE_SECS` after the process's first child: the tests still holding children
/// are named and the process exits (its `atexit` handler stops them).
fn arm_deadline() {
    let Some(secs) = std::env::var("TESTKIT_DEADLINE_SECS")
        .ok()
        .and_then(|secs| secs.parse::<u64>().ok())
    else {
        return;
    };
    thread::Builder::new()
        .name("testkit-deadline".into())
        .spawn(move || {
            thread::sleep(Duration::from_secs(secs));
            let mut tests: Vec<String> = lock(&PIDS)
                .iter()
                .map(|e| e.test.clone().unwrap_or_else(|| "an unnamed thread".into()))
                .collect();
            tests.sort();
            tests.dedup();
            eprintln!(
                "testkit: this test process ran past TESTKIT_DEADLINE_SECS={secs}: a test hangs; the tests whose servers or processes still run: {}",
                tests.join(", ")
            );
            std::process::exit(101);
        })
        .expect("testkit: start the deadline's thread");
}

fn register_pid(pid: u32, gentle: Option<i32>) {
    install();
    lock(&PIDS).push(Entry {
        pid: pid as i32,
        test: thread::current().name().map(str::to_owned),
        gentle,
    });
}

fn unregister_pid(pid: u32) {
    lock(&PIDS).retain(|e| e.pid != pid as i32);
}

/// Remember a directory to delete at process exit (if its owner is never dropped).
pub(crate) fn register_dir(path: &Path) {
    install();
    lock(&DIRS).push(path.to_path_buf());
}

/// A fresh directory `{base}/{prefix}…` for `what`, registered for removal at exit; removed
/// when the handle drops (then [`unregister_dir`] it).
pub(crate) fn temp_dir(prefix: &str, base: &Path, what: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .unwrap_or_else(|e| panic!("testkit: create a temporary directory for {what}: {e}"));
    register_dir(dir.path());
    dir
}

pub(crate) fn unregister_dir(path: &Path) {
    lock(&DIRS).retain(|p| p != path);
}

/// Take a lock at exit without risking a deadlock against a thread that was
/// holding it when `exit` was called.
fn take_at_exit<T>(m: &Mutex<Vec<T>>) -> Vec<T> {
    let deadline = Instant::now() + Duration::from_millis(200);
    loop {
        match m.try_lock() {
            Ok(mut g) => return std::mem::take(&mut *g),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                return std::mem::take(&mut *p.into_inner())
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                if Instant::now() > deadline {
                    return Vec::new();
                }
                thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// Reap `pid` without blocking; true when it is gone (or not ours to wait for).
fn reaped(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: plain syscall on a pid we spawned; `status` is a valid out pointer.
    let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if rc == pid {
        return true;
    }
    if rc == -1 {
        // Not our child (or already reaped): fall back to an existence check.
        // SAFETY: signal 0 only checks for existence.
        return unsafe { libc::kill(pid, 0) } != 0;
    }
    false
}

extern "C" fn cleanup_at_exit() {
    let entries = take_at_exit(&PIDS);
    let mut alive: Vec<i32> = Vec::new();
    for e in &entries {
        let sig = e.gentle.unwrap_or(libc::SIGKILL);
        // SAFETY: sending a signal to a child pid we registered and never reaped.
        unsafe { libc::kill(e.pid, sig) };
        alive.push(e.pid);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !alive.is_empty() && Instant::now() < deadline {
        alive.retain(|&pid| !reaped(pid));
        if !alive.is_empty() {
            thread::sleep(Duration::from_millis(10));
        }
    }
    for &pid in &alive {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while !alive.is_empty() && Instant::now() < deadline {
        alive.retain(|&pid| !reaped(pid));
        if !alive.is_empty() {
            thread::sleep(Duration::from_millis(5));
        }
    }
    for dir in take_at_exit(&DIRS) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

pub(crate) fn send_signal(pid: u32, signal: i32) -> io::Result<()> {
    // SAFETY: plain syscall; callers only pass pids of children not yet reaped.
    let rc = unsafe { libc::kill(pid as i32, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A registered child process. Unregistered as soon as it has been reaped, so
/// a recycled pid is never signalled. Dropping it SIGKILLs and reaps.
#[derive(Debug)]
pub(crate) struct Managed {
    child: Child,
    status: Option<ExitStatus>,
}

impl Managed {
    pub(crate) fn spawn(command: &mut Command, gentle: Option<i32>) -> io::Result<Managed> {
        let child = command.spawn()?;
        register_pid(child.id(), gentle);
        Ok(Managed {
            child,
            status: None,
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.stdout.take()
    }

    pub(crate) fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.child.stderr.take()
    }

    pub(crate) fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.status = Some(status);
                    unregister_pid(self.child.id());
                }
                Ok(None) => {}
                Err(e) => panic!("testkit: waiting for pid {} failed: {e}", self.child.id()),
            }
        }
        self.status
    }

    pub(crate) fn is_running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// Signal the process if it has not exited yet (never signals a reaped pid).
    pub(crate) fn signal(&mut self, signal: i32) {
        if self.is_running() {
            // ESRCH is possible for a zombie that has not been reaped; ignore.
            let _ = send_signal(self.pid(), signal);
        }
    }

    pub(crate) fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL (if still running) and reap.
    pub(crate) fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.try_wait() {
            return status;
        }
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("testkit: reaping pid {} failed: {e}", self.child.id()));
        self.status = Some(status);
        unregister_pid(self.child.id());
        status
    }

    /// Send `signal`, wait up to `grace`, then SIGKILL; always reaps.
    pub(crate) fn stop_with(&mut self, signal: i32, grace: Duration) -> ExitStatus {
        self.signal(signal);
        match self.wait_timeout(grace) {
            Some(status) => status,
            None => self.kill(),
        }
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            unregister_pid(self.child.id());
        }
    }
}
