//! `rserpool proxy` with a TCP listener `splice = "kernel"` (docs/KSPLICE.md), in network namespaces:
//! client | proxy (with the registrar) | server (an echo PE), TCP timestamps on as by
//! default. Each connection is handed to the eBPF datapath once routed; the proxy process is
//! then killed with SIGKILL in the middle of 20 transfers of 50 MiB each way, and every
//! transfer completes byte-exact. A thousand short connections leave no flow entries behind.
//!
//! Needs root, iproute2 and a build with clang (`.ci/run` installs them); without them the
//! test is skipped, except under `CI`, where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::KillOnDrop;
use rserpool_ksplice::testbed::{
    Netns, SharedBpffs, assert_outlived, assert_pattern, in_ns, patterned, send_and_read, topology,
};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

const CONNS: usize = 20;
const BYTES: usize = 50 << 20;

fn spawn_in(ns: &str, args: &[&str]) -> KillOnDrop {
    common::spawn_in(ns, args, "KSPLICE_TEST_LOG")
}

/// Established connections on the proxy's front port (TCP listener), in its namespace.
fn front_sockets(ns: &str) -> usize {
    sockets_on(ns, 7000)
}

/// Established connections on local port `port` in namespace `ns`.
fn sockets_on(ns: &str, port: u16) -> usize {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "ss",
            "-Htn",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// Sends `BYTES` of a pattern and reads the echo, at once.
fn echo_transfer(conn: TcpStream) -> Vec<u8> {
    send_and_read(conn, patterned(BYTES, 5))
}

/// The namespaces, the registrar and the echo PE, and the proxy with `extra` in its config;
/// returns once a short exchange echoes through the proxy.
struct Setup {
    _ns: Netns,
    c: String,
    p: String,
    _processes: [KillOnDrop; 3],
    proxy: KillOnDrop,
    dir: std::path::PathBuf,
}

const FRONT: &str = "10.77.1.1:7000";
const STATUS: &str = "10.77.2.1:8404";
const HTTP_FRONT: &str = "10.77.1.1:7080";

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The proxy's configuration: its listeners with `splice = "{splice}"`, and `extra` in its
/// `[kernel-splice]` section.
fn proxy_config(pins: &std::path::Path, splice: &str, extra: &str) -> String {
    format!(
        r#"
registrars = ["10.77.2.1:3863"]
refresh-ms = 200
status = "{STATUS}"
[[listener]]
listen = "{FRONT}"
mode = "tcp"
pool = "KPool"
splice = "{splice}"
[[listener]]
listen = "{HTTP_FRONT}"
mode = "http"
pool = "HPool"
splice = "{splice}"
[[listener.route]]
prefix = "/user/"
pool = "HPool"
splice = "user"
[kernel-splice]
interfaces = ["p0", "p1"]
pin-dir = "{}"
{extra}
"#,
        pins.display()
    )
}

fn setup(extra: &str) -> Option<Setup> {
    setup_with("kernel", extra, None)
}

/// `pins`: where the maps are pinned, when not in the namespaces' own directory.
fn setup_with(splice: &str, extra: &str, pins: Option<&std::path::Path>) -> Option<Setup> {
    let (ns, c, p, s) = topology(0)?;
    let registrar = spawn_in(
        &p,
        &["registrar", "--asap", "10.77.2.1:3863", "--status", "off"],
    );
    std::thread::sleep(Duration::from_millis(200));
    let pe = spawn_in(
        &s,
        &[
            "example",
            "echo",
            "--listen",
            "10.77.2.2:9000",
            "--pool",
            "KPool",
            "--registrar",
            "10.77.2.1:3863",
        ],
    );
    let web = spawn_in(
        &s,
        &[
            "example",
            "http",
            "--listen",
            "10.77.2.2:9080",
            "--pool",
            "HPool",
            "--registrar",
            "10.77.2.1:3863",
        ],
    );
    let cfg = proxy_config(pins.unwrap_or(&ns.1), splice, extra);
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ksplice-proxy-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("proxy.toml");
    std::fs::write(&path, cfg).unwrap();
    let proxy = spawn_in(&p, &["proxy", "--config", path.to_str().unwrap()]);
    let front: SocketAddrV4 = FRONT.parse().unwrap();
    // Ready when a short exchange echoes through the proxy.
    let probe = in_ns(&c, move || {
        let t0 = Instant::now();
        loop {
            let ok = TcpStream::connect_timeout(&front.into(), Duration::from_secs(1))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_secs(2)))?;
                    s.write_all(b"ping")?;
                    let mut b = [0u8; 4];
                    s.read_exact(&mut b)?;
                    Ok(&b == b"ping")
                })
                .unwrap_or(false);
            if ok {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "the proxy never echoed"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    probe.join().unwrap();
    Some(Setup {
        _ns: ns,
        c,
        p,
        _processes: [registrar, pe, web],
        proxy,
        dir,
    })
}

/// The proxy's status, read from inside its namespace.
fn status(p: &str) -> serde_json::Value {
    in_ns(p, || {
        let mut s = TcpStream::connect(STATUS).unwrap();
        s.write_all(b"GET /status HTTP/1.0\r\n\r\n").unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        let body = reply.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(body).unwrap()
    })
    .join()
    .unwrap()
}

/// The proxy's `kernel_splice` stats.
fn kernel_stats(p: &str) -> serde_json::Value {
    status(p)["kernel_splice"].clone()
}

/// Bytes the proxy counts from clients to the PEs of `pool`.
fn bytes_in(p: &str, pool: &str) -> u64 {
    let st = status(p);
    st["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| x["pool"] == pool)
        .flat_map(|x| x["pool_elements"].as_array().cloned().unwrap_or_default())
        .filter_map(|pe| pe["bytes_in"].as_u64())
        .sum()
}

/// `CONNS` connections through the TCP front, each routed (its first bytes echo) and then left
/// to the kernel (the proxy holds no socket of it any more); the transfers start when the
/// sender says so. Returns each transfer's echo and when it ended.
#[allow(clippy::type_complexity)]
fn spliced_transfers(
    c: &str,
    p: &str,
) -> (
    std::thread::JoinHandle<Vec<(Vec<u8>, Instant)>>,
    std::sync::mpsc::Sender<()>,
) {
    let front: SocketAddrV4 = FRONT.parse().unwrap();
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let cli = in_ns(c, move || {
        let mut conns = Vec::new();
        for _ in 0..CONNS {
            let mut s = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(b"HELLO").unwrap();
            let mut b = [0u8; 5];
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"HELLO");
            conns.push(s);
        }
        opened_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        let handles: Vec<_> = conns
            .into_iter()
            .map(|s| std::thread::spawn(move || (echo_transfer(s), Instant::now())))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    opened_rx.recv().unwrap();
    let t0 = Instant::now();
    while front_sockets(p) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the proxy kept its sockets: no hand-over"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (cli, go_tx)
}

#[test]
fn spliced_connections_outlive_a_killed_proxy() {
    let Some(mut setup) = setup("") else {
        return;
    };
    let (cli, go) = spliced_transfers(&setup.c, &setup.p);
    go.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    setup.proxy.0.kill().unwrap();
    setup.proxy.0.wait().unwrap();
    let killed = Instant::now();
    assert_outlived(cli.join().unwrap(), killed, BYTES, 5);
}

/// An upgrade in the middle of 20 spliced transfers (docs/OPERATIONS.md): a second proxy
/// started with the same configuration takes the listeners over and loads the datapath again
/// (its filter replaced in place, the pinned flow table kept); the old one exits. Every
/// transfer completes byte-exact, and the new process hands new connections to the kernel.
#[test]
fn spliced_connections_outlive_an_upgrade_and_the_new_process_splices() {
    let Some(bpffs) = SharedBpffs::mount("rserpool-ksplice") else {
        return;
    };
    let Some(mut setup) = setup_with("kernel", "", Some(&bpffs.0.join("pins"))) else {
        return;
    };
    let (c, p) = (setup.c.clone(), setup.p.clone());
    let (cli, go) = spliced_transfers(&c, &p);
    go.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let config = setup.dir.join("proxy.toml");
    let _next = spawn_in(&p, &["proxy", "--config", config.to_str().unwrap()]);
    let t0 = Instant::now();
    while setup.proxy.0.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the old proxy did not hand over and exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let upgraded = Instant::now();
    assert_outlived(cli.join().unwrap(), upgraded, BYTES, 5);
    // The new process splices: a few new connections are handed to the kernel by it.
    let before = kernel_stats(&p)["handed_over"].as_u64().unwrap();
    let front: SocketAddrV4 = FRONT.parse().unwrap();
    let conns = in_ns(&c, move || {
        (0..3)
            .map(|_| {
                let mut s =
                    TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                s.write_all(b"AGAIN").unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                assert_eq!(&b, b"AGAIN");
                s
            })
            .collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    let t0 = Instant::now();
    while kernel_stats(&p)["handed_over"].as_u64().unwrap() < before + 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the new process handed none of its connections to the kernel: {}",
            kernel_stats(&p)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conns);
}

/// A thousand short connections from 20 clients at once, each handed to the kernel or kept in
/// user space when it ends before it is quiet (both kinds at once): every one echoes exactly,
/// and once they are closed the flow table empties (FIN in both directions, then
/// `fin-timeout-ms`).
#[test]
fn a_thousand_short_connections_leave_no_entries() {
    let Some(setup) = setup("fin-timeout-ms = 300") else {
        return;
    };
    const CLIENTS: usize = 20;
    const EACH: usize = 50;
    let front: SocketAddrV4 = FRONT.parse().unwrap();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|k| {
            in_ns(&setup.c, move || {
                for i in 0..EACH {
                    let mut s =
                        TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let msg = format!("client {k} connection {i}\n");
                    s.write_all(msg.as_bytes()).unwrap();
                    let mut got = vec![0u8; msg.len()];
                    s.read_exact(&mut got).unwrap();
                    assert_eq!(got, msg.as_bytes());
                    // A second exchange, most often through the kernel.
                    std::thread::sleep(Duration::from_millis(2));
                    s.write_all(msg.as_bytes()).unwrap();
                    s.read_exact(&mut got).unwrap();
                    assert_eq!(got, msg.as_bytes());
                    s.shutdown(std::net::Shutdown::Write).unwrap();
                    assert_eq!(s.read(&mut got).unwrap(), 0);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let t0 = Instant::now();
    let stats = loop {
        let k = kernel_stats(&setup.p);
        if k["entries"] == 0 && k["expired_closed"].as_u64() > Some(0) {
            break k;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the flow table kept entries: {k}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("kernel splice stats: {stats}");
    let (handed, user) = (
        stats["handed_over"].as_u64().unwrap(),
        stats["user_space"].as_u64().unwrap(),
    );
    // The readiness probes count too.
    assert!(handed + user > (CLIENTS * EACH) as u64, "{stats}");
    // Whether a connection goes quiet before its next exchange depends on the client's
    // delayed ACKs; about half do on this machine.
    assert!(handed >= (CLIENTS * EACH / 10) as u64, "{stats}");
    assert_eq!(stats["table_full"], 0, "{stats}");
    assert!(stats["fins"].as_u64() >= Some(2 * handed), "{stats}");
}

/// Waits until the web PE answers through the proxy's HTTP listener (it registers on its
/// own time).
fn wait_for_web_pe(c: &str, front: SocketAddrV4) {
    in_ns(c, move || {
        let t0 = Instant::now();
        loop {
            let mut s = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            if get(&mut s, "/user/ready").0 == 200 {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(15), "no web PE");
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .join()
    .unwrap();
}

/// One HTTP/1.1 GET on `s`: the status and the body.
fn get(s: &mut TcpStream, path: &str) -> (u16, Vec<u8>) {
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: k\r\n\r\n").as_bytes())
        .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    let code = head[9..12].parse().unwrap();
    let len = common::content_length(&head);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    (code, body)
}

/// An HTTP listener with `splice = "kernel"`: the first request of a connection is routed
/// (and gets its forwarding headers), then the connection is pinned to that PE and handed to
/// the kernel. Its later requests reach the same PE unchanged — even after the proxy is
/// killed. A long download as a connection's first request goes by the kernel too. A route with `splice = "user"` keeps its connections in the proxy: each request is
/// rewritten.
#[test]
fn an_http_route_pins_its_connection_and_hands_it_to_the_kernel() {
    // The long download is held early, however fast this machine relays it in user space; a
    // client thread starved by a busy CI machine may read nothing for a while meanwhile (the
    // drain's stall rule is not what this test is about).
    let Some(mut setup) = setup("hold-after-ms = 50\ndrain-stall-ms = 1000") else {
        return;
    };
    let front: SocketAddrV4 = HTTP_FRONT.parse().unwrap();
    let connect = move || {
        let s = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    wait_for_web_pe(&setup.c, front);
    // The TCP listener's readiness probe may have been handed over too.
    let before = kernel_stats(&setup.p)["handed_over"].as_u64().unwrap();
    let (asked_tx, asked_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let client = in_ns(&setup.c, move || {
        // Not pinned: every request is the proxy's, forwarding headers and all.
        let mut u = connect();
        for path in ["/user/a", "/user/b"] {
            let (code, body) = get(&mut u, path);
            assert_eq!(code, 200);
            let body = String::from_utf8(body).unwrap();
            assert!(
                body.ends_with(&format!("GET {path} for 10.77.1.2\n")),
                "{body}"
            );
        }
        drop(u);
        // Pinned: the first request is routed, the rest goes by the kernel.
        let mut k = connect();
        let (code, body) = get(&mut k, "/first");
        assert_eq!(code, 200);
        let first = String::from_utf8(body).unwrap();
        assert!(first.ends_with("GET /first for 10.77.1.2\n"), "{first}");
        asked_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        let (code, body) = get(&mut k, "/bytes/8388608");
        assert_eq!(code, 200);
        assert_pattern(&body, 8 << 20, 0, "download");
        asked_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        // A long download as the first request: handed over at the first quiet moment
        // (before the response, or held and drained in its middle).
        let mut d = connect();
        let (code, body) = get(&mut d, "/bytes/268435456");
        assert_eq!(code, 200);
        assert_pattern(&body, 256 << 20, 0, "long download");
        asked_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        // The proxy is gone: the same PE answers, and no proxy added headers.
        let (code, body) = get(&mut k, "/after");
        assert_eq!(code, 200);
        let after = String::from_utf8(body).unwrap();
        assert_eq!(after[..13], first[..13], "the same PE");
        assert!(after.ends_with("GET /after for -\n"), "{after}");
    });
    asked_rx.recv().unwrap();
    let t0 = Instant::now();
    while sockets_on(&setup.p, 7080) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the proxy kept its sockets: no hand-over"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    go_tx.send(()).unwrap();
    asked_rx.recv().unwrap();
    go_tx.send(()).unwrap();
    asked_rx.recv().unwrap();
    let stats = kernel_stats(&setup.p);
    eprintln!("kernel splice stats: {stats}");
    assert_eq!(stats["handed_over"].as_u64(), Some(before + 2), "{stats}");
    // Most of the long download went by the kernel.
    assert!(stats["bytes"].as_u64() > Some((8 + 128) << 20), "{stats}");
    setup.proxy.0.kill().unwrap();
    setup.proxy.0.wait().unwrap();
    go_tx.send(()).unwrap();
    client.join().unwrap();
}

/// A connection busy from its first byte (a PUT of 64 MiB through an HTTP route that pins
/// its connection) is never quiet by itself: it is held (the client's new data dropped, to
/// be sent again through the splice; the PE's ACKs let through) until the proxy's sockets
/// drain, then handed over mid-upload. The PE receives every byte.
#[test]
fn a_busy_upload_is_held_drained_and_handed_over() {
    let Some(setup) = setup("hold-after-ms = 50") else {
        return;
    };
    // Long enough to be busy past hold-after-ms on a fast machine too.
    const UPLOAD: usize = 64 << 20;
    let front: SocketAddrV4 = HTTP_FRONT.parse().unwrap();
    wait_for_web_pe(&setup.c, front);
    let before = kernel_stats(&setup.p);
    let answer = in_ns(&setup.c, move || {
        let mut request = format!(
            "PUT /up HTTP/1.1\r\nHost: k\r\nConnection: close\r\nContent-Length: {UPLOAD}\r\n\r\n"
        )
        .into_bytes();
        request.extend_from_slice(&patterned(UPLOAD, 1));
        let mut s = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(&request).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    })
    .join()
    .unwrap();
    assert!(
        answer.contains(&format!("received {UPLOAD} bytes")),
        "{answer}"
    );
    let after = kernel_stats(&setup.p);
    eprintln!("kernel splice stats: {after}");
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        n(&after, "handed_over"),
        n(&before, "handed_over") + 1,
        "{after}"
    );
    assert_eq!(
        n(&after, "held_to_drain"),
        n(&before, "held_to_drain") + 1,
        "{after}"
    );
    assert!(
        n(&after, "bytes") - n(&before, "bytes") > (UPLOAD / 2) as u64,
        "{after}"
    );
    // The bytes the kernel carried count for the PE too (at the next expiry pass).
    let t0 = Instant::now();
    while bytes_in(&setup.p, "HPool") < UPLOAD as u64 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the PE's bytes_in stayed at {}",
            bytes_in(&setup.p, "HPool")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A proxy started without the kernel splice loads it on a reload (SIGHUP) that asks for it:
/// the listener it already had hands its connections over from then on.
#[test]
fn a_reload_turns_the_kernel_splice_on() {
    let Some(setup) = setup_with("user", "", None) else {
        return;
    };
    assert!(
        kernel_stats(&setup.p).is_null(),
        "loaded before it was asked for"
    );
    std::fs::write(
        setup.dir.join("proxy.toml"),
        proxy_config(&setup._ns.1, "kernel", ""),
    )
    .unwrap();
    let pid = rustix::process::Pid::from_raw(setup.proxy.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    let t0 = Instant::now();
    while kernel_stats(&setup.p).is_null() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not loaded on reload"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let front: SocketAddrV4 = FRONT.parse().unwrap();
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let client = in_ns(&setup.c, move || {
        let mut s = TcpStream::connect_timeout(&front.into(), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"HELLO").unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        opened_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        send_and_read(s, patterned(1 << 20, 5))
    });
    opened_rx.recv().unwrap();
    let t0 = Instant::now();
    while front_sockets(&setup.p) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the proxy kept its sockets: no hand-over after the reload"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    go_tx.send(()).unwrap();
    assert_pattern(&client.join().unwrap(), 1 << 20, 5, "after the reload");
    let stats = kernel_stats(&setup.p);
    assert!(stats["handed_over"].as_u64() >= Some(1), "{stats}");
}
