//! rserpool's SCTP against a second, independent stack: usrsctp (Debian's `libusrsctp`, the
//! stack of Firefox and Chrome), SCTP in UDP, with packet loss. A small echo server linked
//! with it (`tests/fixtures/usrsctp_echo.c`, compiled here with clang) runs in a network
//! namespace; our association (the process's SCTP host, as the PE and PU library use it)
//! sends 300 messages from 1 byte to 4 KiB (fragmented at 1,200) on three streams from
//! another namespace, while nftables drops 10 % of the packets each way on the server's side;
//! every echo comes back exactly once and in stream order, then the association shuts down.
//!
//! Multi-homed: both hosts on two networks, our association lists both our addresses and
//! learns both of the server's; the network it started on is cut in the middle of the
//! exchange, and every echo still comes back, over the other network.
//!
//! Needs root, clang and libusrsctp-dev (`.ci/run` installs them); without them the test says
//! SKIPPED (and fails under `CI`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::bridge::{Net, sh};
use rserpool_asap::sctp::{Association, Carrier, Host};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The echo server, compiled for this run; `None` (after saying why) when it cannot be.
fn echo_server() -> Option<PathBuf> {
    if !rustix::process::geteuid().is_root() {
        rserpool_ksplice::testbed::skip("the usrsctp test needs root (network namespaces)");
        return None;
    }
    if !std::path::Path::new("/usr/include/usrsctp.h").exists() {
        rserpool_ksplice::testbed::skip("libusrsctp-dev is not installed (.ci/run installs it)");
        return None;
    }
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/usrsctp_echo.c");
    let out = std::env::temp_dir().join(format!("usrsctp-echo-{}", std::process::id()));
    let built = Command::new("clang")
        .args(["-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .args(["-lusrsctp", "-lpthread"])
        .status();
    match built {
        Ok(s) if s.success() => Some(out),
        other => {
            rserpool_ksplice::testbed::skip(&format!(
                "cannot compile {}: {other:?}",
                src.display()
            ));
            None
        }
    }
}

fn message(i: usize) -> Bytes {
    let len = [1, 17, 400, 1_199, 1_200, 2_500, 4_096][i % 7];
    Bytes::from(
        (0..len)
            .map(|k| (i.wrapping_mul(31) + k) as u8)
            .collect::<Vec<u8>>(),
    )
}

/// Runs `body` in namespace `ns` with an association from our host (on the wildcard address,
/// UDP 9899) to the echo server at 192.0.2.1.
fn associated<T, F, Fut>(ns: &str, body: F) -> std::thread::JoinHandle<T>
where
    T: Send + 'static,
    F: FnOnce(Association) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    rserpool_ksplice::testbed::in_ns(ns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let host = Host::start(Carrier::Udp, "0.0.0.0:9899".parse().unwrap()).unwrap();
            let peer: SocketAddr = "192.0.2.1:9899".parse().unwrap();
            let a =
                tokio::time::timeout(Duration::from_secs(60), host.connect_ephemeral(peer, 7000))
                    .await
                    .expect("associated in time")
                    .expect("associated");
            body(a).await
        })
    })
}

/// An nftables table `name` in namespace `ns` with an input and an output chain, each with
/// the rule `matching` (its words, the port direction filled in: `dport` in, `sport` out).
fn nft_both_ways(ns: &str, name: &str, matching: &[&str]) {
    sh(&[
        "ip", "netns", "exec", ns, "nft", "add", "table", "inet", name,
    ]);
    for (chain, hook, dir, iface) in [
        ("in", "input", "dport", "iifname"),
        ("out", "output", "sport", "oifname"),
    ] {
        let spec = format!("{{ type filter hook {hook} priority 0 ; }}");
        sh(&[
            "ip", "netns", "exec", ns, "nft", "add", "chain", "inet", name, chain, &spec,
        ]);
        let rule: Vec<&str> = matching
            .iter()
            .map(|w| match *w {
                "DIR" => dir,
                "IFACE" => iface,
                w => w,
            })
            .collect();
        let mut args = vec![
            "ip", "netns", "exec", ns, "nft", "add", "rule", "inet", name, chain,
        ];
        args.extend(rule);
        sh(&args);
    }
}

