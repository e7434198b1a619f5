//! Property tests for the codec: every valid message survives encode → decode unchanged, in both
//! the RFC's length convention and rsplib's; the decoders are total (no panic on any input,
//! including mutated valid encodings); and the [`Framer`] reassembles back-to-back messages from
//! any chunking of the stream.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

use bytes::Bytes;
use proptest::collection::vec;
use proptest::option::of as opt;
use proptest::prelude::*;
use proptest::sample::Index;
use rserpool_wire::enrp::UpdateAction;
use rserpool_wire::framer::MAX_MESSAGE_SIZE;
use rserpool_wire::policy::policy_type as pt;
use rserpool_wire::*;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

// ---------------------------------------------------------------------------------------------
// Strategies for valid values

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

/// 0..40 bytes; the empty handle is legal on the wire (a Pool Handle TLV of length 4).
fn pool_handle() -> impl Strategy<Value = PoolHandle> {
    prop_oneof![
        1 => Just(PoolHandle::default()),
        9 => bytes(40).prop_map(PoolHandle::new),
    ]
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|a| IpAddr::V4(Ipv4Addr::from(a))),
        any::<[u8; 16]>().prop_map(|a| IpAddr::V6(Ipv6Addr::from(a))),
    ]
}

/// The Transport Use / reserved field: mostly the defined values, sometimes anything.
fn use_field() -> impl Strategy<Value = u16> {
    prop_oneof![3 => 0u16..=1, 1 => any::<u16>()]
}

fn protocol() -> impl Strategy<Value = Protocol> {
    prop_oneof![
        3 => use_field().prop_map(|transport_use| Protocol::Sctp { transport_use }),
        1 => use_field().prop_map(|reserved| Protocol::Tcp { reserved }),
        1 => use_field().prop_map(|reserved| Protocol::Udp { reserved }),
        1 => use_field().prop_map(|reserved| Protocol::UdpLite { reserved }),
        1 => (use_field(), any::<u32>())
            .prop_map(|(reserved, service_code)| Protocol::Dccp { reserved, service_code }),
    ]
}

/// SCTP carries 1..3 (mixed v4/v6) addresses; the other transports exactly one.
fn transport_address() -> impl Strategy<Value = TransportAddress> {
    protocol().prop_flat_map(|protocol| {
        let n = match protocol {
            Protocol::Sctp { .. } => 1..4,
            _ => 1..2,
        };
        (any::<u16>(), vec(ip(), n)).prop_map(move |(port, addresses)| TransportAddress {
            protocol,
            port,
            addresses: addresses.into(),
        })
    })
}

fn sctp_transport() -> impl Strategy<Value = TransportAddress> {
    (use_field(), any::<u16>(), vec(ip(), 1..4)).prop_map(|(transport_use, port, addresses)| {
        TransportAddress {
            protocol: Protocol::Sctp { transport_use },
            port,
            addresses: addresses.into(),
        }
    })
}

fn user_transport() -> impl Strategy<Value = UserTransport> {
    prop_oneof![
        5 => transport_address().prop_map(UserTransport::Address),
        1 => bytes(20).prop_map(UserTransport::Opaque),
    ]
}

/// Every policy type the decoder maps to a named variant, plus the two invalid values.
const KNOWN_OR_INVALID_POLICY_TYPES: [u32; 19] = [
    pt::CREDITS,
    pt::ROUND_ROBIN,
    pt::WEIGHTED_ROUND_ROBIN,
    pt::RANDOM,
    pt::WEIGHTED_RANDOM,
    pt::PRIORITY,
    pt::LEAST_USED,
    pt::LEAST_USED_DEGRADATION,
    pt::PRIORITY_LEAST_USED,
    pt::RANDOMIZED_LEAST_USED,
    pt::RANDOMIZED_PRIORITY_LEAST_USED,
    pt::RANDOMIZED_LEAST_USED_DEGRADATION,
    pt::PRIORITY_LEAST_USED_DEGRADATION,
    pt::RANDOMIZED_PRIORITY_LEAST_USED_DEGRADATION,
    pt::WEIGHTED_RANDOM_DPF,
    pt::LEAST_USED_DPF,
    pt::LEAST_USED_DEGRADATION_DPF,
    0,
    pt::ADAPTIVE,
];

