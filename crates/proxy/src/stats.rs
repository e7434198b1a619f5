//! The stats endpoint: the proxy's counters as JSON on `http://ADDR/stats`.
//!
//! A small HTTP/1.1 server of its own, apart from the listeners: it answers one GET per
//! connection and closes, and knows nothing of what the document holds (the proxy hands it a
//! function that makes one).

use crate::message::{Head, error_response};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Serves the stats document on `sock`; `stats` gives it, or `None` once the proxy is gone.
pub(crate) async fn serve<F>(sock: TcpListener, stats: F)
where
    F: Fn() -> Option<serde_json::Value> + Clone + Send + 'static,
{
    loop {
        let Ok((s, _)) = sock.accept().await else {
            continue;
        };
        let stats = stats.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(s, stats)).await;
        });
    }
}

async fn answer(
    mut s: TcpStream,
    stats: impl Fn() -> Option<serde_json::Value>,
) -> std::io::Result<()> {
    let mut buf = bytes::BytesMut::with_capacity(4096);
    let head = loop {
        if s.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        match Head::request(&mut buf, 8192) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(_) => {
                return s.write_all(&error_response(400, "malformed request")).await;
            }
        }
    };
    let Some(doc) = stats() else {
        return Ok(());
    };
    let path = head
        .target()
        .split(|&b| b == b'?')
        .next()
        .unwrap_or_default();
    if path != b"/stats" && path != b"/" {
        return s.write_all(&error_response(404, "try /stats")).await;
    }
    let body = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len() + 1
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out.push(b'\n');
    s.write_all(&out).await
}
