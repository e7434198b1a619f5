//! One shape for every RSerPool message type: each protocol writes how its messages are
//! encoded and decoded ([`Message::encode`], [`Message::decode_with_report`]), and the
//! conveniences every caller uses ([`Message::to_bytes`], [`Message::decode`]) are written once
//! here, for ASAP and ENRP alike (and for whatever message type comes next, such as the ASAP
//! session layer's).

use crate::error::{DecodeError, EncodeError, ErrorCause};

pub trait Message: Sized {
    /// Appends the encoded message (padded to a multiple of 4) to `out`. A message whose
    /// length would not fit 16 bits is refused and `out` is left as it was.
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError>;

    /// Decodes one message from `buf` (exactly one message, padding allowed), and collects the
    /// error causes the sender should be told about even though the message was accepted
    /// (unknown parameters of type `11xx…`, RFC 5354 §2.2).
    fn decode_with_report(buf: &[u8], report: &mut Vec<ErrorCause>) -> Result<Self, DecodeError>;

    /// The encoded message in a vector of its own.
    fn to_bytes(&self) -> Result<Vec<u8>, EncodeError> {
        let mut v = Vec::new();
        self.encode(&mut v)?;
        Ok(v)
    }

    /// Like [`decode_with_report`](Self::decode_with_report), dropping the report.
    fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_with_report(buf, &mut Vec::new())
    }
}
