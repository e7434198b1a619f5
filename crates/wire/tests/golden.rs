//! Golden byte vectors for every ASAP and ENRP message type, written by hand from the layouts in
//! RFC 5352–5354/5356 (not produced by our encoder), plus the error paths of the decoder.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

use rserpool_wire::enrp::UpdateAction;
use rserpool_wire::*;
use std::net::{IpAddr, Ipv4Addr};

fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s
        .bytes()
        .filter(|b| b.is_ascii_hexdigit())
        .map(|b| (b as char).to_digit(16).unwrap_or(0) as u8)
        .collect();
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

fn ph() -> PoolHandle {
    PoolHandle::from("EchoPool")
}

fn tcp_lo(port: u16) -> TransportAddress {
    TransportAddress {
        protocol: Protocol::TCP,
        port,
        addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
    }
}

fn pe() -> PoolElement {
    PoolElement {
        id: 0x0102_0304,
        home_registrar: 0x0a0b_0c0d,
        registration_life: -1,
        user_transport: UserTransport::Address(tcp_lo(7)),
        policy: Policy::LeastUsed { load: 0x8000_0000 },
        asap_transport: None,
    }
}

const PH: &str = "0009 000c 4563686f 506f6f6c"; // Pool Handle "EchoPool"
const PEID: &str = "000e 0008 01020304"; // PE Identifier
const TCP7: &str = "0005 0010 0007 0000 0001 0008 7f000001"; // TCP 127.0.0.1:7
const LU50: &str = "0008 000c 40000001 80000000"; // Least Used, load 50%
fn pe_param() -> String {
    format!("000a 002c 01020304 0a0b0c0d ffffffff {TCP7} {LU50}")
}

#[track_caller]
fn asap_golden(msg: AsapMessage, bytes: &str) {
    let bytes = hex(bytes);
    assert_eq!(msg.to_bytes().unwrap(), bytes, "encoding of {}", msg.name());
    assert_eq!(AsapMessage::decode(&bytes), Ok(msg), "decoding");
}

#[track_caller]
fn enrp_golden(body: EnrpBody, bytes: &str) {
    let msg = EnrpMessage {
        sender: 0x1111_1111,
        receiver: 0x2222_2222,
        body,
    };
    let bytes = hex(bytes);
    assert_eq!(
        msg.to_bytes().unwrap(),
        bytes,
        "encoding of {}",
        msg.body.name()
    );
    assert_eq!(EnrpMessage::decode(&bytes), Ok(msg), "decoding");
}

#[test]
fn reference_echopool_handle_resolution() {
    let bytes = hex("05 00 00 10 00 09 00 0c 45 63 68 6f 50 6f 6f 6c");
    let msg = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: ph(),
        items: None,
    };
    assert_eq!(msg.to_bytes().unwrap(), bytes);
    assert_eq!(AsapMessage::decode(&bytes).unwrap(), msg);
}

