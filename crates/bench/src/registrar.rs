//! `rserpool-bench registrar`: the seed paper's Figures 7 (left) and 8 (left), and beyond.
//!
//! Each point starts a fresh registrar process and, in a second process (`rserpool-bench load-gen`), N
//! simulated PEs, each on its own TCP connection, re-registering every `a` ms with a new load
//! (least used), and M simulated PUs resolving every `b` ms. After the connections are up and a
//! warm-up, the registrar's CPU time (sum of /proc/PID/task/*/schedstat) and resident memory
//! (VmRSS) are read around a measurement window; the load generator measures response latency
//! from send to the complete answer, so it includes its own scheduling delay.
//!
//! With `--registrars K` (or `--figure 7r`, the paper's Figure 7 right) K registrar processes
//! form an ENRP cluster first; the PEs register at the first one, which sends every change to
//! the K - 1 others. Both the CPU of that home registrar and of one that only synchronises
//! (`sync_cpu`) are measured.

use crate::net::{free_port, local, registrar_status};
use crate::plot;
use crate::process::{Reaper, raise_nofile_limit, wait_for};
use crate::procfs::{cpu_ns, rss_bytes};
use crate::report::{machine, provenance, write_section};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use rserpool_asap::AsapConnection;
use rserpool_wire::{AsapMessage, Policy, PoolHandle, TransportAddress, UserTransport};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpSocket;

/// PEs per pool in the simulated handlespace.
const POOL_SIZE: usize = 100;
/// Connections per loopback source address (the ephemeral port range holds ~28,000).
const CONNS_PER_SOURCE: usize = 20_000;

