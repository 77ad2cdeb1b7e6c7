//! The streaming process: `outbox-relay run`. [`pipeline`] runs a session as a list of
//! steps (lease, connections, setup, resume plan, reader and sink) and restarts it on
//! failure; [`identity`] watches the table's identity (TI1–TI5) and [`monitor`] polls the slot
//! and logs backlog progress; [`heartbeat`] writes the optional WAL heartbeats; [`protection`]
//! watches that a standby keeps a copy of a fail-over slot; [`mark`] sets
//! acknowledged rows `published` and [`retention`] deletes old confirmed rows.
//!
//! May use: `config`, `error`, `connect`, `observe`, and the server rooms `postgres` and
//! `stream` with `setup` (what the first session checks and creates, the backfill at slot
//! creation included). Inside, [`pipeline`] sits on top and uses the others; `monitor` uses
//! `identity`. Never uses `commands`: the commands stand on the server rooms, not on the
//! process.

pub mod heartbeat;
pub mod identity;
pub mod mark;
pub mod monitor;
pub mod pipeline;
pub mod protection;
pub mod retention;
