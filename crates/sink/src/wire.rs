//! The NATS client protocol's framing, with no I/O: what the server sends, read from a
//! byte buffer ([`parse`]), and the `HPUB` a publish starts with, written into one
//! ([`hpub_line`], [`header_line`]). The connection owns the socket and the buffer; this
//! module only says where an operation ends and what it holds.
//!
//! The protocol is <https://docs.nats.io/reference/reference-protocols/nats-protocol>: a
//! control line ended by CRLF (`MSG <subject> <sid> [reply-to] <#bytes>`, `HMSG <subject>
//! <sid> [reply-to] <#header bytes> <#total bytes>`, `INFO {…}`, `PING`, `PONG`, `+OK`,
//! `-ERR '…'`), followed for `MSG` and `HMSG` by that many bytes and a CRLF. The unit tests'
//! frames are what nats-server 2.9.10 wrote to a raw client, byte for byte, including the
//! blank it puts after INFO's JSON.
//!
//! # Invariants
//! - WIRE1 Total: any bytes and any limits give an [`Parsed::Op`], [`Parsed::Incomplete`] or
//!   [`Parsed::Invalid`], never a panic; an operation's consumed length is its whole frame,
//!   at least 1 and at most `buf.len()`.
//! - WIRE2 Incomplete is not invalid, and neither is ever undone: what a buffer gives is
//!   either `Incomplete` or exactly what the buffer gives with any bytes appended. So every
//!   proper prefix of a valid operation is `Incomplete` (never a wrong operation, never
//!   `Invalid`), and `Invalid` may close the connection at once: no later bytes fix it.
//! - WIRE3 As strict as nats-server writes: lines end with CRLF only (a bare LF or a CR inside
//!   the line is invalid); the control line, without its CRLF, is at most
//!   `max_control_line` bytes; a payload (an HMSG's headers and payload together, as the
//!   server counts them) is at most `max_payload` bytes and is followed by CRLF; the header
//!   size is at most the total; numbers are plain decimal digits that fit `u64`. Verbs are
//!   case-insensitive and fields are split by runs of spaces and tabs; blanks before the
//!   CRLF are ignored, blanks before the verb are not.
//! - WIRE4 Zero-copy: every slice of an operation borrows from the buffer, and only `Invalid`
//!   allocates (its text). [`hpub_line`] and [`header_line`] reserve once and write numbers
//!   with `itoa`.
//! - WIRE5 [`hpub_line`]'s sizes are the real ones when the header block of `header_len` bytes
//!   ([`HEADER_START`], [`header_line`]s, [`HEADER_END`]) and the payload follow it; a
//!   proptest reads the frame back as the server's `HMSG`.

use bytes::BytesMut;

/// A header block's first line (no status: a client's publish carries none).
pub const HEADER_START: &[u8] = b"NATS/1.0\r\n";

/// A header block's end: the blank line after the last header.
pub const HEADER_END: &[u8] = b"\r\n";

/// The version a header block starts with; a status code may follow on its line.
const HEADER_VERSION: &[u8] = b"NATS/1.0";

/// How much of an unexpected token an `Invalid` text quotes.
const QUOTED_MAX: usize = 32;

/// One operation the server sends (<https://docs.nats.io/reference/reference-protocols/nats-protocol>).
#[derive(Debug, PartialEq, Eq)]
pub enum ServerOp<'a> {
    /// The JSON after `INFO `, without the blanks around it.
    Info(&'a [u8]),
    /// `MSG` and `HMSG`.
    Msg {
        /// The subject the message was published to.
        subject: &'a [u8],
        /// The subscription it is delivered to.
        sid: u64,
        /// The reply subject, when the publisher gave one.
        reply: Option<&'a [u8]>,
        /// `HMSG`: the whole header block, from `NATS/1.0` through the blank line's CRLF.
        headers: Option<&'a [u8]>,
        /// The payload, without the CRLF after it.
        payload: &'a [u8],
    },
    /// `PING`: answer with `PONG`.
    Ping,
    /// `PONG`.
    Pong,
    /// `+OK` (verbose mode only).
    Ok,
    /// The text of `-ERR`, without the single quotes around it.
    Err(&'a [u8]),
}

/// What the start of a buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// An operation and how many bytes of the buffer it took (control line, payload, CRLFs).
    Op(ServerOp<'a>, usize),
    /// The buffer holds the beginning of an operation only: read more and call again.
    Incomplete,
    /// Not the NATS protocol (unknown verb, bad numbers, header length > total, missing CRLF
    /// after a payload, a control line longer than `max_control_line` without CRLF, a
    /// payload longer than `max_payload`): the connection must be closed. The text says what.
    Invalid(String),
}

/// Parses the first operation in `buf` (WIRE1–WIRE4). Verbs are case-insensitive (the server may
/// send "msg"); fields are separated by one or more spaces or tabs; control lines end with
/// CRLF, and a bare LF is invalid (nats-server always sends CRLF). `max_control_line`
/// bounds the control line without its CRLF; `max_payload` bounds `MSG`'s payload and
/// `HMSG`'s headers and payload together.
pub fn parse(buf: &[u8], max_control_line: usize, max_payload: usize) -> Parsed<'_> {
    // Only the first `max_control_line + 2` bytes can hold the line's LF: looking no
    // further bounds the scan, and makes a too-long line invalid before its end arrives.
    let limit = max_control_line.saturating_add(2);
    let window = buf.get(..limit).unwrap_or(buf);
    let Some(newline) = window.iter().position(|&b| b == b'\n') else {
        if buf.len() >= limit {
            return invalid(format!(
                "a control line longer than {max_control_line} bytes"
            ));
        }
        return Parsed::Incomplete;
    };
    let Some(line) = window
        .get(..newline)
        .and_then(|line| line.strip_suffix(b"\r"))
    else {
        return invalid("a line feed without a carriage return before it".to_owned());
    };
    if line.contains(&b'\r') {
        return invalid("a carriage return inside a control line".to_owned());
    }
    let line_len = newline + 1;

    let verb_len = line.iter().position(|&b| is_blank(b)).unwrap_or(line.len());
    let (verb, rest) = line.split_at(verb_len);
    let verb_is = |name: &[u8]| verb.eq_ignore_ascii_case(name);
    if verb_is(b"MSG") {
        message(buf, line_len, rest, false, max_payload)
    } else if verb_is(b"HMSG") {
        message(buf, line_len, rest, true, max_payload)
    } else if verb_is(b"PING") {
        bare(ServerOp::Ping, "PING", rest, line_len)
    } else if verb_is(b"PONG") {
        bare(ServerOp::Pong, "PONG", rest, line_len)
    } else if verb_is(b"+OK") {
        bare(ServerOp::Ok, "+OK", rest, line_len)
    } else if verb_is(b"INFO") {
        let json = trim(rest);
        if json.is_empty() {
            return invalid("INFO without its JSON".to_owned());
        }
        Parsed::Op(ServerOp::Info(json), line_len)
    } else if verb_is(b"-ERR") {
        let text = trim(rest);
        let text = text
            .strip_prefix(b"'")
            .and_then(|inner| inner.strip_suffix(b"'"))
            .unwrap_or(text);
        Parsed::Op(ServerOp::Err(text), line_len)
    } else if verb.is_empty() {
        invalid("a control line without a verb".to_owned())
    } else {
        invalid(format!("an unknown operation {}", quoted(verb)))
    }
}

