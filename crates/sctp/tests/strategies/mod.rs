//! Generated SCTP chunks and INIT parameters, every kind, for the property tests.
#![allow(dead_code)]

use bytes::Bytes;
use proptest::prelude::*;
use rserpool_sctp::chunk::param;
use rserpool_sctp::{Chunk, Data, Init, InitParam, Sack};
use std::net::{Ipv4Addr, Ipv6Addr};

pub fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

pub fn init_param() -> impl Strategy<Value = InitParam> {
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

pub fn init() -> impl Strategy<Value = Init> {
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

pub fn chunk() -> impl Strategy<Value = Chunk> {
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
