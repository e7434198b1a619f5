//! `rserpool-bench xds`: the registrar as an xDS control plane (docs/XDS.md).
//!
//! One `rserpool registrar --xds` process on loopback. First, how fast a change reaches an xDS
//! client subscribed to the pool's endpoints (EDS over ADS, the generated xDS client): from a
//! library PE's start to its endpoint in a pushed assignment (registration), from its
//! `update_policy` to its new weight there (credit change), and from `kill -9` of an
//! `rserpool example echo` process to its endpoint's absence (death). Then the registrar's CPU
//! while `--subscribers` xDS streams each watch one of `--pools` pools of `--pes-per-pool`
//! PEs, one PE of every pool changing its credits each second (every change pushed to that
//! pool's subscribers).

use crate::net::{free_port, local};
use crate::process::Proc;
use crate::report;
use anyhow::{Context, Result, anyhow};
use clap::Args;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use prost::Message;
use rserpool_asap::{PoolElement, PoolElementConfig};
use rserpool_wire::Policy;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const CAPACITY: u32 = 1_000;

#[derive(Args, Debug)]
pub struct XdsArgs {
    /// Events of each kind (registration, credit change, death) timed to the xDS client.
    #[arg(long, default_value_t = 334)]
    pub events: u32,
    /// xDS streams for the CPU part, each watching one pool.
    #[arg(long, default_value_t = 1000)]
    pub subscribers: u32,
    #[arg(long, default_value_t = 100)]
    pub pools: u32,
    #[arg(long, default_value_t = 10)]
    pub pes_per_pool: u32,
    /// How long the registrar's CPU is measured.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Write the results as a Markdown section into this file (e.g. docs/XDS.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

pub fn run(args: XdsArgs, bin: &Path) -> Result<()> {
    crate::process::raise_nofile_limit(65_536);
    let dir = std::env::temp_dir().join(format!("rserpool-bench-xds-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let xds = local(free_port()?);
    let (mut registrar, asap, _) =
        crate::product::start_registrar_with(bin, &dir, &["--xds", &xds.to_string()])?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = rt.block_on(async {
        let mut out = String::new();
        latencies(&args, bin, asap, xds, &mut out).await?;
        load(&args, asap, xds, registrar.id(), &mut out).await?;
        Ok::<_, anyhow::Error>(out)
    });
    registrar.kill();
    let _ = std::fs::remove_dir_all(&dir);
    let out = out?;
    print!("{out}");
    if let Some(path) = &args.markdown {
        report::write_section(path, "xds", &format!("{}{out}", report::provenance()))?;
        println!("written into {}", path.display());
    }
    Ok(())
}

/// A pool's endpoints as the xDS client last received them: PE ID → weight.
type Seen = BTreeMap<u32, u32>;

/// One ADS stream subscribed to `pool`'s endpoints; `seen` follows every response, `count`
/// counts them.
async fn subscribe(
    xds: SocketAddr,
    pool: String,
    seen: Option<watch::Sender<Seen>>,
    count: Arc<AtomicU64>,
) -> Result<()> {
    let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{xds}")).await?;
    let (tx, rx) = mpsc::channel(4);
    let ask = move |nonce: String, version: String| DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec![pool.clone()],
        response_nonce: nonce,
        version_info: version,
        ..Default::default()
    };
    tx.send(ask(String::new(), String::new())).await?;
    let mut responses = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await?
        .into_inner();
    tokio::spawn(async move {
        while let Ok(Some(r)) = responses.message().await {
            count.fetch_add(1, Ordering::Relaxed);
            if let Some(seen) = &seen {
                let mut now = Seen::new();
                for a in &r.resources {
                    let Ok(cla) = ClusterLoadAssignment::decode(a.value.as_slice()) else {
                        continue;
                    };
                    for l in cla.endpoints {
                        let id = l.locality.as_ref().and_then(|l| {
                            u32::from_str_radix(l.sub_zone.trim_start_matches("0x"), 16).ok()
                        });
                        let w = l.load_balancing_weight.map_or(1, |w| w.value);
                        if let Some(id) = id {
                            now.insert(id, w);
                        }
                    }
                }
                seen.send_replace(now);
            }
            if tx.send(ask(r.nonce, r.version_info)).await.is_err() {
                break;
            }
        }
    });
    Ok(())
}

fn pe(pool: &str, id: u32, registrar: SocketAddr, credits: u32) -> Result<PoolElement> {
    let target = SocketAddr::from(([127, 0, 0, 1], 20_000 + (id % 40_000) as u16));
    let mut cfg = PoolElementConfig::new(
        pool,
        target,
        Policy::Credits {
            credits,
            capacity: CAPACITY,
        },
    );
    cfg.registrars = vec![registrar];
    cfg.id = Some(id);
    Ok(PoolElement::start(cfg)?)
}

/// Waits until the client's view satisfies `cond`; the time since `t0`.
async fn until(
    seen: &mut watch::Receiver<Seen>,
    what: &str,
    t0: Instant,
    cond: impl Fn(&Seen) -> bool,
) -> Result<Duration> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if cond(&seen.borrow_and_update()) {
            return Ok(t0.elapsed());
        }
        tokio::time::timeout_at(deadline, seen.changed())
            .await
            .map_err(|_| anyhow!("the xDS client did not see {what} within 10 s"))??;
    }
}

