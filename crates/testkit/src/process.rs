//! A child process with captured output.

use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::cleanup::Managed;

/// How long to wait, after the process exited, for its pipes to drain.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
struct Captured {
    text: String,
    /// Reader threads that have not hit EOF yet.
    open_streams: usize,
}

#[derive(Debug, Default)]
struct Capture {
    state: Mutex<Captured>,
    changed: Condvar,
}

impl Capture {
    fn lock(&self) -> MutexGuard<'_, Captured> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits up to `timeout` for more output or the end of a stream.
    fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, Captured>,
        timeout: Duration,
    ) -> MutexGuard<'a, Captured> {
        self.changed
            .wait_timeout(state, timeout)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

/// A child process (the relay binary, a benchmark tool, ...) whose stdout and
/// stderr are captured line by line into one shared buffer by reader threads
/// (and echoed to the test's stderr, prefixed with `[name]`, when
/// `TESTKIT_ECHO=1`). Its stdin is `/dev/null`.
///
/// Dropping it SIGKILLs and reaps the process.
pub struct Process {
    name: String,
    pid: u32,
    child: Mutex<Managed>,
    capture: Arc<Capture>,
}

impl fmt::Debug for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Process")
            .field("name", &self.name)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Process {
    /// Spawn `command` (stdin null, stdout/stderr captured, echoed when
    /// `TESTKIT_ECHO=1`). Panics if it cannot be spawned.
    pub fn spawn(name: &str, command: Command) -> Process {
        let echo = std::env::var("TESTKIT_ECHO").is_ok_and(|v| v == "1");
        Process::start(name, command, echo)
    }

    /// Like [`Process::spawn`], and always echoes the output to stderr,
    /// prefixed with `[name]` (for tools that show what the child does).
    pub fn spawn_echoing(name: &str, command: Command) -> Process {
        Process::start(name, command, true)
    }

    fn start(name: &str, mut command: Command, echo: bool) -> Process {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut managed = Managed::spawn(&mut command, None)
            .unwrap_or_else(|e| panic!("testkit: failed to spawn {name} ({command:?}): {e}"));
        let pid = managed.pid();
        let capture = Arc::new(Capture::default());
        let stdout = managed.take_stdout();
        let stderr = managed.take_stderr();
        capture.lock().open_streams = 2;
        for (stream, label) in [
            (
                stdout.map(|s| Box::new(s) as Box<dyn Read + Send>),
                "stdout",
            ),
            (
                stderr.map(|s| Box::new(s) as Box<dyn Read + Send>),
                "stderr",
            ),
        ] {
            let capture = Arc::clone(&capture);
            let prefix = name.to_string();
            let spawned = thread::Builder::new()
                .name(format!("testkit-{name}-{label}"))
                .spawn(move || {
                    if let Some(stream) = stream {
                        pump_lines(stream, &capture, echo.then_some(prefix.as_str()));
                    }
                    capture.lock().open_streams -= 1;
                    capture.changed.notify_all();
                });
            if let Err(e) = spawned {
                panic!("testkit: spawn output reader thread for {name}: {e}");
            }
        }
        Process {
            name: name.to_string(),
            pid,
            child: Mutex::new(managed),
            capture,
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's peak resident set size so far (`VmHWM` of `/proc/{pid}/status`), in
    /// bytes; `None` once it has exited.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line
            .trim_start_matches("VmHWM:")
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    }

    /// Everything captured so far (stdout and stderr interleaved by line).
    pub fn output(&self) -> String {
        self.capture.lock().text.clone()
    }

    /// Asserts that the output so far contains `needle` (the output is the failure's message).
    pub fn assert_output_contains(&self, needle: &str) {
        let output = self.output();
        assert!(
            output.contains(needle),
            "{needle:?} missing from:\n{output}"
        );
    }

    /// Block until the output contains `needle`; panics with the captured
    /// output on timeout, or as soon as the process closed its output (i.e.
    /// exited) without printing it.
    pub fn wait_for_output(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut checked = 0usize;
        let mut state = self.capture.lock();
        loop {
            let mut from = checked.min(state.text.len());
            while !state.text.is_char_boundary(from) {
                from -= 1;
            }
            if state.text[from..].contains(needle) {
                return;
            }
            checked = state.text.len().saturating_sub(needle.len());
            if state.open_streams == 0 {
                let output = state.text.clone();
                drop(state);
                // EOF usually means it exited; give the exit a moment to be reapable.
                let _ = self.lock_child().wait_timeout(Duration::from_millis(500));
                let status = self.status_text();
                panic!(
                    "testkit: {} closed its output ({status}) without printing {needle:?}; output:\n{output}",
                    self.name
                );
            }
            let now = Instant::now();
            if now >= deadline {
                let output = state.text.clone();
                drop(state);
                let status = self.status_text();
                panic!(
                    "testkit: timed out after {timeout:?} waiting for {} ({status}) to print {needle:?}; output:\n{output}",
                    self.name
                );
            }
            state = self.capture.wait(state, deadline - now);
        }
    }

    /// Send `signal` (e.g. `libc::SIGTERM`) to the process, unless it has
    /// already exited.
    pub fn signal(&self, signal: i32) {
        self.lock_child().signal(signal);
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        self.lock_child().kill();
        self.drain();
    }

    /// SIGTERM, then wait up to `timeout` for the exit; panics with the
    /// captured output if the process does not exit in time.
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit(timeout)
    }

    /// Wait up to `timeout` for the process to exit on its own; panics with
    /// the captured output on timeout. Once it returns, [`Process::output`]
    /// holds everything the process printed.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let status = self.lock_child().wait_timeout(timeout);
        match status {
            Some(status) => {
                self.drain();
                status
            }
            None => panic!(
                "testkit: {} (pid {}) did not exit within {timeout:?}; output:\n{}",
                self.name,
                self.pid,
                self.output()
            ),
        }
    }

    /// The exit status if the process has exited (reaps it), else `None`.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.lock_child().try_wait()
    }

    fn lock_child(&self) -> MutexGuard<'_, Managed> {
        self.child.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn status_text(&self) -> String {
        match self.lock_child().try_wait() {
            Some(status) => format!("exited with {status}"),
            None => "still running".to_string(),
        }
    }

    /// After exit: wait (briefly) until the reader threads have seen EOF, so
    /// the captured output is complete. A grandchild holding the pipes open
    /// only delays this by DRAIN_TIMEOUT.
    fn drain(&self) {
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut state = self.capture.lock();
        while state.open_streams > 0 {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            state = self.capture.wait(state, deadline - now);
        }
    }
}

fn pump_lines(stream: Box<dyn Read + Send>, capture: &Capture, echo: Option<&str>) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let mut text = String::from_utf8_lossy(&line).into_owned();
                if !text.ends_with('\n') {
                    text.push('\n');
                }
                if let Some(prefix) = echo {
                    eprint!("[{prefix}] {text}");
                }
                capture.lock().text.push_str(&text);
                capture.changed.notify_all();
            }
        }
    }
}

/// The last `n` lines of `text` (a server's or the relay's log, in a failure message).
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs `command` to its end and asserts that it succeeded (what it printed is the failure's
/// message); returns what it printed.
pub fn succeeds(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
