//! Drawing the table for people ([`render`]), a function of the [`Status`] alone (STA4).

use super::*;

/// The table for people (STA4: a function of `status` alone).
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let headline = match status.health {
        Health::Healthy => "healthy".to_owned(),
        other => format!(
            "{} (exit {})",
            format!("{other:?}").to_uppercase(),
            other.exit_code()
        ),
    };
    let _ = writeln!(out, "outbox-relay status: {headline}");
    for finding in &status.findings {
        let level = format!("{:?}", finding.level).to_lowercase();
        let _ = writeln!(out, "  {level}: {}", finding.message);
    }
    out.push('\n');
    let mut rows: Vec<(&str, String)> = Vec::new();
    rows.push(("postgres", status.postgres.clone()));
    rows.push(("table", status.table.clone()));
    render_slot(&mut rows, status.slot.as_ref());
    render_publication(&mut rows, status.publication.as_ref());
    rows.push((
        "lease",
        match &status.lease {
            None => "unknown".into(),
            Some(LeaseState {
                holder: None,
                retrying,
                ..
            }) if !retrying.is_empty() => {
                let pids: Vec<String> = retrying.iter().map(|r| format!("pid {}", r.pid)).collect();
                format!("held by no relay; retrying: {}", pids.join(", "))
            }
            Some(LeaseState { holder: None, .. }) => "held by no relay".into(),
            Some(LeaseState {
                holder: Some(holder),
                ..
            }) => format!("held by {}", describe_backend(Some(holder), None)),
        },
    ));
    rows.push(("nats", status.nats.clone()));
    render_stream(&mut rows, status.stream.as_ref());
    render_last_event(&mut rows, status.last_event.as_ref());
    if let Some(protection) = &status.failover {
        let slot = status.slot.as_ref().map_or("?", |s| s.name.as_str());
        rows.push(("fail-over", protection.describe(slot)));
    }
    let width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
    for (label, value) in rows {
        let _ = writeln!(out, "{label:<width$}  {value}");
    }
    out
}

/// The slot, publication or stream `thing` (its name and state by `parts`) with its state;
/// `None` once the row `label` says it is unknown (unread) or does not exist.
fn existing<'a, T, S>(
    rows: &mut Vec<(&str, String)>,
    label: &'static str,
    thing: Option<&'a T>,
    parts: impl Fn(&'a T) -> (&'a String, Option<&'a S>),
) -> Option<(&'a T, &'a S)> {
    let Some(thing) = thing else {
        rows.push((label, "unknown".into()));
        return None;
    };
    let (name, state) = parts(thing);
    if state.is_none() {
        rows.push((label, format!("{name}: does not exist")));
    }
    Some((thing, state?))
}

pub(super) fn render_slot(rows: &mut Vec<(&str, String)>, slot: Option<&Slot>) {
    let Some((slot, state)) = existing(rows, "slot", slot, |s| (&s.name, s.state.as_ref())) else {
        return;
    };
    let activity = if state.active {
        format!(
            "active, streamed by {}",
            describe_backend(state.walsender.as_ref(), state.active_pid)
        )
    } else {
        "inactive".into()
    };
    rows.push((
        "slot",
        format!(
            "{} ({}, database {}): {activity}",
            slot.name,
            state.plugin.as_deref().unwrap_or("?"),
            state.database.as_deref().unwrap_or("?")
        ),
    ));
    rows.push((
        "  confirmed",
        format!(
            "{} (restart {})",
            state.confirmed_flush_lsn.as_deref().unwrap_or("none"),
            state.restart_lsn.as_deref().unwrap_or("none")
        ),
    ));
    rows.push((
        "  lag",
        match (state.lag_bytes, &state.current_wal_lsn) {
            (Some(lag), Some(current)) => {
                format!("{} behind the server's WAL at {current}", format_size(lag))
            }
            _ => "unknown".into(),
        },
    ));
    rows.push((
        "  wal",
        format!(
            "wal_status {}, safe_wal_size {}",
            state.wal_status.as_deref().unwrap_or("unknown"),
            match state.safe_wal_size {
                Some(size) if size >= 0 => format_size(size as u64),
                Some(size) => format!("-{}", format_size(size.unsigned_abs())),
                None => "unlimited".into(),
            }
        ),
    ));
}

