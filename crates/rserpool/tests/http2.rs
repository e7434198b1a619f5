//! HTTP/2 and gRPC through the proxy, between real processes on loopback: curl over h2c
//! (prior knowledge) and over TLS (ALPN) to HTTP/1.1 PEs; a gRPC client and servers (Python's
//! grpcio, the C core) through the proxy with a PE killed mid-run; and the known HTTP/2
//! attacks (rapid reset, PING, SETTINGS and CONTINUATION floods, an HPACK bomb), each answered
//! with GOAWAY or a reset while other clients are served.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    BIN, GRPC_ECHO, KillOnDrop, Logged, PYTHON, example_http, free_port, metric, scrape, wait_for,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rserpool-h2-{tag}-{}", free_port()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `rserpool proxy --config` with a config written to `dir`: the registrar at `reg`, the
/// status listener at `status`, an HTTP listener at `front` onto `pool`, then `rest` (more
/// listeners, pool sections).
fn proxy(
    dir: &Path,
    reg: SocketAddr,
    (status, front, pool): (SocketAddr, SocketAddr, &str),
    rest: &str,
) -> Logged {
    proxy_with(dir, reg, (status, front, pool), "", rest)
}

/// [`proxy`] with `top` among the top-level settings.
fn proxy_with(
    dir: &Path,
    reg: SocketAddr,
    (status, front, pool): (SocketAddr, SocketAddr, &str),
    top: &str,
    rest: &str,
) -> Logged {
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "registrars = [\"{reg}\"]\nrefresh-ms = 200\nstatus = \"{status}\"\n{top}\n\
             [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"{pool}\"\n{rest}"
        ),
    )
    .unwrap();
    let check = Command::new(BIN)
        .args(["check-config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    Logged::spawn(
        "proxy",
        &[
            "proxy".into(),
            "--config".into(),
            path.to_str().unwrap().into(),
        ],
        "info",
    )
}

