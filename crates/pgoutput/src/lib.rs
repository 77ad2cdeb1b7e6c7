//! Pure decoding of what a Postgres walsender sends a logical replication client.
//!
//! Two layers, both I/O-free (no tokio, no logging):
//! - [`copy_data`]: the streaming-replication messages inside CopyData
//!   (`XLogData`, `PrimaryKeepalive`, and the client's `StandbyStatusUpdate`);
//! - [`logical`]: the pgoutput protocol version 1 messages carried by `XLogData`
//!   (<https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html>).
//!
//! # Invariants
//! - G1 Total: every function here returns a value or a [`DecodeError`] for any input; none
//!   panics, and none allocates from a length read off the wire before checking that the
//!   bytes are there.
//! - G2 Zero-copy: column values and XLogData payloads are `Bytes` slices of the received buffer.
//! - G3 Positions are [`Lsn`]s, never bare integers.

pub mod copy_data;
mod error;
pub mod logical;
mod lsn;

pub use copy_data::{
    PgTimestamp, PrimaryKeepalive, ReplicationMessage, StandbyStatusUpdate, XLogData,
};
pub use error::DecodeError;
pub use logical::{
    Begin, Column, ColumnRef, ColumnValue, Commit, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, OldTuple, Origin, Relation, Truncate, TupleData, TupleIter, TypeMessage,
    Update,
};
pub use lsn::{Lsn, ParseLsnError};
