//! The proxy over real sockets on loopback: a real registrar, HTTP pool elements as separate
//! `rserpool example http` processes (so one can be killed with SIGKILL), pool elements
//! registered through the library with chosen policies and loads, and the proxy itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop, fast_config, free_port, registrar, wait_until};

use rserpool_asap::{PoolElement, PoolElementConfig};
use rserpool_proxy::http::client::Client;
use rserpool_proxy::{ListenerConfig, Mode, Proxy, ProxyConfig};
use rserpool_registrar::RegistrarThread;
use rserpool_wire::Policy;
use rserpool_wire::policy::load_from_fraction;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `rserpool example http` processes, PE IDs 1..=n, in pool `Backends` (round robin).
struct Backends {
    children: Vec<KillOnDrop>,
    addrs: Vec<SocketAddr>,
}

async fn backends(reg: SocketAddr, n: u32) -> Backends {
    let mut b = Backends {
        children: Vec::new(),
        addrs: Vec::new(),
    };
    for id in 1..=n {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let child = Command::new(BIN)
            .args(["example", "http", "--pool", "Backends", "--policy", "rr"])
            .args(["--id", &id.to_string(), "--listen", &addr.to_string()])
            .args(["--registrar", &reg.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        b.children.push(KillOnDrop(child));
        b.addrs.push(addr);
    }
    for a in &b.addrs {
        wait_until(Duration::from_secs(10), "backend listening", || {
            std::net::TcpStream::connect(a).is_ok()
        })
        .await;
    }
    b
}

/// A library PE in `pool` pointing at `target`, with the given policy.
fn pe(reg: SocketAddr, pool: &str, id: u32, target: SocketAddr, policy: Policy) -> PoolElement {
    let mut cfg = PoolElementConfig::new(pool, target, policy);
    cfg.registrars = vec![reg];
    cfg.id = Some(id);
    PoolElement::start(cfg).unwrap()
}

fn proxy_config(reg: SocketAddr, listeners: Vec<(Mode, &str)>) -> ProxyConfig {
    ProxyConfig {
        registrars: vec![reg.into()],
        refresh_ms: 200,
        listeners: listeners
            .into_iter()
            .map(|(mode, pool)| ListenerConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], free_port())),
                mode,
                pool: Some(pool.into()),
                routes: Vec::new(),
                splice: None,
                certificates: Vec::new(),
                http2: true,
                defer_accept: None,
            })
            .collect(),
        ..ProxyConfig::default()
    }
}

async fn start_proxy(cfg: ProxyConfig, expect_pes: usize) -> Proxy {
    let p = Proxy::start(cfg).await.unwrap();
    let pools = p.pools().clone();
    wait_until(Duration::from_secs(10), "proxy has the pools", || {
        pools.all().iter().all(|x| x.len() >= expect_pes)
    })
    .await;
    p
}

/// A registrar, the three `Backends` PEs and a proxy with one listener per mode onto them.
async fn backends_behind_proxy(modes: &[Mode]) -> (RegistrarThread, Backends, Proxy) {
    let reg = registrar(fast_config());
    let b = backends(reg.asap_addr(), 3).await;
    let listeners = modes.iter().map(|&m| (m, "Backends")).collect();
    let proxy = start_proxy(proxy_config(reg.asap_addr(), listeners), 3).await;
    (reg, b, proxy)
}

fn id(n: u32) -> String {
    format!("{n:#010x}")
}

/// What `rserpool example http` answers to an upload of `body`.
fn received(body: &[u8]) -> String {
    format!("received {} bytes, fnv1a {:016x}\n", body.len(), fnv(body))
}

fn fnv(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_tcp_reach_every_pool_element() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http, Mode::Tcp]).await;
    let addrs = proxy.local_addrs();
    // HTTP, one kept-alive connection: round robin gives each PE every third request.
    let mut c = Client::connect(addrs[0]).await.unwrap();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..30 {
        let r = c.get("/hello").await.unwrap();
        assert_eq!(r.code, 200);
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(text.contains("GET /hello for 127.0.0.1"), "{text}");
        *counts.entry(r.header("x-pe-id").unwrap()).or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.values().all(|&n| n == 10), "{counts:?}");
    // TCP: each connection goes to one PE, the next connection to the next.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let mut c = Client::connect(addrs[1]).await.unwrap();
        let r = c
            .send(b"GET /tcp HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(r.code, 200);
        assert!(r.close);
        seen.push(r.header("x-pe-id").unwrap());
    }
    seen.sort();
    assert_eq!(seen, [id(1), id(2), id(3)]);
    drop(b);
}

