//! What the in-process tests of the HTTP side share: PEs on loopback that answer, refuse,
//! drop, stall or never accept; a proxy context with one pool of them (no registrar); a
//! client socket; one request through the pipeline.
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
pub(super) enum Pe {
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
    /// Answers 500 and keeps the connection.
    Errors,
    /// Answers 500 to every second request, 200 to the others.
    Flaky,
    /// Sends the head and part of the body of a 200, then closes.
    Breaks,
}

/// A PE on loopback: its address, and the requests it read.
pub(super) async fn pe(kind: Pe) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    if let Pe::Refuses = kind {
        drop(l);
        // The port stays bound, without listening, for the test's life: connects are refused,
        // and no other test (they run in parallel) can take the port and answer there.
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let addr = s.local_addr().unwrap().as_socket().unwrap();
        tokio::spawn(async move {
            let _bound = s;
            std::future::pending::<()>().await
        });
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
                    let n = count.fetch_add(1, Ordering::Relaxed);
                    let kind = match kind {
                        Pe::Flaky if n.is_multiple_of(2) => Pe::Errors,
                        Pe::Flaky => Pe::Answers,
                        k => k,
                    };
                    match kind {
                        Pe::Drops => return,
                        Pe::Silent => {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            return;
                        }
                        Pe::Breaks => {
                            let part = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial";
                            let _ = s.write_all(part).await;
                            return;
                        }
                        Pe::Errors => {
                            let no = b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\nno";
                            if s.write_all(no).await.is_err() {
                                return;
                            }
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
                        Pe::Refuses | Pe::Full | Pe::Flaky => unreachable!(),
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// A listener whose accept queue is full: the kernel drops further SYNs.
pub(super) fn full_queue() -> SocketAddr {
    let (l, addr, fill) = filled_listener();
    // Held for the rest of the test run.
    std::mem::forget((l, fill));
    addr
}

/// A listener whose accept queue is full for `full`, after which it accepts and answers
/// every request 200 (and closes), as a PE whose burst has passed.
pub(super) fn full_for(full: Duration) -> SocketAddr {
    let (l, addr, fill) = filled_listener();
    std::thread::spawn(move || {
        std::thread::sleep(full);
        drop(fill);
        use std::io::{Read, Write};
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut buf = [0u8; 4096];
            // The fillers' connections close without a request.
            if c.read(&mut buf).unwrap_or(0) > 0 {
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            }
        }
    });
    addr
}

/// A listener with a backlog of none, filled: its queue holds one connection, then one more,
/// and the kernel drops further SYNs. The connections that fill it come along.
fn filled_listener() -> (std::net::TcpListener, SocketAddr, Vec<std::net::TcpStream>) {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    s.listen(0).unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    let mut fill = Vec::new();
    for _ in 0..4 {
        if let Ok(c) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
            fill.push(c);
        }
    }
    (s.into(), addr, fill)
}

/// `n` PEs that answer 200: their addresses and request counters.
pub(super) async fn answering(n: usize) -> (Vec<SocketAddr>, Vec<Arc<AtomicUsize>>) {
    let mut pes = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..n {
        let (a, s) = pe(Pe::Answers).await;
        pes.push(a);
        seen.push(s);
    }
    (pes, seen)
}

/// The pool elements at these addresses, IDs 1, 2, … and loads 0, 1, … in that order.
pub(super) fn elements(pes: &[SocketAddr]) -> Vec<PoolElement> {
    pes.iter()
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
        .collect()
}

/// A proxy's context with one pool, `P`, of the given PEs, loads 0, 1, 2, … in that order.
pub(super) fn ctx(
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
    let list = elements(pes);
    pool.update(list);
    let listener = ListenerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        mode: Mode::Http,
        pool: Some("P".into()),
        routes: Vec::new(),
        splice: None,
        certificates: Vec::new(),
        http2: false,
        defer_accept: None,
    };
    let (never, draining) = tokio::sync::watch::channel(false);
    // Kept for the rest of the test run: a dropped sender reads as "draining".
    std::mem::forget(never);
    let ctx = Ctx {
        park: None,
        cfg: Arc::new(cfg),
        routes: Arc::new(Routes::new(&listener, &pools)),
        pools,
        log: None,
        draining,
        kernel: None,
        tls: None,
        http2: false,
        tls_failures: Arc::default(),
        rejected: Arc::default(),
        pe_tls: Arc::default(),
        current: None,
    };
    (ctx, pool, reports)
}

/// A client connection: the proxy's side as a [`Client`], and the client's own socket.
pub(super) async fn client() -> (Client, TcpStream) {
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
pub(super) fn request(text: &str, body: &str, peer: SocketAddr) -> (Request, Outgoing) {
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
pub(super) async fn one(ctx: &Ctx, pool: &Arc<Pool>, text: &str, body: &str) -> (bool, String) {
    let (mut c, mut theirs) = client().await;
    let (r, out) = request(text, body, c.peer);
    let keep = forward(&mut Downstream::h1(&mut c, &out), &r, pool, ctx).await;
    drop(c);
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), theirs.read_to_end(&mut got)).await;
    (keep, String::from_utf8_lossy(&got).into_owned())
}

pub(super) fn reported(reports: &mut mpsc::UnboundedReceiver<Unreachable>) -> Vec<u32> {
    let mut ids = Vec::new();
    while let Ok(u) = reports.try_recv() {
        ids.push(u.pe_id);
    }
    ids
}

pub(super) const GET: &str = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";

pub(super) const POST: &str = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n";

/// The pool's PEs by ID, for their counters.
pub(super) fn pe_stats(pool: &Pool, id: u32) -> Arc<crate::balance::backend::Backend> {
    pool.backends().into_iter().find(|b| b.id == id).unwrap()
}
