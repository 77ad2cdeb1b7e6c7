//! `outbox-relay status`: the relay's objects as they are now, as a table for people or
//! JSON for scripts (`--json`), and an exit status a probe or a cron job can act on.
//!
//! [`gather`] reads, on one control connection and one NATS connection: the slot (active and
//! for which backend, confirmed position, lag behind the server's WAL, `wal_status`,
//! `safe_wal_size`), the publication (tables, operations, root publishing, row filters and
//! column lists), the lease holder (`pg_locks` and `pg_stat_activity`), the stream (state,
//! settings, limits) and its last event (outbox id, age from its `created_at`, position and
//! source). It then judges what it read ([`assess`]): every [`Finding`] says what is wrong,
//! why it matters and what to do. [`render`] draws the table.
//!
//! Inside: the types of what was read are here; `gather.rs` reads, `assess.rs` judges and
//! `render.rs` draws, each over those types alone.
//!
//! | exit | health | when |
//! |---|---|---|
//! | 0 | healthy | nothing below (warnings allowed) |
//! | 3 | lagging | slot lag above `max_lag_bytes`; `wal_status` `extended` or `unreserved`; no relay holds the lease (none runs, or one is retrying: lease LS3); the lease holder is not streaming; with `--failover-slot`, no standby holds a copy of the slot a promotion keeps (`postgres::failover` FP1) |
//! | 4 | broken | slot, publication or stream missing; slot `lost`; the start-up checks refuse the publication, table or slot, or the stream's subjects; a `discard: new` stream that is full; the slot read by a program that holds no lease |
//! | 1 | unknown | Postgres or NATS cannot be reached, or a query fails, and nothing read is broken |
//! | 2 | | invalid configuration (as for every command) |
//!
//! 1 and 2 keep the meaning they have for every command of the binary (an error that needs
//! an operator; invalid configuration), so the health codes are 3 and 4.
//!
//! # Invariants
//! - STA1 Read-only: status creates, changes and locks nothing. The start-up checks run with
//!   `create` off, and only on objects that exist; the lease holder is read from
//!   `pg_locks`, never found by trying the lock.
//! - STA2 The exit status is the worst finding: broken > unknown > lagging > healthy; warnings
//!   leave it at healthy.
//! - STA3 Nothing secret is printed: the Postgres target without its password, NATS servers
//!   without credentials, and the whole output through the log scrubber (in `main`).
//! - STA4 [`render`], the JSON and [`assess`] depend on the [`Status`] alone: times and ages are
//!   taken while gathering, so tests pin the output on fixed values.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy, StorageType};
use pgoutput::Lsn;
use serde::Serialize;
use tokio_postgres::Client;

use crate::config::{format_duration, format_size, opt, Config};
use crate::postgres::checks;
use crate::postgres::error::describe;
use crate::stream::policy::{self, StreamSeverity};

mod assess;
mod gather;
mod render;
pub use assess::*;
pub use gather::*;
pub use render::*;

/// How long reading either side may take, connecting included: a probe must not hang.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How bad a finding is; the order is the exit status's precedence (STA2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Worth knowing; the relay works.
    Warning,
    /// Events are behind or not flowing; the set-up is sound.
    Lagging,
    /// Part of the state could not be read.
    Unknown,
    /// The relay cannot relay correctly until an operator acts.
    Broken,
}

/// The verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Exit 0.
    Healthy,
    /// Exit 3.
    Lagging,
    /// Exit 4.
    Broken,
    /// Exit 1: the state could not be read completely.
    Unknown,
}

impl Health {
    /// The process's exit status (see the module docs).
    pub fn exit_code(self) -> u8 {
        match self {
            Health::Healthy => 0,
            Health::Unknown => 1,
            Health::Lagging => 3,
            Health::Broken => 4,
        }
    }

