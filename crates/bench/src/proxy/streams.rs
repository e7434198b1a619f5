//! What an HTTP/2 stream in flight costs a proxy in memory: `connections` clients make one
//! gRPC-shaped call each (so that what follows is per stream, not per connection), then open
//! `per_connection` streams each to a method the backends never answer; the system's resident
//! memory (all its processes) before and after, divided by the streams.
//!
//! Why: an HTTP/2 client multiplexes its calls on one connection, so a proxy's memory under
//! slow backends (long polls, streaming calls, a PE that hangs) grows with streams, not with
//! connections. Every system proxies HTTP/2 end to end here (the bench's gRPC backends);
//! how it holds a stream toward the backend (one multiplexed connection, or a connection per
//! stream as nginx's `grpc_pass` does) is part of what it costs.

use super::front::Front;
use super::idle::{H2Conn, h2_connect, h2_drain};
use super::{GRPC_MESSAGE, GRPC_PATH, HOLD_PATH};
use crate::procfs;
use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use h2::client::{ResponseFuture, SendRequest};
use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

/// Resident bytes per stream held, and how many were held.
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    pub(super) streams: usize,
    pub(super) bytes: f64,
}

/// Time for the system to pass every stream on and for its memory to settle.
const SETTLE: Duration = Duration::from_secs(2);

/// Measures `front` (of system `label`) with `connections` × `per_connection` streams held.
pub(super) fn run(
    front: &Front,
    rt: &tokio::runtime::Runtime,
    connections: usize,
    per_connection: usize,
    label: &str,
) -> Result<Option<Held>> {
    let group = front
        .group()
        .ok_or_else(|| anyhow!("no process to measure"))?;
    let rss = || procfs::group_rss_bytes(group);
    let addr = front.grpc;
    let measured = (|| -> Result<Held> {
        let mut conns = rt.block_on(super::idle::open(connections, move || call_once(addr)))?;
        std::thread::sleep(SETTLE);
        let before = rss();
        let mut pending = Vec::with_capacity(connections * per_connection);
        rt.block_on(async {
            for c in conns.iter_mut() {
                for _ in 0..per_connection {
                    pending.push(call(addr, c, HOLD_PATH).await?);
                }
            }
            anyhow::Ok(())
        })?;
        std::thread::sleep(SETTLE);
        let after = rss();
        // A stream answered (an error, a timeout) is not held: the figure would be too low.
        let (answered, first) = rt.block_on(async {
            let mut n = 0;
            let mut first = None;
            for resp in pending.iter_mut() {
                if let Poll::Ready(r) =
                    poll_fn(|cx| Poll::Ready(Pin::new(&mut *resp).poll(cx))).await
                {
                    n += 1;
                    first.get_or_insert_with(|| match r {
                        Ok(r) => format!("status {} {:?}", r.status(), r.headers()),
                        Err(e) => e.to_string(),
                    });
                }
            }
            (n, first)
        });
        if let Some(first) = first {
            bail!(
                "{answered} of {} streams were answered instead of held (the first: {first})",
                pending.len()
            );
        }
        let streams = pending.len();
        drop(pending);
        drop(conns);
        Ok(Held {
            streams,
            bytes: after.saturating_sub(before) as f64 / streams as f64,
        })
    })();
    match measured {
        Ok(h) => Ok(Some(h)),
        Err(e) => {
            eprintln!("{label}: no HTTP/2 streams held: {e:#}");
            Ok(None)
        }
    }
}

/// An HTTP/2 connection to `addr` (prior knowledge) after one gRPC-shaped call answered in
/// full.
async fn call_once(addr: SocketAddr) -> Result<H2Conn> {
    let mut send = h2_connect(addr).await?;
    let resp = call(addr, &mut send, GRPC_PATH).await?.await?;
    anyhow::ensure!(resp.status() == 200, "{GRPC_PATH}: {}", resp.status());
    let mut body = resp.into_body();
    h2_drain(&mut body).await?;
    body.trailers().await?;
    Ok(send)
}

/// A gRPC-shaped call of `path` sent in full on `send`: its response to come.
async fn call(
    addr: SocketAddr,
    send: &mut SendRequest<Bytes>,
    path: &str,
) -> Result<ResponseFuture> {
    let send = poll_fn(|cx| send.poll_ready(cx)).await.map(|()| send)?;
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (resp, mut body) = send.send_request(req, false)?;
    body.send_data(Bytes::from_static(GRPC_MESSAGE), true)
        .with_context(|| format!("{path}: the message"))?;
    Ok(resp)
}
