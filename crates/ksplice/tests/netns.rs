//! The datapath in network namespaces: client | proxy | server, joined by veth pairs. The
//! proxy namespace has the program at TC ingress of both its interfaces and one connection's
//! entries, with sequence offsets in both directions; the client connects to the proxy's
//! address and talks to the server, whose stack never sees the client's numbers. The proxy
//! namespace's own TCP stack never sees a packet of it.
//!
//! Needs root, iproute2 and a build with clang (`.ci/run` installs clang and libbpf-dev);
//! without them the test is skipped, except under `CI`, where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_ksplice::testbed::{
    FRONT, N, SERVER, assert_outlived, assert_pattern, exchange, exchange_n, greet, in_ns,
    listener, pattern, route_and_hand_over, topology, welcome,
};
use rserpool_ksplice::{Datapath, Splice, ifindex};
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddrV4, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

/// Joins the client and the server, checks what each received, then lets the proxy go and
/// returns its datapath counters.
fn finish(
    cli: std::thread::JoinHandle<Vec<u8>>,
    srv: std::thread::JoinHandle<Vec<u8>>,
    done: std::sync::mpsc::Sender<()>,
    proxy: std::thread::JoinHandle<rserpool_ksplice::Counters>,
    n: usize,
) -> rserpool_ksplice::Counters {
    let at_client = cli.join().unwrap();
    let at_server = srv.join().unwrap();
    done.send(()).unwrap();
    let counters = proxy.join().unwrap();
    assert_pattern(&at_server, n, 3, "client → server");
    assert_pattern(&at_client, n, 7, "server → client");
    eprintln!("datapath counters: {counters:?}");
    counters
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
    let Some((ns, c, p, s)) = topology(loss_percent) else {
        return;
    };
    let pins = ns.1.clone();
    let client: SocketAddrV4 = "10.77.1.2:40000".parse().unwrap();
    let front = FRONT;
    let back: SocketAddrV4 = "10.77.2.1:40001".parse().unwrap();
    let server = SERVER;
    // The proxy: the program on both interfaces, the connection's entries. It stays loaded
    // while the thread waits for the word to go.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let proxy = in_ns(&p, move || {
        let mut dp = Datapath::load(&["p0", "p1"], 1024, &pins).unwrap();
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
            // End to end: the client and the server negotiated with each other.
            client_wscale: 0,
            front_wscale: 0,
            server_wscale: 0,
            back_wscale: 0,
            timestamps: None,
        };
        dp.splice(&splice).unwrap();
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
        let counters = dp.counters().unwrap();
        dp.unsplice(&splice).unwrap();
        counters
    });
    ready_rx.recv().unwrap();

    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let srv = in_ns(&s, move || {
        let l = TcpListener::bind(server).unwrap();
        bound_tx.send(()).unwrap();
        let (conn, peer) = l.accept().unwrap();
        // The server sees the proxy's back address, not the client.
        assert_eq!(peer.to_string(), back.to_string());
        exchange(conn, 7)
    });
    bound_rx.recv().unwrap();
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
        let conn: TcpStream = sock.into();
        exchange(conn, 3)
    });
    let counters = finish(cli, srv, done_tx, proxy, N);
    assert!(
        counters.packets > 0 && counters.bytes >= 2 * N as u64,
        "{counters:?}"
    );
    assert!(
        counters.fins >= 2,
        "both FINs went through the splice: {counters:?}"
    );
}

/// The hand-over: the proxy accepts the client, reads its first message, connects to the
/// server, forwards it and the server's answer, and once both sockets are quiet hands the
/// connection to the datapath and closes its sockets without a FIN or RST. Then 100 MiB go
/// each way, byte-exact, while the proxy has no socket of the connection left. The legs use
/// TCP timestamps (the namespaces' default), each with its own clocks: the datapath
/// translates them. Once both FINs have passed, expiry removes the entries.
#[test]
fn the_proxy_hands_a_routed_connection_to_the_kernel_and_leaves_it() {
    handed_over_transfer(0, 100 << 20, false);
}

