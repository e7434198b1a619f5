//! SCTP chunks (RFC 9260 §3.2–3.3) and INIT's parameters (§3.3.2).
//!
//! A chunk is type (u8), flags (u8), length (u16, without padding), value, padded with zeros
//! to a multiple of 4. Chunks this crate does not know are kept whole ([`Chunk::Unknown`]);
//! [`Unrecognized`] says what RFC 9260 wants done with them.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::net::{Ipv4Addr, Ipv6Addr};

pub mod kind {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const SACK: u8 = 3;
    pub const HEARTBEAT: u8 = 4;
    pub const HEARTBEAT_ACK: u8 = 5;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const ERROR: u8 = 9;
    pub const COOKIE_ECHO: u8 = 10;
    pub const COOKIE_ACK: u8 = 11;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
}

/// Parameter types of INIT and INIT ACK.
pub mod param {
    pub const HEARTBEAT_INFO: u16 = 1;
    pub const IPV4: u16 = 5;
    pub const IPV6: u16 = 6;
    pub const STATE_COOKIE: u16 = 7;
    pub const COOKIE_PRESERVATIVE: u16 = 9;
    pub const HOST_NAME: u16 = 11;
    pub const SUPPORTED_ADDRESS_TYPES: u16 = 12;
    pub const ECN: u16 = 0x8000;
    pub const SUPPORTED_EXTENSIONS: u16 = 0x8008;
    pub const FORWARD_TSN: u16 = 0xc000;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("{0} bytes left, less than a chunk header")]
    Short(usize),
    #[error("length {length} of a chunk with {left} bytes left")]
    Length { length: usize, left: usize },
    #[error("chunk type {ty}: value of {len} bytes, needs at least {need}")]
    Value { ty: u8, len: usize, need: usize },
    #[error("chunk type {ty}: a parameter of length {length} with {left} bytes left")]
    Param { ty: u8, length: usize, left: usize },
}

/// What to do with a chunk (or INIT parameter) of an unknown type: its type's upper two bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrecognized {
    /// 00: stop processing the packet, discard it.
    Stop,
    /// 01: stop, discard, and report it (ERROR "Unrecognized Chunk Type" / parameter).
    StopAndReport,
    /// 10: skip it, go on.
    Skip,
    /// 11: skip it, go on, and report it.
    SkipAndReport,
}

impl Unrecognized {
    pub fn of_chunk(ty: u8) -> Self {
        Self::from_bits(ty >> 6)
    }

    pub fn of_param(ty: u16) -> Self {
        Self::from_bits((ty >> 14) as u8)
    }

    fn from_bits(b: u8) -> Self {
        match b & 3 {
            0 => Self::Stop,
            1 => Self::StopAndReport,
            2 => Self::Skip,
            _ => Self::SkipAndReport,
        }
    }
}

/// A DATA chunk: one message or a fragment of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Data {
    pub tsn: u32,
    pub stream: u16,
    /// Stream sequence number (ignored when unordered).
    pub ssn: u16,
    /// Payload protocol identifier: 11 ASAP, 12 ENRP.
    pub ppid: u32,
    pub unordered: bool,
    /// First and last fragment of the message.
    pub begin: bool,
    pub end: bool,
    /// The sender asks for a SACK at once (RFC 7053).
    pub immediate: bool,
    pub payload: Bytes,
}

