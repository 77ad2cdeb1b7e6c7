//! Observation: what the relay counts and shows, and how it logs. [`logging`] sets up the
//! logs (colour only on a terminal) and scrubs secrets from them (LOG1); [`metrics`] counts
//! what happens and reads the rest when scraped; [`http`] serves metrics and health on
//! `--metrics-addr` (and `outbox-relay probe`'s request).
//!
//! May use: `config`, `error`. The streaming process reports into it; it never reaches into
//! the process or the commands (what it shows of them is handed to it, or read from shared
//! atomics and watches the process gives it).

pub mod http;
pub mod logging;
pub mod metrics;