/// A policy type that is neither known nor invalid, often close to the known ones.
fn other_policy_type() -> impl Strategy<Value = u32> {
    prop_oneof![
        any::<u32>(),
        0u32..16,
        0x4000_0000u32..0x4000_0010,
        0xb000_1000u32..0xb000_1010,
        0xb000_2000u32..0xb000_2010,
    ]
    .prop_filter("known or invalid policy type", |t| {
        !KNOWN_OR_INVALID_POLICY_TYPES.contains(t)
    })
}

/// Policy::Other with data a multiple of 4 bytes (every RFC 5356 field is 32 bits).
fn other_policy() -> impl Strategy<Value = Policy> {
    (other_policy_type(), vec(any::<[u8; 4]>(), 0..4)).prop_map(|(policy_type, words)| {
        Policy::Other {
            policy_type,
            data: words.concat().into(),
        }
    })
}

fn policy() -> impl Strategy<Value = Policy> {
    let u = any::<u32>;
    prop_oneof![
        Just(Policy::RoundRobin),
        u().prop_map(|weight| Policy::WeightedRoundRobin { weight }),
        Just(Policy::Random),
        u().prop_map(|weight| Policy::WeightedRandom { weight }),
        u().prop_map(|priority| Policy::Priority { priority }),
        u().prop_map(|load| Policy::LeastUsed { load }),
        (u(), u())
            .prop_map(|(load, degradation)| Policy::LeastUsedDegradation { load, degradation }),
        (u(), u()).prop_map(|(load, degradation)| Policy::PriorityLeastUsed { load, degradation }),
        u().prop_map(|load| Policy::RandomizedLeastUsed { load }),
        (u(), u()).prop_map(|(load, degradation)| Policy::RandomizedPriorityLeastUsed {
            load,
            degradation
        }),
        (u(), u()).prop_map(
            |(load, degradation)| Policy::RandomizedLeastUsedDegradation { load, degradation }
        ),
        (u(), u()).prop_map(|(load, degradation)| Policy::PriorityLeastUsedDegradation {
            load,
            degradation
        }),
        (u(), u()).prop_map(|(load, degradation)| {
            Policy::RandomizedPriorityLeastUsedDegradation { load, degradation }
        }),
        (u(), u(), u()).prop_map(|(weight, weight_dpf, distance)| Policy::WeightedRandomDpf {
            weight,
            weight_dpf,
            distance
        }),
        (u(), u(), u()).prop_map(|(load, load_dpf, distance)| Policy::LeastUsedDpf {
            load,
            load_dpf,
            distance
        }),
        (u(), u(), u(), u()).prop_map(|(load, degradation, load_dpf, distance)| {
            Policy::LeastUsedDegradationDpf {
                load,
                degradation,
                load_dpf,
                distance,
            }
        }),
        (u(), u()).prop_map(|(credits, capacity)| Policy::Credits { credits, capacity }),
        other_policy(),
    ]
}

fn pool_element() -> impl Strategy<Value = PoolElement> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<i32>(),
        user_transport(),
        policy(),
        opt(sctp_transport()),
    )
        .prop_map(
            |(id, home_registrar, registration_life, user_transport, policy, asap_transport)| {
                PoolElement {
                    id,
                    home_registrar,
                    registration_life,
                    user_transport,
                    policy,
                    asap_transport,
                }
            },
        )
}

/// 1..3 causes, any code, info of any length 0..20 (so every padding length occurs).
fn operation_error() -> impl Strategy<Value = OperationError> {
    vec(
        (any::<u16>(), bytes(20)).prop_map(|(c, info)| ErrorCause::with_info(CauseCode(c), info)),
        1..4,
    )
    .prop_map(|causes| OperationError { causes })
}