/// `PING`, `PONG`, `+OK`: nothing may follow the verb but blanks.
fn bare<'a>(op: ServerOp<'a>, verb: &str, rest: &[u8], line_len: usize) -> Parsed<'a> {
    if trim(rest).is_empty() {
        Parsed::Op(op, line_len)
    } else {
        invalid(format!("{verb} followed by {}", quoted(trim(rest))))
    }
}

/// `MSG <subject> <sid> [reply-to] <#bytes>` or `HMSG <subject> <sid> [reply-to]
/// <#header bytes> <#total bytes>`, whose line (`line_len` bytes with its CRLF) starts `buf`:
/// the line's fields, then the payload after it.
fn message<'a>(
    buf: &'a [u8],
    line_len: usize,
    arguments: &'a [u8],
    headed: bool,
    max_payload: usize,
) -> Parsed<'a> {
    let verb = if headed { "HMSG" } else { "MSG" };
    match message_line(arguments, headed, verb, max_payload) {
        Ok(line) => message_body(buf, line_len, line, headed, verb),
        Err(invalid) => invalid,
    }
}

/// What a `MSG` or `HMSG` line says, its numbers read and checked (WIRE3).
struct MessageLine<'a> {
    subject: &'a [u8],
    sid: u64,
    reply: Option<&'a [u8]>,
    /// `HMSG`'s header size, at most `total`.
    header_len: Option<usize>,
    /// The payload's size (`HMSG`: headers and payload), at most `max_payload`.
    total: usize,
}

/// The fields after the verb, by their number (`[reply-to]` is the optional one), with the
/// subscription id and the sizes read as numbers and checked against `max_payload`.
#[inline]
fn message_line<'a>(
    arguments: &'a [u8],
    headed: bool,
    verb: &str,
    max_payload: usize,
) -> Result<MessageLine<'a>, Parsed<'a>> {
    let mut fields: [&[u8]; 5] = [&[]; 5];
    let mut count = 0;
    for field in arguments.split(|&b| is_blank(b)).filter(|f| !f.is_empty()) {
        match fields.get_mut(count) {
            Some(slot) => *slot = field,
            None => return Err(invalid(format!("{verb} with more than 5 fields"))),
        }
        count += 1;
    }
    let present = fields.get(..count).unwrap_or_default();
    let (subject, sid, reply, header_len, total) = match (headed, present) {
        (false, &[subject, sid, total]) => (subject, sid, None, None, total),
        (false, &[subject, sid, reply, total]) => (subject, sid, Some(reply), None, total),
        (true, &[subject, sid, header_len, total]) => (subject, sid, None, Some(header_len), total),
        (true, &[subject, sid, reply, header_len, total]) => {
            (subject, sid, Some(reply), Some(header_len), total)
        }
        _ => {
            let fewest = if headed { 4 } else { 3 };
            return Err(invalid(format!(
                "{verb} with {count} fields, not {fewest} or {}",
                fewest + 1
            )));
        }
    };
    let (sid, header_len, total) = message_numbers(verb, sid, header_len, total, max_payload)?;
    Ok(MessageLine {
        subject,
        sid,
        reply,
        header_len,
        total,
    })
}

/// The subscription id, the header size and the total size of a message line, as numbers
/// within the limits (WIRE3).
#[inline]
fn message_numbers<'a>(
    verb: &str,
    sid: &[u8],
    header_len: Option<&[u8]>,
    total: &[u8],
    max_payload: usize,
) -> Result<(u64, Option<usize>, usize), Parsed<'a>> {
    let Some(sid) = number(sid) else {
        return Err(invalid(format!(
            "{verb} with a subscription id {}",
            quoted(sid)
        )));
    };
    let size = |text: &[u8]| number(text).and_then(|size| usize::try_from(size).ok());
    let header_len = match header_len.map(|text| (text, size(text))) {
        None => None,
        Some((_, Some(header_len))) => Some(header_len),
        Some((text, None)) => {
            return Err(invalid(format!(
                "{verb} with a header size {}",
                quoted(text)
            )))
        }
    };
    let Some(total) = size(total) else {
        return Err(invalid(format!("{verb} with a size {}", quoted(total))));
    };
    if total > max_payload {
        return Err(invalid(format!(
            "{verb} with {total} bytes, more than the maximum payload of {max_payload}"
        )));
    }
    if header_len.is_some_and(|header_len| header_len > total) {
        return Err(invalid(format!(
            "HMSG with a header size larger than its total size {total}"
        )));
    }
    Ok((sid, header_len, total))
}

