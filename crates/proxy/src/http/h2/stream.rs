//! One HTTP/2 client stream: the request on its way and the client's side of the answer,
//! shared by the front that accepts it and the relays that answer it.

use crate::ctx::Ctx;
use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::header::{CONTENT_TYPE, HeaderValue};
use std::future::poll_fn;
use std::net::SocketAddr;

/// A request body as the client sends it.
pub(crate) enum Body {
    /// All of it: the request can be sent again.
    Held(Bytes),
    /// What was read of it, and the rest to come.
    Streamed {
        prefix: Bytes,
        rest: Option<RecvStream>,
    },
}

/// One stream: the request on its way and the client's side of the answer.
pub(crate) struct Stream {
    pub(crate) respond: SendResponse<Bytes>,
    /// Once the response head went out: where its body goes.
    pub(crate) tx: Option<SendStream<Bytes>>,
    pub(crate) peer: SocketAddr,
    pub(crate) grpc: bool,
    /// `grpc-timeout`, from the request's arrival.
    pub(crate) deadline: Option<tokio::time::Instant>,
    /// The request as the client sent it (for an HTTP/2 PE).
    pub(crate) parts: http::request::Parts,
    pub(crate) body: Body,
    /// A `Set-Cookie` the proxy adds to the response (`sticky-cookie`).
    pub(crate) set_cookie: Option<http::HeaderValue>,
    /// An extended CONNECT (RFC 8441): the client's side of the tunnel, once the PE switches
    /// protocols (`super::tunnel`).
    pub(crate) tunnel: Option<RecvStream>,
}

impl Stream {
    pub(crate) fn expired(&self) -> bool {
        self.deadline
            .is_some_and(|d| d <= tokio::time::Instant::now())
    }

    /// A short answer of the proxy's own: for gRPC, a trailers-only response with the status.
    pub(crate) fn reply(&mut self, code: u16, why: &str, ctx: &Ctx) {
        let expired = self.expired();
        if let Some(tx) = &mut self.tx {
            // Part of a response went out already.
            if self.grpc && expired {
                let _ = tx.send_trailers(grpc_trailers(4, "deadline exceeded"));
            } else {
                tx.send_reset(Reason::INTERNAL_ERROR);
            }
            return;
        }
        let mut head = http::Response::builder();
        if self.grpc {
            let why = if expired { "deadline exceeded" } else { why };
            head = head
                .status(200)
                .header(CONTENT_TYPE, "application/grpc")
                .header("grpc-status", grpc_status(code, expired))
                .header("grpc-message", why);
            if let Ok(h) = head.body(()) {
                let _ = self.respond.send_response(h, true);
            }
            return;
        }
        head = head
            .status(code)
            .header(CONTENT_TYPE, "text/plain; charset=utf-8");
        if code == 503 {
            // No PE had room: say when to come back.
            let secs = ctx.cfg.levels.as_ref().map_or(1, |l| l.retry_after_s);
            head = head.header("retry-after", secs);
        }
        let Ok(h) = head.body(()) else { return };
        if let Ok(mut tx) = self.respond.send_response(h, false) {
            // A line: `h2` holds it until the client's window takes it, no wait here.
            let _ = tx.send_data(Bytes::from(format!("{why}\n")), true);
        }
    }
}

/// Sends `data` as the client's (or a PE's) flow-control window allows.
pub(crate) async fn send_data(
    tx: &mut SendStream<Bytes>,
    mut data: Bytes,
    end: bool,
) -> Result<(), h2::Error> {
    if data.is_empty() {
        if end {
            tx.send_data(data, true)?;
        }
        return Ok(());
    }
    while !data.is_empty() {
        tx.reserve_capacity(data.len());
        let n = match poll_fn(|cx| tx.poll_capacity(cx)).await {
            Some(Ok(n)) => n,
            Some(Err(e)) => return Err(e),
            None => return Err(Reason::STREAM_CLOSED.into()),
        };
        if n > 0 {
            let chunk = data.split_to(n.min(data.len()));
            // The last piece carries END_STREAM: no empty frame after it.
            tx.send_data(chunk, end && data.is_empty())?;
        }
    }
    Ok(())
}

/// gRPC trailers with a status and a message (plain ASCII: nothing to percent-encode).
pub(crate) fn grpc_trailers(status: u16, message: &str) -> http::HeaderMap {
    let mut t = http::HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from(status));
    if let Ok(m) = HeaderValue::from_str(message) {
        t.insert("grpc-message", m);
    }
    t
}

/// The gRPC status of a proxy's error answer (gRPC's HTTP-to-status mapping; the deadline's
/// own status when it passed).
fn grpc_status(code: u16, expired: bool) -> u16 {
    match code {
        _ if expired => 4,
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502..=504 => 14,
        _ => 2,
    }
}
