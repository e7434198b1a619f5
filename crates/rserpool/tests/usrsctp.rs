//! rserpool's SCTP against a second, independent stack: usrsctp (Debian's `libusrsctp`, the
//! stack of Firefox and Chrome), SCTP in UDP, with packet loss. A small echo server linked
//! with it (`tests/fixtures/usrsctp_echo.c`, compiled here with clang) runs in a network
//! namespace; our association (the process's SCTP host, as the PE and PU library use it)
//! sends 300 messages from 1 byte to 4 KiB (fragmented at 1,200) on three streams from
//! another namespace, while nftables drops 10 % of the packets each way on the server's side;
//! every echo comes back exactly once and in stream order, then the association shuts down.
//!
//! Needs root, clang and libusrsctp-dev (`.ci/run` installs them); without them the test says
//! SKIPPED (and fails under `CI`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::bridge::{Net, sh};
use rserpool_asap::sctp::{Carrier, Host};
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

#[test]
fn an_association_with_usrsctp_carries_every_message_through_loss() {
    let Some(server) = echo_server() else { return };
    let net = Net::new(2);
    // 10 % loss each way, on the server's side of the path.
    let ns = &net.names[0];
    sh(&[
        "ip", "netns", "exec", ns, "nft", "add", "table", "inet", "loss",
    ]);
    for (chain, hook, dir) in [("in", "input", "dport"), ("out", "output", "sport")] {
        let spec = format!("{{ type filter hook {hook} priority 0 ; }}");
        sh(&[
            "ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "loss", chain, &spec,
        ]);
        sh(&[
            "ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "loss", chain, "udp", dir,
            "9899", "numgen", "random", "mod", "100", "<", "10", "drop",
        ]);
    }
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(&server)
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
    let ours = net.names[1].clone();
    let result = rserpool_ksplice::testbed::in_ns(&ours, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let host = Host::start(Carrier::Udp, "0.0.0.0:9899".parse().unwrap()).unwrap();
            let peer: SocketAddr = "192.0.2.1:9899".parse().unwrap();
            let mut a =
                tokio::time::timeout(Duration::from_secs(60), host.connect_ephemeral(peer, 7000))
                    .await
                    .expect("associated in time")
                    .expect("associated");
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
        })
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
