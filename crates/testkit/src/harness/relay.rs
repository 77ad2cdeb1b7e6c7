//! A relay process that is killed and started again, keeping the output of every run.

use std::time::{Duration, Instant};

use super::case::Case;
use super::logs::{last_lines, SESSION_ENDED, STREAMING};
use crate::Process;

/// `outbox-relay run` for a case, started, SIGKILLed and started again as a test likes; its
/// output over all runs is kept.
#[derive(Debug)]
pub struct Relay {
    case: Case,
    current: Option<Process>,
    starts: usize,
    log: String,
}

impl Relay {
    /// Not started yet.
    pub fn new(case: Case) -> Relay {
        Relay {
            case,
            current: None,
            starts: 0,
            log: String::new(),
        }
    }

    /// Spawns the next run (`relay-{name}#{n}`); panics if one is running.
    pub fn start(&mut self) {
        assert!(self.current.is_none(), "the relay is running already");
        self.starts += 1;
        let name = format!("relay-{}#{}", self.case.name, self.starts);
        self.current = Some(Process::spawn(&name, self.case.relay_command("run")));
    }

    /// How many runs were started.
    pub fn starts(&self) -> usize {
        self.starts
    }

    /// SIGKILLs the current run (needs a multi-threaded tokio runtime: it blocks while the
    /// process is reaped).
    pub fn kill(&mut self) {
        if let Some(mut process) = self.current.take() {
            tokio::task::block_in_place(|| process.kill());
            self.log.push_str(&format!(
                "===== relay start #{} (SIGKILLed) =====\n",
                self.starts
            ));
            self.log.push_str(&process.output());
        }
    }

    /// The output of every run so far, each after a `===== relay start #n … =====` line.
    pub fn output(&self) -> String {
        let mut all = self.log.clone();
        if let Some(process) = &self.current {
            all.push_str(&format!(
                "===== relay start #{} (running) =====\n",
                self.starts
            ));
            all.push_str(&process.output());
        }
        all
    }

    /// Panics (with the tail of its output) if the current run exited on its own.
    pub fn assert_alive(&mut self) {
        if let Some(process) = self.current.as_mut() {
            if let Some(status) = process.try_status() {
                panic!(
                    "the relay exited on its own ({status}); its output ends:\n{}",
                    last_lines(&self.output(), 60)
                );
            }
        }
    }

    /// Whether the current run's latest session is streaming: it announced itself, and no
    /// session ended since.
    pub fn streaming(&self) -> bool {
        self.current.as_ref().is_some_and(|process| {
            let output = process.output();
            output.rfind(STREAMING) > output.rfind(SESSION_ENDED)
        })
    }

    /// Waits until [`Relay::streaming`]; panics after `timeout` or if the relay exits.
    pub async fn wait_streaming(&mut self, timeout: Duration) {
        let start = Instant::now();
        while !self.streaming() {
            self.assert_alive();
            assert!(
                start.elapsed() < timeout,
                "the relay did not start streaming within {timeout:?}; output ends:\n{}",
                last_lines(&self.output(), 60)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
