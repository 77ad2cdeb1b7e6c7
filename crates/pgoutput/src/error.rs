//! Decoding errors. Every error says what was being decoded; none carries row data.

/// The bytes are not a valid message. Never "need more bytes": every decoder in this crate
/// receives one complete message, framed by the transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message ends before a field it announces.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// The field or message being decoded.
        what: &'static str,
        /// Bytes the field needs.
        need: usize,
        /// Bytes left in the message.
        have: usize,
    },
    /// A tag this decoder does not know.
    #[error("unknown {context} tag {tag:#04x} ({})", char::from(*tag).escape_default())]
    UnknownTag {
        /// Which kind of tag.
        context: &'static str,
        /// The tag byte.
        tag: u8,
    },
    /// A field holds a value the protocol does not allow.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
}
