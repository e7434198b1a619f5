//! The registrar as an xDS control plane for a real proxyless gRPC client (Debian's
//! python3-grpcio, with its own xDS resolver and balancer; `tests/fixtures/xds_client.py`):
//! target `xds:///EchoGrpc`, three gRPC servers registered in pool `EchoGrpc` by `rserpool
//! serve` sidecars with weights 1, 2 and 4.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop, Logged, PYTHON, free_port, grpc_server, metric, scrape, wait_for};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/xds_client.py");
const POOL: &str = "EchoGrpc";

/// A gRPC server and the sidecar that registers it with `weight`.
struct Server {
    grpc: KillOnDrop,
    _sidecar: KillOnDrop,
}

async fn server(reg: SocketAddr, name: &str, weight: u32) -> Server {
    let (grpc, port) = grpc_server(name).await;
    let sidecar = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--target", &format!("127.0.0.1:{port}")])
            .args(["--pool", POOL, "--registrar", &reg.to_string()])
            .args(["--policy", "wrr", "--weight", &weight.to_string()])
            .args(["--status", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    Server {
        grpc,
        _sidecar: sidecar,
    }
}

/// What the client did: its start (Unix ms) and every answered call (ms since, server).
struct Run {
    start: u64,
    ok: u64,
    failed: u64,
    calls: Vec<(u64, String)>,
    raw: serde_json::Value,
}

/// Starts the client on `xds:///EchoGrpc` for `seconds`; `.await` the handle for its run.
fn client(bootstrap: &std::path::Path, seconds: u32) -> tokio::task::JoinHandle<Run> {
    let mut cmd = Command::new(PYTHON);
    cmd.args([
        CLIENT,
        "run",
        &format!("xds:///{POOL}"),
        &seconds.to_string(),
        "4",
    ])
    .env("GRPC_XDS_BOOTSTRAP", bootstrap)
    .env("GRPC_VERBOSITY", "error");
    tokio::task::spawn_blocking(move || {
        let out = cmd.output().unwrap();
        let raw: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "client output ({e}): {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let calls = raw["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c[0].as_u64().unwrap(), c[1].as_str().unwrap().to_string()))
            .collect();
        Run {
            start: raw["start"].as_u64().unwrap(),
            ok: raw["ok"].as_u64().unwrap(),
            failed: raw["failed"].as_u64().unwrap(),
            calls,
            raw: serde_json::json!({
                "ok": raw["ok"], "failed": raw["failed"], "retried": raw["retried"],
                "errors": raw["errors"],
            }),
        }
    })
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn by_server(calls: &[(u64, String)]) -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    for (_, who) in calls {
        *by.entry(who.clone()).or_default() += 1;
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_client_follows_the_pool_over_xds() {
    let asap = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let xds = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args: Vec<String> = [
        "registrar",
        "--asap",
        &asap.to_string(),
        "--enrp",
        "127.0.0.1:0",
        "--status",
        &status.to_string(),
        "--handover-socket",
        "",
        "--xds",
        &xds.to_string(),
    ]
    .map(String::from)
    .to_vec();
    let reg = Logged::spawn("registrar", &args, "info");
    wait_for(Duration::from_secs(10), "xDS listens", || async move {
        tokio::net::TcpStream::connect(xds).await.is_ok()
    })
    .await;
    let dir = std::env::temp_dir().join(format!("rserpool-xds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bootstrap = dir.join("bootstrap.json");
    std::fs::write(
        &bootstrap,
        serde_json::json!({
            "xds_servers": [{
                "server_uri": xds.to_string(),
                "channel_creds": [{"type": "insecure"}],
                "server_features": ["xds_v3"],
            }],
            "node": {"id": "xds-test", "locality": {}},
        })
        .to_string(),
    )
    .unwrap();

    let s1 = server(asap, "s1", 1).await;
    let s2 = server(asap, "s2", 2).await;
    let mut s3 = server(asap, "s3", 4).await;
    let pes = || async move {
        let out = tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(["resolve", POOL, "--registrar", &asap.to_string()])
                .env("RUST_LOG", "off")
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    wait_for(Duration::from_secs(10), "three PEs", || async move {
        pes().await >= 3
    })
    .await;

    // Weights 1:2:4 over thousands of calls.
    let run = client(&bootstrap, 4).await.unwrap();
    assert_eq!(run.failed, 0, "{}", run.raw);
    assert!(run.ok >= 7_000, "{} calls in 4 s: {}", run.ok, run.raw);
    let by = by_server(&run.calls);
    for (name, weight) in [("s1", 1.0), ("s2", 2.0), ("s3", 4.0)] {
        let share = by.get(name).copied().unwrap_or(0) as f64 / run.ok as f64;
        let want = weight / 7.0;
        assert!(
            (share - want).abs() <= want * 0.1,
            "{name}: {share:.3} of the calls, not {want:.3} ± 10 %: {by:?}"
        );
    }

    // s3 dies, s4 joins, while the client calls.
    let running = client(&bootstrap, 6);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let killed = unix_ms();
    s3.grpc.0.kill().unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _s4 = server(asap, "s4", 2).await;
    wait_for(Duration::from_secs(10), "s4 registered", || async move {
        pes().await >= 4
    })
    .await;
    let registered = unix_ms();
    let run = running.await.unwrap();
    assert_eq!(run.failed, 0, "no call failed for good: {}", run.raw);
    let last_s3 = run
        .calls
        .iter()
        .filter(|(_, w)| w == "s3")
        .map(|(t, _)| run.start + t)
        .max()
        .unwrap();
    assert!(
        last_s3 <= killed + 1_000,
        "s3 was called {} ms after it died",
        last_s3 as i64 - killed as i64
    );
    let first_s4 = run
        .calls
        .iter()
        .filter(|(_, w)| w == "s4")
        .map(|(t, _)| run.start + t)
        .min()
        .expect("s4 was called");
    assert!(
        first_s4 <= registered + 1_000,
        "s4 was first called {} ms after its registration",
        first_s4 as i64 - registered as i64
    );
    assert!(
        reg.lines_with("xDS")
            .iter()
            .any(|l| l.contains("state of the world")),
        "the registrar says where xDS is"
    );
    // The registrar's metrics count the streams and what the client accepted.
    let samples = scrape(status).await;
    assert!(metric(&samples, "rserpool_xds_streams_opened_total", &[]) >= 2.0);
    assert!(metric(&samples, "rserpool_xds_responses_total", &[]) >= 8.0);
    assert!(metric(&samples, "rserpool_xds_acks_total", &[]) >= 8.0);
    assert_eq!(metric(&samples, "rserpool_xds_nacks_total", &[]), 0.0);
    drop((s1, s2));
    let _ = std::fs::remove_dir_all(&dir);
}