fn server_information() -> impl Strategy<Value = ServerInformation> {
    (any::<u32>(), sctp_transport()).prop_map(|(server_id, transport)| ServerInformation {
        server_id,
        transport,
    })
}

fn asap_message() -> impl Strategy<Value = AsapMessage> {
    use AsapMessage as M;
    let b = any::<bool>;
    prop_oneof![
        (pool_handle(), pool_element()).prop_map(|(pool_handle, pool_element)| {
            M::Registration {
                pool_handle,
                pool_element,
            }
        }),
        (pool_handle(), any::<u32>())
            .prop_map(|(pool_handle, pe_id)| M::Deregistration { pool_handle, pe_id }),
        (b(), pool_handle(), any::<u32>(), opt(operation_error())).prop_map(
            |(reject, pool_handle, pe_id, error)| M::RegistrationResponse {
                reject,
                pool_handle,
                pe_id,
                error
            }
        ),
        (pool_handle(), any::<u32>(), opt(operation_error())).prop_map(
            |(pool_handle, pe_id, error)| M::DeregistrationResponse {
                pool_handle,
                pe_id,
                error
            }
        ),
        (b(), pool_handle(), opt(any::<u32>())).prop_map(|(subscribe, pool_handle, items)| {
            M::HandleResolution {
                subscribe,
                pool_handle,
                items,
            }
        }),
        (
            b(),
            pool_handle(),
            opt(policy()),
            vec(pool_element(), 0..4),
            opt(operation_error())
        )
            .prop_map(|(accept, pool_handle, policy, pool_elements, error)| {
                M::HandleResolutionResponse {
                    accept,
                    pool_handle,
                    policy,
                    pool_elements,
                    error,
                }
            }),
        (b(), any::<u32>(), pool_handle(), opt(any::<u32>())).prop_map(
            |(home, server_id, pool_handle, pe_id)| M::EndpointKeepAlive {
                home,
                server_id,
                pool_handle,
                pe_id
            }
        ),
        (pool_handle(), any::<u32>())
            .prop_map(|(pool_handle, pe_id)| M::EndpointKeepAliveAck { pool_handle, pe_id }),
        (pool_handle(), any::<u32>())
            .prop_map(|(pool_handle, pe_id)| M::EndpointUnreachable { pool_handle, pe_id }),
        (any::<u32>(), vec(transport_address(), 0..4)).prop_map(|(server_id, transports)| {
            M::ServerAnnounce {
                server_id,
                transports,
            }
        }),
        bytes(64).prop_map(|cookie| M::Cookie { cookie }),
        bytes(64).prop_map(|cookie| M::CookieEcho { cookie }),
        (pool_handle(), opt(policy()), vec(pool_element(), 0..4)).prop_map(
            |(pool_handle, policy, pool_elements)| M::BusinessCard {
                pool_handle,
                policy,
                pool_elements
            }
        ),
        operation_error().prop_map(|error| M::Error { error }),
    ]
}

fn enrp_body() -> impl Strategy<Value = EnrpBody> {
    use EnrpBody as B;
    let b = any::<bool>;
    let pool_entry =
        (pool_handle(), vec(pool_element(), 0..3)).prop_map(|(pool_handle, pool_elements)| {
            PoolEntry {
                pool_handle,
                pool_elements,
            }
        });
    prop_oneof![
        (b(), opt(any::<u16>()), opt(server_information())).prop_map(
            |(reply_required, checksum, server_info)| B::Presence {
                reply_required,
                checksum,
                server_info
            }
        ),
        b().prop_map(|own_children_only| B::HandleTableRequest { own_children_only }),
        (b(), b(), vec(pool_entry, 0..4)).prop_map(|(reject, more, pools)| {
            B::HandleTableResponse {
                reject,
                more,
                pools,
            }
        }),
        (
            b(),
            prop_oneof![Just(UpdateAction::AddPe), Just(UpdateAction::DelPe)],
            pool_handle(),
            pool_element()
        )
            .prop_map(|(takeover_suggested, action, pool_handle, pool_element)| {
                B::HandleUpdate {
                    takeover_suggested,
                    action,
                    pool_handle,
                    pool_element,
                }
            }),
        Just(B::ListRequest),
        (b(), vec(server_information(), 0..4))
            .prop_map(|(reject, servers)| B::ListResponse { reject, servers }),
        any::<u32>().prop_map(|target| B::InitTakeover { target }),
        any::<u32>().prop_map(|target| B::InitTakeoverAck { target }),
        any::<u32>().prop_map(|target| B::TakeoverServer { target }),
        operation_error().prop_map(|error| B::Error { error }),
    ]
}

