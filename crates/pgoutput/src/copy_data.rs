//! The streaming-replication sub-protocol carried inside CopyData messages
//! (<https://www.postgresql.org/docs/15/protocol-replication.html>): `XLogData` ('w') and
//! `PrimaryKeepalive` ('k') from the server, `StandbyStatusUpdate` ('r') from the client.
//!
//! # Invariants
//! - Decoding is total: any byte string yields a message or a [`DecodeError`], never a panic.
//! - `XLogData::data` is a zero-copy slice of the CopyData body.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{DecodeError, Lsn};

/// Microseconds since 2000-01-01 00:00:00 UTC, the server's timestamp epoch.
pub type PgTimestamp = i64;

/// Seconds between the Unix epoch and the Postgres epoch (2000-01-01).
pub const PG_EPOCH_UNIX_SECONDS: i64 = 946_684_800;

/// Tag of an `XLogData` message.
pub const XLOG_DATA_TAG: u8 = b'w';
/// Tag of a `PrimaryKeepalive` message.
pub const PRIMARY_KEEPALIVE_TAG: u8 = b'k';
/// Tag of a `StandbyStatusUpdate` message.
pub const STANDBY_STATUS_UPDATE_TAG: u8 = b'r';

/// A message the server sends inside CopyData during `START_REPLICATION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// WAL data; for a logical slot, one output-plugin message.
    XLogData(XLogData),
    /// A heartbeat carrying the server's current WAL end.
    PrimaryKeepalive(PrimaryKeepalive),
}

/// `XLogData`: one pgoutput message and where it sits in the WAL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XLogData {
    /// The starting point of the WAL data in this message.
    pub wal_start_lsn: Lsn,
    /// The current end of WAL on the server.
    pub wal_end_lsn: Lsn,
    /// The server's clock at transmission.
    pub send_time: PgTimestamp,
    /// The output plugin's message (zero-copy).
    pub data: Bytes,
}

/// `PrimaryKeepalive`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrimaryKeepalive {
    /// The current end of WAL on the server (for a logical walsender: what it has sent).
    pub wal_end_lsn: Lsn,
    /// The server's clock at transmission.
    pub send_time: PgTimestamp,
    /// The server asks for a status update now, or it will time the connection out.
    pub reply_requested: bool,
}

impl ReplicationMessage {
    /// Decodes the body of one CopyData message.
    pub fn decode(mut body: Bytes) -> Result<Self, DecodeError> {
        let Some(&tag) = body.first() else {
            return Err(DecodeError::Truncated {
                what: "replication message tag",
                need: 1,
                have: 0,
            });
        };
        body.advance(1);
        match tag {
            XLOG_DATA_TAG => {
                need(&body, 24, "XLogData header")?;
                let wal_start_lsn = Lsn(body.get_u64());
                let wal_end_lsn = Lsn(body.get_u64());
                let send_time = body.get_i64();
                Ok(Self::XLogData(XLogData {
                    wal_start_lsn,
                    wal_end_lsn,
                    send_time,
                    data: body,
                }))
            }
            PRIMARY_KEEPALIVE_TAG => {
                need(&body, 17, "PrimaryKeepalive")?;
                let wal_end_lsn = Lsn(body.get_u64());
                let send_time = body.get_i64();
                let reply_requested = body.get_u8() != 0;
                Ok(Self::PrimaryKeepalive(PrimaryKeepalive {
                    wal_end_lsn,
                    send_time,
                    reply_requested,
                }))
            }
            tag => Err(DecodeError::UnknownTag {
                context: "replication message",
                tag,
            }),
        }
    }
}

fn need(body: &Bytes, need: usize, what: &'static str) -> Result<(), DecodeError> {
    if body.remaining() < need {
        return Err(DecodeError::Truncated {
            what,
            need,
            have: body.remaining(),
        });
    }
    Ok(())
}

