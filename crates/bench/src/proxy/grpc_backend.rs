//! A gRPC-shaped HTTP/2 backend for the proxy benchmark's gRPC part (`rserpool-bench
//! grpc-backend`, hidden; one process per backend so that its CPU is its own): every request
//! is answered 200 with its own body (a gRPC message) back and the trailer `grpc-status: 0`,
//! as a unary echo call; a call of the hold method is never answered (the streams part holds
//! it open). Not a gRPC implementation: no codecs.

use anyhow::Result;
use bytes::{Bytes, BytesMut};
use clap::Args;
use std::net::SocketAddr;

#[derive(Args, Debug)]
pub struct GrpcBackendArgs {
    /// Where to take HTTP/2 (prior knowledge), repeatable: the service and the sidecar's check.
    #[arg(long, required = true)]
    pub listen: Vec<SocketAddr>,
}

pub fn run(args: GrpcBackendArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut listeners = Vec::new();
        for a in &args.listen {
            listeners.push(tokio::net::TcpListener::bind(a).await?);
        }
        let mut tasks = tokio::task::JoinSet::new();
        for l in listeners {
            tasks.spawn(async move {
                while let Ok((s, _)) = l.accept().await {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(connection(s));
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        Ok(())
    })
}

async fn connection(s: tokio::net::TcpStream) {
    let Ok(mut conn) = h2::server::Builder::new()
        .max_concurrent_streams(10_000)
        .handshake::<_, Bytes>(s)
        .await
    else {
        return;
    };
    while let Some(Ok((req, respond))) = conn.accept().await {
        if req.uri().path() == super::HOLD_PATH {
            tokio::spawn(hold(req, respond));
        } else {
            tokio::spawn(echo(req, respond));
        }
    }
}

/// Reads a call and holds it unanswered until the client resets it. (A body left unread would
/// pile up frames until `h2` ends the connection for them.)
async fn hold(req: http::Request<h2::RecvStream>, mut respond: h2::server::SendResponse<Bytes>) {
    let mut body = req.into_body();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
    }
    let _ = std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
}

async fn echo(req: http::Request<h2::RecvStream>, mut respond: h2::server::SendResponse<Bytes>) {
    let mut body = req.into_body();
    let mut msg = BytesMut::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        msg.extend_from_slice(&d);
    }
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(());
    let Ok(head) = head else { return };
    let Ok(mut tx) = respond.send_response(head, false) else {
        return;
    };
    // Small messages: the stream's initial window always has room.
    tx.reserve_capacity(msg.len());
    if tx.send_data(msg.freeze(), false).is_err() {
        return;
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = tx.send_trailers(trailers);
}
