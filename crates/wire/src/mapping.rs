//! The data channel between a pool user and a pool element over TCP: SCTP-like chunks after
//! draft-ietf-rserpool-tcpmapping-03, so ASAP's session messages (COOKIE, COOKIE_ECHO,
//! BUSINESS_CARD, ERROR) can travel beside the application's data.
//!
//! Why: over SCTP the payload protocol identifier tells ASAP control (PPID 11) from data; a TCP
//! byte stream has nothing of the kind. The draft's chunks bring it back: each chunk has the
//! same 4-byte header as an ASAP message (type, flags, length without padding) and is padded to
//! 4 bytes; a DATA chunk carries a PPID. docs/SESSION.md describes every byte.
//!
//! What is used of the draft: INIT (once, first, each way), DATA, HEARTBEAT and HEARTBEAT ACK.
//! This implementation's INIT omits TSNs and streams (flags 0x03): TCP already orders and
//! delivers, and there is no undelivered-message retrieval, so ACK chunks are neither sent nor
//! expected (one received is ignored). One extension: INIT flag [`init_flags::FRAGMENTS`] says
//! the sender sets SCTP's B and E bits (RFC 9260 §3.3.1) in its DATA chunks, so a message larger
//! than a chunk is cut into several; without it, each DATA chunk is a whole message.
//! Receiving honours every INIT flag of the draft.

use crate::error::{DecodeError, DecodeErrorKind};
use bytes::{Buf, BufMut, Bytes, BytesMut};

pub mod chunk_type {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const ACK: u8 = 3;
    pub const HEARTBEAT: u8 = 4;
    pub const HEARTBEAT_ACK: u8 = 5;
}

pub mod init_flags {
    /// The sender omits the TSN in its DATA chunks (and wants none in ACKs).
    pub const OMIT_TSN: u8 = 0x01;
    /// The sender omits Stream ID and SSN: all its data is stream 0.
    pub const OMIT_STREAM: u8 = 0x02;
    /// The sender omits the PPID: it is 0.
    pub const OMIT_PPID: u8 = 0x04;
    /// Extension: the B and E bits of the sender's DATA flags mark a message's first and last
    /// chunk, as in SCTP.
    pub const FRAGMENTS: u8 = 0x08;
    /// What this implementation sends.
    pub const OURS: u8 = OMIT_TSN | OMIT_STREAM | FRAGMENTS;
}

pub mod data_flags {
    /// Unordered (meaningless over TCP; kept as received).
    pub const UNORDERED: u8 = 0x04;
    /// First chunk of a message (with [`super::init_flags::FRAGMENTS`]).
    pub const BEGIN: u8 = 0x02;
    /// Last chunk of a message (with [`super::init_flags::FRAGMENTS`]).
    pub const END: u8 = 0x01;
}

/// The Heartbeat Info parameter's type inside HEARTBEAT and HEARTBEAT ACK.
pub const HEARTBEAT_INFO: u16 = 1;

/// Chunk header plus PPID: the bytes before a DATA chunk's payload as this implementation
/// sends it.
pub const DATA_HEADER: usize = 8;
/// The most payload one DATA chunk of ours carries (a multiple of 4, under the 16-bit length).
pub const MAX_DATA_PAYLOAD: usize = 65_520;

/// One chunk as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Init {
        flags: u8,
    },
    Data {
        flags: u8,
        ppid: u32,
        payload: Bytes,
    },
    Ack,
    Heartbeat {
        info: Bytes,
    },
    HeartbeatAck {
        info: Bytes,
    },
    /// A type the draft reserves: skipped.
    Unknown {
        ty: u8,
    },
}

/// Appends our INIT chunk.
pub fn put_init(out: &mut BytesMut) {
    out.put_slice(&[chunk_type::INIT, init_flags::OURS, 0, 4]);
}

