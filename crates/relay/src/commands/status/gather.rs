//! Reading: the slot, publication, lease and stream as they are now, on one control
//! connection and one NATS connection ([`gather`]); what cannot be read is a finding.

use super::*;
use crate::observe::metrics::FailoverState;
use crate::postgres::failover::Protection;

/// Reads everything, judges it ([`assess`]) and never fails: what cannot be read is a
/// finding of level [`Level::Unknown`].
pub async fn gather(config: &Config) -> Status {
    let now = SystemTime::now();
    let late = |what: String| {
        vec![Finding::new(
            Level::Unknown,
            format!("{what} did not answer within {} s", READ_TIMEOUT.as_secs()),
        )]
    };
    let (postgres, nats) = tokio::join!(
        tokio::time::timeout(READ_TIMEOUT, gather_postgres(config)),
        tokio::time::timeout(READ_TIMEOUT, gather_nats(config, now))
    );
    let (slot, lease, publication, mut findings) = postgres.unwrap_or_else(|_| {
        let what = format!("Postgres at {}", config.database.redacted());
        (None, None, None, late(what))
    });
    let (stream, last_event, nats_findings) = nats.unwrap_or_else(|_| {
        let what = format!("NATS at {}", config.nats.servers().join(","));
        (None, None, late(what))
    });
    findings.extend(nats_findings);
    let failover = gather_failover(config, slot.as_ref()).await;
    if let Some(protection) = &failover {
        findings.extend(assess_failover(protection, &config.slot));
    }
    let mut status = Status {
        health: Health::Healthy,
        exit_code: 0,
        findings,
        postgres: config.database.redacted(),
        table: format!("{} ({})", config.table, config.mapping),
        nats: config.nats.servers().join(","),
        slot,
        lease,
        publication,
        stream,
        last_event,
        failover,
    };
    let judged = assess(&status, config);
    status.findings.extend(judged);
    status.findings.sort_by_key(|f| std::cmp::Reverse(f.level));
    status.health = Health::of(&status.findings);
    status.exit_code = status.health.exit_code();
    status
}

/// With `--failover-slot` and the slot in place: what the standbys hold of it
/// (`crate::postgres::failover`, each standby bounded by its timeout).
async fn gather_failover(config: &Config, slot: Option<&Slot>) -> Option<Protection> {
    let confirmed = slot?.state.as_ref()?.confirmed_flush_lsn.as_deref()?;
    if !config.failover_slot {
        return None;
    }
    Some(crate::postgres::failover::read(config, confirmed.parse().ok()).await)
}

/// Fail-over protection missing is lagging (a promotion now would stop the relay); not
/// watched, a warning naming the fix.
fn assess_failover(protection: &Protection, slot: &str) -> Option<Finding> {
    let line = protection.describe(slot);
    match protection.state() {
        FailoverState::Unwatched => Some(Finding::new(
            Level::Warning,
            format!("fail-over protection is not watched: {line}"),
        )),
        FailoverState::Missing => Some(Finding::new(
            Level::Lagging,
            format!(
                "fail-over protection missing: a promotion now would lose slot {slot} and the \
                 relay would refuse on the new primary; {line}"
            ),
        )),
        FailoverState::Protected | FailoverState::Off => None,
    }
}

pub(super) type PostgresPart = (
    Option<Slot>,
    Option<LeaseState>,
    Option<Publication>,
    Vec<Finding>,
);

pub(super) async fn gather_postgres(config: &Config) -> PostgresPart {
    let unknown = |what: String| vec![Finding::new(Level::Unknown, what)];
    let client = match replication::connect_sql(&config.database).await {
        Ok(client) => client,
        Err(e) => {
            return (
                None,
                None,
                None,
                unknown(format!(
                    "cannot connect to Postgres at {}: {e}",
                    config.database.redacted()
                )),
            )
        }
    };
    let (slot, lease, publication) = match read_parts(&client, config).await {
        Ok(read) => read,
        Err(e) => return (None, None, None, unknown(e)),
    };
    let mut findings = Vec::new();
    // The start-up checks, read-only (STA1), on objects that exist (missing ones are findings
    // of their own, with a fix that fits `status`).
    if slot.exists && publication.exists {
        let mut checking = config.clone();
        checking.create = false;
        if let Err(e) = checks::postgres(&client, &checking).await {
            let level = if e.is_transient() {
                Level::Unknown
            } else {
                Level::Broken
            };
            findings.push(Finding::new(
                level,
                format!("the relay's start-up checks refuse: {e}"),
            ));
        }
    }
    (Some(slot), Some(lease), Some(publication), findings)
}

