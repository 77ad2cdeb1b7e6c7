//! The commands users run once, over the process's pieces: [`status`] reads and judges the
//! slot, publication, lease and stream (`outbox-relay status`); [`verify`] reconciles the
//! table with the stream (`outbox-relay verify`); [`replay`] re-publishes a range of rows
//! (`outbox-relay replay`, using `verify`'s reading of the stream and the table). The
//! binary dispatches the others to what already does them: `init` is
//! `process::pipeline::init`, `backfill` is `process::backfill::range`, `config` prints the
//! effective configuration (`config`) and `probe` asks a running relay's health endpoint
//! (`observe::http::get`).
//!
//! May use: every other room (`config`, `error`, `connect`, `observe`, `process`); nothing
//! below uses it. Inside, `replay` uses `verify`, never the reverse.

pub mod replay;
pub mod status;
pub mod verify;
