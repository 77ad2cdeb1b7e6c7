//! The pgoutput logical replication protocol, version 1
//! (<https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html>): the
//! messages a `pgoutput` slot puts in the `data` of each `XLogData`.
//!
//! Only protocol version 1 is decoded: the streaming messages of version 2 (`S`, `E`, `c`,
//! `A`) and the xid fields they add to other messages are unknown here, so a stream started
//! with `proto_version '2', streaming 'on'` fails at its first Stream Start (`UnknownTag`)
//! instead of being misread.
//!
//! # Invariants
//! - Total: [`LogicalMessage::decode`] returns a message or a [`DecodeError`] for any bytes; it
//!   never panics. Every fixed-size field is length-checked before it is read, strings must
//!   have their NUL terminator inside the message, signed lengths are rejected when negative
//!   (never cast), and a message with bytes left after its last field is an error.
//! - Bounded: nothing is allocated from a count read off the wire before the bytes that count
//!   announces are known to be there (capacities are capped by the bytes remaining divided by
//!   the smallest encoding of one element).
//! - Zero-copy: [`TupleData`], [`ColumnValue::Text`], [`ColumnValue::Binary`] and
//!   [`LogicalDecodingMessage::content`] are `Bytes` slices of the decoded buffer. Decoding and
//!   iterating a `TupleData` allocates nothing; [`TupleIter::next_ref`] and [`ColumnRef`]
//!   borrow a column without touching the buffer's reference count (each `Bytes` slice is an
//!   atomic increment and, dropped, a decrement), and [`TupleData::share`] turns the part of
//!   it that is kept into a `Bytes` slice.
//! - Validated tuples: `decode` walks each tuple once and checks every column against the bytes
//!   that remain; a `TupleData` can only be built that way, so iterating it cannot fail.

use std::fmt;
use std::iter::FusedIterator;
use std::ops::Range;

use bytes::{Buf, Bytes};

pub use crate::copy_data::PgTimestamp;
use crate::{DecodeError, Lsn};

/// Tag of a [`Begin`] message.
pub const BEGIN_TAG: u8 = b'B';
/// Tag of a [`Commit`] message.
pub const COMMIT_TAG: u8 = b'C';
/// Tag of an [`Origin`] message.
pub const ORIGIN_TAG: u8 = b'O';
/// Tag of a [`Relation`] message.
pub const RELATION_TAG: u8 = b'R';
/// Tag of a [`TypeMessage`].
pub const TYPE_TAG: u8 = b'Y';
/// Tag of an [`Insert`] message.
pub const INSERT_TAG: u8 = b'I';
/// Tag of an [`Update`] message.
pub const UPDATE_TAG: u8 = b'U';
/// Tag of a [`Delete`] message.
pub const DELETE_TAG: u8 = b'D';
/// Tag of a [`Truncate`] message.
pub const TRUNCATE_TAG: u8 = b'T';
/// Tag of a [`LogicalDecodingMessage`] (`pg_logical_emit_message`).
pub const MESSAGE_TAG: u8 = b'M';

/// Marks the new tuple of an Insert or Update.
pub const NEW_TUPLE_TAG: u8 = b'N';
/// Marks an old tuple holding only the replica identity key ([`OldTuple::Key`]).
pub const KEY_TUPLE_TAG: u8 = b'K';
/// Marks an old tuple holding the whole row ([`OldTuple::Full`], `REPLICA IDENTITY FULL`).
pub const OLD_TUPLE_TAG: u8 = b'O';

/// Column kind: SQL NULL.
pub const COLUMN_NULL_TAG: u8 = b'n';
/// Column kind: an unchanged TOASTed value the server did not send.
pub const COLUMN_UNCHANGED_TOAST_TAG: u8 = b'u';
/// Column kind: a value in the type's text output format.
pub const COLUMN_TEXT_TAG: u8 = b't';
/// Column kind: a value in the type's binary send format (`binary 'true'`).
pub const COLUMN_BINARY_TAG: u8 = b'b';

/// [`Column::flags`] bit: the column is part of the replica identity.
pub const COLUMN_FLAG_KEY: u8 = 1;
/// [`Truncate::options`] bit: `TRUNCATE ... CASCADE`.
pub const TRUNCATE_CASCADE: u8 = 1;
/// [`Truncate::options`] bit: `TRUNCATE ... RESTART IDENTITY`.
pub const TRUNCATE_RESTART_IDENTITY: u8 = 2;
/// [`LogicalDecodingMessage::flags`] bit: the message was emitted transactionally.
pub const MESSAGE_TRANSACTIONAL: u8 = 1;

/// [`Relation::replica_identity`]: the primary key (`REPLICA IDENTITY DEFAULT`).
pub const REPLICA_IDENTITY_DEFAULT: u8 = b'd';
/// [`Relation::replica_identity`]: no old values at all.
pub const REPLICA_IDENTITY_NOTHING: u8 = b'n';
/// [`Relation::replica_identity`]: every column.
pub const REPLICA_IDENTITY_FULL: u8 = b'f';
/// [`Relation::replica_identity`]: the columns of a chosen unique index.
pub const REPLICA_IDENTITY_INDEX: u8 = b'i';

/// One pgoutput protocol version 1 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    /// `B`: a transaction starts.
    Begin(Begin),
    /// `C`: the transaction commits.
    Commit(Commit),
    /// `O`: the transaction was replayed from another node (follows `Begin`).
    Origin(Origin),
    /// `R`: a relation's schema, sent before its first change in the session and on change.
    Relation(Relation),
    /// `Y`: a non-builtin column type, sent before the relation that uses it.
    Type(TypeMessage),
    /// `I`: a row was inserted.
    Insert(Insert),
    /// `U`: a row was updated.
    Update(Update),
    /// `D`: a row was deleted.
    Delete(Delete),
    /// `T`: relations were truncated.
    Truncate(Truncate),
    /// `M`: `pg_logical_emit_message` (only with `messages 'true'`).
    Message(LogicalDecodingMessage),
}

/// `B`: the start of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    /// The LSN of the commit record; equals the `commit_lsn` of the matching [`Commit`].
    pub final_lsn: Lsn,
    /// Commit timestamp of the transaction.
    pub commit_time: PgTimestamp,
    /// Transaction id.
    pub xid: u32,
}

/// `C`: the end of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Unused by the server (always 0).
    pub flags: u8,
    /// The LSN of the commit record.
    pub commit_lsn: Lsn,
    /// The end of the commit record: the position to confirm once the transaction is done.
    pub end_lsn: Lsn,
    /// Commit timestamp of the transaction.
    pub commit_time: PgTimestamp,
}

/// `O`: the transaction originated on another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The commit LSN on the origin server (`0/0` when the origin did not set one).
    pub commit_lsn: Lsn,
    /// Name of the replication origin.
    pub name: String,
}

