//! The relay's counters. Named here once; the Prometheus endpoint (a later issue) exposes
//! them under these names, and log lines that bump one carry its name as `metric`.

use std::sync::atomic::AtomicU64;

/// Sessions that could not read a position from the stream's tail and fell back to
/// de-duplication by `Nats-Msg-Id` only.
pub static TAIL_UNREADABLE: AtomicU64 = AtomicU64::new(0);
/// Metric name of [`TAIL_UNREADABLE`].
pub const TAIL_UNREADABLE_NAME: &str = "outbox_relay_tail_unreadable_total";

/// Stored positions (the stream's tail, or what an earlier session acknowledged) not used
/// to skip because they lie beyond the server's WAL end.
pub static TAIL_REJECTED: AtomicU64 = AtomicU64::new(0);
/// Metric name of [`TAIL_REJECTED`].
pub const TAIL_REJECTED_NAME: &str = "outbox_relay_tail_rejected_total";

/// Shared-mode sessions whose oldest replayable event was older than the duplicate window.
pub static DEDUPE_WINDOW_EXCEEDED: AtomicU64 = AtomicU64::new(0);
/// Metric name of [`DEDUPE_WINDOW_EXCEEDED`].
pub const DEDUPE_WINDOW_EXCEEDED_NAME: &str = "outbox_relay_dedupe_window_exceeded_total";