/// Counts which PE answered `n` requests, over a few connections.
async fn distribution(addr: SocketAddr, n: usize) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    let mut c = Client::connect(addr).await.unwrap();
    for _ in 0..n {
        let r = c.get("/").await.unwrap();
        assert_eq!(r.code, 200);
        *counts.entry(r.header("x-pe-id").unwrap()).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_distributes_as_defined() {
    let reg = registrar(fast_config());
    let r = reg.asap_addr();
    let b = backends(r, 3).await;
    let t = &b.addrs;
    let lu = |l: f64| Policy::LeastUsed {
        load: load_from_fraction(l),
    };
    let rlu = |l: f64| Policy::RandomizedLeastUsed {
        load: load_from_fraction(l),
    };
    let wr = |w: u32| Policy::WeightedRandom { weight: w };
    let _pes = [
        pe(r, "WRAND", 11, t[0], wr(1)),
        pe(r, "WRAND", 12, t[1], wr(2)),
        pe(r, "WRAND", 13, t[2], wr(5)),
        pe(r, "LU", 21, t[0], lu(0.5)),
        pe(r, "LU", 22, t[1], lu(0.1)),
        pe(r, "LU", 23, t[2], lu(0.9)),
        pe(r, "RLU", 31, t[0], rlu(0.0)),
        pe(r, "RLU", 32, t[1], rlu(0.5)),
        pe(r, "RLU", 33, t[2], rlu(0.75)),
    ];
    for p in &_pes {
        p.wait_registered(Duration::from_secs(5)).await.unwrap();
    }
    let proxy = start_proxy(
        proxy_config(
            r,
            vec![
                (Mode::Http, "WRAND"),
                (Mode::Http, "LU"),
                (Mode::Http, "RLU"),
            ],
        ),
        3,
    )
    .await;
    let a = proxy.local_addrs();
    let n = 1600;
    let share =
        |c: &HashMap<String, usize>, pe: u32| *c.get(&id(pe)).unwrap_or(&0) as f64 / n as f64;
    // Weighted random: probability ∝ weight (1 : 2 : 5).
    let c = distribution(a[0], n).await;
    for (pe, p) in [(1, 1.0 / 8.0), (2, 2.0 / 8.0), (3, 5.0 / 8.0)] {
        assert!((share(&c, pe) - p).abs() < 0.05, "WRAND {c:?}");
    }
    // Least used: always the PE with the lowest load.
    let c = distribution(a[1], 200).await;
    assert_eq!(c.get(&id(2)), Some(&200), "LU {c:?}");
    // Randomized least used: probability ∝ free capacity (1 : 0.5 : 0.25).
    let c = distribution(a[2], n).await;
    for (pe, p) in [(1, 4.0 / 7.0), (2, 2.0 / 7.0), (3, 1.0 / 7.0)] {
        assert!((share(&c, pe) - p).abs() < 0.05, "RLU {c:?}");
    }
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pe_reporting_high_load_gets_less_within_one_refresh() {
    let reg = registrar(fast_config());
    let r = reg.asap_addr();
    let b = backends(r, 3).await;
    let lu = |l: f64| Policy::LeastUsed {
        load: load_from_fraction(l),
    };
    let pes: Vec<PoolElement> = (0..3)
        .map(|i| pe(r, "LU", 41 + i as u32, b.addrs[i], lu(0.2)))
        .collect();
    for p in &pes {
        p.wait_registered(Duration::from_secs(5)).await.unwrap();
    }
    let cfg = proxy_config(r, vec![(Mode::Http, "LU")]);
    let refresh = Duration::from_millis(cfg.refresh_ms);
    let proxy = start_proxy(cfg, 3).await;
    let a = proxy.local_addrs()[0];
    // Equal loads: ties go round robin.
    let c = distribution(a, 30).await;
    assert!(c.values().all(|&n| n == 10), "{c:?}");
    // PE 1 reports 90 %: after one refresh it gets nothing while the others are at 20 %.
    pes[0].update_load(0.9);
    let changed = Instant::now();
    let mut client = Client::connect(a).await.unwrap();
    let took = loop {
        let mut hit = false;
        for _ in 0..6 {
            hit |= client.get("/").await.unwrap().header("x-pe-id") == Some(id(1));
        }
        if !hit {
            break changed.elapsed();
        }
        assert!(changed.elapsed() < refresh * 5, "PE 1 still chosen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!("least used saw the load change after {took:?} (refresh {refresh:?})");
    assert!(took < refresh * 2 + Duration::from_millis(300), "{took:?}");
    let c = distribution(a, 60).await;
    assert!(!c.contains_key(&id(1)), "{c:?}");
    drop(b);
}

/// Clients sending GETs in a loop until `stop`; counts successes, failures and per-PE answers.
struct Load {
    ok: AtomicU64,
    failed: AtomicU64,
    last_from: std::sync::Mutex<HashMap<String, Instant>>,
}

fn start_load(
    addr: SocketAddr,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
    let load = Arc::new(Load {
        ok: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        last_from: std::sync::Mutex::new(HashMap::new()),
    });
    let tasks = (0..clients)
        .map(|_| {
            let load = load.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut c: Option<Client> = None;
                while !stop.load(Ordering::Relaxed) {
                    if c.is_none() {
                        c = Client::connect(addr).await.ok();
                    }
                    let Some(cl) = c.as_mut() else {
                        load.failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    match cl.get("/").await {
                        Ok(r) if r.code == 200 => {
                            load.ok.fetch_add(1, Ordering::Relaxed);
                            if let Some(pe) = r.header("x-pe-id") {
                                load.last_from.lock().unwrap().insert(pe, Instant::now());
                            }
                            if r.close {
                                c = None;
                            }
                        }
                        Ok(r) => {
                            eprintln!("failed request: {}", r.code);
                            load.failed.fetch_add(1, Ordering::Relaxed);
                            c = None;
                        }
                        Err(e) => {
                            eprintln!("failed request: {e}");
                            load.failed.fetch_add(1, Ordering::Relaxed);
                            c = None;
                        }
                    }
                }
            })
        })
        .collect();
    (load, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pe_killed_under_load_fails_no_idempotent_request() {
    let (_reg, mut b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    let stop = Arc::new(AtomicBool::new(false));
    let (load, tasks) = start_load(addr, 8, stop.clone());
    wait_until(Duration::from_secs(5), "load running", || {
        load.ok.load(Ordering::Relaxed) > 300
    })
    .await;
    let victim = proxy
        .pools()
        .all()
        .into_iter()
        .flat_map(|p| p.backends())
        .find(|x| x.id == 2)
        .unwrap();
    b.children[1].kill().unwrap();
    let killed = Instant::now();
    b.children[1].wait().unwrap();
    // The failure becomes visible at the first connection refused, or when the registrar,
    // which saw the PE's association close, pushes the pool without it (the proxy subscribes);
    // from then on no request may be sent to the PE.
    let pools = proxy.pools().clone();
    let listed = || {
        pools
            .all()
            .iter()
            .any(|p| p.backends().iter().any(|x| Arc::ptr_eq(x, &victim)))
    };
    wait_until(Duration::from_secs(5), "the proxy sees the failure", || {
        victim.stats.failures.load(Ordering::Relaxed) > 0 || !listed()
    })
    .await;
    let visible = killed.elapsed();
    // Requests that had picked the PE just before may still go out (and fail over); none
    // picks it from then on.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sent_then = victim.stats.requests.load(Ordering::Relaxed);
    let ok_then = load.ok.load(Ordering::Relaxed);
    wait_until(
        Duration::from_secs(10),
        "more load after the failure",
        || load.ok.load(Ordering::Relaxed) > ok_then + 1000,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let last = load.last_from.lock().unwrap().get(&id(2)).copied();
    let refused = victim.stats.failures.load(Ordering::Relaxed) > 0;
    eprintln!(
        "failure visible after {visible:?} ({}); {} ok, {} failed; last answer from PE 2 {:?} after the kill",
        if refused {
            "a connection refused"
        } else {
            "the registrar's push"
        },
        load.ok.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed),
        last.map(|l| l.saturating_duration_since(killed))
    );
    assert_eq!(load.failed.load(Ordering::Relaxed), 0);
    assert_eq!(victim.stats.requests.load(Ordering::Relaxed), sent_then);
    if refused {
        assert!(victim.stats.ejections.load(Ordering::Relaxed) >= 1);
    }
    assert!(!listed(), "the PE is gone from the proxy's pool");
    // Its ejection outlives it in the pool's count (the PE's own series are gone).
    if refused {
        let pool = proxy.pools().all().into_iter().next().unwrap();
        assert!(pool.ejections()[0] >= 1, "{:?}", pool.ejections());
    }
}

/// A reload whose new listener cannot be bound (its port is taken) changes nothing: the
/// running listener keeps its pool, and no listener is added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_cannot_bind_a_listener_changes_nothing() {
    let (_reg, _b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cfg = proxy.config().as_ref().clone();
    let first = cfg.listeners[0].listen;
    cfg.listeners[0].pool = Some("Elsewhere".into());
    let mut extra = cfg.listeners[0].clone();
    extra.listen = busy.local_addr().unwrap();
    cfg.listeners.push(extra);
    let refused = proxy.reload(cfg).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(proxy.local_addrs(), vec![first]);
    let mut c = Client::connect(first).await.unwrap();
    assert_eq!(
        c.get("/").await.unwrap().code,
        200,
        "the listener lost its pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_on_when_the_registrar_stops() {
    let (reg, b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    reg.stop();
    let pools = proxy.pools().clone();
    wait_until(Duration::from_secs(10), "the proxy notices", || {
        !pools.registrar_reachable()
    })
    .await;
    let c = distribution(addr, 90).await;
    assert_eq!(c.len(), 3, "{c:?}");
    assert_eq!(proxy.stats_json()["registrar_reachable"], false);
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_listener_shows_pools_and_counters() {
    let reg = registrar(fast_config());
    let b = backends(reg.asap_addr(), 3).await;
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let proxy = start_proxy(
        ProxyConfig {
            status: Some(status),
            ..proxy_config(reg.asap_addr(), vec![(Mode::Http, "Backends")])
        },
        3,
    )
    .await;
    let c = distribution(proxy.local_addrs()[0], 9).await;
    assert_eq!(c.values().sum::<usize>(), 9);
    // `/stats` is the older name of the same document.
    for path in ["/status", "/stats"] {
        let (code, body) = rserpool_status::get(status, path).await.unwrap();
        assert_eq!(code, 200, "{path}");
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["registrar_reachable"], true);
        let pes = doc["pools"][0]["pool_elements"].as_array().unwrap();
        assert_eq!(pes.len(), 3, "{doc}");
        let requests: u64 = pes.iter().map(|p| p["requests"].as_u64().unwrap()).sum();
        assert_eq!(requests, 9, "{doc}");
    }
    assert_eq!(rserpool_status::get(status, "/nope").await.unwrap().0, 404);
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_uploads_and_downloads_arrive_byte_exact() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http, Mode::Tcp]).await;
    let want_download: Vec<u8> = (0..24_000_000u64).map(|i| (i % 251) as u8).collect();
    let upload: Vec<u8> = (0..20_000_000u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for addr in proxy.local_addrs() {
        let mut c = Client::connect(addr).await.unwrap();
        let r = c
            .get(&format!("/bytes/{}", want_download.len()))
            .await
            .unwrap();
        assert_eq!(r.code, 200);
        assert!(r.body == want_download, "download differs via {addr}");
        // Content-Length upload.
        let mut req = format!(
            "PUT /up HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
            upload.len()
        )
        .into_bytes();
        req.extend_from_slice(&upload);
        let r = c.send(&req).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&r.body), received(&upload));
        // Chunked upload, passed through as it came; the PE takes the coding apart and hashes
        // the payload.
        let mut chunked = Vec::new();
        for part in upload.chunks(1_000_003) {
            chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
            chunked.extend_from_slice(part);
            chunked.extend_from_slice(b"\r\n");
        }
        chunked.extend_from_slice(b"0\r\n\r\n");
        let mut req =
            b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        req.extend_from_slice(&chunked);
        let r = c.send(&req).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&r.body), received(&upload));
    }
    drop(b);
}

/// An HTTP listener takes a connection once its request is there (`defer-accept`, on by
/// default): a client that has connected and sent nothing is not yet one of the proxy's
/// connections, and is taken about a second later all the same; `defer-accept = false` takes
/// it at once, and so does a deferring listener a reload turned it off on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_listener_takes_a_connection_once_its_request_is_there() {
    let reg = registrar(fast_config());
    let mut cfg = proxy_config(
        reg.asap_addr(),
        vec![(Mode::Http, "Nobody"), (Mode::Http, "Nobody")],
    );
    cfg.listeners[1].defer_accept = Some(false);
    let (deferred, at_once) = (cfg.listeners[0].listen, cfg.listeners[1].listen);
    let proxy = Proxy::start(cfg.clone()).await.unwrap();
    let _silent = tokio::net::TcpStream::connect(deferred).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proxy.active_connections(), 0, "taken before its request");
    let t = Instant::now();
    let _other = tokio::net::TcpStream::connect(at_once).await.unwrap();
    wait_until(Duration::from_secs(5), "taken at once", || {
        proxy.active_connections() >= 1
    })
    .await;
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    wait_until(Duration::from_secs(5), "taken after the deferral", || {
        proxy.active_connections() == 2
    })
    .await;
    let mut changed = cfg.clone();
    changed.listeners[0].defer_accept = Some(false);
    let ignored = proxy.reload(changed).await.unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    let t = Instant::now();
    let _late = tokio::net::TcpStream::connect(deferred).await.unwrap();
    wait_until(
        Duration::from_secs(5),
        "taken at once after the reload",
        || proxy.active_connections() == 3,
    )
    .await;
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

/// The proxy ends the connection cleanly right after the response: nothing more, then EOF.
async fn closed_after_response(c: &mut Client) {
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), c.stream.read_to_end(&mut rest))
        .await
        .expect("the proxy closes after the last response");
    assert!(
        end.is_ok() && rest.is_empty(),
        "{end:?}, {} bytes after the body",
        rest.len()
    );
}

