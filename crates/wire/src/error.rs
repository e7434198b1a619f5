//! Error causes (RFC 5354 §3.3.10) and the decoder's typed errors.
//!
//! A [`DecodeError`] always says what went wrong and, where the protocol defines one, carries the
//! [`ErrorCause`] to send back to the peer, so a driver can answer with an ERROR message without
//! knowing the decoder's internals.

use bytes::Bytes;

/// An RSerPool error cause code (RFC 5354 §3.3.10). Unknown codes are kept as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CauseCode(pub u16);

impl CauseCode {
    pub const UNSPECIFIED: Self = Self(0x0);
    pub const UNRECOGNIZED_PARAMETER: Self = Self(0x1);
    pub const UNRECOGNIZED_MESSAGE: Self = Self(0x2);
    pub const INVALID_VALUES: Self = Self(0x3);
    pub const NON_UNIQUE_PE_IDENTIFIER: Self = Self(0x4);
    pub const INCONSISTENT_POOLING_POLICY: Self = Self(0x5);
    pub const LACK_OF_RESOURCES: Self = Self(0x6);
    pub const INCONSISTENT_TRANSPORT_TYPE: Self = Self(0x7);
    pub const INCONSISTENT_DATA_CONTROL: Self = Self(0x8);
    pub const UNKNOWN_POOL_HANDLE: Self = Self(0x9);
    pub const REJECTED_SECURITY: Self = Self(0xa);

    /// The RFC's name of this cause, or `None` for a code the RFC does not define.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0x0 => "Unspecified Error",
            0x1 => "Unrecognized Parameter",
            0x2 => "Unrecognized Message",
            0x3 => "Invalid Values",
            0x4 => "Non-unique PE Identifier",
            0x5 => "Inconsistent Pooling Policy",
            0x6 => "Lack of Resources",
            0x7 => "Inconsistent Transport Type",
            0x8 => "Inconsistent Data/Control Configuration",
            0x9 => "Unknown Pool Handle",
            0xa => "Rejected due to security considerations",
            _ => return None,
        })
    }
}

impl std::fmt::Display for CauseCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n} (0x{:x})", self.0),
            None => write!(f, "cause 0x{:x}", self.0),
        }
    }
}

/// One error cause: code plus cause-specific information (e.g. the offending TLV).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ErrorCause {
    pub code: CauseCode,
    pub info: Bytes,
}

impl ErrorCause {
    pub fn new(code: CauseCode) -> Self {
        Self {
            code,
            info: Bytes::new(),
        }
    }

    pub fn with_info(code: CauseCode, info: impl Into<Bytes>) -> Self {
        Self {
            code,
            info: info.into(),
        }
    }
}

/// What went wrong while decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeErrorKind {
    #[error("message is truncated: need {needed} bytes, have {available}")]
    Truncated { needed: usize, available: usize },
    #[error("message length {0} is shorter than its header")]
    BadMessageLength(u16),
    #[error("parameter 0x{ptype:04x} has a bad length {length}")]
    BadParameterLength { ptype: u16, length: u16 },
    #[error("parameter 0x{ptype:04x} exceeds its container")]
    ParameterOverrun { ptype: u16 },
    #[error("garbage after the last parameter")]
    TrailingGarbage,
    #[error("unknown message type 0x{0:02x}")]
    UnknownMessage(u8),
    #[error("unrecognized parameter 0x{0:04x}")]
    UnrecognizedParameter(u16),
    #[error("mandatory {0} parameter missing")]
    MissingParameter(&'static str),
    #[error("invalid value in {0}")]
    InvalidValue(&'static str),
    #[error("message too large: {length} bytes, limit {limit}")]
    TooLarge { length: usize, limit: usize },
}

/// A decoding failure: what went wrong and the error cause to report to the sender, if any.
///
/// `cause` is `None` where the protocol says "discard silently" (an unknown message or parameter
/// type whose top two bits are `00`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct DecodeError {
    pub kind: DecodeErrorKind,
    pub cause: Option<ErrorCause>,
}

impl DecodeError {
    pub(crate) fn invalid(kind: DecodeErrorKind, offending: &[u8]) -> Self {
        Self {
            kind,
            cause: Some(ErrorCause::with_info(
                CauseCode::INVALID_VALUES,
                Bytes::copy_from_slice(offending),
            )),
        }
    }

    pub(crate) fn silent(kind: DecodeErrorKind) -> Self {
        Self { kind, cause: None }
    }

    /// True when the byte stream can no longer be trusted to be framed correctly.
    pub fn loses_framing(&self) -> bool {
        matches!(
            self.kind,
            DecodeErrorKind::BadMessageLength(_) | DecodeErrorKind::TooLarge { .. }
        )
    }
}

/// An encoding failure: the message does not fit the 16-bit length field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("message too large to encode: {length} bytes (at most 65535)")]
    TooLarge { length: usize },
}