#[derive(Args, Debug, Clone)]
pub struct RegistrarBenchArgs {
    /// Which series to run (repeatable): 7 (Figure 7 left), 8 (Figure 8 left), further
    /// (10,000 and 50,000 PEs), 7r (Figure 7 right: 1,000 PEs, 1 to 6 registrars). Default:
    /// 7, 8 and further. Ignored when --pes is given.
    #[arg(long = "figure")]
    pub figures: Vec<String>,
    /// Ad-hoc points instead: PE counts (cross product with the other lists).
    #[arg(long = "pes")]
    pub pes: Vec<usize>,
    #[arg(long = "rereg-ms", default_value = "1000")]
    pub rereg_ms: Vec<u64>,
    #[arg(long = "pus", default_value = "0")]
    pub pus: Vec<usize>,
    #[arg(long = "resolve-ms", default_value = "1000")]
    pub resolve_ms: Vec<u64>,
    /// Registrars in the ENRP cluster (the PEs register at the first).
    #[arg(long = "registrars", default_value = "1", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub registrars: Vec<u32>,
    /// Measurement window per point.
    #[arg(long, default_value_t = 3000)]
    pub duration_ms: u64,
    /// Warm-up after all connections are up.
    #[arg(long, default_value_t = 1000)]
    pub warmup_ms: u64,
    /// Runs per point; each figure is the median over the runs (this machine is noisy).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// One JSON object per point on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the table into this Markdown file (between generated-section markers).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<std::path::PathBuf>,
    /// Write PNG plots with this path prefix (e.g. docs/bench-registrar → -pes.png, -pus.png).
    #[arg(long, value_name = "PREFIX")]
    pub plot: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Point {
    pub pes: usize,
    pub pus: usize,
    pub rereg_ms: u64,
    pub resolve_ms: u64,
    pub registrars: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    pub pes: usize,
    pub pus: usize,
    pub rereg_ms: u64,
    pub resolve_ms: u64,
    /// Registrars in the ENRP cluster.
    pub registrars: u32,
    /// Registrar CPU time / wall time, 1.0 = one core (the PEs' home registrar).
    pub registrar_cpu: f64,
    /// CPU of a registrar that only synchronises (with more than one registrar).
    pub sync_cpu: Option<f64>,
    pub rss_bytes: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    /// Requests per second offered by the schedule and answered in the window.
    pub offered_per_s: f64,
    pub answered_per_s: f64,
    pub errors: u64,
    /// The load generator's own CPU (same 2 cores): near 1.0 means latencies include its
    /// queueing, not only the registrar's.
    pub loadgen_cpu: f64,
    /// Runs behind this point (each figure is their median) and the spread of CPU and p99.
    pub runs: u32,
    pub registrar_cpu_min: f64,
    pub registrar_cpu_max: f64,
    pub p99_us_max: u64,
}

/// Each figure's median over repeated runs of one point.
fn median(runs: &[Sample]) -> Option<Sample> {
    fn mid<T: Copy + PartialOrd>(mut v: Vec<T>) -> T {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v[v.len() / 2]
    }
    let first = runs.first()?;
    let f = |g: fn(&Sample) -> f64| mid(runs.iter().map(g).collect());
    let u = |g: fn(&Sample) -> u64| mid(runs.iter().map(g).collect());
    let cpu = runs.iter().map(|s| s.registrar_cpu);
    Some(Sample {
        registrar_cpu: f(|s| s.registrar_cpu),
        sync_cpu: first.sync_cpu.map(|_| f(|s| s.sync_cpu.unwrap_or(0.0))),
        rss_bytes: u(|s| s.rss_bytes),
        p50_us: u(|s| s.p50_us),
        p99_us: u(|s| s.p99_us),
        answered_per_s: f(|s| s.answered_per_s),
        errors: runs.iter().map(|s| s.errors).sum(),
        loadgen_cpu: f(|s| s.loadgen_cpu),
        runs: runs.len() as u32,
        registrar_cpu_min: cpu.clone().fold(f64::INFINITY, f64::min),
        registrar_cpu_max: cpu.fold(0.0, f64::max),
        p99_us_max: runs.iter().map(|s| s.p99_us).max().unwrap_or(0),
        ..first.clone()
    })
}

fn figure_points(fig: &str) -> Result<Vec<Point>> {
    let pt = |pes, pus, rereg_ms, resolve_ms| Point {
        pes,
        pus,
        rereg_ms,
        resolve_ms,
        registrars: 1,
    };
    Ok(match fig {
        "7" => {
            let mut v = Vec::new();
            for a in [250, 500, 1000] {
                for n in [500, 1000, 1500, 2000, 2500, 3000] {
                    v.push(pt(n, 0, a, 1000));
                }
            }
            v
        }
        "8" => {
            // As in the paper: 1,000 PEs re-registering every 1000 ms.
            let mut v = Vec::new();
            for b in [100, 250, 500] {
                for m in [250, 500, 1000, 1500, 2000] {
                    v.push(pt(1000, m, 1000, b));
                }
            }
            v
        }
        // 50,000 PEs need 50,000 descriptors per process; this machine's hard limit is 20,000
        // (no CAP_SYS_RESOURCE), so the largest point here is 18,000. On a machine with a
        // higher limit add `--pes 50000`.
        "further" => vec![
            pt(10_000, 0, 250, 1000),
            pt(10_000, 1000, 1000, 100),
            pt(18_000, 0, 1000, 1000),
        ],
        "7r" => {
            let mut v = Vec::new();
            for a in [250, 500, 1000] {
                for k in 1..=6 {
                    v.push(Point {
                        registrars: k,
                        ..pt(1000, 0, a, 1000)
                    });
                }
            }
            v
        }
        other => bail!("unknown --figure {other}; use 7, 8, further or 7r"),
    })
}

pub fn run(args: RegistrarBenchArgs, rserpool: &Path) -> Result<()> {
    let points = if args.pes.is_empty() {
        let figs = if args.figures.is_empty() {
            vec!["7".to_string(), "8".into(), "further".into()]
        } else {
            args.figures.clone()
        };
        let mut v = Vec::new();
        for f in &figs {
            v.extend(figure_points(f)?);
        }
        v
    } else {
        let mut v = Vec::new();
        for &pes in &args.pes {
            for &rereg_ms in &args.rereg_ms {
                for &pus in &args.pus {
                    for &resolve_ms in &args.resolve_ms {
                        for &registrars in &args.registrars {
                            v.push(Point {
                                pes,
                                pus,
                                rereg_ms,
                                resolve_ms,
                                registrars,
                            });
                        }
                    }
                }
            }
        }
        v
    };
    let limit = raise_nofile_limit(200_000);
    if !args.json {
        println!("machine: {}; open-file limit {limit}", machine());
        println!(
            "{:>3} {:>7} {:>6} {:>6} {:>6} {:>8} {:>8} {:>9} {:>9} {:>9} {:>10} {:>6} {:>8}",
            "K",
            "PEs",
            "PUs",
            "a ms",
            "b ms",
            "CPU",
            "sync CPU",
            "RSS MB",
            "p50 µs",
            "p99 µs",
            "answered/s",
            "errors",
            "gen CPU"
        );
    }
    let mut samples = Vec::new();
    for p in points {
        let mut runs = Vec::new();
        for _ in 0..args.repeat {
            // Ports are picked free beforehand, so a registrar's port can be taken by someone
            // else's outgoing connection before it binds: try such a point again.
            let mut attempt = 0;
            let sample = loop {
                attempt += 1;
                match run_point(p, &args, rserpool) {
                    Ok(s) => break s,
                    Err(e) if attempt < 3 => eprintln!("point {p:?}: {e:#}; again"),
                    Err(e) => return Err(e.context(format!("point {p:?}"))),
                }
            };
            runs.push(sample);
        }
        let Some(s) = median(&runs) else { continue };
        if args.json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            println!(
                "{:>3} {:>7} {:>6} {:>6} {:>6} {:>7.1}% {:>8} {:>9.1} {:>9} {:>9} {:>10.0} {:>6} {:>7.0}%",
                s.registrars,
                s.pes,
                s.pus,
                s.rereg_ms,
                s.resolve_ms,
                s.registrar_cpu * 100.0,
                s.sync_cpu
                    .map_or("-".to_string(), |c| format!("{:.1}%", c * 100.0)),
                s.rss_bytes as f64 / 1e6,
                s.p50_us,
                s.p99_us,
                s.answered_per_s,
                s.errors,
                s.loadgen_cpu * 100.0
            );
        }
        samples.push(s);
    }
    // A cluster run (Figure 7 right) has its own table and plot, K = 1 included.
    let cluster = args.figures.iter().any(|f| f == "7r") || args.registrars.iter().any(|&k| k > 1);
    if let Some(path) = &args.markdown {
        if cluster {
            write_section(path, "registrar-cluster", &cluster_markdown(&samples))?;
        } else {
            write_section(path, "registrar", &markdown(&samples))?;
        }
    }
    if let Some(prefix) = &args.plot {
        if cluster {
            cluster_plot(&samples, prefix)?;
        } else {
            plot(&samples, prefix)?;
        }
    }
    Ok(())
}