/// Appends `message` as DATA chunks with `ppid` (cut when larger than [`MAX_DATA_PAYLOAD`]; an
/// empty message is one empty chunk).
pub fn put_data(out: &mut BytesMut, ppid: u32, message: &[u8]) {
    let mut parts = message.chunks(MAX_DATA_PAYLOAD).peekable();
    let mut first = true;
    loop {
        let part = parts.next().unwrap_or(&[]);
        let last = parts.peek().is_none();
        let mut flags = 0;
        if first {
            flags |= data_flags::BEGIN;
        }
        if last {
            flags |= data_flags::END;
        }
        let len = DATA_HEADER + part.len();
        out.reserve(len.next_multiple_of(4));
        out.put_u8(chunk_type::DATA);
        out.put_u8(flags);
        out.put_u16(len as u16);
        out.put_u32(ppid);
        out.put_slice(part);
        pad(out, len);
        first = false;
        if last {
            return;
        }
    }
}

/// Appends a HEARTBEAT (or its ACK) carrying `info` in a Heartbeat Info parameter.
pub fn put_heartbeat(out: &mut BytesMut, ack: bool, info: &[u8]) {
    let param = 4 + info.len();
    let len = 4 + param;
    out.put_u8(if ack {
        chunk_type::HEARTBEAT_ACK
    } else {
        chunk_type::HEARTBEAT
    });
    out.put_u8(0);
    out.put_u16(len as u16);
    out.put_u16(HEARTBEAT_INFO);
    out.put_u16(param as u16);
    out.put_slice(info);
    pad(out, len);
}

fn pad(out: &mut BytesMut, len: usize) {
    out.put_bytes(0, len.next_multiple_of(4) - len);
}

/// Cuts a received byte stream into chunks. The peer's INIT must come first: it says which
/// fields its DATA chunks omit.
#[derive(Debug, Default)]
pub struct ChunkReader {
    buf: BytesMut,
    peer_flags: Option<u8>,
}

impl ChunkReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// The buffer to read into (e.g. with `read_buf`).
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// The peer's INIT flags, once its INIT has arrived.
    pub fn peer_flags(&self) -> Option<u8> {
        self.peer_flags
    }

    /// The next whole chunk; `Ok(None)` when more bytes are needed. An error means the stream
    /// cannot be framed any more (the connection should be closed).
    pub fn next_chunk(&mut self) -> Result<Option<Chunk>, DecodeError> {
        let Some(&[ty, flags, l0, l1]) = self.buf.get(..4) else {
            return Ok(None);
        };
        let len = usize::from(u16::from_be_bytes([l0, l1]));
        if self.peer_flags.is_none() && (ty != chunk_type::INIT || len != 4) {
            return Err(invalid(
                "the first chunk is not an INIT (a client without the RSerPool TCP mapping?)",
            ));
        }
        if len < 4 {
            return Err(invalid("chunk length below 4"));
        }
        let padded = len.next_multiple_of(4);
        if self.buf.len() < padded {
            return Ok(None);
        }
        let mut chunk = self.buf.split_to(padded).freeze();
        chunk.truncate(len);
        chunk.advance(4);
        let Some(peer) = self.peer_flags else {
            self.peer_flags = Some(flags);
            return Ok(Some(Chunk::Init { flags }));
        };
        Ok(Some(match ty {
            chunk_type::DATA => data(peer, flags, chunk)?,
            chunk_type::INIT => return Err(invalid("a second INIT")),
            chunk_type::ACK => Chunk::Ack,
            chunk_type::HEARTBEAT | chunk_type::HEARTBEAT_ACK => {
                let info = heartbeat_info(chunk)?;
                if ty == chunk_type::HEARTBEAT {
                    Chunk::Heartbeat { info }
                } else {
                    Chunk::HeartbeatAck { info }
                }
            }
            ty => Chunk::Unknown { ty },
        }))
    }
}

