//! Component Status reports (rsplib's CSP, `rserpool_wire::csp`) read by rsplib's own monitor
//! and by Wireshark: a registrar, a pool element (`example http`) and a proxy report to
//! Debian's `cspmonitor`, which lists each with its status text, and every report they sent
//! is decoded by tshark's `componentstatusprotocol` dissector with nothing malformed. A relay
//! between them and `cspmonitor` keeps a copy of every datagram for tshark.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{KillOnDrop, example_http, fast_config, free_port, registrar, spawn, wait_for};
use std::io::Write as _;
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Whether `tool` runs here; under CI its absence fails the test (.ci/run installs it).
fn here(tool: &str, probe: &[&str]) -> bool {
    Command::new(tool)
        .args(probe)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
        || !rserpool_ksplice::testbed::skip(&format!("{tool} is missing (.ci/run installs it)"))
}

/// Forwards every datagram to `to`, keeping a copy.
fn relay(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<Vec<u8>>>>) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let copy = kept.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(n) = sock.recv(&mut buf) {
            copy.lock().unwrap().push(buf[..n].to_vec());
            let _ = sock.send_to(&buf[..n], to);
        }
    });
    (addr, kept)
}

/// A component as `cspmonitor` lists it: its kind and ID (`PE $1234abcd`), its status text.
type Listed = (String, String);

/// The components of `cspmonitor`'s latest screen, and the counts of registrars, PEs and PUs
/// it shows.
fn monitor_screen(out: &std::path::Path) -> (Vec<Listed>, Option<(u32, u32, u32)>) {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let Some((_, last)) = text.rsplit_once("Current Component Status -- ") else {
        return (Vec::new(), None);
    };
    let mut plain = String::new();
    let mut chars = last.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An escape sequence: up to its final letter.
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let counts = plain.lines().next().and_then(|l| {
        let n: Vec<u32> = l
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        (n.len() >= 3).then(|| (n[0], n[1], n[2]))
    });
    let entries = plain
        .lines()
        .filter(|l| l.starts_with("PR $") || l.starts_with("PE $") || l.starts_with("PU $"))
        .map(|l| {
            let who = l.split(" [").next().unwrap_or("").to_owned();
            let status = l.split('"').nth(1).unwrap_or("").to_owned();
            (who, status)
        })
        .collect();
    (entries, counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cspmonitor_lists_a_registrar_a_pe_and_a_proxy_and_tshark_decodes_their_reports() {
    if !here("cspmonitor", &["-bad-argument"]) || !here("tshark", &["-v"]) {
        return;
    }
    let monitor_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let screen = std::env::temp_dir().join(format!("rserpool-cspmonitor-{}.txt", free_port()));
    let file = std::fs::File::create(&screen).unwrap();
    let _monitor = KillOnDrop(
        Command::new("cspmonitor")
            .arg(format!("-localaddress={monitor_addr}"))
            .arg("-updateinterval=200")
            .stdout(file)
            .stderr(Stdio::null())
            .stdin(Stdio::null())
            .spawn()
            .expect("cspmonitor"),
    );
    let (csp, kept) = relay(monitor_addr);
    let csp_arg = csp.to_string();

    let reg = registrar(rserpool_registrar::Config {
        csp: Some(csp),
        csp_interval_ms: 250,
        ..fast_config()
    });
    let r = reg.asap_addr().to_string();
    let _pe = example_http(
        reg.asap_addr(),
        "Web",
        0x1234_abcd,
        &["--csp", &csp_arg, "--csp-interval-ms", "250"],
    )
    .await;
    let front = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _proxy = spawn(&[
        "proxy",
        "--listen",
        &front.to_string(),
        "--pool",
        "Web",
        "--registrar",
        &r,
        "--refresh-ms",
        "200",
        "--csp",
        &csp_arg,
    ]);

    let pr = format!("PR ${:08x}", reg.server_id());
    wait_for(
        Duration::from_secs(15),
        "cspmonitor lists all three",
        || {
            let screen = screen.clone();
            let pr = pr.clone();
            async move {
                let (entries, counts) = monitor_screen(&screen);
                let status = |who: &str| {
                    entries
                        .iter()
                        .find(|(w, _)| w.starts_with(who))
                        .map(|(_, s)| s.clone())
                };
                let want = [
                    (pr.as_str(), "1[1] PEs in 1 Pool, 0 Peers".to_owned()),
                    (
                        "PE $1234abcd",
                        format!("Registered at registrar ${}", &pr[4..]),
                    ),
                    // No client: none (the accept loop's waiting permit is no connection).
                    ("PU $", "0 Connections to 1 Pool of 1 PE".to_owned()),
                ];
                if counts != Some((1, 1, 1)) {
                    return Err(format!("counts {counts:?}, entries {entries:?}"));
                }
                for (who, s) in &want {
                    if status(who).as_deref() != Some(s.as_str()) {
                        return Err(format!("{who}: {:?}, entries {entries:?}", status(who)));
                    }
                }
                Ok(())
            }
        },
    )
    .await;

    // Every report sent, as tshark sees it on the monitor's port: decoded, none malformed.
    let reports = kept.lock().unwrap().clone();
    assert!(reports.len() >= 6, "{} reports", reports.len());
    let dir = std::env::temp_dir().join(format!("rserpool-csp-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let (hex, pcap) = (dir.join("reports.txt"), dir.join("reports.pcap"));
    let mut dump = std::fs::File::create(&hex).unwrap();
    for r in &reports {
        for (i, line) in r.chunks(16).enumerate() {
            let bytes: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(dump, "{:06x}  {}", i * 16, bytes.join(" ")).unwrap();
        }
        writeln!(dump).unwrap();
    }
    drop(dump);
    let made = Command::new("text2pcap")
        .args(["-q", "-u", "40000,2960"])
        .arg(&hex)
        .arg(&pcap)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let fields = Command::new("tshark")
        .args(["-r"])
        .arg(&pcap)
        .args([
            "-T",
            "fields",
            "-e",
            "componentstatusprotocol.message_sender_id.group",
            "-e",
            "componentstatusprotocol.componentstatusreport_status",
            "-e",
            "_ws.malformed",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let lines: Vec<String> = String::from_utf8_lossy(&fields.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), reports.len(), "{lines:?}");
    for l in &lines {
        let f: Vec<&str> = l.split('\t').collect();
        assert!(
            f.len() == 3 && ["0x0001", "0x0002", "0x0003"].contains(&f[0]) && f[2].is_empty(),
            "not a clean CSP report: {l:?}"
        );
    }
    assert!(
        lines.iter().any(|l| l.contains("PEs in 1 Pool")),
        "{lines:?}"
    );
    let _ = std::fs::remove_file(&screen);
}