/// `StandbyStatusUpdate`: the client's progress report. For a logical slot the server
/// advances `confirmed_flush_lsn` to `flush_lsn`, and may then recycle the WAL before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    /// WAL received and written.
    pub write_lsn: Lsn,
    /// WAL durably processed: the position the slot may be advanced to.
    pub flush_lsn: Lsn,
    /// WAL applied.
    pub apply_lsn: Lsn,
    /// The client's clock at transmission.
    pub send_time: PgTimestamp,
    /// Ask the server to reply immediately (used to measure round trips; we never need it).
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// Size of the encoded message, without the CopyData envelope.
    pub const ENCODED_LEN: usize = 34;

    /// Appends the CopyData body of this update to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(Self::ENCODED_LEN);
        out.put_u8(STANDBY_STATUS_UPDATE_TAG);
        out.put_u64(self.write_lsn.0);
        out.put_u64(self.flush_lsn.0);
        out.put_u64(self.apply_lsn.0);
        out.put_i64(self.send_time);
        out.put_u8(u8::from(self.reply_requested));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_xlog_data_zero_copy() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&0x10u64.to_be_bytes());
        raw.extend_from_slice(&0x20u64.to_be_bytes());
        raw.extend_from_slice(&7i64.to_be_bytes());
        raw.extend_from_slice(b"Bpayload");
        let body = Bytes::from(raw);
        let ReplicationMessage::XLogData(x) = ReplicationMessage::decode(body.clone()).unwrap()
        else {
            panic!("not XLogData")
        };
        assert_eq!(
            (x.wal_start_lsn, x.wal_end_lsn, x.send_time),
            (Lsn(0x10), Lsn(0x20), 7)
        );
        assert_eq!(&x.data[..], b"Bpayload");
        assert_eq!(
            x.data.as_ptr(),
            body[25..].as_ptr(),
            "data must be a slice of the body"
        );
    }

    #[test]
    fn decodes_keepalive() {
        let mut raw = vec![b'k'];
        raw.extend_from_slice(&0xABu64.to_be_bytes());
        raw.extend_from_slice(&9i64.to_be_bytes());
        raw.push(1);
        let msg = ReplicationMessage::decode(Bytes::from(raw)).unwrap();
        assert_eq!(
            msg,
            ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                wal_end_lsn: Lsn(0xAB),
                send_time: 9,
                reply_requested: true
            })
        );
    }

    #[test]
    fn short_and_unknown_messages_are_errors() {
        assert!(matches!(
            ReplicationMessage::decode(Bytes::new()),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            ReplicationMessage::decode(Bytes::from_static(b"w\0\0")),
            Err(DecodeError::Truncated {
                need: 24,
                have: 2,
                ..
            })
        ));
        assert!(matches!(
            ReplicationMessage::decode(Bytes::from_static(b"k\0")),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            ReplicationMessage::decode(Bytes::from_static(b"z")),
            Err(DecodeError::UnknownTag { tag: b'z', .. })
        ));
    }

    #[test]
    fn status_update_layout() {
        let mut out = BytesMut::new();
        StandbyStatusUpdate {
            write_lsn: Lsn(1),
            flush_lsn: Lsn(2),
            apply_lsn: Lsn(3),
            send_time: 4,
            reply_requested: false,
        }
        .encode(&mut out);
        assert_eq!(out.len(), StandbyStatusUpdate::ENCODED_LEN);
        assert_eq!(out[0], b'r');
        assert_eq!(&out[1..9], &1u64.to_be_bytes());
        assert_eq!(&out[9..17], &2u64.to_be_bytes());
        assert_eq!(&out[17..25], &3u64.to_be_bytes());
        assert_eq!(&out[25..33], &4i64.to_be_bytes());
        assert_eq!(out[33], 0);
    }

    proptest! {
        #[test]
        fn decode_is_total(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ReplicationMessage::decode(Bytes::from(raw));
        }
    }
}