fn data(peer: u8, flags: u8, mut body: Bytes) -> Result<Chunk, DecodeError> {
    let mut skip = 0;
    if peer & init_flags::OMIT_TSN == 0 {
        skip += 4;
    }
    if peer & init_flags::OMIT_STREAM == 0 {
        skip += 4;
    }
    if body.len() < skip {
        return Err(invalid("DATA chunk shorter than its fields"));
    }
    body.advance(skip);
    let ppid = if peer & init_flags::OMIT_PPID == 0 {
        if body.len() < 4 {
            return Err(invalid("DATA chunk shorter than its PPID"));
        }
        body.get_u32()
    } else {
        0
    };
    // Without fragments, every chunk is a whole message.
    let flags = if peer & init_flags::FRAGMENTS == 0 {
        (flags & !(data_flags::BEGIN | data_flags::END)) | data_flags::BEGIN | data_flags::END
    } else {
        flags
    };
    Ok(Chunk::Data {
        flags,
        ppid,
        payload: body,
    })
}

fn heartbeat_info(mut body: Bytes) -> Result<Bytes, DecodeError> {
    if body.len() < 4 {
        return Err(invalid("HEARTBEAT without its Heartbeat Info"));
    }
    let ty = body.get_u16();
    let len = usize::from(body.get_u16());
    if ty != HEARTBEAT_INFO || len < 4 || len - 4 > body.len() {
        return Err(invalid("bad Heartbeat Info parameter"));
    }
    Ok(body.split_to(len - 4))
}

fn invalid(what: &'static str) -> DecodeError {
    DecodeError::silent(DecodeErrorKind::InvalidValue(what))
}

/// Puts a fragmented message back together, up to a size limit.
#[derive(Debug)]
pub struct Reassembly {
    max: usize,
    parts: Option<(u32, BytesMut)>,
}

impl Reassembly {
    /// Refuses messages larger than `max` bytes.
    pub fn new(max: usize) -> Self {
        Self { max, parts: None }
    }

    /// Takes a DATA chunk's flags, PPID and payload; returns the message it completes.
    pub fn push(
        &mut self,
        flags: u8,
        ppid: u32,
        payload: Bytes,
    ) -> Result<Option<(u32, Bytes)>, DecodeError> {
        let begin = flags & data_flags::BEGIN != 0;
        let end = flags & data_flags::END != 0;
        match (begin, end, self.parts.take()) {
            (true, true, None) => {
                if payload.len() > self.max {
                    return Err(invalid("message larger than the limit"));
                }
                Ok(Some((ppid, payload)))
            }
            (true, false, None) => {
                self.parts = Some((ppid, BytesMut::from(&payload[..])));
                self.check()?;
                Ok(None)
            }
            (false, last, Some((p, mut buf))) => {
                buf.extend_from_slice(&payload);
                if last {
                    if buf.len() > self.max {
                        return Err(invalid("message larger than the limit"));
                    }
                    return Ok(Some((p, buf.freeze())));
                }
                self.parts = Some((p, buf));
                self.check()?;
                Ok(None)
            }
            _ => Err(invalid("DATA chunk out of its message's order")),
        }
    }