/// The last response on a connection goes out with the FIN (MSG_MORE, then shutdown): whole
/// bodies, small (one write) and large (the last of many), then a clean end of stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_responses_arrive_whole_before_the_close() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    for (n, req) in [
        (
            0,
            "GET /bytes/0 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        ),
        (
            100,
            "GET /bytes/100 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        ),
        (60_000, "GET /bytes/60000 HTTP/1.0\r\nHost: t\r\n\r\n"),
        (
            3_000_000,
            "GET /bytes/3000000 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        ),
    ] {
        for _ in 0..20 {
            let mut c = Client::connect(addr).await.unwrap();
            let r = c.send(req.as_bytes()).await.unwrap();
            assert_eq!(r.code, 200);
            assert!(r.close, "{req:?} is answered with Connection: close");
            let want: Vec<u8> = (0..n as u64).map(|i| (i % 251) as u8).collect();
            assert!(r.body == want, "body of {req:?} differs");
            closed_after_response(&mut c).await;
        }
    }
    drop(b);
}

/// A client that sends more after a `Connection: close` request (a pipelined request, the
/// rest of an upload) while the response is still on its way gets the whole response:
/// closing a socket with unread bytes makes Linux send a RST, which destroys what the client
/// has not read yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_after_the_last_request_do_not_cut_off_its_response() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    // Larger than the socket buffers on loopback (several MB): the proxy is still sending when
    // the extra bytes come. (A client that sends more only after the proxy has closed gets
    // a RST, as from HAProxy or nginx.)
    let n = 20_000_000u64;
    let want: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    for _ in 0..3 {
        let mut c = Client::connect(addr).await.unwrap();
        let req = format!("GET /bytes/{n} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        c.stream.write_all(req.as_bytes()).await.unwrap();
        // Once the proxy has read the request, more arrives; the client reads only later.
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.stream
            .write_all(b"GET /more HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let r = c.read_response(false, true).await.unwrap();
        assert_eq!(r.code, 200);
        assert!(
            r.body == want,
            "{} of {n} bytes arrived intact",
            r.body.len()
        );
    }
    drop(b);
}

/// A PE that answers every request with a chunked body, whatever the request's version.
async fn chunked_pe() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
                          5\r\nhello\r\n0\r\n\r\n",
                    )
                    .await;
            });
        }
    });
    addr
}