/// The same (8 MiB each way) with 2 % of the packets into the client and into the server
/// dropped: SACK and timestamps in use on both legs, retransmissions through the splice.
/// Captures at the client and at the server (tshark) show good IP and TCP checksums on
/// every packet, timestamps and SACK blocks in use, and retransmissions of under a quarter
/// of the data packets, not a storm. The veths compute full checksums here (offload off), as packets from a real
/// NIC carry them; veth receivers do not check checksums, so only a capture shows them right.
#[test]
fn a_handed_over_connection_survives_loss_with_sack_and_timestamps() {
    handed_over_transfer(2, N, true);
}

/// tshark capturing on `dev` in namespace `ns` into `file`, stopped (and flushed) on drop.
struct Capture(std::process::Child);

impl Capture {
    fn start(ns: &str, dev: &str, file: &std::path::Path) -> Option<Capture> {
        if !tx_checksum_off(ns, dev) {
            return None;
        }
        let mut child = Command::new("ip")
            .args([
                "netns", "exec", ns, "tshark", "-q", "-i", dev, "-f", "tcp", "-w",
            ])
            .arg(file)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .ok()?;
        let mut lines = std::io::BufReader::new(child.stderr.take()?).lines();
        // tshark says so once it captures.
        lines
            .find(|l| l.as_ref().is_ok_and(|l| l.contains("Capturing on")))?
            .ok()?;
        std::thread::spawn(move || lines.for_each(drop));
        Some(Capture(child))
    }

    fn stop(mut self) {
        let pid = rustix::process::Pid::from_raw(self.0.id() as i32).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        let _ = self.0.wait();
    }
}