/// INIT and INIT ACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Init {
    pub initiate_tag: u32,
    pub a_rwnd: u32,
    pub outbound_streams: u16,
    pub inbound_streams: u16,
    pub initial_tsn: u32,
    pub params: Vec<InitParam>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitParam {
    Ipv4(Ipv4Addr),
    Ipv6(Ipv6Addr),
    /// INIT ACK only.
    StateCookie(Bytes),
    /// Suggested cookie life-span increment, ms.
    CookiePreservative(u32),
    HostName(Bytes),
    SupportedAddressTypes(Vec<u16>),
    Ecn,
    ForwardTsn,
    SupportedExtensions(Vec<u8>),
    Unknown {
        ty: u16,
        value: Bytes,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sack {
    pub cum_tsn: u32,
    pub a_rwnd: u32,
    /// Gap ack blocks: start and end offsets from `cum_tsn`.
    pub gaps: Vec<(u16, u16)>,
    pub dups: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data(Data),
    Init(Init),
    InitAck(Init),
    Sack(Sack),
    /// The heartbeat information parameter's value, returned as is.
    Heartbeat(Bytes),
    HeartbeatAck(Bytes),
    /// `reflected`: the T bit (the sender had no TCB, the tag is the receiver's own).
    Abort {
        reflected: bool,
        causes: Bytes,
    },
    Shutdown {
        cum_tsn: u32,
    },
    ShutdownAck,
    Error {
        causes: Bytes,
    },
    CookieEcho(Bytes),
    CookieAck,
    ShutdownComplete {
        reflected: bool,
    },
    Unknown {
        ty: u8,
        flags: u8,
        value: Bytes,
    },
}

fn padded(n: usize) -> usize {
    (n + 3) & !3
}

impl Chunk {
    /// The chunk starting at `at` in `buf`, and the bytes it takes with its padding.
    pub fn decode(buf: &Bytes, at: usize) -> Result<(Self, usize), ChunkError> {
        let left = buf.len().saturating_sub(at);
        if left < 4 {
            return Err(ChunkError::Short(left));
        }
        let b = &buf[at..];
        let (ty, flags) = (b[0], b[1]);
        let length = usize::from(u16::from_be_bytes([b[2], b[3]]));
        if length < 4 || length > left {
            return Err(ChunkError::Length { length, left });
        }
        // The last chunk's padding may be missing from a sloppy sender; never read past.
        let used = padded(length).min(left);
        let value = buf.slice(at + 4..at + length);
        let need = |n: usize| {
            if value.len() < n {
                Err(ChunkError::Value {
                    ty,
                    len: value.len(),
                    need: n,
                })
            } else {
                Ok(())
            }
        };
        let mut v = value.clone();
        let chunk = match ty {
            kind::DATA => {
                need(12)?;
                Chunk::Data(Data {
                    tsn: v.get_u32(),
                    stream: v.get_u16(),
                    ssn: v.get_u16(),
                    ppid: v.get_u32(),
                    unordered: flags & 4 != 0,
                    begin: flags & 2 != 0,
                    end: flags & 1 != 0,
                    immediate: flags & 8 != 0,
                    payload: v,
                })
            }
            kind::INIT | kind::INIT_ACK => {
                need(16)?;
                let init = Init {
                    initiate_tag: v.get_u32(),
                    a_rwnd: v.get_u32(),
                    outbound_streams: v.get_u16(),
                    inbound_streams: v.get_u16(),
                    initial_tsn: v.get_u32(),
                    params: decode_params(ty, v)?,
                };
                if ty == kind::INIT {
                    Chunk::Init(init)
                } else {
                    Chunk::InitAck(init)
                }
            }
            kind::SACK => {
                need(12)?;
                let cum_tsn = v.get_u32();
                let a_rwnd = v.get_u32();
                let (ngaps, ndups) = (usize::from(v.get_u16()), usize::from(v.get_u16()));
                need(12 + 4 * ngaps + 4 * ndups)?;
                let gaps = (0..ngaps).map(|_| (v.get_u16(), v.get_u16())).collect();
                let dups = (0..ndups).map(|_| v.get_u32()).collect();
                Chunk::Sack(Sack {
                    cum_tsn,
                    a_rwnd,
                    gaps,
                    dups,
                })
            }
            kind::HEARTBEAT | kind::HEARTBEAT_ACK => {
                // One parameter, heartbeat info; its value goes back untouched.
                need(4)?;
                let (_, info, _) = param_at(ty, &v)?;
                if ty == kind::HEARTBEAT {
                    Chunk::Heartbeat(info)
                } else {
                    Chunk::HeartbeatAck(info)
                }
            }
            kind::ABORT => Chunk::Abort {
                reflected: flags & 1 != 0,
                causes: value,
            },
            kind::SHUTDOWN => {
                need(4)?;
                Chunk::Shutdown {
                    cum_tsn: v.get_u32(),
                }
            }
            kind::SHUTDOWN_ACK => Chunk::ShutdownAck,
            kind::ERROR => Chunk::Error { causes: value },
            kind::COOKIE_ECHO => Chunk::CookieEcho(value),
            kind::COOKIE_ACK => Chunk::CookieAck,
            kind::SHUTDOWN_COMPLETE => Chunk::ShutdownComplete {
                reflected: flags & 1 != 0,
            },
            _ => Chunk::Unknown { ty, flags, value },
        };
        Ok((chunk, used))
    }

    /// The chunk's type, as on the wire.
    pub fn ty(&self) -> u8 {
        match self {
            Chunk::Data(_) => kind::DATA,
            Chunk::Init(_) => kind::INIT,
            Chunk::InitAck(_) => kind::INIT_ACK,
            Chunk::Sack(_) => kind::SACK,
            Chunk::Heartbeat(_) => kind::HEARTBEAT,
            Chunk::HeartbeatAck(_) => kind::HEARTBEAT_ACK,
            Chunk::Abort { .. } => kind::ABORT,
            Chunk::Shutdown { .. } => kind::SHUTDOWN,
            Chunk::ShutdownAck => kind::SHUTDOWN_ACK,
            Chunk::Error { .. } => kind::ERROR,
            Chunk::CookieEcho(_) => kind::COOKIE_ECHO,
            Chunk::CookieAck => kind::COOKIE_ACK,
            Chunk::ShutdownComplete { .. } => kind::SHUTDOWN_COMPLETE,
            Chunk::Unknown { ty, .. } => *ty,
        }
    }

    /// Bytes on the wire, padding included.
    pub fn padded_len(&self) -> usize {
        padded(4 + self.value_len())
    }

    fn value_len(&self) -> usize {
        match self {
            Chunk::Data(d) => 12 + d.payload.len(),
            // The length counts every parameter's padding but the last's (RFC 9260 §3.2).
            Chunk::Init(i) | Chunk::InitAck(i) => {
                let all: usize = i.params.iter().map(InitParam::padded_len).sum();
                let last_pad = i
                    .params
                    .last()
                    .map_or(0, |p| p.padded_len() - 4 - p.value_len());
                16 + all - last_pad
            }
            Chunk::Sack(s) => 12 + 4 * s.gaps.len() + 4 * s.dups.len(),
            Chunk::Heartbeat(b) | Chunk::HeartbeatAck(b) => 4 + b.len(),
            Chunk::Abort { causes, .. } | Chunk::Error { causes } => causes.len(),
            Chunk::Shutdown { .. } => 4,
            Chunk::ShutdownAck | Chunk::CookieAck | Chunk::ShutdownComplete { .. } => 0,
            Chunk::CookieEcho(b) => b.len(),
            Chunk::Unknown { value, .. } => value.len(),
        }
    }

    fn flags(&self) -> u8 {
        match self {
            Chunk::Data(d) => {
                u8::from(d.end)
                    | u8::from(d.begin) << 1
                    | u8::from(d.unordered) << 2
                    | u8::from(d.immediate) << 3
            }
            Chunk::Abort { reflected, .. } | Chunk::ShutdownComplete { reflected } => {
                u8::from(*reflected)
            }
            Chunk::Unknown { flags, .. } => *flags,
            _ => 0,
        }
    }

    /// Appends the chunk, padded.
    pub fn encode(&self, out: &mut BytesMut) {
        let len = 4 + self.value_len();
        out.put_u8(self.ty());
        out.put_u8(self.flags());
        // A chunk longer than 65,535 bytes cannot be sent; the association fragments first.
        out.put_u16(len.min(usize::from(u16::MAX)) as u16);
        match self {
            Chunk::Data(d) => {
                out.put_u32(d.tsn);
                out.put_u16(d.stream);
                out.put_u16(d.ssn);
                out.put_u32(d.ppid);
                out.put_slice(&d.payload);
            }
            Chunk::Init(i) | Chunk::InitAck(i) => {
                out.put_u32(i.initiate_tag);
                out.put_u32(i.a_rwnd);
                out.put_u16(i.outbound_streams);
                out.put_u16(i.inbound_streams);
                out.put_u32(i.initial_tsn);
                for (n, p) in i.params.iter().enumerate() {
                    // The last one's padding is the chunk's.
                    p.encode(out, n + 1 < i.params.len());
                }
            }
            Chunk::Sack(s) => {
                out.put_u32(s.cum_tsn);
                out.put_u32(s.a_rwnd);
                out.put_u16(s.gaps.len() as u16);
                out.put_u16(s.dups.len() as u16);
                for (a, b) in &s.gaps {
                    out.put_u16(*a);
                    out.put_u16(*b);
                }
                for d in &s.dups {
                    out.put_u32(*d);
                }
            }
            Chunk::Heartbeat(info) | Chunk::HeartbeatAck(info) => {
                out.put_u16(param::HEARTBEAT_INFO);
                out.put_u16((4 + info.len()) as u16);
                out.put_slice(info);
            }
            Chunk::Abort { causes, .. } | Chunk::Error { causes } => out.put_slice(causes),
            Chunk::Shutdown { cum_tsn } => out.put_u32(*cum_tsn),
            Chunk::CookieEcho(b) => out.put_slice(b),
            Chunk::Unknown { value, .. } => out.put_slice(value),
            Chunk::ShutdownAck | Chunk::CookieAck | Chunk::ShutdownComplete { .. } => {}
        }
        out.put_bytes(0, padded(len) - len);
    }
}

/// The parameter at the start of `v` (of a chunk of type `ty`): its type, its value and its
/// length without padding.
fn param_at(ty: u8, v: &Bytes) -> Result<(u16, Bytes, usize), ChunkError> {
    let pty = u16::from_be_bytes([v[0], v[1]]);
    let plen = usize::from(u16::from_be_bytes([v[2], v[3]]));
    if plen < 4 || plen > v.len() {
        return Err(ChunkError::Param {
            ty,
            length: plen,
            left: v.len(),
        });
    }
    Ok((pty, v.slice(4..plen), plen))
}

fn decode_params(ty: u8, mut v: Bytes) -> Result<Vec<InitParam>, ChunkError> {
    let mut params = Vec::new();
    while v.len() >= 4 {
        let (pty, value, plen) = param_at(ty, &v)?;
        v.advance(padded(plen).min(v.len()));
        let p = match (pty, value.len()) {
            (param::IPV4, 4) => {
                InitParam::Ipv4(Ipv4Addr::new(value[0], value[1], value[2], value[3]))
            }
            (param::IPV6, 16) => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&value);
                InitParam::Ipv6(Ipv6Addr::from(o))
            }
            (param::STATE_COOKIE, _) => InitParam::StateCookie(value),
            (param::COOKIE_PRESERVATIVE, 4) => InitParam::CookiePreservative(u32::from_be_bytes([
                value[0], value[1], value[2], value[3],
            ])),
            (param::HOST_NAME, _) => InitParam::HostName(value),
            (param::SUPPORTED_ADDRESS_TYPES, n) if n % 2 == 0 => InitParam::SupportedAddressTypes(
                value
                    .chunks_exact(2)
                    .map(|c| u16::from_be_bytes([c[0], c[1]]))
                    .collect(),
            ),
            (param::ECN, 0) => InitParam::Ecn,
            (param::FORWARD_TSN, 0) => InitParam::ForwardTsn,
            (param::SUPPORTED_EXTENSIONS, _) => InitParam::SupportedExtensions(value.to_vec()),
            _ => InitParam::Unknown { ty: pty, value },
        };
        params.push(p);
    }
    Ok(params)
}

