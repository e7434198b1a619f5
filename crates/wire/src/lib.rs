//! Sans-IO codec for the RSerPool protocols: ASAP (RFC 5352) and ENRP (RFC 5353) messages with
//! the parameters of RFC 5354 and the pool policies of RFC 5356.
//!
//! Why it exists: everything else in rserpool talks through these bytes, so they must match the
//! RFCs exactly (Wireshark's dissectors are our independent check) and decoding must be *total*:
//! any byte string gives a message or a [`DecodeError`] that carries the RFC error cause to send
//! back. No I/O happens here; [`Framer`] cuts a TCP byte stream into messages.
//!
//! Encoders use the RFC's length convention (a length excludes the padding of the last nested
//! parameter); decoders also accept rsplib's (lengths include it). Unknown message and parameter
//! types are handled by their top two bits (RFC 5354 §2.2).

pub mod address;
pub mod asap;
pub mod checksum;
pub mod csp;
pub mod enrp;
pub mod error;
pub mod framer;
#[doc(hidden)]
pub mod fuzzing;
pub mod mapping;
pub mod message;
pub mod param;
pub mod policy;
pub mod ptype;
pub mod sctp_life;
pub mod time;
mod tlv;

pub use address::{Address, AddressList, Scheme};
pub use asap::AsapMessage;
pub use checksum::PeChecksum;
pub use enrp::{EnrpBody, EnrpMessage, PoolEntry, UpdateAction};
pub use error::{CauseCode, DecodeError, DecodeErrorKind, EncodeError, ErrorCause};
pub use framer::{Frame, Framer};
pub use message::Message;
pub use param::{
    Addresses, OperationError, PoolElement, PoolHandle, Protocol, ServerInformation,
    TransportAddress, UserTransport,
};
pub use policy::Policy;
pub use time::Instant;

pub use smallvec;

use bytes::Bytes;

/// The IANA port of ASAP over TCP and UDP.
pub const ASAP_PORT: u16 = 3863;
/// The IANA port of ENRP (UDP; used here for ENRP over TCP too).
pub const ENRP_PORT: u16 = 9901;
/// SCTP payload protocol identifiers.
pub const ASAP_PPID: u32 = 11;
pub const ENRP_PPID: u32 = 12;

/// Splits a message into type, flags and body (the bytes the header's length covers).
pub(crate) fn split_message(buf: &[u8]) -> Result<(u8, u8, &[u8]), DecodeError> {
    let [ty, flags, l0, l1, ..] = *buf else {
        return Err(DecodeError::silent(DecodeErrorKind::Truncated {
            needed: 4,
            available: buf.len(),
        }));
    };
    let length = u16::from_be_bytes([l0, l1]);
    let len = usize::from(length);
    if len < 4 {
        return Err(DecodeError::silent(DecodeErrorKind::BadMessageLength(
            length,
        )));
    }
    if len > buf.len() {
        return Err(DecodeError::silent(DecodeErrorKind::Truncated {
            needed: len,
            available: buf.len(),
        }));
    }
    // After the message only its padding may follow (at most 3 zero bytes).
    let tail = &buf[len..];
    if tail.len() > 3 || tail.iter().any(|&b| b != 0) {
        return Err(DecodeError::invalid(DecodeErrorKind::TrailingGarbage, tail));
    }
    Ok((ty, flags, &buf[4..len]))
}

/// The error for an unknown message type, by its top two bits (00 discard, 01 report).
pub(crate) fn unknown_message(ty: u8, buf: &[u8]) -> DecodeError {
    let kind = DecodeErrorKind::UnknownMessage(ty);
    if ty >> 6 == 0b01 {
        let len = buf
            .len()
            .min(usize::from(u16::from_be_bytes([buf[2], buf[3]])));
        DecodeError {
            kind,
            cause: Some(ErrorCause::with_info(
                CauseCode::UNRECOGNIZED_MESSAGE,
                Bytes::copy_from_slice(&buf[..len]),
            )),
        }
    } else {
        DecodeError::silent(kind)
    }
}

/// Reads the header of a message at the start of `buf`: (type, flags, length).
pub fn peek_header(buf: &[u8]) -> Option<(u8, u8, u16)> {
    match *buf {
        [t, f, l0, l1, ..] => Some((t, f, u16::from_be_bytes([l0, l1]))),
        _ => None,
    }
}
