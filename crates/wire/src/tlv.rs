//! TLV walking and writing shared by ASAP and ENRP (RFC 5354 §2).
//!
//! Receivers accept both length conventions: the RFC's (a length excludes the padding of the last
//! nested parameter) and rsplib's (it includes it). Senders use the RFC's.

use crate::error::{CauseCode, DecodeError, DecodeErrorKind, ErrorCause};
use bytes::Bytes;

/// One parameter as found on the wire.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawTlv<'a> {
    pub ptype: u16,
    /// The value, without the 4-byte header and without padding.
    pub value: &'a [u8],
    /// Header and value, without padding: what an error cause quotes.
    pub whole: &'a [u8],
}

/// Walks the TLVs in `buf`, which must hold nothing but TLVs (and padding).
pub(crate) struct TlvIter<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> TlvIter<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
}

impl<'a> Iterator for TlvIter<'a> {
    type Item = Result<RawTlv<'a>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.buf.get(self.pos..)?;
        if rest.len() < 4 {
            self.pos = self.buf.len();
            // Up to three bytes of zero padding may follow the last parameter.
            if rest.iter().all(|&b| b == 0) {
                return None;
            }
            return Some(Err(DecodeError::invalid(
                DecodeErrorKind::TrailingGarbage,
                rest,
            )));
        }
        let ptype = u16::from_be_bytes([rest[0], rest[1]]);
        let length = u16::from_be_bytes([rest[2], rest[3]]);
        let len = usize::from(length);
        if len < 4 {
            self.pos = self.buf.len();
            return Some(Err(DecodeError::invalid(
                DecodeErrorKind::BadParameterLength { ptype, length },
                &rest[..4],
            )));
        }
        if len > rest.len() {
            self.pos = self.buf.len();
            return Some(Err(DecodeError::invalid(
                DecodeErrorKind::ParameterOverrun { ptype },
                &rest[..4],
            )));
        }
        self.pos += len.next_multiple_of(4).min(rest.len());
        Some(Ok(RawTlv {
            ptype,
            value: &rest[4..len],
            whole: &rest[..len],
        }))
    }
}

/// What the top two bits of an unknown parameter type ask for (RFC 5354 §2.2.1).
pub(crate) fn unknown_parameter(
    tlv: &RawTlv<'_>,
    report: &mut Vec<ErrorCause>,
) -> Result<(), DecodeError> {
    let cause = ErrorCause::with_info(
        CauseCode::UNRECOGNIZED_PARAMETER,
        Bytes::copy_from_slice(tlv.whole),
    );
    let kind = DecodeErrorKind::UnrecognizedParameter(tlv.ptype);
    match tlv.ptype >> 14 {
        0b00 => Err(DecodeError::silent(kind)),
        0b01 => Err(DecodeError {
            kind,
            cause: Some(cause),
        }),
        0b10 => Ok(()),
        _ => {
            report.push(cause);
            Ok(())
        }
    }
}

/// Reads big-endian integers from a fixed-size prefix, with a typed error when short.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
    whole: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str, whole: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            what,
            whole,
        }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let end = self.pos + N;
        match self.buf.get(self.pos..end) {
            Some(s) => {
                self.pos = end;
                let mut a = [0u8; N];
                a.copy_from_slice(s);
                Ok(a)
            }
            None => Err(self.invalid()),
        }
    }

    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        self.take::<2>().map(u16::from_be_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.take::<4>().map(u32::from_be_bytes)
    }

    pub fn i32(&mut self) -> Result<i32, DecodeError> {
        self.take::<4>().map(i32::from_be_bytes)
    }

    pub fn bytes<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        self.take::<N>()
    }

    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos.min(self.buf.len())..]
    }

    pub fn invalid(&self) -> DecodeError {
        DecodeError::invalid(DecodeErrorKind::InvalidValue(self.what), self.whole)
    }
}

/// Appends messages and TLVs to a buffer, RFC-style lengths: a TLV's length excludes its own
/// padding, and an enclosing length excludes the padding of its last nested TLV.
pub struct Encoder<'a> {
    buf: &'a mut Vec<u8>,
    /// Where this encoding started: alignment is relative to it, not to the buffer.
    base: usize,
    /// Pad bytes at the end of `buf` that belong to the last TLV written.
    trailing_pad: usize,
    /// Set when some length did not fit 16 bits.
    too_large: Option<usize>,
}

impl<'a> Encoder<'a> {
    pub fn new(buf: &'a mut Vec<u8>) -> Self {
        let base = buf.len();
        Self {
            buf,
            base,
            trailing_pad: 0,
            too_large: None,
        }
    }

    /// Ends the encoding: on a length overflow the buffer is restored and the error returned.
    pub fn finish(self) -> Result<(), crate::error::EncodeError> {
        match self.too_large {
            None => Ok(()),
            Some(length) => {
                self.buf.truncate(self.base);
                Err(crate::error::EncodeError::TooLarge { length })
            }
        }
    }

    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self.trailing_pad = 0;
    }

    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self.trailing_pad = 0;
    }

    pub fn raw(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
        self.trailing_pad = 0;
    }

    /// Starts a TLV (or a message: same 2+2 layout with type/flags in the first two bytes).
    pub fn begin(&mut self, first: u16) -> usize {
        let start = self.buf.len();
        self.u16(first);
        self.u16(0);
        start
    }

    /// Ends the TLV started at `start`: fills in its length and pads to 4 bytes.
    pub fn end(&mut self, start: usize) {
        let unpadded_end = self.buf.len() - self.trailing_pad;
        let len = unpadded_end - start;
        let len16 = u16::try_from(len).unwrap_or_else(|_| {
            self.too_large = Some(self.too_large.unwrap_or(0).max(len));
            u16::MAX
        });
        self.buf[start + 2..start + 4].copy_from_slice(&len16.to_be_bytes());
        let padded = self.base + (unpadded_end - self.base).next_multiple_of(4);
        self.buf.resize(padded.max(self.buf.len()), 0);
        self.trailing_pad = padded - unpadded_end;
    }

    /// A simple TLV whose value is `value`.
    pub fn tlv(&mut self, ptype: u16, value: &[u8]) {
        let s = self.begin(ptype);
        self.raw(value);
        self.end(s);
    }
}
