//! The pipeline's decisions, in process: [`forward`] with a real client socket and real PEs on
//! loopback (one that refuses, one that closes without answering, one that answers, one that
//! closes its kept-alive connections), no registrar. The pool's policy is "least used" with
//! fixed loads, so which PE is tried first is known.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::client_stream::{Client, ClientStream};
use super::downstream::Downstream;
use super::message::Head;
use super::pipeline::forward;
use super::request::{Outgoing, Request, parse};
use super::upstream::h1::outgoing_head;
use crate::balance::backend::HealthSettings;
use crate::balance::pools::{Pool, PoolSettings, Pools, Unreachable};
use crate::config::{ListenerConfig, Mode, ProxyConfig};
use crate::ctx::Ctx;
use crate::routes::Routes;
use bytes::{Bytes, BytesMut};
use rserpool_wire::{Policy, PoolElement, Protocol, TransportAddress, UserTransport};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// What a test PE does with each request.
#[derive(Clone, Copy)]
enum Pe {
    /// Nobody listens.
    Refuses,
    /// Reads the request and closes the connection.
    Drops,
    /// Answers 200 and keeps the connection.
    Answers,
    /// Answers 200 and then closes the connection, as a server whose keep-alive timeout passed.
    AnswersOnce,
    /// Reads the request and never answers.
    Silent,
    /// Listens with a full accept queue and never accepts: connects time out.
    Full,
}

/// A PE on loopback: its address, and the requests it read.
async fn pe(kind: Pe) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    if let Pe::Refuses = kind {
        drop(l);
        return (addr, seen);
    }
    if let Pe::Full = kind {
        drop(l);
        return (full_queue(), seen);
    }
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = BytesMut::new();
                loop {
                    while Head::request(&mut buf, 1 << 16).ok().flatten().is_none() {
                        if s.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                    match kind {
                        Pe::Drops => return,
                        Pe::Silent => {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            return;
                        }
                        Pe::Answers | Pe::AnswersOnce => {
                            let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                            if s.write_all(ok).await.is_err() {
                                return;
                            }
                            if let Pe::AnswersOnce = kind {
                                return;
                            }
                        }
                        Pe::Refuses | Pe::Full => unreachable!(),
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// A listener whose accept queue is full: the kernel drops further SYNs.
fn full_queue() -> SocketAddr {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    s.listen(0).unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    // Held for the rest of the test run; its queue holds one connection, then one more.
    let mut fill = Vec::new();
    for _ in 0..4 {
        if let Ok(c) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
            fill.push(c);
        }
    }
    std::mem::forget((s, fill));
    addr
}

/// A proxy's context with one pool, `P`, of the given PEs, loads 0, 1, 2, … in that order.
fn ctx(
    pes: &[SocketAddr],
    cfg: ProxyConfig,
) -> (Ctx, Arc<Pool>, mpsc::UnboundedReceiver<Unreachable>) {
    let settings = PoolSettings {
        registrars: Vec::new(),
        refresh: Duration::from_secs(3600),
        connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
        health: HealthSettings {
            max_fails: 1,
            eject: Duration::from_secs(10),
            eject_max: Duration::from_secs(10),
        },
        max_idle_per_pe: 8,
        idle_timeout: Duration::from_secs(60),
        registrar_tls: None,
    };
    let (pools, reports) = Pools::new(settings);
    let pool = pools.pool("P");
    let list = pes
        .iter()
        .enumerate()
        .map(|(i, a)| PoolElement {
            id: i as u32 + 1,
            home_registrar: 0,
            registration_life: -1,
            user_transport: UserTransport::Address(TransportAddress {
                protocol: Protocol::TCP,
                port: a.port(),
                addresses: vec![a.ip()].into(),
            }),
            policy: Policy::LeastUsed { load: i as u32 },
            asap_transport: None,
        })
        .collect();
    pool.update(list);
    let listener = ListenerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        mode: Mode::Http,
        pool: Some("P".into()),
        routes: Vec::new(),
        splice: None,
        certificates: Vec::new(),
        http2: false,
    };
    let (_, draining) = tokio::sync::watch::channel(false);
    let ctx = Ctx {
        cfg: Arc::new(cfg),
        routes: Arc::new(Routes::new(&listener, &pools)),
        pools,
        log: None,
        draining,
        kernel: None,
        tls: None,
        http2: false,
        tls_failures: Arc::default(),
        pe_tls: Arc::default(),
    };
    (ctx, pool, reports)
}

/// A client connection: the proxy's side as a [`Client`], and the client's own socket.
async fn client() -> (Client, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let theirs = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (ours, peer) = l.accept().await.unwrap();
    let c = Client {
        stream: ClientStream::new(ours.into_std().unwrap()),
        buf: BytesMut::new(),
        peer,
    };
    (c, theirs)
}

/// A request with a held body, as the HTTP/1.1 front prepares it.
fn request(text: &str, body: &str, peer: SocketAddr) -> (Request, Outgoing) {
    let head = Head::request(&mut BytesMut::from(text), 1 << 16)
        .unwrap()
        .unwrap();
    let mut r = parse(head, peer, Instant::now()).unwrap();
    r.framing = crate::http::message::Framing::None;
    let out = Outgoing {
        head: outgoing_head(&r, peer),
        held: Some(Bytes::from(body.to_owned())),
    };
    (r, out)
}

/// One request through the pipeline: whether the connection stays, and what the client read.
async fn one(ctx: &Ctx, pool: &Arc<Pool>, text: &str, body: &str) -> (bool, String) {
    let (mut c, mut theirs) = client().await;
    let (r, out) = request(text, body, c.peer);
    let keep = forward(&mut Downstream::h1(&mut c, &out), &r, pool, ctx).await;
    drop(c);
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), theirs.read_to_end(&mut got)).await;
    (keep, String::from_utf8_lossy(&got).into_owned())
}