/// The slot, the lease and the publication, with the sessions of the lease's holder and
/// of the slot's walsender.
pub(super) async fn read_parts(
    client: &Client,
    config: &Config,
) -> Result<(Slot, LeaseState, Publication), String> {
    let slot = read_slot(client, &config.slot).await?;
    let publication = read_publication(client, config).await?;
    let holder = crate::postgres::lease::holder(client, &config.slot)
        .await
        .map_err(|e| e.to_string())?;
    let walsender = slot.state.as_ref().and_then(|s| s.active_pid);
    let pids: Vec<i32> = holder.iter().chain(walsender.iter()).copied().collect();
    let backends = read_backends(client, &pids).await?;
    let backend = |pid: i32| {
        backends
            .iter()
            .find(|b| b.pid == pid)
            .cloned()
            .unwrap_or(Backend {
                pid,
                application_name: None,
                client_addr: None,
                client_port: None,
                backend_start: None,
            })
    };
    let mut slot = slot;
    if let Some(state) = slot.state.as_mut() {
        state.walsender = state.active_pid.map(backend);
    }
    let retrying = crate::postgres::lease::retrying(client, &config.slot)
        .await
        .map_err(|e| e.to_string())?;
    let lease = LeaseState {
        held: holder.is_some(),
        holder: holder.map(backend),
        retrying,
    };
    Ok((slot, lease, publication))
}

pub(super) fn sql_error(what: &str) -> impl Fn(tokio_postgres::Error) -> String + '_ {
    move |e| format!("cannot read {what}: {}", describe(&e))
}

/// The slot's row as JSON (columns differ between Postgres versions) and the server's WAL
/// position.
pub(super) async fn read_slot(client: &Client, name: &str) -> Result<Slot, String> {
    let row = client
        .query_opt(
            concat!(
                "SELECT pg_catalog.to_jsonb(s)::text, ",
                crate::postgres::standby::wal_position!(),
                "::text FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1"
            ),
            &[&name],
        )
        .await
        .map_err(sql_error("the replication slot"))?;
    let Some(row) = row else {
        return Ok(Slot {
            name: name.to_owned(),
            exists: false,
            state: None,
        });
    };
    let json: String = row.get(0);
    let current: Option<String> = row.get(1);
    let slot: serde_json::Value = serde_json::from_str(&json)
        .map_err(|e| format!("cannot read the replication slot: {e}"))?;
    let text = |key: &str| slot.get(key).and_then(|v| v.as_str()).map(str::to_owned);
    let confirmed = text("confirmed_flush_lsn");
    let lsn = |text: &Option<String>| text.as_deref().and_then(|t| t.parse::<Lsn>().ok());
    let lag_bytes = match (lsn(&confirmed), lsn(&current)) {
        (Some(confirmed), Some(current)) => Some(confirmed.bytes_until(current)),
        _ => None,
    };
    Ok(Slot {
        name: name.to_owned(),
        exists: true,
        state: Some(SlotState {
            plugin: text("plugin"),
            database: text("database"),
            active: slot
                .get("active")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            active_pid: slot
                .get("active_pid")
                .and_then(|v| v.as_i64())
                .and_then(|pid| i32::try_from(pid).ok()),
            walsender: None,
            restart_lsn: text("restart_lsn"),
            confirmed_flush_lsn: confirmed,
            current_wal_lsn: current,
            lag_bytes,
            wal_status: text("wal_status"),
            safe_wal_size: slot.get("safe_wal_size").and_then(|v| v.as_i64()),
        }),
    })
}

pub(super) async fn read_publication(
    client: &Client,
    config: &Config,
) -> Result<Publication, String> {
    let name = &config.publication;
    let row = client
        .query_opt(
            "SELECT pg_catalog.to_jsonb(p)::text FROM pg_catalog.pg_publication p WHERE p.pubname = $1",
            &[name],
        )
        .await
        .map_err(sql_error("the publication"))?;
    let Some(row) = row else {
        return Ok(Publication {
            name: name.clone(),
            exists: false,
            state: None,
        });
    };
    let publication: serde_json::Value = serde_json::from_str(&row.get::<_, String>(0))
        .map_err(|e| format!("cannot read the publication: {e}"))?;
    let flag = |key: &str| publication.get(key).and_then(|v| v.as_bool());
    let operations = [
        ("pubinsert", "insert"),
        ("pubupdate", "update"),
        ("pubdelete", "delete"),
        ("pubtruncate", "truncate"),
    ]
    .iter()
    .filter(|(key, _)| flag(key) == Some(true))
    .map(|(_, op)| (*op).to_owned())
    .collect();
    let tables = read_published_tables(client, name).await?;
    let ours = config.table.to_string();
    Ok(Publication {
        name: name.clone(),
        exists: true,
        state: Some(PublicationState {
            all_tables: flag("puballtables").unwrap_or(false),
            operations,
            publish_via_partition_root: flag("pubviaroot"),
            includes_outbox_table: tables.iter().any(|t| t.name == ours),
            tables,
        }),
    })
}