fn run_point(p: Point, args: &RegistrarBenchArgs, rserpool: &Path) -> Result<Sample> {
    let exe = std::env::current_exe()?;
    let k = p.registrars.max(1) as usize;
    let mut asap = Vec::new();
    let mut enrp = Vec::new();
    for _ in 0..k {
        asap.push(local(free_port()?));
        enrp.push(local(free_port()?));
    }
    let addr = asap[0];
    let mut reaper = Reaper::default();
    let mut pids = Vec::new();
    for i in 0..k {
        let mut cmd = Command::new(rserpool);
        cmd.args([
            "registrar",
            "--asap",
            &asap[i].to_string(),
            "--max-hr-rate",
            "0",
        ])
        .args([
            "--max-connections",
            "200000",
            "--max-pes-per-pool",
            "200000",
        ])
        .args(["--enrp", &enrp[i].to_string()]);
        for (j, e) in enrp.iter().enumerate() {
            if j != i {
                cmd.args(["--peer", &e.to_string()]);
            }
        }
        let child = cmd
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a registrar")?;
        pids.push(child.id());
        reaper.0.push(child);
    }
    let pid = pids[0];
    let sync_pid = pids.get(1).copied();
    for a in &asap {
        wait_for(
            &format!("the registrar on {a}"),
            Duration::from_secs(5),
            || std::net::TcpStream::connect(a).is_ok(),
        )?;
    }
    // The cluster is formed once every registrar knows every other one.
    if k > 1 {
        wait_for(
            &format!("a cluster of the {k} registrars"),
            Duration::from_secs(20),
            || cluster_formed(&asap),
        )?;
    }
    let mut generator = Command::new(&exe)
        .args(["load-gen", "--registrar", &addr.to_string()])
        .args([
            "--pes",
            &p.pes.to_string(),
            "--rereg-ms",
            &p.rereg_ms.to_string(),
        ])
        .args([
            "--pus",
            &p.pus.to_string(),
            "--resolve-ms",
            &p.resolve_ms.to_string(),
        ])
        .args(["--warmup-ms", &args.warmup_ms.to_string()])
        .args(["--duration-ms", &args.duration_ms.to_string()])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the load generator")?;
    let gen_pid = generator.id();
    let out = generator
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no load generator stdout"))?;
    reaper.0.push(generator);
    let mut lines = BufReader::new(out).lines();
    let mut cpu0 = None;
    let mut cpu = None;
    let mut sync0 = 0;
    let mut sync_cpu = None;
    let mut rss = 0;
    let mut result: Option<GenResult> = None;
    while let Some(line) = lines.next().transpose()? {
        match line.as_str() {
            "start" => {
                if let Some(s) = sync_pid {
                    sync0 = cpu_ns(s)?;
                }
                cpu0 = Some((Instant::now(), cpu_ns(pid)?, cpu_ns(gen_pid)?));
            }
            "stop" => {
                let (t0, c0, g0) = cpu0.ok_or_else(|| anyhow!("stop before start"))?;
                let (c1, g1) = (cpu_ns(pid)?, cpu_ns(gen_pid)?);
                let wall = t0.elapsed().as_nanos() as f64;
                cpu = Some(((c1 - c0) as f64 / wall, (g1 - g0) as f64 / wall));
                if let Some(s) = sync_pid {
                    sync_cpu = Some((cpu_ns(s)? - sync0) as f64 / wall);
                }
                rss = rss_bytes(pid)?;
            }
            l if l.starts_with('{') => {
                result = Some(serde_json::from_str(l)?);
                break;
            }
            _ => {}
        }
    }
    let r = result.ok_or_else(|| anyhow!("load generator ended without a result"))?;
    let (cpu, loadgen_cpu) = cpu.ok_or_else(|| anyhow!("no CPU measurement"))?;
    Ok(Sample {
        pes: p.pes,
        pus: p.pus,
        rereg_ms: p.rereg_ms,
        resolve_ms: p.resolve_ms,
        registrars: p.registrars,
        registrar_cpu: cpu,
        sync_cpu,
        rss_bytes: rss,
        p50_us: r.p50_us,
        p99_us: r.p99_us,
        offered_per_s: p.pes as f64 * 1000.0 / p.rereg_ms as f64
            + p.pus as f64 * 1000.0 / p.resolve_ms as f64,
        answered_per_s: r.answered as f64 / r.seconds,
        errors: r.errors,
        loadgen_cpu,
        runs: 1,
        registrar_cpu_min: cpu,
        registrar_cpu_max: cpu,
        p99_us_max: r.p99_us,
    })
}

