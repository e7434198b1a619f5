//! Independent check of the encoder with Wireshark's ASAP and ENRP dissectors (tshark 4.0).
//!
//! Every ASAP and ENRP message type is encoded with realistic contents, written as a text2pcap
//! hex dump (one packet per message), turned into a capture over UDP (ports 3863/9901) and over
//! SCTP (PPID 11/12), and dissected by tshark. Each packet must be dissected as the right
//! protocol and message type, carry no malformed or expert item, and show the field values we
//! meant to send (pool handles, IDs, checksums, policy types and loads, ...).
//!
//! Without tshark/text2pcap on PATH the tests print a SKIPPED line and pass, unless `CI` is set.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

use rserpool_wire::enrp::UpdateAction;
use rserpool_wire::policy::policy_type as pt;
use rserpool_wire::*;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

// ---------------------------------------------------------------------------------------------
// Tool discovery and temp files

const TOOLS: [&str; 2] = ["tshark", "text2pcap"];

/// True if the tools are installed. Otherwise says so and returns false, or fails under CI.
fn tools_available() -> bool {
    let missing: Vec<&str> = TOOLS
        .into_iter()
        .filter(|t| {
            Command::new(t)
                .arg("-v")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_err()
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    assert!(
        !ci,
        "CI is set but {missing:?} not found on PATH (apt-get install tshark)"
    );
    // Written to the real stderr so it shows even though the test harness captures output.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: tshark not installed (apt-get install tshark); missing {missing:?}"
    );
    false
}

/// A private scratch directory, removed on drop unless the test is failing (then kept, and its
/// path printed, for inspection).
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "rserpool-wire-wireshark-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = writeln!(
                std::io::stderr(),
                "wireshark test files kept in {}",
                self.0.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn run(cmd: &mut Command, config_dir: &Path) -> String {
    // A private configuration directory, so a user's Wireshark preferences cannot interfere.
    cmd.env("WIRESHARK_CONFIG_DIR", config_dir)
        .stdin(Stdio::null());
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    // tshark run as root warns on stderr; stderr only matters when the command failed.
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{cmd:?} printed non-UTF-8: {e}"))
}

/// The text2pcap input: one packet per message, 16 bytes per line behind a hex offset.
fn hexdump(messages: &[Vec<u8>]) -> String {
    let mut s = String::new();
    for m in messages {
        for (i, line) in m.chunks(16).enumerate() {
            s.push_str(&format!("{:06x} ", i * 16));
            for b in line {
                s.push_str(&format!(" {b:02x}"));
            }
            s.push('\n');
        }
        s.push('\n');
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Expected field values

/// One expected value of a tshark field, compared after normalising tshark's notation.
#[derive(Debug, Clone)]
enum V {
    /// An integer; tshark prints it in decimal or 0x-hex depending on the field.
    U(u64),
    /// A floating-point value (loads as percentages, DPFs as fractions).
    Pct(f64),
    /// Raw text: byte fields (lowercase hex, no separators), addresses.
    S(String),
}

impl V {
    fn matches(&self, actual: &str) -> bool {
        match self {
            V::U(n) => {
                let parsed = match actual.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16).ok(),
                    None => actual
                        .parse::<u64>()
                        .ok()
                        .or_else(|| actual.parse::<i64>().ok().map(|v| v as u64)),
                };
                parsed == Some(*n)
            }
            V::Pct(p) => actual.parse::<f64>().is_ok_and(|a| (a - p).abs() < 1e-4),
            V::S(s) => actual == s,
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Loads and degradations: Wireshark shows `100 * v / 0xffffffff` percent.
fn pct(v: u32) -> V {
    V::Pct(100.0 * f64::from(v) / f64::from(u32::MAX))
}

/// The DPF fields of the private policies: Wireshark shows the fraction `v / 0xffffffff`.
fn frac(v: u32) -> V {
    V::Pct(f64::from(v) / f64::from(u32::MAX))
}

fn u(v: impl Into<u64>) -> V {
    V::U(v.into())
}

fn s(v: impl ToString) -> V {
    V::S(v.to_string())
}

/// One packet: the message's bytes and the fields tshark must show for it, with all their
/// occurrences in order.
struct Packet {
    name: String,
    bytes: Vec<u8>,
    expect: Vec<(String, Vec<V>)>,
}

impl Packet {
    fn new(proto: &str, name: &str, ty: u8, bytes: Vec<u8>) -> Self {
        let length = u16::from_be_bytes([bytes[2], bytes[3]]);
        let flags = bytes[1];
        let mut p = Self {
            name: name.to_string(),
            bytes,
            expect: Vec::new(),
        };
        p.field(&format!("{proto}.message_type"), vec![u(ty)]);
        p.field(&format!("{proto}.message_flags"), vec![u(flags)]);
        p.field(&format!("{proto}.message_length"), vec![u(length)]);
        p
    }

    /// Expects `values` (all occurrences, in order) for field `name`, replacing any earlier
    /// expectation for that field.
    fn field(&mut self, name: &str, values: Vec<V>) -> &mut Self {
        self.expect.retain(|(n, _)| n != name);
        self.expect.push((name.to_string(), values));
        self
    }
}

/// Encodes, dissects over UDP and over SCTP, and checks every packet.
fn check_with_tshark(proto: &str, port: u16, ppid: u32, packets: &[Packet]) {
    let dir = Scratch::new(proto);
    let txt = dir.path("messages.txt");
    let messages: Vec<Vec<u8>> = packets.iter().map(|p| p.bytes.clone()).collect();
    std::fs::write(&txt, hexdump(&messages))
        .unwrap_or_else(|e| panic!("writing {}: {e}", txt.display()));

    let mut fields: Vec<String> = vec![
        "frame.number".into(),
        "frame.protocols".into(),
        "_ws.malformed".into(),
        "_ws.expert".into(),
        "_ws.expert.message".into(),
    ];
    for p in packets {
        for (f, _) in &p.expect {
            if !fields.contains(f) {
                fields.push(f.clone());
            }
        }
    }

    let transports: [(&str, Vec<String>); 2] = [
        ("udp", vec!["-u".into(), format!("40000,{port}")]),
        ("sctp", vec!["-S".into(), format!("40000,{port},{ppid}")]),
    ];
    for (transport, args) in transports {
        let pcap = dir.path(&format!("{proto}-{transport}.pcap"));
        run(
            Command::new("text2pcap")
                .arg("-q")
                .args(&args)
                .arg(&txt)
                .arg(&pcap),
            &dir.0,
        );
        let mut cmd = Command::new("tshark");
        cmd.args(["-n", "-r"]).arg(&pcap).args([
            "-T",
            "fields",
            "-E",
            "header=n",
            "-E",
            "separator=/t",
            "-E",
            "occurrence=a",
            "-E",
            "aggregator=|",
        ]);
        for f in &fields {
            cmd.args(["-e", f]);
        }
        let out = run(&mut cmd, &dir.0);
        let rows: Vec<Vec<&str>> = out
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.split('\t').collect())
            .collect();
        assert_eq!(
            rows.len(),
            packets.len(),
            "{transport}: tshark printed {} rows for {} packets:\n{out}",
            rows.len(),
            packets.len()
        );

        let mut failures = Vec::new();
        for (i, (p, row)) in packets.iter().zip(&rows).enumerate() {
            let col = |name: &str| -> &str {
                let j = fields.iter().position(|f| f == name);
                j.and_then(|j| row.get(j)).copied().unwrap_or("")
            };
            let what = format!("{transport} frame {} ({})", i + 1, p.name);
            if col("frame.number") != (i + 1).to_string() {
                failures.push(format!("{what}: rows out of order: {row:?}"));
                continue;
            }
            let protocols = col("frame.protocols");
            if protocols.rsplit(':').next() != Some(proto) {
                failures.push(format!("{what}: dissected as {protocols:?}, not {proto}"));
            }
            for bad in ["_ws.malformed", "_ws.expert", "_ws.expert.message"] {
                if !col(bad).is_empty() {
                    failures.push(format!("{what}: {bad} = {:?}", col(bad)));
                }
            }
            for (f, want) in &p.expect {
                let got: Vec<&str> = match col(f) {
                    "" => Vec::new(),
                    v => v.split('|').collect(),
                };
                let ok =
                    got.len() == want.len() && want.iter().zip(&got).all(|(w, g)| w.matches(g));
                if !ok {
                    failures.push(format!("{what}: {f} = {got:?}, expected {want:?}"));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "tshark disagrees with our encoding:\n  {}",
            failures.join("\n  ")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Realistic messages

fn ph() -> PoolHandle {
    PoolHandle::from("EchoPool")
}

const V4A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const V4B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const V6A: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x10);

fn sctp(port: u16, transport_use: u16, addrs: &[IpAddr]) -> TransportAddress {
    TransportAddress {
        protocol: Protocol::Sctp { transport_use },
        port,
        addresses: addrs.iter().copied().collect(),
    }
}

fn single(protocol: Protocol, port: u16, a: IpAddr) -> TransportAddress {
    TransportAddress {
        protocol,
        port,
        addresses: vec![a].into(),
    }
}

fn pe(id: u32, user: TransportAddress, policy: Policy, asap: bool) -> PoolElement {
    PoolElement {
        id,
        home_registrar: 0x5eed_0001,
        registration_life: 300,
        user_transport: UserTransport::Address(user),
        policy,
        asap_transport: asap.then(|| sctp(3863, 1, &[IpAddr::V4(V4A)])),
    }
}

fn policies() -> Vec<Policy> {
    vec![
        Policy::LeastUsedDegradation {
            load: 0x4000_0000,
            degradation: 0x0100_0000,
        },
        Policy::PriorityLeastUsed {
            load: 0x2000_0000,
            degradation: 0x0200_0000,
        },
        Policy::RandomizedLeastUsed { load: 0xc000_0000 },
        Policy::WeightedRoundRobin { weight: 7 },
        Policy::Priority { priority: 3 },
        Policy::WeightedRandomDpf {
            weight: 5,
            weight_dpf: 0x1000_0000,
            distance: 20,
        },
        Policy::LeastUsedDpf {
            load: 0x8000_0000,
            load_dpf: 0x0800_0000,
            distance: 40,
        },
    ]
}

/// Expected policy fields of a list of policies in message order.
fn policy_fields(p: &mut Packet, proto: &str, list: &[&Policy]) {
    let mut types = Vec::new();
    let mut loads = Vec::new();
    let mut degradations = Vec::new();
    let mut weights = Vec::new();
    let mut priorities = Vec::new();
    let mut distances = Vec::new();
    let mut load_dpfs = Vec::new();
    let mut weight_dpfs = Vec::new();
    for pol in list {
        types.push(u(pol.policy_type()));
        match **pol {
            Policy::LeastUsed { load } | Policy::RandomizedLeastUsed { load } => {
                loads.push(pct(load))
            }
            Policy::LeastUsedDegradation { load, degradation }
            | Policy::PriorityLeastUsed { load, degradation } => {
                loads.push(pct(load));
                degradations.push(pct(degradation));
            }
            Policy::WeightedRoundRobin { weight } | Policy::WeightedRandom { weight } => {
                weights.push(u(weight))
            }
            Policy::Priority { priority } => priorities.push(u(priority)),
            Policy::WeightedRandomDpf {
                weight,
                weight_dpf,
                distance,
            } => {
                weights.push(u(weight));
                weight_dpfs.push(frac(weight_dpf));
                distances.push(u(distance));
            }
            Policy::LeastUsedDpf {
                load,
                load_dpf,
                distance,
            } => {
                loads.push(pct(load));
                load_dpfs.push(frac(load_dpf));
                distances.push(u(distance));
            }
            Policy::RoundRobin | Policy::Random => {}
            ref other => panic!("no expectation written for {other:?}"),
        }
    }
    let f = |n: &str| format!("{proto}.pool_member_selection_policy_{n}");
    p.field(&f("type"), types)
        .field(&f("load"), loads)
        .field(&f("degradation"), degradations)
        .field(&f("weight"), weights)
        .field(&f("priority"), priorities)
        .field(&f("distance"), distances)
        .field(&f("load_dpf"), load_dpfs)
        .field(&f("weight_dpf"), weight_dpfs);
}

fn asap_packets() -> Vec<Packet> {
    use AsapMessage as M;
    let lu50 = Policy::LeastUsed { load: 0x8000_0000 };
    let reg_pe = pe(
        0x0102_0304,
        sctp(7, 1, &[IpAddr::V4(V4A), IpAddr::V6(V6A)]),
        lu50.clone(),
        false,
    );
    let mut out = Vec::new();
    let mut add = |name: &str, m: M, f: &mut dyn FnMut(&mut Packet)| {
        let mut p = Packet::new("asap", name, m.msg_type(), m.to_bytes().unwrap());
        assert_eq!(AsapMessage::decode(&p.bytes).as_ref(), Ok(&m), "{name}");
        f(&mut p);
        out.push(p);
    };
    let handle = || vec![s(hex(b"EchoPool"))];
    const PH: &str = "asap.pool_handle_pool_handle";

    add(
        "REGISTRATION (SCTP v4+v6, LU 50%)",
        M::Registration {
            pool_handle: ph(),
            pool_element: reg_pe.clone(),
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.pool_element_pe_identifier", vec![u(0x0102_0304u32)])
                .field(
                    "asap.pool_element_home_enrp_server_identifier",
                    vec![u(0x5eed_0001u32)],
                )
                .field("asap.pool_element_registration_life", vec![u(300u32)])
                .field("asap.sctp_transport_port", vec![u(7u16)])
                .field("asap.transport_use", vec![u(1u16)])
                .field("asap.ipv4_address", vec![s(V4A)])
                .field("asap.ipv6_address", vec![s(V6A)]);
            policy_fields(p, "asap", &[&lu50]);
        },
    );
    add(
        "DEREGISTRATION",
        M::Deregistration {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)]);
        },
    );
    let mut lu_tlv = Vec::new();
    // The offending policy TLV as cause info: take it from an encoded business card.
    {
        let b = M::BusinessCard {
            pool_handle: PoolHandle::default(),
            policy: Some(lu50.clone()),
            pool_elements: vec![],
        }
        .to_bytes()
        .unwrap();
        lu_tlv.extend_from_slice(&b[8..20]);
    }
    add(
        "REGISTRATION_RESPONSE R=1, Inconsistent Pooling Policy",
        M::RegistrationResponse {
            reject: true,
            pool_handle: ph(),
            pe_id: 0x0102_0304,
            error: Some(OperationError::single(ErrorCause::with_info(
                CauseCode::INCONSISTENT_POOLING_POLICY,
                lu_tlv.clone(),
            ))),
        },
        &mut |p| {
            // Wireshark dissects the cause's info as the policy parameter it is.
            p.field(PH, handle())
                .field("asap.r_bit", vec![u(1u8)])
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)])
                .field("asap.cause_code", vec![u(5u16)])
                .field("asap.cause_length", vec![u(16u16)]);
            policy_fields(p, "asap", &[&lu50]);
        },
    );
    add(
        "REGISTRATION_RESPONSE R=0",
        M::RegistrationResponse {
            reject: false,
            pool_handle: ph(),
            pe_id: 0x0102_0304,
            error: None,
        },
        &mut |p| {
            p.field("asap.r_bit", vec![u(0u8)])
                .field("asap.cause_code", vec![]);
        },
    );
    add(
        "DEREGISTRATION_RESPONSE",
        M::DeregistrationResponse {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
            error: None,
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)]);
        },
    );
    add(
        "HANDLE_RESOLUTION S=1 with Handle Resolution Option 0x803f",
        M::HandleResolution {
            subscribe: true,
            pool_handle: ph(),
            items: Some(3),
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.hropt_items", vec![u(3u32)]);
        },
    );
    let pols = policies();
    let users = [
        sctp(7, 0, &[IpAddr::V4(V4B)]),
        single(Protocol::TCP, 8, IpAddr::V4(V4B)),
        single(Protocol::Udp { reserved: 0 }, 9, IpAddr::V6(V6A)),
        single(Protocol::UdpLite { reserved: 0 }, 10, IpAddr::V4(V4A)),
    ];
    let hr_pes: Vec<PoolElement> = pols
        .iter()
        .enumerate()
        .map(|(i, pol)| {
            pe(
                0x1000 + i as u32,
                users[i % users.len()].clone(),
                pol.clone(),
                true,
            )
        })
        .collect();
    let overall = Policy::LeastUsed { load: 0 };
    add(
        "HANDLE_RESOLUTION_RESPONSE A=1, 7 PEs: LUD/PLU/RLU/WRR/Priority/WRAND-DPF/LU-DPF",
        M::HandleResolutionResponse {
            accept: true,
            pool_handle: ph(),
            policy: Some(overall.clone()),
            pool_elements: hr_pes.clone(),
            error: None,
        },
        &mut |p| {
            let mut list = vec![&overall];
            list.extend(pols.iter());
            policy_fields(p, "asap", &list);
            p.field(PH, handle()).field(
                "asap.pool_element_pe_identifier",
                (0..pols.len() as u64).map(|i| V::U(0x1000 + i)).collect(),
            );
        },
    );
    add(
        "HANDLE_RESOLUTION_RESPONSE, Unknown Pool Handle",
        M::HandleResolutionResponse {
            accept: false,
            pool_handle: PoolHandle::from("NoSuchPool"),
            policy: None,
            pool_elements: vec![],
            error: Some(OperationError::single(ErrorCause::new(
                CauseCode::UNKNOWN_POOL_HANDLE,
            ))),
        },
        &mut |p| {
            p.field(PH, vec![s(hex(b"NoSuchPool"))])
                .field("asap.cause_code", vec![u(9u16)]);
        },
    );
    add(
        "ENDPOINT_KEEP_ALIVE H=1",
        M::EndpointKeepAlive {
            home: true,
            server_id: 0x5eed_0002,
            pool_handle: ph(),
            pe_id: None,
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.h_bit", vec![u(1u8)])
                .field("asap.server_identifier", vec![u(0x5eed_0002u32)]);
        },
    );
    add(
        "ENDPOINT_KEEP_ALIVE H=0 with rsplib's PE Identifier",
        M::EndpointKeepAlive {
            home: false,
            server_id: 0x5eed_0002,
            pool_handle: ph(),
            pe_id: Some(0x0102_0304),
        },
        &mut |p| {
            p.field("asap.h_bit", vec![u(0u8)])
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)]);
        },
    );
    add(
        "ENDPOINT_KEEP_ALIVE_ACK",
        M::EndpointKeepAliveAck {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)]);
        },
    );
    add(
        "ENDPOINT_UNREACHABLE",
        M::EndpointUnreachable {
            pool_handle: ph(),
            pe_id: 0x0102_0304,
        },
        &mut |p| {
            p.field(PH, handle())
                .field("asap.pe_identifier", vec![u(0x0102_0304u32)]);
        },
    );
    add(
        "SERVER_ANNOUNCE with SCTP and TCP transports",
        M::ServerAnnounce {
            server_id: 0x5eed_0002,
            transports: vec![
                sctp(3863, 1, &[IpAddr::V4(V4A), IpAddr::V4(V4B)]),
                single(Protocol::TCP, 3863, IpAddr::V6(V6A)),
            ],
        },
        &mut |p| {
            p.field("asap.server_identifier", vec![u(0x5eed_0002u32)])
                .field("asap.sctp_transport_port", vec![u(3863u16)])
                .field("asap.tcp_transport_port", vec![u(3863u16)])
                .field("asap.ipv4_address", vec![s(V4A), s(V4B)])
                .field("asap.ipv6_address", vec![s(V6A)]);
        },
    );
    let cookie = b"session-state\x00\x01".to_vec(); // 15 bytes: one byte of padding
    add(
        "COOKIE (15 bytes)",
        M::Cookie {
            cookie: cookie.clone().into(),
        },
        &mut |p| {
            p.field("asap.cookie", vec![s(hex(&cookie))]);
        },
    );
    add(
        "COOKIE_ECHO (15 bytes)",
        M::CookieEcho {
            cookie: cookie.clone().into(),
        },
        &mut |p| {
            p.field("asap.cookie", vec![s(hex(&cookie))]);
        },
    );
    let card_pes = vec![
        pe(
            0x2001,
            single(Protocol::TCP, 7, IpAddr::V4(V4A)),
            Policy::RoundRobin,
            false,
        ),
        pe(
            0x2002,
            single(Protocol::TCP, 7, IpAddr::V4(V4B)),
            Policy::RoundRobin,
            false,
        ),
    ];
    add(
        "BUSINESS_CARD with 2 PEs (failover order)",
        M::BusinessCard {
            pool_handle: ph(),
            policy: None,
            pool_elements: card_pes,
        },
        &mut |p| {
            p.field(PH, handle())
                .field(
                    "asap.pool_element_pe_identifier",
                    vec![u(0x2001u32), u(0x2002u32)],
                )
                .field("asap.tcp_transport_port", vec![u(7u16), u(7u16)])
                .field("asap.ipv4_address", vec![s(V4A), s(V4B)]);
        },
    );
    // The less common transports and policies. Wireshark 4.0 names only three private policy
    // types (0xb0001003, 0xb0002001, 0xb0002002) and shows the others' data as raw bytes; it
    // does not know the Opaque Transport (0x10) and shows it as an unknown parameter.
    let dccp = TransportAddress {
        protocol: Protocol::Dccp {
            reserved: 0,
            service_code: 0x0102_0304,
        },
        port: 5001,
        addresses: vec![IpAddr::V6(V6A)].into(),
    };
    add(
        "REGISTRATION (DCCP, service code 0x01020304, Priority)",
        M::Registration {
            pool_handle: ph(),
            pool_element: pe(0x4001, dccp, Policy::Priority { priority: 9 }, false),
        },
        &mut |p| {
            p.field("asap.dccp_transport_port", vec![u(5001u16)])
                .field("asap.dccp_transport_service_code", vec![u(0x0102_0304u32)])
                .field("asap.ipv6_address", vec![s(V6A)]);
            policy_fields(p, "asap", &[&Policy::Priority { priority: 9 }]);
        },
    );
    let mut opaque_pe = pe(
        0x4002,
        sctp(1, 0, &[IpAddr::V4(V4A)]),
        Policy::Random,
        false,
    );
    opaque_pe.user_transport = UserTransport::Opaque(b"opaque-xyz".to_vec().into());
    let exotic = [
        Policy::PriorityLeastUsedDegradation {
            load: 1,
            degradation: 2,
        },
        Policy::LeastUsedDegradationDpf {
            load: 1,
            degradation: 2,
            load_dpf: 3,
            distance: 4,
        },
        Policy::Other {
            policy_type: 0xc000_0001,
            data: vec![0xaa, 0xbb, 0xcc, 0xdd].into(),
        },
    ];
    let udplite = single(Protocol::UdpLite { reserved: 0 }, 4711, IpAddr::V4(V4B));
    let mut card = vec![opaque_pe];
    card.extend(
        exotic
            .iter()
            .enumerate()
            .map(|(i, pol)| pe(0x4003 + i as u32, udplite.clone(), pol.clone(), false)),
    );
    add(
        "BUSINESS_CARD: Opaque and UDP-Lite transports, PLUD/LUD-DPF/private policies",
        M::BusinessCard {
            pool_handle: ph(),
            policy: Some(Policy::Random),
            pool_elements: card,
        },
        &mut |p| {
            let f = "asap.pool_member_selection_policy_";
            p.field(
                "asap.pool_element_pe_identifier",
                (0x4002..=0x4005u32).map(u).collect(),
            )
            .field("asap.udp_lite_transport_port", vec![u(4711u16); 3])
            .field(&format!("{f}type"), {
                let mut t = vec![u(pt::RANDOM), u(pt::RANDOM)];
                t.extend(exotic.iter().map(|x| u(x.policy_type())));
                t
            })
            .field(
                &format!("{f}value"),
                vec![
                    s("0000000100000002"),
                    s("00000001000000020000000300000004"),
                    s("aabbccdd"),
                ],
            )
            // Opaque Transport, as an unknown parameter.
            .field("asap.parameter_value", vec![s(hex(b"opaque-xyz"))]);
        },
    );
    add(
        "HANDLE_RESOLUTION for the empty pool handle, all items",
        M::HandleResolution {
            subscribe: false,
            pool_handle: PoolHandle::default(),
            items: Some(u32::MAX),
        },
        &mut |p| {
            p.field("asap.hropt_items", vec![u(u32::MAX)]);
        },
    );
    let unknown_tlv = [0x40, 0x77, 0x00, 0x06, 0xab, 0xcd]; // 6 bytes: two bytes of padding
    add(
        "ERROR: Unrecognized Parameter + Lack of Resources",
        M::Error {
            error: OperationError {
                causes: vec![
                    ErrorCause::with_info(CauseCode::UNRECOGNIZED_PARAMETER, unknown_tlv.to_vec()),
                    ErrorCause::new(CauseCode::LACK_OF_RESOURCES),
                ],
            },
        },
        &mut |p| {
            // The info is dissected as the (unknown) parameter it quotes.
            p.field("asap.cause_code", vec![u(1u16), u(6u16)])
                .field("asap.cause_length", vec![u(10u16), u(4u16)])
                .field("asap.parameter_type", vec![u(0x000cu16), u(0x4077u16)])
                .field("asap.parameter_value", vec![s("abcd")]);
        },
    );
    out
}