/// The tables the publication publishes, with their row filters and column lists.
pub(super) async fn read_published_tables(
    client: &Client,
    name: &str,
) -> Result<Vec<PublishedTable>, String> {
    // Row filters and column lists exist from Postgres 15 on: read through to_jsonb, a
    // missing column is NULL. `attnames` always lists the published columns; a column list
    // is set when `pg_publication_rel.prattrs` is.
    let rows = client
        .query(
            "SELECT t.schemaname::text, t.tablename::text, pg_catalog.to_jsonb(t) ->> 'rowfilter', \
                    CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r \
                                        JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid \
                                        JOIN pg_catalog.pg_class c ON c.oid = r.prrelid \
                                        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                                       WHERE p.pubname = t.pubname AND n.nspname = t.schemaname \
                                         AND c.relname = t.tablename \
                                         AND (pg_catalog.to_jsonb(r) ->> 'prattrs') IS NOT NULL) \
                         THEN (pg_catalog.to_jsonb(t) -> 'attnames')::text END \
               FROM pg_catalog.pg_publication_tables t WHERE t.pubname = $1 ORDER BY 1, 2",
            &[&name],
        )
        .await
        .map_err(sql_error("the publication's tables"))?;
    Ok(rows
        .iter()
        .map(|row| PublishedTable {
            name: format!("{}.{}", row.get::<_, String>(0), row.get::<_, String>(1)),
            row_filter: row.get(2),
            columns: row
                .get::<_, Option<String>>(3)
                .and_then(|json| serde_json::from_str(&json).ok()),
        })
        .collect())
}

pub(super) async fn read_backends(client: &Client, pids: &[i32]) -> Result<Vec<Backend>, String> {
    if pids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT pid, application_name, pg_catalog.host(client_addr), client_port, \
                    pg_catalog.to_char(backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
               FROM pg_catalog.pg_stat_activity WHERE pid = ANY($1)",
            &[&pids],
        )
        .await
        .map_err(sql_error("the sessions (pg_stat_activity)"))?;
    Ok(rows
        .iter()
        .map(|row| Backend {
            pid: row.get(0),
            application_name: row
                .get::<_, Option<String>>(1)
                .filter(|name| !name.is_empty()),
            client_addr: row.get(2),
            client_port: row.get::<_, Option<i32>>(3).filter(|&port| port > 0),
            backend_start: row.get(4),
        })
        .collect())
}

pub(super) async fn gather_nats(
    config: &Config,
    now: SystemTime,
) -> (Option<Stream>, Option<LastEvent>, Vec<Finding>) {
    let unknown = |what: String| vec![Finding::new(Level::Unknown, what)];
    let client = match crate::connect::nats::connect(&config.nats).await {
        Ok(client) => client,
        Err(e) => return (None, None, unknown(e.to_string())),
    };
    let max_payload = client.server_info().max_payload;
    let jetstream = jetstream::new(client);
    let mut stream = match jetstream.get_stream(&config.stream).await {
        Ok(stream) => stream,
        Err(e) => {
            let missing = matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            );
            if !missing {
                return (
                    None,
                    None,
                    unknown(format!("cannot read stream {}: {e}", config.stream)),
                );
            }
            let stream = Stream {
                name: config.stream.clone(),
                exists: false,
                state: None,
            };
            return (Some(stream), None, Vec::new());
        }
    };
    let info = match stream.info().await {
        Ok(info) => info.clone(),
        Err(e) => {
            return (
                None,
                None,
                unknown(format!("cannot read stream {}: {e}", config.stream)),
            )
        }
    };
    let mut findings = stream_findings(&info, config, max_payload);
    match policy::persistence_finding(&jetstream, &config.stream).await {
        Ok(finding) => findings.extend(finding.map(status_finding)),
        Err(e) => findings.push(Finding::new(Level::Unknown, e.to_string())),
    }
    let last_event = read_last_event(&stream, &info, config, now, &mut findings).await;
    let stream = Stream {
        name: config.stream.clone(),
        exists: true,
        state: Some(stream_state(&info, max_payload)),
    };
    (Some(stream), last_event, findings)
}

