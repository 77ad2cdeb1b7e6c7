//! Protocol v3 framing and the backend messages this crate reads
//! (<https://www.postgresql.org/docs/15/protocol-message-formats.html>).
//!
//! Frontend messages are encoded by `postgres_protocol::message::frontend`. Backend messages
//! are framed here, and the few we need are parsed here too rather than with
//! `postgres_protocol::message::backend::Message::parse`: that parser rejects
//! CopyBothResponse ('W'), which every replication stream starts with, and its field
//! iterators need another dependency. Parsing is total ([`Error::Protocol`] on bad input,
//! never a panic) and zero-copy: a frame body is a `Bytes` slice of the read buffer.
//!
//! The read buffer is the cancel-safety of the whole crate: [`FrameReader::next_frame`]
//! keeps every byte it has read in its `BytesMut`, so dropping the future mid-frame loses
//! nothing, and the next call continues where the last one stopped.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use pgoutput::StandbyStatusUpdate;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::DbError;
use crate::Error;

/// Any byte stream a connection can run over: TCP, Unix socket, TLS, or (in tests) a pipe.
pub(crate) trait Socket:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin
{
}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Socket for T {}
/// The socket every connection of this crate frames its messages over.
pub(crate) type BoxSocket = Box<dyn Socket>;

/// How much the reader asks the socket for at a time (at least): the walsender gets
/// cheaper when its client takes data in large batches.
pub(crate) const READ_CAPACITY: usize = 256 * 1024;

/// Below this much free buffer space, the reader grows (or compacts) the buffer before
/// reading again, so that reads stay large.
const MIN_READ: usize = 64 * 1024;

/// Header size: tag byte plus the length word (which counts itself but not the tag).
const HEADER_LEN: usize = 5;

pub(crate) const AUTHENTICATION: u8 = b'R';
pub(crate) const BACKEND_KEY_DATA: u8 = b'K';
pub(crate) const COMMAND_COMPLETE: u8 = b'C';
pub(crate) const COPY_BOTH_RESPONSE: u8 = b'W';
pub(crate) const COPY_DATA: u8 = b'd';
pub(crate) const COPY_DONE: u8 = b'c';
pub(crate) const COPY_IN_RESPONSE: u8 = b'G';
pub(crate) const COPY_OUT_RESPONSE: u8 = b'H';
pub(crate) const DATA_ROW: u8 = b'D';
pub(crate) const EMPTY_QUERY_RESPONSE: u8 = b'I';
pub(crate) const ERROR_RESPONSE: u8 = b'E';
pub(crate) const NOTICE_RESPONSE: u8 = b'N';
pub(crate) const NOTIFICATION_RESPONSE: u8 = b'A';
pub(crate) const PARAMETER_STATUS: u8 = b'S';
pub(crate) const READY_FOR_QUERY: u8 = b'Z';
pub(crate) const ROW_DESCRIPTION: u8 = b'T';

/// One backend message: its tag and its body (without the length word).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub(crate) tag: u8,
    pub(crate) body: Bytes,
}

/// Splits the first complete message off `buf`; `Ok(None)` when more bytes are needed.
pub(crate) fn parse_frame(buf: &mut BytesMut) -> Result<Option<Frame>, Error> {
    let Some(total) = frame_len(buf)? else {
        return Ok(None);
    };
    if buf.len() < total {
        return Ok(None);
    }
    let mut frame = buf.split_to(total).freeze();
    let tag = frame.get_u8();
    frame.advance(HEADER_LEN - 1);
    Ok(Some(Frame { tag, body: frame }))
}

/// Total length (tag included) of the message at the head of `buf`, once its header is in.
fn frame_len(buf: &[u8]) -> Result<Option<usize>, Error> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let length = i32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    match usize::try_from(length) {
        Ok(length) if length >= 4 => Ok(Some(length + 1)),
        _ => Err(Error::protocol(format!(
            "invalid length {length} of a message with tag {}",
            char::from(header[0]).escape_default()
        ))),
    }
}

/// The read half of a connection and its buffer.
#[derive(Debug)]
pub(crate) struct FrameReader<R> {
    io: R,
    buf: BytesMut,
    target: String,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(crate) fn new(io: R, target: String) -> Self {
        FrameReader {
            io,
            buf: BytesMut::with_capacity(READ_CAPACITY),
            target,
        }
    }

    /// The next message if it is complete in the buffer; no I/O.
    pub(crate) fn try_frame(&mut self) -> Result<Option<Frame>, Error> {
        parse_frame(&mut self.buf)
    }

