//! What an idle kept-alive connection costs a proxy in memory: `n` clients each make one
//! request (HTTP/1.1, HTTP/2 with prior knowledge, HTTPS) and stay connected; the system's
//! resident memory (all its processes) before and after, divided by `n`.
//!
//! Why: a front door holds many more idle connections than busy ones (browsers and mobile
//! clients keep theirs open), and memory per connection decides how many one host holds.

use super::SMALL;
use super::front::Front;
use crate::procfs;
use anyhow::{Context, Result, anyhow};
use bytes::Bytes;
use rserpool_proxy::http::client::Client;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes of resident memory per idle connection, by protocol (each measured in a system
/// started afresh: freed memory of one protocol's connections would otherwise be reused by
/// the other's and hide its cost).
#[derive(Serialize, Clone, Copy, Debug, Default)]
pub(super) struct Idle {
    pub(super) connections: usize,
    pub(super) h1_bytes: Option<f64>,
    pub(super) h2_bytes: Option<f64>,
    pub(super) tls_bytes: Option<f64>,
    /// HTTP/2 streams held (`streams.rs`), and the bytes per stream.
    pub(super) streams: usize,
    pub(super) stream_bytes: Option<f64>,
}

impl Idle {
    pub(super) fn merge(self, o: Idle) -> Idle {
        Idle {
            connections: self.connections.max(o.connections),
            h1_bytes: self.h1_bytes.or(o.h1_bytes),
            h2_bytes: self.h2_bytes.or(o.h2_bytes),
            tls_bytes: self.tls_bytes.or(o.tls_bytes),
            streams: self.streams.max(o.streams),
            stream_bytes: self.stream_bytes.or(o.stream_bytes),
        }
    }
}

/// Connections opened at once at most (the listeners' backlogs are smaller than `n`).
const AT_ONCE: usize = 256;

/// The protocol of the idle connections.
#[derive(Clone, Copy)]
pub(super) enum Kind<'a> {
    H1,
    H2,
    /// HTTPS (HTTP/1.1 by ALPN), trusting the bed's CA (this file).
    Tls(&'a Path),
}

/// Measures `front` (of system `label`) with `n` idle connections of `kind`.
pub(super) fn run(
    front: &Front,
    rt: &tokio::runtime::Runtime,
    n: usize,
    label: &str,
    kind: Kind,
) -> Result<Idle> {
    let group = front
        .group()
        .ok_or_else(|| anyhow!("no process to measure"))?;
    let per_conn = match kind {
        Kind::H1 => grown(rt, group, n, |k| h1(front.http[0], k)),
        Kind::H2 => grown(rt, group, n, |k| self::h2(front.h2c, k)),
        Kind::Tls(ca) => match (front.https, rserpool_tls::client_to(ca, None)) {
            (Some(addr), Ok(cfg)) => {
                let mut cfg = (*cfg).clone();
                cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
                let cfg = Arc::new(cfg);
                grown(rt, group, n, |k| tls(addr, cfg.clone(), k))
            }
            (None, _) => Err(anyhow!("no HTTPS listener")),
            (_, Err(e)) => Err(anyhow!("the bed's CA: {e}")),
        },
    };
    let proto = match kind {
        Kind::H1 => "HTTP/1.1",
        Kind::H2 => "HTTP/2",
        Kind::Tls(_) => "HTTPS",
    };
    let per_conn = match per_conn {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("{label}: no idle {proto} connections: {e:#}");
            None
        }
    };
    Ok(Idle {
        connections: n,
        h1_bytes: per_conn.filter(|_| matches!(kind, Kind::H1)),
        h2_bytes: per_conn.filter(|_| matches!(kind, Kind::H2)),
        tls_bytes: per_conn.filter(|_| matches!(kind, Kind::Tls(_))),
        ..Idle::default()
    })
}

