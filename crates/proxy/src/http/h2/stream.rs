//! One HTTP/2 client stream: the request on its way and the client's side of the answer,
//! shared by the front that accepts it and the relays that answer it.

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::header::HeaderValue;
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
}

impl Stream {
    pub(crate) fn expired(&self) -> bool {
        self.deadline
            .is_some_and(|d| d <= tokio::time::Instant::now())
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
