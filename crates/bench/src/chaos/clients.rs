//! The soak's clients: HTTP GETs through the proxy at a steady rate, each on a kept-alive
//! connection that is opened again when the proxy closes it. A GET is idempotent, so the proxy
//! may retry it on another PE; every request that does not come back `200` with a PE's answer
//! within [`REQUEST_TIMEOUT`] counts as failed, with what was going on at the time.

use rserpool_proxy::http::client::Client;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longer than the proxy's own wait for a PE's response (30 s), so that the proxy answers
/// first.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(35);

/// Requests that failed the same way during the same episode.
#[derive(Clone, Debug)]
pub struct Failure {
    pub count: u64,
    /// The first and the last, since the start of the soak.
    pub first: Duration,
    pub last: Duration,
    /// The error, and one request that got it.
    pub error: String,
    pub example: String,
    pub context: String,
}

/// What the clients did, shared with the harness while they run.
#[derive(Default)]
pub struct Requests {
    pub sent: AtomicU64,
    pub failed: AtomicU64,
    pub failures: Mutex<Vec<Failure>>,
}

impl Requests {
    fn failed(&self, at: Duration, error: String, example: String, context: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut v = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = v
            .iter_mut()
            .find(|f| f.error == error && f.context == context)
        {
            f.count += 1;
            f.last = at;
        } else if v.len() < 100 {
            // Enough to describe them; the count has them all.
            v.push(Failure {
                count: 1,
                first: at,
                last: at,
                error,
                example,
                context,
            });
        }
    }
}

/// Runs `clients` clients sending `rps` requests per second in all until `stop` is set;
/// `context` says what is going on, for the failures.
pub async fn run(
    front: SocketAddr,
    clients: usize,
    rps: u32,
    start: Instant,
    context: impl Fn() -> String + Clone + Send + 'static,
    stop: Arc<AtomicBool>,
    requests: Arc<Requests>,
) {
    let period = Duration::from_secs_f64(clients as f64 / f64::from(rps.max(1)));
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (stop, requests, context) = (stop.clone(), requests.clone(), context.clone());
            tokio::spawn(async move {
                let mut conn: Option<Client> = None;
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    n += 1;
                    requests.sent.fetch_add(1, Ordering::Relaxed);
                    let path = format!("/chaos/{c}/{n}");
                    let outcome =
                        tokio::time::timeout(REQUEST_TIMEOUT, get(&mut conn, front, &path)).await;
                    let error = match outcome {
                        Ok(Ok(())) => continue,
                        Ok(Err(e)) => e,
                        Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
                    };
                    conn = None;
                    requests.failed(start.elapsed(), error, format!("GET {path}"), context());
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// One GET on the kept-alive connection (opened if there is none); an error unless a PE
/// answered 200.
async fn get(conn: &mut Option<Client>, front: SocketAddr, path: &str) -> Result<(), String> {
    if conn.is_none() {
        *conn = Some(
            Client::connect(front)
                .await
                .map_err(|e| format!("connect to the proxy: {e}"))?,
        );
    }
    let Some(c) = conn.as_mut() else {
        return Err("no connection".into());
    };
    let r = c.get(path).await.map_err(|e| e.to_string())?;
    if r.close {
        *conn = None;
    }
    if r.code != 200 || !r.body.starts_with(b"PE ") {
        return Err(format!(
            "HTTP {}: {}",
            r.code,
            String::from_utf8_lossy(&r.body).trim()
        ));
    }
    Ok(())
}