pub(super) fn render_publication(
    rows: &mut Vec<(&str, String)>,
    publication: Option<&Publication>,
) {
    let Some((publication, state)) = existing(rows, "publication", publication, |p| {
        (&p.name, p.state.as_ref())
    }) else {
        return;
    };
    let mut head = format!(
        "{}: {}",
        publication.name,
        if state.operations.is_empty() {
            "no operations".into()
        } else {
            state.operations.join(", ")
        }
    );
    if let Some(root) = state.publish_via_partition_root {
        let _ = write!(head, "; publish_via_partition_root {root}");
    }
    rows.push(("publication", head));
    const SHOWN: usize = 5;
    let mut tables: Vec<String> = state
        .tables
        .iter()
        .take(SHOWN)
        .map(|table| {
            let mut text = table.name.clone();
            if let Some(columns) = &table.columns {
                let _ = write!(text, " ({})", columns.join(", "));
            }
            if let Some(filter) = &table.row_filter {
                let _ = write!(text, " WHERE {filter}");
            }
            text
        })
        .collect();
    if state.tables.len() > SHOWN {
        tables.push(format!("… {} more", state.tables.len() - SHOWN));
    }
    let mut value = if state.all_tables {
        format!("all tables ({}): ", state.tables.len())
    } else {
        String::new()
    };
    value.push_str(&if tables.is_empty() {
        "none".to_owned()
    } else {
        tables.join("; ")
    });
    rows.push(("  tables", value));
}

pub(super) fn render_stream(rows: &mut Vec<(&str, String)>, stream: Option<&Stream>) {
    let Some((stream, state)) = existing(rows, "stream", stream, |s| (&s.name, s.state.as_ref()))
    else {
        return;
    };
    rows.push((
        "stream",
        format!("{}: subjects {}", stream.name, state.subjects.join(", ")),
    ));
    rows.push((
        "  messages",
        format!(
            "{} ({}), sequences {} to {}, {} consumer{}",
            state.messages,
            format_size(state.bytes),
            state.first_sequence,
            state.last_sequence,
            state.consumers,
            if state.consumers == 1 { "" } else { "s" }
        ),
    ));
    let mut settings = format!(
        "{} storage, {} replica{}",
        state.storage,
        state.replicas,
        if state.replicas == 1 { "" } else { "s" }
    );
    if let Some(leader) = &state.leader {
        let _ = write!(settings, " (leader {leader})");
    }
    let _ = write!(
        settings,
        ", duplicate window {}, {} retention, discard {}",
        format_duration(Duration::from_secs_f64(state.duplicate_window_seconds)),
        state.retention,
        state.discard
    );
    rows.push(("  settings", settings));
    let size = |v: Option<u64>| v.map_or("unlimited".into(), format_size);
    let count = |v: Option<u64>| v.map_or("unlimited".into(), |v| v.to_string());
    rows.push((
        "  limits",
        format!(
            "max_age {}, max_bytes {}, max_msgs {}, max_msgs_per_subject {}, max_msg_size {} (server max_payload {})",
            state
                .max_age_seconds
                .map_or("unlimited".into(), |s| format_duration(Duration::from_secs_f64(s))),
            size(state.max_bytes),
            count(state.max_msgs),
            count(state.max_msgs_per_subject),
            size(state.max_msg_size),
            format_size(state.server_max_payload)
        ),
    ));
}

pub(super) fn render_last_event(rows: &mut Vec<(&str, String)>, event: Option<&LastEvent>) {
    let Some(event) = event else {
        rows.push(("last event", "none".into()));
        return;
    };
    let what = match (&event.outbox_id, event.dead_letter) {
        (Some(id), false) => format!("outbox id {id}"),
        (Some(id), true) => format!("dead-letter record of outbox id {id}"),
        (None, _) => "a message without Outbox-Id".into(),
    };
    rows.push((
        "last event",
        format!(
            "{what}, sequence {}, subject {}",
            event.sequence, event.subject
        ),
    ));
    rows.push((
        "  age",
        format!(
            "{} (created {}, stored {})",
            format_age(event.age_seconds),
            event.created_at.as_deref().unwrap_or("unknown"),
            event.stored_at
        ),
    ));
    rows.push((
        "  position",
        format!(
            "commit {} #{}, source {}",
            event.commit_lsn.as_deref().unwrap_or("unknown"),
            event.tx_index.map_or("?".into(), |index| index.to_string()),
            event.source.as_deref().unwrap_or("unknown")
        ),
    ));
}

/// `3.2 s`, `4 min 12 s`, `5 h 3 min`, `2 d 4 h`.
pub(super) fn format_age(seconds: f64) -> String {
    let whole = seconds as u64;
    match whole {
        0..=59 => format!("{seconds:.1} s"),
        60..=3599 => format!("{} min {} s", whole / 60, whole % 60),
        3600..=86_399 => format!("{} h {} min", whole / 3600, whole % 3600 / 60),
        _ => format!("{} d {} h", whole / 86_400, whole % 86_400 / 3600),
    }
}

/// Unix milliseconds as `2025-01-31T12:34:56.789Z` (RFC 3339), or as the count itself for
/// an instant RFC 3339 cannot write.
pub(super) fn utc_millis(ms: i64) -> String {
    outbox::timestamp::rfc3339_millis(ms).unwrap_or_else(|| format!("{ms} ms since 1970"))
}