/// Runs `cmd` to its end off the runtime's threads.
async fn output(mut cmd: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

/// curl with `args`: (exit success, stdout with the response head (-D -) and body).
async fn curl(args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "10", "-D", "-"]).args(args);
    let out = output(cmd).await;
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A GET over h2c with prior knowledge: the response head and body.
async fn h2c_get(front: SocketAddr, path: &str) -> String {
    curl(&["--http2-prior-knowledge", &format!("http://{front}{path}")])
        .await
        .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_clients_reach_http1_pes_in_cleartext_and_over_tls() {
    let dir = tempdir("curl");
    let reg = common::registrar(common::fast_config());
    let _pes = [
        example_http(reg.asap_addr(), "Web", 1, &[]).await,
        example_http(reg.asap_addr(), "Web", 2, &[]).await,
    ];
    let out = Command::new(BIN)
        .args(["cert", "--dir", dir.to_str().unwrap(), "a.test"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let (front, tls_front, status) = (addr(), addr(), addr());
    let d = dir.display();
    let p = proxy(
        &dir,
        reg.asap_addr(),
        (status, front, "Web"),
        &format!(
            r#"
[[listener]]
listen = "{tls_front}"
mode = "http"
pool = "Web"

[[listener.certificate]]
cert = "{d}/a.test.pem"
key = "{d}/a.test.key"
names = ["a.test"]
"#
        ),
    );
    every_pe_answers(2, "both PEs answer over h2c", async || {
        let r = h2c_get(front, "/").await;
        r.lines()
            .find_map(|l| l.strip_prefix("x-pe-id: "))
            .map(str::to_owned)
    })
    .await;
    let r = h2c_get(front, "/").await;
    assert!(r.starts_with("HTTP/2 200"), "{r}");
    // A body of unknown length goes to the PE chunked, and arrives whole.
    let body = "x".repeat(100_000);
    let body_file = dir.join("body");
    std::fs::write(&body_file, &body).unwrap();
    let (ok, r) = curl(&[
        "--http2-prior-knowledge",
        "-H",
        "content-length:",
        "--data-binary",
        &format!("@{}", body_file.display()),
        &format!("http://{front}/echo"),
    ])
    .await;
    assert!(ok, "{r}");
    assert!(r.starts_with("HTTP/2 200"), "{r}");
    assert!(r.contains("received 100000 bytes"), "{r}");
    // Over TLS, ALPN picks h2; HTTP/1.1 clients still get HTTP/1.1.
    let ca = dir.join("ca.pem");
    let resolve = format!("a.test:{}:127.0.0.1", tls_front.port());
    let url = format!("https://a.test:{}/", tls_front.port());
    let base = ["--cacert", ca.to_str().unwrap(), "--resolve", &resolve];
    let (ok, r) = curl(&[&base[..], &["--http2", &url]].concat()).await;
    assert!(ok && r.starts_with("HTTP/2 200"), "{r}");
    let (ok, r) = curl(&[&base[..], &["--http1.1", &url]].concat()).await;
    assert!(ok && r.starts_with("HTTP/1.1 200"), "{r}");
    // WebSocket over HTTP/2 (an extended CONNECT) to a PE that answers the upgrade with a
    // plain 200: the client gets 502, not a 2xx that would open its tunnel (it would read the
    // PE's page as WebSocket frames, RFC 8441), and the PE is not blamed for it.
    for _ in 0..6 {
        let s = TcpStream::connect(front).await.unwrap();
        let (send, conn) = h2::client::handshake(s).await.unwrap();
        tokio::spawn(conn);
        let mut send = send.ready().await.unwrap();
        wait_for(Duration::from_secs(5), "extended CONNECT offered", || {
            let on = send.is_extended_connect_protocol_enabled();
            async move { on }
        })
        .await;
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri(format!("http://{front}/not-a-websocket"))
            .extension(h2::ext::Protocol::from_static("websocket"))
            .header("sec-websocket-version", "13")
            .body(())
            .unwrap();
        let (resp, _up) = send.send_request(req, false).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 502);
    }
    assert!(
        p.lines_with("ejected").is_empty(),
        "{:?}",
        p.lines_with("ejected")
    );
    // The same pipeline: no route is a 404, the access log and metrics count the requests.
    let m = scrape(status).await;
    assert!(metric(&m, "rserpool_proxy_requests_total", &[("pool", "Web")]) >= 4.0);
    assert!(p.lines_with("panicked").is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// WebSocket over HTTP/2 (RFC 8441): a client in cleartext (Python's h2) finds
/// SETTINGS_ENABLE_CONNECT_PROTOCOL, opens `:protocol websocket` through the proxy to a
/// WebSocket PE over HTTP/1.1 (Python's websockets) and, on another listener, to one over
/// HTTP/2 (`protocol = "h2"`; Python's h2), both registered by `serve`; each time 1,000
/// messages, ten of them of 1 MB, come back intact, then the close handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_over_http2_reaches_http1_and_http2_websocket_pes() {
    const WS_ECHO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ws_echo.py");
    const H2_ECHO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h2_ws_echo.py");
    const CLIENT: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/h2_websocket.py"
    );
    let dir = tempdir("ws");
    let reg = common::registrar(common::fast_config());
    let r = reg.asap_addr().to_string();
    let mut keep = Vec::new();
    for (script, pool) in [(WS_ECHO, "Ws"), (H2_ECHO, "WsH2")] {
        let target = addr();
        keep.push(KillOnDrop(
            Command::new(PYTHON)
                .arg(script)
                .arg(target.port().to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("python3 with python3-websockets and python3-h2 (.ci/run installs them)"),
        ));
        keep.push(common::spawn(&[
            "serve",
            "--pool",
            pool,
            "--target",
            &target.to_string(),
            "--registrar",
            &r,
            "--check-interval-ms",
            "100",
        ]));
    }
    let (front, front_h2, status) = (addr(), addr(), addr());
    let p = proxy(
        &dir,
        reg.asap_addr(),
        (status, front, "Ws"),
        &format!(
            "[[listener]]\nlisten = \"{front_h2}\"\nmode = \"http\"\npool = \"WsH2\"\n\n\
             [pool.WsH2]\nprotocol = \"h2\"\n"
        ),
    );
    wait_for(
        Duration::from_secs(20),
        "the proxy has both WebSocket PEs",
        || async {
            let doc = rserpool_status::get(status, "/status")
                .await
                .ok()
                .and_then(|(_, b)| serde_json::from_slice::<serde_json::Value>(&b).ok());
            let pes = |pool: &str| {
                doc.as_ref()
                    .and_then(|d| d["pools"].as_array().cloned())
                    .unwrap_or_default()
                    .iter()
                    .find(|p| p["pool"] == pool)
                    .and_then(|p| p["pool_elements"].as_array().map(Vec::len))
            };
            pes("Ws") == Some(1) && pes("WsH2") == Some(1)
        },
    )
    .await;
    for (listener, pool) in [(front, "Ws"), (front_h2, "WsH2")] {
        let mut client = Command::new(PYTHON);
        client.args([
            CLIENT,
            "127.0.0.1",
            &listener.port().to_string(),
            "/echo",
            "1000",
        ]);
        let out = output(client).await;
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.starts_with("ok 1000 "),
            "{pool}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The tunnel's bytes count for the PE, as an HTTP/1.1 upgrade's do.
        let m = scrape(status).await;
        for sent in [
            "rserpool_proxy_pe_sent_bytes_total",
            "rserpool_proxy_pe_received_bytes_total",
        ] {
            assert!(metric(&m, sent, &[("pool", pool)]) > 10e6, "{pool} {sent}");
        }
    }
    assert!(p.lines_with("panicked").is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// Waits (20 s at most) until `n` different PEs have answered: `who` asks once and says which
/// PE answered, if one did.
async fn every_pe_answers(n: usize, what: &str, who: impl AsyncFn() -> Option<String>) {
    wait_for(Duration::from_secs(20), what, || async {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 * n {
            seen.extend(who().await);
        }
        seen.len() == n
    })
    .await;
}

/// A gRPC server (PE) registered by an `rserpool serve` sidecar.
struct GrpcPe {
    server: KillOnDrop,
    _sidecar: KillOnDrop,
}

async fn grpc_pe(reg: SocketAddr, name: &str) -> GrpcPe {
    let (server, port) = common::grpc_server(name).await;
    let sidecar = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--target", &format!("127.0.0.1:{port}")])
            .args(["--pool", "Grpc", "--registrar", &reg.to_string()])
            .args(["--check-interval-ms", "200", "--fall", "1"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    GrpcPe {
        server,
        _sidecar: sidecar,
    }
}

/// One call of the gRPC client: code, details, reply and trailing metadata as JSON.
async fn grpc_call(front: SocketAddr, method: &str, timeout: Option<&str>) -> serde_json::Value {
    let mut cmd = Command::new(PYTHON);
    cmd.args([GRPC_ECHO, "call", &front.to_string(), method]);
    if let Some(t) = timeout {
        cmd.arg(t);
    }
    let out = output(cmd).await;
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_fail_over_with_zero_failures_when_a_pe_dies() {
    let dir = tempdir("grpc");
    let reg = common::registrar(common::fast_config());
    let mut pes = Vec::new();
    for name in ["a", "b", "c"] {
        pes.push(grpc_pe(reg.asap_addr(), name).await);
    }
    let (front, status) = (addr(), addr());
    let p = proxy(
        &dir,
        reg.asap_addr(),
        (status, front, "Grpc"),
        // Four clients call back to back: when PE "a" dies, all four calls under way may
        // need their retry at once, and the default budget (3 at least) would refuse one —
        // the budget does its job there (it is tested in the pipeline's tests); this test is
        // about failover, so the budget fits its concurrency.
        r#"
[pool.Grpc]
protocol = "h2"
idempotent = ["/test.Echo/Echo"]
retry-budget-min = 4
"#,
    );
    every_pe_answers(3, "calls reach all three PEs", async || {
        let v = grpc_call(front, "Echo", None).await;
        (v["code"] == "OK").then(|| v["trailers"]["x-served-by"].to_string())
    })
    .await;
    // Trailers and statuses come through: the reply, its trailing metadata, an error status
    // with its message.
    let v = grpc_call(front, "Echo", None).await;
    assert_eq!(v["code"], "OK", "{v}");
    assert!(v["reply"].as_str().unwrap().ends_with(":ping"), "{v}");
    let v = grpc_call(front, "Fail", None).await;
    assert_eq!(
        (v["code"].as_str(), v["details"].as_str()),
        (Some("NOT_FOUND"), Some("nope"))
    );
    // The deadline is the client's: the call ends with DEADLINE_EXCEEDED when it passes, not
    // after the PE's two seconds.
    let t = Instant::now();
    let v = grpc_call(front, "Slow", Some("0.3")).await;
    assert_eq!(v["code"], "DEADLINE_EXCEEDED", "{v}");
    assert!(
        t.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t.elapsed()
    );
    // The proxy enforces it itself too (a client that sends grpc-timeout and waits longer).
    let frame = dir.join("frame");
    std::fs::write(&frame, b"\0\0\0\0\x04ping").unwrap();
    let t = Instant::now();
    let (_, r) = curl(&[
        "--http2-prior-knowledge",
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "-H",
        "grpc-timeout: 300m",
        "--data-binary",
        &format!("@{}", frame.display()),
        &format!("http://{front}/test.Echo/Slow"),
    ])
    .await;
    assert!(r.contains("grpc-status: 4"), "{r}");
    assert!(
        t.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t.elapsed()
    );
    // An HTTP/1.1 client of the HTTP/2 pool: the call goes out as HTTP/2, the answer comes
    // back chunked with the trailers in its trailer section.
    let (ok, r) = curl(&[
        "--http1.1",
        "--raw",
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "--data-binary",
        &format!("@{}", frame.display()),
        &format!("http://{front}/test.Echo/Echo"),
    ])
    .await;
    assert!(ok && r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        r.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{r}"
    );
    assert!(r.contains(":ping") && r.contains("grpc-status: 0"), "{r}");

    // Calls back to back from 4 threads for 4 s; PE "a" dies after 1.5 s.
    let mut load = Command::new(PYTHON);
    load.args([GRPC_ECHO, "load", &front.to_string(), "4", "4"]);
    let load = output(load);
    let kill = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut a = pes.remove(0);
        a.server.0.kill().unwrap();
    };
    let (out, ()) = tokio::join!(load, kill);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    eprintln!("load: {v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert!(v["ok"].as_u64().unwrap() > 100, "{v}");
    for name in ["a", "b", "c"] {
        assert!(
            v["by"][name].as_u64().unwrap_or(0) > 0,
            "{name} served nothing: {v}"
        );
    }
    let m = scrape(status).await;
    assert!(metric(&m, "rserpool_proxy_requests_total", &[("pool", "Grpc")]) > 100.0);
    assert!(p.lines_with("panicked").is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

// ---- Raw HTTP/2 frames for the attacks ----

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1) after the `first` bits.
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// The header block of `GET /` to `authority` (static table entries and a literal).
fn get_block(authority: &str) -> Vec<u8> {
    get_block_to(authority, "/")
}

/// A GET of `path` at `authority`.
fn get_block_to(authority: &str, path: &str) -> Vec<u8> {
    // :method GET, :scheme http
    let mut b = vec![0x82, 0x86];
    if path == "/" {
        b.push(0x84);
    } else {
        // :path, literal without indexing, name from the static table (index 4)
        b.push(0x04);
        hpack_int(&mut b, 0, 7, path.len());
        b.extend_from_slice(path.as_bytes());
    }
    // :authority, literal without indexing, name from the static table (index 1)
    b.push(0x01);
    hpack_int(&mut b, 0, 7, authority.len());
    b.extend_from_slice(authority.as_bytes());
    b
}

/// A connection that has sent the preface and its SETTINGS.
async fn raw_h2(front: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(front).await.unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(4, 0, 0, &[]));
    s.write_all(&hello).await.unwrap();
    s
}

/// What the server did to the connection: `Some(error code)` of its GOAWAY, with the RST_STREAM
/// codes and the HEADERS count it sent before; `None` for the GOAWAY if it sent none before
/// closing or `limit` passing.
#[derive(Debug, Default)]
struct Seen {
    goaway: Option<u32>,
    resets: Vec<u32>,
    headers: usize,
}

async fn watch(s: &mut (impl AsyncReadExt + Unpin), limit: Duration) -> Seen {
    let mut seen = Seen::default();
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        while buf.len() >= 9 {
            let len = (buf[0] as usize) << 16 | (buf[1] as usize) << 8 | buf[2] as usize;
            if buf.len() < 9 + len {
                break;
            }
            let (kind, payload) = (buf[3], &buf[9..9 + len]);
            match kind {
                1 => seen.headers += 1,
                3 => seen
                    .resets
                    .push(u32::from_be_bytes(payload[..4].try_into().unwrap())),
                7 => {
                    seen.goaway = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
                    return seen;
                }
                _ => {}
            }
            buf.drain(..9 + len);
        }
        let mut chunk = vec![0u8; 64 * 1024];
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return seen,
        }
    }
}

/// Writes `bytes` (ignoring a connection the server closed) while watching what comes back,
/// until a GOAWAY or 10 s.
async fn attack(front: SocketAddr, bytes: Vec<u8>) -> Seen {
    attack_for(front, bytes, Duration::from_secs(10)).await
}

async fn attack_for(front: SocketAddr, bytes: Vec<u8>, limit: Duration) -> Seen {
    let (mut rd, mut wr) = raw_h2(front).await.into_split();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&bytes).await;
        wr
    });
    let seen = watch(&mut rd, limit).await;
    writer.abort();
    seen
}

const ENHANCE_YOUR_CALM: u32 = 0xb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_attacks_get_goaway_and_other_clients_stay_served() {
    let dir = tempdir("attacks");
    let reg = common::registrar(common::fast_config());
    let _pe = example_http(reg.asap_addr(), "Web", 1, &[]).await;
    let (front, status) = (addr(), addr());
    let p = proxy(&dir, reg.asap_addr(), (status, front, "Web"), "");
    serves_h2c(front).await;
    // A client that stays connected throughout and is served after every attack.
    let mut bystander = Bystander::connect(front).await;
    bystander.served().await;

    // Rapid reset (CVE-2023-44487): streams opened and reset at once.
    let mut bytes = Vec::new();
    for i in 0..2000u32 {
        let id = 2 * i + 1;
        bytes.extend(frame(1, END_STREAM | END_HEADERS, id, &get_block("a")));
        bytes.extend(frame(3, 0, id, &8u32.to_be_bytes()));
    }
    let seen = attack(front, bytes).await;
    assert_eq!(
        seen.goaway,
        Some(ENHANCE_YOUR_CALM),
        "rapid reset: {seen:?}"
    );
    bystander.served().await;

    // PING flood.
    let pings: Vec<u8> = (0..10_000u64)
        .flat_map(|i| frame(6, 0, 0, &i.to_be_bytes()))
        .collect();
    let seen = attack(front, pings).await;
    assert_eq!(seen.goaway, Some(ENHANCE_YOUR_CALM), "PING flood: {seen:?}");
    bystander.served().await;

    // SETTINGS flood.
    let settings: Vec<u8> = (0..10_000).flat_map(|_| frame(4, 0, 0, &[])).collect();
    let seen = attack(front, settings).await;
    assert_eq!(
        seen.goaway,
        Some(ENHANCE_YOUR_CALM),
        "SETTINGS flood: {seen:?}"
    );
    bystander.served().await;

    // CONTINUATION flood: a header block that never ends, one byte per frame.
    let mut cont = frame(1, END_STREAM, 1, &get_block("a"));
    for _ in 0..10_000 {
        // A literal header's first byte, over and over: the block grows, never completes.
        cont.extend(frame(9, 0, 1, &[0x40]));
    }
    let seen = attack(front, cont).await;
    assert_eq!(
        seen.goaway,
        Some(ENHANCE_YOUR_CALM),
        "CONTINUATION flood: {seen:?}"
    );
    bystander.served().await;

    // HPACK bomb: a 4000-byte header stored in the dynamic table once, referenced 2000 times
    // (8 MB decoded from a 6 KB block).
    let mut block = get_block("a");
    block.push(0x40);
    hpack_int(&mut block, 0, 7, 6);
    block.extend_from_slice(b"x-bomb");
    hpack_int(&mut block, 0, 7, 4000);
    block.extend(std::iter::repeat_n(b'a', 4000));
    block.extend(std::iter::repeat_n(0xbe, 2000));
    let mut bomb = Vec::new();
    let mut chunks = block.chunks(16_384).peekable();
    let mut first = true;
    while let Some(c) = chunks.next() {
        let last = chunks.peek().is_none();
        let flags = if last { END_HEADERS } else { 0 };
        if first {
            bomb.extend(frame(1, flags | END_STREAM, 1, c));
            first = false;
        } else {
            bomb.extend(frame(9, flags, 1, c));
        }
    }
    let seen = attack(front, bomb).await;
    assert_eq!(
        seen.headers, 0,
        "the bomb was not answered as a request: {seen:?}"
    );
    assert!(
        seen.goaway == Some(ENHANCE_YOUR_CALM) || !seen.resets.is_empty(),
        "HPACK bomb: {seen:?}"
    );
    bystander.served().await;

    // More streams at once than max-concurrent-streams (100): the excess is refused
    // (REFUSED_STREAM), the connection lives on.
    let open: Vec<u8> = (0..110u32)
        .flat_map(|i| frame(1, END_HEADERS, 2 * i + 1, &get_block("a")))
        .collect();
    let seen = attack_for(front, open, Duration::from_secs(2)).await;
    assert_eq!(seen.goaway, None, "{seen:?}");
    assert_eq!(
        seen.resets, [7; 10],
        "REFUSED_STREAM for the 10 beyond: {seen:?}"
    );
    bystander.served().await;

    // h2-to-h1 request smuggling: Transfer-Encoding in an HTTP/2 request makes it malformed
    // (RFC 9113 §8.2.2): the stream is reset (PROTOCOL_ERROR), nothing reaches a PE.
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    block.push(0x04); // :path, literal without indexing, static name
    hpack_int(&mut block, 0, 7, 5);
    block.extend_from_slice(b"/echo");
    block.push(0x01);
    hpack_int(&mut block, 0, 7, 1);
    block.push(b'a');
    block.push(0x00); // a new name
    hpack_int(&mut block, 0, 7, 17);
    block.extend_from_slice(b"transfer-encoding");
    hpack_int(&mut block, 0, 7, 7);
    block.extend_from_slice(b"chunked");
    let mut smuggle = frame(1, END_HEADERS, 1, &block);
    smuggle.extend(frame(
        0,
        END_STREAM,
        1,
        b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    ));
    let seen = attack_for(front, smuggle, Duration::from_secs(2)).await;
    assert_eq!(
        (seen.headers, &seen.resets[..]),
        (0, &[1][..]),
        "smuggling: {seen:?}"
    );
    bystander.served().await;

    // Each flood is counted, once per connection; the proxy is still whole.
    let m = scrape(status).await;
    let floods = metric(&m, "rserpool_proxy_http2_floods_total", &[]);
    assert!(floods >= 4.0, "{floods}");
    assert!(h2c_get(front, "/").await.starts_with("HTTP/2 200"));
    assert!(p.lines_with("panicked").is_empty());
    let warnings = p.lines_with("ENHANCE_YOUR_CALM");
    assert!(!warnings.is_empty() && warnings.len() < 5, "{warnings:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// An HTTP/2 connection is closed `idle-timeout-ms` after its last stream ended (GOAWAY, then
/// the close), and not while streams keep coming, however long it lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_closes_when_idle_after_its_last_stream_and_not_before() {
    let dir = tempdir("idle");
    let reg = common::registrar(common::fast_config());
    let _pe = example_http(reg.asap_addr(), "Web", 1, &[]).await;
    let (front, status) = (addr(), addr());
    let idle = Duration::from_millis(600);
    let _p = proxy_with(
        &dir,
        reg.asap_addr(),
        (status, front, "Web"),
        &format!("idle-timeout-ms = {}", idle.as_millis()),
        "",
    );
    serves_h2c(front).await;
    // A stream every 200 ms for three idle times: each answered, no GOAWAY. The proxy sees a
    // stream no earlier than the client began to send it, so it may close only when the next
    // one comes an idle time after that; a client held up that long (a loaded machine) was
    // idle, and starts over on a new connection.
    let mut c = 'periodic: {
        for _ in 0..3 {
            let mut c = Bystander::connect(front).await;
            let started = Instant::now();
            let mut held_up = false;
            while started.elapsed() < idle * 3 && !held_up {
                let sent = Instant::now();
                c.served().await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                held_up = sent.elapsed() > idle - Duration::from_millis(100);
            }
            if !held_up {
                break 'periodic c;
            }
            eprintln!("the client was held up for an idle time between two streams: again");
        }
        panic!("the client was held up in three tries out of three");
    };
    // The last stream outlasts an idle time (the PE works 750 ms): the idle time runs from its
    // end, not from its start nor from the timer's last look during it.
    c.served_at("/work?us=750000").await;
    let last = Instant::now();
    // Then nothing: GOAWAY (NO_ERROR) about an idle time later, and the close.
    let seen = watch(&mut c.s, Duration::from_secs(10)).await;
    let after = last.elapsed();
    assert_eq!(seen.goaway, Some(0), "{seen:?}");
    assert!(
        after >= idle - Duration::from_millis(50) && after < idle * 3,
        "GOAWAY {after:?} after the last stream, the idle timeout is {idle:?}"
    );
    let mut rest = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match c.s.read(&mut rest).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection stayed open after its GOAWAY"
    );
}

/// A client on one HTTP/2 connection through all the attacks.
struct Bystander {
    s: TcpStream,
    buf: Vec<u8>,
    next: u32,
}

/// Once the proxy at `front` answers h2c.
async fn serves_h2c(front: SocketAddr) {
    wait_for(Duration::from_secs(15), "the proxy serves h2c", || async {
        h2c_get(front, "/").await.starts_with("HTTP/2 200")
    })
    .await;
}

impl Bystander {
    async fn connect(front: SocketAddr) -> Self {
        Self {
            s: raw_h2(front).await,
            buf: Vec::new(),
            next: 1,
        }
    }

    /// A GET on a new stream; panics unless its response HEADERS arrive within 5 s.
    async fn served(&mut self) {
        self.get(&get_block("a"), false).await;
    }

    /// A GET of `path` on a new stream; panics unless its whole response (to END_STREAM)
    /// arrives within 5 s.
    async fn served_at(&mut self, path: &str) {
        self.get(&get_block_to("a", path), true).await;
    }

    /// Sends the GET `block` on a new stream and waits for its response's HEADERS, or `to_end`
    /// for its last frame.
    async fn get(&mut self, block: &[u8], to_end: bool) {
        let id = self.next;
        self.next += 2;
        self.s
            .write_all(&frame(1, END_STREAM | END_HEADERS, id, block))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            while self.buf.len() >= 9 {
                let b = &self.buf;
                let len = (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize;
                if b.len() < 9 + len {
                    break;
                }
                let (kind, flags) = (b[3], b[4]);
                let stream = u32::from_be_bytes(b[5..9].try_into().unwrap());
                assert_ne!(kind, 7, "the bystander got GOAWAY");
                self.buf.drain(..9 + len);
                let ends = kind <= 1 && flags & END_STREAM != 0;
                if stream == id && ((kind == 1 && !to_end) || ends) {
                    return;
                }
            }
            let mut chunk = vec![0u8; 16 * 1024];
            match tokio::time::timeout_at(deadline, self.s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                other => panic!("the bystander got no response: {other:?}"),
            }
        }
    }
}

// ---- A burst of small calls to an HTTP/2 PE ----

/// A registrar, an HTTP/2 PE registered by an `rserpool serve` sidecar in `pool`, and a
/// proxy with default settings but `protocol = "h2"` for the pool, listening at `front`.
struct H2Bed {
    dir: PathBuf,
    front: SocketAddr,
    proxy: Logged,
    _sidecar: KillOnDrop,
    _reg: rserpool_registrar::RegistrarThread,
}

impl H2Bed {
    async fn start(tag: &str, pool: &str, pe: SocketAddr) -> Self {
        let dir = tempdir(tag);
        let reg = common::registrar(common::fast_config());
        let sidecar = KillOnDrop(
            Command::new(BIN)
                .args(["serve", "--target", &pe.to_string()])
                .args(["--pool", pool, "--registrar", &reg.asap_addr().to_string()])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let (front, status) = (addr(), addr());
        let proxy = proxy(
            &dir,
            reg.asap_addr(),
            (status, front, pool),
            &format!("[pool.{pool}]\nprotocol = \"h2\"\n"),
        );
        wait_for(Duration::from_secs(10), "the proxy listens", async || {
            TcpStream::connect(front).await.is_ok()
        })
        .await;
        H2Bed {
            dir,
            front,
            proxy,
            _sidecar: sidecar,
            _reg: reg,
        }
    }
}

impl H2Bed {
    /// A client connection with `h2`'s defaults.
    async fn client(&self) -> h2::client::SendRequest<bytes::Bytes> {
        let s = TcpStream::connect(self.front).await.unwrap();
        let (send, conn) = h2::client::handshake(s).await.unwrap();
        tokio::spawn(conn);
        send
    }

    /// Once a call on `send` reaches the PE and comes back.
    async fn warm(&self, send: &h2::client::SendRequest<bytes::Bytes>) {
        let front = self.front;
        wait_for(
            Duration::from_secs(10),
            "the PE answers through the proxy",
            || {
                let mut send = send.clone();
                async move { h2_call(&mut send, front, "/t.E/Warm").await == (200, "0".into()) }
            },
        )
        .await;
    }
}

impl Drop for H2Bed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Calls the burst PE below holds until this many are waiting.
const BURST: usize = 300;

/// An HTTP/2 PE in the `h2` crate with its defaults, as a Rust gRPC server built on it
/// (tonic, hyper) runs: `/t.E/Warm` is echoed at once; calls of `/t.E/Burst` are held until
/// [`BURST`] of them wait, then each is read and echoed (a server whose handlers are slower
/// than the calls arrive).
async fn burst_pe() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let (waiting, _) = tokio::sync::watch::channel(0usize);
    let waiting = std::sync::Arc::new(waiting);
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let waiting = waiting.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::Builder::new()
                    .max_concurrent_streams(1000)
                    .handshake::<_, bytes::Bytes>(s)
                    .await
                else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let waiting = waiting.clone();
                    tokio::spawn(async move {
                        if req.uri().path() == "/t.E/Burst" {
                            waiting.send_modify(|n| *n += 1);
                            let mut rx = waiting.subscribe();
                            let _ = rx.wait_for(|&n| n >= BURST).await;
                        }
                        echo(req, respond).await;
                    });
                }
            });
        }
    });
    at
}