/// `R`: the schema of a relation; later messages refer to it by `rel_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// OID of the relation.
    pub rel_id: u32,
    /// Schema name (empty for `pg_catalog`).
    pub namespace: String,
    /// Relation name.
    pub name: String,
    /// `REPLICA_IDENTITY_*`: `d`, `n`, `f` or `i`.
    pub replica_identity: u8,
    /// The published columns, in tuple order.
    pub columns: Vec<Column>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// [`COLUMN_FLAG_KEY`] or 0.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// OID of the column's data type.
    pub type_oid: u32,
    /// `atttypmod` (-1 when the type has none).
    pub type_modifier: i32,
}

impl Column {
    /// The column is part of the replica identity (for `REPLICA IDENTITY FULL`: every column).
    pub fn is_key(&self) -> bool {
        self.flags & COLUMN_FLAG_KEY != 0
    }
}

/// `Y`: a column type that is not built in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    /// OID of the type.
    pub type_oid: u32,
    /// Schema name (empty for `pg_catalog`).
    pub namespace: String,
    /// Type name.
    pub name: String,
}

/// `I`: an inserted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// OID of the relation (see [`Relation`]).
    pub rel_id: u32,
    /// The new row.
    pub new_tuple: TupleData,
}

/// `U`: an updated row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// OID of the relation (see [`Relation`]).
    pub rel_id: u32,
    /// The old key (when the key changed) or old row (`REPLICA IDENTITY FULL`), if sent.
    pub old_tuple: Option<OldTuple>,
    /// The new row; unchanged TOASTed columns are [`ColumnValue::UnchangedToast`].
    pub new_tuple: TupleData,
}

/// `D`: a deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// OID of the relation (see [`Relation`]).
    pub rel_id: u32,
    /// The deleted row's key or whole row.
    pub old_tuple: OldTuple,
}

/// The old values of an updated or deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// `K`: the replica identity columns; every other column is null.
    Key(TupleData),
    /// `O`: the whole old row (`REPLICA IDENTITY FULL`).
    Full(TupleData),
}

impl OldTuple {
    /// The tuple, whichever kind it is.
    pub fn tuple(&self) -> &TupleData {
        match self {
            OldTuple::Key(t) | OldTuple::Full(t) => t,
        }
    }
}

/// `T`: truncated relations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// [`TRUNCATE_CASCADE`] | [`TRUNCATE_RESTART_IDENTITY`].
    pub options: u8,
    /// OIDs of the truncated relations.
    pub rel_ids: Vec<u32>,
}

impl Truncate {
    /// `TRUNCATE ... CASCADE`.
    pub fn cascade(&self) -> bool {
        self.options & TRUNCATE_CASCADE != 0
    }

    /// `TRUNCATE ... RESTART IDENTITY`.
    pub fn restart_identity(&self) -> bool {
        self.options & TRUNCATE_RESTART_IDENTITY != 0
    }
}

/// `M`: a message written with `pg_logical_emit_message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// [`MESSAGE_TRANSACTIONAL`] or 0.
    pub flags: u8,
    /// The LSN of the message.
    pub lsn: Lsn,
    /// The prefix given to `pg_logical_emit_message`.
    pub prefix: String,
    /// The content (zero-copy).
    pub content: Bytes,
}

impl LogicalDecodingMessage {
    /// Emitted transactionally: delivered inside its transaction, and only if it commits.
    pub fn transactional(&self) -> bool {
        self.flags & MESSAGE_TRANSACTIONAL != 0
    }
}

/// One column of a [`TupleData`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// `n`: SQL NULL.
    Null,
    /// `u`: a TOASTed value that did not change; the server does not resend it.
    UnchangedToast,
    /// `t`: the value in its type's text format (zero-copy).
    Text(Bytes),
    /// `b`: the value in its type's binary format (zero-copy).
    Binary(Bytes),
}

/// One column of a [`TupleData`], borrowed ([`TupleIter::next_ref`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnRef<'a> {
    /// `n`: SQL NULL.
    Null,
    /// `u`: a TOASTed value that did not change; the server does not resend it.
    UnchangedToast,
    /// `t`: the value in its type's text format.
    Text(&'a [u8]),
    /// `b`: the value in its type's binary format.
    Binary(&'a [u8]),
}

/// A validated tuple: decode walks it once and checks every length against what remains;
/// afterwards iteration cannot fail.
///
/// Holds the raw column bytes (a zero-copy slice of the message) and the column count.
/// [`TupleData::iter`] re-walks them; [`TupleData::get`] walks up to the column asked for,
/// so reading every column is best done with one `iter()`.
#[derive(Clone, PartialEq, Eq)]
pub struct TupleData {
    /// The columns after the Int16 count, validated.
    raw: Bytes,
    column_count: u16,
}

impl TupleData {
    /// Number of columns.
    pub fn len(&self) -> usize {
        usize::from(self.column_count)
    }

    /// The tuple has no columns.
    pub fn is_empty(&self) -> bool {
        self.column_count == 0
    }

    /// The columns in order.
    pub fn iter(&self) -> TupleIter<'_> {
        TupleIter {
            raw: &self.raw,
            pos: 0,
            left: self.column_count,
        }
    }

    /// The column at `index`, or `None` past the end.
    pub fn get(&self, index: usize) -> Option<ColumnValue> {
        self.iter().nth(index)
    }

    /// `part`, a column borrowed from this tuple ([`ColumnRef`]) or a part of one, as a
    /// zero-copy `Bytes` slice; `None` if it does not lie within this tuple's bytes.
    pub fn share(&self, part: &[u8]) -> Option<Bytes> {
        let start = (part.as_ptr() as usize).checked_sub(self.raw.as_ptr() as usize)?;
        let end = start.checked_add(part.len())?;
        (end <= self.raw.len()).then(|| self.raw.slice(start..end))
    }

    /// Validates the tuple at the start of `buf` and splits it off.
    fn decode(buf: &mut Bytes) -> Result<Self, DecodeError> {
        need(buf, 2, "tuple column count")?;
        let column_count = buf.get_u16();
        let mut pos = 0;
        for _ in 0..column_count {
            pos = step(buf, pos)?.1;
        }
        Ok(TupleData {
            raw: buf.split_to(pos),
            column_count,
        })
    }
}

impl fmt::Debug for TupleData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a TupleData {
    type Item = ColumnValue;
    type IntoIter = TupleIter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Iterator over the columns of a [`TupleData`]; yields zero-copy values.
#[derive(Debug, Clone)]
pub struct TupleIter<'a> {
    raw: &'a Bytes,
    pos: usize,
    left: u16,
}