/// Chunked responses go to HTTP/1.1 clients as they are; an HTTP/1.0 client, which cannot
/// read them, gets a 502 instead (a PE must not send one to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_responses_reach_http_1_1_clients_only() {
    let reg = registrar(fast_config());
    let _pe = pe(
        reg.asap_addr(),
        "Chunky",
        1,
        chunked_pe().await,
        Policy::RoundRobin,
    );
    let proxy = start_proxy(
        proxy_config(reg.asap_addr(), vec![(Mode::Http, "Chunky")]),
        1,
    )
    .await;
    let addr = proxy.local_addrs()[0];
    let mut c = Client::connect(addr).await.unwrap();
    let r = c.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
    assert_eq!(r.code, 200);
    assert_eq!(r.header("transfer-encoding").as_deref(), Some("chunked"));
    assert_eq!(r.body, b"5\r\nhello\r\n0\r\n\r\n");
    let mut c = Client::connect(addr).await.unwrap();
    let r = c.send(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    assert_eq!(r.code, 502);
}

/// HTTP/1.0 clients are answered, kept alive when they ask for it, and their requests go over
/// kept-alive connections to the PEs like everyone else's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_clients_share_kept_alive_pe_connections() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    for _ in 0..30 {
        let mut c = Client::connect(addr).await.unwrap();
        let r = c.send(b"GET /once HTTP/1.0\r\n\r\n").await.unwrap();
        assert_eq!(r.code, 200);
        assert!(r.close, "a plain HTTP/1.0 request ends its connection");
        closed_after_response(&mut c).await;
    }
    let mut c = Client::connect(addr).await.unwrap();
    for _ in 0..10 {
        let r = c
            .send(b"GET /kept HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(r.code, 200);
        assert_eq!(r.header("connection").as_deref(), Some("keep-alive"));
    }
    let pes: Vec<_> = proxy
        .pools()
        .all()
        .into_iter()
        .flat_map(|p| p.backends())
        .collect();
    let sum = |f: &dyn Fn(&rserpool_proxy::balance::backend::BackendStats) -> u64| -> u64 {
        pes.iter().map(|pe| f(&pe.stats)).sum()
    };
    let requests = sum(&|s| s.requests.load(Ordering::Relaxed));
    let connections = sum(&|s| s.connections.load(Ordering::Relaxed));
    eprintln!("{requests} requests over {connections} PE connections");
    assert_eq!(requests, 40);
    // One per PE when every request finds its PE's connection idle; 40 without reuse.
    assert!(
        connections <= 6,
        "{connections} connections for {requests} requests"
    );
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_http_gets_400_and_disturbs_no_one_else() {
    let (_reg, b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    let mut good = Client::connect(addr).await.unwrap();
    assert_eq!(good.get("/").await.unwrap().code, 200);
    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut c = Client::connect(addr).await.unwrap();
        c.stream.write_all(bad).await.unwrap();
        let r = c.read_response(false, true).await.unwrap();
        assert_eq!(r.code, 400, "{}", String::from_utf8_lossy(bad));
        assert!(r.close);
        assert_eq!(good.get("/").await.unwrap().code, 200);
    }
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_and_upgrades_are_relayed() {
    let (_reg, _b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    // 100-continue: the interim answer comes back before any body byte is sent.
    let mut c = Client::connect(addr).await.unwrap();
    let body = vec![7u8; 1_000_000];
    c.stream
        .write_all(
            format!(
                "PUT /up HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let interim = tokio::time::timeout(Duration::from_secs(5), c.read_response(false, true))
        .await
        .expect("an interim answer without the body")
        .unwrap();
    assert_eq!(interim.code, 100);
    assert!(interim.header("x-pe-id").is_some(), "the PE's 100, relayed");
    c.stream.write_all(&body).await.unwrap();
    let r = c.read_response(false, true).await.unwrap();
    assert_eq!(r.code, 200);
    assert_eq!(String::from_utf8_lossy(&r.body), received(&body));
    // The same connection goes on with the next request.
    assert_eq!(c.get("/after").await.unwrap().code, 200);

    // Upgrade: 101 is passed through, then the connection is a tunnel both ways.
    let mut u = Client::connect(addr).await.unwrap();
    u.stream
        .write_all(b"GET /chat HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let r = u.read_response(false, true).await.unwrap();
    assert_eq!(r.code, 101);
    assert_eq!(r.header("upgrade").as_deref(), Some("echo"));
    for msg in [&b"ping"[..], &[0u8, 1, 2, 255][..], &vec![9u8; 300_000][..]] {
        u.stream.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), u.stream.read_exact(&mut got))
            .await
            .expect("echo through the tunnel")
            .unwrap();
        assert_eq!(got, msg);
    }
}

/// `rserpool proxy --config FILE` as a process, for the signal tests.
struct ProxyProcess {
    child: KillOnDrop,
    config: std::path::PathBuf,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

fn listener_toml(addr: SocketAddr, mode: &str) -> String {
    format!("[[listener]]\nlisten = \"{addr}\"\nmode = \"{mode}\"\npool = \"Backends\"\n\n")
}

fn proxy_toml(reg: SocketAddr, listeners: &str) -> String {
    format!("registrars = [\"{reg}\"]\nrefresh-ms = 200\ndrain-timeout-ms = 20000\n\n{listeners}")
}

async fn proxy_process(reg: SocketAddr, listeners: &str) -> ProxyProcess {
    static N: AtomicU64 = AtomicU64::new(0);
    let config = std::env::temp_dir().join(format!(
        "rserpool-proxy-test-{}-{}.toml",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&config, proxy_toml(reg, listeners)).unwrap();
    let child = Command::new(BIN)
        .args(["proxy", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    ProxyProcess {
        child: KillOnDrop(child),
        config,
    }
}

impl ProxyProcess {
    fn rewrite(&self, reg: SocketAddr, listeners: &str) {
        std::fs::write(&self.config, proxy_toml(reg, listeners)).unwrap();
    }

    fn signal(&self, sig: rustix::process::Signal) {
        common::signal(&self.child, sig);
    }
}

/// Waits until a GET through `addr` is answered by a PE.
async fn serving(addr: SocketAddr) {
    let start = Instant::now();
    loop {
        if let Ok(mut c) = Client::connect(addr).await
            && c.get("/").await.is_ok_and(|r| r.code == 200)
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{addr} does not serve"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Time a thread of process `pid` named `name` has run, nanoseconds (its schedstat).
fn thread_run_ns(pid: u32, name: &str) -> Option<u64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .and_then(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// With `threads = 2` the client connections are shared between two runtimes, the main
/// thread's and a worker thread's: the worker serves its share of kept-alive requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_thread_serves_its_share_of_the_connections() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 3).await;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let listeners = format!("threads = 2\n\n{}", listener_toml(addr, "http"));
    let p = proxy_process(reg.asap_addr(), &listeners).await;
    serving(addr).await;
    let pid = p.child.0.id();
    let before = thread_run_ns(pid, "worker-1").expect("a worker thread");
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(Client::connect(addr).await.unwrap());
    }
    for _ in 0..100 {
        for c in &mut clients {
            let r = c.get("/").await.unwrap();
            assert_eq!(r.code, 200);
        }
    }
    let ran = thread_run_ns(pid, "worker-1").unwrap() - before;
    // Four of the connections, 400 requests: milliseconds of work, not an idle thread's.
    assert!(ran > 1_000_000, "the worker ran {ran} ns");
    assert_eq!(thread_run_ns(pid, "worker-2"), None, "one worker only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 3).await;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut p = proxy_process(reg.asap_addr(), &listener_toml(addr, "http")).await;
    serving(addr).await;
    // A 40 MB download, more than the socket buffers hold: after its first bytes the test
    // stops reading, so it is in flight when SIGTERM comes.
    const N: u64 = 40_000_000;
    let mut c = Client::connect(addr).await.unwrap();
    c.stream
        .write_all(format!("GET /bytes/{N} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = vec![0u8; 4096];
    c.stream.read_exact(&mut first).await.unwrap();
    p.signal(rustix::process::Signal::TERM);
    // New connections are refused once the listener is closed ...
    let closed_after = wait_until(Duration::from_secs(5), "the listener closes", || {
        std::net::TcpStream::connect(addr).is_err()
    })
    .await;
    // ... while the download in flight completes, byte for byte.
    let mut rest = Vec::new();
    c.stream.read_to_end(&mut rest).await.unwrap();
    let all = [first, rest].concat();
    let at = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let body = &all[at..];
    assert_eq!(body.len() as u64, N);
    assert!(
        body.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
        "download corrupted"
    );
    // Then the process exits on its own, successfully.
    let start = Instant::now();
    let status = loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the proxy did not exit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("listener closed {closed_after:?} after SIGTERM; exit {status}");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_listeners_without_dropping_connections() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 3).await;
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let p = proxy_process(reg.asap_addr(), &listener_toml(http, "http")).await;
    serving(http).await;
    let mut kept = Client::connect(http).await.unwrap();
    assert_eq!(kept.get("/before").await.unwrap().code, 200);
    // Add a TCP listener.
    let tcp = SocketAddr::from(([127, 0, 0, 1], free_port()));
    p.rewrite(
        reg.asap_addr(),
        &(listener_toml(http, "http") + &listener_toml(tcp, "tcp")),
    );
    p.signal(rustix::process::Signal::HUP);
    serving(tcp).await;
    // The connection opened before the reload is still served.
    assert_eq!(kept.get("/after").await.unwrap().code, 200);
    // Remove the HTTP listener: no new connections there, the open one still answers.
    p.rewrite(reg.asap_addr(), &listener_toml(tcp, "tcp"));
    p.signal(rustix::process::Signal::HUP);
    wait_until(Duration::from_secs(5), "the HTTP listener closes", || {
        std::net::TcpStream::connect(http).is_err()
    })
    .await;
    assert_eq!(kept.get("/still").await.unwrap().code, 200);
    serving(tcp).await;
}

/// A reload that changes a listener's mode keeps its address: the new listener takes over
/// the same listening socket (binding it anew would find it still in use) and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_listeners_mode_keeps_serving_on_its_address() {
    let (_reg, _b, proxy) = backends_behind_proxy(&[Mode::Http]).await;
    let addr = proxy.local_addrs()[0];
    let mut c = Client::connect(addr).await.unwrap();
    assert_eq!(c.get("/http").await.unwrap().code, 200);
    let mut cfg = (*proxy.config()).clone();
    cfg.listeners[0].mode = Mode::Tcp;
    proxy
        .reload(cfg)
        .await
        .expect("the reload takes the new mode");
    assert_eq!(proxy.local_addrs(), vec![addr]);
    // A request through TCP mode reaches a PE as it was sent.
    let mut t = Client::connect(addr).await.unwrap();
    assert_eq!(t.get("/tcp").await.unwrap().code, 200);
}

/// What the proxy refuses itself (a malformed head, a request with both Content-Length and
/// Transfer-Encoding) has its access log line and is counted by status; a rotated access log
/// (moved away, then SIGHUP, as logrotate does) goes on in a new file of its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_are_logged_and_counted_and_the_access_log_reopens() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 1).await;
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let log = std::env::temp_dir().join(format!("rserpool-access-{}.log", free_port()));
    let listeners = format!(
        "access-log = \"{}\"\nstatus = \"{status}\"\n{}",
        log.display(),
        listener_toml(http, "http")
    );
    let p = proxy_process(reg.asap_addr(), &listeners).await;
    serving(http).await;
    let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(70_000));
    for (req, code) in [
        (
            "GET /both HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "400",
        ),
        ("NOT A REQUEST\r\n\r\n", "400"),
        (long.as_str(), "414"),
        ("GET / HTTP/2.0\r\nHost: x\r\n\r\n", "505"),
    ] {
        let mut c = tokio::net::TcpStream::connect(http).await.unwrap();
        c.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got)).await;
        let line = String::from_utf8_lossy(&got[..got.len().min(40)]).into_owned();
        assert!(
            line.starts_with(&format!("HTTP/1.1 {code}")),
            "{:.40}: {line:?}",
            req
        );
    }
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until(Duration::from_secs(5), "the refusals are logged", || {
        lines().contains(" GET /both 400 - - ") && lines().contains(" - - 400 - - ")
    })
    .await;
    let samples = common::scrape(status).await;
    let refused = |code| {
        common::metric(
            &samples,
            "rserpool_proxy_rejected_requests_total",
            &[("code", code)],
        )
    };
    assert_eq!(
        (refused("400"), refused("414"), refused("505")),
        (2.0, 1.0, 1.0)
    );

    let rotated = log.with_extension("log.1");
    std::fs::rename(&log, &rotated).unwrap();
    p.signal(rustix::process::Signal::HUP);
    common::wait_for(Duration::from_secs(10), "a line in the new log", || async {
        let mut c = Client::connect(http).await.unwrap();
        assert_eq!(c.get("/after-rotation").await.unwrap().code, 200);
        lines().contains(" GET /after-rotation 200 ")
    })
    .await;
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(&rotated);
}

/// A reload reaches kept-alive connections: after SIGHUP moves the listener to another pool,
/// the next request on a connection opened before goes to the new pool (HTTP/1.1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reaches_the_next_request_of_a_kept_alive_connection() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 2).await;
    let other = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _o = KillOnDrop(
        Command::new(BIN)
            .args(["example", "http", "--pool", "Other", "--id", "99"])
            .args(["--listen", &other.to_string()])
            .args(["--registrar", &reg.asap_addr().to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let p = proxy_process(reg.asap_addr(), &listener_toml(http, "http")).await;
    serving(http).await;
    let mut kept = Client::connect(http).await.unwrap();
    let before = kept.get("/").await.unwrap();
    assert!(["0x00000001", "0x00000002"].contains(&before.header("x-pe-id").unwrap().as_str()));
    p.rewrite(
        reg.asap_addr(),
        &listener_toml(http, "http").replace("pool = \"Backends\"", "pool = \"Other\""),
    );
    p.signal(rustix::process::Signal::HUP);
    // The reload is in once a new connection reaches the other pool.
    common::wait_for(Duration::from_secs(10), "the reload", || async move {
        let Ok(mut c) = Client::connect(http).await else {
            return false;
        };
        c.get("/")
            .await
            .is_ok_and(|r| r.header("x-pe-id").as_deref() == Some("0x00000063"))
    })
    .await;
    let after = kept.get("/").await.unwrap();
    assert_eq!(after.header("x-pe-id").as_deref(), Some("0x00000063"));
}

/// `rserpool drain` takes a PE out under load (its control socket, `example --control`): no
/// request fails, and within 100 ms of the command the proxy sends it nothing new; `undrain`
/// puts it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_pe_gets_no_new_work_and_no_request_fails() {
    let reg = registrar(fast_config());
    let sock = std::env::temp_dir().join(format!("rserpool-drain-{}.sock", free_port()));
    let mut pes = Vec::new();
    for id in ["1", "2"] {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cmd = Command::new(BIN);
        cmd.args(["example", "http", "--pool", "Backends", "--policy", "rr"])
            .args(["--id", id, "--listen", &addr.to_string()])
            .args(["--registrar", &reg.asap_addr().to_string()]);
        if id == "2" {
            cmd.arg("--control").arg(&sock);
        }
        pes.push(KillOnDrop(
            cmd.env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        ));
    }
    wait_until(Duration::from_secs(10), "the control socket", || {
        sock.exists()
    })
    .await;
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _p = proxy_process(reg.asap_addr(), &listener_toml(http, "http")).await;
    serving(http).await;
    // Requests one after the other on a kept-alive connection: (sent, PE, status).
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut c = Client::connect(http).await.unwrap();
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let at = Instant::now();
                let r = c.get("/").await.unwrap();
                seen.push((at, r.header("x-pe-id").unwrap_or_default(), r.code));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let drain = sock.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN).arg("drain").arg(drain).output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let drained = Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = load.await.unwrap();
    assert!(
        seen.iter().all(|(_, _, code)| *code == 200),
        "a request failed"
    );
    let to_two = |s: &&(Instant, String, u16)| s.1 == "0x00000002";
    assert!(seen.iter().filter(|s| s.0 < drained).any(|s| to_two(&s)));
    let late: Vec<_> = seen
        .iter()
        .filter(|s| s.0 > drained + Duration::from_millis(100))
        .filter(to_two)
        .collect();
    assert!(late.is_empty(), "{} requests to the drained PE", late.len());
    assert!(
        seen.iter()
            .any(|s| s.0 > drained + Duration::from_millis(100))
    );
    // Back in.
    let undrain = sock.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .arg("undrain")
            .arg(undrain)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success());
    common::wait_for(
        Duration::from_secs(5),
        "the PE back in the pool",
        || async move {
            let Ok(mut c) = Client::connect(http).await else {
                return false;
            };
            let mut ids = Vec::new();
            for _ in 0..4 {
                if let Ok(r) = c.get("/").await {
                    ids.push(r.header("x-pe-id").unwrap_or_default());
                }
            }
            ids.iter().any(|i| i == "0x00000002")
        },
    )
    .await;
    drop(pes);
    let _ = std::fs::remove_file(&sock);
}

/// The proxy's pool user reaches its registrar over SCTP in UDP (`registrars =
/// ["sctp+udp://…"]`): it finds the pool and every PE answers through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_finds_its_pools_at_a_registrar_over_sctp() {
    let udp = free_port();
    let sctp: rserpool_wire::Address = format!("sctp+udp://127.0.0.1:3863?udp={udp}")
        .parse()
        .unwrap();
    let mut cfg = fast_config();
    cfg.asap = format!("127.0.0.1:0,{sctp}").parse().unwrap();
    let reg = registrar(cfg);
    let b = backends(reg.asap_addr(), 3).await;
    let mut pcfg = proxy_config(reg.asap_addr(), vec![(Mode::Http, "Backends")]);
    pcfg.registrars = vec![sctp];
    let proxy = start_proxy(pcfg, 3).await;
    let mut c = Client::connect(proxy.local_addrs()[0]).await.unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..9 {
        let r = c.get("/over-sctp").await.unwrap();
        assert_eq!(r.code, 200);
        seen.insert(r.header("x-pe-id").unwrap());
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    drop(b);
}

/// Kept-alive connections that idle leave their tasks for the parker (`http::park`): they are
/// served as before when their clients come back, closed at their idle timeout, and closed
/// after the drain's grace when the proxy drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_parked_served_on_return_and_closed_in_time() {
    let reg = registrar(fast_config());
    let _b = backends(reg.asap_addr(), 3).await;
    let proxy = start_proxy(
        ProxyConfig {
            idle_timeout_ms: 3000,
            ..proxy_config(reg.asap_addr(), vec![(Mode::Http, "Backends")])
        },
        3,
    )
    .await;
    let addr = proxy.local_addrs()[0];
    const N: usize = 50;
    let mut clients = Vec::new();
    for _ in 0..N {
        let mut c = Client::connect(addr).await.unwrap();
        assert_eq!(c.get("/").await.unwrap().code, 200);
        clients.push(c);
    }
    wait_until(
        Duration::from_secs(5),
        "all idle connections parked",
        || proxy.parked_connections() == N,
    )
    .await;
    assert_eq!(proxy.active_connections(), N);
    // Back from the parker: each connection serves its next requests (a pipelined pair too).
    for c in &mut clients {
        assert_eq!(c.get("/").await.unwrap().code, 200);
    }
    assert!(proxy.parked_connections() < N);
    wait_until(Duration::from_secs(5), "parked again", || {
        proxy.parked_connections() == N
    })
    .await;
    let c = &mut clients[0];
    c.stream
        .write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(c.read_response(false, true).await.unwrap().code, 200);
    assert_eq!(c.read_response(false, true).await.unwrap().code, 200);
    // At the idle timeout (3 s after each one's last request), every connection is closed.
    let quiet = Instant::now();
    for c in &mut clients {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), c.stream.read(&mut b))
            .await
            .expect("a parked connection outlived its idle timeout")
            .unwrap_or(0);
        assert_eq!(n, 0, "a parked connection sent data");
    }
    eprintln!(
        "idle connections closed {:?} after the last request",
        quiet.elapsed()
    );
    wait_until(Duration::from_secs(5), "the parker is empty", || {
        proxy.parked_connections() == 0 && proxy.active_connections() == 0
    })
    .await;
    // A drain closes parked connections after the grace (1 s), not at the idle timeout.
    let mut idle = Vec::new();
    for _ in 0..N {
        let mut c = Client::connect(addr).await.unwrap();
        assert_eq!(c.get("/").await.unwrap().code, 200);
        idle.push(c);
    }
    wait_until(Duration::from_secs(5), "parked before the drain", || {
        proxy.parked_connections() == N
    })
    .await;
    let started = Instant::now();
    let left = proxy.drain(Duration::from_secs(10)).await;
    assert_eq!(left, 0, "parked connections left after the drain");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the drain took {:?}",
        started.elapsed()
    );
}