fn enrp_message() -> impl Strategy<Value = EnrpMessage> {
    (any::<u32>(), any::<u32>(), enrp_body()).prop_map(|(sender, receiver, body)| EnrpMessage {
        sender,
        receiver,
        body,
    })
}

/// Either protocol, tagged, so one test can mix them.
#[derive(Debug, Clone)]
enum Msg {
    Asap(AsapMessage),
    Enrp(EnrpMessage),
}

impl Msg {
    fn to_bytes(&self) -> Vec<u8> {
        match self {
            Msg::Asap(m) => m.to_bytes().unwrap(),
            Msg::Enrp(m) => m.to_bytes().unwrap(),
        }
    }
}

fn any_msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        asap_message().prop_map(Msg::Asap),
        enrp_message().prop_map(Msg::Enrp),
    ]
}

// ---------------------------------------------------------------------------------------------
// Helpers

fn header_length(b: &[u8]) -> usize {
    usize::from(u16::from_be_bytes([b[2], b[3]]))
}

/// The framing invariants of an encoding: padded to 4, and the length field counts everything
/// but that final padding (at most 3 bytes).
fn check_framing(b: &[u8], ty: u8) -> Result<(), TestCaseError> {
    prop_assert!(b.len() >= 4);
    prop_assert_eq!(b.len() % 4, 0, "encoded length not a multiple of 4");
    prop_assert_eq!(b[0], ty, "type byte");
    let len = header_length(b);
    prop_assert!(len <= b.len(), "length field {} > encoded {}", len, b.len());
    prop_assert!(
        len + 4 > b.len(),
        "length field {} too short for {}",
        len,
        b.len()
    );
    prop_assert!(b[len..].iter().all(|&x| x == 0), "padding is not zero");
    Ok(())
}

fn be16(b: &[u8], at: usize) -> usize {
    usize::from(u16::from_be_bytes([b[at], b[at + 1]]))
}

/// Bytes before the first TLV inside a container parameter, or `None` for a leaf parameter.
fn container_prefix(ptype: u16) -> Option<usize> {
    match ptype {
        0x0003 => Some(8),          // DCCP: port, reserved, service code
        0x0004..=0x0007 => Some(4), // SCTP/TCP/UDP/UDP-Lite: port, use/reserved
        0x000a => Some(12),         // Pool Element: id, home, life
        0x000b => Some(4),          // Server Information: server id
        0x000c => Some(0),          // Operation Error: causes (TLV-shaped leaves)
        _ => None,
    }
}

/// Rewrites, in place, the lengths of every container TLV in `b[start..end]` the rsplib way:
/// the length includes the padding of the last nested parameter. Byte count is unchanged.
fn rsplibify_tlvs(b: &mut [u8], start: usize, end: usize) {
    let mut pos = start;
    while pos + 4 <= end {
        let ptype = u16::from_be_bytes([b[pos], b[pos + 1]]);
        let len = be16(b, pos + 2);
        let padded = len.next_multiple_of(4);
        if let Some(prefix) = container_prefix(ptype) {
            if ptype != 0x000c {
                rsplibify_tlvs(b, pos + 4 + prefix, pos + padded);
            }
            b[pos + 2..pos + 4].copy_from_slice(&(padded as u16).to_be_bytes());
        }
        pos += padded;
    }
}