    /// The next message, reading as needed. Cancel-safe: see the module docs.
    pub(crate) async fn next_frame(&mut self, context: &'static str) -> Result<Frame, Error> {
        loop {
            if let Some(frame) = self.try_frame()? {
                return Ok(frame);
            }
            self.fill(context).await?;
        }
    }

    /// Reads once into the buffer (at least [`MIN_READ`] bytes of space, normally
    /// [`READ_CAPACITY`]). Cancel-safe: `read_buf` adds bytes only when it completes.
    pub(crate) async fn fill(&mut self, context: &'static str) -> Result<(), Error> {
        let missing = match frame_len(&self.buf)? {
            Some(total) => total.saturating_sub(self.buf.len()),
            None => 0,
        };
        let spare = self.buf.capacity() - self.buf.len();
        if spare < MIN_READ.max(missing) {
            // Compacts in place when the frames handed out are gone, else allocates a new
            // block; either way the partial frame at the head moves along.
            self.buf.reserve(READ_CAPACITY.max(missing));
        }
        match self.io.read_buf(&mut self.buf).await {
            Ok(0) => Err(Error::Closed { context }),
            Ok(_) => Ok(()),
            Err(error) => Err(Error::io(
                format!("reading from {} {context}", self.target),
                error,
            )),
        }
    }

    /// Bytes read but not yet handed out.
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buf.capacity()
    }
}

/// The write half of a connection and the bytes not yet written.
#[derive(Debug)]
pub(crate) struct FrameWriter<W> {
    io: W,
    /// Encoded messages waiting to be written. A write cancelled midway leaves the rest
    /// here, and the next [`FrameWriter::flush`] sends it first, so the peer never sees a
    /// torn message.
    pub(crate) buf: BytesMut,
    target: String,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(crate) fn new(io: W, target: String) -> Self {
        FrameWriter {
            io,
            buf: BytesMut::with_capacity(1024),
            target,
        }
    }

    /// Writes everything buffered and flushes the socket.
    pub(crate) async fn flush(&mut self) -> Result<(), Error> {
        while self.buf.has_remaining() {
            match self.io.write_buf(&mut self.buf).await {
                Ok(0) => {
                    return Err(Error::Closed {
                        context: "while we were writing",
                    })
                }
                Ok(_) => {}
                Err(error) => return Err(Error::io(format!("writing to {}", self.target), error)),
            }
        }
        self.io
            .flush()
            .await
            .map_err(|error| Error::io(format!("writing to {}", self.target), error))
    }

    /// Closes the write direction (after Terminate).
    pub(crate) async fn shutdown(&mut self) -> Result<(), Error> {
        self.io
            .shutdown()
            .await
            .map_err(|error| Error::io(format!("closing {}", self.target), error))
    }
}

/// Appends CopyData('r' status update) to `out`, without allocating once `out` has room.
pub(crate) fn encode_status_update(update: &StandbyStatusUpdate, out: &mut BytesMut) {
    const LENGTH: usize = 4 + StandbyStatusUpdate::ENCODED_LEN;
    out.reserve(1 + LENGTH);
    out.put_u8(COPY_DATA);
    out.put_u32(LENGTH as u32);
    update.encode(out);
}

/// A bounds-checked cursor over a message body.
struct Fields<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Fields { buf, what }
    }

    fn truncated(&self) -> Error {
        Error::protocol(format!("truncated {}", self.what))
    }

    fn u8(&mut self) -> Result<u8, Error> {
        let (&byte, rest) = self.buf.split_first().ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(byte)
    }

    fn i16(&mut self) -> Result<i16, Error> {
        let bytes = self.bytes(2)?;
        Ok(i16::from_be_bytes([bytes[0], bytes[1]]))
    }

    fn i32(&mut self) -> Result<i32, Error> {
        let bytes = self.bytes(4)?;
        Ok(i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn bytes(&mut self, count: usize) -> Result<&'a [u8], Error> {
        let (head, rest) = self
            .buf
            .split_at_checked(count)
            .ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(head)
    }

    /// A NUL-terminated string, decoded lossily (server messages may precede the
    /// client_encoding setting).
    fn cstr(&mut self) -> Result<String, Error> {
        let end = self
            .buf
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| self.truncated())?;
        let text = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        self.buf = &self.buf[end + 1..];
        Ok(text)
    }

    fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

/// The fields of an ErrorResponse or NoticeResponse.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ServerMessage {
    pub(crate) severity: String,
    pub(crate) code: String,
    pub(crate) message: String,
    pub(crate) detail: Option<String>,
    pub(crate) hint: Option<String>,
}