impl<'a> TupleIter<'a> {
    /// Steps over one column. `None` only at the end (the tuple was validated; should it
    /// somehow not step, the iterator ends rather than panics).
    fn advance_one(&mut self) -> Option<RawColumn> {
        self.left = self.left.checked_sub(1)?;
        match step(self.raw, self.pos) {
            Ok((column, next)) => {
                self.pos = next;
                Some(column)
            }
            Err(_) => {
                self.left = 0;
                None
            }
        }
    }

    /// The next column, borrowed: no reference count is touched ([`TupleData::share`] makes
    /// a `Bytes` of what is kept).
    pub fn next_ref(&mut self) -> Option<ColumnRef<'a>> {
        let raw: &'a Bytes = self.raw;
        Some(match self.advance_one()? {
            RawColumn::Null => ColumnRef::Null,
            RawColumn::UnchangedToast => ColumnRef::UnchangedToast,
            RawColumn::Text(range) => ColumnRef::Text(&raw[range]),
            RawColumn::Binary(range) => ColumnRef::Binary(&raw[range]),
        })
    }

    fn value(&self, column: RawColumn) -> ColumnValue {
        // `step` only returns ranges it checked against `raw`, so `slice` cannot panic.
        match column {
            RawColumn::Null => ColumnValue::Null,
            RawColumn::UnchangedToast => ColumnValue::UnchangedToast,
            RawColumn::Text(range) => ColumnValue::Text(self.raw.slice(range)),
            RawColumn::Binary(range) => ColumnValue::Binary(self.raw.slice(range)),
        }
    }
}

impl Iterator for TupleIter<'_> {
    type Item = ColumnValue;

    fn next(&mut self) -> Option<ColumnValue> {
        let column = self.advance_one()?;
        Some(self.value(column))
    }

    fn nth(&mut self, n: usize) -> Option<ColumnValue> {
        // Skip without slicing (no reference-count traffic for the skipped values).
        for _ in 0..n {
            self.advance_one()?;
        }
        self.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::from(self.left);
        (left, Some(left))
    }
}

impl ExactSizeIterator for TupleIter<'_> {}
impl FusedIterator for TupleIter<'_> {}

/// A column located in a tuple's bytes, before slicing.
enum RawColumn {
    Null,
    UnchangedToast,
    Text(Range<usize>),
    Binary(Range<usize>),
}

/// Reads the column starting at `pos` of `raw`: returns it and the position after it.
/// The one place that knows the column encoding; used to validate and to iterate.
fn step(raw: &[u8], pos: usize) -> Result<(RawColumn, usize), DecodeError> {
    let rest = raw.get(pos..).unwrap_or_default();
    let Some(&kind) = rest.first() else {
        return Err(DecodeError::Truncated {
            what: "tuple column kind",
            need: 1,
            have: 0,
        });
    };
    let after_kind = pos + 1;
    match kind {
        COLUMN_NULL_TAG => Ok((RawColumn::Null, after_kind)),
        COLUMN_UNCHANGED_TOAST_TAG => Ok((RawColumn::UnchangedToast, after_kind)),
        COLUMN_TEXT_TAG | COLUMN_BINARY_TAG => {
            let rest = rest.get(1..).unwrap_or_default();
            let Some(len_bytes) = rest.first_chunk::<4>() else {
                return Err(DecodeError::Truncated {
                    what: "tuple column length",
                    need: 4,
                    have: rest.len(),
                });
            };
            let len = non_negative(i32::from_be_bytes(*len_bytes), "tuple column length")?;
            let have = rest.len() - 4;
            if have < len {
                return Err(DecodeError::Truncated {
                    what: "tuple column value",
                    need: len,
                    have,
                });
            }
            let start = after_kind + 4;
            let range = start..start + len;
            Ok(if kind == COLUMN_TEXT_TAG {
                (RawColumn::Text(range.clone()), range.end)
            } else {
                (RawColumn::Binary(range.clone()), range.end)
            })
        }
        tag => Err(DecodeError::UnknownTag {
            context: "tuple column kind",
            tag,
        }),
    }
}

impl LogicalMessage {
    /// Decodes one pgoutput v1 message (the `data` of one `XLogData`).
    pub fn decode(mut data: Bytes) -> Result<LogicalMessage, DecodeError> {
        let Some(&tag) = data.first() else {
            return Err(DecodeError::Truncated {
                what: "pgoutput message tag",
                need: 1,
                have: 0,
            });
        };
        data.advance(1);
        let buf = &mut data;
        let (message, what) = match tag {
            BEGIN_TAG => (Self::Begin(decode_begin(buf)?), "Begin message"),
            COMMIT_TAG => (Self::Commit(decode_commit(buf)?), "Commit message"),
            ORIGIN_TAG => (Self::Origin(decode_origin(buf)?), "Origin message"),
            RELATION_TAG => (Self::Relation(decode_relation(buf)?), "Relation message"),
            TYPE_TAG => (Self::Type(decode_type(buf)?), "Type message"),
            INSERT_TAG => (Self::Insert(decode_insert(buf)?), "Insert message"),
            UPDATE_TAG => (Self::Update(decode_update(buf)?), "Update message"),
            DELETE_TAG => (Self::Delete(decode_delete(buf)?), "Delete message"),
            TRUNCATE_TAG => (Self::Truncate(decode_truncate(buf)?), "Truncate message"),
            MESSAGE_TAG => (
                Self::Message(decode_message(buf)?),
                "logical decoding message",
            ),
            tag => {
                return Err(DecodeError::UnknownTag {
                    context: "pgoutput message",
                    tag,
                })
            }
        };
        if data.has_remaining() {
            return Err(DecodeError::Invalid {
                what,
                detail: format!("{} trailing bytes after the last field", data.remaining()),
            });
        }
        Ok(message)
    }
}

fn decode_begin(buf: &mut Bytes) -> Result<Begin, DecodeError> {
    need(buf, 20, "Begin")?;
    Ok(Begin {
        final_lsn: Lsn(buf.get_u64()),
        commit_time: buf.get_i64(),
        xid: buf.get_u32(),
    })
}

fn decode_commit(buf: &mut Bytes) -> Result<Commit, DecodeError> {
    need(buf, 25, "Commit")?;
    Ok(Commit {
        flags: buf.get_u8(),
        commit_lsn: Lsn(buf.get_u64()),
        end_lsn: Lsn(buf.get_u64()),
        commit_time: buf.get_i64(),
    })
}

fn decode_origin(buf: &mut Bytes) -> Result<Origin, DecodeError> {
    need(buf, 8, "Origin commit LSN")?;
    let commit_lsn = Lsn(buf.get_u64());
    let name = string(buf, "Origin name")?;
    Ok(Origin { commit_lsn, name })
}

/// The smallest encoding of one Relation column: flags, empty name's NUL, type OID, typmod.
const MIN_RELATION_COLUMN_LEN: usize = 1 + 1 + 4 + 4;