fn enrp_packets() -> Vec<Packet> {
    use EnrpBody as B;
    const SENDER: u32 = 0x5eed_0001;
    const RECEIVER: u32 = 0x5eed_0002;
    let mut out = Vec::new();
    let mut add = |name: &str, receiver: u32, body: B, f: &mut dyn FnMut(&mut Packet)| {
        let m = EnrpMessage {
            sender: SENDER,
            receiver,
            body,
        };
        let mut p = Packet::new("enrp", name, m.body.msg_type(), m.to_bytes().unwrap());
        assert_eq!(EnrpMessage::decode(&p.bytes).as_ref(), Ok(&m), "{name}");
        p.field("enrp.sender_servers_id", vec![u(SENDER)])
            .field("enrp.receiver_servers_id", vec![u(receiver)]);
        f(&mut p);
        out.push(p);
    };
    const PH: &str = "enrp.pool_handle_pool_handle";
    let si = |id: u32, a: IpAddr| ServerInformation {
        server_id: id,
        transport: sctp(9901, 1, &[a]),
    };

    add(
        "PRESENCE R=1 with PE checksum and Server Information",
        RECEIVER,
        B::Presence {
            reply_required: true,
            checksum: Some(0x29a5),
            server_info: Some(ServerInformation {
                server_id: SENDER,
                transport: sctp(9901, 1, &[IpAddr::V4(V4A), IpAddr::V6(V6A)]),
            }),
        },
        &mut |p| {
            p.field("enrp.r_bit", vec![u(1u8)])
                .field("enrp.pe_checksum", vec![u(0x29a5u16)])
                .field("enrp.server_information_server_identifier", vec![u(SENDER)])
                .field("enrp.sctp_transport_port", vec![u(9901u16)])
                .field("enrp.ipv4_address", vec![s(V4A)])
                .field("enrp.ipv6_address", vec![s(V6A)]);
        },
    );
    add(
        "PRESENCE R=0, checksum only (group-cast)",
        0,
        B::Presence {
            reply_required: false,
            checksum: Some(0xffff),
            server_info: None,
        },
        &mut |p| {
            p.field("enrp.r_bit", vec![u(0u8)])
                .field("enrp.pe_checksum", vec![u(0xffffu16)]);
        },
    );
    add(
        "HANDLE_TABLE_REQUEST W=1",
        RECEIVER,
        B::HandleTableRequest {
            own_children_only: true,
        },
        &mut |p| {
            p.field("enrp.w_bit", vec![u(1u8)]);
        },
    );
    let pols = policies();
    let pools = vec![
        PoolEntry {
            pool_handle: ph(),
            pool_elements: vec![
                pe(
                    0x3001,
                    sctp(7, 0, &[IpAddr::V4(V4A)]),
                    pols[0].clone(),
                    true,
                ),
                pe(
                    0x3002,
                    sctp(7, 0, &[IpAddr::V4(V4B)]),
                    pols[1].clone(),
                    true,
                ),
            ],
        },
        PoolEntry {
            pool_handle: PoolHandle::from("DaytimePool"),
            pool_elements: vec![pe(
                0x3003,
                single(Protocol::TCP, 13, IpAddr::V6(V6A)),
                pols[6].clone(),
                true,
            )],
        },
    ];
    add(
        "HANDLE_TABLE_RESPONSE M=1, 2 pools, 3 PEs",
        RECEIVER,
        B::HandleTableResponse {
            reject: false,
            more: true,
            pools,
        },
        &mut |p| {
            p.field("enrp.m_bit", vec![u(1u8)])
                .field("enrp.r_bit", vec![u(0u8)])
                .field(PH, vec![s(hex(b"EchoPool")), s(hex(b"DaytimePool"))])
                .field(
                    "enrp.pool_element_pe_identifier",
                    vec![u(0x3001u32), u(0x3002u32), u(0x3003u32)],
                );
            policy_fields(p, "enrp", &[&pols[0], &pols[1], &pols[6]]);
        },
    );
    add(
        "HANDLE_TABLE_RESPONSE R=1",
        RECEIVER,
        B::HandleTableResponse {
            reject: true,
            more: false,
            pools: vec![],
        },
        &mut |p| {
            p.field("enrp.r_bit", vec![u(1u8)])
                .field("enrp.m_bit", vec![u(0u8)]);
        },
    );
    add(
        "HANDLE_UPDATE ADD_PE",
        0,
        B::HandleUpdate {
            takeover_suggested: false,
            action: UpdateAction::AddPe,
            pool_handle: ph(),
            pool_element: pe(
                0x3004,
                sctp(7, 1, &[IpAddr::V4(V4A), IpAddr::V6(V6A)]),
                pols[2].clone(),
                true,
            ),
        },
        &mut |p| {
            p.field("enrp.update_action", vec![u(0u16)])
                .field("enrp.t_bit", vec![u(0u8)])
                .field(PH, vec![s(hex(b"EchoPool"))])
                .field("enrp.pool_element_pe_identifier", vec![u(0x3004u32)])
                .field("enrp.pool_element_registration_life", vec![u(300u32)]);
            policy_fields(p, "enrp", &[&pols[2]]);
        },
    );
    add(
        "HANDLE_UPDATE DEL_PE, T=1",
        0,
        B::HandleUpdate {
            takeover_suggested: true,
            action: UpdateAction::DelPe,
            pool_handle: ph(),
            pool_element: pe(
                0x3004,
                sctp(7, 1, &[IpAddr::V4(V4A)]),
                pols[3].clone(),
                true,
            ),
        },
        &mut |p| {
            p.field("enrp.update_action", vec![u(1u16)])
                .field("enrp.t_bit", vec![u(1u8)]);
        },
    );
    add("LIST_REQUEST", RECEIVER, B::ListRequest, &mut |_| {});
    add(
        "LIST_RESPONSE with 2 servers",
        RECEIVER,
        B::ListResponse {
            reject: false,
            servers: vec![
                si(0x5eed_0003, IpAddr::V4(V4A)),
                si(0x5eed_0004, IpAddr::V6(V6A)),
            ],
        },
        &mut |p| {
            p.field("enrp.r_bit", vec![u(0u8)]).field(
                "enrp.server_information_server_identifier",
                vec![u(0x5eed_0003u32), u(0x5eed_0004u32)],
            );
        },
    );
    add(
        "LIST_RESPONSE R=1",
        RECEIVER,
        B::ListResponse {
            reject: true,
            servers: vec![],
        },
        &mut |p| {
            p.field("enrp.r_bit", vec![u(1u8)]);
        },
    );
    for (name, body) in [
        (
            "INIT_TAKEOVER",
            B::InitTakeover {
                target: 0x5eed_0009,
            },
        ),
        (
            "INIT_TAKEOVER_ACK",
            B::InitTakeoverAck {
                target: 0x5eed_0009,
            },
        ),
        (
            "TAKEOVER_SERVER",
            B::TakeoverServer {
                target: 0x5eed_0009,
            },
        ),
    ] {
        add(name, 0, body, &mut |p| {
            p.field("enrp.target_servers_id", vec![u(0x5eed_0009u32)]);
        });
    }
    add(
        "ERROR: Unrecognized Message",
        RECEIVER,
        B::Error {
            error: OperationError::single(ErrorCause::with_info(
                CauseCode::UNRECOGNIZED_MESSAGE,
                vec![0x4b, 0x00, 0x00, 0x0c, 0, 0, 0, 1, 0, 0, 0, 0],
            )),
        },
        &mut |p| {
            // The info is dissected as the (unknown, type 0x4b) ENRP message it quotes.
            p.field("enrp.cause_code", vec![u(2u16)])
                .field("enrp.cause_length", vec![u(16u16)])
                .field("enrp.message_type", vec![u(10u8), u(0x4bu8)])
                .field("enrp.message_flags", vec![u(0u8), u(0u8)])
                .field("enrp.message_length", vec![u(32u16), u(12u16)])
                .field("enrp.message_value", vec![s("0000000100000000")]);
        },
    );
    out
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn asap_messages_pass_wiresharks_dissector() {
    let packets = asap_packets();
    let types: std::collections::BTreeSet<u8> = packets.iter().map(|p| p.bytes[0]).collect();
    assert_eq!(types, (1..=14).collect(), "every ASAP message type");
    if tools_available() {
        check_with_tshark("asap", ASAP_PORT, ASAP_PPID, &packets);
    }
}

#[test]
fn enrp_messages_pass_wiresharks_dissector() {
    let packets = enrp_packets();
    let types: std::collections::BTreeSet<u8> = packets.iter().map(|p| p.bytes[0]).collect();
    assert_eq!(types, (1..=10).collect(), "every ENRP message type");
    if tools_available() {
        check_with_tshark("enrp", ENRP_PORT, ENRP_PPID, &packets);
    }
}