/// Reads a call and echoes its message with `grpc-status: 0`.
async fn echo(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
) {
    let mut body = req.into_body();
    let mut msg = Vec::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        msg.extend_from_slice(&d);
    }
    let Ok(mut tx) = respond.send_response(grpc_response(), false) else {
        return;
    };
    tx.reserve_capacity(msg.len());
    let _ = tx.send_data(msg.into(), false);
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = tx.send_trailers(t);
}

/// The head of a gRPC answer; its status comes in the trailers.
fn grpc_response() -> http::Response<()> {
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap()
}

/// The head of a gRPC call to `path` through `front`.
fn grpc_request(front: SocketAddr, path: &str) -> http::Request<()> {
    http::Request::post(format!("http://{front}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A gRPC-shaped call over `send`: its status and `grpc-status` (0 and the error when no
/// response came).
async fn h2_call(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
    front: SocketAddr,
    path: &str,
) -> (u16, String) {
    let mut send = send.clone().ready().await.unwrap();
    let req = grpc_request(front, path);
    let (resp, mut body) = send.send_request(req, false).unwrap();
    body.send_data(bytes::Bytes::from_static(b"\0\0\0\0\x04ping"), true)
        .unwrap();
    let resp = match resp.await {
        Ok(r) => r,
        Err(e) => return (0, e.to_string()),
    };
    let status = resp.status().as_u16();
    // A trailers-only response (the proxy's own errors) has it in the head.
    let head = resp.headers().clone();
    let mut body = resp.into_body();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
    }
    let trailers = body.trailers().await.ok().flatten().unwrap_or(head);
    let grpc = trailers
        .get("grpc-status")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    (status, grpc)
}

/// 300 calls at once, each a small message, reach an HTTP/2 PE that reads them late: every
/// one is answered. The proxy sends a message that ends the call with END_STREAM on its DATA
/// frame, as clients do: followed by an empty DATA frame instead, each small message counts
/// against the PE's allowance for small unfinished frames (the `h2` crate's, 0.4.20 on), and
/// a burst like this one made the PE end the connection with ENHANCE_YOUR_CALM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_small_calls_reaches_an_h2_pe_that_reads_them_late() {
    let bed = H2Bed::start("burst", "Burst", burst_pe().await).await;
    let (front, p) = (bed.front, &bed.proxy);
    // Three client connections: 100 streams each at most (the proxy's default).
    let mut clients = Vec::new();
    for _ in 0..BURST / 100 {
        clients.push(bed.client().await);
    }
    bed.warm(&clients[0]).await;
    let calls: Vec<_> = (0..BURST)
        .map(|i| {
            let mut send = clients[i % clients.len()].clone();
            tokio::spawn(async move {
                let call = h2_call(&mut send, front, "/t.E/Burst");
                tokio::time::timeout(Duration::from_secs(20), call)
                    .await
                    .unwrap_or((0, "no answer within 20 s".into()))
            })
        })
        .collect();
    let mut failed = std::collections::BTreeMap::<_, usize>::new();
    for c in calls {
        let a = c.await.unwrap();
        if a != (200, "0".into()) {
            *failed.entry(a).or_default() += 1;
        }
    }
    assert!(
        failed.is_empty(),
        "failed calls (answer: how many): {failed:?}"
    );
    assert!(p.lines_with("panicked").is_empty());
}

/// A call whose message (with a Content-Length, so the proxy holds it to send again if need
/// be) comes well after its head is waited for and reaches the PE whole: the read of a held
/// body starts its timer only when the body is not there yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_body_that_comes_after_its_head_is_waited_for() {
    let bed = H2Bed::start("late", "Late", burst_pe().await).await;
    let send = bed.client().await;
    bed.warm(&send).await;
    let mut send = send.ready().await.unwrap();
    let msg = b"\0\0\0\0\x04late";
    let mut req = grpc_request(bed.front, "/t.E/Warm");
    req.headers_mut()
        .insert("content-length", msg.len().to_string().parse().unwrap());
    let (resp, mut body) = send.send_request(req, false).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    body.send_data(bytes::Bytes::from_static(msg), true)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("an answer within 10 s")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut echoed = Vec::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        echoed.extend_from_slice(&d);
    }
    assert_eq!(echoed, msg, "the PE got the message whole");
}

