//! The commands users run once, each over the server rooms (`postgres`, `stream`) and
//! `setup`: [`status`] reads and judges the slot, publication, lease and stream (`outbox-relay
//! status`); [`verify`] reconciles the table with the stream (`outbox-relay verify`);
//! [`replay`] re-publishes a range of rows (`outbox-relay replay`, using `verify`'s reading of
//! the stream and the table); [`backfill`] publishes a range of rows on an existing slot
//! (`outbox-relay backfill`); [`init`] checks and creates the publication, slot and stream
//! (`outbox-relay init`). The binary dispatches the rest itself: `config` prints the effective
//! configuration and `probe` asks a running relay's health endpoint (`observe::http::get`).
//!
//! May use: `config`, `error`, `connect`, `observe`, `postgres`, `stream`, `setup`; never
//! `process` (`.ci/check-structure` keeps it so); nothing below uses it. Inside, `replay` uses
//! `verify`, never the reverse.

pub mod backfill;
pub mod init;
pub mod replay;
pub mod status;
pub mod verify;