/// The echo server running in `ns`, once it says it listens.
fn start_server(ns: &str, server: &std::path::Path) -> std::process::Child {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(server)
        .args(["9899", "7000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "listening");
    child
}

#[test]
fn an_association_with_usrsctp_carries_every_message_through_loss() {
    let Some(server) = echo_server() else { return };
    let net = Net::new(2);
    // 10 % loss each way, on the server's side of the path.
    let ns = &net.names[0];
    nft_both_ways(
        ns,
        "loss",
        &[
            "udp", "DIR", "9899", "numgen", "random", "mod", "100", "<", "10", "drop",
        ],
    );
    let mut child = start_server(ns, &server);
    let ours = net.names[1].clone();
    let result = associated(&ours, |mut a| async move {
        let n = 300;
        for i in 0..n {
            a.send((i % 3) as u16, 50 + (i % 2) as u32, message(i))
                .unwrap();
        }
        let mut got: Vec<Vec<(u32, Bytes)>> = vec![Vec::new(); 3];
        let mut count = 0;
        while count < n {
            let m = tokio::time::timeout(Duration::from_secs(120), a.recv())
                .await
                .expect("echoes keep coming")
                .expect("the association lives");
            got[usize::from(m.stream)].push((m.ppid, m.data));
            count += 1;
        }
        drop(a);
        // The shutdown goes out on the host's task.
        tokio::time::sleep(Duration::from_millis(500)).await;
        got
    });
    let got = result.join();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&server);
    let got = got.unwrap();
    for (stream, echoes) in got.iter().enumerate() {
        let want: Vec<(u32, Bytes)> = (0..300)
            .filter(|i| i % 3 == stream)
            .map(|i| (50 + (i % 2) as u32, message(i)))
            .collect();
        assert_eq!(echoes.len(), want.len(), "stream {stream}");
        assert!(
            *echoes == want,
            "stream {stream}: echoes differ from what was sent, or their order"
        );
    }
    drop(net);
}

/// Packets counted by the rule of chain `chain` in table `table` of `ns`.
fn nft_packets(ns: &str, table: &str, chain: &str) -> u64 {
    let out = Command::new("ip")
        .args([
            "netns", "exec", ns, "nft", "list", "chain", "inet", table, chain,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_multi_homed_association_with_usrsctp_survives_the_loss_of_a_network() {
    let Some(server) = echo_server() else { return };
    let net = Net::new(2);
    net.second_network();
    let ns = net.names[0].clone();
    // Packets on the second network, counted on the server's side.
    nft_both_ways(
        &ns,
        "second",
        &["IFACE", "br1", "udp", "DIR", "9899", "counter"],
    );
    let mut child = start_server(&ns, &server);
    let ours = net.names[1].clone();
    let cut_ns = ours.clone();
    // Bound to the wildcard address, our host's INIT lists 192.0.2.2 and 198.51.100.2.
    let result = associated(&ours, move |mut a| async move {
        let mut got = Vec::new();
        for i in 0..50 {
            a.send(0, 51, message(i)).unwrap();
        }
        while got.len() < 50 {
            let m = tokio::time::timeout(Duration::from_secs(30), a.recv())
                .await
                .expect("echoes before the cut")
                .expect("the association lives");
            got.push(m.data);
        }
        // Both ends confirm each other's second address by heartbeat first.
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Network 1 goes dark, both ways: dropped on our side, where it costs us a
        // refused send and the server nothing but silence (a sender told of the drop
        // at once, as usrsctp would be on its own host, does not time out).
        nft_both_ways(
            &cut_ns,
            "cut",
            &["IFACE", "eth0", "udp", "DIR", "9899", "drop"],
        );
        let cut = std::time::Instant::now();
        for i in 50..250 {
            a.send(0, 51, message(i)).unwrap();
        }
        while got.len() < 250 {
            let m = tokio::time::timeout(Duration::from_secs(60), a.recv())
                .await
                .unwrap_or_else(|_| panic!("{} echoes, then none after the cut", got.len()))
                .expect("the association survives the cut");
            got.push(m.data);
        }
        let took = cut.elapsed();
        drop(a);
        tokio::time::sleep(Duration::from_millis(500)).await;
        (got, took)
    });
    let outcome = result.join();
    let on_second = nft_packets(&ns, "second", "in") + nft_packets(&ns, "second", "out");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&server);
    let (got, took) = outcome.unwrap();
    let want: Vec<Bytes> = (0..250).map(message).collect();
    assert!(
        got == want,
        "echoes differ from what was sent, or their order"
    );
    eprintln!("200 echoes after the cut in {took:?}; {on_second} packets on the second network");
    assert!(
        on_second > 100,
        "only {on_second} packets went over the second network"
    );
    drop(net);
}