/// The stream's findings ([`policy::check_stream`], ST1) as status levels: refused or
/// full is broken.
pub(super) fn stream_findings(
    info: &jetstream::stream::Info,
    config: &Config,
    max_payload: usize,
) -> Vec<Finding> {
    policy::check_stream(info, config, max_payload)
        .into_iter()
        .map(status_finding)
        .collect()
}

/// A stream finding as a status level: refused or full is broken.
pub(super) fn status_finding(finding: policy::StreamFinding) -> Finding {
    let level = match finding.severity {
        StreamSeverity::Refused | StreamSeverity::Full => Level::Broken,
        StreamSeverity::Warning => Level::Warning,
    };
    Finding::new(level, finding.message)
}

/// The stream's last message as the last event, if the stream holds any; a warning in
/// `findings` when it cannot be read.
pub(super) async fn read_last_event(
    stream: &jetstream::stream::Stream,
    info: &jetstream::stream::Info,
    config: &Config,
    now: SystemTime,
    findings: &mut Vec<Finding>,
) -> Option<LastEvent> {
    if info.state.last_sequence > 0 && info.state.messages > 0 {
        match stream.get_raw_message(info.state.last_sequence).await {
            Ok(message) => Some(last_event(&message, now)),
            Err(e) => {
                findings.push(Finding::new(
                    Level::Warning,
                    format!(
                        "cannot read the last message of stream {} (sequence {}): {e}",
                        config.stream, info.state.last_sequence
                    ),
                ));
                None
            }
        }
    } else {
        None
    }
}

pub(super) fn stream_state(info: &jetstream::stream::Info, max_payload: usize) -> StreamState {
    let config = &info.config;
    let positive = |v: i64| u64::try_from(v).ok().filter(|&v| v > 0);
    StreamState {
        subjects: config.subjects.clone(),
        messages: info.state.messages,
        bytes: info.state.bytes,
        first_sequence: info.state.first_sequence,
        last_sequence: info.state.last_sequence,
        consumers: info.state.consumer_count,
        duplicate_window_seconds: config.duplicate_window.as_secs_f64(),
        storage: match config.storage {
            StorageType::File => "file",
            StorageType::Memory => "memory",
        }
        .into(),
        replicas: config.num_replicas.max(1),
        retention: match config.retention {
            RetentionPolicy::Limits => "limits",
            RetentionPolicy::Interest => "interest",
            RetentionPolicy::WorkQueue => "workqueue",
        }
        .into(),
        max_age_seconds: Some(config.max_age)
            .filter(|age| !age.is_zero())
            .map(|age| age.as_secs_f64()),
        max_bytes: positive(config.max_bytes),
        max_msgs: positive(config.max_messages),
        max_msgs_per_subject: positive(config.max_messages_per_subject),
        max_msg_size: positive(i64::from(config.max_message_size)),
        discard: match config.discard {
            DiscardPolicy::Old => "old",
            DiscardPolicy::New => "new",
        }
        .into(),
        server_max_payload: max_payload as u64,
        leader: info.cluster.as_ref().and_then(|c| c.leader.clone()),
    }
}

pub(super) fn last_event(
    message: &jetstream::message::StreamMessage,
    now: SystemTime,
) -> LastEvent {
    use outbox::headers;
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    let created_ms = header(headers::OUTBOX_ORDERING_KEY).and_then(|key| {
        key.split_once(':')
            .and_then(|(ms, _)| ms.parse::<i64>().ok())
    });
    let stored_ms = i64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
    let now_ms = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let (from_ms, age_from) = match created_ms {
        Some(ms) => (ms, "created_at"),
        None => (stored_ms, "stored_at"),
    };
    LastEvent {
        sequence: message.sequence,
        subject: message.subject.to_string(),
        outbox_id: outbox::EventId::from_headers(|name| {
            message.headers.get(name).map(|v| v.as_str())
        }),
        created_at: created_ms.map(utc_millis),
        stored_at: utc_millis(stored_ms),
        age_seconds: (now_ms.saturating_sub(from_ms).max(0)) as f64 / 1000.0,
        age_from: age_from.into(),
        commit_lsn: header(headers::OUTBOX_COMMIT_LSN),
        tx_index: header(headers::OUTBOX_TX_INDEX).and_then(|i| i.parse().ok()),
        source: header(headers::OUTBOX_SOURCE),
        dead_letter: header(headers::OUTBOX_DEAD_LETTER_REASON).is_some(),
    }
}
