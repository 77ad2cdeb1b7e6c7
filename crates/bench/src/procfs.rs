//! What `/proc` says about a process: CPU time (`utime + stime`, and the reaped children's
//! `cutime + cstime`) and peak resident memory (`VmHWM`).
//!
//! CPU times are in clock ticks (`sysconf(_SC_CLK_TCK)`, 100 per second on Linux), so a
//! figure is exact to 10 ms: divided by the events of a run it is precise enough for runs
//! of a second and more.

use anyhow::{anyhow, Context as _, Result};

/// Seconds per clock tick.
pub fn seconds_per_tick() -> f64 {
    #[allow(unsafe_code)]
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        1.0 / ticks as f64
    } else {
        0.01
    }
}

/// The fields of `/proc/<pid>/stat` after the command name, from `state` (field 3) on.
fn stat_fields(pid: u32) -> Result<Vec<u64>> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    // The command name is in parentheses and may contain spaces: split after the last ')'.
    let rest = text
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow!("{path}: no ')' in {text:?}"))?;
    Ok(rest
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(0))
        .collect())
}

/// Field `n` (1-based, as in proc(5)) from the fields returned by [`stat_fields`].
fn field(fields: &[u64], n: usize) -> Result<u64> {
    fields
        .get(n - 3)
        .copied()
        .ok_or_else(|| anyhow!("/proc/<pid>/stat has no field {n}"))
}

/// CPU seconds the process itself used so far (`utime + stime`).
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let fields = stat_fields(pid)?;
    let ticks = field(&fields, 14)? + field(&fields, 15)?;
    Ok(ticks as f64 * seconds_per_tick())
}

/// CPU seconds of the process's children that it has waited for (`cutime + cstime`).
///
/// The postmaster reaps its backends, so a walsender's whole CPU time lands here once it
/// exited; our own process reaps `pg_recvlogical`.
pub fn reaped_children_cpu_seconds(pid: u32) -> Result<f64> {
    let fields = stat_fields(pid)?;
    let ticks = field(&fields, 16)? + field(&fields, 17)?;
    Ok(ticks as f64 * seconds_per_tick())
}

/// Peak resident set size (`VmHWM`) in MiB.
pub fn peak_rss_mib(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    let line = text
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .ok_or_else(|| anyhow!("{path} has no VmHWM line"))?;
    let kib: f64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("{path}: VmHWM {line:?}"))?;
    Ok(kib / 1024.0)
}

/// Context switches of all the process's live threads so far (voluntary and involuntary,
/// summed over `/proc/<pid>/task/*/status`): a thread that parks and is woken again counts.
pub fn context_switches(pid: u32) -> Result<u64> {
    let mut total = 0;
    let tasks = format!("/proc/{pid}/task");
    for task in std::fs::read_dir(&tasks).with_context(|| format!("read {tasks}"))? {
        let status = task?.path().join("status");
        // A thread may exit between listing and reading.
        let Ok(text) = std::fs::read_to_string(&status) else {
            continue;
        };
        for line in text.lines() {
            if let Some(rest) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += rest.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(total)
}

/// Read-type and write-type system calls the process made so far (`syscr + syscw` of
/// `/proc/<pid>/io`: read, write and their vector forms; a socket's recv and send do not
/// count).
pub fn io_syscalls(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/io");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    Ok(text
        .lines()
        .filter_map(|line| {
            line.strip_prefix("syscr:")
                .or_else(|| line.strip_prefix("syscw:"))
        })
        .map(|v| v.trim().parse::<u64>().unwrap_or(0))
        .sum())
}

/// Seconds of CPU time the hypervisor has taken from this VM so far, all CPUs together
/// (the `steal` field of `/proc/stat`'s `cpu` line, in clock ticks).
pub fn stolen_seconds() -> Result<f64> {
    let text = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let ticks = text
        .lines()
        .find_map(|line| line.strip_prefix("cpu "))
        .and_then(|fields| fields.split_whitespace().nth(7))
        .and_then(|steal| steal.parse::<u64>().ok())
        .unwrap_or(0);
    Ok(ticks as f64 * seconds_per_tick())
}

/// Seconds the process's live threads have spent runnable but waiting for a CPU so far
/// (the second field of `/proc/<pid>/task/*/schedstat`, summed): time the machine, not
/// the process, made it wait. Needs `CONFIG_SCHEDSTATS`-style accounting, which every
/// kernel with `/proc/<pid>/schedstat` keeps; 0 if the file is missing.
pub fn run_queue_wait_seconds(pid: u32) -> Result<f64> {
    let mut nanos: u64 = 0;
    let tasks = format!("/proc/{pid}/task");
    for task in std::fs::read_dir(&tasks).with_context(|| format!("read {tasks}"))? {
        // A thread may exit between listing and reading.
        let Ok(text) = std::fs::read_to_string(task?.path().join("schedstat")) else {
            continue;
        };
        nanos += text
            .split_whitespace()
            .nth(1)
            .and_then(|waited| waited.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(nanos as f64 / 1e9)
}
