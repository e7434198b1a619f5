//! Upgrading a running proxy (docs/OPERATIONS.md, "Upgrading without a refused connection"): a
//! second binary started with the same configuration takes the listening sockets over, the old
//! process drains, and no client notices — kept-alive HTTP/1.1 clients, a loop of new
//! connections, HTTP/2 clients that follow GOAWAY, an echo upgrade (as a WebSocket) and a long
//! download stay whole across ten upgrades in a row. SIGUSR2 starts the successor itself.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

mod common;

use common::{BIN, Logged, example_http, fast_config, free_port, registrar};
use rserpool_proxy::http::client::Client;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rserpool-upgrade-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A proxy configuration file as a user writes one: one HTTP listener (HTTP/2 by prior
/// knowledge too), a status listener, no hand-over setting (the default).
fn config(dir: &Path, reg: SocketAddr, http: SocketAddr, status: SocketAddr) -> PathBuf {
    let path = dir.join("proxy.toml");
    std::fs::write(
        &path,
        format!(
            "registrars = [\"{reg}\"]\nrefresh-ms = 200\nstatus = \"{status}\"\n\
             drain-timeout-ms = 60000\n\n\
             [[listener]]\nlisten = \"{http}\"\nmode = \"http\"\npool = \"Backends\"\n"
        ),
    )
    .unwrap();
    path
}

fn proxy(exe: &Path, name: &str, config: &Path) -> Logged {
    let args = vec![
        "proxy".to_string(),
        "--config".into(),
        config.display().to_string(),
    ];
    Logged::spawn_exe(exe, name, &args, "info")
}

/// Waits until `p` says it serves on sockets handed over, and returns how long that took.
async fn took_over(p: &Logged) -> Duration {
    common::wait_until(Duration::from_secs(20), "the hand-over", || {
        !p.lines_with("stopped accepting; this one serves")
            .is_empty()
    })
    .await
}

/// Waits (20 s at most) for `p` to exit.
async fn exits(p: &mut Logged, what: &str) {
    let started = Instant::now();
    while p.proc.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{what} did not exit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn serving(addr: SocketAddr) {
    common::wait_for(
        Duration::from_secs(10),
        "the proxy serving",
        || async move {
            match Client::connect(addr).await {
                Ok(mut c) => c.get("/").await.is_ok_and(|r| r.code == 200),
                Err(_) => false,
            }
        },
    )
    .await;
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    /// HTTP/2 streams a GOAWAY said were never processed, sent again on a new connection.
    retried: AtomicU64,
    connections: AtomicU64,
}

impl Tally {
    fn fail(&self, what: &str, e: impl std::fmt::Display) {
        if self.failed.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("{what}: {e}");
        }
    }
}

/// Kept-alive HTTP/1.1 requests, one after the other; a `Connection: close` answer (a draining
/// proxy) is followed by a new connection.
async fn keep_alive(addr: SocketAddr, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    while !stop.load(Ordering::Relaxed) {
        let mut c = match Client::connect(addr).await {
            Ok(c) => c,
            Err(e) => {
                t.fail("keep-alive connect", e);
                continue;
            }
        };
        t.connections.fetch_add(1, Ordering::Relaxed);
        while !stop.load(Ordering::Relaxed) {
            match c.get("/").await {
                Ok(r) if r.code == 200 => {
                    t.ok.fetch_add(1, Ordering::Relaxed);
                    if r.header("connection").as_deref() == Some("close") {
                        break;
                    }
                }
                Ok(r) => {
                    t.fail("keep-alive", r.code);
                    break;
                }
                Err(e) => {
                    t.fail("keep-alive", e);
                    break;
                }
            }
        }
    }
}

/// A new connection for every request.
async fn new_connections(addr: SocketAddr, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    while !stop.load(Ordering::Relaxed) {
        match Client::connect(addr).await {
            Ok(mut c) => match c.get("/").await {
                Ok(r) if r.code == 200 => {
                    t.ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(r) => t.fail("new connection", r.code),
                Err(e) => t.fail("new connection", e),
            },
            Err(e) => t.fail("connect", e),
        }
    }
}

/// HTTP/2 (prior knowledge) as a well-behaved client: no new stream after a GOAWAY, a new
/// connection instead; a stream the GOAWAY says was not processed is sent again.
async fn h2_client(addr: SocketAddr, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    let mut pending_retry = false;
    'connection: while !stop.load(Ordering::Relaxed) {
        let tcp = match TcpStream::connect(addr).await {
            Ok(s) => s,
            Err(e) => {
                t.fail("h2 connect", e);
                continue;
            }
        };
        let (send, conn) = match h2::client::handshake(tcp).await {
            Ok(x) => x,
            Err(e) => {
                t.fail("h2 handshake", e);
                continue;
            }
        };
        tokio::spawn(conn);
        t.connections.fetch_add(1, Ordering::Relaxed);
        while pending_retry || !stop.load(Ordering::Relaxed) {
            // Refused once a GOAWAY came: a new connection.
            let Ok(mut s) = send.clone().ready().await else {
                continue 'connection;
            };
            let req = http::Request::get(format!("http://{addr}/"))
                .body(())
                .unwrap();
            let Ok((resp, _)) = s.send_request(req, true) else {
                continue 'connection;
            };
            match resp.await {
                Ok(r) if r.status() == 200 => {
                    let mut body = r.into_body();
                    let mut whole = true;
                    while let Some(d) = body.data().await {
                        match d {
                            Ok(d) => {
                                let _ = body.flow_control().release_capacity(d.len());
                            }
                            Err(e) => {
                                t.fail("h2 body", e);
                                whole = false;
                                break;
                            }
                        }
                    }
                    if whole {
                        t.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    pending_retry = false;
                }
                Ok(r) => t.fail("h2", r.status()),
                // Not processed (RFC 9113, 6.8): safe to send again.
                Err(e) if e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM) => {
                    t.retried.fetch_add(1, Ordering::Relaxed);
                    pending_retry = true;
                    continue 'connection;
                }
                Err(e) => {
                    t.fail("h2", e);
                    continue 'connection;
                }
            }
        }
    }
}

/// Ten upgrades in a row to a second binary under load: 0 refused connections, 0 failed
/// requests; an echo upgrade and a 1 GB download opened before the first upgrade finish intact,
/// served by the first process while it drains; the first process exits when they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_upgrades_under_load_refuse_and_break_nothing() {
    let dir = tempdir("ten");
    // The second binary, as a package upgrade installs it.
    let next = dir.join("rserpool-next");
    std::fs::copy(BIN, &next).unwrap();
    let reg = registrar(fast_config());
    let _pes = [
        example_http(reg.asap_addr(), "Backends", 1, &["--policy", "rr"]).await,
        example_http(reg.asap_addr(), "Backends", 2, &["--policy", "rr"]).await,
    ];
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cfg = config(&dir, reg.asap_addr(), http, status);
    let mut first = proxy(Path::new(BIN), "proxy-0", &cfg);
    serving(http).await;

    // Long-lived: an echo upgrade and a download, both through the first process.
    let mut echo = TcpStream::connect(http).await.unwrap();
    echo.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let mut head = vec![0u8; 256];
    let n = echo.read(&mut head).await.unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 101"),
        "{:?}",
        String::from_utf8_lossy(&head[..n])
    );
    let size: u64 = 1 << 30;
    let mut download = TcpStream::connect(http).await.unwrap();
    download
        .write_all(format!("GET /bytes/{size} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (ka, nc, h2) = (
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
    );
    let mut load = Vec::new();
    for _ in 0..4 {
        load.push(tokio::spawn(keep_alive(http, stop.clone(), ka.clone())));
        load.push(tokio::spawn(h2_client(http, stop.clone(), h2.clone())));
    }
    load.push(tokio::spawn(new_connections(
        http,
        stop.clone(),
        nc.clone(),
    )));
    load.push(tokio::spawn(new_connections(
        http,
        stop.clone(),
        nc.clone(),
    )));
    // wrk, as a user measures: 50 kept-alive connections, stopped (SIGINT: it reports) after
    // the upgrades.
    let wrk = std::process::Command::new("wrk")
        .args(["-t1", "-c50", "-d120s"])
        .arg(format!("http://{http}/"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wrk runs (.ci/run installs it)");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut procs = Vec::new();
    for i in 1..=10 {
        let exe = if i % 2 == 1 {
            next.as_path()
        } else {
            Path::new(BIN)
        };
        let p = proxy(exe, &format!("proxy-{i}"), &cfg);
        took_over(&p).await;
        // The echo goes on through the first process.
        let msg = format!("message {i}");
        echo.write_all(msg.as_bytes()).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), echo.read_exact(&mut got))
            .await
            .expect("the echo answers")
            .unwrap();
        assert_eq!(got, msg.as_bytes());
        procs.push(p);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    common::signal(&wrk, rustix::process::Signal::INT);
    let wrk = tokio::task::spawn_blocking(move || wrk.wait_with_output().unwrap())
        .await
        .unwrap();
    let wrk = String::from_utf8_lossy(&wrk.stdout).into_owned();
    eprintln!("{wrk}");
    assert!(wrk.contains("requests in"), "wrk ran: {wrk}");
    assert!(
        !wrk.contains("Socket errors"),
        "wrk saw socket errors: {wrk}"
    );
    assert!(!wrk.contains("Non-2xx"), "wrk saw failed requests: {wrk}");
    // Every process but the last has handed over; those without long-lived connections exit.
    for (i, p) in procs.iter_mut().enumerate().take(9) {
        exits(p, &format!("proxy-{} after handing over", i + 1)).await;
    }
    assert!(
        first.proc.try_wait().unwrap().is_none(),
        "the first process serves its long connections"
    );

    // The download, read only now, arrives whole from the first process.
    let mut buf = vec![0u8; 1 << 20];
    let mut headed = Vec::new();
    let body_start = loop {
        let n = download.read(&mut buf).await.unwrap();
        assert!(n > 0, "the download closed before its head");
        headed.extend_from_slice(&buf[..n]);
        if let Some(at) = headed.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    assert!(headed.starts_with(b"HTTP/1.1 200"));
    let mut offset = 0u64;
    let check = |data: &[u8], offset: &mut u64| {
        for &b in data {
            // `example http`'s download pattern.
            assert_eq!(b, (*offset % 251) as u8, "byte {offset}");
            *offset += 1;
        }
    };
    check(&headed[body_start..], &mut offset);
    while offset < size {
        let n = tokio::time::timeout(Duration::from_secs(30), download.read(&mut buf))
            .await
            .expect("the download goes on")
            .unwrap();
        assert!(n > 0, "the download was cut at {offset} of {size} bytes");
        check(&buf[..n], &mut offset);
    }
    echo.write_all(b"last").await.unwrap();
    let mut last = [0u8; 4];
    echo.read_exact(&mut last).await.unwrap();
    assert_eq!(&last, b"last");
    drop((echo, download));
    // Its long connections ended: the first process exits.
    exits(&mut first, "the first process").await;

    let count = |t: &Tally| {
        (
            t.ok.load(Ordering::Relaxed),
            t.failed.load(Ordering::Relaxed),
            t.retried.load(Ordering::Relaxed),
            t.connections.load(Ordering::Relaxed),
        )
    };
    let (ka, nc, h2) = (count(&ka), count(&nc), count(&h2));
    eprintln!(
        "keep-alive (ok, failed, -, connections) {ka:?}; new connections {nc:?}; HTTP/2 (ok, failed, retried, connections) {h2:?}"
    );
    assert_eq!((ka.1, nc.1, h2.1), (0, 0, 0), "no request failed");
    assert!(ka.0 > 100 && nc.0 > 100 && h2.0 > 100, "the load ran");
    // Each upgrade moved the kept-alive clients to a new process.
    assert!(
        ka.3 >= 10 && h2.3 >= 10,
        "clients reconnected as processes drained"
    );
    // The last process serves on.
    serving(http).await;
    assert!(
        rserpool_status::get(status, "/status")
            .await
            .is_ok_and(|(c, _)| c == 200)
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(dir);
}

/// `kill -USR2` (what the systemd unit's reload does): the running proxy starts its own
/// successor, which takes over; the old process exits, the port serves throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_starts_a_successor_that_takes_over() {
    let dir = tempdir("usr2");
    let reg = registrar(fast_config());
    let _pe = example_http(reg.asap_addr(), "Backends", 1, &[]).await;
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cfg = config(&dir, reg.asap_addr(), http, status);
    let mut old = proxy(Path::new(BIN), "proxy-old", &cfg);
    serving(http).await;
    let stop = Arc::new(AtomicBool::new(false));
    let nc = Arc::new(Tally::default());
    let load = tokio::spawn(new_connections(http, stop.clone(), nc.clone()));
    common::signal(&old.proc, rustix::process::Signal::USR2);
    // The successor is the old process's child: its pid is in the old one's log.
    common::wait_until(Duration::from_secs(10), "the successor started", || {
        !old.lines_with("to take over").is_empty()
    })
    .await;
    let line = old.lines_with("to take over").remove(0);
    let pid: u32 = line
        .split("as process ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"));
    let _successor = KillPid(pid);
    exits(&mut old, "the old process, handing over").await;
    assert!(!old.lines_with("took over the listeners").is_empty());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert_eq!(nc.failed.load(Ordering::Relaxed), 0, "no connection failed");
    assert!(nc.ok.load(Ordering::Relaxed) > 10);
    serving(http).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A process by pid (not our child), killed when dropped.
struct KillPid(u32);

impl Drop for KillPid {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0 as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// A single registrar upgraded five times in a row (a second process with the same flags takes
/// it over) under 1,000 PEs and a pool user resolving in a loop: every resolution answers with
/// all 1,000 PEs, no PE ever has to register again, and the Server Identifier stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_upgraded_five_times_keeps_its_pes_and_answers_every_resolution() {
    use rserpool_asap::{PeState, PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
    use rserpool_wire::{Policy, PoolHandle};
    let asap = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args: Vec<String> = [
        "registrar",
        "--asap",
        &asap.to_string(),
        "--enrp",
        &SocketAddr::from(([127, 0, 0, 1], free_port())).to_string(),
        "--status",
        &status.to_string(),
        // Keep-alive rounds every 300 ms: the adopted associations must answer them.
        "--keep-alive-interval-ms",
        "300",
        "--keep-alive-timeout-ms",
        "1000",
    ]
    .map(String::from)
    .to_vec();
    let first = Logged::spawn("registrar-0", &args, "info");
    common::wait_until(Duration::from_secs(10), "the registrar", || {
        std::net::TcpStream::connect(asap).is_ok()
    })
    .await;
    const N: usize = 1000;
    let forced = Arc::new(AtomicU64::new(0));
    let mut pes = Vec::with_capacity(N);
    for i in 0..N {
        let mut cfg = PoolElementConfig::new(
            "Big",
            SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16)),
            Policy::RoundRobin,
        );
        cfg.registrars = vec![asap];
        let pe = PoolElement::start(cfg).unwrap();
        // Registering again after having been registered: the association was lost.
        let mut state = pe.watch_state();
        let forced = forced.clone();
        tokio::spawn(async move {
            let mut registered = false;
            while state.changed().await.is_ok() {
                match &*state.borrow() {
                    PeState::Registered { .. } => registered = true,
                    PeState::Registering if registered => {
                        forced.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
        });
        pes.push(pe);
    }
    let handle = PoolHandle::from("Big");
    let mut pu = PoolUser::new(PoolUserConfig {
        registrars: vec![asap],
        ..PoolUserConfig::default()
    })
    .unwrap();
    common::wait_for(Duration::from_secs(30), "1,000 PEs registered", || {
        let h = handle.clone();
        let mut pu = PoolUser::new(PoolUserConfig {
            registrars: vec![asap],
            ..PoolUserConfig::default()
        })
        .unwrap();
        async move { pu.pool_elements(&h).await.is_ok_and(|(_, p)| p.len() == N) }
    })
    .await;
    let id_before = common::registrar_status(status).await.unwrap().server_id;

    let stop = Arc::new(AtomicBool::new(false));
    let resolving = tokio::spawn({
        let stop = stop.clone();
        let handle = handle.clone();
        async move {
            let (mut ok, mut failed) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                match pu.pool_elements(&handle).await {
                    Ok((_, p)) if p.len() == N => ok += 1,
                    Ok((_, p)) => {
                        failed += 1;
                        eprintln!("a resolution with {} PEs", p.len());
                    }
                    Err(e) => {
                        failed += 1;
                        eprintln!("a resolution failed: {e}");
                    }
                }
            }
            (ok, failed)
        }
    });
    let mut procs = vec![first];
    for i in 1..=5 {
        let p = Logged::spawn(&format!("registrar-{i}"), &args, "info");
        common::wait_until(Duration::from_secs(20), "the hand-over", || {
            !p.lines_with("stopped serving; this one serves").is_empty()
        })
        .await;
        assert!(
            !p.lines_with(&format!("took over {} associations", N + 1))
                .is_empty(),
            "every association was taken over: {:?}",
            p.lines_with("took over")
        );
        procs.push(p);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Several keep-alive rounds of the last registrar, resolving on.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = resolving.await.unwrap();
    eprintln!("resolutions: {ok} answered with every PE, {failed} not");
    assert_eq!(failed, 0);
    assert!(ok > 10);
    let s = common::registrar_status(status).await.unwrap();
    assert_eq!(s.server_id, id_before, "the Server Identifier stays");
    assert_eq!(s.pool_elements, N);
    assert_eq!(
        forced.load(Ordering::Relaxed),
        0,
        "no PE had to register again"
    );
    for (i, p) in procs.iter_mut().enumerate().take(5) {
        exits(p, &format!("registrar-{i}")).await;
    }
    drop(pes);
}

/// A registrar's successor whose settings name another status address serves status there,
/// and the old address closes with the old process. Before, the hand-over kept the old
/// listener and ignored the setting, saying `status on` the old address (found by an
/// operator).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_upgraded_with_another_status_address_serves_status_there() {
    let asap = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let enrp = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let (old_status, new_status) = (
        SocketAddr::from(([127, 0, 0, 1], free_port())),
        SocketAddr::from(([127, 0, 0, 1], free_port())),
    );
    let args = |status: SocketAddr| -> Vec<String> {
        [
            "registrar",
            "--asap",
            &asap.to_string(),
            "--enrp",
            &enrp.to_string(),
            "--status",
            &status.to_string(),
        ]
        .map(String::from)
        .to_vec()
    };
    let first = Logged::spawn("registrar-old", &args(old_status), "info");
    common::wait_until(Duration::from_secs(10), "the registrar", || {
        std::net::TcpStream::connect(old_status).is_ok()
    })
    .await;
    let id = common::registrar_status(old_status)
        .await
        .unwrap()
        .server_id;
    let next = Logged::spawn("registrar-new", &args(new_status), "info");
    common::wait_until(Duration::from_secs(20), "the hand-over", || {
        !next
            .lines_with("stopped serving; this one serves")
            .is_empty()
    })
    .await;
    let st = common::registrar_status(new_status)
        .await
        .expect("status on the configured address");
    assert_eq!(st.server_id, id, "the same registrar, handed over");
    drop(first);
    common::wait_until(
        Duration::from_secs(10),
        "the old status address closes",
        || std::net::TcpStream::connect(old_status).is_err(),
    )
    .await;
    assert!(
        next.lines_with(&format!("status on http://{old_status}"))
            .is_empty()
    );
}