/// The same message as rsplib would frame it: message and container lengths include the
/// padding of their last parameter.
fn rsplib_style(encoded: &[u8], prefix: usize) -> Vec<u8> {
    let mut b = encoded.to_vec();
    let n = b.len();
    if let Some(p) = prefix.checked_add(4).filter(|p| *p <= n) {
        rsplibify_tlvs(&mut b, p, n);
    }
    b[2..4].copy_from_slice(&(n as u16).to_be_bytes());
    b
}

/// Bytes between the header and the first TLV of an ASAP message.
fn asap_prefix(m: &AsapMessage) -> usize {
    match m {
        AsapMessage::EndpointKeepAlive { .. } | AsapMessage::ServerAnnounce { .. } => 4,
        _ => 0,
    }
}

fn enrp_prefix(m: &EnrpMessage) -> usize {
    match m.body {
        EnrpBody::HandleUpdate { .. } => 12,
        // No TLVs at all: point past the end.
        EnrpBody::InitTakeover { .. }
        | EnrpBody::InitTakeoverAck { .. }
        | EnrpBody::TakeoverServer { .. } => usize::MAX - 4,
        _ => 8,
    }
}

/// Decodes with both decoders (and the reporting variants); must never panic. When one
/// succeeds, its re-encoding must decode to the same message (decoding is a normal form).
fn decode_everything(b: &[u8]) -> Result<(), TestCaseError> {
    let mut report = Vec::new();
    if let Ok(m) = AsapMessage::decode_with_report(b, &mut report) {
        let again = AsapMessage::decode(&m.to_bytes().unwrap());
        prop_assert_eq!(again.as_ref(), Ok(&m), "ASAP re-encoding of {:02x?}", b);
    }
    let _ = AsapMessage::decode(b);
    if let Ok(m) = EnrpMessage::decode_with_report(b, &mut report) {
        let again = EnrpMessage::decode(&m.to_bytes().unwrap());
        prop_assert_eq!(again.as_ref(), Ok(&m), "ENRP re-encoding of {:02x?}", b);
    }
    let _ = EnrpMessage::decode(b);
    let _ = peek_header(b);
    let mut f = Framer::new(MAX_MESSAGE_SIZE);
    f.extend(b);
    while let Ok(Some(_)) = f.next_message() {}
    Ok(())
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(Index, u8),
    Set(Index, u8),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    /// Sets the header length to the buffer's length, so the body is parsed at all.
    FixLength,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 1u8..).prop_map(|(i, m)| Mutation::Flip(i, m)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        2 => (any::<Index>(), vec(any::<u8>(), 1..9)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        2 => (any::<Index>(), 1usize..9).prop_map(|(i, n)| Mutation::Delete(i, n)),
        2 => Just(Mutation::FixLength),
    ]
}

fn apply(b: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Flip(i, mask) if !b.is_empty() => {
            let i = i.index(b.len());
            b[i] ^= mask;
        }
        Mutation::Set(i, v) if !b.is_empty() => {
            let i = i.index(b.len());
            b[i] = *v;
        }
        Mutation::Truncate(i) => b.truncate(i.index(b.len() + 1)),
        Mutation::Insert(i, v) => {
            let i = i.index(b.len() + 1);
            b.splice(i..i, v.iter().copied());
        }
        Mutation::Delete(i, n) if !b.is_empty() => {
            let i = i.index(b.len());
            b.drain(i..(i + n).min(b.len()));
        }
        Mutation::FixLength if b.len() >= 4 && b.len() <= usize::from(u16::MAX) => {
            let n = b.len() as u16;
            b[2..4].copy_from_slice(&n.to_be_bytes());
        }
        _ => {}
    }
}