pub(crate) fn server_message(body: &[u8]) -> Result<ServerMessage, Error> {
    let mut fields = Fields::new(body, "error or notice fields");
    let mut message = ServerMessage::default();
    let mut localized_severity = String::new();
    loop {
        let kind = fields.u8()?;
        if kind == 0 {
            break;
        }
        let value = fields.cstr()?;
        match kind {
            b'S' => localized_severity = value,
            b'V' => message.severity = value,
            b'C' => message.code = value,
            b'M' => message.message = value,
            b'D' => message.detail = Some(value),
            b'H' => message.hint = Some(value),
            _ => {}
        }
    }
    if message.severity.is_empty() {
        message.severity = localized_severity;
    }
    Ok(message)
}

/// An ErrorResponse as an error; `user` makes our hints concrete.
pub(crate) fn error_response(body: &[u8], user: &str) -> Error {
    match server_message(body) {
        Ok(m) => DbError::new(m.severity, m.code, m.message, m.detail, m.hint, Some(user)).into(),
        Err(error) => error,
    }
}

/// Logs a NoticeResponse.
pub(crate) fn log_notice(body: &[u8], target: &str) {
    match server_message(body) {
        Ok(notice) if notice.severity == "WARNING" => tracing::warn!(
            target = %target,
            code = %notice.code,
            detail = notice.detail.as_deref().unwrap_or(""),
            "server warning: {}",
            notice.message
        ),
        Ok(notice) => tracing::info!(
            target = %target,
            severity = %notice.severity,
            code = %notice.code,
            "server notice: {}",
            notice.message
        ),
        Err(error) => tracing::warn!(target = %target, error = %error, "undecodable notice"),
    }
}

/// An Authentication* request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Authentication {
    Ok,
    CleartextPassword,
    Md5Password {
        salt: [u8; 4],
    },
    Sasl {
        mechanisms: Vec<String>,
    },
    SaslContinue(Bytes),
    SaslFinal(Bytes),
    /// Kerberos (2), SCM (6), GSS (7, 8), SSPI (9), or a code we do not know.
    Unsupported(i32),
}

pub(crate) fn authentication(body: &Bytes) -> Result<Authentication, Error> {
    let mut fields = Fields::new(body, "authentication request");
    let code = fields.i32()?;
    let rest = body.slice(4..);
    Ok(match code {
        0 => Authentication::Ok,
        3 => Authentication::CleartextPassword,
        5 => {
            let salt = fields.bytes(4)?;
            Authentication::Md5Password {
                salt: [salt[0], salt[1], salt[2], salt[3]],
            }
        }
        10 => {
            let mut mechanisms = Vec::new();
            loop {
                let mechanism = fields.cstr()?;
                if mechanism.is_empty() {
                    break;
                }
                mechanisms.push(mechanism);
            }
            Authentication::Sasl { mechanisms }
        }
        11 => Authentication::SaslContinue(rest),
        12 => Authentication::SaslFinal(rest),
        other => Authentication::Unsupported(other),
    })
}

pub(crate) fn parameter_status(body: &[u8]) -> Result<(String, String), Error> {
    let mut fields = Fields::new(body, "ParameterStatus");
    Ok((fields.cstr()?, fields.cstr()?))
}

/// BackendKeyData: the backend's process id (for logs).
pub(crate) fn backend_pid(body: &[u8]) -> Result<i32, Error> {
    Fields::new(body, "BackendKeyData").i32()
}