/// Resident bytes of process group `group` per connection that `open(n)` holds, after one
/// (`open(1)`) to warm up, so that what grows is per connection.
fn grown<T, Fut>(
    rt: &tokio::runtime::Runtime,
    group: u32,
    n: usize,
    open: impl Fn(usize) -> Fut,
) -> Result<f64>
where
    Fut: std::future::Future<Output = Result<Vec<T>>>,
{
    let rss = || procfs::group_rss_bytes(group);
    let settle = || std::thread::sleep(Duration::from_secs(1));
    rt.block_on(open(1)).context("warm-up")?;
    settle();
    let before = rss();
    let held = rt.block_on(open(n))?;
    settle();
    let bytes = rss().saturating_sub(before) as f64 / n as f64;
    drop(held);
    Ok(bytes)
}

/// `n` connections made by `one`, at most [`AT_ONCE`] at a time.
pub(super) async fn open<T, F, Fut>(n: usize, one: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T>> + Send + 'static,
{
    let mut held = Vec::with_capacity(n);
    while held.len() < n {
        let batch = AT_ONCE.min(n - held.len());
        let tasks: Vec<_> = (0..batch).map(|_| tokio::spawn(one())).collect();
        for t in tasks {
            held.push(
                t.await?
                    .with_context(|| format!("connection {}", held.len()))?,
            );
        }
    }
    Ok(held)
}

/// `n` HTTP/1.1 connections to `addr`, each after one GET of the small file.
async fn h1(addr: SocketAddr, n: usize) -> Result<Vec<Client>> {
    open(n, move || async move {
        let mut c = Client::connect(addr).await?;
        let r = c.get_counted(SMALL).await?;
        anyhow::ensure!(r.code == 200, "GET {SMALL}: {}", r.code);
        Ok(c)
    })
    .await
}

/// An HTTP/2 connection kept: its request handle (its driver runs as a task).
pub(super) type H2Conn = h2::client::SendRequest<Bytes>;

/// An HTTP/2 connection (prior knowledge) to `addr`, ready for a request.
pub(super) async fn h2_connect(addr: SocketAddr) -> Result<H2Conn> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (send, conn) = h2::client::handshake(tcp).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send.ready().await?)
}

/// Reads an HTTP/2 body to its end, giving its flow-control window back as it goes.
pub(super) async fn h2_drain(body: &mut h2::RecvStream) -> Result<()> {
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    Ok(())
}

/// `n` HTTP/2 connections (prior knowledge) to `addr`, each after one GET of the small file.
async fn h2(addr: SocketAddr, n: usize) -> Result<Vec<H2Conn>> {
    open(n, move || async move {
        let mut send = h2_connect(addr).await?;
        let req = http::Request::get(format!("http://{addr}{SMALL}")).body(())?;
        let (resp, _) = send.send_request(req, true)?;
        let resp = resp.await?;
        anyhow::ensure!(resp.status() == 200, "GET {SMALL}: {}", resp.status());
        h2_drain(&mut resp.into_body()).await?;
        Ok(send)
    })
    .await
}

/// An HTTPS connection kept.
type TlsConn = rserpool_tls::tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// `n` HTTPS connections to `addr`, each after one GET of the small file (its response read
/// by its length).
async fn tls(
    addr: SocketAddr,
    cfg: Arc<rserpool_tls::rustls::ClientConfig>,
    n: usize,
) -> Result<Vec<TlsConn>> {
    open(n, move || {
        let cfg = cfg.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rserpool_tls::rustls::pki_types::ServerName::IpAddress(addr.ip().into());
            let mut s = rserpool_tls::tokio_rustls::TlsConnector::from(cfg)
                .connect(name, tcp)
                .await?;
            s.write_all(format!("GET {SMALL} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
                .await?;
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let (head, len) = loop {
                let k = s.read(&mut buf).await?;
                anyhow::ensure!(k > 0, "closed before the response");
                got.extend_from_slice(&buf[..k]);
                if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&got[..end]).into_owned();
                    let len = head
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse::<usize>().ok())?
                        })
                        .context("no Content-Length")?;
                    break (head, end + 4 + len);
                }
            };
            anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "GET {SMALL}: {head}");
            while got.len() < len {
                let k = s.read(&mut buf).await?;
                anyhow::ensure!(k > 0, "closed in the body");
                got.extend_from_slice(&buf[..k]);
            }
            Ok(s)
        }
    })
    .await
}