/// True when each registrar's status lists all the others as alive peers.
fn cluster_formed(asap: &[SocketAddr]) -> bool {
    asap.iter().all(|a| {
        let Ok(st) = registrar_status(*a) else {
            return false;
        };
        st.peers.iter().filter(|p| p.state == "alive").count() + 1 == asap.len()
    })
}

#[derive(Args, Debug, Clone)]
pub struct LoadGenArgs {
    #[arg(long)]
    pub registrar: SocketAddr,
    #[arg(long)]
    pub pes: usize,
    #[arg(long)]
    pub rereg_ms: u64,
    #[arg(long)]
    pub pus: usize,
    #[arg(long)]
    pub resolve_ms: u64,
    #[arg(long)]
    pub warmup_ms: u64,
    #[arg(long)]
    pub duration_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct GenResult {
    p50_us: u64,
    p99_us: u64,
    answered: u64,
    seconds: f64,
    errors: u64,
}

struct Shared {
    measuring: AtomicBool,
    latencies: Mutex<Vec<u32>>,
    answered: AtomicU64,
    errors: AtomicU64,
}

impl Shared {
    fn record(&self, t0: Instant) {
        if self.measuring.load(Ordering::Relaxed) {
            let us = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
            if let Ok(mut l) = self.latencies.lock() {
                l.push(us);
            }
            self.answered.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The simulated PEs and PUs (a separate process, so its CPU is not the registrar's).
pub fn load_gen(args: LoadGenArgs) -> Result<()> {
    raise_nofile_limit(200_000);
    let rt = rserpool::util::runtime()?;
    rt.block_on(async move {
        let shared = Arc::new(Shared {
            measuring: AtomicBool::new(false),
            latencies: Mutex::new(Vec::new()),
            answered: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        });
        // Connect and register everyone first, a bounded number at a time.
        let gate = Arc::new(tokio::sync::Semaphore::new(256));
        let mut setup = tokio::task::JoinSet::new();
        for i in 0..args.pes + args.pus {
            let gate = gate.clone();
            let reg = args.registrar;
            setup.spawn(async move {
                let _permit = gate.acquire().await;
                let conn = connect(reg, i).await?;
                let mut conn = conn;
                if i < args.pes {
                    conn.send(&registration(i, 0)).await?;
                    loop {
                        if let AsapMessage::RegistrationResponse { reject, .. } =
                            conn.recv().await?
                        {
                            if reject {
                                bail!("registration {i} rejected");
                            }
                            break;
                        }
                    }
                }
                Ok::<_, anyhow::Error>((i, conn))
            });
        }
        let mut conns = Vec::with_capacity(args.pes + args.pus);
        while let Some(r) = setup.join_next().await {
            conns.push(r??);
        }
        let pools = args.pes.div_ceil(POOL_SIZE).max(1);
        for (i, conn) in conns {
            let shared = shared.clone();
            if i < args.pes {
                tokio::spawn(pe_task(i, conn, args.rereg_ms, shared));
            } else {
                tokio::spawn(pu_task(i, conn, args.resolve_ms, pools, shared));
            }
        }
        tokio::time::sleep(Duration::from_millis(args.warmup_ms)).await;
        println!("start");
        shared.measuring.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_millis(args.duration_ms)).await;
        shared.measuring.store(false, Ordering::Relaxed);
        let seconds = t0.elapsed().as_secs_f64();
        println!("stop");
        let mut l = shared
            .latencies
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        l.sort_unstable();
        let pct = |q: f64| {
            l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0)
        };
        let r = GenResult {
            p50_us: u64::from(pct(0.50)),
            p99_us: u64::from(pct(0.99)),
            answered: shared.answered.load(Ordering::Relaxed),
            seconds,
            errors: shared.errors.load(Ordering::Relaxed),
        };
        println!("{}", serde_json::to_string(&r)?);
        Ok::<_, anyhow::Error>(())
    })?;
    // Skip tearing down tens of thousands of connections one by one.
    std::process::exit(0)
}

async fn connect(reg: SocketAddr, i: usize) -> Result<AsapConnection> {
    let source = Ipv4Addr::new(127, 0, 0, 1 + (i / CONNS_PER_SOURCE) as u8);
    let sock = TcpSocket::new_v4()?;
    // Reset instead of FIN at exit: no TIME_WAIT holding ports the next point needs.
    sock.set_zero_linger()?;
    sock.bind(SocketAddr::from((source, 0)))?;
    let stream = sock.connect(reg).await?;
    Ok(AsapConnection::from_stream(stream, reg))
}

fn registration(i: usize, round: u64) -> AsapMessage {
    // A new load each time, so every re-registration moves the PE in its pool's LU order.
    let load = ((i as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(round * 40_503)
        % 1000) as f64
        / 1000.0;
    AsapMessage::Registration {
        pool_handle: PoolHandle::from(format!("pool-{}", i / POOL_SIZE).as_str()),
        pool_element: rserpool_wire::PoolElement {
            id: i as u32 + 1,
            home_registrar: 0,
            registration_life: 60,
            user_transport: UserTransport::Address(TransportAddress::tcp(SocketAddr::from((
                Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8),
                8000,
            )))),
            policy: Policy::LeastUsed {
                load: rserpool_wire::policy::load_from_fraction(load),
            },
            asap_transport: None,
        },
    }
}

/// Spreads the first request of each simulated endpoint over one period.
fn phase(i: usize, period_ms: u64) -> Duration {
    Duration::from_millis((i as u64).wrapping_mul(7919) % period_ms.max(1))
}

async fn pe_task(i: usize, mut conn: AsapConnection, period_ms: u64, shared: Arc<Shared>) {
    let period = Duration::from_millis(period_ms.max(1));
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + phase(i, period_ms), period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round = 0;
    loop {
        tick.tick().await;
        round += 1;
        let t0 = Instant::now();
        if conn.send(&registration(i, round)).await.is_err() {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        loop {
            match conn.recv().await {
                Ok(AsapMessage::RegistrationResponse { reject, .. }) => {
                    if reject {
                        shared.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    shared.record(t0);
                    break;
                }
                Ok(AsapMessage::EndpointKeepAlive { pool_handle, .. }) => {
                    let ack = AsapMessage::EndpointKeepAliveAck {
                        pool_handle,
                        pe_id: i as u32 + 1,
                    };
                    let _ = conn.send(&ack).await;
                }
                Ok(_) => {}
                Err(_) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }
}

async fn pu_task(
    i: usize,
    mut conn: AsapConnection,
    period_ms: u64,
    pools: usize,
    shared: Arc<Shared>,
) {
    let period = Duration::from_millis(period_ms.max(1));
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + phase(i, period_ms), period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round = 0usize;
    loop {
        tick.tick().await;
        round += 1;
        let pool = (i + round) % pools;
        let msg = AsapMessage::HandleResolution {
            subscribe: false,
            pool_handle: PoolHandle::from(format!("pool-{pool}").as_str()),
            items: None,
        };
        let t0 = Instant::now();
        if conn.send(&msg).await.is_err() {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match conn.recv().await {
            Ok(AsapMessage::HandleResolutionResponse { error, .. }) => {
                if error.is_some() {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                }
                shared.record(t0);
            }
            _ => {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// `value`, followed by `(range)` when there were several runs.
/// The registrar's CPU, with the range over the runs when there were several.
fn cpu_cell(x: &Sample) -> String {
    spread(
        format!("{:.1}%", x.registrar_cpu * 100.0),
        x.runs > 1,
        format!(
            "{:.1}–{:.1}",
            x.registrar_cpu_min * 100.0,
            x.registrar_cpu_max * 100.0
        ),
    )
}

fn spread(value: String, several: bool, range: String) -> String {
    if several {
        format!("{value} ({range})")
    } else {
        value
    }
}

/// A results section's title, command, machine, date and, with repeated runs, how to read them.
fn section_head(title: &str, samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "### {title}\n");
    s += &provenance();
    let runs = samples.first().map_or(1, |x| x.runs);
    if runs > 1 {
        let _ = writeln!(
            s,
            "Each row is the median of {runs} runs; CPU shows the range over the runs in brackets, p99 the highest run.\n"
        );
    }
    s
}

fn markdown(samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = section_head("Registrar (`rserpool-bench registrar`)", samples);
    let _ = writeln!(
        s,
        "| PEs | PUs | re-reg every (ms) | resolve every (ms) | registrar CPU (1 core = 100%) | RSS (MB) | p50 (µs) | p99 (µs) | offered/s | answered/s | errors | load generator CPU |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for x in samples {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.0} | {:.0} | {} | {:.0}% |",
            x.pes,
            x.pus,
            if x.pes > 0 {
                x.rereg_ms.to_string()
            } else {
                "-".into()
            },
            if x.pus > 0 {
                x.resolve_ms.to_string()
            } else {
                "-".into()
            },
            cpu_cell(x),
            x.rss_bytes as f64 / 1e6,
            x.p50_us,
            spread(x.p99_us.to_string(), x.runs > 1, x.p99_us_max.to_string()),
            x.offered_per_s,
            x.answered_per_s,
            x.errors,
            x.loadgen_cpu * 100.0
        );
    }
    s.push('\n');
    s
}

/// Figure 7 style (CPU against PEs, one line per re-registration interval) and Figure 8 style
/// (CPU against PUs, one line per resolution interval).
fn plot(samples: &[Sample], prefix: &str) -> Result<()> {
    let mut by_a: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
    let mut by_b: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
    for s in samples {
        if s.pus == 0 {
            by_a.entry(s.rereg_ms)
                .or_default()
                .push((s.pes as f64, s.registrar_cpu * 100.0));
        } else if s.pes == 1000 {
            by_b.entry(s.resolve_ms)
                .or_default()
                .push((s.pus as f64, s.registrar_cpu * 100.0));
        }
    }
    let series = |m: std::collections::BTreeMap<u64, Vec<(f64, f64)>>, what: &str| {
        m.into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                (format!("{what} = {k} ms"), v)
            })
            .collect::<Vec<_>>()
    };
    let a = series(by_a, "re-registration a");
    if !a.is_empty() {
        plot::lines(
            &format!("{prefix}-pes.png"),
            "Registrar CPU against pool elements (seed Fig. 7 left)",
            "pool elements (log scale)",
            "registrar CPU, % of one core",
            &a,
            true,
        )?;
    }
    let b = series(by_b, "resolution b");
    if !b.is_empty() {
        plot::lines(
            &format!("{prefix}-pus.png"),
            "Registrar CPU against pool users, 1,000 PEs (seed Fig. 8 left)",
            "pool users",
            "registrar CPU, % of one core",
            &b,
            false,
        )?;
    }
    Ok(())
}

/// Figure 7 right: the home registrar's and a synchronising registrar's CPU against K.
fn cluster_markdown(samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = section_head(
        "Registrar cluster (`rserpool-bench registrar --figure 7r`)",
        samples,
    );
    let _ = writeln!(
        s,
        "K registrars in one ENRP cluster on this host, all PEs registered at the first (home), which sends every change to the K - 1 others. All K registrars and the load generator share the 2 cores.\n"
    );
    let _ = writeln!(
        s,
        "| K | PEs | re-reg every (ms) | home registrar CPU | home CPU / K = 1 | synchronising registrar CPU | p99 (µs) | answered/s | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for x in samples {
        let base = samples
            .iter()
            .find(|b| b.registrars == 1 && b.rereg_ms == x.rereg_ms && b.pes == x.pes)
            .map(|b| b.registrar_cpu);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {} |",
            x.registrars,
            x.pes,
            x.rereg_ms,
            cpu_cell(x),
            base.map_or("-".into(), |b| format!("{:.2}×", x.registrar_cpu / b)),
            x.sync_cpu
                .map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
            x.p99_us,
            x.answered_per_s,
            x.errors
        );
    }
    s.push('\n');
    s
}

fn cluster_plot(samples: &[Sample], prefix: &str) -> Result<()> {
    let mut series: std::collections::BTreeMap<(u64, u8), Vec<(f64, f64)>> = Default::default();
    for s in samples {
        let k = f64::from(s.registrars);
        series
            .entry((s.rereg_ms, 0))
            .or_default()
            .push((k, s.registrar_cpu * 100.0));
        if let Some(c) = s.sync_cpu {
            series
                .entry((s.rereg_ms, 1))
                .or_default()
                .push((k, c * 100.0));
        }
    }
    let lines: Vec<(String, Vec<(f64, f64)>)> = series
        .into_iter()
        .map(|((a, kind), mut v)| {
            v.sort_by(|x, y| x.0.total_cmp(&y.0));
            let who = if kind == 0 { "home" } else { "synchronising" };
            (format!("{who}, a = {a} ms"), v)
        })
        .collect();
    plot::lines(
        &format!("{prefix}-cluster.png"),
        "Registrar CPU against registrars in the cluster, 1,000 PEs (seed Fig. 7 right)",
        "registrars K",
        "registrar CPU, % of one core",
        &lines,
        false,
    )
}
