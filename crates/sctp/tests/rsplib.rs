//! The association against another SCTP stack: rsplib's registrar on sctplib, over SCTP in
//! UDP (port 9899 at both ends, RFC 6951 style), each side in a network namespace of its
//! own. Our association (driven here by a few lines over a UDP socket) makes the four-way
//! handshake with `rspregistrar`, registers a pool element with ASAP (PPID 11) and gets a
//! REGISTRATION RESPONSE that accepts it, then deregisters and shuts down gracefully.
//!
//! Needs root and the peer built by the interoperability script into `target/rsplib-udp`
//! (`.ci/run` does); without them the test says SKIPPED (and fails under `CI`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use rserpool_sctp::assoc::Config;
use rserpool_sctp::{Association, Event, Packet, State};
use rserpool_wire::{
    AsapMessage, Message, PoolElement, PoolHandle, Protocol, TransportAddress, UserTransport,
};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REGISTRAR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const US: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
const UDP_PORT: u16 = 9899;

fn peer_bin(name: &str) -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/rsplib-udp/bin");
    let p = root.join(name);
    p.exists().then_some(p)
}

fn skip(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("SKIPPED: {why}");
}

/// Two namespaces joined by a veth pair; removed on drop.
struct Pair(String, String);

impl Pair {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}x{n}", std::process::id() % 100_000);
        let (a, b) = (format!("sctpr{tag}"), format!("sctpu{tag}"));
        let ip = |args: &[&str]| {
            let ok = Command::new("ip").args(args).status().unwrap().success();
            assert!(ok, "ip {args:?}");
        };
        for ns in [&a, &b] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
        ip(&["netns", "add", &a]);
        ip(&["netns", "add", &b]);
        ip(&[
            "link", "add", "sr0", "netns", &a, "type", "veth", "peer", "name", "su0", "netns", &b,
        ]);
        for (ns, dev, addr) in [(&a, "sr0", REGISTRAR), (&b, "su0", US)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        Pair(a, b)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.1]).status();
    }
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An rsplib program in namespace `ns`, logging into `log`.
fn peer(ns: &str, bin: PathBuf, args: &[&str], log: &std::path::Path) -> Kill {
    Kill(
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(bin)
            .args(args)
            .args(["-loglevel=3", "-logcolor=off"])
            .arg(format!("-logfile={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Drives `a` over `sock` until `done` says so or `limit` passes; returns the events seen.
fn drive(
    sock: &UdpSocket,
    peer: SocketAddr,
    a: &mut Association,
    limit: Duration,
    mut done: impl FnMut(&Association, &[Event]) -> bool,
) -> Vec<Event> {
    let t0 = Instant::now();
    let mut events = Vec::new();
    let mut buf = vec![0u8; 65_536];
    while t0.elapsed() < limit {
        let now = Instant::now();
        while let Some((to, p)) = a.poll_transmit(now) {
            sock.send_to(&p.encode(), to).unwrap();
        }
        while let Some(e) = a.poll_event() {
            events.push(e);
        }
        if done(a, &events) {
            break;
        }
        let wait = a
            .poll_timeout()
            .map_or(Duration::from_millis(50), |t| {
                t.saturating_duration_since(now)
            })
            .clamp(Duration::from_millis(1), Duration::from_millis(50));
        sock.set_read_timeout(Some(wait)).unwrap();
        if let Ok((n, from)) = sock.recv_from(&mut buf)
            && from.ip() == peer.ip()
        {
            match Packet::decode(&buf[..n]) {
                Ok(p) => a.handle(p, from, Instant::now()),
                Err(e) => panic!("rsplib sent a packet we cannot decode: {e}"),
            }
        }
        a.handle_timeout(Instant::now());
    }
    events
}

fn asap(events: &[Event]) -> Vec<AsapMessage> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Message(m) if m.ppid == 11 => Some(AsapMessage::decode(&m.data).unwrap()),
            _ => None,
        })
        .collect()
}

#[test]
fn an_association_with_rsplibs_registrar_registers_a_pool_element() {
    if !rustix::process::geteuid().is_root() {
        return skip("the rsplib test needs root (network namespaces)");
    }
    let Some(registrar) = peer_bin("rspregistrar") else {
        return skip(
            "rsplib is not built in target/rsplib-udp (../shared/interop/build-rsplib.sh)",
        );
    };
    let pair = Pair::new();
    let log = std::env::temp_dir().join(format!("rsplib-registrar-{}.log", std::process::id()));
    let _registrar = peer(
        &pair.0,
        registrar,
        &[
            &format!("-asap={REGISTRAR}:3863"),
            &format!("-enrp={REGISTRAR}:9901"),
            "-disable-ipv6",
        ],
        &log,
    );
    let ns = pair.1.clone();
    let outcome = rserpool_ksplice::testbed::in_ns(&ns, move || {
        let sock = UdpSocket::bind((US, UDP_PORT)).unwrap();
        let peer = SocketAddr::from((REGISTRAR, UDP_PORT));
        // rspregistrar needs a moment to listen; INIT is retransmitted meanwhile anyway.
        let now = Instant::now();
        let mut a =
            Association::connect(Config::default(), peer, 41000, 3863, 0x5a5a_0001, 77, now);
        let events = drive(&sock, peer, &mut a, Duration::from_secs(20), |a, _| {
            a.state() == State::Established
        });
        assert_eq!(a.state(), State::Established, "no handshake: {events:?}");
        let pe = PoolElement {
            id: 0x0102_0304,
            home_registrar: 0,
            registration_life: 30_000,
            user_transport: UserTransport::Address(TransportAddress {
                protocol: Protocol::Sctp { transport_use: 0 },
                port: 7777,
                addresses: smallvec::smallvec![IpAddr::V4(US)],
            }),
            policy: rserpool_wire::Policy::RoundRobin,
            asap_transport: None,
        };
        let handle = PoolHandle::new(&b"SctpInterop"[..]);
        let reg = AsapMessage::Registration {
            pool_handle: handle.clone(),
            pool_element: pe,
        };
        a.send(0, 11, Bytes::from(reg.to_bytes().unwrap()), false)
            .unwrap();
        let events = drive(&sock, peer, &mut a, Duration::from_secs(10), |_, ev| {
            !asap(ev).is_empty()
        });
        let answers = asap(&events);
        let dereg = AsapMessage::Deregistration {
            pool_handle: handle,
            pe_id: 0x0102_0304,
        };
        a.send(0, 11, Bytes::from(dereg.to_bytes().unwrap()), false)
            .unwrap();
        let more = drive(&sock, peer, &mut a, Duration::from_secs(10), |_, ev| {
            !asap(ev).is_empty()
        });
        a.shutdown(Instant::now());
        let end = drive(&sock, peer, &mut a, Duration::from_secs(10), |a, _| {
            a.state() == State::Closed
        });
        (answers, asap(&more), end, a.state())
    })
    .join();
    let (answers, deregistered, end, state) = match outcome {
        Ok(o) => o,
        Err(_) => panic!(
            "the client side failed; rspregistrar's log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        ),
    };
    let _ = std::fs::remove_file(&log);
    assert!(
        matches!(
            answers.first(),
            Some(AsapMessage::RegistrationResponse {
                reject: false,
                pe_id: 0x0102_0304,
                ..
            })
        ),
        "{answers:?}"
    );
    assert!(
        matches!(
            deregistered.first(),
            Some(AsapMessage::DeregistrationResponse {
                pe_id: 0x0102_0304,
                error: None,
                ..
            })
        ),
        "{deregistered:?}"
    );
    assert_eq!(state, State::Closed, "{end:?}");
    assert!(end.contains(&Event::Closed), "{end:?}");
    drop(pair);
}

/// The other way round: rsplib's pool element (`rspserver`) opens the association to our
/// listening endpoint (stateless INIT ACK with our cookie, then COOKIE ECHO), registers, and
/// our REGISTRATION RESPONSE reaches it (it acknowledges the data and stays associated).
#[test]
fn rsplibs_pool_element_associates_with_our_endpoint_and_registers() {
    if !rustix::process::geteuid().is_root() {
        return skip("the rsplib test needs root (network namespaces)");
    }
    let Some(server) = peer_bin("rspserver") else {
        return skip("rsplib is not built in target/rsplib-udp (.ci/run builds it)");
    };
    let pair = Pair::new();
    let log = std::env::temp_dir().join(format!("rsplib-pe-{}.log", std::process::id()));
    // rsplib's PE in the first namespace, pointed at our "registrar" in the second.
    let _pe = peer(
        &pair.0,
        server,
        &[
            "-echo",
            "-poolhandle=FromRsplib",
            &format!("-registrar={US}:3863"),
            &format!("-local={REGISTRAR}:7777"),
        ],
        &log,
    );
    let ns = pair.1.clone();
    let outcome = rserpool_ksplice::testbed::in_ns(&ns, move || {
        let sock = UdpSocket::bind((US, UDP_PORT)).unwrap();
        let peer = SocketAddr::from((REGISTRAR, UDP_PORT));
        let mut endpoint = rserpool_sctp::Endpoint::new(
            Config::default(),
            3863,
            [0x42; 32],
            0x1234_5678,
            Instant::now(),
        );
        let mut buf = vec![0u8; 65_536];
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let t0 = Instant::now();
        let mut assoc = loop {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no association from rspserver"
            );
            let Ok((n, from)) = sock.recv_from(&mut buf) else {
                continue;
            };
            if from.ip() != peer.ip() {
                continue;
            }
            let p = Packet::decode(&buf[..n]).unwrap();
            match endpoint.handle(p, from, Instant::now()) {
                rserpool_sctp::Outcome::Reply(r) => {
                    sock.send_to(&r.encode(), peer).unwrap();
                }
                rserpool_sctp::Outcome::Accept(a) => break *a,
                rserpool_sctp::Outcome::BadCookie(e) => panic!("our own cookie: {e}"),
                rserpool_sctp::Outcome::Ignore => {}
            }
        };
        let events = drive(&sock, peer, &mut assoc, Duration::from_secs(20), |_, ev| {
            !asap(ev).is_empty()
        });
        let registration = asap(&events).into_iter().next();
        if let Some(AsapMessage::Registration {
            pool_handle,
            pool_element,
        }) = &registration
        {
            let answer = AsapMessage::RegistrationResponse {
                reject: false,
                pool_handle: pool_handle.clone(),
                pe_id: pool_element.id,
                error: None,
            };
            assoc
                .send(0, 11, Bytes::from(answer.to_bytes().unwrap()), false)
                .unwrap();
        }
        // The answer acknowledged, the association still up a while later.
        let _ = drive(&sock, peer, &mut assoc, Duration::from_secs(3), |_, _| {
            false
        });
        (registration, events, assoc.state(), assoc.debug())
    })
    .join();
    let (registration, events, state, sender) = match outcome {
        Ok(o) => o,
        Err(_) => panic!(
            "our side failed; rspserver's log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        ),
    };
    let _ = std::fs::remove_file(&log);
    match registration {
        Some(AsapMessage::Registration {
            pool_handle,
            pool_element,
        }) => {
            assert_eq!(pool_handle, PoolHandle::new(&b"FromRsplib"[..]));
            let UserTransport::Address(t) = &pool_element.user_transport else {
                panic!("{pool_element:?}")
            };
            assert_eq!(t.port, 7777);
            assert!(t.addresses.contains(&IpAddr::V4(REGISTRAR)), "{t:?}");
        }
        other => panic!("no REGISTRATION from rspserver: {other:?} ({events:?})"),
    }
    assert_eq!(state, State::Established);
    assert!(
        sender.contains("flight 0"),
        "our answer unacknowledged: {sender}"
    );
    drop(pair);
}
