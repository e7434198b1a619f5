//! `rserpool proxy` with a TCP listener `splice = "kernel"` (issue 21), in network namespaces:
//! client | proxy (with the registrar) | server (an echo PE). Each connection is handed to the
//! eBPF datapath once routed; the proxy process is then killed with SIGKILL in the middle of
//! the transfers, and every transfer completes byte-exact.
//!
//! Needs root, iproute2 and a build with clang (`.ci/run` installs them); without them the
//! test is skipped, except under `CI`, where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop};
use rserpool_ksplice::testbed::{assert_pattern, in_ns, pattern, topology, without_timestamps};
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CONNS: usize = 4;
const BYTES: usize = 8 << 20;

fn spawn_in(ns: &str, args: &[&str]) -> KillOnDrop {
    KillOnDrop(
        Command::new("ip")
            .args(["netns", "exec", ns, BIN])
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("KSPLICE_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Established connections on the proxy's front port, in its namespace.
fn front_sockets(ns: &str) -> usize {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "ss",
            "-Htn",
            "state",
            "established",
            "( sport = :7000 )",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// Sends `BYTES` of a pattern and reads the echo, at once.
fn echo_transfer(mut conn: TcpStream) -> Vec<u8> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut w = conn.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let buf: Vec<u8> = (0..BYTES).map(|i| pattern(i, 5)).collect();
        w.write_all(&buf).unwrap();
        w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut got = Vec::with_capacity(BYTES);
    conn.read_to_end(&mut got).unwrap();
    writer.join().unwrap();
    got
}

#[test]
fn spliced_connections_outlive_a_killed_proxy() {
    let Some((ns, c, p, s)) = topology(0) else {
        return;
    };
    without_timestamps(&p);
    let _registrar = spawn_in(
        &p,
        &["registrar", "--asap", "10.77.2.1:3863", "--status", "off"],
    );
    std::thread::sleep(Duration::from_millis(200));
    let _pe = spawn_in(
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
    let cfg = format!(
        r#"
registrars = ["10.77.2.1:3863"]
refresh-ms = 200
[[listener]]
listen = "10.77.1.1:7000"
mode = "tcp"
pool = "KPool"
splice = "kernel"
[kernel-splice]
interfaces = ["p0", "p1"]
pin-dir = "{}"
"#,
        ns.1.display()
    );
    let dir = std::env::temp_dir().join(format!("ksplice-proxy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("proxy.toml");
    std::fs::write(&path, cfg).unwrap();
    let mut proxy = spawn_in(&p, &["proxy", "--config", path.to_str().unwrap()]);
    let front: SocketAddrV4 = "10.77.1.1:7000".parse().unwrap();

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

    // Each connection is routed (its first bytes echo), then left to the kernel: the proxy
    // holds no socket of it any more. Then the transfers start.
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let cli = in_ns(&c, move || {
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
    while front_sockets(&p) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the proxy kept its sockets: no hand-over"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    go_tx.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    proxy.0.kill().unwrap();
    proxy.0.wait().unwrap();
    let killed = Instant::now();
    let done = cli.join().unwrap();
    assert!(
        done.iter().any(|(_, at)| *at > killed),
        "every transfer ended before the kill: the test proved nothing"
    );
    for (got, _) in done {
        assert_pattern(&got, BYTES, 5, "transfer");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