    fn of(findings: &[Finding]) -> Health {
        match findings.iter().map(|f| f.level).max() {
            Some(Level::Broken) => Health::Broken,
            Some(Level::Unknown) => Health::Unknown,
            Some(Level::Lagging) => Health::Lagging,
            Some(Level::Warning) | None => Health::Healthy,
        }
    }
}

/// Something wrong: what, why it matters, and the fix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// How bad.
    pub level: Level,
    /// What, why, and what to do.
    pub message: String,
}

impl Finding {
    fn new(level: Level, message: impl Into<String>) -> Finding {
        Finding {
            level,
            message: message.into(),
        }
    }
}

/// Everything `outbox-relay status` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The verdict, from the findings (STA2).
    pub health: Health,
    /// The exit status of the verdict.
    pub exit_code: u8,
    /// What is wrong, worst first.
    pub findings: Vec<Finding>,
    /// The Postgres connection, without its password.
    pub postgres: String,
    /// The outbox table and the mapping the relay reads it through.
    pub table: String,
    /// The NATS servers, without credentials.
    pub nats: String,
    /// The slot; `None` when Postgres could not be read.
    pub slot: Option<Slot>,
    /// The lease; `None` when Postgres could not be read.
    pub lease: Option<LeaseState>,
    /// The publication; `None` when Postgres could not be read.
    pub publication: Option<Publication>,
    /// The stream; `None` when NATS could not be read.
    pub stream: Option<Stream>,
    /// The stream's last message; `None` when the stream is empty or unreadable.
    pub last_event: Option<LastEvent>,
    /// With `--failover-slot`: what the standbys of `DATABASE_URL` hold of the slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover: Option<crate::postgres::failover::Protection>,
}

/// A Postgres backend (session), as `pg_stat_activity` shows it to this role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// Its process id.
    pub pid: i32,
    /// Its `application_name` (hidden for other roles' sessions without `pg_read_all_stats`).
    pub application_name: Option<String>,
    /// Its client's address, `None` for a Unix socket (or hidden).
    pub client_addr: Option<String>,
    /// Its client's port.
    pub client_port: Option<i32>,
    /// When it connected (UTC).
    pub backend_start: Option<String>,
}

/// The replication slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Slot {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing slot.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<SlotState>,
}

/// An existing slot's state (`pg_replication_slots`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotState {
    /// Its output plugin (`pgoutput`).
    pub plugin: Option<String>,
    /// Its database.
    pub database: Option<String>,
    /// Whether a walsender streams it.
    pub active: bool,
    /// That walsender's pid.
    pub active_pid: Option<i32>,
    /// That walsender's session.
    pub walsender: Option<Backend>,
    /// The oldest WAL it retains.
    pub restart_lsn: Option<String>,
    /// What its consumer confirmed: where the relay resumes.
    pub confirmed_flush_lsn: Option<String>,
    /// The server's WAL position (`pg_current_wal_lsn()`, on a standby the replay position).
    pub current_wal_lsn: Option<String>,
    /// `current_wal_lsn - confirmed_flush_lsn`, in bytes.
    pub lag_bytes: Option<u64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (Postgres 13+).
    pub wal_status: Option<String>,
    /// Bytes of WAL that may still be written before the slot is lost; `None`: no limit
    /// (`max_slot_wal_keep_size = -1`) or Postgres before 13.
    pub safe_wal_size: Option<i64>,
}

/// The lease (advisory lock keyed by the slot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseState {
    /// Whether a session holds it.
    pub held: bool,
    /// That session.
    pub holder: Option<Backend>,
    /// The relays between a failed session and their next attempt (lease LS3).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub retrying: Vec<crate::postgres::lease::Retrying>,
}

/// The publication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Publication {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing publication.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<PublicationState>,
}

/// An existing publication's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublicationState {
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// The operations it publishes: `insert`, `update`, `delete`, `truncate`.
    pub operations: Vec<String>,
    /// `publish_via_partition_root` (Postgres 13+).
    pub publish_via_partition_root: Option<bool>,
    /// Whether it publishes the outbox table.
    pub includes_outbox_table: bool,
    /// The tables it publishes.
    pub tables: Vec<PublishedTable>,
}