impl InitParam {
    fn ty(&self) -> u16 {
        match self {
            InitParam::Ipv4(_) => param::IPV4,
            InitParam::Ipv6(_) => param::IPV6,
            InitParam::StateCookie(_) => param::STATE_COOKIE,
            InitParam::CookiePreservative(_) => param::COOKIE_PRESERVATIVE,
            InitParam::HostName(_) => param::HOST_NAME,
            InitParam::SupportedAddressTypes(_) => param::SUPPORTED_ADDRESS_TYPES,
            InitParam::Ecn => param::ECN,
            InitParam::ForwardTsn => param::FORWARD_TSN,
            InitParam::SupportedExtensions(_) => param::SUPPORTED_EXTENSIONS,
            InitParam::Unknown { ty, .. } => *ty,
        }
    }

    fn value_len(&self) -> usize {
        match self {
            InitParam::Ipv4(_) | InitParam::CookiePreservative(_) => 4,
            InitParam::Ipv6(_) => 16,
            InitParam::StateCookie(b) | InitParam::HostName(b) => b.len(),
            InitParam::SupportedAddressTypes(t) => 2 * t.len(),
            InitParam::Ecn | InitParam::ForwardTsn => 0,
            InitParam::SupportedExtensions(e) => e.len(),
            InitParam::Unknown { value, .. } => value.len(),
        }
    }

