//! The streaming process.

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
