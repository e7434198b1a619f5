//! What members of the tier say to each other, and what the distributor and the members say
//! over UDP. The formats are those of docs/TIER.md; this module is their one definition.
//!
//! Between members (TCP): each message is its length (u32, the bytes after it), its type (u8)
//! and its body; addresses are IPv4 and port (6 bytes).
//!
//! Distributor and members (UDP, on a member's tier address):
//! - heartbeat: `RSPT`, sequence (u32);
//! - its answer: the heartbeat's 8 bytes, the member's ID (u32), its free capacity in
//!   millionths (u32);
//! - a member died: `RSPD`, the dead member's ID (u32), 1 if the receiver sends the nudge's
//!   probes, else 0.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::net::{Ipv4Addr, SocketAddrV4};

/// Longest message between members.
pub const MAX_MESSAGE: usize = 1 << 20;
/// Heartbeat datagrams (and their answers) start with this.
pub const HEARTBEAT_MAGIC: &[u8; 4] = b"RSPT";
/// The distributor's word that a member died starts with this.
pub const DEAD_MAGIC: &[u8; 4] = b"RSPD";

mod kind {
    pub const HELLO: u8 = 1;
    pub const ADD: u8 = 2;
    pub const DEL: u8 = 3;
    pub const FIN: u8 = 4;
    pub const TOUCH: u8 = 5;
}

/// A spliced connection as members exchange it: its four addresses and the translation
/// between its legs. No interfaces: each member finds its own towards both ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Splice {
    pub client: SocketAddrV4,
    pub front: SocketAddrV4,
    pub back: SocketAddrV4,
    pub server: SocketAddrV4,
    pub client_seq_delta: u32,
    pub server_seq_delta: u32,
    /// Window scale shifts: the client's, the proxy's towards the client, the server's, the
    /// proxy's towards the server.
    pub client_wscale: u8,
    pub front_wscale: u8,
    pub server_wscale: u8,
    pub back_wscale: u8,
    /// Timestamp offsets (client → server, server → client) when both legs use timestamps.
    pub timestamps: Option<(u32, u32)>,
}

impl Splice {
    /// The connection's name in a flow table: its client direction (client, front).
    pub fn key(&self) -> (SocketAddrV4, SocketAddrV4) {
        (self.client, self.front)
    }

    /// Its two directions: client → front, and server → back.
    pub fn directions(&self) -> [(SocketAddrV4, SocketAddrV4); 2] {
        [(self.client, self.front), (self.server, self.back)]
    }
}

/// What a member says of itself first on every link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Its pool element identifier in the tier pool.
    pub id: u32,
    /// Its MAC address on the segment shared with the router.
    pub mac: [u8; 6],
    /// The server-facing address all members share.
    pub shared: Ipv4Addr,
    /// Its source ports on `shared`; 0–0 for a server of a split splice.
    pub lo: u16,
    pub hi: u16,
}

impl Hello {
    /// Whether its port range overlaps `other`'s on the same shared address.
    pub fn overlaps(&self, other: &Hello) -> bool {
        self.shared == other.shared && self.lo <= other.hi && other.lo <= self.hi
    }
}

/// A message from one member to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    /// A splice to install.
    Add(Splice),
    /// A splice whose entries went at the sender (an RST, or expiry).
    Del(Splice),
    /// A FIN passed at the sender in this direction (from, to).
    Fin(SocketAddrV4, SocketAddrV4),
    /// Packets passed at the sender in these directions since its last pass.
    Touch(Vec<(SocketAddrV4, SocketAddrV4)>),
}

fn put_addr(b: &mut BytesMut, a: SocketAddrV4) {
    b.put_slice(&a.ip().octets());
    b.put_u16(a.port());
}

fn get_addr(b: &mut Bytes) -> Option<SocketAddrV4> {
    if b.remaining() < 6 {
        return None;
    }
    let ip = Ipv4Addr::from(b.get_u32());
    Some(SocketAddrV4::new(ip, b.get_u16()))
}

fn put_splice(b: &mut BytesMut, s: &Splice) {
    for a in [s.client, s.front, s.back, s.server] {
        put_addr(b, a);
    }
    b.put_u32(s.client_seq_delta);
    b.put_u32(s.server_seq_delta);
    b.put_slice(&[
        s.client_wscale,
        s.front_wscale,
        s.server_wscale,
        s.back_wscale,
    ]);
    match s.timestamps {
        Some((c, v)) => {
            b.put_u8(1);
            b.put_u32(c);
            b.put_u32(v);
        }
        None => b.put_u8(0),
    }
}