fn reported(reports: &mut mpsc::UnboundedReceiver<Unreachable>) -> Vec<u32> {
    let mut ids = Vec::new();
    while let Ok(u) = reports.try_recv() {
        ids.push(u.pe_id);
    }
    ids
}

const GET: &str = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
const POST: &str = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n";

#[tokio::test]
async fn a_pe_that_refuses_is_reported_and_the_next_one_answers() {
    let (a, _) = pe(Pe::Refuses).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(keep);
    assert_eq!(b_seen.load(Ordering::Relaxed), 1);
    assert_eq!(reported(&mut reports), [1], "the refusing PE, and only it");
    let failovers = |id: u32| {
        pool.backends()
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.stats.failovers.load(Ordering::Relaxed))
    };
    assert_eq!(failovers(1), Some(1));
    assert_eq!(failovers(2), Some(0));
}

#[tokio::test]
async fn no_pe_answering_is_a_502_and_an_empty_pool_a_503_with_retry_after() {
    let (a, _) = pe(Pe::Refuses).await;
    let (b, _) = pe(Pe::Refuses).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 502"), "{got}");
    assert!(got.contains("no pool element answered"), "{got}");
    assert!(!keep);
    let mut ids = reported(&mut reports);
    ids.sort_unstable();
    assert_eq!(ids, [1, 2]);

    let (ctx, pool, _) = self::ctx(&[], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("Retry-After: 1"), "{got}");
}

#[tokio::test]
async fn an_idempotent_request_goes_once_more_after_a_pe_closed_without_answering() {
    let (a, a_seen) = pe(Pe::Drops).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(a_seen.load(Ordering::Relaxed), 1, "first to the least used");
    assert_eq!(
        b_seen.load(Ordering::Relaxed),
        1,
        "then once more elsewhere"
    );
    assert_eq!(reported(&mut reports), [1]);
}

#[tokio::test]
async fn a_request_that_is_not_idempotent_is_not_sent_again() {
    let (a, a_seen) = pe(Pe::Drops).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let (ctx, pool, mut reports) = ctx(&[a, b], ProxyConfig::default());
    let (keep, got) = one(&ctx, &pool, POST, "hi").await;
    assert!(got.starts_with("HTTP/1.1 502"), "{got}");
    assert!(got.contains("closed the connection"), "{got}");
    assert!(!keep);
    assert_eq!(a_seen.load(Ordering::Relaxed), 1);
    assert_eq!(
        b_seen.load(Ordering::Relaxed),
        0,
        "a POST may have been processed"
    );
    assert_eq!(reported(&mut reports), [1]);
}