/// How many messages the ticker PE below sends on a call of `/t.E/Ticks`.
const TICKS: usize = 30_000;
const TICK: &[u8] = b"\0\0\0\0\x05tick!";

/// Sends [`TICKS`] messages, a DATA frame each, as flow control lets them go; `end` on the
/// last.
async fn send_ticks(tx: &mut h2::SendStream<bytes::Bytes>, end: bool) -> Result<(), String> {
    for i in 0..TICKS {
        tx.reserve_capacity(TICK.len());
        while tx.capacity() < TICK.len() {
            match std::future::poll_fn(|cx| tx.poll_capacity(cx)).await {
                Some(Ok(_)) => {}
                other => return Err(format!("message {i}: no window: {other:?}")),
            }
        }
        let last = end && i + 1 == TICKS;
        tx.send_data(bytes::Bytes::from_static(TICK), last)
            .map_err(|e| format!("message {i}: {e}"))?;
    }
    Ok(())
}

/// Reads a stream of [`TICKS`] messages to its end: every byte, then `grpc-status: 0`.
async fn read_ticks(body: &mut h2::RecvStream) {
    let mut got = 0usize;
    while let Some(d) = body.data().await {
        let d = d.expect("the stream goes on");
        got += d.len();
        let _ = body.flow_control().release_capacity(d.len());
    }
    assert_eq!(got, TICKS * TICK.len(), "bytes of the stream");
    let trailers = body.trailers().await.expect("trailers, not a reset");
    let grpc = trailers.as_ref().and_then(|t| t.get("grpc-status"));
    assert_eq!(grpc.map(http::HeaderValue::as_bytes), Some(&b"0"[..]));
}

