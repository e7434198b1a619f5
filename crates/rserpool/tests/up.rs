//! The README's first command as a newcomer runs it: `rserpool up` on the built-in defaults
//! (registrar on 127.0.0.1:3863 with its status on 127.0.0.1:8863, proxy on 8080 and 7000), then
//! the commands it suggests, all without a flag: `status`, `resolve`, HTTP and TCP through the
//! proxy. It needs those default ports free on this host.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

mod common;

use common::{BIN, KillOnDrop, signal, wait_until};
use rserpool_proxy::http::client::Client;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_then_the_suggested_commands_work_on_defaults() {
    let mut up = KillOnDrop(
        Command::new(BIN)
            .arg("up")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let stdout = up.stdout.take().unwrap();
    // `up` prints its banner once everything listens; then its suggestions follow. The pipe is
    // closed after it, as `rserpool up | head` does: `up` must serve on regardless.
    let banner = tokio::task::spawn_blocking(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let done = line.contains("Ctrl-C stops everything");
            lines.push(line);
            if done {
                break;
            }
        }
        lines.join("\n")
    });
    let banner = tokio::time::timeout(Duration::from_secs(30), banner)
        .await
        .expect("`rserpool up` comes up within 30 s (are its default ports free?)")
        .unwrap();
    assert!(
        banner.contains("  cargo run --release -- status\n"),
        "{banner}"
    );
    assert!(
        banner.contains("curl http://127.0.0.1:8863/metrics"),
        "{banner}"
    );
    assert!(
        banner.contains("registrar: http://127.0.0.1:8863/"),
        "{banner}"
    );
    assert!(
        banner.contains("proxy:     http://127.0.0.1:8864/"),
        "{banner}"
    );

    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "rserpool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let st: rserpool_registrar::Status = serde_json::from_str(&run(&["status", "--json"])).unwrap();
    let mut pools: Vec<(String, usize)> = st
        .pools
        .iter()
        .map(|p| (p.handle.clone(), p.pes.len()))
        .collect();
    pools.sort();
    assert_eq!(
        pools,
        [("EchoPool".to_string(), 3), ("WebPool".to_string(), 3)]
    );
    let resolved = run(&["resolve", "EchoPool"]);
    assert!(resolved.contains("EchoPool"), "{resolved}");

    let mut c = Client::connect("127.0.0.1:8080".parse().unwrap())
        .await
        .unwrap();
    let r = c.get("/hello").await.unwrap();
    assert_eq!(r.code, 200);
    // The README's HTTP/2 command, on the same port.
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
        ])
        .args(["--http2-prior-knowledge", "http://127.0.0.1:8080/hello"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "2 200", "{out:?}");

    let mut echo = tokio::net::TcpStream::connect("127.0.0.1:7000")
        .await
        .unwrap();
    echo.write_all(b"hello\n").await.unwrap();
    let mut got = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(5), echo.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got, b"hello\n");

    // The metrics of both, and the dashboards, on the addresses the banner gave.
    for status in ["127.0.0.1:8863", "127.0.0.1:8864"] {
        let m = common::scrape(status.parse().unwrap()).await;
        assert!(
            m.iter().any(|s| s.name == "process_cpu_seconds_total"),
            "{status}"
        );
        let (code, page) = rserpool_status::get(status.parse().unwrap(), "/")
            .await
            .unwrap();
        assert_eq!(code, 200);
        assert!(page.starts_with(b"<!doctype html>"));
    }
    let m = common::scrape("127.0.0.1:8864".parse().unwrap()).await;
    assert!(common::metric(&m, "rserpool_proxy_requests_total", &[("pool", "WebPool")]) >= 1.0);

    // An attacker on the same host forges a takeover of every EchoPool PE (docs/SECURITY.md):
    // each answers, stays with its registrar and closes the attacker's connection.
    let out = Command::new(BIN)
        .args([
            "attack",
            "takeover",
            "--pool",
            "EchoPool",
            "--hold-ms",
            "3000",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(said.matches(": Refused").count(), 3, "{said}");
    let st: rserpool_registrar::Status = serde_json::from_str(&run(&["status", "--json"])).unwrap();
    let echo_pool = st.pools.iter().find(|p| p.handle == "EchoPool").unwrap();
    assert_eq!(echo_pool.pes.len(), 3, "every PE still registered");
    let mut again = tokio::net::TcpStream::connect("127.0.0.1:7000")
        .await
        .unwrap();
    again.write_all(b"still\n").await.unwrap();
    let mut got = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(5), again.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got, b"still\n");

    // Without transparent huge pages, which would make every connection's memory grow in
    // 2 MiB pages (src/main.rs): the kernel says so of the process.
    let status = std::fs::read_to_string(format!("/proc/{}/status", up.id())).unwrap();
    if let Some(thp) = status.lines().find_map(|l| l.strip_prefix("THP_enabled:")) {
        assert_eq!(
            thp.trim(),
            "0",
            "transparent huge pages are on for `rserpool up`"
        );
    }

    drop((c, echo, again));
    signal(&up, rustix::process::Signal::INT);
    wait_until(
        Duration::from_secs(10),
        "`rserpool up` exits on Ctrl-C",
        || matches!(up.try_wait(), Ok(Some(s)) if s.success()),
    )
    .await;
}

/// `cargo run --release -- up` at the root works only while exactly one of the workspace's
/// default members is a binary (with two, cargo asks which one to run).
#[test]
fn cargo_run_at_the_root_finds_one_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let members = manifest["workspace"]["default-members"].as_array().unwrap();
    let binaries: Vec<&str> = members
        .iter()
        .filter_map(|m| m.as_str())
        .filter(|m| {
            let dir = root.join(m);
            let own: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
                .unwrap()
                .parse()
                .unwrap();
            dir.join("src/main.rs").exists() || own.contains_key("bin")
        })
        .collect();
    assert_eq!(binaries, ["crates/rserpool"]);
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains("\ncargo run --release -- up ")
            && readme.contains("\ncargo test --workspace "),
        "the README starts with the two commands"
    );
}
