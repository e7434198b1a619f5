//! An SCTP packet (RFC 9260 §3.1): the common header, then chunks, each padded to 4 bytes.
//!
//! The checksum is CRC32c over the whole packet with the checksum field zero (Appendix A),
//! stored least significant byte first, as every implementation does.

use crate::chunk::{Chunk, ChunkError};
use bytes::{BufMut, Bytes, BytesMut};

/// Bytes of the common header.
pub const HEADER: usize = 12;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    pub src_port: u16,
    pub dst_port: u16,
    /// The receiver's verification tag (0 only in an INIT).
    pub tag: u32,
    pub chunks: Vec<Chunk>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("an SCTP packet needs at least {HEADER} bytes, got {0}")]
    Short(usize),
    #[error("bad CRC32c checksum: carried {carried:#010x}, computed {computed:#010x}")]
    Checksum { carried: u32, computed: u32 },
    #[error("chunk {index}: {error}")]
    Chunk { index: usize, error: ChunkError },
    #[error("no chunk in the packet")]
    Empty,
}

impl Packet {
    pub fn new(src_port: u16, dst_port: u16, tag: u32, chunks: Vec<Chunk>) -> Self {
        Self {
            src_port,
            dst_port,
            tag,
            chunks,
        }
    }

    /// Decodes a packet whose checksum is right. Chunks of an unknown type are kept as
    /// [`Chunk::Unknown`] (the association decides by their type's upper bits).
    pub fn decode(buf: &[u8]) -> Result<Self, PacketError> {
        if buf.len() < HEADER {
            return Err(PacketError::Short(buf.len()));
        }
        let carried = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        let computed = checksum(buf);
        if carried != computed {
            return Err(PacketError::Checksum { carried, computed });
        }
        let src_port = u16::from_be_bytes([buf[0], buf[1]]);
        let dst_port = u16::from_be_bytes([buf[2], buf[3]]);
        let tag = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let bytes = Bytes::copy_from_slice(&buf[HEADER..]);
        let mut chunks = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let (chunk, used) = Chunk::decode(&bytes, at).map_err(|error| PacketError::Chunk {
                index: chunks.len(),
                error,
            })?;
            chunks.push(chunk);
            at += used;
        }
        if chunks.is_empty() {
            return Err(PacketError::Empty);
        }
        Ok(Self {
            src_port,
            dst_port,
            tag,
            chunks,
        })
    }

    /// Encodes the packet with its checksum.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(
            HEADER + self.chunks.iter().map(Chunk::padded_len).sum::<usize>(),
        );
        out.put_u16(self.src_port);
        out.put_u16(self.dst_port);
        out.put_u32(self.tag);
        out.put_u32(0);
        for c in &self.chunks {
            c.encode(&mut out);
        }
        let sum = checksum(&out);
        out[8..12].copy_from_slice(&sum.to_le_bytes());
        out.freeze()
    }
}

/// CRC32c of `packet` with its checksum field (bytes 8..12) taken as zero.
pub fn checksum(packet: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&packet[..8]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, packet.get(HEADER..).unwrap_or(&[]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{Data, Init, InitParam};
    use std::net::Ipv4Addr;

    #[test]
    fn an_init_round_trips_with_its_checksum() {
        let p = Packet::new(
            9899,
            9899,
            0,
            vec![Chunk::Init(Init {
                initiate_tag: 0x1234_5678,
                a_rwnd: 65_536,
                outbound_streams: 10,
                inbound_streams: 65_535,
                initial_tsn: 7,
                params: vec![
                    InitParam::Ipv4(Ipv4Addr::new(192, 0, 2, 1)),
                    InitParam::SupportedAddressTypes(vec![5]),
                ],
            })],
        );
        let wire = p.encode();
        assert_eq!(Packet::decode(&wire).unwrap(), p);
        let mut bad = wire.to_vec();
        bad[20] ^= 1;
        assert!(matches!(
            Packet::decode(&bad),
            Err(PacketError::Checksum { .. })
        ));
    }

    #[test]
    fn the_checksum_is_crc32c() {
        // CRC32c's standard check value: "123456789" gives 0xe3069283 (RFC 3720 B.4). Its
        // byte order on the wire is checked against Wireshark (tests/wireshark.rs).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn data_chunks_bundle_and_pad() {
        let d = |tsn, n: usize| {
            Chunk::Data(Data {
                tsn,
                stream: 0,
                ssn: tsn as u16,
                ppid: 11,
                unordered: false,
                begin: true,
                end: true,
                immediate: false,
                payload: Bytes::from(vec![0xab; n]),
            })
        };
        let p = Packet::new(1, 2, 3, vec![d(1, 1), d(2, 5), d(3, 8)]);
        let wire = p.encode();
        // 12 + (16+1 → 20) + (16+5 → 24) + (16+8 = 24)
        assert_eq!(wire.len(), 12 + 20 + 24 + 24);
        assert_eq!(Packet::decode(&wire).unwrap(), p);
    }
}