fn get_splice(b: &mut Bytes) -> Option<Splice> {
    let (client, front, back, server) = (get_addr(b)?, get_addr(b)?, get_addr(b)?, get_addr(b)?);
    if b.remaining() < 13 {
        return None;
    }
    let (cs, ss) = (b.get_u32(), b.get_u32());
    let ws = [b.get_u8(), b.get_u8(), b.get_u8(), b.get_u8()];
    let timestamps = match b.get_u8() {
        0 => None,
        _ if b.remaining() >= 8 => Some((b.get_u32(), b.get_u32())),
        _ => return None,
    };
    Some(Splice {
        client,
        front,
        back,
        server,
        client_seq_delta: cs,
        server_seq_delta: ss,
        client_wscale: ws[0],
        front_wscale: ws[1],
        server_wscale: ws[2],
        back_wscale: ws[3],
        timestamps,
    })
}

impl Message {
    /// The message with its length (u32) and type in front.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(64);
        b.put_u32(0);
        match self {
            Self::Hello(m) => {
                b.put_u8(kind::HELLO);
                b.put_u32(m.id);
                b.put_slice(&m.mac);
                b.put_slice(&m.shared.octets());
                b.put_u16(m.lo);
                b.put_u16(m.hi);
            }
            Self::Add(s) => {
                b.put_u8(kind::ADD);
                put_splice(&mut b, s);
            }
            Self::Del(s) => {
                b.put_u8(kind::DEL);
                put_splice(&mut b, s);
            }
            Self::Fin(from, to) => {
                b.put_u8(kind::FIN);
                put_addr(&mut b, *from);
                put_addr(&mut b, *to);
            }
            Self::Touch(flows) => {
                b.put_u8(kind::TOUCH);
                for (from, to) in flows {
                    put_addr(&mut b, *from);
                    put_addr(&mut b, *to);
                }
            }
        }
        let len = u32::try_from(b.len() - 4).unwrap_or(u32::MAX);
        b[..4].copy_from_slice(&len.to_be_bytes());
        b.freeze()
    }

    /// A message's body (what follows its length); `None` when it does not parse.
    pub fn decode(mut b: Bytes) -> Option<Self> {
        if !b.has_remaining() {
            return None;
        }
        Some(match b.get_u8() {
            kind::HELLO => {
                if b.remaining() < 18 {
                    return None;
                }
                let id = b.get_u32();
                let mut mac = [0u8; 6];
                b.copy_to_slice(&mut mac);
                let shared = Ipv4Addr::from(b.get_u32());
                Self::Hello(Hello {
                    id,
                    mac,
                    shared,
                    lo: b.get_u16(),
                    hi: b.get_u16(),
                })
            }
            kind::ADD => Self::Add(get_splice(&mut b)?),
            kind::DEL => Self::Del(get_splice(&mut b)?),
            kind::FIN => Self::Fin(get_addr(&mut b)?, get_addr(&mut b)?),
            kind::TOUCH => {
                let mut flows = Vec::with_capacity(b.remaining() / 12);
                while b.has_remaining() {
                    flows.push((get_addr(&mut b)?, get_addr(&mut b)?));
                }
                Self::Touch(flows)
            }
            _ => return None,
        })
    }
}

/// The length a message's 4-byte header announces, if it is one a member accepts.
pub fn frame_len(header: [u8; 4]) -> Result<usize, String> {
    let len = u32::from_be_bytes(header) as usize;
    if len == 0 || len > MAX_MESSAGE {
        return Err(format!("a tier message of {len} bytes"));
    }
    Ok(len)
}

/// A datagram between the distributor and a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datagram {
    /// The distributor asks: alive?
    Heartbeat { seq: u32 },
    /// A member answers, with its free capacity in millionths.
    Answer { seq: u32, id: u32, free: u32 },
    /// The distributor says that member `dead` died; `prober`: the receiver sends the
    /// nudge's probes.
    Dead { dead: u32, prober: bool },
}

