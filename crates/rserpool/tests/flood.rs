//! A handle-resolution flood (RFC 5355 §3.4) at a registrar process on its defaults, with
//! `rserpool attack resolve-flood` over four associations that reconnect when closed: the rate
//! limit refuses it, an association that has a second's worth refused in a row is closed, a
//! legitimate pool user is
//! still answered promptly, the registrar's memory stays bounded and it logs one line per
//! source and minute, not one per refused request or association.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, Logged, free_port, wait_for};
use rserpool_asap::{PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_wire::{Policy, PoolHandle};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// `rserpool registrar` on a free ASAP port with `extra` flags, logging warnings; once it
/// listens.
async fn registrar(extra: &[&str]) -> (Logged, SocketAddr) {
    let asap = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut args: Vec<String> = ["registrar", "--asap", &asap.to_string(), "--status", "off"]
        .map(String::from)
        .to_vec();
    args.extend(extra.iter().map(|a| a.to_string()));
    let reg = Logged::spawn("registrar", &args, "warn");
    wait_for(
        Duration::from_secs(10),
        "the registrar listens",
        || async move { tokio::net::TcpStream::connect(asap).await.is_ok() },
    )
    .await;
    (reg, asap)
}

/// `rserpool attack ARGS --registrar ASAP`, to its end.
async fn attack(asap: SocketAddr, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("attack")
        .args(args)
        .args(["--registrar", &asap.to_string()])
        .env("RUST_LOG", "off");
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_flood_is_refused_and_others_are_served() {
    let (reg, asap) = registrar(&[]).await;
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg =
        PoolElementConfig::new("Flooded", service.local_addr().unwrap(), Policy::RoundRobin);
    cfg.registrars = vec![asap];
    let pe = PoolElement::start(cfg).unwrap();
    pe.wait_registered(Duration::from_secs(5)).await.unwrap();
    let before = rss_kib(reg.proc.id());

    let flood = tokio::spawn(attack(
        asap,
        &[
            "resolve-flood",
            "--pool",
            "Flooded",
            "--associations",
            "4",
            "--duration-ms",
            "3000",
        ],
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A legitimate pool user, one resolution every 50 ms on a fresh association each time.
    let mut took = Vec::new();
    let h = PoolHandle::from("Flooded");
    for _ in 0..40 {
        let mut pu = PoolUser::new(PoolUserConfig {
            registrars: vec![asap],
            ..PoolUserConfig::default()
        })
        .unwrap();
        let t = Instant::now();
        let res = pu.resolve(&h).await.unwrap();
        took.push(t.elapsed());
        assert_eq!(res.pool_elements.len(), 1);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let during = rss_kib(reg.proc.id());
    let out = flood.await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    eprintln!("{said}");
    took.sort();
    let p95 = took[took.len() * 95 / 100];
    eprintln!(
        "legitimate resolutions during the flood: median {:?}, p95 {p95:?}, max {:?}; RSS {before} → {during} KiB",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    // The flood went past the limit (1,000 resolutions/s per association by default).
    let refused: u64 = said
        .split(", ")
        .find_map(|p| p.strip_suffix(" refused by the rate limit")?.parse().ok())
        .unwrap();
    assert!(refused > 0, "{said}");
    assert!(p95 < Duration::from_millis(100), "p95 {p95:?}");
    assert!(during < before + 64 * 1024, "RSS {before} → {during} KiB");
    // Each flooding association is refused, then closed once it has had a second's worth
    // refused in a row.
    let closed: u32 = said
        .split(", ")
        .find_map(|p| {
            p.trim()
                .strip_suffix(" association(s) closed by the registrar")?
                .parse()
                .ok()
        })
        .unwrap();
    assert!(closed >= 4, "{said}");
    let lines = reg.lines_with("handle resolutions refused");
    assert!(
        (1..=2).contains(&lines.len()),
        "one line per source and minute: {lines:?}"
    );
    drop(service);
}

/// A registration flood (RFC 5355 §3.3) over eight associations at a registrar with
/// `--max-pes 3000`: each association gets at most `max-pes-per-connection` (1,000), the whole
/// handlespace at most 3,000, the rest is refused with *lack of resources*, the registrar's
/// memory stays bounded, the refusals log one line per source and minute, and once the
/// flooder is gone a real PE registers and is resolved promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_flood_stops_at_the_limits() {
    let (reg, asap) = registrar(&["--max-pes", "3000"]).await;
    let before = rss_kib(reg.proc.id());
    let out = attack(
        asap,
        &[
            "register-flood",
            "--pool",
            "Flood",
            "--associations",
            "8",
            "--pes",
            "1500",
        ],
    )
    .await;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    eprintln!("{said}");
    assert!(said.contains("registered 3000 PEs"), "{said}");
    assert!(said.contains("9000 Lack of Resources"), "{said}");
    let after = rss_kib(reg.proc.id());
    eprintln!("RSS {before} → {after} KiB");
    assert!(after < before + 64 * 1024, "RSS {before} → {after} KiB");
    // The flooder gone, its PEs went with its associations: a real PE registers and is found.
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = PoolElementConfig::new("Real", service.local_addr().unwrap(), Policy::RoundRobin);
    cfg.registrars = vec![asap];
    let pe = PoolElement::start(cfg).unwrap();
    pe.wait_registered(Duration::from_secs(5)).await.unwrap();
    let mut pu = PoolUser::new(PoolUserConfig {
        registrars: vec![asap],
        ..PoolUserConfig::default()
    })
    .unwrap();
    let t = Instant::now();
    let res = pu.resolve(&PoolHandle::from("Real")).await.unwrap();
    assert_eq!(res.pool_elements.len(), 1);
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    let lines = reg.lines_with("rejected: limit of");
    assert!(
        (1..=2).contains(&lines.len()),
        "one line per source and minute: {lines:?}"
    );
}

/// A registrar whose open-file limit is below its `max-connections` refuses connections at
/// what the limit allows, with its own refusal (counted, logged once), and keeps descriptors
/// for its listeners: its status listener still answers. Before, accepting failed with
/// EMFILE on every listener, logged once a second, `connections_refused_total` stayed 0 and
/// the operator was blind (24,000 connections from one host, in a walkthrough).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_fits_its_connections_to_the_open_file_limit() {
    let asap = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "ulimit -n 300 && exec \"$0\" \"$@\"", BIN]);
    let args = [
        "registrar",
        "--asap",
        &asap.to_string(),
        "--status",
        &status.to_string(),
        "--max-connections",
        "1000",
    ]
    .map(String::from);
    let reg = Logged::spawn_cmd(cmd, "registrar", &args, "info");
    wait_for(Duration::from_secs(10), "the registrar listens", || async {
        tokio::net::TcpStream::connect(asap).await.is_ok()
    })
    .await;
    assert_eq!(
        reg.lines_with("max-connections = 1000 is more than the open-file limit allows (300 descriptors): 44 connections at most")
            .len(),
        1
    );
    let mut held = Vec::new();
    for _ in 0..80 {
        held.push(std::net::TcpStream::connect(asap).unwrap());
    }
    wait_for(
        Duration::from_secs(10),
        "the registrar refuses past its limit",
        || async {
            !reg.lines_with("refused: limit of 44 connections reached")
                .is_empty()
        },
    )
    .await;
    let mut s = tokio::net::TcpStream::connect(status).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /status HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer))
        .await
        .expect("the status listener answers")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        reg.lines_with("Too many open files").is_empty(),
        "{:?}",
        reg.lines_with("Too many open files")
    );
}