fn decode_relation(buf: &mut Bytes) -> Result<Relation, DecodeError> {
    need(buf, 4, "Relation id")?;
    let rel_id = buf.get_u32();
    let namespace = string(buf, "Relation namespace")?;
    let name = string(buf, "Relation name")?;
    need(buf, 3, "Relation replica identity and column count")?;
    let replica_identity = buf.get_u8();
    let column_count = usize::from(buf.get_u16());
    let mut columns =
        Vec::with_capacity(column_count.min(buf.remaining() / MIN_RELATION_COLUMN_LEN));
    for _ in 0..column_count {
        need(buf, 1, "Relation column flags")?;
        let flags = buf.get_u8();
        let name = string(buf, "Relation column name")?;
        need(buf, 8, "Relation column type")?;
        columns.push(Column {
            flags,
            name,
            type_oid: buf.get_u32(),
            type_modifier: buf.get_i32(),
        });
    }
    Ok(Relation {
        rel_id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn decode_type(buf: &mut Bytes) -> Result<TypeMessage, DecodeError> {
    need(buf, 4, "Type OID")?;
    let type_oid = buf.get_u32();
    let namespace = string(buf, "Type namespace")?;
    let name = string(buf, "Type name")?;
    Ok(TypeMessage {
        type_oid,
        namespace,
        name,
    })
}

fn decode_insert(buf: &mut Bytes) -> Result<Insert, DecodeError> {
    need(buf, 5, "Insert relation id and tuple kind")?;
    let rel_id = buf.get_u32();
    match buf.get_u8() {
        NEW_TUPLE_TAG => {}
        tag => {
            return Err(DecodeError::UnknownTag {
                context: "Insert tuple kind",
                tag,
            })
        }
    }
    let new_tuple = TupleData::decode(buf)?;
    Ok(Insert { rel_id, new_tuple })
}

fn decode_update(buf: &mut Bytes) -> Result<Update, DecodeError> {
    need(buf, 5, "Update relation id and tuple kind")?;
    let rel_id = buf.get_u32();
    let old_tuple = match buf.get_u8() {
        NEW_TUPLE_TAG => None,
        KEY_TUPLE_TAG => Some(OldTuple::Key(TupleData::decode(buf)?)),
        OLD_TUPLE_TAG => Some(OldTuple::Full(TupleData::decode(buf)?)),
        tag => {
            return Err(DecodeError::UnknownTag {
                context: "Update tuple kind",
                tag,
            })
        }
    };
    if old_tuple.is_some() {
        need(buf, 1, "Update new tuple kind")?;
        match buf.get_u8() {
            NEW_TUPLE_TAG => {}
            tag => {
                return Err(DecodeError::UnknownTag {
                    context: "Update new tuple kind",
                    tag,
                })
            }
        }
    }
    let new_tuple = TupleData::decode(buf)?;
    Ok(Update {
        rel_id,
        old_tuple,
        new_tuple,
    })
}

fn decode_delete(buf: &mut Bytes) -> Result<Delete, DecodeError> {
    need(buf, 5, "Delete relation id and tuple kind")?;
    let rel_id = buf.get_u32();
    let old_tuple = match buf.get_u8() {
        KEY_TUPLE_TAG => OldTuple::Key(TupleData::decode(buf)?),
        OLD_TUPLE_TAG => OldTuple::Full(TupleData::decode(buf)?),
        tag => {
            return Err(DecodeError::UnknownTag {
                context: "Delete tuple kind",
                tag,
            })
        }
    };
    Ok(Delete { rel_id, old_tuple })
}

fn decode_truncate(buf: &mut Bytes) -> Result<Truncate, DecodeError> {
    need(buf, 5, "Truncate relation count and options")?;
    let count = non_negative(buf.get_i32(), "Truncate relation count")?;
    let options = buf.get_u8();
    need(buf, count.saturating_mul(4), "Truncate relation ids")?;
    let mut rel_ids = Vec::with_capacity(count);
    for _ in 0..count {
        rel_ids.push(buf.get_u32());
    }
    Ok(Truncate { options, rel_ids })
}

fn decode_message(buf: &mut Bytes) -> Result<LogicalDecodingMessage, DecodeError> {
    need(buf, 9, "Message flags and LSN")?;
    let flags = buf.get_u8();
    let lsn = Lsn(buf.get_u64());
    let prefix = string(buf, "Message prefix")?;
    need(buf, 4, "Message content length")?;
    let len = non_negative(buf.get_i32(), "Message content length")?;
    need(buf, len, "Message content")?;
    let content = buf.split_to(len);
    Ok(LogicalDecodingMessage {
        flags,
        lsn,
        prefix,
        content,
    })
}

fn need(buf: &[u8], need: usize, what: &'static str) -> Result<(), DecodeError> {
    if buf.len() < need {
        return Err(DecodeError::Truncated {
            what,
            need,
            have: buf.len(),
        });
    }
    Ok(())
}

/// A length field: Int32 on the wire, never negative.
fn non_negative(len: i32, what: &'static str) -> Result<usize, DecodeError> {
    usize::try_from(len).map_err(|_| DecodeError::Invalid {
        what,
        detail: format!("negative length {len}"),
    })
}

/// A NUL-terminated UTF-8 string. A string without its NUL is truncated: the message ended
/// inside it, so at least one more byte was needed.
fn string(buf: &mut Bytes, what: &'static str) -> Result<String, DecodeError> {
    let Some(nul) = buf.iter().position(|&b| b == 0) else {
        return Err(DecodeError::Truncated {
            what,
            need: buf.len() + 1,
            have: buf.len(),
        });
    };
    let text = std::str::from_utf8(&buf[..nul])
        .map_err(|e| DecodeError::Invalid {
            what,
            detail: format!("not UTF-8: {e}"),
        })?
        .to_owned();
    buf.advance(nul + 1);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use proptest::prelude::*;

    // ---- a test-only encoder -------------------------------------------------------------

    fn put_str(out: &mut BytesMut, s: &str) {
        out.put_slice(s.as_bytes());
        out.put_u8(0);
    }

    fn encode_columns(columns: &[ColumnValue]) -> BytesMut {
        let mut out = BytesMut::new();
        for c in columns {
            match c {
                ColumnValue::Null => out.put_u8(b'n'),
                ColumnValue::UnchangedToast => out.put_u8(b'u'),
                ColumnValue::Text(v) | ColumnValue::Binary(v) => {
                    out.put_u8(if matches!(c, ColumnValue::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    out.put_i32(i32::try_from(v.len()).unwrap());
                    out.put_slice(v);
                }
            }
        }
        out
    }

    fn tuple(columns: &[ColumnValue]) -> TupleData {
        TupleData {
            raw: encode_columns(columns).freeze(),
            column_count: u16::try_from(columns.len()).unwrap(),
        }
    }

    fn put_tuple(out: &mut BytesMut, t: &TupleData) {
        out.put_u16(t.column_count);
        out.put_slice(&t.raw);
    }

    fn put_old(out: &mut BytesMut, old: &OldTuple) {
        match old {
            OldTuple::Key(t) => {
                out.put_u8(b'K');
                put_tuple(out, t);
            }
            OldTuple::Full(t) => {
                out.put_u8(b'O');
                put_tuple(out, t);
            }
        }
    }

    fn encode(msg: &LogicalMessage) -> Bytes {
        let mut out = BytesMut::new();
        match msg {
            LogicalMessage::Begin(b) => {
                out.put_u8(b'B');
                out.put_u64(b.final_lsn.0);
                out.put_i64(b.commit_time);
                out.put_u32(b.xid);
            }
            LogicalMessage::Commit(c) => {
                out.put_u8(b'C');
                out.put_u8(c.flags);
                out.put_u64(c.commit_lsn.0);
                out.put_u64(c.end_lsn.0);
                out.put_i64(c.commit_time);
            }
            LogicalMessage::Origin(o) => {
                out.put_u8(b'O');
                out.put_u64(o.commit_lsn.0);
                put_str(&mut out, &o.name);
            }
            LogicalMessage::Relation(r) => {
                out.put_u8(b'R');
                out.put_u32(r.rel_id);
                put_str(&mut out, &r.namespace);
                put_str(&mut out, &r.name);
                out.put_u8(r.replica_identity);
                out.put_u16(u16::try_from(r.columns.len()).unwrap());
                for c in &r.columns {
                    out.put_u8(c.flags);
                    put_str(&mut out, &c.name);
                    out.put_u32(c.type_oid);
                    out.put_i32(c.type_modifier);
                }
            }
            LogicalMessage::Type(t) => {
                out.put_u8(b'Y');
                out.put_u32(t.type_oid);
                put_str(&mut out, &t.namespace);
                put_str(&mut out, &t.name);
            }
            LogicalMessage::Insert(i) => {
                out.put_u8(b'I');
                out.put_u32(i.rel_id);
                out.put_u8(b'N');
                put_tuple(&mut out, &i.new_tuple);
            }
            LogicalMessage::Update(u) => {
                out.put_u8(b'U');
                out.put_u32(u.rel_id);
                if let Some(old) = &u.old_tuple {
                    put_old(&mut out, old);
                }
                out.put_u8(b'N');
                put_tuple(&mut out, &u.new_tuple);
            }
            LogicalMessage::Delete(d) => {
                out.put_u8(b'D');
                out.put_u32(d.rel_id);
                put_old(&mut out, &d.old_tuple);
            }
            LogicalMessage::Truncate(t) => {
                out.put_u8(b'T');
                out.put_i32(i32::try_from(t.rel_ids.len()).unwrap());
                out.put_u8(t.options);
                for id in &t.rel_ids {
                    out.put_u32(*id);
                }
            }
            LogicalMessage::Message(m) => {
                out.put_u8(b'M');
                out.put_u8(m.flags);
                out.put_u64(m.lsn.0);
                put_str(&mut out, &m.prefix);
                out.put_i32(i32::try_from(m.content.len()).unwrap());
                out.put_slice(&m.content);
            }
        }
        out.freeze()
    }

    fn decode(raw: &[u8]) -> Result<LogicalMessage, DecodeError> {
        LogicalMessage::decode(Bytes::copy_from_slice(raw))
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    /// Every strict prefix is `Truncated`; one extra byte is `Invalid`; the whole decodes.
    fn assert_exact(msg: &LogicalMessage) {
        let raw = encode(msg);
        assert_eq!(LogicalMessage::decode(raw.clone()).as_ref(), Ok(msg));
        for cut in 0..raw.len() {
            let got = LogicalMessage::decode(raw.slice(..cut));
            assert!(
                matches!(got, Err(DecodeError::Truncated { .. })),
                "prefix of {cut}/{} bytes of {msg:?}: {got:?}",
                raw.len()
            );
        }
        let mut long = BytesMut::from(&raw[..]);
        long.put_u8(0);
        let got = LogicalMessage::decode(long.freeze());
        assert!(
            matches!(&got, Err(DecodeError::Invalid { detail, .. }) if detail.starts_with("1 trailing")),
            "{got:?}"
        );
    }

    fn truncated_what(raw: &[u8]) -> &'static str {
        match decode(raw) {
            Err(DecodeError::Truncated { what, .. }) => what,
            other => panic!("expected Truncated, got {other:?}"),
        }
    }

    fn sample_relation() -> Relation {
        Relation {
            rel_id: 16_385,
            namespace: "public".into(),
            name: "outbox_events".into(),
            replica_identity: REPLICA_IDENTITY_DEFAULT,
            columns: vec![
                Column {
                    flags: 1,
                    name: "id".into(),
                    type_oid: 20,
                    type_modifier: -1,
                },
                Column {
                    flags: 0,
                    name: "ent".into(),
                    type_oid: 1043,
                    type_modifier: 24,
                },
            ],
        }
    }

    fn sample_tuple() -> TupleData {
        tuple(&[
            text("42"),
            ColumnValue::Null,
            ColumnValue::UnchangedToast,
            ColumnValue::Binary(Bytes::from_static(&[0, 0, 1])),
            text(""),
        ])
    }

    // ---- per message ---------------------------------------------------------------------

    #[test]
    fn begin() {
        let mut raw = vec![b'B'];
        raw.extend_from_slice(&0x0000_0001_0000_00A0u64.to_be_bytes());
        raw.extend_from_slice(&(-5i64).to_be_bytes());
        raw.extend_from_slice(&777u32.to_be_bytes());
        assert_eq!(
            decode(&raw),
            Ok(LogicalMessage::Begin(Begin {
                final_lsn: Lsn(0x1_0000_00A0),
                commit_time: -5,
                xid: 777
            }))
        );
        assert_eq!(truncated_what(&raw[..20]), "Begin");
        assert_exact(&decode(&raw).unwrap());
    }

    #[test]
    fn commit() {
        let msg = LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x10),
            end_lsn: Lsn(0x38),
            commit_time: 1_000_000,
        });
        let raw = encode(&msg);
        assert_eq!(raw.len(), 26);
        assert_eq!(&raw[2..10], &0x10u64.to_be_bytes());
        assert_eq!(truncated_what(&raw[..25]), "Commit");
        assert_exact(&msg);
    }

    #[test]
    fn origin() {
        let msg = LogicalMessage::Origin(Origin {
            commit_lsn: Lsn(0xABCDEF),
            name: "node_a".into(),
        });
        assert_exact(&msg);
        let raw = encode(&msg);
        assert_eq!(truncated_what(&raw[..5]), "Origin commit LSN");
        assert_eq!(truncated_what(&raw[..12]), "Origin name");
        assert_eq!(
            decode(&raw[..raw.len() - 1]),
            Err(DecodeError::Truncated {
                what: "Origin name",
                need: 7,
                have: 6
            })
        );
        let mut bad = raw[..9].to_vec();
        bad.extend_from_slice(b"n\xffde\0");
        assert!(matches!(
            decode(&bad),
            Err(DecodeError::Invalid { what: "Origin name", detail }) if detail.contains("UTF-8")
        ));
    }

    #[test]
    fn relation() {
        let msg = LogicalMessage::Relation(sample_relation());
        assert_exact(&msg);
        let raw = encode(&msg);
        // 'R' | id(4) | "public\0"(7) | "outbox_events\0"(14) | ident | ncols(2) | columns
        assert_eq!(truncated_what(&raw[..3]), "Relation id");
        assert_eq!(truncated_what(&raw[..8]), "Relation namespace");
        assert_eq!(truncated_what(&raw[..20]), "Relation name");
        assert_eq!(
            truncated_what(&raw[..27]),
            "Relation replica identity and column count"
        );
        assert_eq!(truncated_what(&raw[..29]), "Relation column flags");
        assert_eq!(truncated_what(&raw[..31]), "Relation column name");
        assert_eq!(truncated_what(&raw[..33]), "Relation column type");
        let mut bad = raw.to_vec();
        bad[5] = 0xC3; // 'p' of "public" -> a lone UTF-8 lead byte
        assert!(matches!(
            decode(&bad),
            Err(DecodeError::Invalid {
                what: "Relation namespace",
                ..
            })
        ));
        let mut empty = raw[..27].to_vec();
        empty.extend_from_slice(&0u16.to_be_bytes());
        let LogicalMessage::Relation(r) = decode(&empty).unwrap() else {
            panic!()
        };
        assert!(r.columns.is_empty());
        assert!(sample_relation().columns[0].is_key());
        assert!(!sample_relation().columns[1].is_key());
    }

    #[test]
    fn relation_huge_column_count_does_not_allocate_up_front() {
        let mut raw = vec![b'R', 0, 0, 0, 1, 0, 0, b'd'];
        raw.extend_from_slice(&u16::MAX.to_be_bytes());
        assert_eq!(truncated_what(&raw), "Relation column flags");
    }

    #[test]
    fn type_message() {
        let msg = LogicalMessage::Type(TypeMessage {
            type_oid: 16_390,
            namespace: "public".into(),
            name: "mood".into(),
        });
        assert_exact(&msg);
        let raw = encode(&msg);
        assert_eq!(truncated_what(&raw[..4]), "Type OID");
        assert_eq!(truncated_what(&raw[..7]), "Type namespace");
        assert_eq!(truncated_what(&raw[..13]), "Type name");
    }

    #[test]
    fn insert() {
        let msg = LogicalMessage::Insert(Insert {
            rel_id: 16_385,
            new_tuple: sample_tuple(),
        });
        assert_exact(&msg);
        let raw = encode(&msg);
        assert_eq!(
            truncated_what(&raw[..5]),
            "Insert relation id and tuple kind"
        );
        assert_eq!(truncated_what(&raw[..7]), "tuple column count");
        assert_eq!(truncated_what(&raw[..8]), "tuple column kind");
        assert_eq!(truncated_what(&raw[..10]), "tuple column length");
        assert_eq!(truncated_what(&raw[..13]), "tuple column value");
        let mut bad = raw.to_vec();
        bad[5] = b'K';
        assert_eq!(
            decode(&bad),
            Err(DecodeError::UnknownTag {
                context: "Insert tuple kind",
                tag: b'K'
            })
        );
    }

    #[test]
    fn tuple_column_errors() {
        let head = [b'I', 0, 0, 0, 7, b'N', 0, 1];
        let with = |column: &[u8]| {
            let mut raw = head.to_vec();
            raw.extend_from_slice(column);
            decode(&raw)
        };
        assert_eq!(
            with(b"x"),
            Err(DecodeError::UnknownTag {
                context: "tuple column kind",
                tag: b'x'
            })
        );
        assert_eq!(
            with(&[b't', 0xFF, 0xFF, 0xFF, 0xFB]),
            Err(DecodeError::Invalid {
                what: "tuple column length",
                detail: "negative length -5".into()
            })
        );
        assert_eq!(
            with(&[b'b', 0x80, 0, 0, 0]),
            Err(DecodeError::Invalid {
                what: "tuple column length",
                detail: format!("negative length {}", i32::MIN)
            })
        );
        assert_eq!(
            with(&[b't', 0x7F, 0xFF, 0xFF, 0xFF, b'a']),
            Err(DecodeError::Truncated {
                what: "tuple column value",
                need: i32::MAX as usize,
                have: 1
            })
        );
        // Column count larger than the columns present.
        let mut raw = vec![b'I', 0, 0, 0, 7, b'N', 0xFF, 0xFF];
        raw.extend_from_slice(&[b'n'; 100]);
        assert_eq!(truncated_what(&raw), "tuple column kind");
        // Text values need not be UTF-8 (they are the type's output, in the server encoding).
        let got = with(&[b't', 0, 0, 0, 1, 0xFF]).unwrap();
        let LogicalMessage::Insert(i) = got else {
            panic!()
        };
        assert_eq!(
            i.new_tuple.get(0),
            Some(ColumnValue::Text(Bytes::from_static(b"\xff")))
        );
    }

    #[test]
    fn update() {
        for old_tuple in [
            None,
            Some(OldTuple::Key(tuple(&[text("1"), ColumnValue::Null]))),
            Some(OldTuple::Full(tuple(&[text("1"), text("x")]))),
        ] {
            assert_exact(&LogicalMessage::Update(Update {
                rel_id: 9,
                old_tuple,
                new_tuple: sample_tuple(),
            }));
        }
        let msg = LogicalMessage::Update(Update {
            rel_id: 9,
            old_tuple: Some(OldTuple::Key(tuple(&[ColumnValue::Null]))),
            new_tuple: tuple(&[ColumnValue::Null]),
        });
        let raw = encode(&msg); // U id(4) K 0 1 n N 0 1 n
        assert_eq!(
            truncated_what(&raw[..5]),
            "Update relation id and tuple kind"
        );
        assert_eq!(truncated_what(&raw[..9]), "Update new tuple kind");
        let mut bad = raw.to_vec();
        bad[5] = b'X';
        assert_eq!(
            decode(&bad),
            Err(DecodeError::UnknownTag {
                context: "Update tuple kind",
                tag: b'X'
            })
        );
        let mut bad = raw.to_vec();
        bad[9] = b'K';
        assert_eq!(
            decode(&bad),
            Err(DecodeError::UnknownTag {
                context: "Update new tuple kind",
                tag: b'K'
            })
        );
    }

    #[test]
    fn delete() {
        for old_tuple in [
            OldTuple::Key(tuple(&[text("1"), ColumnValue::Null])),
            OldTuple::Full(sample_tuple()),
        ] {
            assert_exact(&LogicalMessage::Delete(Delete {
                rel_id: 3,
                old_tuple,
            }));
        }
        for tag in [b'N', b'k', 0] {
            assert_eq!(
                decode(&[b'D', 0, 0, 0, 3, tag, 0, 0]),
                Err(DecodeError::UnknownTag {
                    context: "Delete tuple kind",
                    tag
                })
            );
        }
    }

    #[test]
    fn truncate() {
        let t = Truncate {
            options: TRUNCATE_CASCADE | TRUNCATE_RESTART_IDENTITY,
            rel_ids: vec![16_385, 16_400],
        };
        assert!(t.cascade() && t.restart_identity());
        assert!(!Truncate {
            options: 0,
            rel_ids: vec![]
        }
        .cascade());
        assert_exact(&LogicalMessage::Truncate(t.clone()));
        assert_exact(&LogicalMessage::Truncate(Truncate {
            options: 0,
            rel_ids: vec![],
        }));
        let raw = encode(&LogicalMessage::Truncate(t));
        assert_eq!(
            truncated_what(&raw[..5]),
            "Truncate relation count and options"
        );
        assert_eq!(truncated_what(&raw[..9]), "Truncate relation ids");
        assert_eq!(
            decode(&[b'T', 0xFF, 0xFF, 0xFF, 0xFF, 0]),
            Err(DecodeError::Invalid {
                what: "Truncate relation count",
                detail: "negative length -1".into()
            })
        );
        // A huge count is refused before anything is allocated for it.
        assert_eq!(
            decode(&[b'T', 0x7F, 0xFF, 0xFF, 0xFF, 0, 1, 2, 3, 4]),
            Err(DecodeError::Truncated {
                what: "Truncate relation ids",
                need: (i32::MAX as usize) * 4,
                have: 4
            })
        );
    }

    #[test]
    fn message() {
        let msg = LogicalDecodingMessage {
            flags: 1,
            lsn: Lsn(0x1_5000_0000),
            prefix: "prefix".into(),
            content: Bytes::from_static(b"content\0with nul"),
        };
        assert!(msg.transactional());
        assert_exact(&LogicalMessage::Message(msg.clone()));
        let raw = encode(&LogicalMessage::Message(msg));
        assert_eq!(truncated_what(&raw[..9]), "Message flags and LSN");
        assert_eq!(truncated_what(&raw[..12]), "Message prefix");
        assert_eq!(truncated_what(&raw[..19]), "Message content length");
        assert_eq!(truncated_what(&raw[..24]), "Message content");
        let mut bad = raw[..17].to_vec();
        bad.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            decode(&bad),
            Err(DecodeError::Invalid {
                what: "Message content length",
                detail: "negative length -1".into()
            })
        );
        // Zero-copy content.
        let LogicalMessage::Message(m) = LogicalMessage::decode(raw.clone()).unwrap() else {
            panic!()
        };
        assert_eq!(m.content.as_ptr(), raw[21..].as_ptr());
        assert!(!LogicalDecodingMessage { flags: 0, ..m }.transactional());
    }

    #[test]
    fn empty_and_unknown() {
        assert_eq!(
            decode(b""),
            Err(DecodeError::Truncated {
                what: "pgoutput message tag",
                need: 1,
                have: 0
            })
        );
        for tag in [b'S', b'E', b'c', b'A', b'P', b'K', b'r', b'x', 0, 0xFF] {
            assert_eq!(
                decode(&[tag, 0, 0, 0, 0]),
                Err(DecodeError::UnknownTag {
                    context: "pgoutput message",
                    tag
                })
            );
        }
    }

    #[test]
    fn tuple_access_is_zero_copy_and_exact() {
        let msg = encode(&LogicalMessage::Insert(Insert {
            rel_id: 1,
            new_tuple: sample_tuple(),
        }));
        let LogicalMessage::Insert(insert) = LogicalMessage::decode(msg.clone()).unwrap() else {
            panic!()
        };
        let t = &insert.new_tuple;
        assert_eq!((t.len(), t.is_empty()), (5, false));
        let mut it = t.iter();
        assert_eq!(it.len(), 5);
        let Some(ColumnValue::Text(first)) = it.next() else {
            panic!()
        };
        assert_eq!(&first[..], b"42");
        // 'I' id(4) 'N' count(2) 't' len(4) -> the value starts at offset 13.
        assert_eq!(first.as_ptr(), msg[13..].as_ptr());
        assert_eq!(it.len(), 4);
        assert_eq!(it.next(), Some(ColumnValue::Null));
        assert_eq!(it.next(), Some(ColumnValue::UnchangedToast));
        assert_eq!(
            it.next(),
            Some(ColumnValue::Binary(Bytes::from_static(&[0, 0, 1])))
        );
        assert_eq!(it.next(), Some(text("")));
        assert_eq!((it.next(), it.next(), it.len()), (None, None, 0));
        assert_eq!(
            t.get(3),
            Some(ColumnValue::Binary(Bytes::from_static(&[0, 0, 1])))
        );
        assert_eq!(t.get(5), None);
        assert_eq!(t.get(usize::MAX), None);
        assert_eq!((&insert.new_tuple).into_iter().count(), 5);
        assert_eq!(
            format!("{t:?}"),
            r#"[Text(b"42"), Null, UnchangedToast, Binary(b"\0\0\x01"), Text(b"")]"#
        );
        let empty = tuple(&[]);
        assert!(empty.is_empty());
        assert_eq!(empty.iter().next(), None);
    }

    // ---- properties ----------------------------------------------------------------------

    fn arb_column_value() -> impl Strategy<Value = ColumnValue> {
        prop_oneof![
            Just(ColumnValue::Null),
            Just(ColumnValue::UnchangedToast),
            proptest::collection::vec(any::<u8>(), 0..24)
                .prop_map(|v| ColumnValue::Text(Bytes::from(v))),
            proptest::collection::vec(any::<u8>(), 0..24)
                .prop_map(|v| ColumnValue::Binary(Bytes::from(v))),
        ]
    }

    fn arb_tuple() -> impl Strategy<Value = TupleData> {
        proptest::collection::vec(arb_column_value(), 0..12).prop_map(|c| tuple(&c))
    }

    fn arb_name() -> impl Strategy<Value = String> {
        "[^\u{0}]{0,10}"
    }

    fn arb_old() -> impl Strategy<Value = OldTuple> {
        prop_oneof![
            arb_tuple().prop_map(OldTuple::Key),
            arb_tuple().prop_map(OldTuple::Full)
        ]
    }

    fn arb_message() -> impl Strategy<Value = LogicalMessage> {
        let column = (any::<u8>(), arb_name(), any::<u32>(), any::<i32>()).prop_map(
            |(flags, name, type_oid, type_modifier)| Column {
                flags,
                name,
                type_oid,
                type_modifier,
            },
        );
        prop_oneof![
            (any::<u64>(), any::<i64>(), any::<u32>()).prop_map(|(l, t, xid)| {
                LogicalMessage::Begin(Begin {
                    final_lsn: Lsn(l),
                    commit_time: t,
                    xid,
                })
            }),
            (any::<u8>(), any::<u64>(), any::<u64>(), any::<i64>()).prop_map(|(f, c, e, t)| {
                LogicalMessage::Commit(Commit {
                    flags: f,
                    commit_lsn: Lsn(c),
                    end_lsn: Lsn(e),
                    commit_time: t,
                })
            }),
            (any::<u64>(), arb_name()).prop_map(|(l, name)| {
                LogicalMessage::Origin(Origin {
                    commit_lsn: Lsn(l),
                    name,
                })
            }),
            (
                any::<u32>(),
                arb_name(),
                arb_name(),
                any::<u8>(),
                proptest::collection::vec(column, 0..6)
            )
                .prop_map(|(rel_id, namespace, name, replica_identity, columns)| {
                    LogicalMessage::Relation(Relation {
                        rel_id,
                        namespace,
                        name,
                        replica_identity,
                        columns,
                    })
                }),
            (any::<u32>(), arb_name(), arb_name()).prop_map(|(type_oid, namespace, name)| {
                LogicalMessage::Type(TypeMessage {
                    type_oid,
                    namespace,
                    name,
                })
            }),
            (any::<u32>(), arb_tuple()).prop_map(|(rel_id, new_tuple)| LogicalMessage::Insert(
                Insert { rel_id, new_tuple }
            )),
            (any::<u32>(), proptest::option::of(arb_old()), arb_tuple()).prop_map(
                |(rel_id, old_tuple, new_tuple)| LogicalMessage::Update(Update {
                    rel_id,
                    old_tuple,
                    new_tuple
                })
            ),
            (any::<u32>(), arb_old()).prop_map(|(rel_id, old_tuple)| LogicalMessage::Delete(
                Delete { rel_id, old_tuple }
            )),
            (any::<u8>(), proptest::collection::vec(any::<u32>(), 0..8)).prop_map(
                |(options, rel_ids)| LogicalMessage::Truncate(Truncate { options, rel_ids })
            ),
            (
                any::<u8>(),
                any::<u64>(),
                arb_name(),
                proptest::collection::vec(any::<u8>(), 0..32)
            )
                .prop_map(|(flags, lsn, prefix, content)| {
                    LogicalMessage::Message(LogicalDecodingMessage {
                        flags,
                        lsn: Lsn(lsn),
                        prefix,
                        content: Bytes::from(content),
                    })
                }),
        ]
    }

    const TAGS: [u8; 10] = [
        BEGIN_TAG,
        COMMIT_TAG,
        ORIGIN_TAG,
        RELATION_TAG,
        TYPE_TAG,
        INSERT_TAG,
        UPDATE_TAG,
        DELETE_TAG,
        TRUNCATE_TAG,
        MESSAGE_TAG,
    ];

    /// Walks every column of a decoded message: iteration must never panic.
    fn touch(msg: &LogicalMessage) {
        let tuples: Vec<&TupleData> = match msg {
            LogicalMessage::Insert(i) => vec![&i.new_tuple],
            LogicalMessage::Update(u) => {
                let mut t = vec![&u.new_tuple];
                t.extend(u.old_tuple.as_ref().map(OldTuple::tuple));
                t
            }
            LogicalMessage::Delete(d) => vec![d.old_tuple.tuple()],
            _ => vec![],
        };
        for t in tuples {
            assert_eq!(t.iter().count(), t.len());
            assert_eq!(t.get(t.len()), None);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn decode_is_total(raw in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok(msg) = decode(&raw) {
                touch(&msg);
            }
        }

        #[test]
        fn decode_is_total_after_each_tag(
            tag in proptest::sample::select(&TAGS[..]),
            body in proptest::collection::vec(
                prop_oneof![any::<u8>(), proptest::sample::select(
                    &[0u8, 0xFF, b'n', b'u', b't', b'b', b'N', b'K', b'O'][..])],
                0..96),
        ) {
            let mut raw = vec![tag];
            raw.extend_from_slice(&body);
            if let Ok(msg) = decode(&raw) {
                touch(&msg);
                // Whatever decodes re-encodes to the same bytes.
                prop_assert_eq!(&encode(&msg)[..], &raw[..]);
            }
        }

        #[test]
        fn tuple_round_trip(columns in proptest::collection::vec(arb_column_value(), 0..40)) {
            let mut raw = BytesMut::from(&[b'I', 0, 0, 0, 5, b'N'][..]);
            raw.put_u16(u16::try_from(columns.len()).unwrap());
            raw.put_slice(&encode_columns(&columns));
            let LogicalMessage::Insert(insert) = LogicalMessage::decode(raw.freeze()).unwrap() else {
                panic!("not an Insert")
            };
            let t = insert.new_tuple;
            prop_assert_eq!(t.len(), columns.len());
            prop_assert_eq!(t.iter().collect::<Vec<_>>(), columns.clone());
            for (i, c) in columns.iter().enumerate() {
                prop_assert_eq!(t.get(i), Some(c.clone()));
            }
            prop_assert_eq!(t.get(columns.len()), None);
            // Borrowed, the same columns; shared back, the same bytes, zero-copy.
            let mut refs = t.iter();
            for c in &columns {
                let borrowed = refs.next_ref();
                let (ColumnValue::Text(want) | ColumnValue::Binary(want)) = c else {
                    let same = matches!(
                        (c, borrowed),
                        (ColumnValue::Null, Some(ColumnRef::Null))
                            | (ColumnValue::UnchangedToast, Some(ColumnRef::UnchangedToast))
                    );
                    prop_assert!(same, "{c:?} borrowed as {borrowed:?}");
                    continue;
                };
                let (Some(ColumnRef::Text(part)) | Some(ColumnRef::Binary(part))) = borrowed else {
                    return Err(TestCaseError::fail(format!("{c:?} borrowed as {borrowed:?}")));
                };
                prop_assert_eq!(part, &want[..]);
                let shared = t.share(part).unwrap();
                prop_assert_eq!(&shared[..], part);
                prop_assert_eq!(shared.as_ptr(), part.as_ptr());
            }
            prop_assert_eq!(refs.next_ref(), None);
            prop_assert_eq!(t.share(b"not of this tuple"), None);
        }

        #[test]
        fn message_round_trip_and_exact_length(msg in arb_message()) {
            assert_exact(&msg);
        }
    }
}
