//! JetStream's answer to a publish, read by hand: the PubAck JSON
//! (`{"stream":"S","seq":N}`, with `"duplicate":true` when the message id was seen), the
//! API error (`{"error":{"code":…,"err_code":…,"description":…}}`) and the no-responders
//! status (no stream listens on the subject, or no JetStream at all).
//!
//! async-nats reads every ack with serde's untagged `Response<PublishAck>`, which first
//! tries the error variant and formats a serde error message for each successful ack; this
//! reader walks the bytes once and allocates nothing for an ack (docs/performance.md,
//! proposal 4).
//!
//! # Invariants
//! - AK1 Total: any bytes give `Ok` or `Err`, never a panic; nesting is bounded
//!   ([`MAX_DEPTH`]), so no input can exhaust the stack.
//! - AK2 It reads what async-nats 0.51 reads, as strictly: an `"error"` member (not `null`)
//!   makes the answer an error whatever else it holds (the untagged enum tries that variant
//!   first); otherwise `"stream"` (a string) and `"seq"` (an integer in `u64`) are
//!   required, `"duplicate"` is a boolean defaulting to `false`, and unknown members are
//!   skipped whatever their value. The input must be one JSON object and nothing but
//!   whitespace around it. A unit proptest checks the two readers agree. One liberty:
//!   serde also reads a struct written as an array (`"error":[400,10071,"…"]`), which no
//!   server sends; this reader refuses it, which fails the publish (P1: never confirmed).
//! - AK3 Errors are classified as async-nats 0.51's `PublishAckFuture` classifies them, so
//!   [`crate::SinkError`]'s `is_fence_refusal`, `poison_id` and `advice` see what they saw:
//!   the 503 no-responders status is `StreamNotFound`; err_code 10071 `WrongLastSequence`,
//!   10070 `WrongLastMessageId`, any other `Other`, each with async-nats's
//!   `jetstream::Error` (code, err_code, description) as its source; an unreadable answer
//!   is `Other`.

use std::borrow::Cow;
use std::fmt;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::ErrorCode;
use async_nats::StatusCode;

/// How deep unknown members may nest before the answer counts as unreadable (serde_json's
/// own recursion limit is 128).
pub const MAX_DEPTH: usize = 64;

/// A stored (or duplicate) publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubAck<'a> {
    /// The stream that stored the message.
    pub stream: Cow<'a, str>,
    /// Its sequence in the stream (the original's, for a duplicate).
    pub sequence: u64,
    /// Whether the stream already held a message with this `Nats-Msg-Id`.
    pub duplicate: bool,
}

/// A JetStream API error, as the server sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP-like status (400, 503…).
    pub code: u64,
    /// JetStream's own error code (10071: wrong last sequence…); 0 when absent.
    pub err_code: u64,
    /// The server's words, when given.
    pub description: Option<String>,
}

/// What an answer says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply<'a> {
    /// Stored, or a duplicate.
    Ack(PubAck<'a>),
    /// Refused.
    Error(ApiError),
}

/// Why an answer could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Where, in bytes from the start.
    pub offset: usize,
    /// What was expected there.
    pub expected: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unreadable JetStream publish ack: expected {} at byte {}",
            self.expected, self.offset
        )
    }
}

impl std::error::Error for ParseError {}

/// The answer to a publish, classified as async-nats classifies it (AK3).
pub fn read(message: &async_nats::Message) -> Result<PubAck<'_>, PublishError> {
    read_parts(message.status.map(|s| s.as_u16()), &message.payload)
}

/// [`read`] of an answer's status code (the `NATS/1.0 503` of its header block, if any) and
/// payload, as the sink's own connection receives them (`crate::conn`).
pub fn read_parts(status: Option<u16>, payload: &[u8]) -> Result<PubAck<'_>, PublishError> {
    if status == Some(StatusCode::NO_RESPONDERS.as_u16()) {
        return Err(PublishError::new(PublishErrorKind::StreamNotFound));
    }
    match parse(payload) {
        Ok(Reply::Ack(ack)) => Ok(ack),
        Ok(Reply::Error(error)) => Err(error.into_publish_error()),
        Err(error) => Err(PublishError::with_source(PublishErrorKind::Other, error)),
    }
}

