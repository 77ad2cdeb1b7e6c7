//! The streaming process: `outbox-relay run` (and `init`, its checks and creations alone).
//! [`pipeline`] runs a session as a list of steps (lease, connections, checks, resume plan,
//! reader and sink) and restarts it on failure; [`lease`] holds the slot's advisory lock
//! (L1, L2); [`bootstrap`] checks and creates the publication, slot and stream (B1–B3);
//! [`backfill`] publishes the table's rows when the first session creates the slot (F1–F5;
//! its [`backfill::range`] is also the `outbox-relay backfill` command), recording the slot's
//! [`boundary`] for `verify`; [`identity`] watches the table's identity (V1–V5) and
//! [`monitor`] polls the slot and logs backlog progress; [`heartbeat`] writes the optional WAL
//! heartbeats; [`mark`] sets acknowledged rows `published` and [`retention`] deletes old
//! confirmed rows; [`stored`] checks what the stream says is stored against the table before
//! a session skips by it, and reads a row back as the relay reads it (for `verify` and
//! `replay` too); [`atomic`] checks that the server and the stream take atomic batches
//! (`--atomic-transactions`, X1–X2).
//!
//! May use: `config`, `error`, `connect`, `observe`. Inside, [`pipeline`] sits on top and
//! uses the others; `backfill` uses `bootstrap` and `boundary`, `monitor` uses `identity`,
//! which uses `bootstrap`, which uses `atomic`. Never uses `commands`: the commands use the process's pieces.

pub mod atomic;
pub mod backfill;
pub mod bootstrap;
pub mod boundary;
pub mod heartbeat;
pub mod identity;
pub mod lease;
pub mod mark;
pub mod monitor;
pub mod pipeline;
pub mod retention;
pub mod stored;