    fn check(&self) -> Result<(), DecodeError> {
        match &self.parts {
            Some((_, b)) if b.len() > self.max => Err(invalid("message larger than the limit")),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read_all(bytes: &[u8]) -> Result<Vec<Chunk>, DecodeError> {
        let mut r = ChunkReader::new();
        r.buffer_mut().extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(c) = r.next_chunk()? {
            out.push(c);
        }
        Ok(out)
    }

    #[test]
    fn init_data_heartbeat_round_trip() {
        let mut b = BytesMut::new();
        put_init(&mut b);
        put_data(&mut b, 11, b"abcde");
        put_heartbeat(&mut b, false, b"xyz");
        put_heartbeat(&mut b, true, b"xyz");
        assert_eq!(b.len() % 4, 0);
        let chunks = read_all(&b).unwrap();
        assert_eq!(
            chunks,
            vec![
                Chunk::Init {
                    flags: init_flags::OURS
                },
                Chunk::Data {
                    flags: data_flags::BEGIN | data_flags::END,
                    ppid: 11,
                    payload: Bytes::from_static(b"abcde")
                },
                Chunk::Heartbeat {
                    info: Bytes::from_static(b"xyz")
                },
                Chunk::HeartbeatAck {
                    info: Bytes::from_static(b"xyz")
                },
            ]
        );
        // The exact bytes of docs/SESSION.md's example.
        assert_eq!(
            &b[..20],
            &[
                1, 0x0b, 0, 4, // INIT
                0, 0x03, 0, 13, 0, 0, 0, 11, b'a', b'b', b'c', b'd', b'e', 0, 0, 0
            ]
        );
    }

    #[test]
    fn a_draft_peer_with_every_field_is_understood() {
        // INIT flags 0: TSN, stream/SSN and PPID present; no fragments.
        let bytes = [
            1, 0, 0, 4, // INIT
            0, 0, 0, 18, 0, 0, 0, 7, 0, 1, 0, 2, 0, 0, 0, 42, b'h', b'i', 0, 0, // DATA
            3, 0, 0, 8, 0, 0, 0, 7, // ACK
        ];
        let chunks = read_all(&bytes).unwrap();
        assert_eq!(
            chunks[1],
            Chunk::Data {
                flags: data_flags::BEGIN | data_flags::END,
                ppid: 42,
                payload: Bytes::from_static(b"hi")
            }
        );
        assert_eq!(chunks[2], Chunk::Ack);
    }

    #[test]
    fn stream_without_init_or_with_bad_lengths_is_refused() {
        assert!(read_all(b"GET / HTTP/1.1\r\n").is_err());
        assert!(read_all(&[1, 3, 0, 4, 0, 0, 0, 2]).is_err());
        assert!(read_all(&[1, 3, 0, 4, 1, 3, 0, 4]).is_err());
        assert!(read_all(&[1, 3, 0, 4, 4, 0, 0, 8, 0, 1, 0, 9]).is_err());
    }

    #[test]
    fn large_messages_are_cut_and_reassembled_within_the_limit() {
        let msg: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let mut b = BytesMut::new();
        put_init(&mut b);
        put_data(&mut b, 0, &msg);
        let mut ok = Reassembly::new(1 << 20);
        let mut small = Reassembly::new(100_000);
        let (mut got, mut refused) = (None, false);
        for c in read_all(&b).unwrap() {
            if let Chunk::Data {
                flags,
                ppid,
                payload,
            } = c
            {
                if let Some(m) = ok.push(flags, ppid, payload.clone()).unwrap() {
                    got = Some(m);
                }
                refused |= small.push(flags, ppid, payload).is_err();
            }
        }
        assert_eq!(got.unwrap().1, msg);
        assert!(refused);
    }

    proptest! {
        #[test]
        fn any_bytes_after_init_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut b = vec![1, 3, 0, 4];
            b.extend_from_slice(&tail);
            let _ = read_all(&b);
        }

        #[test]
        fn messages_survive_any_read_boundaries(
            msgs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 1..8),
            cut in 1usize..64,
        ) {
            let mut b = BytesMut::new();
            put_init(&mut b);
            for m in &msgs {
                put_data(&mut b, 0, m);
            }
            let mut r = ChunkReader::new();
            let mut re = Reassembly::new(1000);
            let mut got = Vec::new();
            for piece in b.chunks(cut) {
                r.buffer_mut().extend_from_slice(piece);
                while let Some(c) = r.next_chunk().unwrap() {
                    if let Chunk::Data { flags, ppid, payload } = c
                        && let Some((_, m)) = re.push(flags, ppid, payload).unwrap() {
                            got.push(m.to_vec());
                        }
                }
            }
            prop_assert_eq!(got, msgs);
        }
    }
}