/// A table of the publication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishedTable {
    /// `schema.table`.
    pub name: String,
    /// Its row filter (Postgres 15+), if any.
    pub row_filter: Option<String>,
    /// Its column list (Postgres 15+), if any.
    pub columns: Option<Vec<String>>,
}

/// The stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stream {
    /// Its name.
    pub name: String,
    /// Whether it exists.
    pub exists: bool,
    /// What is known of an existing stream.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub state: Option<StreamState>,
}

/// An existing stream's state and settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamState {
    /// Its subjects.
    pub subjects: Vec<String>,
    /// Messages it holds.
    pub messages: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Its first sequence.
    pub first_sequence: u64,
    /// Its last sequence.
    pub last_sequence: u64,
    /// Its consumers.
    pub consumers: usize,
    /// Its duplicate window.
    pub duplicate_window_seconds: f64,
    /// `file` or `memory`.
    pub storage: String,
    /// Its replicas.
    pub replicas: usize,
    /// `limits`, `interest` or `workqueue`.
    pub retention: String,
    /// Events older than this are deleted; `None`: unlimited.
    pub max_age_seconds: Option<f64>,
    /// Size limit; `None`: unlimited.
    pub max_bytes: Option<u64>,
    /// Message count limit; `None`: unlimited.
    pub max_msgs: Option<u64>,
    /// Message count limit per subject; `None`: unlimited.
    pub max_msgs_per_subject: Option<u64>,
    /// Largest message; `None`: the server's `max_payload`.
    pub max_msg_size: Option<u64>,
    /// `old` or `new`.
    pub discard: String,
    /// The server's `max_payload`.
    pub server_max_payload: u64,
    /// The cluster's leader for the stream, if clustered.
    pub leader: Option<String>,
}

/// The stream's last message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LastEvent {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its subject.
    pub subject: String,
    /// `Outbox-Id`: a number for integer ids (as always), a string for uuid and text ids.
    #[serde(serialize_with = "serialize_id")]
    pub outbox_id: Option<outbox::EventId>,
    /// The row's `created_at` (UTC), from the `Outbox-Ordering-Key`'s millisecond prefix.
    pub created_at: Option<String>,
    /// When the stream stored it (UTC).
    pub stored_at: String,
    /// Its age when read: from `created_at`, else from `stored_at`.
    pub age_seconds: f64,
    /// `created_at` or `stored_at`: what the age is measured from.
    pub age_from: String,
    /// `Outbox-Commit-Lsn`.
    pub commit_lsn: Option<String>,
    /// `Outbox-Tx-Index`.
    pub tx_index: Option<u64>,
    /// `Outbox-Source`: cluster, timeline, database and slot it was relayed from.
    pub source: Option<String>,
    /// Whether it is a dead-letter record in place of an event.
    pub dead_letter: bool,
}

