//! Servers kept in statics (never dropped) and leaked processes are killed,
//! and their directories removed, when the test binary exits — normally or
//! after a panic. The test re-runs this binary as a child to observe that.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use testkit::{shared, wait_until, Nats, Postgres, Process};

static PG: OnceLock<Postgres> = OnceLock::new();
static NATS: OnceLock<Nats> = OnceLock::new();

const CHILD_ENV: &str = "TESTKIT_CLEANUP_CHILD";

/// Runs only inside the child test binary.
#[test]
fn child_side() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let pg = shared(&PG, Postgres::start);
    let nats = shared(&NATS, Nats::start);
    let sleeper = Process::spawn("sleep", {
        let mut c = Command::new("sleep");
        c.arg("1000");
        c
    });
    let sleeper_pid = sleeper.pid();
    std::mem::forget(sleeper);
    println!(
        "CHILD {} {} {} {} {}",
        pg.pid(),
        nats.pid(),
        sleeper_pid,
        pg.data_dir().parent().expect("pg dir").display(),
        nats.store_dir().parent().expect("nats dir").display(),
    );
    assert!(mode != "panic", "deliberate panic with servers in statics");
}

fn alive(pid: u32) -> bool {
    // Zombies count as dead: only look at the state in /proc.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn servers_in_statics_are_cleaned_up_at_exit() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    for mode in ["ok", "panic"] {
        let output = Command::new(std::env::current_exe().expect("current_exe"))
            .args(["--exact", "child_side", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, mode)
            .output()
            .expect("run the child test binary");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            output.status.success(),
            mode == "ok",
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("CHILD ").map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("no CHILD line in:\n{stdout}"));
        let fields: Vec<&str> = line.split(' ').collect();
        let pids: Vec<u32> = fields[..3]
            .iter()
            .map(|p| p.parse().expect("pid"))
            .collect();
        for pid in pids {
            wait_until(
                &format!("pid {pid} to be gone ({mode})"),
                Duration::from_secs(5),
                || !alive(pid),
            );
        }
        for dir in &fields[3..] {
            assert!(!Path::new(dir).exists(), "{dir} left behind ({mode})");
        }
    }
}