/// The message whose `line` (`line_len` bytes) starts `buf`, once its payload and the CRLF
/// after it have arrived (WIRE2).
#[inline]
fn message_body<'a>(
    buf: &'a [u8],
    line_len: usize,
    line: MessageLine<'a>,
    headed: bool,
    verb: &str,
) -> Parsed<'a> {
    let Some(payload_end) = line_len.checked_add(line.total) else {
        return invalid(format!("{verb} with a size beyond memory"));
    };
    // The CRLF after the payload is checked as far as it has arrived (WIRE2: a wrong byte is
    // invalid as soon as it is seen, whatever follows it).
    let tail = buf.get(payload_end..).unwrap_or_default();
    let arrived = tail.len().min(2);
    if tail.get(..arrived) != b"\r\n".get(..arrived) {
        return invalid(format!("{verb}'s payload not followed by CRLF"));
    }
    if arrived < 2 {
        return Parsed::Incomplete;
    }
    let header_len = line.header_len.unwrap_or(0);
    let block = buf.get(line_len..payload_end).unwrap_or_default();
    let (headers, payload) = block.split_at(header_len.min(block.len()));
    Parsed::Op(
        ServerOp::Msg {
            subject: line.subject,
            sid: line.sid,
            reply: line.reply,
            headers: headed.then_some(headers),
            payload,
        },
        payload_end + 2,
    )
}

/// The status code of an HMSG header block: `NATS/1.0 503\r\n...` -> Some(503);
/// `NATS/1.0\r\n...` -> None; a description after the code is allowed
/// (`NATS/1.0 408 Request Timeout`). The code is three digits, 100 to 999, as async-nats's
/// `StatusCode` takes it; anything else is None. Never panics.
pub fn status(headers: &[u8]) -> Option<u16> {
    let rest = headers.strip_prefix(HEADER_VERSION)?;
    if !rest.first().copied().is_some_and(is_blank) {
        return None;
    }
    let rest = trim(rest);
    let code = match *rest {
        [a @ b'1'..=b'9', b @ b'0'..=b'9', c @ b'0'..=b'9', ref after @ ..] => {
            match after.first() {
                None | Some(b' ' | b'\t' | b'\r') => [a, b, c],
                Some(_) => return None,
            }
        }
        _ => return None,
    };
    Some(
        code.iter()
            .fold(0, |value, &digit| value * 10 + u16::from(digit - b'0')),
    )
}

/// Appends `HPUB {subject} {reply_prefix}{sequence} {header_len} {header_len + payload_len}\r\n`
/// to `out` (WIRE4, WIRE5). The caller then appends the header block, the payload and "\r\n".
pub fn hpub_line(
    out: &mut BytesMut,
    subject: &str,
    reply_prefix: &str,
    sequence: u64,
    header_len: usize,
    payload_len: usize,
) {
    hpub_line_to(
        out,
        subject,
        Some((reply_prefix, sequence)),
        header_len,
        payload_len,
    );
}

/// [`hpub_line`] with the reply subject `{prefix}{sequence}` when `reply` is given, or none:
/// `HPUB {subject} {header_len} {total}\r\n`, a publish nothing answers (a message of an
/// atomic batch before its commit, `crate::batch` B3).
pub fn hpub_line_to(
    out: &mut BytesMut,
    subject: &str,
    reply: Option<(&str, u64)>,
    header_len: usize,
    payload_len: usize,
) {
    let mut sequence_text = itoa::Buffer::new();
    let reply = reply
        .map(|(prefix, sequence)| (prefix.as_bytes(), sequence_text.format(sequence).as_bytes()));
    hpub_parts(out, subject, reply, header_len, payload_len);
}

/// [`hpub_line`] with a reply subject written whole by the caller (a fast-ingest batch's,
/// `crate::batch` F5).
pub fn hpub_line_reply(
    out: &mut BytesMut,
    subject: &str,
    reply: &[u8],
    header_len: usize,
    payload_len: usize,
) {
    hpub_parts(out, subject, Some((reply, b"")), header_len, payload_len);
}

/// The `HPUB` line with the reply subject made of two parts, if any.
fn hpub_parts(
    out: &mut BytesMut,
    subject: &str,
    reply: Option<(&[u8], &[u8])>,
    header_len: usize,
    payload_len: usize,
) {
    let (reply_prefix, sequence, space): (&[u8], &[u8], &[u8]) = match reply {
        Some((prefix, rest)) => (prefix, rest, b" "),
        None => (b"", b"", b""),
    };
    let mut header_text = itoa::Buffer::new();
    let header = header_text.format(header_len);
    // Two in-memory lengths cannot overflow `u128`: the total is exact, never wrapped.
    let mut total_text = itoa::Buffer::new();
    let total = total_text.format(header_len as u128 + payload_len as u128);
    let parts: [&[u8]; 10] = [
        b"HPUB ",
        subject.as_bytes(),
        b" ",
        reply_prefix,
        sequence,
        space,
        header.as_bytes(),
        b" ",
        total.as_bytes(),
        b"\r\n",
    ];
    out.reserve(parts.iter().map(|part| part.len()).sum());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// Appends one header line `name: value\r\n`. The caller guarantees what the protocol
/// needs: no `:`, blank, CR or LF in `name`, no CR or LF in `value` (M1 in
/// [`crate::message`]).
pub fn header_line(out: &mut BytesMut, name: &str, value: &[u8]) {
    out.reserve(name.len() + 2 + value.len() + 2);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

fn is_blank(byte: u8) -> bool {
    byte == b' ' || byte == b'\t'
}

/// `bytes` without the blanks around it.
fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|&b| !is_blank(b))
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|&b| !is_blank(b))
        .map_or(start, |end| end + 1);
    bytes.get(start..end).unwrap_or_default()
}

