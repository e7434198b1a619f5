//! The open-loop replayer: every request is sent at its trace time, whether or not earlier
//! ones were answered (a closed loop would slow down with the servers and hide overload).
//! Each request is a new connection with `Connection: close`, as the HTTP/1.0-era clients
//! of the trace; its *first response time* is from the connect to the first byte of the
//! response.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One request as sent: when (from the start), the path, and its service time.
pub struct Request {
    pub at: Duration,
    pub path: String,
    /// The page of the trace (sent as `X-Page`, the key of the hashing selections).
    pub page: String,
    pub cost_us: u64,
}

/// What became of one request.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// First response time of a request answered 200 in full; `None` for an error (refused,
    /// reset, timed out, another status, a short body).
    pub first: Option<Duration>,
    pub cost_us: u64,
}

/// Replays `requests` against `front` and returns their outcomes (in order) and the largest
/// delay of a send behind its trace time.
pub async fn replay(
    front: SocketAddr,
    requests: Vec<Request>,
    timeout: Duration,
) -> (Vec<Outcome>, Duration) {
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    let mut late = Duration::ZERO;
    for r in requests {
        let due = start + r.at;
        tokio::time::sleep_until(due).await;
        late = late.max(tokio::time::Instant::now().saturating_duration_since(due));
        let cost_us = r.cost_us;
        tasks.push(tokio::spawn(async move {
            let first = tokio::time::timeout(timeout, one(front, &r.path, &r.page))
                .await
                .ok()
                .flatten();
            Outcome { first, cost_us }
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or(Outcome {
            first: None,
            cost_us: 0,
        }));
    }
    (out, late)
}

async fn one(front: SocketAddr, path: &str, page: &str) -> Option<Duration> {
    let started = tokio::time::Instant::now();
    let mut s = TcpStream::connect(front).await.ok()?;
    let _ = s.set_nodelay(true);
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: bench\r\nX-Page: {page}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = Vec::with_capacity(512);
    let mut first = None;
    let mut total = 0usize;
    loop {
        let n = s.read(&mut buf).await.ok()?;
        if n == 0 {
            break;
        }
        first.get_or_insert_with(|| started.elapsed());
        total += n;
        if got.len() < 4096 {
            got.extend_from_slice(&buf[..n.min(4096)]);
        }
    }
    let head_end = got.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&got[..head_end]).ok()?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return None;
    }
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(total - head_end);
    (total - head_end == length).then_some(first?)
}