/// A DataRow in text format.
pub(crate) fn data_row(body: &[u8]) -> Result<Vec<Option<String>>, Error> {
    let mut fields = Fields::new(body, "DataRow");
    let count = fields.i16()?;
    let count = usize::try_from(count)
        .map_err(|_| Error::protocol(format!("negative column count {count} in DataRow")))?;
    let mut row = Vec::with_capacity(count.min(fields.rest().len() / 4));
    for _ in 0..count {
        let length = fields.i32()?;
        if length == -1 {
            row.push(None);
            continue;
        }
        let length = usize::try_from(length)
            .map_err(|_| Error::protocol(format!("invalid value length {length} in DataRow")))?;
        let value = fields.bytes(length)?;
        let value = std::str::from_utf8(value)
            .map_err(|_| Error::protocol("a DataRow value is not UTF-8"))?;
        row.push(Some(value.to_owned()));
    }
    if !fields.rest().is_empty() {
        return Err(Error::protocol("trailing bytes after DataRow values"));
    }
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn frames_need_all_their_bytes() {
        let raw = [message(b'd', b"hello"), message(b'Z', b"I")].concat();
        // Feed a byte at a time: nothing comes out before a frame is complete.
        let mut buf = BytesMut::new();
        let mut frames = Vec::new();
        for byte in &raw {
            buf.put_u8(*byte);
            while let Some(frame) = parse_frame(&mut buf).unwrap() {
                frames.push((buf.len(), frame));
            }
        }
        assert_eq!(
            frames,
            vec![
                (
                    0,
                    Frame {
                        tag: b'd',
                        body: Bytes::from_static(b"hello")
                    }
                ),
                (
                    0,
                    Frame {
                        tag: b'Z',
                        body: Bytes::from_static(b"I")
                    }
                ),
            ]
        );
    }

    #[test]
    fn frame_bodies_are_slices_of_the_buffer() {
        let mut buf = BytesMut::from(&message(b'd', b"payload")[..]);
        let start = buf.as_ptr() as usize;
        let frame = parse_frame(&mut buf).unwrap().unwrap();
        assert_eq!(frame.body.as_ptr() as usize, start + HEADER_LEN);
    }

    #[test]
    fn bad_lengths_are_protocol_errors() {
        for length in [0i32, 3, -1, i32::MIN] {
            let mut buf = BytesMut::new();
            buf.put_u8(b'd');
            buf.put_i32(length);
            assert!(matches!(parse_frame(&mut buf), Err(Error::Protocol(_))));
        }
    }

    #[test]
    fn error_fields() {
        let body = b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed for user \"u\"\0Rauth_failed\0\0";
        let parsed = server_message(body).unwrap();
        assert_eq!(parsed.code, "28P01");
        assert_eq!(parsed.severity, "FATAL");
        let error = error_response(body, "u");
        assert_eq!(error.sqlstate(), Some("28P01"));
        assert!(!error.is_transient());
        assert!(server_message(b"Cabc").is_err());
        assert!(server_message(b"").is_err());
    }

    #[test]
    fn authentication_requests() {
        let md5 = Bytes::from_static(&[0, 0, 0, 5, 1, 2, 3, 4]);
        assert_eq!(
            authentication(&md5).unwrap(),
            Authentication::Md5Password { salt: [1, 2, 3, 4] }
        );
        let sasl = Bytes::from_static(b"\0\0\0\x0aSCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0");
        assert_eq!(
            authentication(&sasl).unwrap(),
            Authentication::Sasl {
                mechanisms: vec!["SCRAM-SHA-256-PLUS".into(), "SCRAM-SHA-256".into()]
            }
        );
        let cont = Bytes::from_static(b"\0\0\0\x0br=abc");
        assert_eq!(
            authentication(&cont).unwrap(),
            Authentication::SaslContinue(Bytes::from_static(b"r=abc"))
        );
        assert_eq!(
            authentication(&Bytes::from_static(&[0, 0, 0, 7])).unwrap(),
            Authentication::Unsupported(7)
        );
        assert!(authentication(&Bytes::from_static(&[0, 0, 0, 5, 1])).is_err());
        assert!(authentication(&Bytes::from_static(b"\0\0\0\x0aSCRAM")).is_err());
    }

    #[test]
    fn data_rows() {
        let mut body = vec![0, 3];
        body.extend_from_slice(&2i32.to_be_bytes());
        body.extend_from_slice(b"ab");
        body.extend_from_slice(&(-1i32).to_be_bytes());
        body.extend_from_slice(&0i32.to_be_bytes());
        assert_eq!(
            data_row(&body).unwrap(),
            vec![Some("ab".into()), None, Some(String::new())]
        );
        assert!(data_row(&body[..body.len() - 1]).is_err());
        assert!(data_row(&[0xff, 0xff]).is_err());
        let mut huge = vec![0, 1];
        huge.extend_from_slice(&i32::MAX.to_be_bytes());
        assert!(data_row(&huge).is_err());
        let mut trailing = body.clone();
        trailing.push(0);
        assert!(data_row(&trailing).is_err());
    }

    #[test]
    fn status_update_envelope() {
        let mut out = BytesMut::new();
        encode_status_update(
            &StandbyStatusUpdate {
                write_lsn: pgoutput::Lsn(1),
                flush_lsn: pgoutput::Lsn(1),
                apply_lsn: pgoutput::Lsn(1),
                send_time: 0,
                reply_requested: false,
            },
            &mut out,
        );
        assert_eq!(out.len(), 1 + 4 + StandbyStatusUpdate::ENCODED_LEN);
        assert_eq!(&out[..5], &[b'd', 0, 0, 0, 38]);
        assert_eq!(out[5], b'r');
    }
}