/// An outbox id in status's JSON: a number for an integer id, a string for the others.
fn serialize_id<S: serde::Serializer>(
    id: &Option<outbox::EventId>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match id {
        None => serializer.serialize_none(),
        Some(outbox::EventId::Int(id)) => serializer.serialize_i64(*id),
        Some(outbox::EventId::Text(id)) => serializer.serialize_str(id),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn config(env: &[(&str, &str)]) -> Config {
        let mut all = vec![("DATABASE_URL", "postgres://relay:hunter2@db:5432/app")];
        all.extend_from_slice(env);
        crate::config::tests::load(&[], &all, None).unwrap()
    }

    fn relay_backend(pid: i32, port: i32) -> Backend {
        Backend {
            pid,
            application_name: Some("outbox-relay".into()),
            client_addr: Some("10.0.0.3".into()),
            client_port: Some(port),
            backend_start: Some("2025-01-31T12:00:00Z".into()),
        }
    }

    /// A healthy system: the relay streams the slot and holds the lease.
    fn healthy() -> Status {
        Status {
            health: Health::Healthy,
            exit_code: 0,
            findings: vec![],
            postgres: "postgres://relay@db:5432/app?sslmode=prefer".into(),
            table: "public.outbox_events (the seed's columns)".into(),
            nats: "nats://nats:4222".into(),
            slot: Some(Slot {
                name: "outbox_relay".into(),
                exists: true,
                state: Some(SlotState {
                    plugin: Some("pgoutput".into()),
                    database: Some("app".into()),
                    active: true,
                    active_pid: Some(4242),
                    walsender: Some(relay_backend(4242, 50412)),
                    restart_lsn: Some("0/16B3710".into()),
                    confirmed_flush_lsn: Some("0/16B3748".into()),
                    current_wal_lsn: Some("0/16B3B48".into()),
                    lag_bytes: Some(1024),
                    wal_status: Some("reserved".into()),
                    safe_wal_size: None,
                }),
            }),
            lease: Some(LeaseState {
                held: true,
                holder: Some(relay_backend(4241, 50410)),
                retrying: Vec::new(),
            }),
            publication: Some(Publication {
                name: "outbox_relay".into(),
                exists: true,
                state: Some(PublicationState {
                    all_tables: false,
                    operations: vec!["insert".into()],
                    publish_via_partition_root: Some(false),
                    includes_outbox_table: true,
                    tables: vec![PublishedTable {
                        name: "public.outbox_events".into(),
                        row_filter: None,
                        columns: None,
                    }],
                }),
            }),
            stream: Some(Stream {
                name: "OUTBOX".into(),
                exists: true,
                state: Some(StreamState {
                    subjects: vec!["outbox.>".into()],
                    messages: 1234,
                    bytes: 1_258_291,
                    first_sequence: 1,
                    last_sequence: 1234,
                    consumers: 1,
                    duplicate_window_seconds: 120.0,
                    storage: "file".into(),
                    replicas: 1,
                    retention: "limits".into(),
                    max_age_seconds: None,
                    max_bytes: None,
                    max_msgs: None,
                    max_msgs_per_subject: None,
                    max_msg_size: None,
                    discard: "old".into(),
                    server_max_payload: 1_048_576,
                    leader: None,
                }),
            }),
            last_event: Some(LastEvent {
                sequence: 1234,
                subject: "outbox.3.OrderPaid".into(),
                outbox_id: Some(outbox::EventId::Int(4711)),
                created_at: Some(utc_millis(1_738_326_896_789)),
                stored_at: utc_millis(1_738_326_896_795),
                age_seconds: 3.25,
                age_from: "created_at".into(),
                commit_lsn: Some("0/16B3748".into()),
                tx_index: Some(0),
                source: Some("7301/1/app/outbox_relay".into()),
                dead_letter: false,
            }),
            failover: None,
        }
    }

    #[test]
    fn renders_a_healthy_system_as_a_table() {
        let expected = "\
outbox-relay status: healthy

postgres     postgres://relay@db:5432/app?sslmode=prefer
table        public.outbox_events (the seed's columns)
slot         outbox_relay (pgoutput, database app): active, streamed by pid 4242 (outbox-relay, 10.0.0.3:50412, since 2025-01-31T12:00:00Z)
  confirmed  0/16B3748 (restart 0/16B3710)
  lag        1 KiB behind the server's WAL at 0/16B3B48
  wal        wal_status reserved, safe_wal_size unlimited
publication  outbox_relay: insert; publish_via_partition_root false
  tables     public.outbox_events
lease        held by pid 4241 (outbox-relay, 10.0.0.3:50410, since 2025-01-31T12:00:00Z)
nats         nats://nats:4222
stream       OUTBOX: subjects outbox.>
  messages   1234 (1.2 MiB), sequences 1 to 1234, 1 consumer
  settings   file storage, 1 replica, duplicate window 2m, limits retention, discard old
  limits     max_age unlimited, max_bytes unlimited, max_msgs unlimited, max_msgs_per_subject unlimited, max_msg_size unlimited (server max_payload 1 MiB)
last event   outbox id 4711, sequence 1234, subject outbox.3.OrderPaid
  age        3.2 s (created 2025-01-31T12:34:56.789Z, stored 2025-01-31T12:34:56.795Z)
  position   commit 0/16B3748 #0, source 7301/1/app/outbox_relay
";
        assert_eq!(render(&healthy()), expected);
    }

    #[test]
    fn renders_findings_first_and_what_is_missing_or_unknown() {
        let mut status = healthy();
        status.slot = Some(Slot {
            name: "outbox_relay".into(),
            exists: false,
            state: None,
        });
        status.stream = None;
        status.last_event = None;
        status.lease = Some(LeaseState {
            held: false,
            holder: None,
            retrying: Vec::new(),
        });
        status.findings = vec![
            Finding::new(
                Level::Broken,
                "replication slot outbox_relay does not exist",
            ),
            Finding::new(Level::Unknown, "cannot connect to NATS"),
        ];
        status.health = Health::of(&status.findings);
        let text = render(&status);
        assert!(
            text.starts_with(
                "outbox-relay status: BROKEN (exit 4)\n  broken: replication slot outbox_relay does not exist\n  unknown: cannot connect to NATS\n\n"
            ),
            "{text}"
        );
        for line in [
            "slot         outbox_relay: does not exist\n",
            "lease        held by no relay\n",
            "stream       unknown\n",
            "last event   none\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
    }

    #[test]
    fn json_names_every_part() {
        let json = serde_json::to_value(healthy()).unwrap();
        assert_eq!(json["health"], "healthy");
        assert_eq!(json["slot"]["exists"], true);
        assert_eq!(json["slot"]["lag_bytes"], 1024);
        assert_eq!(json["slot"]["safe_wal_size"], serde_json::Value::Null);
        assert_eq!(json["slot"]["walsender"]["pid"], 4242);
        assert_eq!(json["lease"]["holder"]["application_name"], "outbox-relay");
        assert_eq!(json["publication"]["operations"][0], "insert");
        assert_eq!(json["stream"]["max_bytes"], serde_json::Value::Null);
        assert_eq!(json["stream"]["duplicate_window_seconds"], 120.0);
        assert_eq!(json["last_event"]["outbox_id"], 4711);
        assert_eq!(json["last_event"]["created_at"], "2025-01-31T12:34:56.789Z");
        let missing = serde_json::to_value(Slot {
            name: "s".into(),
            exists: false,
            state: None,
        })
        .unwrap();
        assert_eq!(missing, serde_json::json!({"name": "s", "exists": false}));
    }

    #[test]
    fn a_healthy_system_has_no_finding() {
        let status = healthy();
        assert_eq!(assess(&status, &config(&[])), vec![]);
    }

    #[test]
    fn lag_above_the_threshold_and_wal_retention_are_lagging() {
        let mut status = healthy();
        let config = config(&[("OUTBOX_RELAY_MAX_LAG_BYTES", "512")]);
        let findings = assess(&status, &config);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].level, Level::Lagging);
        assert!(
            findings[0].message.contains("1 KiB behind")
                && findings[0].message.contains("OUTBOX_RELAY_MAX_LAG_BYTES"),
            "{findings:?}"
        );
        for (wal_status, level) in [
            ("extended", Level::Lagging),
            ("unreserved", Level::Lagging),
            ("lost", Level::Broken),
        ] {
            let slot = status.slot.as_mut().unwrap().state.as_mut().unwrap();
            slot.wal_status = Some(wal_status.into());
            let findings = assess(&status, &super::tests::config(&[]));
            assert_eq!(findings.len(), 1, "{findings:?}");
            assert_eq!(findings[0].level, level, "{wal_status}");
            assert!(findings[0].message.contains(wal_status), "{findings:?}");
        }
    }

    #[test]
    fn the_lease_and_the_walsender_are_judged_together() {
        let config = config(&[]);
        // No relay at all: lagging (the set-up is sound, nothing flows).
        let mut status = healthy();
        status.lease = Some(LeaseState {
            held: false,
            holder: None,
            retrying: Vec::new(),
        });
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = false;
        let findings = assess(&status, &config);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].level, Level::Lagging);
        assert!(findings[0].message.contains("no relay is running"));
        // A relay between two attempts: running and retrying, with its last error (LS3).
        status.lease.as_mut().unwrap().retrying = vec![crate::postgres::lease::Retrying {
            pid: 4243,
            note: Some("next attempt at 2026-12-05T22:00:05Z; last error: stream full".into()),
            since: Some("2026-12-05T22:00:00Z".into()),
        }];
        let findings = assess(&status, &config);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].level, Level::Lagging);
        let message = &findings[0].message;
        assert!(
            message.contains("a relay (pid 4243) is running and retrying after a failed session")
                && message
                    .contains("next attempt at 2026-12-05T22:00:05Z; last error: stream full")
                && !message.contains("no relay is running"),
            "{message}"
        );
        assert!(render(&status).contains("held by no relay; retrying: pid 4243"));
        status.lease.as_mut().unwrap().retrying.clear();
        // Someone reads the slot without the lease: broken.
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = true;
        let findings = assess(&status, &config);
        assert_eq!(findings[0].level, Level::Broken, "{findings:?}");
        assert!(findings[0].message.contains("pg_terminate_backend(4242)"));
        // The holder does not stream: lagging.
        let mut status = healthy();
        status.slot.as_mut().unwrap().state.as_mut().unwrap().active = false;
        let findings = assess(&status, &config);
        assert_eq!(findings[0].level, Level::Lagging, "{findings:?}");
        assert!(findings[0].message.contains("pid 4241"), "{findings:?}");
    }

    #[test]
    fn missing_objects_are_broken_and_the_worst_finding_decides() {
        let mut status = healthy();
        status.slot.as_mut().unwrap().state = None;
        status.publication.as_mut().unwrap().state = None;
        status.publication.as_mut().unwrap().exists = false;
        status.stream.as_mut().unwrap().state = None;
        status.stream.as_mut().unwrap().exists = false;
        let findings = assess(&status, &config(&[]));
        assert_eq!(findings.len(), 3, "{findings:?}");
        assert!(findings.iter().all(|f| f.level == Level::Broken));
        let mut all = findings;
        all.push(Finding::new(Level::Unknown, "x"));
        all.push(Finding::new(Level::Lagging, "y"));
        assert_eq!(Health::of(&all), Health::Broken);
        assert_eq!(Health::of(&all[3..]), Health::Unknown);
        assert_eq!(Health::of(&all[4..]), Health::Lagging);
        assert_eq!(
            Health::of(&[Finding::new(Level::Warning, "z")]),
            Health::Healthy
        );
        let codes: Vec<u8> = [
            Health::Healthy,
            Health::Unknown,
            Health::Lagging,
            Health::Broken,
        ]
        .iter()
        .map(|h| h.exit_code())
        .collect();
        assert_eq!(codes, [0, 1, 3, 4]);
    }

    #[test]
    fn utc_timestamps_and_ages() {
        assert_eq!(utc_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_millis(951_782_400_001), "2000-02-29T00:00:00.001Z");
        assert_eq!(utc_millis(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_age(0.04), "0.0 s");
        assert_eq!(format_age(252.0), "4 min 12 s");
        assert_eq!(format_age(18_180.0), "5 h 3 min");
        assert_eq!(format_age(187_200.0), "2 d 4 h");
    }
}
