//! Servers kept in statics (never dropped) and leaked processes are killed,
//! and their directories removed, when the test binary exits — normally or
//! after a panic, or at `TESTKIT_DEADLINE_SECS` when a test hangs. The tests re-run this
//! binary as a child to observe that.

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

/// Runs only inside the child test binary: a test that hangs with a process running.
#[test]
fn hanging_child() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("hang") {
        return;
    }
    let sleeper = Process::spawn("sleep", {
        let mut c = Command::new("sleep");
        c.arg("1000");
        c
    });
    println!("CHILD {}", sleeper.pid());
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A test that hangs ends its process at `TESTKIT_DEADLINE_SECS`: the process fails, says
/// which test still holds a process, and that process is stopped.
#[test]
fn a_hung_test_ends_its_process_at_the_deadline_and_is_named() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let output = Command::new(std::env::current_exe().expect("current_exe"))
        .args(["--exact", "hanging_child", "--nocapture"])
        .env(CHILD_ENV, "hang")
        .env("TESTKIT_DEADLINE_SECS", "1")
        .output()
        .expect("run the child test binary");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert_eq!(output.status.code(), Some(101), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("ran past TESTKIT_DEADLINE_SECS=1")
            && stderr.contains("still run: hanging_child"),
        "{stderr}"
    );
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CHILD "))
        .unwrap_or_else(|| panic!("no CHILD line in:\n{stdout}"))
        .parse()
        .expect("pid");
    wait_until(
        "the hung test's sleeper to be gone",
        Duration::from_secs(5),
        || !alive(pid),
    );
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
            .env_remove("TESTKIT_DEADLINE_SECS")
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
