//! The datapath in network namespaces: client | proxy | server, joined by veth pairs. The
//! proxy namespace has the program at TC ingress of both its interfaces and one connection's
//! entries, with sequence offsets in both directions; the client connects to the proxy's
//! address and talks to the server, whose stack never sees the client's numbers. The proxy
//! namespace's own TCP stack never sees a packet of it.
//!
//! Needs root, iproute2 and a build with clang (`.ci/run` installs clang and libbpf-dev);
//! without them the test is skipped, except under `CI`, where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_ksplice::{Datapath, Splice, ifindex, unavailable};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

fn skip(why: &str) -> bool {
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("SKIPPED: {why}");
    true
}

fn ip(args: &str) {
    let ok = Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip {args}");
}

/// Namespaces that go away with the test.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Runs `f` on a thread inside namespace `ns`.
fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap();
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&fd),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
        f()
    })
}

fn pattern(i: usize, seed: u8) -> u8 {
    ((i % 251) as u8).wrapping_add(seed)
}

#[test]
fn a_spliced_connection_carries_bytes_exactly_both_ways_with_sequence_offsets() {
    spliced_transfer(0);
}

/// With 2 % of the packets into the server and into the client dropped (nftables; the kernel
/// here has no netem), both ends retransmit and acknowledge selectively through the splice:
/// the SACK blocks they send are translated into the other leg's numbers.
#[test]
fn a_spliced_connection_survives_loss_with_sack() {
    spliced_transfer(2);
}

fn spliced_transfer(loss_percent: u32) {
    if !rustix::process::geteuid().is_root() {
        skip("the kernel splice test needs root (network namespaces, eBPF)");
        return;
    }
    if let Some(why) = unavailable() {
        skip(why);
        return;
    }
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tag = format!("{}x{n}", std::process::id() % 100_000);
    let (c, p, s) = (
        format!("ksc{tag}"),
        format!("ksp{tag}"),
        format!("kss{tag}"),
    );
    let _ns = Netns(vec![c.clone(), p.clone(), s.clone()]);
    for n in [&c, &p, &s] {
        ip(&format!("netns add {n}"));
        ip(&format!("-n {n} link set lo up"));
    }
    ip(&format!(
        "-n {c} link add c0 type veth peer name p0 netns {p}"
    ));
    ip(&format!(
        "-n {s} link add s0 type veth peer name p1 netns {p}"
    ));
    ip(&format!("-n {c} addr add 10.77.1.2/24 dev c0"));
    ip(&format!("-n {p} addr add 10.77.1.1/24 dev p0"));
    ip(&format!("-n {p} addr add 10.77.2.1/24 dev p1"));
    ip(&format!("-n {s} addr add 10.77.2.2/24 dev s0"));
    for (n, d) in [(&c, "c0"), (&p, "p0"), (&p, "p1"), (&s, "s0")] {
        ip(&format!("-n {n} link set {d} up"));
    }
    if loss_percent > 0 {
        for n in [&c, &s] {
            let rules = format!(
                "table inet loss {{\n chain input {{\n  type filter hook input priority 0;\n  \
                 meta l4proto tcp numgen random mod 100 < {loss_percent} drop\n }}\n}}\n"
            );
            let ok = Command::new("ip")
                .args(["netns", "exec", n, "nft", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut ch| {
                    ch.stdin.take().unwrap().write_all(rules.as_bytes())?;
                    ch.wait()
                })
                .is_ok_and(|st| st.success());
            if !ok {
                skip("the loss test needs nftables (apt-get install -y nftables)");
                return;
            }
        }
    }

    let client: SocketAddrV4 = "10.77.1.2:40000".parse().unwrap();
    let front: SocketAddrV4 = "10.77.1.1:8080".parse().unwrap();
    let back: SocketAddrV4 = "10.77.2.1:40001".parse().unwrap();
    let server: SocketAddrV4 = "10.77.2.2:9000".parse().unwrap();
    // The proxy: the program on both interfaces, the connection's entries. It stays loaded
    // while the thread waits for the word to go.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let proxy = in_ns(&p, move || {
        let mut dp = Datapath::load(&["p0", "p1"], 1024).unwrap();
        let splice = Splice {
            client,
            front,
            back,
            server,
            // Offsets that wrap: the legs' numbers differ in every bit that matters.
            client_seq_delta: 0x9e37_79b9,
            server_seq_delta: 0x7f4a_7c15,
            client_if: ifindex("p0").unwrap(),
            server_if: ifindex("p1").unwrap(),
        };
        dp.splice(&splice).unwrap();
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
        let counters = dp.counters().unwrap();
        dp.unsplice(&splice).unwrap();
        counters
    });
    ready_rx.recv().unwrap();

    const N: usize = 8 << 20;
    let srv = in_ns(&s, move || {
        let l = TcpListener::bind(server).unwrap();
        let (mut conn, peer) = l.accept().unwrap();
        // The server sees the proxy's back address, not the client.
        assert_eq!(peer.to_string(), back.to_string());
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut w = conn.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let buf: Vec<u8> = (0..N).map(|i| pattern(i, 7)).collect();
            w.write_all(&buf).unwrap();
            w.shutdown(std::net::Shutdown::Write).unwrap();
        });
        let mut got = Vec::with_capacity(N);
        conn.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        got
    });
    std::thread::sleep(Duration::from_millis(100));
    let cli = in_ns(&c, move || {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_reuse_address(true).unwrap();
        sock.bind(&std::net::SocketAddr::V4(client).into()).unwrap();
        sock.connect_timeout(
            &std::net::SocketAddr::V4(front).into(),
            Duration::from_secs(5),
        )
        .unwrap();
        let mut conn: TcpStream = sock.into();
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut w = conn.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let buf: Vec<u8> = (0..N).map(|i| pattern(i, 3)).collect();
            w.write_all(&buf).unwrap();
            w.shutdown(std::net::Shutdown::Write).unwrap();
        });
        let mut got = Vec::with_capacity(N);
        conn.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        got
    });
    let at_client = cli.join().unwrap();
    let at_server = srv.join().unwrap();
    done_tx.send(()).unwrap();
    let counters = proxy.join().unwrap();
    assert_eq!(at_server.len(), N, "client → server length");
    assert!(
        at_server
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(i, 3))
    );
    assert_eq!(at_client.len(), N, "server → client length");
    assert!(
        at_client
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(i, 7))
    );
    eprintln!("datapath counters: {counters:?}");
    assert!(
        counters.packets > 0 && counters.bytes >= 2 * N as u64,
        "{counters:?}"
    );
    assert!(
        counters.fins >= 2,
        "both FINs went through the splice: {counters:?}"
    );
}
