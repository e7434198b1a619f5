//! The floor under the proxy's gRPC part (`rserpool-bench h2-relay`, hidden; the system
//! `h2-relay` of `proxy --parts grpc`): a bare relay of HTTP/2 streams on the same crates as
//! the proxy (`h2` both ways, tokio on one thread, mimalloc) and nothing else — no routes, no
//! policy, no failover, no logs, one connection to each backend taken in turn. What it costs
//! per call is what those crates cost; the proxy's own work is the difference.

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use h2::client::SendRequest;
use rserpool_proxy::config::Http2Config;
use rserpool_proxy::small_frame_budget;
use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;

#[derive(Args, Debug)]
pub struct H2RelayArgs {
    /// Where to take HTTP/2 (prior knowledge).
    #[arg(long)]
    pub listen: SocketAddr,
    /// An HTTP/2 backend, repeatable.
    #[arg(long, required = true)]
    pub backend: Vec<SocketAddr>,
}

pub fn run(args: H2RelayArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    // The proxy's `[http2]` defaults and allowance for small frames: the same flow control.
    let h = Http2Config::default();
    local.block_on(&rt, async move {
        let mut backends = Vec::new();
        for b in &args.backend {
            let s = tokio::net::TcpStream::connect(b)
                .await
                .with_context(|| format!("connecting to {b}"))?;
            s.set_nodelay(true)?;
            let (send, conn) = h2::client::Builder::new()
                .initial_window_size(h.stream_window)
                .initial_connection_window_size(h.connection_window)
                .data_frame_budget(small_frame_budget(h.connection_window))
                .handshake::<_, Bytes>(s)
                .await?;
            tokio::task::spawn_local(async move {
                let _ = conn.await;
            });
            backends.push(send);
        }
        let backends = Rc::new(backends);
        let next = Rc::new(Cell::new(0usize));
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        loop {
            let (s, _) = listener.accept().await?;
            let _ = s.set_nodelay(true);
            let (backends, next) = (backends.clone(), next.clone());
            tokio::task::spawn_local(async move {
                let Ok(mut conn) = h2::server::Builder::new()
                    .initial_window_size(h.stream_window)
                    .initial_connection_window_size(h.connection_window)
                    .data_frame_budget(small_frame_budget(h.stream_window))
                    .handshake::<_, Bytes>(s)
                    .await
                else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let i = next.get();
                    next.set((i + 1) % backends.len());
                    tokio::task::spawn_local(call(req, respond, backends[i].clone()));
                }
            });
        }
    })
}

/// One call: its message read whole (as the proxy holds a small body), sent on, the answer
/// relayed with its trailers.
async fn call(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    send: SendRequest<Bytes>,
) {
    let (parts, mut body) = req.into_parts();
    let mut msg = bytes::BytesMut::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        msg.extend_from_slice(&d);
    }
    let mut up = http::Request::new(());
    *up.method_mut() = parts.method;
    *up.uri_mut() = parts.uri;
    *up.headers_mut() = parts.headers;
    let Ok(mut send) = send.ready().await else {
        return;
    };
    let Ok((resp, mut tx)) = send.send_request(up, msg.is_empty()) else {
        return;
    };
    if !msg.is_empty() {
        tx.reserve_capacity(msg.len());
        let _ = tx.send_data(msg.freeze(), true);
    }
    let Ok(resp) = resp.await else {
        return;
    };
    let (head, mut rb) = resp.into_parts();
    let end = rb.is_end_stream();
    let Ok(mut out) = respond.send_response(http::Response::from_parts(head, ()), end) else {
        return;
    };
    while let Some(Ok(d)) = rb.data().await {
        let n = d.len();
        let last = rb.is_end_stream();
        out.reserve_capacity(n);
        let _ = out.send_data(d, last);
        let _ = rb.flow_control().release_capacity(n);
        if last {
            return;
        }
    }
    if let Ok(Some(t)) = rb.trailers().await {
        let _ = out.send_trailers(t);
    }
}