/// A plain decimal number that fits `u64`: digits only, at least one.
fn number(text: &[u8]) -> Option<u64> {
    if text.is_empty() {
        return None;
    }
    text.iter().try_fold(0u64, |value, &digit| {
        if !digit.is_ascii_digit() {
            return None;
        }
        value.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

/// Up to [`QUOTED_MAX`] bytes of `bytes`, quoted and escaped, for an `Invalid` text.
fn quoted(bytes: &[u8]) -> String {
    let shown = bytes.get(..QUOTED_MAX).unwrap_or(bytes);
    let more = if shown.len() < bytes.len() { "…" } else { "" };
    format!("\"{}{more}\"", shown.escape_ascii())
}

fn invalid<'a>(text: String) -> Parsed<'a> {
    Parsed::Invalid(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMIT: usize = 4096;
    const MAX_PAYLOAD: usize = 1024 * 1024;

    /// What nats-server 2.9.10 wrote to a raw client (`verbose`, `headers`,
    /// `no_responders`, a user denied publishing to "x"), byte for byte.
    const INFO: &[u8] = b"INFO {\"server_id\":\"NC7G5PALW7MYGCYQEX7FP57RTNQUYA6ACVMYQSUYTZMQBEAK3OPXYXRO\",\"server_name\":\"NC7G5PALW7MYGCYQEX7FP57RTNQUYA6ACVMYQSUYTZMQBEAK3OPXYXRO\",\"version\":\"2.9.10\",\"proto\":1,\"go\":\"go1.19.8\",\"host\":\"0.0.0.0\",\"port\":14999,\"headers\":true,\"auth_required\":true,\"max_payload\":1048576,\"client_id\":4,\"client_ip\":\"127.0.0.1\"} \r\n";
    const MSGS: &[u8] = b"+OK\r\nMSG subj 1 5\r\nhello\r\nMSG subj 2 5\r\nhello\r\n";
    const MSGS_WITH_REPLY: &[u8] =
        b"+OK\r\nMSG subj 1 reply 5\r\nhello\r\nMSG subj 2 reply 5\r\nhello\r\nPING\r\n";
    const HMSG: &[u8] = b"HMSG subj 1 reply 24 29\r\nNATS/1.0\r\nA: b\r\nC: d\r\n\r\nhello\r\n";
    const NO_RESPONDERS: &[u8] = b"HMSG _INBOX.r 9 16 16\r\nNATS/1.0 503\r\n\r\n\r\n";
    const PERMISSIONS: &[u8] = b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n";
    const UNKNOWN_OPERATION: &[u8] = b"-ERR 'Unknown Protocol Operation'\r\n";

    fn one(buf: &[u8]) -> Parsed<'_> {
        parse(buf, LIMIT, MAX_PAYLOAD)
    }

    /// Every operation in `buf`, and what is left at the end (`Incomplete` or `Invalid`).
    fn all(
        buf: &[u8],
        max_control_line: usize,
        max_payload: usize,
    ) -> (Vec<ServerOp<'_>>, Parsed<'_>) {
        let mut ops = Vec::new();
        let mut at = 0;
        loop {
            match parse(&buf[at..], max_control_line, max_payload) {
                Parsed::Op(op, used) => {
                    assert!(used >= 1 && used <= buf.len() - at, "used {used}");
                    ops.push(op);
                    at += used;
                }
                end => return (ops, end),
            }
        }
    }

    fn msg<'a>(
        subject: &'a [u8],
        sid: u64,
        reply: Option<&'a [u8]>,
        headers: Option<&'a [u8]>,
        payload: &'a [u8],
    ) -> ServerOp<'a> {
        ServerOp::Msg {
            subject,
            sid,
            reply,
            headers,
            payload,
        }
    }

    #[test]
    fn info() {
        let json = &INFO[5..INFO.len() - 3];
        assert_eq!(json.first(), Some(&b'{'));
        assert_eq!(json.last(), Some(&b'}'));
        assert_eq!(one(INFO), Parsed::Op(ServerOp::Info(json), INFO.len()));
    }

    #[test]
    fn msg_and_ok() {
        let (ops, end) = all(MSGS, LIMIT, MAX_PAYLOAD);
        assert_eq!(
            ops,
            [
                ServerOp::Ok,
                msg(b"subj", 1, None, None, b"hello"),
                msg(b"subj", 2, None, None, b"hello"),
            ]
        );
        assert_eq!(end, Parsed::Incomplete);
        assert_eq!(
            one(b"MSG subj 1 5\r\nhello\r\n"),
            Parsed::Op(msg(b"subj", 1, None, None, b"hello"), 21)
        );
    }

    #[test]
    fn msg_with_reply_and_ping() {
        let (ops, end) = all(MSGS_WITH_REPLY, LIMIT, MAX_PAYLOAD);
        assert_eq!(
            ops,
            [
                ServerOp::Ok,
                msg(b"subj", 1, Some(b"reply"), None, b"hello"),
                msg(b"subj", 2, Some(b"reply"), None, b"hello"),
                ServerOp::Ping,
            ]
        );
        assert_eq!(end, Parsed::Incomplete);
    }

    #[test]
    fn hmsg() {
        let headers: &[u8] = b"NATS/1.0\r\nA: b\r\nC: d\r\n\r\n";
        assert_eq!(headers.len(), 24);
        assert_eq!(
            one(HMSG),
            Parsed::Op(
                msg(b"subj", 1, Some(b"reply"), Some(headers), b"hello"),
                HMSG.len()
            )
        );
        assert_eq!(status(headers), None);
    }

    #[test]
    fn no_responders() {
        let headers: &[u8] = b"NATS/1.0 503\r\n\r\n";
        assert_eq!(
            one(NO_RESPONDERS),
            Parsed::Op(
                msg(b"_INBOX.r", 9, None, Some(headers), b""),
                NO_RESPONDERS.len()
            )
        );
        assert_eq!(status(headers), Some(503));
    }

    #[test]
    fn err_ping_pong() {
        assert_eq!(
            one(PERMISSIONS),
            Parsed::Op(
                ServerOp::Err(b"Permissions Violation for Publish to \"x\""),
                PERMISSIONS.len()
            )
        );
        assert_eq!(
            one(UNKNOWN_OPERATION),
            Parsed::Op(
                ServerOp::Err(b"Unknown Protocol Operation"),
                UNKNOWN_OPERATION.len()
            )
        );
        assert_eq!(one(b"-ERR\r\n"), Parsed::Op(ServerOp::Err(b""), 6));
        assert_eq!(
            one(b"-ERR unquoted\r\n"),
            Parsed::Op(ServerOp::Err(b"unquoted"), 15)
        );
        assert_eq!(one(b"PING\r\n"), Parsed::Op(ServerOp::Ping, 6));
        assert_eq!(one(b"PONG\r\nPING\r\n"), Parsed::Op(ServerOp::Pong, 6));
        assert_eq!(one(b"+OK\r\n"), Parsed::Op(ServerOp::Ok, 5));
    }

    #[test]
    fn any_case_and_blanks() {
        assert_eq!(one(b"ping\r\n"), Parsed::Op(ServerOp::Ping, 6));
        assert_eq!(one(b"pOnG \t\r\n"), Parsed::Op(ServerOp::Pong, 8));
        assert_eq!(one(b"+ok\r\n"), Parsed::Op(ServerOp::Ok, 5));
        assert_eq!(one(b"info\t{}\r\n"), Parsed::Op(ServerOp::Info(b"{}"), 9));
        assert_eq!(one(b"-err\t'x'\t\r\n"), Parsed::Op(ServerOp::Err(b"x"), 11));
        let frame = b"msg\tsubj \t1\t\treply  5 \r\nhello\r\n";
        assert_eq!(
            one(frame),
            Parsed::Op(msg(b"subj", 1, Some(b"reply"), None, b"hello"), frame.len())
        );
        let frame = b"hMsG subj\t1 2 2\r\n\r\n\r\n";
        assert_eq!(
            one(frame),
            Parsed::Op(msg(b"subj", 1, None, Some(b"\r\n"), b""), frame.len())
        );
    }

    #[test]
    fn payload_may_hold_anything() {
        let frame = b"MSG s 1 6\r\nPING\r\n\r\n";
        assert_eq!(
            one(frame),
            Parsed::Op(msg(b"s", 1, None, None, b"PING\r\n"), frame.len())
        );
    }

    #[track_caller]
    fn refused(buf: &[u8], words: &str) {
        match one(buf) {
            Parsed::Invalid(text) => assert!(text.contains(words), "{buf:?}: {text}"),
            other => panic!("{:?}: {other:?}", buf.escape_ascii().to_string()),
        }
    }

    #[test]
    fn refuses_what_is_not_nats() {
        let cases: &[(&[u8], &str)] = &[
            (b"BOGUS\r\n", "unknown operation \"BOGUS\""),
            (b"PINGX\r\n", "unknown operation"),
            (b"\r\n", "without a verb"),
            (b" PING\r\n", "without a verb"),
            (b"PING\n", "line feed without a carriage return"),
            (b"MSG a 1 5\nhello\r\n", "line feed without"),
            (b"\n", "line feed without"),
            (b"PI\rNG\r\n", "carriage return inside"),
            (b"PING x\r\n", "PING followed by \"x\""),
            (b"+OK ok\r\n", "+OK followed by"),
            (b"INFO \r\n", "INFO without"),
            (b"MSG subj 1\r\n", "MSG with 2 fields, not 3 or 4"),
            (b"MSG a b c d e\r\n", "MSG with 5 fields"),
            (b"MSG a b c d e f\r\n", "more than 5 fields"),
            (
                b"HMSG subj 1 5\r\nhello\r\n",
                "HMSG with 3 fields, not 4 or 5",
            ),
            (b"MSG subj x 5\r\n", "subscription id \"x\""),
            (b"MSG subj 1 -5\r\n", "size \"-5\""),
            (b"MSG subj 1 +5\r\n", "size \"+5\""),
            (b"MSG subj 1 5x\r\n", "size \"5x\""),
            (b"MSG subj 18446744073709551616 5\r\n", "subscription id"),
            (b"MSG subj 1 18446744073709551616\r\n", "size"),
            (b"HMSG subj 1 6 5\r\n", "header size larger"),
            (b"MSG subj 1 5\r\nhelloX", "not followed by CRLF"),
            (b"MSG subj 1 5\r\nhello\rX", "not followed by CRLF"),
            (b"MSG subj 1 5\r\nhello\n", "not followed by CRLF"),
            (b"MSG subj 1 4\r\nhello\r\n", "not followed by CRLF"),
        ];
        for (frame, words) in cases {
            refused(frame, words);
        }
        // Without a payload limit, a frame's end must still fit in memory.
        refused_with(
            b"MSG s 1 18446744073709551615\r\n",
            LIMIT,
            usize::MAX,
            "beyond memory",
        );
        assert_eq!(
            parse(b"MSG s 1 18446744073709551000\r\n", LIMIT, usize::MAX),
            Parsed::Incomplete
        );
    }

    #[test]
    fn incomplete_until_whole() {
        for frame in [
            INFO,
            HMSG,
            NO_RESPONDERS,
            PERMISSIONS,
            b"PING\r\n".as_slice(),
        ] {
            for cut in 0..frame.len() {
                assert_eq!(one(&frame[..cut]), Parsed::Incomplete, "{cut}");
            }
        }
    }

    #[test]
    fn limits() {
        let line = b"MSG subj 1 5"; // 12 bytes without CRLF
        let frame = b"MSG subj 1 5\r\nhello\r\n";
        let whole = Parsed::Op(msg(b"subj", 1, None, None, b"hello"), frame.len());
        assert_eq!(parse(frame, line.len(), 5), whole);
        refused_with(frame, line.len() - 1, 5, "longer than 11 bytes");
        refused_with(
            frame,
            line.len(),
            4,
            "5 bytes, more than the maximum payload of 4",
        );
        // Too long is known before the CRLF comes, and not before.
        refused_with(&frame[..13], 11, 5, "longer than 11");
        assert_eq!(parse(&frame[..12], 11, 5), Parsed::Incomplete);
        assert_eq!(parse(&frame[..13], 12, 5), Parsed::Incomplete);
        refused_with(b"PING", 1, 5, "longer than 1");
        refused_with(b"\r\n", 0, 0, "without a verb");
        refused_with(b"x\r", 0, 0, "longer than 0");
        // HMSG counts headers and payload together.
        refused_with(HMSG, LIMIT, 28, "29 bytes");
        assert!(matches!(parse(HMSG, LIMIT, 29), Parsed::Op(..)));
    }

    #[track_caller]
    fn refused_with(buf: &[u8], max_control_line: usize, max_payload: usize, words: &str) {
        match parse(buf, max_control_line, max_payload) {
            Parsed::Invalid(text) => assert!(text.contains(words), "{text}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn status_codes() {
        assert_eq!(status(b"NATS/1.0 503\r\n\r\n"), Some(503));
        assert_eq!(status(b"NATS/1.0 408 Request Timeout\r\n\r\n"), Some(408));
        assert_eq!(status(b"NATS/1.0\t100\r\n"), Some(100));
        assert_eq!(status(b"NATS/1.0 503"), Some(503));
        assert_eq!(status(b"NATS/1.0  999 \r\n"), Some(999));
        for none in [
            b"NATS/1.0\r\n\r\n".as_slice(),
            b"NATS/1.0 \r\n",
            b"NATS/1.0",
            b"NATS/1.0503\r\n",
            b"NATS/1.0 5030\r\n",
            b"NATS/1.0 50\r\n",
            b"NATS/1.0 099\r\n",
            b"NATS/1.0 5x3\r\n",
            b"NATS/1.1 503\r\n",
            b"nats/1.0 503\r\n",
            b"",
        ] {
            assert_eq!(status(none), None, "{}", none.escape_ascii());
        }
    }

    #[test]
    fn hpub_golden() {
        let mut headers = BytesMut::new();
        headers.extend_from_slice(HEADER_START);
        header_line(&mut headers, "A", b"b");
        header_line(&mut headers, "C", b"d");
        headers.extend_from_slice(HEADER_END);
        assert_eq!(&headers[..], b"NATS/1.0\r\nA: b\r\nC: d\r\n\r\n");
        let mut out = BytesMut::new();
        hpub_line(&mut out, "subj", "_INBOX.t.", 7, headers.len(), 5);
        assert_eq!(&out[..], b"HPUB subj _INBOX.t.7 24 29\r\n");
        let mut out = BytesMut::new();
        hpub_line(&mut out, "s", "r", u64::MAX, usize::MAX, usize::MAX);
        assert_eq!(
            &out[..],
            b"HPUB s r18446744073709551615 18446744073709551615 36893488147419103230\r\n"
        );
    }

    #[test]
    fn a_publish_without_reply_has_the_same_sizes() {
        let mut out = BytesMut::new();
        hpub_line_to(&mut out, "subj", None, 12, 5);
        assert_eq!(&out[..], b"HPUB subj 12 17\r\n");
    }

    // ---- proptests -------------------------------------------------------------------

    /// An operation that owns its bytes, for generating.
    #[derive(Debug, Clone)]
    enum Op {
        Info(Vec<u8>),
        Msg {
            subject: Vec<u8>,
            sid: u64,
            reply: Option<Vec<u8>>,
            headers: Option<(Option<u16>, Vec<u8>)>,
            payload: Vec<u8>,
        },
        Ping,
        Pong,
        Ok,
        Err(Vec<u8>),
    }

    impl Op {
        fn view(&self) -> ServerOp<'_> {
            match self {
                Op::Info(json) => ServerOp::Info(json),
                Op::Msg {
                    subject,
                    sid,
                    reply,
                    headers,
                    payload,
                } => ServerOp::Msg {
                    subject,
                    sid: *sid,
                    reply: reply.as_deref(),
                    headers: headers.as_ref().map(|(_, block)| block.as_slice()),
                    payload,
                },
                Op::Ping => ServerOp::Ping,
                Op::Pong => ServerOp::Pong,
                Op::Ok => ServerOp::Ok,
                Op::Err(text) => ServerOp::Err(text),
            }
        }
    }

    /// How an operation is written: the verb's case (a bit per letter), the blanks between
    /// fields, blanks before the CRLF.
    #[derive(Debug, Clone)]
    struct Style {
        case: u8,
        blank: &'static [u8],
        trailing: &'static [u8],
    }

    fn style() -> impl Strategy<Value = Style> {
        let blanks = prop_oneof![
            Just(&b" "[..]),
            Just(&b"\t"[..]),
            Just(&b" \t "[..]),
            Just(&b"  "[..])
        ];
        let trailing =
            prop_oneof![3 => Just(&b""[..]), 1 => Just(&b" "[..]), 1 => Just(&b"\t "[..])];
        (any::<u8>(), blanks, trailing).prop_map(|(case, blank, trailing)| Style {
            case,
            blank,
            trailing,
        })
    }

    /// Test-only serialiser: writes `op` as the server would (in `style`); returns the
    /// control line's length without its CRLF, and the payload's.
    fn write(op: &Op, style: &Style, out: &mut Vec<u8>) -> (usize, usize) {
        let start = out.len();
        let verb: &[u8] = match op {
            Op::Info(_) => b"INFO",
            Op::Msg { headers: None, .. } => b"MSG",
            Op::Msg {
                headers: Some(_), ..
            } => b"HMSG",
            Op::Ping => b"PING",
            Op::Pong => b"PONG",
            Op::Ok => b"+OK",
            Op::Err(_) => b"-ERR",
        };
        for (i, &b) in verb.iter().enumerate() {
            out.push(if (style.case >> i) & 1 == 1 {
                b.to_ascii_lowercase()
            } else {
                b
            });
        }
        let field = |out: &mut Vec<u8>, bytes: &[u8]| {
            out.extend_from_slice(style.blank);
            out.extend_from_slice(bytes);
        };
        let mut body: Option<Vec<u8>> = None;
        match op {
            Op::Info(json) => field(out, json),
            Op::Err(text) => field(out, &[b"'", &text[..], b"'"].concat()),
            Op::Ping | Op::Pong | Op::Ok => {}
            Op::Msg {
                subject,
                sid,
                reply,
                headers,
                payload,
            } => {
                field(out, subject);
                field(out, sid.to_string().as_bytes());
                if let Some(reply) = reply {
                    field(out, reply);
                }
                let mut block = Vec::new();
                if let Some((_, headers)) = headers {
                    field(out, headers.len().to_string().as_bytes());
                    block.extend_from_slice(headers);
                }
                block.extend_from_slice(payload);
                field(out, block.len().to_string().as_bytes());
                body = Some(block);
            }
        }
        out.extend_from_slice(style.trailing);
        let line_len = out.len() - start;
        out.extend_from_slice(b"\r\n");
        let payload_len = body.as_ref().map_or(0, Vec::len);
        if let Some(body) = body {
            out.extend_from_slice(&body);
            out.extend_from_slice(b"\r\n");
        }
        (line_len, payload_len)
    }

    /// A field: no blank, CR or LF, at least one byte.
    fn token() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 1..12).prop_map(|bytes| {
            bytes
                .into_iter()
                .map(|b| {
                    if matches!(b, b' ' | b'\t' | b'\r' | b'\n') {
                        b'_'
                    } else {
                        b
                    }
                })
                .collect()
        })
    }

    /// Text for a line: no CR or LF.
    fn text(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), len).prop_map(|bytes| {
            bytes
                .into_iter()
                .map(|b| if matches!(b, b'\r' | b'\n') { b'.' } else { b })
                .collect()
        })
    }

    /// A header name and value, as `header_line` takes them.
    fn header() -> impl Strategy<Value = (String, Vec<u8>)> {
        ("[A-Za-z][A-Za-z0-9-]{0,15}", text(0..20))
    }

    /// A header block as the server forwards it: `NATS/1.0[ code]\r\n`, lines, `\r\n`.
    fn header_block() -> impl Strategy<Value = (Option<u16>, Vec<u8>)> {
        (
            proptest::option::of(100u16..1000),
            proptest::collection::vec(header(), 0..4),
        )
            .prop_map(|(code, lines)| {
                let mut block = BytesMut::new();
                match code {
                    Some(code) => {
                        block.extend_from_slice(format!("NATS/1.0 {code}\r\n").as_bytes())
                    }
                    None => block.extend_from_slice(HEADER_START),
                }
                for (name, value) in &lines {
                    header_line(&mut block, name, value);
                }
                block.extend_from_slice(HEADER_END);
                (code, block.to_vec())
            })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            1 => text(1..40).prop_map(|mut json| {
                // The JSON never starts or ends with a blank (the parser trims blanks).
                if let Some(first) = json.first_mut() {
                    if is_blank(*first) {
                        *first = b'{';
                    }
                }
                if let Some(last) = json.last_mut() {
                    if is_blank(*last) {
                        *last = b'}';
                    }
                }
                Op::Info(json)
            }),
            3 => (
                token(),
                prop_oneof![any::<u64>(), 0u64..10],
                proptest::option::of(token()),
                proptest::option::of(header_block()),
                proptest::collection::vec(any::<u8>(), 0..40),
            )
                .prop_map(|(subject, sid, reply, headers, payload)| Op::Msg {
                    subject,
                    sid,
                    reply,
                    headers,
                    payload,
                }),
            1 => Just(Op::Ping),
            1 => Just(Op::Pong),
            1 => Just(Op::Ok),
            1 => text(0..30).prop_map(Op::Err),
        ]
    }

    /// A stream of operations, written; each operation's frame length; the longest control
    /// line and payload.
    fn stream() -> impl Strategy<Value = (Vec<Op>, Vec<u8>, Vec<usize>, usize, usize)> {
        proptest::collection::vec((op(), style()), 1..8).prop_map(|ops| {
            let mut bytes = Vec::new();
            let mut frames = Vec::new();
            let (mut longest_line, mut largest_payload) = (0, 0);
            for (op, style) in &ops {
                let start = bytes.len();
                let (line, payload) = write(op, style, &mut bytes);
                frames.push(bytes.len() - start);
                longest_line = longest_line.max(line);
                largest_payload = largest_payload.max(payload);
            }
            let ops = ops.into_iter().map(|(op, _)| op).collect();
            (ops, bytes, frames, longest_line, largest_payload)
        })
    }

    /// WIRE1, WIRE2: whatever `bytes` hold, every operation takes between 1 byte and what is
    /// left, and at every cut the prefix gives `Incomplete` or what the whole gives.
    fn check_total(bytes: &[u8], max_control_line: usize, max_payload: usize) {
        let mut at = 0;
        loop {
            let rest = &bytes[at..];
            let whole = parse(rest, max_control_line, max_payload);
            for cut in 0..rest.len() {
                let prefix = parse(&rest[..cut], max_control_line, max_payload);
                assert!(
                    prefix == Parsed::Incomplete || prefix == whole,
                    "at {at}, cut {cut}: {prefix:?}, whole {whole:?}"
                );
            }
            match whole {
                Parsed::Op(_, used) => {
                    assert!(
                        used >= 1 && used <= rest.len(),
                        "used {used} of {}",
                        rest.len()
                    );
                    at += used;
                }
                Parsed::Incomplete | Parsed::Invalid(_) => return,
            }
        }
    }

    proptest! {
        /// (1) Operations written one after another are read back one by one, each with its
        /// frame's length, with the limits at exactly the longest line and payload; one
        /// byte less of either makes the first operation that needs it invalid.
        #[test]
        fn round_trip((ops, bytes, frames, longest_line, largest_payload) in stream()) {
            let mut at = 0;
            for (op, frame) in ops.iter().zip(&frames) {
                let parsed = parse(&bytes[at..], longest_line, largest_payload);
                prop_assert_eq!(parsed, Parsed::Op(op.view(), *frame));
                if let Op::Msg { headers: Some((code, block)), .. } = op {
                    prop_assert_eq!(status(block), *code);
                }
                at += frame;
            }
            prop_assert_eq!(at, bytes.len());
            prop_assert_eq!(parse(&bytes[at..], longest_line, largest_payload), Parsed::Incomplete);

            let (read, end) = all(&bytes, longest_line - 1, largest_payload);
            prop_assert!(matches!(end, Parsed::Invalid(ref text) if text.contains("longer than")), "{:?}", end);
            prop_assert!(read.len() < ops.len());
            if largest_payload > 0 {
                let (read, end) = all(&bytes, longest_line, largest_payload - 1);
                prop_assert!(matches!(end, Parsed::Invalid(ref text) if text.contains("maximum payload")), "{:?}", end);
                prop_assert!(read.len() < ops.len());
            }
        }

        /// (2) Cut anywhere, the stream gives the operations wholly before the cut, then
        /// `Incomplete`: never a wrong operation, never `Invalid`.
        #[test]
        fn prefixes_are_incomplete((ops, bytes, frames, _, _) in stream()) {
            let mut ends = Vec::new();
            let mut end = 0;
            for frame in &frames {
                end += frame;
                ends.push(end);
            }
            for cut in 0..=bytes.len() {
                let (read, rest) = all(&bytes[..cut], LIMIT, MAX_PAYLOAD);
                let whole = ends.iter().filter(|&&end| end <= cut).count();
                prop_assert_eq!(read.len(), whole, "cut {}", cut);
                for (read, op) in read.iter().zip(&ops) {
                    prop_assert_eq!(read, &op.view());
                }
                prop_assert_eq!(rest, Parsed::Incomplete, "cut {}", cut);
            }
        }

        /// (3) Arbitrary bytes, under arbitrary limits: never a panic, never more than the
        /// buffer, and WIRE2's prefix rule at every cut.
        #[test]
        fn total_on_any_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..120),
            max_control_line in prop_oneof![0usize..40, Just(LIMIT), Just(usize::MAX)],
            max_payload in prop_oneof![0usize..40, Just(MAX_PAYLOAD), Just(usize::MAX)],
        ) {
            check_total(&bytes, max_control_line, max_payload);
        }

        /// (3) Valid streams with a byte changed, inserted or removed, or a real frame's
        /// bytes shuffled a little: the same.
        #[test]
        fn total_on_mangled_frames(
            (_, bytes, _, longest_line, largest_payload) in stream(),
            at in any::<usize>(),
            byte in prop_oneof![any::<u8>(), Just(b'\r'), Just(b'\n'), Just(b' '), Just(b'9')],
            how in 0u8..3,
        ) {
            let mut bytes = bytes;
            let at = at % bytes.len();
            match how {
                0 => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ => { bytes.remove(at); }
            }
            check_total(&bytes, longest_line, largest_payload);
            check_total(&bytes, LIMIT, MAX_PAYLOAD);
        }

        /// (4) `hpub_line`, header lines and a payload: the sizes written are the real ones,
        /// and the frame reads back (as the server delivers it, an HMSG) to the same
        /// header block and payload.
        #[test]
        fn hpub_sizes_are_real(
            subject in "[a-zA-Z0-9_.>*-]{1,30}",
            reply_prefix in "[a-zA-Z0-9_.-]{0,30}",
            sequence in any::<u64>(),
            headers in proptest::collection::vec(header(), 0..6),
            payload in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut block = BytesMut::new();
            block.extend_from_slice(HEADER_START);
            for (name, value) in &headers {
                header_line(&mut block, name, value);
            }
            block.extend_from_slice(HEADER_END);
            let mut frame = BytesMut::new();
            hpub_line(&mut frame, &subject, &reply_prefix, sequence, block.len(), payload.len());
            let line_len = frame.len();
            frame.extend_from_slice(&block);
            frame.extend_from_slice(&payload);
            frame.extend_from_slice(b"\r\n");

            let line = &frame[..line_len - 2];
            prop_assert_eq!(&frame[line_len - 2..line_len], b"\r\n");
            let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let reply = format!("{reply_prefix}{sequence}");
            let header_len = block.len().to_string();
            let total = (block.len() + payload.len()).to_string();
            prop_assert_eq!(
                fields,
                [&b"HPUB"[..], subject.as_bytes(), reply.as_bytes(), header_len.as_bytes(), total.as_bytes()]
            );
            prop_assert_eq!(frame.len(), line_len + block.len() + payload.len() + 2);

            let delivered = [
                format!("HMSG {subject} 1 {reply} {header_len} {total}").as_bytes(),
                &frame[line_len - 2..],
            ]
            .concat();
            prop_assert_eq!(
                one(&delivered),
                Parsed::Op(msg(subject.as_bytes(), 1, Some(reply.as_bytes()), Some(&block[..]), &payload), delivered.len())
            );
            prop_assert_eq!(status(&block), None);
        }
    }
}