/// Calls on `send`, one after another until 2 s after `since`: every one answered, and more
/// than ten of them.
async fn calls_beside(
    send: &h2::client::SendRequest<bytes::Bytes>,
    front: SocketAddr,
    since: Instant,
) {
    let mut answered = 0;
    while since.elapsed() < Duration::from_secs(2) {
        let mut send = send.clone();
        let a = tokio::time::timeout(
            Duration::from_secs(5),
            h2_call(&mut send, front, "/t.E/Warm"),
        )
        .await
        .unwrap_or((0, "no answer within 5 s".into()));
        assert_eq!(a, (200, "0".into()), "a call beside the slow one");
        answered += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered > 10, "{answered} calls beside the slow one");
}

/// An HTTP/2 PE in the `h2` crate streaming small messages as a server-streaming gRPC call
/// does: `/t.E/Ticks` is answered with [`TICKS`] messages, a DATA frame each, as fast as
/// flow control lets them go; `/t.E/Late` is read only after 2 s, then echoed; any other call
/// is echoed at once.
async fn ticker_pe() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                // The stream's window is h2's default (64 KiB); the connection's is larger, as
                // a server for many calls has it (tonic's, through hyper), so that a call read
                // late does not hold up the others.
                let Ok(mut conn) = h2::server::Builder::new()
                    .initial_connection_window_size(4 << 20)
                    .handshake(s)
                    .await
                else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    if req.uri().path() == "/t.E/Late" {
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            echo(req, respond).await;
                        });
                        continue;
                    }
                    if req.uri().path() != "/t.E/Ticks" {
                        tokio::spawn(echo(req, respond));
                        continue;
                    }
                    tokio::spawn(async move {
                        let Ok(mut tx) = respond.send_response(grpc_response(), false) else {
                            return;
                        };
                        if send_ticks(&mut tx, false).await.is_err() {
                            return;
                        }
                        let mut t = http::HeaderMap::new();
                        t.insert("grpc-status", http::HeaderValue::from_static("0"));
                        let _ = tx.send_trailers(t);
                    });
                }
            });
        }
    });
    at
}