#[tokio::test]
async fn a_stale_kept_alive_connection_costs_the_pe_nothing() {
    let (a, a_seen) = pe(Pe::AnswersOnce).await;
    let (ctx, pool, mut reports) = ctx(&[a], ProxyConfig::default());
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // The PE closed the connection the proxy keeps for reuse; the next request finds it so.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(a_seen.load(Ordering::Relaxed), 2);
    assert!(reported(&mut reports).is_empty(), "not the PE's fault");
    let b = &pool.backends()[0];
    assert_eq!(b.stats.failures.load(Ordering::Relaxed), 0);
    assert_eq!(b.stats.connections.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn a_pe_that_does_not_answer_in_time_is_a_504_and_a_failure() {
    let (a, _) = pe(Pe::Silent).await;
    let cfg = ProxyConfig {
        request_timeout_ms: 200,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a], cfg);
    let (keep, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
    assert!(!keep);
    let b = &pool.backends()[0];
    assert_eq!(b.stats.failures.load(Ordering::Relaxed), 1);
    assert!(reported(&mut reports).is_empty(), "slow is not unreachable");
}

/// The pool's PEs by ID, for their counters.
fn pe_stats(pool: &Pool, id: u32) -> Arc<crate::balance::backend::Backend> {
    pool.backends().into_iter().find(|b| b.id == id).unwrap()
}

#[tokio::test]
async fn a_pe_whose_accept_queue_is_full_is_busy_not_dead() {
    let (a, _) = pe(Pe::Full).await;
    let (b, b_seen) = pe(Pe::Answers).await;
    let cfg = ProxyConfig {
        connect_timeout_ms: 200,
        ..ProxyConfig::default()
    };
    let (ctx, pool, mut reports) = ctx(&[a, b], cfg);
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let busy = pe_stats(&pool, 1);
    assert_eq!(busy.stats.busy.load(Ordering::Relaxed), 1);
    assert_eq!(
        busy.stats.ejections.load(Ordering::Relaxed),
        0,
        "overload is not death"
    );
    assert!(
        reported(&mut reports).is_empty(),
        "and not reported to the registrar"
    );
    // While it is busy, new work goes elsewhere at once (no second connect timeout).
    let started = Instant::now();
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(started.elapsed() < Duration::from_millis(150));
    assert_eq!(busy.stats.busy.load(Ordering::Relaxed), 1);
    assert_eq!(b_seen.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn an_ejection_never_takes_more_than_the_cap_of_a_pool() {
    let mut pes = Vec::new();
    for _ in 0..3 {
        pes.push(pe(Pe::Refuses).await.0);
    }
    let (d, d_seen) = pe(Pe::Answers).await;
    pes.push(d);
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(
        crate::config::PoolConfig {
            panic_threshold: 0,
            ..Default::default()
        },
        None,
    );
    for _ in 0..3 {
        let (_, got) = one(&ctx, &pool, GET, "").await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }
    assert_eq!(d_seen.load(Ordering::Relaxed), 3);
    let now = Instant::now();
    let ejected = pool.backends().iter().filter(|b| b.is_ejected(now)).count();
    // 10 % of 4 PEs, but at least one.
    assert_eq!(ejected, 1);
    let capped: u64 = pool
        .backends()
        .iter()
        .map(|b| b.stats.ejections_capped.load(Ordering::Relaxed))
        .sum();
    assert!(
        capped >= 2,
        "the other refusals were counted, not ejected ({capped})"
    );
}

#[tokio::test]
async fn with_too_few_healthy_pes_the_pool_panics_and_spreads_over_all() {
    let mut pes = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let (a, s) = pe(Pe::Answers).await;
        pes.push(a);
        seen.push(s);
    }
    let (ctx, pool, _) = ctx(&pes, ProxyConfig::default());
    pool.set_config(
        crate::config::PoolConfig {
            max_ejection_percent: 100,
            ..Default::default()
        },
        None,
    );
    // Three of four ejected (by failures of their own).
    for id in 1..=3 {
        assert!(pe_stats(&pool, id).failed(&ctx.pools.settings.health, true));
    }
    // 1 of 4 healthy is below the default threshold (50 %): the least used PE, ejected or
    // not, gets the request.
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(
        seen[0].load(Ordering::Relaxed),
        1,
        "panic: ejected PEs serve too"
    );
    // Without panic mode the healthy one takes it all.
    pool.set_config(
        crate::config::PoolConfig {
            max_ejection_percent: 100,
            panic_threshold: 0,
            ..Default::default()
        },
        None,
    );
    for id in 1..=3 {
        pe_stats(&pool, id).failed(&ctx.pools.settings.health, true);
    }
    let (_, got) = one(&ctx, &pool, GET, "").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(seen[3].load(Ordering::Relaxed), 1);
    assert_eq!(seen[0].load(Ordering::Relaxed), 1);
}
