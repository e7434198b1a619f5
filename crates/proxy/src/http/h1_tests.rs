//! The HTTP/1.1 front in process: the header timeout against a slow client (slowloris) and on
//! kept-alive connections, and absolute-form request targets (RFC 9112 §3.2.2).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::testbed::*;
use crate::config::ProxyConfig;
use crate::ctx::Ctx;
use bytes::BytesMut;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The HTTP/1.1 front on a loopback listener: its address.
async fn front(ctx: Ctx) -> SocketAddr {
    let ctx = std::sync::Arc::new(ctx);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, peer)) = l.accept().await {
            let ctx = ctx.clone();
            tokio::spawn(super::h1::serve(s.into_std().unwrap(), peer, ctx, None));
        }
    });
    addr
}

/// Reads one response (a head and a Content-Length body) or what came before the close.
async fn response(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.strip_prefix("Content-Length: ")?
                        .trim()
                        .parse::<usize>()
                        .ok()
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return text;
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return String::from_utf8_lossy(&got).into_owned(),
        }
    }
}

fn timeouts(header_ms: u64, idle_ms: u64) -> ProxyConfig {
    ProxyConfig {
        header_timeout_ms: header_ms,
        idle_timeout_ms: idle_ms,
        ..ProxyConfig::default()
    }
}

#[tokio::test]
async fn a_slow_head_is_closed_at_the_header_timeout_and_others_are_served() {
    let (pe, _) = pe(Pe::Answers).await;
    let (ctx, _pool, _) = ctx(&[pe], timeouts(300, 60_000));
    let addr = front(ctx).await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    // Meanwhile another client is served.
    let mut other = TcpStream::connect(addr).await.unwrap();
    other.write_all(GET.as_bytes()).await.unwrap();
    assert!(response(&mut other).await.starts_with("HTTP/1.1 200"));
    let got = response(&mut slow).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[tokio::test]
async fn a_kept_alive_connection_may_idle_past_the_header_timeout_but_not_dawdle_in_a_head() {
    let (pe, _) = pe(Pe::Answers).await;
    let (ctx, _pool, _) = ctx(&[pe], timeouts(300, 60_000));
    let addr = front(ctx).await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(GET.as_bytes()).await.unwrap();
    assert!(response(&mut c).await.starts_with("HTTP/1.1 200"));
    // Idle between requests for longer than the header timeout: still open.
    tokio::time::sleep(Duration::from_millis(600)).await;
    c.write_all(GET.as_bytes()).await.unwrap();
    assert!(response(&mut c).await.starts_with("HTTP/1.1 200"));
    // A later head that starts and stalls gets the header timeout.
    c.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let got = response(&mut c).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
}

#[tokio::test]
async fn an_absolute_form_target_reaches_the_pe_in_origin_form_with_its_authority_as_host() {
    // A PE that answers with the head it got as the body.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pe = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = BytesMut::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    if s.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                        return;
                    }
                }
                let head = String::from_utf8_lossy(&buf).into_owned();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{head}",
                    head.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    let (ctx, _pool, _) = ctx(&[pe], ProxyConfig::default());
    let addr = front(ctx).await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET http://api.example:8080/v1/x?q=1 HTTP/1.1\r\nHost: other\r\n\r\n")
        .await
        .unwrap();
    let got = response(&mut c).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let seen = &got[got.find("\r\n\r\n").unwrap() + 4..];
    assert!(seen.starts_with("GET /v1/x?q=1 HTTP/1.1\r\n"), "{seen}");
    assert!(seen.contains("\r\nHost: api.example:8080\r\n"), "{seen}");
    assert!(!seen.contains("Host: other"), "{seen}");
    // Only http and https targets.
    c.write_all(b"GET ftp://x/ HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let got = response(&mut c).await;
    assert!(got.starts_with("HTTP/1.1 400"), "{got}");
}

/// What every request's task carries and moves stays small: a path taken rarely (connecting,
/// a tunnel, a route's TCP-mode pin, a queue's wait, the proxy's own answer) is boxed where
/// it is taken. Inline, a tunnel's 2.9 KB made every HTTP/1.1 request's future 4.2 KB, moved
/// into its box and touched on each request. (Sizes in a test build; a release build's are
/// about the same.)
#[tokio::test]
async fn every_requests_futures_stay_small() {
    use crate::balance::failover::{Attempt, Failover};
    use crate::http::downstream::Downstream;
    use crate::http::upstream::{PeStream, h1 as up1, h2 as up2};
    use std::mem::size_of_val;
    use std::sync::Arc;
    const MAX: usize = 2048;
    let (a, _) = pe(Pe::Answers).await;
    let (ctx, pool, _reports) = ctx(&[a], ProxyConfig::default());
    let mut ctx = Arc::new(ctx);
    let (mut c, _theirs) = client().await;
    let (_never, mut draining) = tokio::sync::watch::channel(false);
    let mut sizes = Vec::new();
    let f = super::h1::next_request(&mut c, &mut ctx, true, &mut draining);
    sizes.push(("an HTTP/1.1 request", size_of_val(&f)));
    drop(f);
    let ctx = &*ctx;
    let (r, out) = request(GET, "", c.peer);
    let mut d = Downstream::h1(&mut c, &out);
    let f = crate::http::pipeline::forward(&mut d, &r, &pool, ctx);
    sizes.push(("forward", size_of_val(&f)));
    drop(f);
    let mut failover = Failover::new(ctx.failover());
    let f = failover.attempt(&pool, &ctx.pools, 1, |pe| async move {
        up1::take_conn(&pe, ctx, false).await
    });
    sizes.push(("an attempt at an HTTP/1.1 PE", size_of_val(&f)));
    drop(f);
    let f = failover.attempt(&pool, &ctx.pools, 1, |pe| async move {
        up2::stream(&pe, ctx).await.map(|v| (v, false))
    });
    sizes.push(("an attempt at an HTTP/2 PE", size_of_val(&f)));
    drop(f);
    let pe = pool.backends()[0].clone();
    let attempt = Attempt {
        pool: pool.clone(),
        pe,
        reused: false,
        rif: 0,
        asked: Instant::now(),
        sent: Instant::now(),
        try_timeout: None,
    };
    let bc = up1::BackendConn::new(PeStream::Plain(TcpStream::connect(a).await.unwrap()));
    let f = up1::exchange(&mut d, bc, &r, &attempt, ctx);
    sizes.push(("an exchange with an HTTP/1.1 PE", size_of_val(&f)));
    drop(f);
    for (what, n) in sizes {
        assert!(n <= MAX, "the future of {what} is {n} bytes");
    }
}