/// A server-streaming call of 30,000 small messages to a client that stops reading for a
/// while: the client gets every message once it reads again, and meanwhile other calls on the
/// same PE connection are answered. What the proxy holds for the slow client is flow-controlled
/// data, not frames left unread inside `h2`: those count against the allowance for small
/// frames (0.4.20 on) and made `h2` end the whole PE connection with ENHANCE_YOUR_CALM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_of_a_stream_of_small_messages_gets_them_all_and_costs_no_other_call() {
    let bed = H2Bed::start("ticks", "Ticks", ticker_pe().await).await;
    let (front, p) = (bed.front, &bed.proxy);
    let other = bed.client().await;
    bed.warm(&other).await;
    // The slow client: its window (64 KiB, h2's default) fills, then it reads nothing for 2 s.
    let mut slow = bed.client().await.ready().await.unwrap();
    let req = grpc_request(front, "/t.E/Ticks");
    let (resp, mut body) = slow.send_request(req, false).unwrap();
    body.send_data(bytes::Bytes::from_static(b"\0\0\0\0\0"), true)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("the stream's head within 10 s")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut ticks = resp.into_body();
    calls_beside(&other, front, Instant::now()).await;
    let read = tokio::time::timeout(Duration::from_secs(20), read_ticks(&mut ticks));
    read.await.expect("the rest within 20 s");
    // And the PE connection still serves.
    let mut send = other.clone();
    assert_eq!(
        h2_call(&mut send, front, "/t.E/Warm").await,
        (200, "0".into())
    );
    assert!(p.lines_with("panicked").is_empty());
}

