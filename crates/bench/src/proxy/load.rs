//! rserpool's own HTTP client as the load generator for what wrk does not do: TCP mode bulk
//! downloads and the seed paper's concurrent uploads and downloads.

use super::{BULK, BULK_SIZE, MB};
use anyhow::{Result, anyhow};
use rserpool_proxy::http::client::Client;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The runtime the clients run on, with as many threads as the proxies.
pub(super) fn client_runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?)
}

/// TCP mode bulk: connections loop over GETs of a large file for `d`; MiB/s of body.
pub(super) async fn bulk(targets: Vec<SocketAddr>, conns: usize, d: Duration) -> Result<f64> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..conns.max(1) {
        let addr = targets[i % targets.len()];
        tasks.push(tokio::spawn(async move {
            let mut c = Client::connect(addr).await?;
            let mut bytes = 0u64;
            while start.elapsed() < d {
                let r = c.get_counted(BULK).await?;
                if r.code != 200 || r.body_len != BULK_SIZE as u64 {
                    return Err(anyhow!("bulk GET: {} with {} bytes", r.code, r.body_len));
                }
                bytes += r.body_len;
            }
            Ok::<u64, anyhow::Error>(bytes)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / MB as f64 / start.elapsed().as_secs_f64())
}

/// One round of the seed's experiment: all transfers of one method and size.
#[derive(Serialize, Clone, Debug)]
pub(super) struct Transfer {
    pub(super) method: &'static str,
    pub(super) mib: usize,
    pub(super) avg_s: f64,
    pub(super) total_s: f64,
    pub(super) failed: usize,
}

/// The seed's experiment: `n` clients start one transfer each at the same moment.
pub(super) async fn transfer(
    targets: Vec<SocketAddr>,
    method: &'static str,
    mib: usize,
    n: usize,
) -> Result<Transfer> {
    let size = mib * MB;
    let body = Arc::new(vec![0x5au8; if method == "PUT" { size } else { 0 }]);
    let mut clients = Vec::new();
    for i in 0..n {
        clients.push(Client::connect(targets[i % targets.len()]).await?);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, mut c) in clients.into_iter().enumerate() {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let ok = if method == "PUT" {
                c.put(&format!("/up/{i}"), &body)
                    .await
                    .is_ok_and(|r| (200..300).contains(&r.code))
            } else {
                c.get_counted(&format!("/m{mib}"))
                    .await
                    .is_ok_and(|r| r.code == 200 && r.body_len == size as u64)
            };
            (ok, t0.elapsed())
        }));
    }
    let mut times = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (ok, d) = t.await?;
        if !ok {
            failed += 1;
        }
        times.push(d.as_secs_f64());
    }
    Ok(Transfer {
        method,
        mib,
        avg_s: times.iter().sum::<f64>() / times.len().max(1) as f64,
        total_s: start.elapsed().as_secs_f64(),
        failed,
    })
}