/// Splits `stream` into chunks whose sizes cycle through `sizes`.
fn chunks<'a>(stream: &'a [u8], sizes: &[usize]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut rest = stream;
    for &n in sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (a, b) = rest.split_at(n.min(rest.len()));
        out.push(a);
        rest = b;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(768))]

    #[test]
    fn asap_roundtrip(m in asap_message()) {
        let b = m.to_bytes().unwrap();
        check_framing(&b, m.msg_type())?;
        prop_assert_eq!(AsapMessage::decode(&b), Ok(m.clone()));
        // Without the final padding too (the length field says where the message ends).
        prop_assert_eq!(AsapMessage::decode(&b[..header_length(&b)]), Ok(m.clone()));
        // Encoding appends: a (4-byte aligned) prefix in the buffer is kept as it is.
        let mut out = vec![0xee; 8];
        m.encode(&mut out).unwrap();
        prop_assert_eq!(&out[..8], &[0xee; 8][..]);
        prop_assert_eq!(&out[8..], &b[..]);
        // Nothing to report for a message we produced ourselves.
        let mut report = Vec::new();
        AsapMessage::decode_with_report(&b, &mut report).ok();
        prop_assert!(report.is_empty());
    }

    #[test]
    fn enrp_roundtrip(m in enrp_message()) {
        let b = m.to_bytes().unwrap();
        check_framing(&b, m.body.msg_type())?;
        prop_assert_eq!(EnrpMessage::decode(&b), Ok(m.clone()));
        prop_assert_eq!(EnrpMessage::decode(&b[..header_length(&b)]), Ok(m.clone()));
        let mut report = Vec::new();
        EnrpMessage::decode_with_report(&b, &mut report).ok();
        prop_assert!(report.is_empty());
    }

    /// rsplib counts the last parameter's padding in message and container lengths; the
    /// decoders accept that and read the same message.
    #[test]
    fn rsplib_length_convention_decodes_the_same(m in any_msg()) {
        match m {
            Msg::Asap(m) => {
                let b = rsplib_style(&m.to_bytes().unwrap(), asap_prefix(&m));
                prop_assert_eq!(AsapMessage::decode(&b), Ok(m));
            }
            Msg::Enrp(m) => {
                let b = rsplib_style(&m.to_bytes().unwrap(), enrp_prefix(&m));
                prop_assert_eq!(EnrpMessage::decode(&b), Ok(m));
            }
        }
    }

    /// A private policy's data need not be a multiple of 4 bytes; it round-trips with padding.
    #[test]
    fn unaligned_other_policy_roundtrip(
        policy_type in other_policy_type(),
        data in vec(any::<u8>(), 0..15),
        pe in pool_element(),
    ) {
        let policy = Policy::Other { policy_type, data: data.into() };
        let m = AsapMessage::Registration {
            pool_handle: PoolHandle::from("P"),
            pool_element: PoolElement { policy: policy.clone(), ..pe },
        };
        let b = m.to_bytes().unwrap();
        check_framing(&b, m.msg_type())?;
        prop_assert_eq!(AsapMessage::decode(&b), Ok(m));
        let m = AsapMessage::BusinessCard {
            pool_handle: PoolHandle::default(),
            policy: Some(policy),
            pool_elements: vec![],
        };
        let b = m.to_bytes().unwrap();
        check_framing(&b, m.msg_type())?;
        prop_assert_eq!(AsapMessage::decode(&b), Ok(m));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_bytes_never_panic(b in vec(any::<u8>(), 0..300)) {
        decode_everything(&b)?;
    }

    /// Random bodies behind a plausible header (known type, right length), so the parameter
    /// walkers see the bytes instead of failing at the header.
    #[test]
    fn arbitrary_bodies_never_panic(
        ty in prop_oneof![0u8..=16, any::<u8>()],
        flags in any::<u8>(),
        body in vec(any::<u8>(), 0..300),
    ) {
        let mut b = vec![ty, flags, 0, 0];
        b.extend_from_slice(&body);
        let n = b.len() as u16;
        b[2..4].copy_from_slice(&n.to_be_bytes());
        decode_everything(&b)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1536))]

    #[test]
    fn mutated_encodings_never_panic(m in any_msg(), muts in vec(mutation(), 1..6)) {
        let mut b = m.to_bytes();
        for mu in &muts {
            apply(&mut b, mu);
        }
        decode_everything(&b)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    /// Back-to-back messages (each padded or not, as the framer tolerates both), cut into
    /// arbitrary chunks, come back whole and equal.
    #[test]
    fn framer_reassembles_any_chunking(
        msgs in prop_oneof![
            // One protocol per stream, as on a real connection.
            vec((asap_message().prop_map(Msg::Asap), any::<bool>()), 1..6),
            vec((enrp_message().prop_map(Msg::Enrp), any::<bool>()), 1..6),
        ],
        sizes in vec(1usize..48, 1..8),
    ) {
        let mut stream = Vec::new();
        for (m, padded) in &msgs {
            let b = m.to_bytes();
            let n = if *padded { b.len() } else { header_length(&b) };
            stream.extend_from_slice(&b[..n]);
        }
        let mut f = Framer::new(MAX_MESSAGE_SIZE);
        let mut got = Vec::new();
        for c in chunks(&stream, &sizes) {
            f.extend(c);
            while let Some(m) = f.next_message().map_err(|e| TestCaseError::fail(e.to_string()))? {
                got.push(m);
            }
        }
        prop_assert_eq!(got.len(), msgs.len());
        prop_assert_eq!(f.buffered(), 0);
        for (raw, (m, _)) in got.iter().zip(&msgs) {
            match m {
                Msg::Asap(m) => prop_assert_eq!(AsapMessage::decode(raw), Ok(m.clone())),
                Msg::Enrp(m) => prop_assert_eq!(EnrpMessage::decode(raw), Ok(m.clone())),
            }
        }
    }
}

