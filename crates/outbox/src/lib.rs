//! What the relay publishes for an outbox row: the seed's keys, the shard, the subject and
//! the headers, as pure functions of the row.
//!
//! No I/O: this crate depends on the pgoutput decoder's data types and nothing async.
//!
//! # Invariants
//! - K1–K3 ([`keys`]): keys and shard are byte-identical to the seed's `compute_keys` and
//!   `shard_for_key`, for every vector in `shared/seed/key-vectors.json`.
//! - TS1–TS2 ([`timestamp`]): `created_at` milliseconds are exact integers.
//! - SUB1–SUB2 ([`subject`]): the subject token escaping is injective and NATS-safe.
//! - SRC1–SRC2 ([`source`]): the `Outbox-Source` value names the WAL history (cluster,
//!   timeline, database, slot) and is header-safe.
//! - D1–D7 ([`framer`]): replication messages become events and transaction boundaries in
//!   replication order; nothing the relay cannot place is skipped.
//! - E1–E3 ([`event`]): only the row is trusted, the payload is passed through unchanged,
//!   and a row that cannot be represented faithfully is an error, never altered.
//! - H1–H4 ([`encoding`]): header values no row can subvert; a hostile row's values are
//!   percent-encoded, exactly recoverable.
//! - MAP1–MAP4 ([`mapping`]): the user's table and settings; the default is the seed's.
//! - ID1–ID3 ([`id`]): integer ids keep the seed's keys; uuid and text ids its formulas.
//! - TPL1–TPL3 ([`template`]): subject templates stay under the prefix, one token per
//!   placeholder, escaped.
//! - CE1–CE3 ([`cloudevents`]): CloudEvents attributes are functions of the row and the
//!   configured source, stable across replays.

pub mod cloudevents;
pub mod encoding;
pub mod event;
pub mod framer;
pub mod headers;
pub mod id;
pub mod keys;
pub mod mapping;
mod percent;
pub mod properties;
pub mod source;
pub mod subject;
pub mod template;
pub mod timestamp;

pub use event::{
    EventBuilder, EventError, EventErrorKind, OutboxColumns, OutboxEvent, OutboxRow, Position,
    SchemaError,
};
pub use framer::{FrameError, Framer, Item, KnownRelations, Notice, TableName};
pub use id::EventId;
pub use keys::{compute_keys, ordering_key, shard_for_key, Keys};
pub use mapping::{IdKind, Mapping, PayloadKind, Preset, Role};
/// The LSN type of [`Position::commit_lsn`], so users of positions need not know the decoder.
pub use pgoutput::Lsn;
pub use template::SubjectTemplate;