    fn padded_len(&self) -> usize {
        padded(4 + self.value_len())
    }

    fn encode(&self, out: &mut BytesMut, pad: bool) {
        let len = 4 + self.value_len();
        out.put_u16(self.ty());
        out.put_u16(len as u16);
        match self {
            InitParam::Ipv4(a) => out.put_slice(&a.octets()),
            InitParam::Ipv6(a) => out.put_slice(&a.octets()),
            InitParam::StateCookie(b) | InitParam::HostName(b) => out.put_slice(b),
            InitParam::CookiePreservative(ms) => out.put_u32(*ms),
            InitParam::SupportedAddressTypes(t) => t.iter().for_each(|t| out.put_u16(*t)),
            InitParam::Ecn | InitParam::ForwardTsn => {}
            InitParam::SupportedExtensions(e) => out.put_slice(e),
            InitParam::Unknown { value, .. } => out.put_slice(value),
        }
        if pad {
            out.put_bytes(0, padded(len) - len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_types_say_what_to_do_by_their_upper_bits() {
        assert_eq!(Unrecognized::of_chunk(0x3f), Unrecognized::Stop);
        assert_eq!(Unrecognized::of_chunk(0x40), Unrecognized::StopAndReport);
        assert_eq!(Unrecognized::of_chunk(0x84), Unrecognized::Skip);
        assert_eq!(Unrecognized::of_chunk(0xc1), Unrecognized::SkipAndReport);
        assert_eq!(Unrecognized::of_param(0x8008), Unrecognized::Skip);
        assert_eq!(Unrecognized::of_param(0xc000), Unrecognized::SkipAndReport);
    }

    #[test]
    fn lengths_are_never_trusted() {
        // A DATA chunk claiming 40 bytes in 16.
        let b = Bytes::from_static(&[0, 3, 0, 40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 11]);
        assert!(matches!(
            Chunk::decode(&b, 0),
            Err(ChunkError::Length { .. })
        ));
        // A SACK claiming 1,000 gap blocks.
        let b = Bytes::from_static(&[3, 0, 0, 16, 0, 0, 0, 1, 0, 1, 0, 0, 3, 232, 0, 0]);
        assert!(matches!(
            Chunk::decode(&b, 0),
            Err(ChunkError::Value { .. })
        ));
        // A DATA chunk too short for its header.
        let b = Bytes::from_static(&[0, 3, 0, 8, 0, 0, 0, 1]);
        assert!(matches!(
            Chunk::decode(&b, 0),
            Err(ChunkError::Value { .. })
        ));
    }
}
