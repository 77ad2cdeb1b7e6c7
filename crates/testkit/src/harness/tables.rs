//! Outbox tables of other shapes than the seed's (issue 22: the user's own table), the relay
//! settings that map them, and running the relay's one-shot subcommands on a case.

use crate::harness::case::{servers, Case};

/// Debezium's outbox table (its router's columns and its Quarkus extension's `timestamp`),
/// with the producer's span context in `tracingspancontext`; read through
/// [`DEBEZIUM_ENV`]'s preset.
pub const DEBEZIUM_TABLE: &str = "CREATE TABLE outboxevent (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    timestamp timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'),
    payload jsonb,
    tracingspancontext varchar(256));";

/// The relay settings for [`DEBEZIUM_TABLE`].
pub const DEBEZIUM_ENV: &[(&str, &str)] = &[
    ("OUTBOX_RELAY_TABLE", "public.outboxevent"),
    ("OUTBOX_RELAY_TABLE_PRESET", "debezium"),
];

/// A table of text ids with a `bytea` payload and its own column names, a header column
/// (`tenant`), a bare `traceparent` column (`trace`), a template column (`region`) and
/// `seq`, the order its rows were written in.
pub const TEXT_TABLE: &str = "CREATE TABLE app_events (
    event_id text PRIMARY KEY,
    stream_id text NOT NULL,
    kind text NOT NULL,
    body bytea NOT NULL,
    occurred_at timestamptz NOT NULL DEFAULT now(),
    region text NOT NULL,
    tenant text,
    trace text,
    seq bigserial);";

/// The relay settings for [`TEXT_TABLE`]: every column named, `X-Tenant` from `tenant`,
/// subjects `{prefix}.{region}.{shard}.{event_type}`, events of type `Noise` left out.
pub const TEXT_ENV: &[(&str, &str)] = &[
    ("OUTBOX_RELAY_TABLE", "public.app_events"),
    ("OUTBOX_RELAY_ID_COLUMN", "event_id"),
    ("OUTBOX_RELAY_ENTITY_ID_COLUMN", "stream_id"),
    ("OUTBOX_RELAY_EVENT_TYPE_COLUMN", "kind"),
    ("OUTBOX_RELAY_PAYLOAD_COLUMN", "body"),
    ("OUTBOX_RELAY_CREATED_AT_COLUMN", "occurred_at"),
    ("OUTBOX_RELAY_HEADER_COLUMNS", "tenant:X-Tenant"),
    ("OUTBOX_RELAY_TRACE_CONTEXT_COLUMN", "trace"),
    (
        "OUTBOX_RELAY_SUBJECT_TEMPLATE",
        "{prefix}.{region}.{shard}.{event_type}",
    ),
    ("OUTBOX_RELAY_EXCLUDE_EVENT_TYPES", "Noise"),
];

/// SQL that replaces the seed's table `outbox_events` by one with its columns, the
/// constraints `keys` (a primary or unique key must include `column`), range-partitioned by
/// `column`; the caller creates its partitions.
pub fn partitioned_outbox_table(keys: &str, column: &str) -> String {
    format!(
        "drop table outbox_events;
         create table outbox_events (
           id bigserial, entity_id text not null, event_type text not null,
           dedupe_key text not null, partition_key text not null, ordering_key text not null,
           payload jsonb not null, status text not null default 'pending',
           attempts integer not null default 0, last_error text,
           created_at timestamptz not null default now(), published_at timestamptz,
           {keys}
         ) partition by range ({column});"
    )
}

impl Case {
    /// A case on the shared [`servers`] whose database also holds `table_sql`, relayed with
    /// the settings of every list in `env`, in order.
    pub fn with_table(name: &str, table_sql: &str, env: &[&[(&str, &str)]]) -> Case {
        let s = servers();
        let mut case = Case::new(&s.pg, &s.nats, name);
        s.pg.psql(&case.database, table_sql);
        for (key, value) in env.iter().copied().flatten() {
            case.extra_env.push(((*key).into(), (*value).into()));
        }
        case
    }

    /// Runs a one-shot subcommand (`verify`, `replay`, `backfill`, ...) to its end.
    pub fn run_command(&self, subcommand: &str, args: &[&str]) -> CommandRun {
        let output = self
            .relay_command(subcommand)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run outbox-relay {subcommand}: {e}"));
        CommandRun {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

/// Asserts that `text` (a run's `stream`) holds each of `parts`.
fn assert_holds(stream: &str, text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "{stream} lacks {part:?}:\n{text}");
    }
}

/// What one run of a subcommand printed, and its exit status (-1: killed by a signal).
#[derive(Debug, Clone)]
pub struct CommandRun {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CommandRun {
    /// Asserts that the run exited with status `code` (what it printed is the failure's
    /// message); returns it.
    pub fn assert_code(&self, code: i32) -> &CommandRun {
        assert_eq!(self.code, code, "{}\n{}", self.stdout, self.stderr);
        self
    }

    /// Asserts that its stdout holds each of `parts` (the failure names the first missing
    /// one, with the whole stdout); returns it.
    pub fn assert_stdout_has(&self, parts: &[&str]) -> &CommandRun {
        assert_holds("stdout", &self.stdout, parts);
        self
    }

    /// [`CommandRun::assert_stdout_has`] for its stderr.
    pub fn assert_stderr_has(&self, parts: &[&str]) -> &CommandRun {
        assert_holds("stderr", &self.stderr, parts);
        self
    }

    /// The one line of its stdout that starts with `prefix` (asserted to be one).
    pub fn only_line(&self, prefix: &str) -> &str {
        let lines = self.lines(prefix);
        assert_eq!(lines.len(), 1, "{}", self.stdout);
        lines[0]
    }

    /// The one line of its stdout that starts like `expected` up to its first `": "`,
    /// asserted to start with the whole of `expected`.
    pub fn only_line_starting(&self, expected: &str) -> &str {
        let prefix = expected.split_inclusive(": ").next().unwrap_or(expected);
        let line = self.only_line(prefix);
        assert!(line.starts_with(expected), "{expected:?}\n{}", self.stdout);
        line
    }

    /// The lines of its stdout that start with `prefix`.
    pub fn lines(&self, prefix: &str) -> Vec<&str> {
        self.stdout
            .lines()
            .filter(|l| l.starts_with(prefix))
            .collect()
    }
}

/// The number a summary line puts right before `what` (`3 stored again`, ...).
pub fn counted(stdout: &str, what: &str) -> u64 {
    let at = stdout
        .find(what)
        .unwrap_or_else(|| panic!("no {what:?} in {stdout}"));
    stdout[..at]
        .trim_end()
        .rsplit([' ', ','])
        .next()
        .unwrap_or_default()
        .parse()
        .unwrap_or_else(|_| panic!("no count before {what:?} in {stdout}"))
}