async fn latencies(
    args: &XdsArgs,
    bin: &Path,
    asap: SocketAddr,
    xds: SocketAddr,
    out: &mut String,
) -> Result<()> {
    const POOL: &str = "XdsLatency";
    let (tx, mut seen) = watch::channel(Seen::new());
    subscribe(xds, POOL.into(), Some(tx), Arc::default()).await?;
    let mut registered = Vec::new();
    let mut changed = Vec::new();
    let mut died = Vec::new();
    let mut pes = Vec::new();
    for i in 0..args.events {
        // A registration.
        let id = 0x1000 + i;
        let t0 = Instant::now();
        let p = pe(POOL, id, asap, CAPACITY)?;
        registered.push(until(&mut seen, "a registration", t0, |s| s.contains_key(&id)).await?);
        // A credit change.
        let credits = 1 + (i % 500);
        let t0 = Instant::now();
        p.update_policy(Policy::Credits {
            credits,
            capacity: CAPACITY,
        });
        changed.push(
            until(&mut seen, "a credit change", t0, |s| {
                s.get(&id) == Some(&credits)
            })
            .await?,
        );
        pes.push(p);
        // A death: a PE process killed.
        let dead = 0x9000 + i;
        let mut proc = Proc::spawn(
            crate::product::command(bin)
                .args(["example", "echo", "--listen", "127.0.0.1:0", "--pool", POOL])
                .args(["--policy", "credits"])
                .args(["--id", &dead.to_string(), "--registrar", &asap.to_string()]),
            Path::new("/dev/null"),
        )?;
        until(&mut seen, "a PE process", Instant::now(), |s| {
            s.contains_key(&dead)
        })
        .await?;
        let t0 = Instant::now();
        proc.kill();
        died.push(until(&mut seen, "a death", t0, |s| !s.contains_key(&dead)).await?);
        if pes.len() >= 50 {
            // Keep the pool small: a large assignment costs every push.
            for p in pes.drain(..) {
                p.stop().await;
            }
        }
    }
    let _ = writeln!(
        out,
        "Time from a change to the xDS client's view (one ADS stream subscribed to the pool's \
         endpoints, loopback), {} events of each kind:\n",
        args.events
    );
    let _ = writeln!(out, "| change | p50 | p99 | max |\n|---|---|---|---|");
    for (what, v) in [
        ("registration (library PE started)", registered),
        ("credit change (`update_policy`)", changed),
        ("death (`kill -9` of an `example echo` PE)", died),
    ] {
        let (p50, p99, max) = percentiles(v);
        let _ = writeln!(out, "| {what} | {p50:.1} ms | {p99:.1} ms | {max:.1} ms |");
    }
    let _ = writeln!(out);
    Ok(())
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: f64| ms(v[((v.len() as f64 * q) as usize).min(v.len() - 1)]);
    (at(0.5), at(0.99), v.last().map_or(0.0, |d| ms(*d)))
}

async fn load(
    args: &XdsArgs,
    asap: SocketAddr,
    xds: SocketAddr,
    registrar_pid: u32,
    out: &mut String,
) -> Result<()> {
    let pools: Vec<String> = (0..args.pools).map(|p| format!("XdsLoad{p}")).collect();
    let mut pes: Vec<Vec<PoolElement>> = Vec::new();
    for (p, pool) in pools.iter().enumerate() {
        let mut v = Vec::new();
        for k in 0..args.pes_per_pool {
            v.push(pe(pool, 0x10_0000 + (p as u32) * 1000 + k, asap, CAPACITY)?);
        }
        pes.push(v);
    }
    for v in &pes {
        for p in v {
            p.wait_registered(Duration::from_secs(10))
                .await
                .map_err(|e| anyhow!("a PE did not register: {e}"))?;
        }
    }
    let responses = Arc::new(AtomicU64::new(0));
    for s in 0..args.subscribers {
        let pool = pools[(s % args.pools) as usize].clone();
        subscribe(xds, pool, None, responses.clone())
            .await
            .context("an xDS subscriber")?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu0 = crate::procfs::cpu_ns(registrar_pid)?;
    let pushed0 = responses.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut round = 0u32;
    while t0.elapsed() < Duration::from_secs(args.duration_s) {
        tick.tick().await;
        round += 1;
        for v in &pes {
            let k = (round as usize) % v.len();
            v[k].update_policy(Policy::Credits {
                credits: 1 + round % 900,
                capacity: CAPACITY,
            });
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (crate::procfs::cpu_ns(registrar_pid)? - cpu0) as f64 / 1e9 / secs;
    let pushed = (responses.load(Ordering::Relaxed) - pushed0) as f64 / secs;
    let _ = writeln!(
        out,
        "The registrar serving {} xDS subscribers, each watching one of {} pools of {} PEs, one \
         PE of every pool changing its credits each second, for {secs:.0} s:\n",
        args.subscribers, args.pools, args.pes_per_pool
    );
    let _ = writeln!(
        out,
        "| registrar CPU | EDS responses received per second |\n|---|---|\n| {:.1} % of a core | {pushed:.0} |\n",
        cpu * 100.0
    );
    for v in pes {
        for p in v {
            drop(p);
        }
    }
    Ok(())
}