/// The other way: a client-streaming call of 30,000 small messages to a PE that reads it only
/// after 2 s. The call is answered with every byte, and the client's other calls on the same
/// connection meanwhile: the proxy takes the client's frames out of `h2` while the PE is slow
/// to take them, so they do not run out the client's allowance for small frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_small_messages_to_a_slow_pe_arrives_whole_and_costs_no_other_call() {
    let bed = H2Bed::start("late", "Late", ticker_pe().await).await;
    let (front, p) = (bed.front, &bed.proxy);
    let s = TcpStream::connect(front).await.unwrap();
    // Windows for the whole echo coming back: it is read only after the calls beside it.
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .handshake(s)
        .await
        .unwrap();
    tokio::spawn(conn);
    bed.warm(&client).await;
    let mut send = client.clone().ready().await.unwrap();
    let req = grpc_request(front, "/t.E/Late");
    let (resp, mut up) = send.send_request(req, false).unwrap();
    let started = Instant::now();
    let upload = tokio::spawn(async move { send_ticks(&mut up, true).await });
    calls_beside(&client, front, started).await;
    let resp = tokio::time::timeout(Duration::from_secs(20), resp)
        .await
        .expect("the answer within 20 s")
        .expect("an answer, not a reset");
    upload.await.unwrap().expect("the upload");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    read_ticks(&mut body).await;
    assert!(p.lines_with("panicked").is_empty());
}

