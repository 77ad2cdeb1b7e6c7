//! The relay harness: everything the end-to-end tests, the fault tests and the benchmark
//! share on top of the servers.
//!
//! - [`case`]: a *case* is one test's slice of the servers (a database with the seed's
//!   table, a slot, a publication, a stream, a subject prefix) and runs the real
//!   `outbox-relay` binary on it; [`servers`] are the pair shared by a test binary.
//! - [`relay`]: a relay process killed and started again, keeping every run's output.
//! - [`stream`]: what the stream holds, read back.
//! - [`writers`]: writing outbox rows, one transaction at a time or by continuous writers,
//!   each transaction recorded with what its client knows of its outcome.
//! - [`faithful`]: whether the stream is a faithful copy of what was committed: each
//!   committed row exactly once, in commit order, nothing rolled back, and the slot never
//!   confirmed past an event that was not stored.
//! - [`logs`]: reading the relay's log (colour escapes, timestamps, markers).
//! - [`tables`]: outbox tables of other shapes (Debezium's, a text-id one) and their
//!   settings; running the relay's one-shot subcommands.
//!
//! Unlike the servers, this layer is async: it talks to Postgres and JetStream as a client
//! (tokio, `tokio-postgres`, `async-nats`). Waiting is always on a condition with a deadline
//! ([`eventually`], [`crate::Process::wait_for_output`]); nothing sleeps and hopes.
//!
//! `tests/support/mod.rs` re-exports this module for the end-to-end tests.

pub mod case;
pub mod faithful;
pub mod logs;
pub mod relay;
pub mod stream;
pub mod tables;
pub mod writers;

pub use case::{
    assert_relay_sessions_use_tls, assert_wrong_password_fails_without_printing_it, built_relay,
    eventually, exits_with, jetstream_at, jetstream_with_timeout, new_case, relay_bin,
    relay_command, relay_one_row_as_superuser, servers, sql_connect, sql_connect_retrying,
    succeeds, target_profile_dir, wal_lsn, Case, Relayed, Servers, DEADLINE, SCHEMA_SQL,
    TRIGGER_SQL,
};
pub use faithful::{check_faithful, check_stream, Findings, Sample, Sampler};
pub use logs::{
    assert_contains_all, last_lines, lines_with, min_median_max, parse_rfc3339_utc, strip_ansi,
    timed_log_lines, SESSION_ENDED, STREAMING,
};
pub use relay::Relay;
pub use stream::{publish_acked, read_stream, stream_tail, update_stream_setting, Stored};
pub use tables::{
    counted, partitioned_outbox_table, CommandRun, DEBEZIUM_ENV, DEBEZIUM_TABLE, TEXT_ENV,
    TEXT_TABLE,
};
pub use writers::{
    assert_matches_row, attempt, insert_oversized_row, insert_row, insert_transaction,
    replay_ahead_then_relay, rows, rows_by_id, sql_column, sql_value, write_transaction, Attempt,
    Ledger, Outcome, Plan, Row, TxRecord, WriterLog, Writers, MIXED_SIZES, ROLLBACK_EVERY,
    ROW_COLUMNS,
};
