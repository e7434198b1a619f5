//! The failover run: keep-alive load through the system while one backend is killed with
//! SIGKILL; the connection attempts to the dead backend, seen on a raw socket, tell when the
//! failure became visible and when the traffic was off it.

use super::SMALL;
use super::args::ProxyBenchArgs;
use super::bed::Bed;
use super::front::Front;
use super::synwatch::SynWatch;
use anyhow::Result;
use rserpool_proxy::http::client::Client;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What one failover run saw.
#[derive(Serialize, Clone, Debug, Default)]
pub(super) struct Failover {
    pub(super) requests: u64,
    pub(super) failed: u64,
    /// Kill → first connection attempt that was refused.
    pub(super) visible_ms: Option<f64>,
    /// First refused attempt → last attempt of that burst (the next one came ≥ 500 ms later).
    pub(super) off_ms: Option<f64>,
    pub(super) burst_connects: usize,
    /// Attempts after the burst: re-probes, health checks, retries after a back-off.
    pub(super) later_connects: usize,
    /// When they came, ms after the kill.
    pub(super) later_at_ms: Vec<f64>,
}

/// Keep-alive GET load; a backend is killed after one second.
pub(super) fn run(
    bed: &mut Bed,
    front: &Front,
    rt: &tokio::runtime::Runtime,
    args: &ProxyBenchArgs,
) -> Result<Failover> {
    const VICTIM: usize = 1;
    let victim = bed.backends[VICTIM];
    let watch = SynWatch::start(victim.port())?;
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let addr = front.http[0];
    let tasks = (0..args.failover_clients.max(1))
        .map(|_| {
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            rt.spawn(async move {
                let mut c: Option<Client> = None;
                while !stop.load(Ordering::Relaxed) {
                    if c.is_none() {
                        c = Client::connect(addr).await.ok();
                    }
                    let Some(cl) = c.as_mut() else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    };
                    match tokio::time::timeout(Duration::from_secs(2), cl.get(SMALL)).await {
                        Ok(Ok(r)) if r.code == 200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if r.close {
                                c = None;
                            }
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            c = None;
                        }
                    }
                }
            })
        })
        .collect::<Vec<_>>();
    std::thread::sleep(Duration::from_secs(1));
    // Taken before the kill: the proxies react to the resets while the process is still
    // being torn down, before it can be reaped.
    let killed = Instant::now();
    bed.kill_backend(VICTIM);
    std::thread::sleep(Duration::from_millis(args.failover_ms));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        rt.block_on(t)?;
    }
    let syns = watch.finish()?;
    bed.start_backend(VICTIM)?;
    bed.wait_registered()?;
    let after: Vec<Instant> = syns.into_iter().filter(|&t| t >= killed).collect();
    let mut f = Failover {
        requests: ok.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        ..Failover::default()
    };
    if let Some(&first) = after.first() {
        let burst_end = after
            .windows(2)
            .position(|w| w[1] - w[0] >= Duration::from_millis(500))
            .map_or(after.len() - 1, |i| i);
        f.visible_ms = Some(ms(first - killed));
        f.off_ms = Some(ms(after[burst_end] - first));
        f.burst_connects = burst_end + 1;
        f.later_connects = after.len() - burst_end - 1;
        f.later_at_ms = after[burst_end + 1..]
            .iter()
            .map(|&t| ms(t - killed).round())
            .collect();
    }
    Ok(f)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
