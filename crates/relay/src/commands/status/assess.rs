//! Judging what was read ([`assess`]): missing and lost objects, WAL retention and lag,
//! the lease (STA2).

use super::*;

/// Judges what was read: missing and lost objects, WAL retention and lag, the lease.
pub fn assess(status: &Status, config: &Config) -> Vec<Finding> {
    let mut findings = Vec::new();
    if let Some(slot) = &status.slot {
        findings.extend(assess_slot(slot, config));
    }
    if let Some(publication) = &status.publication {
        if !publication.exists {
            findings.push(Finding::new(
                Level::Broken,
                format!(
                "publication {} does not exist: nothing is relayed; create it with outbox-relay \
                 init, or as the table's owner with sql/publication.sql",
                publication.name
            ),
            ));
        }
    }
    let slot = status.slot.as_ref().and_then(|s| s.state.as_ref());
    if let Some(lease) = &status.lease {
        findings.extend(assess_lease(lease, slot, config));
    }
    if let Some(stream) = &status.stream {
        if !stream.exists {
            findings.push(Finding::new(
                Level::Broken,
                format!(
                "stream {} does not exist: nothing is relayed; create it with outbox-relay init \
                 (if the relay ran before, the stream was deleted with the events in it)",
                stream.name
            ),
            ));
        }
    }
    findings
}

/// The slot: missing, lost or at risk (its `wal_status`), or further behind than
/// `--max-lag-bytes`.
pub(super) fn assess_slot(slot: &Slot, config: &Config) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut say = |level, message: String| findings.push(Finding::new(level, message));
    let slot_name = &config.slot;
    match &slot.state {
        None => say(
            Level::Broken,
            format!(
                "replication slot {slot_name} does not exist: nothing is relayed, and events \
             committed while it is missing never will be; create it with outbox-relay init \
             (if the stream already holds events, the slot was dropped: events committed \
             since are missing from the stream)"
            ),
        ),
        Some(state) => {
            match state.wal_status.as_deref() {
                Some("lost") => say(
                    Level::Broken,
                    format!(
                        "replication slot {slot_name} is lost (wal_status lost): Postgres \
                     removed WAL it still needed (max_slot_wal_keep_size), so events \
                     committed after its confirmed position {} are missing from the stream; \
                     drop it and create it again with outbox-relay init, then recover the \
                     missing events from the table (docs/operations.md)",
                        state.confirmed_flush_lsn.as_deref().unwrap_or("?")
                    ),
                ),
                Some("unreserved") => say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} retains WAL beyond max_slot_wal_keep_size \
                     (wal_status unreserved): the next checkpoint may remove it and lose the \
                     slot; the relay must catch up now"
                    ),
                ),
                Some("extended") => say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} retains more WAL than max_wal_size \
                     (wal_status extended): the relay is behind"
                    ),
                ),
                _ => {}
            }
            if let Some(lag) = state.lag_bytes.filter(|&lag| lag > config.max_lag_bytes) {
                say(
                    Level::Lagging,
                    format!(
                        "replication slot {slot_name} is {} behind the server's WAL, more than \
                     {} ({}): the relay is behind or stopped, and Postgres keeps that WAL",
                        format_size(lag),
                        format_size(config.max_lag_bytes),
                        opt::MAX_LAG_BYTES.env
                    ),
                );
            }
        }
    }
    findings
}

/// The lease against the slot: a program reading the slot without the lease, no relay,
/// or a relay holding the lease without streaming.
pub(super) fn assess_lease(
    lease: &LeaseState,
    slot: Option<&SlotState>,
    config: &Config,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut say = |level, message: String| findings.push(Finding::new(level, message));
    let slot_name = &config.slot;
    match (&lease.holder, slot) {
        // A retrying relay first: between its failed session and the next attempt the slot
        // may still be active for a moment, its last walsender ending (and a foreign one is
        // ended by the next attempt, lease LS2).
        (None, _) if !lease.retrying.is_empty() => {
            findings.extend(assess_retrying(lease, slot_name))
        }
        (None, Some(slot)) if slot.active => say(
            Level::Broken,
            format!(
                "replication slot {slot_name} is read by {} but no relay holds the lease: \
             another program consumes the slot, and what it confirms never reaches the \
             stream; stop it (SELECT pg_terminate_backend({})) and run outbox-relay",
                describe_backend(slot.walsender.as_ref(), slot.active_pid),
                slot.active_pid
                    .map_or("<pid>".into(), |pid| pid.to_string())
            ),
        ),
        (None, _) => say(
            Level::Lagging,
            format!(
                "no relay holds the lease for slot {slot_name}: no relay is running, so nothing \
             is relayed; start outbox-relay run"
            ),
        ),
        (Some(holder), Some(slot)) if !slot.active => say(
            Level::Lagging,
            format!(
                "the relay holding the lease ({}) is not streaming: slot {slot_name} is \
             inactive (between sessions after a failure? its log says why)",
                describe_backend(Some(holder), Some(holder.pid))
            ),
        ),
        _ => {}
    }
    findings
}

/// A relay retrying after a failed session (lease LS3): running, with its next attempt and
/// last error, and the JetStream limit that error names.
fn assess_retrying(lease: &LeaseState, slot_name: &str) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut say = |level, message: String| findings.push(Finding::new(level, message));
    for relay in &lease.retrying {
        say(
            Level::Lagging,
            format!(
                "no relay holds the lease for slot {slot_name}: a relay (pid {}) is \
                         running and retrying after a failed session{}; {}",
                relay.pid,
                relay
                    .since
                    .as_ref()
                    .map_or(String::new(), |since| format!(", waiting since {since}")),
                relay
                    .note
                    .as_deref()
                    .unwrap_or("its log says why (this role may not read its session's statement)")
            ),
        );
        if let Some(cause) = relay.note.as_deref().and_then(jetstream_limit) {
            say(Level::Broken, cause);
        }
    }
    findings
}

/// The JetStream limit a retrying relay's last error names, as a finding with its fix: the
/// server or account out of storage (JetStream's "insufficient resources", error 10047).
/// A full discard-new stream is a finding of the stream's own.
fn jetstream_limit(note: &str) -> Option<String> {
    let lower = note.to_lowercase();
    (lower.contains("insufficient resources") || lower.contains("10047")).then(|| {
        "JetStream has no storage left for the stream (insufficient resources: the server's \
         max_file_store or max_memory_store, or the account's max_storage, is used up): nothing \
         more is stored until room is made; raise the limit or free storage, and the relay goes \
         on by itself"
            .to_owned()
    })
}

/// `pid 4242 (outbox-relay, 10.0.0.3:50412)`.
pub(super) fn describe_backend(backend: Option<&Backend>, pid: Option<i32>) -> String {
    let Some(pid) = backend.map(|b| b.pid).or(pid) else {
        return "an unknown backend".into();
    };
    let mut details = Vec::new();
    if let Some(backend) = backend {
        details.extend(backend.application_name.clone());
        match (&backend.client_addr, backend.client_port) {
            (Some(addr), Some(port)) if addr.contains(':') => {
                details.push(format!("[{addr}]:{port}"))
            }
            (Some(addr), Some(port)) => details.push(format!("{addr}:{port}")),
            (Some(addr), None) => details.push(addr.clone()),
            (None, _) if backend.backend_start.is_some() => details.push("local socket".into()),
            (None, _) => {}
        }
        if let Some(start) = &backend.backend_start {
            details.push(format!("since {start}"));
        }
    }
    if details.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid} ({})", details.join(", "))
    }
}