impl ApiError {
    /// The error async-nats's `PublishAckFuture` gives for this answer (AK3).
    pub fn into_publish_error(self) -> PublishError {
        let (code, err_code) = (self.code, self.err_code);
        let json = serde_json::json!({
            "code": code,
            "err_code": err_code,
            "description": self.description,
        });
        // async-nats's error has private fields: it is built the way async-nats builds it,
        // from JSON. Only a `code` beyond `usize` can fail, which no server sends.
        let error = match serde_json::from_value::<async_nats::jetstream::Error>(json) {
            Ok(error) => error,
            Err(_) => {
                return PublishError::with_source(
                    PublishErrorKind::Other,
                    format!("JetStream error code {code}, error code {err_code}"),
                )
            }
        };
        let kind = match error.error_code() {
            ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID => PublishErrorKind::WrongLastMessageId,
            ErrorCode::STREAM_WRONG_LAST_SEQUENCE => PublishErrorKind::WrongLastSequence,
            _ => PublishErrorKind::Other,
        };
        PublishError::with_source(kind, error)
    }
}

/// Reads a JetStream publish answer's JSON (AK1, AK2).
pub fn parse(input: &[u8]) -> Result<Reply<'_>, ParseError> {
    let mut parser = Parser { input, at: 0 };
    let mut stream = Field::Absent;
    let mut sequence = Field::Absent;
    let mut duplicate = Field::Absent;
    let mut error = Field::Absent;
    let mut domain = Field::Absent;
    let mut value = Field::Absent;
    parser.object(|parser, key| match key.as_bytes() {
        b"stream" => parser.field(&mut stream, Parser::string),
        b"seq" => parser.field(&mut sequence, Parser::unsigned),
        b"duplicate" => parser.field(&mut duplicate, Parser::boolean),
        b"error" => parser.field(&mut error, Parser::api_error),
        b"domain" => parser.field(&mut domain, |parser| parser.string().map(drop)),
        b"val" => parser.field(&mut value, |parser| parser.string().map(drop)),
        _ => parser.skip_value(0),
    })?;
    parser.whitespace();
    if parser.at != input.len() {
        return Err(parser.expected("the end of the answer"));
    }
    if let Field::Value(error) = error {
        return Ok(Reply::Error(error));
    }
    // Not an error: now the ack's members must be well-typed (serde refuses `null` for a
    // `String`, a `u64` and a defaulted `bool` alike; `val` is an `Option`).
    let wrong = |expected| ParseError {
        offset: input.len(),
        expected,
    };
    let Field::Value(stream) = stream else {
        return Err(wrong("a string \"stream\""));
    };
    let Field::Value(sequence) = sequence else {
        return Err(wrong("an integer \"seq\""));
    };
    let duplicate = match duplicate {
        Field::Absent => false,
        Field::Value(duplicate) => duplicate,
        Field::Null | Field::Wrong => return Err(wrong("a boolean \"duplicate\"")),
    };
    if matches!(domain, Field::Null | Field::Wrong) {
        return Err(wrong("a string \"domain\""));
    }
    if matches!(value, Field::Wrong) {
        return Err(wrong("a string \"val\""));
    }
    Ok(Reply::Ack(PubAck {
        stream,
        sequence,
        duplicate,
    }))
}

/// A member's value, as serde's untagged enum sees it: a member of the wrong type does not
/// make the answer unreadable until the variant that needs it is tried (AK2).
#[derive(Debug)]
enum Field<T> {
    Absent,
    Null,
    Value(T),
    Wrong,
}

