//! The JetStream stream: its settings and the policy the relay keeps about them.
//!
//! - [`policy`]: the stream checked, or created when missing (and allowed) with the
//!   configured settings (replicas, storage, limits, discard, duplicate window), the table
//!   mapping's record in its description, and what its settings (subjects, storage,
//!   persistence, retention, limits) mean for the events, said at every start.
//! - [`atomic`]: whether the server and the stream take atomic and fast-ingest batches
//!   (`--atomic-transactions`, `--fast-ingest`, AT1–AT3).
//!
//! May use: `config`, `error`, `observe`. Never uses `postgres`, `setup`, `process` or
//! `commands`: they stand on it.

pub mod atomic;
pub mod policy;
