//! The packet codec against generated input: every packet round-trips, and no byte string —
//! with a right checksum, so that it reaches the chunk parser — makes the decoder panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use proptest::prelude::*;
use rserpool_sctp::chunk::param;
use rserpool_sctp::packet::checksum;
use rserpool_sctp::{Chunk, Data, Init, InitParam, Packet, Sack};
use std::net::{Ipv4Addr, Ipv6Addr};

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn init_param() -> impl Strategy<Value = InitParam> {
    let known = [
        param::IPV4,
        param::IPV6,
        param::STATE_COOKIE,
        param::COOKIE_PRESERVATIVE,
        param::HOST_NAME,
        param::SUPPORTED_ADDRESS_TYPES,
        param::ECN,
        param::FORWARD_TSN,
        param::SUPPORTED_EXTENSIONS,
    ];
    prop_oneof![
        any::<u32>().prop_map(|a| InitParam::Ipv4(Ipv4Addr::from(a))),
        any::<u128>().prop_map(|a| InitParam::Ipv6(Ipv6Addr::from(a))),
        bytes(64).prop_map(InitParam::StateCookie),
        any::<u32>().prop_map(InitParam::CookiePreservative),
        bytes(20).prop_map(InitParam::HostName),
        prop::collection::vec(any::<u16>(), 0..4).prop_map(InitParam::SupportedAddressTypes),
        Just(InitParam::Ecn),
        Just(InitParam::ForwardTsn),
        prop::collection::vec(any::<u8>(), 0..5).prop_map(InitParam::SupportedExtensions),
        (
            any::<u16>().prop_filter("unknown", move |t| !known.contains(t)),
            bytes(12)
        )
            .prop_map(|(ty, value)| InitParam::Unknown { ty, value }),
    ]
}

fn init() -> impl Strategy<Value = Init> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u16>(),
        any::<u16>(),
        any::<u32>(),
        prop::collection::vec(init_param(), 0..5),
    )
        .prop_map(|(t, w, o, i, tsn, params)| Init {
            initiate_tag: t,
            a_rwnd: w,
            outbound_streams: o,
            inbound_streams: i,
            initial_tsn: tsn,
            params,
        })
}

fn chunk() -> impl Strategy<Value = Chunk> {
    let known = [0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14];
    prop_oneof![
        (
            any::<u32>(),
            any::<u16>(),
            any::<u16>(),
            any::<u32>(),
            any::<[bool; 4]>(),
            bytes(100)
        )
            .prop_map(|(tsn, stream, ssn, ppid, f, payload)| Chunk::Data(Data {
                tsn,
                stream,
                ssn,
                ppid,
                unordered: f[0],
                begin: f[1],
                end: f[2],
                immediate: f[3],
                payload,
            })),
        init().prop_map(Chunk::Init),
        init().prop_map(Chunk::InitAck),
        (
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(any::<(u16, u16)>(), 0..4),
            prop::collection::vec(any::<u32>(), 0..4)
        )
            .prop_map(|(cum_tsn, a_rwnd, gaps, dups)| Chunk::Sack(Sack {
                cum_tsn,
                a_rwnd,
                gaps,
                dups
            })),
        bytes(40).prop_map(Chunk::Heartbeat),
        bytes(40).prop_map(Chunk::HeartbeatAck),
        (any::<bool>(), bytes(20))
            .prop_map(|(reflected, causes)| Chunk::Abort { reflected, causes }),
        any::<u32>().prop_map(|cum_tsn| Chunk::Shutdown { cum_tsn }),
        Just(Chunk::ShutdownAck),
        bytes(20).prop_map(|causes| Chunk::Error { causes }),
        bytes(60).prop_map(Chunk::CookieEcho),
        Just(Chunk::CookieAck),
        any::<bool>().prop_map(|reflected| Chunk::ShutdownComplete { reflected }),
        (
            any::<u8>().prop_filter("unknown", move |t| !known.contains(t)),
            any::<u8>(),
            bytes(30)
        )
            .prop_map(|(ty, flags, value)| Chunk::Unknown { ty, flags, value }),
    ]
}

proptest! {
    #[test]
    fn packets_round_trip(
        ports in any::<(u16, u16)>(),
        tag in any::<u32>(),
        chunks in prop::collection::vec(chunk(), 1..6),
    ) {
        let p = Packet::new(ports.0, ports.1, tag, chunks);
        let wire = p.encode();
        prop_assert_eq!(wire.len() % 4, 0);
        prop_assert_eq!(Packet::decode(&wire).unwrap(), p);
    }

    #[test]
    fn any_bytes_with_a_right_checksum_decode_or_fail_cleanly(
        body in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut p = vec![0u8; 12];
        p.extend_from_slice(&body);
        let sum = checksum(&p);
        p[8..12].copy_from_slice(&sum.to_le_bytes());
        let _ = Packet::decode(&p);
    }

    #[test]
    fn a_chunk_cut_anywhere_is_an_error_not_a_panic(c in chunk(), cut in 0usize..200) {
        let wire = Packet::new(1, 2, 3, vec![c]).encode();
        let cut = cut.min(wire.len());
        let mut p = wire[..cut].to_vec();
        if p.len() >= 12 {
            let sum = checksum(&p);
            p[8..12].copy_from_slice(&sum.to_le_bytes());
        }
        let _ = Packet::decode(&p);
    }
}
