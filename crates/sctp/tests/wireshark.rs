//! Independent check of the packet encoder with Wireshark's SCTP dissector: packets of every
//! chunk type are written as a capture of SCTP over UDP port 9899 (RFC 6951, as rsplib's
//! sctplib sends it), and tshark, told to verify CRC32c, must find every checksum good, no
//! malformed packet, and the fields we meant.
//!
//! Without tshark/text2pcap on PATH the test prints a SKIPPED line and passes, unless `CI` is
//! set.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use rserpool_sctp::{Chunk, Data, Init, InitParam, Packet, Sack};
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

fn tools() -> bool {
    let here = |t: &str| {
        Command::new(t)
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    if here("tshark") && here("text2pcap") {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but tshark/text2pcap are missing (apt-get install tshark)"
    );
    eprintln!("SKIPPED: tshark not installed");
    false
}

/// An ASAP DEREGISTRATION, for Wireshark's ASAP dissector behind PPID 11.
fn asap() -> Bytes {
    use rserpool_wire::{AsapMessage, Message, PoolHandle};
    let m = AsapMessage::Deregistration {
        pool_handle: PoolHandle::new(&b"EchoPool"[..]),
        pe_id: 0x1234,
    };
    Bytes::from(m.to_bytes().unwrap())
}

fn packets() -> Vec<Packet> {
    let init = Init {
        initiate_tag: 0x0102_0304,
        a_rwnd: 131_072,
        outbound_streams: 10,
        inbound_streams: 2048,
        initial_tsn: 0x0a0b_0c0d,
        params: vec![
            InitParam::Ipv4(Ipv4Addr::new(192, 0, 2, 1)),
            InitParam::Ipv4(Ipv4Addr::new(198, 51, 100, 1)),
            InitParam::SupportedAddressTypes(vec![5]),
            InitParam::Ecn,
            InitParam::ForwardTsn,
        ],
    };
    let mut ack = init.clone();
    ack.initiate_tag = 0x0506_0708;
    ack.params.push(InitParam::StateCookie(Bytes::from_static(
        b"a cookie of 21 bytes.",
    )));
    vec![
        Packet::new(9899, 9899, 0, vec![Chunk::Init(init)]),
        Packet::new(9899, 9899, 0x0102_0304, vec![Chunk::InitAck(ack)]),
        Packet::new(
            9899,
            9899,
            0x0506_0708,
            vec![
                Chunk::CookieEcho(Bytes::from_static(b"a cookie of 21 bytes.")),
                Chunk::Data(Data {
                    tsn: 0x0a0b_0c0d,
                    stream: 0,
                    ssn: 0,
                    ppid: 11,
                    unordered: false,
                    begin: true,
                    end: true,
                    immediate: false,
                    payload: asap(),
                }),
            ],
        ),
        Packet::new(
            9899,
            9899,
            0x0102_0304,
            vec![
                Chunk::CookieAck,
                Chunk::Sack(Sack {
                    cum_tsn: 0x0a0b_0c0d,
                    a_rwnd: 131_072,
                    gaps: vec![(2, 3), (5, 5)],
                    dups: vec![0x0a0b_0c0d],
                }),
            ],
        ),
        Packet::new(
            9899,
            9899,
            7,
            vec![Chunk::Heartbeat(Bytes::from_static(b"path 1, t=17"))],
        ),
        Packet::new(
            9899,
            9899,
            7,
            vec![Chunk::HeartbeatAck(Bytes::from_static(b"path 1, t=17"))],
        ),
        Packet::new(9899, 9899, 7, vec![Chunk::Shutdown { cum_tsn: 99 }]),
        Packet::new(9899, 9899, 7, vec![Chunk::ShutdownAck]),
        Packet::new(
            9899,
            9899,
            7,
            vec![Chunk::ShutdownComplete { reflected: false }],
        ),
        Packet::new(
            9899,
            9899,
            7,
            vec![Chunk::Abort {
                reflected: true,
                causes: Bytes::new(),
            }],
        ),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn wireshark_finds_every_checksum_good_and_every_field_as_meant() {
    if !tools() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("rserpool-sctp-wireshark-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut dump = String::new();
    for p in packets() {
        for (i, line) in p.encode().chunks(16).enumerate() {
            write!(dump, "{:06x}", i * 16).unwrap();
            for b in line {
                write!(dump, " {b:02x}").unwrap();
            }
            dump.push('\n');
        }
        dump.push('\n');
    }
    let (txt, pcap) = (dir.join("sctp.txt"), dir.join("sctp.pcap"));
    std::fs::write(&txt, dump).unwrap();
    let ok = Command::new("text2pcap")
        .args(["-q", "-u", "9899,9899"])
        .arg(&txt)
        .arg(&pcap)
        .status()
        .unwrap();
    assert!(ok.success());
    let out = Command::new("tshark")
        .env("WIRESHARK_CONFIG_DIR", &dir)
        .args(["-n", "-r"])
        .arg(&pcap)
        .args([
            "-o",
            "sctp.checksum:CRC-32C",
            "-T",
            "fields",
            "-E",
            "separator=|",
        ])
        .args([
            "-e",
            "sctp.checksum.status",
            "-e",
            "sctp.chunk_type",
            "-e",
            "_ws.malformed",
        ])
        .args([
            "-e",
            "sctp.verification_tag",
            "-e",
            "sctp.init_initiate_tag",
        ])
        .args([
            "-e",
            "sctp.parameter_ipv4_address",
            "-e",
            "sctp.data_payload_proto_id",
        ])
        .args(["-e", "sctp.sack_gap_block_start", "-e", "sctp.sack_a_rwnd"])
        .args([
            "-e",
            "sctp.initack_initiate_tag",
            "-e",
            "sctp.parameter_state_cookie",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split('|').collect()).collect();
    assert_eq!(lines.len(), packets().len(), "{text}");
    let want_types = ["1", "2", "10,0", "11,3", "4", "5", "7", "8", "14", "6"];
    for (i, (l, want)) in lines.iter().zip(want_types).enumerate() {
        // Checksum status 1: good (2 would be bad, empty: not verified).
        assert_eq!(l[0], "1", "packet {i}: checksum not good: {text}");
        assert_eq!(l[1], want, "packet {i}: chunk types: {text}");
        assert_eq!(l[2], "", "packet {i} malformed: {text}");
    }
    assert_eq!(lines[0][3], "0x00000000");
    assert_eq!(lines[0][4], "0x01020304");
    assert_eq!(lines[0][5], "192.0.2.1,198.51.100.1");
    assert_eq!(lines[1][9], "0x05060708");
    assert_eq!(lines[1][10], hex(b"a cookie of 21 bytes."));
    assert_eq!(lines[2][6], "11", "ASAP's PPID");
    assert_eq!(lines[3][7], "2,5");
    assert_eq!(lines[3][8], "131072", "{text}");
}