/// An HTTP/2 PE that tells when a call's stream is reset: `/t.E/Warm` is echoed at once;
/// `/t.E/Hang` is never answered; `/t.E/Upload` reads its body and is never answered. The
/// time each reset is seen goes to the receiver.
async fn cancel_pe() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Instant>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::Builder::new()
                    .handshake::<_, bytes::Bytes>(s)
                    .await
                else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        if req.uri().path() == "/t.E/Warm" {
                            return echo(req, respond).await;
                        }
                        let mut body = req.into_body();
                        let reading = async {
                            while let Some(Ok(d)) = body.data().await {
                                let _ = body.flow_control().release_capacity(d.len());
                            }
                            std::future::pending::<()>().await;
                        };
                        tokio::select! {
                            () = reading => {}
                            _ = std::future::poll_fn(|cx| respond.poll_reset(cx)) => {}
                        }
                        let _ = tx.send(Instant::now());
                    });
                }
            });
        }
    });
    (at, rx)
}

/// A client that cancels its call — while the PE works on it, or in the middle of its
/// upload — has it cancelled at the PE at once, and the PE is not blamed. Before, the
/// proxy waited for the PE's answer until `request-timeout-ms` (30 s) and then ejected the
/// PE, and a cancelled upload ejected it at once: any client could keep a PE ejected, its
/// back-off doubling with each cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_is_cancelled_at_the_pe_and_ejects_nothing() {
    let (pe, mut resets) = cancel_pe().await;
    let bed = H2Bed::start("cancel", "Cancel", pe).await;
    let send = bed.client().await;
    bed.warm(&send).await;
    for (path, upload) in [("/t.E/Hang", false), ("/t.E/Upload", true)] {
        let mut s = send.clone().ready().await.unwrap();
        let (resp, mut body) = s
            .send_request(grpc_request(bed.front, path), false)
            .unwrap();
        body.send_data(bytes::Bytes::from_static(b"\0\0\0\0\x04ping"), !upload)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let cancelled = Instant::now();
        body.send_reset(h2::Reason::CANCEL);
        drop(resp);
        let seen = tokio::time::timeout(Duration::from_secs(5), resets.recv())
            .await
            .unwrap_or_else(|_| panic!("{path}: the PE still works on a cancelled call"))
            .unwrap();
        assert!(
            seen.duration_since(cancelled) < Duration::from_secs(1),
            "{path}: the PE heard of the cancel {:?} after it",
            seen.duration_since(cancelled)
        );
    }
    // The PE serves on, never ejected.
    let mut s = send.clone();
    for _ in 0..5 {
        assert_eq!(
            h2_call(&mut s, bed.front, "/t.E/Warm").await,
            (200, "0".into())
        );
    }
    let ejected = bed.proxy.lines_with("ejected");
    assert!(
        ejected.is_empty(),
        "a client's cancel ejected the PE: {ejected:?}"
    );
}

/// A PE of a pool with `protocol = "h2"` that speaks only HTTP/1.1 (it answers the preface
/// with a 400, as HTTP/1.1 servers do): the clients get 502, and the proxy says once what is
/// likely wrong. Before, nothing was logged (found by trying the proxy as a user would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_pool_whose_pe_speaks_http1_only_is_said_once() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pe = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
                    .await;
            });
        }
    });
    let bed = H2Bed::start("h1only", "H1Only", pe).await;
    let front = bed.front;
    let mut codes = Vec::new();
    for _ in 0..5 {
        wait_for(Duration::from_secs(10), "an answer", || async {
            TcpStream::connect(front).await.is_ok()
        })
        .await;
        let r = h2c_get(front, "/x").await;
        codes.push(r.lines().next().unwrap_or_default().to_owned());
    }
    assert!(
        codes.iter().all(|c| c.starts_with("HTTP/2 502")),
        "{codes:?}"
    );
    wait_for(Duration::from_secs(5), "the proxy says why", || async {
        bed.proxy.lines_with("does it speak HTTP/2").len() == 1
    })
    .await;
}

/// A gRPC call whose deadline has passed when it arrives (`grpc-timeout: 0m`) gets
/// DEADLINE_EXCEEDED without reaching a PE. Before, a PE quick enough answered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_deadline_is_not_sent_to_a_pe() {
    let (pe, _resets) = cancel_pe().await;
    let bed = H2Bed::start("deadline0", "Deadline0", pe).await;
    let send = bed.client().await;
    bed.warm(&send).await;
    let mut s = send.clone().ready().await.unwrap();
    let mut req = grpc_request(bed.front, "/t.E/Warm");
    req.headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static("0m"));
    let (resp, mut body) = s.send_request(req, false).unwrap();
    body.send_data(bytes::Bytes::from_static(b"\0\0\0\0\x04ping"), true)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        resp.headers().get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"4"[..]),
        "{resp:?}"
    );
}