struct Parser<'a> {
    input: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    fn expected(&self, expected: &'static str) -> ParseError {
        ParseError {
            offset: self.at,
            expected,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// Skips whitespace, then consumes `byte` if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.whitespace();
        if self.peek() == Some(byte) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn literal(&mut self, word: &'static [u8], expected: &'static str) -> Result<(), ParseError> {
        match self.input.get(self.at..self.at + word.len()) {
            Some(found) if found == word => {
                self.at += word.len();
                Ok(())
            }
            _ => Err(self.expected(expected)),
        }
    }

    /// `{ "key": value, … }`, handing each key to `member`, which consumes the value.
    fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Result<(), ParseError>,
    ) -> Result<(), ParseError> {
        if !self.eat(b'{') {
            return Err(self.expected("'{'"));
        }
        if self.eat(b'}') {
            return Ok(());
        }
        loop {
            self.whitespace();
            let key = self.string()?;
            if !self.eat(b':') {
                return Err(self.expected("':'"));
            }
            self.whitespace();
            member(self, key)?;
            if self.eat(b',') {
                continue;
            }
            if self.eat(b'}') {
                return Ok(());
            }
            return Err(self.expected("',' or '}'"));
        }
    }

    /// A JSON string; borrowed unless it has escapes.
    fn string(&mut self) -> Result<Cow<'a, str>, ParseError> {
        let input = self.input;
        if self.peek() != Some(b'"') {
            return Err(self.expected("a string"));
        }
        self.at += 1;
        let start = self.at;
        // The common case, no escape: one scan to the closing quote, borrowed.
        let plain = input[start..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        if let Some(len) = plain.filter(|&len| input[start + len] == b'"') {
            self.at = start + len + 1;
            return std::str::from_utf8(&input[start..start + len])
                .map(Cow::Borrowed)
                .map_err(|_| ParseError {
                    offset: self.at,
                    expected: "UTF-8 text",
                });
        }
        self.escaped_string(start)
    }

    /// The rest of a string (its text from `start`, after the opening quote) that holds an
    /// escape, a control character or no closing quote: decoded into a buffer of its own
    /// from the first escape on.
    fn escaped_string(&mut self, start: usize) -> Result<Cow<'a, str>, ParseError> {
        let input = self.input;
        let mut owned: Option<Vec<u8>> = None;
        loop {
            let Some(byte) = self.peek() else {
                return Err(self.expected("the end of the string"));
            };
            match byte {
                b'"' => {
                    let raw = &input[start..self.at];
                    self.at += 1;
                    let offset = self.at;
                    let text = match owned {
                        None => std::str::from_utf8(raw).map(Cow::Borrowed).ok(),
                        Some(bytes) => String::from_utf8(bytes).map(Cow::Owned).ok(),
                    };
                    return text.ok_or(ParseError {
                        offset,
                        expected: "UTF-8 text",
                    });
                }
                b'\\' => {
                    let buffer = owned.get_or_insert_with(|| input[start..self.at].to_vec());
                    self.at += 1;
                    self.escape(buffer)?;
                }
                0x00..=0x1f => return Err(self.expected("no control character in a string")),
                _ => {
                    if let Some(buffer) = &mut owned {
                        buffer.push(byte);
                    }
                    self.at += 1;
                }
            }
        }
    }

    /// The escape after a backslash (consumed), its character appended to `buffer`.
    fn escape(&mut self, buffer: &mut Vec<u8>) -> Result<(), ParseError> {
        let escaped = self.peek().ok_or_else(|| self.expected("an escape"))?;
        self.at += 1;
        let plain = match escaped {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let c = self.unicode_escape()?;
                let mut utf8 = [0; 4];
                buffer.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                return Ok(());
            }
            _ => {
                self.at -= 1;
                return Err(self.expected("a valid escape"));
            }
        };
        buffer.push(plain);
        Ok(())
    }

    /// The `XXXX` of `\uXXXX` (the `\u` consumed), with a surrogate pair's second half.
    fn unicode_escape(&mut self) -> Result<char, ParseError> {
        let high = self.hex4()?;
        let code = match high {
            0xd800..=0xdbff => {
                self.literal(b"\\u", "the second half of a surrogate pair")?;
                let low = self.hex4()?;
                if !(0xdc00..=0xdfff).contains(&low) {
                    return Err(self.expected("the second half of a surrogate pair"));
                }
                0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00)
            }
            0xdc00..=0xdfff => return Err(self.expected("a surrogate pair's first half")),
            code => code,
        };
        char::from_u32(code).ok_or_else(|| self.expected("a Unicode scalar value"))
    }

    fn hex4(&mut self) -> Result<u32, ParseError> {
        let mut value = 0;
        for _ in 0..4 {
            let digit = self
                .peek()
                .and_then(|b| char::from(b).to_digit(16))
                .ok_or_else(|| self.expected("four hex digits"))?;
            value = value * 16 + digit;
            self.at += 1;
        }
        Ok(value)
    }

    /// A JSON number, checked for its grammar; returns its text.
    fn number(&mut self) -> Result<&'a [u8], ParseError> {
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.expected("a number")),
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.expected("a digit after '.'"));
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.expected("a digit in the exponent"));
            }
            self.digits();
        }
        Ok(&self.input[start..self.at])
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
    }

    /// A non-negative integer that fits `u64` (serde refuses `1.0`, `1e3` and `-1` there).
    fn unsigned(&mut self) -> Result<u64, ParseError> {
        let start = self.at;
        let text = self.number()?;
        let mut value: u64 = 0;
        for &digit in text {
            let digit = match digit {
                b'0'..=b'9' => u64::from(digit - b'0'),
                _ => {
                    return Err(ParseError {
                        offset: start,
                        expected: "an integer from 0 to 2^64-1",
                    })
                }
            };
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(digit))
                .ok_or(ParseError {
                    offset: start,
                    expected: "an integer from 0 to 2^64-1",
                })?;
        }
        Ok(value)
    }

    /// Reads a member's value into `slot` with `read`; `null`, or a value `read` refuses
    /// (which is then skipped), is recorded as such. A member given twice makes the answer
    /// unreadable (serde refuses it too).
    fn field<T>(
        &mut self,
        slot: &mut Field<T>,
        read: impl FnOnce(&mut Self) -> Result<T, ParseError>,
    ) -> Result<(), ParseError> {
        if !matches!(slot, Field::Absent) {
            return Err(self.expected("each member once"));
        }
        if self.input[self.at..].starts_with(b"null") {
            self.at += 4;
            *slot = Field::Null;
            return Ok(());
        }
        let start = self.at;
        *slot = match read(self) {
            Ok(value) => Field::Value(value),
            Err(_) => {
                self.at = start;
                self.skip_value(0)?;
                Field::Wrong
            }
        };
        Ok(())
    }

    fn boolean(&mut self) -> Result<bool, ParseError> {
        if self.input[self.at..].starts_with(b"true") {
            self.at += 4;
            Ok(true)
        } else if self.input[self.at..].starts_with(b"false") {
            self.at += 5;
            Ok(false)
        } else {
            Err(self.expected("true or false"))
        }
    }

    /// `{"code":…,"err_code":…,"description":…}`: `code` required, `err_code` optional
    /// (not `null`), `description` optional (async-nats's `jetstream::Error`).
    fn api_error(&mut self) -> Result<ApiError, ParseError> {
        let start = self.at;
        let (mut code, mut err_code, mut description) =
            (Field::Absent, Field::Absent, Field::Absent);
        self.object(|parser, key| match key.as_bytes() {
            b"code" => parser.field(&mut code, Parser::unsigned),
            b"err_code" => parser.field(&mut err_code, Parser::unsigned),
            b"description" => parser.field(&mut description, |parser| {
                parser.string().map(Cow::into_owned)
            }),
            _ => parser.skip_value(1),
        })?;
        let wrong = ParseError {
            offset: start,
            expected: "an error with an integer \"code\"",
        };
        Ok(ApiError {
            code: match code {
                Field::Value(code) => code,
                _ => return Err(wrong),
            },
            err_code: match err_code {
                Field::Absent => 0,
                Field::Value(err_code) => err_code,
                Field::Null | Field::Wrong => return Err(wrong),
            },
            description: match description {
                Field::Absent | Field::Null => None,
                Field::Value(description) => Some(description),
                Field::Wrong => return Err(wrong),
            },
        })
    }

    /// Any JSON value, checked for its grammar and dropped; `depth` counts the enclosing
    /// objects and arrays (AK1).
    fn skip_value(&mut self, depth: usize) -> Result<(), ParseError> {
        if depth >= MAX_DEPTH {
            return Err(self.expected("less nesting"));
        }
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(b'{') => self.object(|parser, _| parser.skip_value(depth + 1)),
            Some(b'[') => {
                self.at += 1;
                if self.eat(b']') {
                    return Ok(());
                }
                loop {
                    self.whitespace();
                    self.skip_value(depth + 1)?;
                    if self.eat(b',') {
                        continue;
                    }
                    if self.eat(b']') {
                        return Ok(());
                    }
                    return Err(self.expected("',' or ']'"));
                }
            }
            Some(b't') => self.literal(b"true", "a value"),
            Some(b'f') => self.literal(b"false", "a value"),
            Some(b'n') => self.literal(b"null", "a value"),
            _ => self.number().map(drop),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use async_nats::jetstream::publish::PublishAck;
    use async_nats::jetstream::response::Response;
    use proptest::prelude::*;

    /// Answers nats-server 2.9.10 sent, byte for byte (captured with a raw client; the
    /// space after the comma is the server's).
    const STORED: &str = r#"{"stream":"CAP", "seq":1}"#;
    const DUPLICATE: &str = r#"{"stream":"CAP", "seq":1,"duplicate": true}"#;
    const WRONG_LAST_SEQUENCE: &str = r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},"stream":"CAP","seq":0}"#;
    const WRONG_LAST_MSG_ID: &str = r#"{"error":{"code":400,"err_code":10070,"description":"wrong last msg ID: a"},"stream":"CAP","seq":0}"#;
    const TOO_LARGE: &str = r#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"},"stream":"SMALL","seq":0}"#;

    fn ack(stream: &str, sequence: u64, duplicate: bool) -> Reply<'_> {
        Reply::Ack(PubAck {
            stream: Cow::Borrowed(stream),
            sequence,
            duplicate,
        })
    }

    fn message(payload: &'static str, status: Option<StatusCode>) -> async_nats::Message {
        async_nats::Message {
            subject: "_INBOX.x.1".into(),
            reply: None,
            payload: bytes::Bytes::from_static(payload.as_bytes()),
            headers: None,
            status,
            description: None,
            length: payload.len(),
        }
    }

    #[test]
    fn reads_what_the_server_sends() {
        assert_eq!(parse(STORED.as_bytes()), Ok(ack("CAP", 1, false)));
        assert_eq!(parse(DUPLICATE.as_bytes()), Ok(ack("CAP", 1, true)));
        let error = |err_code, description: &str| {
            Ok(Reply::Error(ApiError {
                code: 400,
                err_code,
                description: Some(description.to_owned()),
            }))
        };
        assert_eq!(
            parse(WRONG_LAST_SEQUENCE.as_bytes()),
            error(10071, "wrong last sequence: 1")
        );
        assert_eq!(
            parse(WRONG_LAST_MSG_ID.as_bytes()),
            error(10070, "wrong last msg ID: a")
        );
        assert_eq!(
            parse(TOO_LARGE.as_bytes()),
            error(10054, "message size exceeds maximum allowed")
        );
    }

    /// AK3: the kinds async-nats gave, with its error (and its words) as the source.
    #[test]
    fn classifies_as_async_nats_does() {
        let kind = |payload, status| read(&message(payload, status)).unwrap_err().kind();
        assert_eq!(
            kind(WRONG_LAST_SEQUENCE, None),
            PublishErrorKind::WrongLastSequence
        );
        assert_eq!(
            kind(WRONG_LAST_MSG_ID, None),
            PublishErrorKind::WrongLastMessageId
        );
        assert_eq!(kind(TOO_LARGE, None), PublishErrorKind::Other);
        assert_eq!(
            kind("", Some(StatusCode::NO_RESPONDERS)),
            PublishErrorKind::StreamNotFound
        );
        assert_eq!(kind("", None), PublishErrorKind::Other);
        assert_eq!(kind("not json", None), PublishErrorKind::Other);

        use std::error::Error as _;
        let refused = read(&message(TOO_LARGE, None)).unwrap_err();
        let source = refused
            .source()
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .expect("the JetStream error is the source");
        assert_eq!(
            source.error_code(),
            ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
        );
        assert_eq!(source.code(), 400);
        assert!(refused
            .to_string()
            .contains("message size exceeds maximum allowed"));

        let duplicate = message(DUPLICATE, None);
        let stored = read(&duplicate).unwrap();
        assert_eq!(
            (stored.stream.as_ref(), stored.sequence, stored.duplicate),
            ("CAP", 1, true)
        );
    }

    #[test]
    fn refuses_what_is_not_an_ack() {
        for bad in [
            "",
            "{",
            "[]",
            "null",
            r#"{"stream":"S"}"#,
            r#"{"seq":1}"#,
            r#"{"stream":"S","seq":-1}"#,
            r#"{"stream":"S","seq":1.0}"#,
            r#"{"stream":"S","seq":18446744073709551616}"#,
            r#"{"stream":"S","seq":01}"#,
            r#"{"stream":"S","seq":1,"duplicate":null}"#,
            r#"{"stream":"S","seq":1,"duplicate":1}"#,
            r#"{"stream":"S","seq":1} x"#,
            r#"{"stream":"S","seq":1,"seq":2}"#,
            r#"{"stream":"S\q","seq":1}"#,
            "{\"stream\":\"a\nb\",\"seq\":1}",
            r#"{"stream":"\ud800","seq":1}"#,
            r#"{"error":{"err_code":10071}}"#,
            r#"{"error":null}"#,
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad:?} was read");
        }
    }

    #[test]
    fn escapes_and_unknown_members() {
        let text = r#" { "x" : [1, {"y": [true, false, null, -1.5e3]}], "stream" : "S\"\u00e9\ud83d\ude00" ,
            "seq" : 18446744073709551615, "domain": "hub", "val": null, "duplicate" : false } "#;
        assert_eq!(
            parse(text.as_bytes()),
            Ok(Reply::Ack(PubAck {
                stream: Cow::Owned("S\"é😀".to_owned()),
                sequence: u64::MAX,
                duplicate: false,
            }))
        );
        // An "error" wins over everything, a null or ill-typed one counts as absent.
        let error = r#"{"seq":"x","error":{"code":503,"extra":{}},"stream":5}"#;
        assert!(matches!(
            parse(error.as_bytes()),
            Ok(Reply::Error(ApiError {
                code: 503,
                err_code: 0,
                description: None
            }))
        ));
        let null = r#"{"error":null,"stream":"S","seq":2}"#;
        assert_eq!(parse(null.as_bytes()), Ok(ack("S", 2, false)));
        let ill_typed = r#"{"error":{"code":"400"},"stream":"S","seq":2}"#;
        assert_eq!(parse(ill_typed.as_bytes()), Ok(ack("S", 2, false)));
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = format!(r#"{{"x":{}{}}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse(deep.as_bytes()).is_err());
        let fine = format!(
            r#"{{"x":{}{},"stream":"S","seq":1}}"#,
            "[".repeat(50),
            "]".repeat(50)
        );
        assert_eq!(parse(fine.as_bytes()), Ok(ack("S", 1, false)));
    }

    /// A JSON text for `value`, escaped one of three ways.
    fn json_string(value: &str, style: u8) -> String {
        match style {
            0 => serde_json::to_string(value).unwrap(),
            1 => {
                let mut out = String::from("\"");
                for unit in value.encode_utf16() {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
                out.push('"');
                out
            }
            _ => serde_json::to_string(value).unwrap().replace('/', "\\/"),
        }
    }

    fn string_value() -> impl Strategy<Value = String> {
        ("[a-zA-Z0-9 _/\"\\\\\n\té😀\u{7f}-]{0,12}", 0u8..3)
            .prop_map(|(s, style)| json_string(&s, style))
    }

    /// A value of any type, nested a little.
    fn any_value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:e}")),
            string_value(),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                proptest::collection::vec(("[a-z]{1,3}", inner), 0..4).prop_map(|members| {
                    let mut seen = std::collections::HashSet::new();
                    let members: Vec<String> = members
                        .into_iter()
                        .filter(|(k, _)| seen.insert(k.clone()))
                        .map(|(k, v)| format!("\"{k}\":{v}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
    }

    /// Mostly well-typed, sometimes not.
    fn member(typed: BoxedStrategy<String>) -> BoxedStrategy<String> {
        prop_oneof![6 => typed, 1 => any_value()].boxed()
    }

    /// The JSON object members `"name":value` of the values present.
    fn present<const N: usize>(members: [(&str, Option<String>); N]) -> Vec<String> {
        members
            .into_iter()
            .filter_map(|(name, value)| Some(format!("\"{name}\":{}", value?)))
            .collect()
    }

    fn error_value() -> BoxedStrategy<String> {
        (
            proptest::option::of(member(any::<u16>().prop_map(|n| n.to_string()).boxed())),
            proptest::option::of(member(
                prop_oneof![Just(10071u64), Just(10070), Just(10054), any::<u64>()]
                    .prop_map(|n| n.to_string())
                    .boxed(),
            )),
            proptest::option::of(member(string_value().boxed())),
            proptest::option::of(any_value()),
        )
            .prop_map(|(code, err_code, description, extra)| {
                let members = present([
                    ("code", code),
                    ("err_code", err_code),
                    ("description", description),
                    ("zz", extra),
                ]);
                format!("{{{}}}", members.join(","))
            })
            .boxed()
    }

    /// A publish answer: the ack's and error's members (each maybe, maybe ill-typed), an
    /// unknown one, in any order, with any whitespace.
    fn answer() -> impl Strategy<Value = String> {
        (
            proptest::option::of(member(string_value().boxed())),
            proptest::option::of(member(any::<u64>().prop_map(|n| n.to_string()).boxed())),
            proptest::option::of(member(any::<bool>().prop_map(|b| b.to_string()).boxed())),
            // Not an array: serde reads one positionally as the error (AK2's one liberty).
            proptest::option::of(prop_oneof![
                4 => error_value(),
                1 => any_value().prop_filter("no array", |v| !v.starts_with('[')).boxed(),
            ]),
            proptest::option::of(member(string_value().boxed())),
            proptest::option::of(member(string_value().boxed())),
            proptest::option::of(any_value()),
            any::<u64>(),
            proptest::collection::vec(prop_oneof![Just(""), Just(" "), Just("\n"), Just("\t ")], 8),
        )
            .prop_map(
                |(stream, seq, duplicate, error, domain, val, unknown, order, spaces)| {
                    let mut members = present([
                        ("stream", stream),
                        ("seq", seq),
                        ("duplicate", duplicate),
                        ("error", error),
                        ("domain", domain),
                        ("val", val),
                        ("time", unknown),
                    ]);
                    let len = members.len().max(1) as u64;
                    members.rotate_left((order % len) as usize);
                    if order & 1 << 40 != 0 {
                        members.reverse();
                    }
                    let [a, b, c, d, ..] = [spaces[0], spaces[1], spaces[2], spaces[3]];
                    format!(
                        "{a}{{{b}{}{c}}}{d}",
                        members.join(&format!("{},{}", spaces[4], spaces[5]))
                    )
                },
            )
    }

    proptest! {
        /// AK2: the hand-written reader and async-nats's serde reading agree on every answer.
        #[test]
        fn agrees_with_serde(text in answer()) {
            let theirs = serde_json::from_str::<Response<PublishAck>>(&text);
            let ours = parse(text.as_bytes());
            match (theirs, ours) {
                (Ok(Response::Ok(theirs)), Ok(Reply::Ack(ours))) => {
                    prop_assert_eq!(
                        (theirs.stream.as_str(), theirs.sequence, theirs.duplicate),
                        (ours.stream.as_ref(), ours.sequence, ours.duplicate),
                        "{}", text
                    );
                }
                (Ok(Response::Err { error }), Ok(Reply::Error(ours))) => {
                    let ours = ours.into_publish_error();
                    use std::error::Error as _;
                    let ours = ours.source().and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>()).unwrap();
                    prop_assert_eq!(
                        (error.code(), error.error_code(), error.to_string()),
                        (ours.code(), ours.error_code(), ours.to_string()),
                        "{}", text
                    );
                }
                (Err(_), Err(_)) => {}
                (theirs, ours) => prop_assert!(false, "{}: serde {:?}, ours {:?}", text, theirs, ours),
            }
        }

        /// AK1: whatever the bytes, an answer or an error, never a panic.
        #[test]
        fn total_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
        }

        /// AK1 on near-misses: every prefix and every one-byte change of a real answer.
        #[test]
        fn total_on_mangled_answers(which in 0usize..5, at in any::<usize>(), byte in any::<u8>()) {
            let text = [STORED, DUPLICATE, WRONG_LAST_SEQUENCE, WRONG_LAST_MSG_ID, TOO_LARGE][which];
            let at = at % text.len();
            let _ = parse(&text.as_bytes()[..at]);
            let mut changed = text.as_bytes().to_vec();
            changed[at] = byte;
            let _ = parse(&changed);
        }
    }
}