/// Regression: appending after an unaligned prefix once padded to absolute buffer offsets
/// instead of offsets from the message start (found by `asap_roundtrip`).
#[test]
fn encode_appends_after_unaligned_prefix() {
    let m = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::default(),
        items: Some(3),
    };
    let alone = m.to_bytes().unwrap();
    let mut out = vec![0xee; 3];
    m.encode(&mut out).unwrap();
    assert_eq!(&out[3..], &alone[..]);
}

/// The strategies really produce every variant (a guard against a strategy silently
/// collapsing, e.g. through an over-eager filter).
#[test]
fn strategies_cover_every_variant() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use std::collections::BTreeSet;
    let mut runner = TestRunner::deterministic();
    let (asap, enrp) = (asap_message(), enrp_message());
    let (mut a, mut e) = (BTreeSet::new(), BTreeSet::new());
    let mut policies = BTreeSet::new();
    for _ in 0..2000 {
        let m = asap.new_tree(&mut runner).map(|t| t.current());
        if let Ok(m) = m {
            if let AsapMessage::Registration { pool_element, .. } = &m {
                policies.insert(pool_element.policy.short_name());
            }
            a.insert(m.msg_type());
        }
        if let Ok(m) = enrp.new_tree(&mut runner).map(|t| t.current()) {
            e.insert(m.body.msg_type());
        }
    }
    assert_eq!(a, (1..=14).collect::<BTreeSet<u8>>());
    assert_eq!(e, (1..=10).collect::<BTreeSet<u8>>());
    assert_eq!(policies.len(), 18, "{policies:?}");
}

/// A message whose length does not fit 16 bits is refused and leaves the buffer unchanged; one
/// of exactly 65,535 bytes encodes and decodes.
#[test]
fn oversized_messages_are_refused() {
    let cookie = |n: usize| AsapMessage::Cookie {
        cookie: vec![7u8; n].into(),
    };
    let mut out = vec![1, 2, 3];
    assert_eq!(
        cookie(65_528).encode(&mut out),
        Err(rserpool_wire::EncodeError::TooLarge { length: 65_536 })
    );
    assert_eq!(out, [1, 2, 3]);
    let max = cookie(65_527).to_bytes().unwrap();
    assert_eq!(AsapMessage::decode(&max).unwrap(), cookie(65_527));
}

/// Only padding may follow a message in a buffer given to `decode`.
#[test]
fn trailing_bytes_after_a_message_are_refused() {
    let mut b = AsapMessage::Cookie {
        cookie: vec![1u8; 4].into(),
    }
    .to_bytes()
    .unwrap();
    b.extend_from_slice(&[0x0e, 0x00]);
    assert!(AsapMessage::decode(&b).is_err());
}