impl Datagram {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16);
        match *self {
            Self::Heartbeat { seq } => {
                b.extend_from_slice(HEARTBEAT_MAGIC);
                b.extend_from_slice(&seq.to_be_bytes());
            }
            Self::Answer { seq, id, free } => {
                b.extend_from_slice(HEARTBEAT_MAGIC);
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&id.to_be_bytes());
                b.extend_from_slice(&free.to_be_bytes());
            }
            Self::Dead { dead, prober } => {
                b.extend_from_slice(DEAD_MAGIC);
                b.extend_from_slice(&dead.to_be_bytes());
                b.push(u8::from(prober));
            }
        }
        b
    }

    /// A datagram as a member reads it (a heartbeat, or the word of a death).
    pub fn decode_at_member(b: &[u8]) -> Option<Self> {
        let u32_at = |i: usize| Some(u32::from_be_bytes(b.get(i..i + 4)?.try_into().ok()?));
        match b.get(..4)? {
            m if m == DEAD_MAGIC && b.len() >= 9 => Some(Self::Dead {
                dead: u32_at(4)?,
                prober: b[8] == 1,
            }),
            m if m == HEARTBEAT_MAGIC && b.len() >= 8 => Some(Self::Heartbeat { seq: u32_at(4)? }),
            _ => None,
        }
    }

    /// A datagram as the distributor reads it (an answer).
    pub fn decode_at_distributor(b: &[u8]) -> Option<Self> {
        let u32_at = |i: usize| Some(u32::from_be_bytes(b.get(i..i + 4)?.try_into().ok()?));
        if b.len() < 16 || b.get(..4)? != HEARTBEAT_MAGIC {
            return None;
        }
        Some(Self::Answer {
            seq: u32_at(4)?,
            id: u32_at(8)?,
            free: u32_at(12)?,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    pub(crate) fn splice() -> Splice {
        Splice {
            client: "10.0.0.2:40000".parse().unwrap(),
            front: "10.9.0.1:7000".parse().unwrap(),
            back: "10.9.0.2:20001".parse().unwrap(),
            server: "10.0.3.2:8080".parse().unwrap(),
            client_seq_delta: 0xdead_beef,
            server_seq_delta: 12,
            client_wscale: 7,
            front_wscale: 9,
            server_wscale: 2,
            back_wscale: 5,
            timestamps: Some((1, 0xffff_fff0)),
        }
    }

    #[test]
    fn messages_round_trip_and_garbage_does_not_parse() {
        let me = Hello {
            id: 0x1234,
            mac: [2, 0, 0, 0, 0, 1],
            shared: Ipv4Addr::new(10, 9, 0, 2),
            lo: 20000,
            hi: 29999,
        };
        let s = splice();
        let msgs = [
            Message::Hello(me),
            Message::Add(s),
            Message::Add(Splice {
                timestamps: None,
                ..s
            }),
            Message::Del(s),
            Message::Fin(s.client, s.front),
            Message::Touch(vec![(s.client, s.front), (s.server, s.back)]),
            Message::Touch(Vec::new()),
        ];
        for m in msgs {
            let b = m.encode();
            let len = frame_len([b[0], b[1], b[2], b[3]]).unwrap();
            assert_eq!(len, b.len() - 4);
            assert_eq!(Message::decode(b.slice(4..)).unwrap(), m);
            for cut in 0..b.len() - 4 {
                let _ = Message::decode(b.slice(4..4 + cut));
            }
        }
        assert!(Message::decode(Bytes::from_static(&[99, 1, 2])).is_none());
        assert!(Message::decode(Bytes::new()).is_none());
        assert!(frame_len([0; 4]).is_err());
        assert!(frame_len(((MAX_MESSAGE + 1) as u32).to_be_bytes()).is_err());
    }

    /// The bytes docs/TIER.md describes, spelled out: a FIN and a HELLO.
    #[test]
    fn the_wire_format_is_the_documented_one() {
        let fin = Message::Fin("1.2.3.4:5".parse().unwrap(), "6.7.8.9:10".parse().unwrap());
        assert_eq!(
            &fin.encode()[..],
            &[0, 0, 0, 13, 4, 1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 0, 10]
        );
        let hello = Message::Hello(Hello {
            id: 1,
            mac: [2, 0, 0, 0, 0, 9],
            shared: Ipv4Addr::new(10, 88, 9, 2),
            lo: 21000,
            hi: 21999,
        });
        let b = hello.encode();
        assert_eq!(&b[..5], &[0, 0, 0, 19, 1]);
        assert_eq!(&b[15..19], &[10, 88, 9, 2]);
        // An ADD: 4 addresses, 2 offsets, 4 scales, the timestamps' flag and offsets.
        assert_eq!(
            Message::Add(splice()).encode().len(),
            4 + 1 + 24 + 8 + 4 + 1 + 8
        );
    }

    #[test]
    fn datagrams_round_trip() {
        for d in [
            Datagram::Heartbeat { seq: 7 },
            Datagram::Dead {
                dead: 0xabcd,
                prober: true,
            },
            Datagram::Dead {
                dead: 3,
                prober: false,
            },
        ] {
            assert_eq!(Datagram::decode_at_member(&d.encode()), Some(d));
        }
        let a = Datagram::Answer {
            seq: 9,
            id: 0x1234,
            free: 500_000,
        };
        assert_eq!(a.encode().len(), 16);
        assert_eq!(Datagram::decode_at_distributor(&a.encode()), Some(a));
        assert_eq!(&Datagram::Heartbeat { seq: 1 }.encode()[..4], b"RSPT");
        assert!(Datagram::decode_at_member(b"RSPD\0\0").is_none());
        assert!(Datagram::decode_at_member(b"XXXX\0\0\0\0").is_none());
        assert!(Datagram::decode_at_distributor(b"RSPT\0\0\0\0").is_none());
    }
}