#[test]
fn asap_every_message_type() {
    asap_golden(
        AsapMessage::Registration {
            pool_handle: ph(),
            pool_element: pe(),
        },
        &format!("01 00 003c {PH} {}", pe_param()),
    );
    asap_golden(
        AsapMessage::Deregistration {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &format!("02 00 0018 {PH} {PEID}"),
    );
    asap_golden(
        AsapMessage::RegistrationResponse {
            reject: true,
            pool_handle: ph(),
            pe_id: 0x0102_0304,
            error: Some(OperationError::single(ErrorCause::with_info(
                CauseCode::INCONSISTENT_POOLING_POLICY,
                hex(LU50),
            ))),
        },
        &format!("03 01 002c {PH} {PEID} 000c 0014 0005 0010 {LU50}"),
    );
    asap_golden(
        AsapMessage::DeregistrationResponse {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
            error: None,
        },
        &format!("04 00 0018 {PH} {PEID}"),
    );
    asap_golden(
        AsapMessage::HandleResolution {
            subscribe: true,
            pool_handle: ph(),
            items: Some(3),
        },
        &format!("05 01 0018 {PH} 803f 0008 00000003"),
    );
    let mut pe_with_asap = pe();
    pe_with_asap.asap_transport = Some(tcp_lo(40000));
    asap_golden(
        AsapMessage::HandleResolutionResponse {
            accept: false,
            pool_handle: ph(),
            policy: Some(Policy::LeastUsed { load: 0x8000_0000 }),
            pool_elements: vec![pe_with_asap.clone()],
            error: None,
        },
        &format!(
            "06 00 0058 {PH} {LU50} 000a 003c 01020304 0a0b0c0d ffffffff {TCP7} {LU50} \
             0005 0010 9c40 0000 0001 0008 7f000001"
        ),
    );
    // The borrowed encoder a registrar answers with gives the same bytes.
    let mut borrowed = Vec::new();
    AsapMessage::encode_resolution(
        &mut borrowed,
        false,
        &ph(),
        Some(&Policy::LeastUsed { load: 0x8000_0000 }),
        [&pe_with_asap],
    )
    .unwrap();
    assert_eq!(
        borrowed,
        hex(&format!(
            "06 00 0058 {PH} {LU50} 000a 003c 01020304 0a0b0c0d ffffffff {TCP7} {LU50} \
             0005 0010 9c40 0000 0001 0008 7f000001"
        ))
    );
    asap_golden(
        AsapMessage::HandleResolutionResponse {
            accept: false,
            pool_handle: ph(),
            policy: None,
            pool_elements: vec![],
            error: Some(OperationError::single(ErrorCause::new(
                CauseCode::UNKNOWN_POOL_HANDLE,
            ))),
        },
        &format!("06 00 0018 {PH} 000c 0008 0009 0004"),
    );
    asap_golden(
        AsapMessage::EndpointKeepAlive {
            home: true,
            server_id: 0x1122_3344,
            pool_handle: ph(),
            pe_id: None,
        },
        &format!("07 01 0014 11223344 {PH}"),
    );
    asap_golden(
        AsapMessage::EndpointKeepAliveAck {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &format!("08 00 0018 {PH} {PEID}"),
    );
    asap_golden(
        AsapMessage::EndpointUnreachable {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &format!("09 00 0018 {PH} {PEID}"),
    );
    asap_golden(
        AsapMessage::ServerAnnounce {
            server_id: 0x1122_3344,
            transports: vec![tcp_lo(3863)],
        },
        "0a 00 0018 11223344 0005 0010 0f17 0000 0001 0008 7f000001",
    );
    // Length 11 (RFC style: the last parameter's padding is not counted), then one pad byte.
    asap_golden(
        AsapMessage::Cookie {
            cookie: "abc".into(),
        },
        "0b 00 000b 000d 0007 616263 00",
    );
    asap_golden(
        AsapMessage::CookieEcho {
            cookie: "abc".into(),
        },
        "0c 00 000b 000d 0007 616263 00",
    );
    asap_golden(
        AsapMessage::BusinessCard {
            pool_handle: ph(),
            policy: None,
            pool_elements: vec![pe()],
        },
        &format!("0d 00 003c {PH} {}", pe_param()),
    );
    asap_golden(
        AsapMessage::Error {
            error: OperationError::single(ErrorCause::new(CauseCode::LACK_OF_RESOURCES)),
        },
        "0e 00 000c 000c 0008 0006 0004",
    );
}

#[test]
fn enrp_every_message_type() {
    const IDS: &str = "11111111 22222222";
    let si = ServerInformation {
        server_id: 0x1111_1111,
        transport: TransportAddress {
            protocol: Protocol::SCTP_DATA_CONTROL,
            port: 9901,
            addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
        },
    };
    const SI: &str = "000b 0018 11111111 0004 0010 26ad 0001 0001 0008 7f000001";
    enrp_golden(
        EnrpBody::Presence {
            reply_required: true,
            checksum: Some(0x29a5),
            server_info: Some(si.clone()),
        },
        &format!("01 01 002c {IDS} 000f 0006 29a5 0000 {SI}"),
    );
    // PE checksum last: its 2 padding bytes are not counted in the message length.
    enrp_golden(
        EnrpBody::Presence {
            reply_required: false,
            checksum: Some(0xffff),
            server_info: None,
        },
        &format!("01 00 0012 {IDS} 000f 0006 ffff 0000"),
    );
    enrp_golden(
        EnrpBody::HandleTableRequest {
            own_children_only: true,
        },
        &format!("02 01 000c {IDS}"),
    );
    enrp_golden(
        EnrpBody::HandleTableResponse {
            reject: false,
            more: true,
            pools: vec![PoolEntry {
                pool_handle: ph(),
                pool_elements: vec![pe()],
            }],
        },
        &format!("03 02 0044 {IDS} {PH} {}", pe_param()),
    );
    enrp_golden(
        EnrpBody::HandleUpdate {
            takeover_suggested: false,
            action: UpdateAction::DelPe,
            pool_handle: ph(),
            pool_element: pe(),
        },
        &format!("04 00 0048 {IDS} 0001 0000 {PH} {}", pe_param()),
    );
    enrp_golden(EnrpBody::ListRequest, &format!("05 00 000c {IDS}"));
    enrp_golden(
        EnrpBody::ListResponse {
            reject: true,
            servers: vec![],
        },
        &format!("06 01 000c {IDS}"),
    );
    enrp_golden(
        EnrpBody::ListResponse {
            reject: false,
            servers: vec![si],
        },
        &format!("06 00 0024 {IDS} {SI}"),
    );
    enrp_golden(
        EnrpBody::InitTakeover {
            target: 0x3333_3333,
        },
        &format!("07 00 0010 {IDS} 33333333"),
    );
    enrp_golden(
        EnrpBody::InitTakeoverAck {
            target: 0x3333_3333,
        },
        &format!("08 00 0010 {IDS} 33333333"),
    );
    enrp_golden(
        EnrpBody::TakeoverServer {
            target: 0x3333_3333,
        },
        &format!("09 00 0010 {IDS} 33333333"),
    );
    enrp_golden(
        EnrpBody::Error {
            error: OperationError::single(ErrorCause::new(CauseCode::LACK_OF_RESOURCES)),
        },
        &format!("0a 00 0014 {IDS} 000c 0008 0006 0004"),
    );
}

#[test]
fn every_policy_parameter() {
    let cases: Vec<(Policy, &str)> = vec![
        (Policy::RoundRobin, "0008 0008 00000001"),
        (
            Policy::WeightedRoundRobin { weight: 7 },
            "0008 000c 00000002 00000007",
        ),
        (Policy::Random, "0008 0008 00000003"),
        (
            Policy::WeightedRandom { weight: 9 },
            "0008 000c 00000004 00000009",
        ),
        (
            Policy::Priority { priority: 5 },
            "0008 000c 00000005 00000005",
        ),
        (
            Policy::LeastUsed { load: 0xffff_ffff },
            "0008 000c 40000001 ffffffff",
        ),
        (
            Policy::LeastUsedDegradation {
                load: 1,
                degradation: 2,
            },
            "0008 0010 40000002 00000001 00000002",
        ),
        (
            Policy::PriorityLeastUsed {
                load: 1,
                degradation: 2,
            },
            "0008 0010 40000003 00000001 00000002",
        ),
        (
            Policy::RandomizedLeastUsed { load: 3 },
            "0008 000c 40000004 00000003",
        ),
        (
            Policy::PriorityLeastUsedDegradation {
                load: 1,
                degradation: 2,
            },
            "0008 0010 b0001003 00000001 00000002",
        ),
        (
            Policy::WeightedRandomDpf {
                weight: 1,
                weight_dpf: 2,
                distance: 3,
            },
            "0008 0014 b0002001 00000001 00000002 00000003",
        ),
        (
            Policy::LeastUsedDpf {
                load: 1,
                load_dpf: 2,
                distance: 3,
            },
            "0008 0014 b0002002 00000001 00000002 00000003",
        ),
        (
            Policy::LeastUsedDegradationDpf {
                load: 1,
                degradation: 2,
                load_dpf: 3,
                distance: 4,
            },
            "0008 0018 b0002003 00000001 00000002 00000003 00000004",
        ),
        (
            Policy::Other {
                policy_type: 0xc000_0001,
                data: vec![0xaa, 0xbb, 0xcc, 0xdd].into(),
            },
            "0008 000c c0000001 aabbccdd",
        ),
        (
            Policy::Credits {
                credits: 3,
                capacity: 8,
            },
            "0008 0010 c5a10001 00000003 00000008",
        ),
    ];
    for (policy, bytes) in cases {
        let msg = AsapMessage::HandleResolutionResponse {
            accept: false,
            pool_handle: ph(),
            policy: Some(policy),
            pool_elements: vec![],
            error: None,
        };
        let len = 16 + hex(bytes).len();
        asap_golden(msg, &format!("06 00 {len:04x} {PH} {bytes}"));
    }
}

#[test]
fn rsplib_length_conventions_are_accepted() {
    // rsplib counts the last parameter's padding in the message length (12, not 9) ...
    let rsplib = hex("05 00 000c 0009 0005 50 000000");
    let rfc = hex("05 00 0009 0009 0005 50 000000");
    let a = AsapMessage::decode(&rsplib).unwrap();
    assert_eq!(a, AsapMessage::decode(&rfc).unwrap());
    assert_eq!(a.to_bytes().unwrap(), rfc);
    // ... and sends Priority-LU without its degradation field.
    let plu = hex(&format!("06 00 001c {PH} 0008 000c 40000003 00000010"));
    match AsapMessage::decode(&plu).unwrap() {
        AsapMessage::HandleResolutionResponse { policy, .. } => assert_eq!(
            policy,
            Some(Policy::PriorityLeastUsed {
                load: 0x10,
                degradation: 0
            })
        ),
        other => panic!("{other:?}"),
    }
    // rsplib's keep-alive carries an extra PE Identifier.
    let eka = hex(&format!("07 00 001c 11223344 {PH} {PEID}"));
    assert!(matches!(
        AsapMessage::decode(&eka).unwrap(),
        AsapMessage::EndpointKeepAlive {
            pe_id: Some(0x0102_0304),
            ..
        }
    ));
}

#[test]
fn unknown_message_types_by_top_bits() {
    // 0x45: top bits 01 → discard and report Unrecognized Message with the message.
    let m = hex(&format!("45 00 0010 {PH}"));
    let e = AsapMessage::decode(&m).unwrap_err();
    assert_eq!(e.kind, DecodeErrorKind::UnknownMessage(0x45));
    let cause = e.cause.unwrap();
    assert_eq!(cause.code, CauseCode::UNRECOGNIZED_MESSAGE);
    assert_eq!(&cause.info[..], &m[..]);
    // 0x0f: top bits 00 → discard silently.
    let e = AsapMessage::decode(&hex(&format!("0f 00 0010 {PH}"))).unwrap_err();
    assert_eq!(e.cause, None);
    // ENRP 0x0b is unknown too.
    let e = EnrpMessage::decode(&hex("4b 00 000c 00000001 00000000")).unwrap_err();
    assert_eq!(e.cause.unwrap().code, CauseCode::UNRECOGNIZED_MESSAGE);
}

#[test]
fn unknown_parameters_by_top_bits() {
    let with = |t: &str| hex(&format!("05 00 0018 {PH} {t} 0008 deadbeef"));
    // 00: stop, discard silently.
    let e = AsapMessage::decode(&with("0077")).unwrap_err();
    assert_eq!(e.kind, DecodeErrorKind::UnrecognizedParameter(0x0077));
    assert_eq!(e.cause, None);
    // 01: stop, discard, report the whole TLV.
    let e = AsapMessage::decode(&with("4077")).unwrap_err();
    let c = e.cause.unwrap();
    assert_eq!(c.code, CauseCode::UNRECOGNIZED_PARAMETER);
    assert_eq!(&c.info[..], &hex("4077 0008 deadbeef")[..]);
    // 10: skip and continue.
    let mut report = Vec::new();
    let m = AsapMessage::decode_with_report(&with("8077"), &mut report).unwrap();
    assert!(matches!(m, AsapMessage::HandleResolution { .. }));
    assert!(report.is_empty());
    // 11: skip, continue, report.
    AsapMessage::decode_with_report(&with("c077"), &mut report).unwrap();
    assert_eq!(report.len(), 1);
    assert_eq!(report[0].code, CauseCode::UNRECOGNIZED_PARAMETER);
}

#[test]
fn malformed_input_gives_typed_errors() {
    let invalid = |b: &[u8]| {
        let e = AsapMessage::decode(b).unwrap_err();
        (e.kind.clone(), e.cause.map(|c| c.code))
    };
    // Truncated header and truncated body.
    assert!(matches!(
        invalid(&hex("05 00")).0,
        DecodeErrorKind::Truncated { .. }
    ));
    assert!(matches!(
        invalid(&hex("05 00 0010 0009 000c 4563")).0,
        DecodeErrorKind::Truncated { .. }
    ));
    // Message length below the header.
    assert_eq!(
        invalid(&hex("05 00 0002")).0,
        DecodeErrorKind::BadMessageLength(2)
    );
    // Parameter longer than the message: Invalid Values.
    let (k, c) = invalid(&hex("05 00 000c 0009 00ff 41424344"));
    assert_eq!(k, DecodeErrorKind::ParameterOverrun { ptype: 9 });
    assert_eq!(c, Some(CauseCode::INVALID_VALUES));
    // Parameter length below 4.
    let (k, _) = invalid(&hex("05 00 0008 0009 0002"));
    assert!(matches!(k, DecodeErrorKind::BadParameterLength { .. }));
    // Missing mandatory pool handle.
    let (k, c) = invalid(&hex("05 00 0004"));
    assert_eq!(k, DecodeErrorKind::MissingParameter("Pool Handle"));
    assert_eq!(c, Some(CauseCode::INVALID_VALUES));
    // Policy too short for its fields (LU without load).
    let (k, c) = invalid(&hex(&format!("06 00 0018 {PH} 0008 0008 40000001")));
    assert_eq!(k, DecodeErrorKind::InvalidValue("policy"));
    assert_eq!(c, Some(CauseCode::INVALID_VALUES));
    // A transport without an address.
    let (_, c) = invalid(&hex("0a 00 0010 00000001 0005 0008 0007 0000"));
    assert_eq!(c, Some(CauseCode::INVALID_VALUES));
    // Non-zero garbage after the last parameter.
    let (k, _) = invalid(&hex(&format!("05 00 0012 {PH} 0102")));
    assert_eq!(k, DecodeErrorKind::TrailingGarbage);
    // Bad HANDLE_UPDATE action.
    let e = EnrpMessage::decode(&hex("04 00 0010 00000001 00000000 00070000")).unwrap_err();
    assert_eq!(e.cause.unwrap().code, CauseCode::INVALID_VALUES);
}

/// How `rserpool resolve` and the logs show the credits policy.
#[test]
fn credits_display_as_credits_of_capacity() {
    let p = Policy::Credits {
        credits: 3,
        capacity: 8,
    };
    assert_eq!(p.to_string(), "credits credits=3/8");
}