/// Has `dev` in `ns` compute full checksums (no offload); false (and skipped) without ethtool.
fn tx_checksum_off(ns: &str, dev: &str) -> bool {
    let ok = Command::new("ip")
        .args(["netns", "exec", ns, "ethtool", "-K", dev, "tx", "off"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        rserpool_ksplice::testbed::skip("the capture test needs ethtool and tshark");
    }
    ok
}

/// Packets of capture `file` that match the display filter `filter` (checksums validated).
fn count(file: &std::path::Path, filter: &str) -> usize {
    let out = Command::new("tshark")
        .args(["-r"])
        .arg(file)
        .args([
            "-o",
            "ip.check_checksum:TRUE",
            "-o",
            "tcp.check_checksum:TRUE",
            "-Y",
            filter,
            "-T",
            "fields",
            "-e",
            "frame.number",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "tshark -r: {out:?}");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

fn handed_over_transfer(loss_percent: u32, bytes: usize, capture: bool) {
    let Some((ns, c, p, s)) = topology(loss_percent) else {
        return;
    };
    let pins = ns.1.clone();
    let front = FRONT;
    let back: SocketAddrV4 = "10.77.2.1:40001".parse().unwrap();
    let server = SERVER;
    let dir = std::env::temp_dir().join(format!("ksplice-cap-{}", ns.0[0]));
    let mut captures = Vec::new();
    if capture {
        std::fs::create_dir_all(&dir).unwrap();
        for dev in ["p0", "p1"] {
            if !tx_checksum_off(&p, dev) {
                return;
            }
        }
        for (n, dev) in [(&c, "c0"), (&s, "s0")] {
            let Some(cap) = Capture::start(n, dev, &dir.join(format!("{dev}.pcap"))) else {
                return;
            };
            captures.push(cap);
        }
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    // Client and server start their transfers once the connection is handed over: the
    // helper hands over quiet sockets only.
    let gate = std::sync::Arc::new(std::sync::Barrier::new(3));
    let (server_gate, proxy_gate) = (gate.clone(), gate.clone());
    let srv = in_ns(&s, move || {
        let l = TcpListener::bind(server).unwrap();
        bound_tx.send(()).unwrap();
        let (mut conn, peer) = l.accept().unwrap();
        assert_eq!(peer.to_string(), back.to_string());
        welcome(&mut conn);
        server_gate.wait();
        exchange_n(conn, 7, bytes)
    });
    let proxy = in_ns(&p, move || {
        let mut dp = Datapath::load(&["p0", "p1"], 1024, &pins).unwrap();
        let l = listener(front);
        ready_tx.send(()).unwrap();
        // A small receive buffer: the back leg negotiates a smaller window scale than the
        // front leg, so the datapath must rescale the server's windows.
        let splice = route_and_hand_over(&mut dp, &l, back, server, Some(16 * 1024));
        proxy_gate.wait();
        assert_ne!(splice.front_wscale, splice.back_wscale, "{splice:?}");
        assert!(splice.timestamps.is_some(), "{splice:?}");
        let _ = done_rx.recv();
        let carried = dp.carried(&splice).expect("the entries until expiry");
        eprintln!("carried (packets, bytes) each way: {carried:?}");
        assert!(
            carried.iter().all(|&(_, b)| b >= bytes as u64),
            "{carried:?}"
        );
        // Both FINs passed: nothing younger than zero seconds keeps them.
        let kept = dp
            .expire(Duration::from_secs(3600), Duration::from_secs(3600))
            .unwrap();
        assert_eq!((kept.entries, kept.closed), (2, 0), "{kept:?}");
        let gone = dp
            .expire(Duration::from_secs(3600), Duration::ZERO)
            .unwrap();
        assert_eq!((gone.entries, gone.closed), (0, 2), "{gone:?}");
        dp.counters().unwrap()
    });
    ready_rx.recv().unwrap();
    bound_rx.recv().unwrap();
    let cli = in_ns(&c, move || {
        let conn = greet(front);
        gate.wait();
        exchange_n(conn, 3, bytes)
    });
    let counters = finish(cli, srv, done_tx, proxy, bytes);
    assert!(counters.bytes >= 2 * bytes as u64, "{counters:?}");
    assert!(counters.fins >= 2, "{counters:?}");
    if !capture {
        return;
    }
    for cap in captures {
        cap.stop();
    }
    for dev in ["c0", "s0"] {
        let file = dir.join(format!("{dev}.pcap"));
        let all = count(&file, "tcp");
        let data = count(&file, "tcp.len > 0");
        // A TCP checksum of 0xffff where the sum folds to 0x0000 is the same one's-complement
        // number (RFC 1624 §3) and receivers take it; Wireshark calls it bad. The client's own
        // kernel sent one (one of its ACKs, before the datapath) in about 13,000 packets.
        let zero_as_ffff = count(&file, "tcp.checksum.ffff");
        let good = count(&file, "tcp.checksum.status == \"Good\"") + zero_as_ffff;
        let bad = count(
            &file,
            "ip.checksum.status == \"Bad\" \
             || (tcp.checksum.status == \"Bad\" && !tcp.checksum.ffff)",
        );
        let ts = count(&file, "tcp.options.timestamp.tsval");
        let sack = count(&file, "tcp.options.sack_le");
        let retrans = count(&file, "tcp.analysis.retransmission");
        eprintln!(
            "{dev}: {all} packets, {data} with data, {bad} bad checksums, {ts} with \
             timestamps, {sack} with SACK, {retrans} retransmissions"
        );
        assert!(
            data > 2 * N / 65536,
            "{dev}: the capture missed the transfer"
        );
        assert_eq!(bad, 0, "{dev}: bad checksums");
        assert_eq!(good, all, "{dev}: every TCP checksum checked and good");
        assert!(
            ts * 10 > all * 9,
            "{dev}: timestamps on almost every packet"
        );
        assert!(sack > 0, "{dev}: SACK in use under loss");
        // 2 % loss each way shows as a few per cent; a CI machine that starves a leg past
        // its RTO adds timeouts' retransmissions (11 % seen once). A storm is far more.
        assert!(retrans * 4 < data, "{dev}: a retransmission storm");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ends of spliced connections: a half close from the client (the server goes on sending),
/// a half close from the server (the client goes on sending), and an RST from the client and
/// one from the server, each of which has the datapath remove its connection's entries at
/// once.
#[test]
fn half_closes_carry_on_and_a_reset_ends_the_entries() {
    let Some((ns, c, p, s)) = topology(0) else {
        return;
    };
    let pins = ns.1.clone();
    let front = FRONT;
    let server = SERVER;
    const MORE: usize = 1 << 20;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (handed_tx, handed_rx) = std::sync::mpsc::channel();
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let send = |conn: &mut TcpStream, seed: u8| {
        let buf: Vec<u8> = (0..MORE).map(|i| pattern(i, seed)).collect();
        conn.write_all(&buf).unwrap();
    };
    let read_all = |conn: &mut TcpStream| {
        let mut got = Vec::new();
        conn.read_to_end(&mut got).map(|_| got)
    };
    let srv = in_ns(&s, move || {
        let l = TcpListener::bind(server).unwrap();
        bound_tx.send(()).unwrap();
        let mut conns: Vec<TcpStream> = (0..4)
            .map(|_| {
                let (mut c, _) = l.accept().unwrap();
                c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                welcome(&mut c);
                c
            })
            .collect();
        // 1: the client has half closed; answer after its EOF.
        let got = read_all(&mut conns[0]).unwrap();
        assert!(got.is_empty());
        send(&mut conns[0], 1);
        conns[0].shutdown(std::net::Shutdown::Write).unwrap();
        // 2: half close first, then read what the client still sends.
        conns[1].shutdown(std::net::Shutdown::Write).unwrap();
        let got = read_all(&mut conns[1]).unwrap();
        assert_pattern(&got, MORE, 2, "after the server's half close");
        // 3: the client resets.
        let reset = read_all(&mut conns[2]);
        assert_eq!(
            reset.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::ConnectionReset)
        );
        // 4: the server resets.
        socket2::SockRef::from(&conns[3])
            .set_linger(Some(Duration::ZERO))
            .unwrap();
    });
    let proxy = in_ns(&p, move || {
        let mut dp = Datapath::load(&["p0", "p1"], 1024, &pins).unwrap();
        let l = listener(front);
        ready_tx.send(()).unwrap();
        let splices: Vec<Splice> = (0..4)
            .map(|i| {
                let back = SocketAddrV4::new([10, 77, 2, 1].into(), 40200 + i);
                let s = route_and_hand_over(&mut dp, &l, back, server, None);
                handed_tx.send(()).unwrap();
                s
            })
            .collect();
        let _ = done_rx.recv();
        splices
            .iter()
            .map(|s| dp.carried(s).is_some())
            .collect::<Vec<_>>()
    });
    ready_rx.recv().unwrap();
    bound_rx.recv().unwrap();
    let cli = in_ns(&c, move || {
        let mut conns = Vec::new();
        for _ in 0..4 {
            let conn = greet(front);
            conn.set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            conns.push(conn);
            handed_rx.recv().unwrap();
        }
        conns[0].shutdown(std::net::Shutdown::Write).unwrap();
        let got = read_all(&mut conns[0]).unwrap();
        assert_pattern(&got, MORE, 1, "after the client's half close");
        let got = read_all(&mut conns[1]).unwrap();
        assert!(got.is_empty());
        send(&mut conns[1], 2);
        conns[1].shutdown(std::net::Shutdown::Write).unwrap();
        socket2::SockRef::from(&conns[2])
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(conns.remove(2));
        let reset = read_all(&mut conns[2]);
        assert_eq!(
            reset.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::ConnectionReset)
        );
        conns
    });
    let _open = cli.join().unwrap();
    srv.join().unwrap();
    done_tx.send(()).unwrap();
    // The two half-closed connections keep their entries until expiry; the reset ones' are
    // gone.
    assert_eq!(proxy.join().unwrap(), [true, true, false, false]);
}

/// The proxy's part in [`the_connections_outlive_a_killed_proxy`], run as a process of its
/// own (this test binary again, inside the proxy's namespace): accepts `KSPLICE_CONNS`
/// connections, routes each (reads HELLO, connects to the server, relays WELCOME) and hands it
/// to the kernel, says "handed N" after each, then waits to be killed.
#[test]
#[ignore = "run by the_connections_outlive_a_killed_proxy"]
fn proxy_role() {
    let Ok(pins) = std::env::var("KSPLICE_PINS") else {
        return;
    };
    let n: usize = std::env::var("KSPLICE_CONNS").unwrap().parse().unwrap();
    let front = FRONT;
    let server = SERVER;
    let mut dp = Datapath::load(&["p0", "p1"], 1024, std::path::Path::new(&pins)).unwrap();
    let l = listener(front);
    println!("listening");
    for i in 0..n {
        let back = SocketAddrV4::new([10, 77, 2, 1].into(), 40100 + i as u16);
        route_and_hand_over(&mut dp, &l, back, server, None);
        println!("handed {}", i + 1);
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The proxy process is killed (SIGKILL) while its spliced connections are moving data: every
/// transfer completes byte-exact, because the connections now live in the kernel.
#[test]
fn the_connections_outlive_a_killed_proxy() {
    let Some((ns, c, p, s)) = topology(0) else {
        return;
    };
    const CONNS: usize = 4;
    let front = FRONT;
    let server = SERVER;
    let mut proxy = Command::new("ip")
        .args(["netns", "exec", &p])
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "proxy_role", "--nocapture"])
        .env("KSPLICE_PINS", &ns.1)
        .env("KSPLICE_CONNS", CONNS.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(proxy.stdout.take().unwrap()).lines();
    let mut wait_for = |what: &str| {
        for l in lines.by_ref() {
            if l.unwrap().contains(what) {
                return;
            }
        }
        panic!("the proxy ended before {what:?}");
    };
    wait_for("listening");
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    // Client and server start their transfers once every connection is handed over: the
    // helper hands over quiet sockets only.
    let (server_go_tx, server_go_rx) = std::sync::mpsc::channel::<()>();
    let (client_go_tx, client_go_rx) = std::sync::mpsc::channel::<()>();
    let srv = in_ns(&s, move || {
        let l = TcpListener::bind(server).unwrap();
        bound_tx.send(()).unwrap();
        let mut conns = Vec::new();
        for _ in 0..CONNS {
            let (mut conn, _) = l.accept().unwrap();
            welcome(&mut conn);
            conns.push(conn);
        }
        server_go_rx.recv().unwrap();
        let handles: Vec<_> = conns
            .into_iter()
            .map(|conn| std::thread::spawn(move || exchange(conn, 7)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    bound_rx.recv().unwrap();
    let cli = in_ns(&c, move || {
        let conns: Vec<TcpStream> = (0..CONNS).map(|_| greet(front)).collect();
        client_go_rx.recv().unwrap();
        let handles: Vec<_> = conns
            .into_iter()
            .map(|conn| std::thread::spawn(move || (exchange(conn, 3), std::time::Instant::now())))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    wait_for(&format!("handed {CONNS}"));
    server_go_tx.send(()).unwrap();
    client_go_tx.send(()).unwrap();
    // Mid-transfer: 8 MiB each way per connection take far longer than this.
    std::thread::sleep(Duration::from_millis(20));
    proxy.kill().unwrap();
    proxy.wait().unwrap();
    let killed = std::time::Instant::now();
    assert_outlived(cli.join().unwrap(), killed, N, 7);
    for got in srv.join().unwrap() {
        assert_pattern(&got, N, 3, "transfer");
    }
}
