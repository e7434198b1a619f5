//! The service-levels benchmark: the seed's Figure 3 (`differentiated-services-clusters`,
//! §5) on this machine, beside HAProxy's strict priority classes and a plain FIFO queue.
//!
//! Two open-loop clients (Poisson arrivals), each offering the same rate, overload a pool of
//! two `rserpool example http` PEs that take one request at a time and spend a CPU cost on
//! it (1 KB responses). Client 2 (source 127.0.0.3) is always level 1; client 1 (source
//! 127.0.0.2) is level 1, 3, 5, 7, 9 in turn. The proxy limits each PE to one request in
//! flight (`max-conn = 1`), so everything beyond waits in its admission queue, served by
//! lottery over the levels' tickets. The same load then goes through HAProxy with
//! `http-request set-priority-class` (client 1 ahead) and `maxconn 1` per server, and
//! through the proxy without levels (one FIFO queue).

use crate::net::{free_port, local, registrar_status};
use crate::process::{Proc, raise_nofile_limit, wait_for};
use crate::{plot, procfs, report};
use anyhow::{Result, bail};
use clap::Args;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_asap::share::{Discipline, Domain, Share};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Args, Debug)]
pub struct LevelsArgs {
    /// Client 1's levels, one point each (client 2 is always level 1).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 3, 5, 7, 9])]
    pub levels: Vec<usize>,
    /// Seconds each client sends per point.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// CPU time a request costs at its PE, µs.
    #[arg(long, default_value_t = 4000)]
    pub cpu_us: u64,
    /// Each client's offered rate as a share of the pool's nominal capacity (2 PEs × 1 /
    /// cost). 0.5: together they overload the pool, but level 9's share could carry client
    /// 1 alone; 1.0: either client alone overloads it (sustained overload).
    #[arg(long, default_value_t = 0.5)]
    pub load: f64,
    /// Requests in flight per PE (the proxy's `max-conn`, HAProxy's `maxconn`); the PE's one
    /// worker serves its own queue by level too.
    #[arg(long, default_value_t = 2)]
    pub max_conn: u32,
    /// The proxy's queue timeout (and HAProxy's `timeout queue`), ms.
    #[arg(long, default_value_t = 5000)]
    pub queue_timeout_ms: u64,
    /// The proxy's scheduler over levels.
    #[arg(long, default_value = "lottery")]
    pub scheduler: String,
    /// Also run HAProxy's strict classes and the FIFO proxy.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub compare: bool,
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    #[arg(long)]
    pub plots: Option<PathBuf>,
}

const CLIENT1: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const CLIENT2: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const POOL: &str = "LevelsPool";
/// `max-conn` of the comparison without a queue in the proxy: more than the run ever has in
/// flight, so every request goes on to a PE at once and waits in the PE's own queue.
const UNQUEUED_MAX_CONN: u32 = 100_000;
/// The plots' label of that comparison.
const UNQUEUED: &str = "no proxy queue";

/// One client's results at one point.
#[derive(Debug, Clone, Default)]
struct ClientRow {
    sent: usize,
    ok: usize,
    refused: usize,
    mean_ms: f64,
    p99_ms: f64,
    per_s: f64,
}

struct Point {
    name: String,
    /// The plots' group label.
    short: String,
    clients: [ClientRow; 2],
    /// The front's CPU per request, µs.
    front_us: f64,
}

pub fn run(args: LevelsArgs, bin: &Path) -> Result<()> {
    if args.levels.iter().any(|&l| !(1..=9).contains(&l)) {
        bail!("--levels: levels are 1 ..= 9");
    }
    if !["lottery", "stride"].contains(&args.scheduler.as_str()) {
        bail!("--scheduler: lottery or stride");
    }
    let haproxy = args.compare && Command::new("haproxy").arg("-v").output().is_ok();
    if args.compare && !haproxy {
        println!("haproxy not found (apt-get install -y haproxy): its column is left out");
    }
    raise_nofile_limit(65_536);
    let dir = std::env::temp_dir().join(format!("rserpool-bench-levels-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run_in(&args, bin, &dir, haproxy);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(args: &LevelsArgs, bin: &Path, dir: &Path, haproxy: bool) -> Result<()> {
    let (registrar, reg, reg_status) = crate::product::start_registrar(bin, dir)?;
    let mut procs = vec![registrar];
    let mut pes = Vec::new();
    for i in 1..=2 {
        let addr = local(free_port()?);
        procs.push(Proc::spawn(
            crate::product::command(bin)
                .args(["example", "http", "--listen", &addr.to_string()])
                .args(["--workers", "1", "--levels", "9"])
                .args(["--pool", POOL, "--id", &i.to_string()])
                .args(["--registrar", &reg.to_string(), "--policy", "rr"]),
            &dir.join(format!("pe{i}.log")),
        )?);
        pes.push(addr);
    }
    wait_for("the PEs registered", Duration::from_secs(10), || {
        registrar_status(reg_status).is_ok_and(|s| s.pool_elements == 2)
    })?;
    let capacity = 2.0 * 1e6 / args.cpu_us as f64;
    let rate = args.load * capacity;
    println!(
        "pool: 2 PEs × 1 worker, {} in flight each, {} µs CPU per request: {capacity:.0} requests/s nominal; \
         each client offers {rate:.0}/s for {} s",
        args.max_conn, args.cpu_us, args.duration_s
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut points = Vec::new();
    let mut run_point = |name: String, short: &str, front: SocketAddr, pid: u32| -> Result<()> {
        wait_for("the front answers", Duration::from_secs(15), || {
            rt.block_on(one(front, CLIENT2, "/work?bytes=16"))
                .is_some_and(|r| r.0 == 200)
        })?;
        std::thread::sleep(Duration::from_millis(500));
        let cpu0 = procfs::cpu_ns(pid).unwrap_or(0);
        let clients = rt.block_on(load(front, rate, args));
        let cpu = procfs::cpu_ns(pid).unwrap_or(0).saturating_sub(cpu0);
        let requests = (clients[0].sent + clients[1].sent).max(1);
        let p = Point {
            name,
            short: short.to_string(),
            front_us: cpu as f64 / requests as f64 / 1e3,
            clients,
        };
        println!(
            "  {}: client 1 mean {:.0} ms, {:.0}/s; client 2 mean {:.0} ms, {:.0}/s",
            p.name,
            p.clients[0].mean_ms,
            p.clients[0].per_s,
            p.clients[1].mean_ms,
            p.clients[1].per_s
        );
        points.push(p);
        // Queues drain before the next point.
        std::thread::sleep(Duration::from_secs(2));
        Ok(())
    };
    for &level in &args.levels {
        let (front, p) = proxy(bin, dir, reg, args, Some(level), args.max_conn)?;
        let short = format!("level {level}");
        run_point(
            format!("levels, client 1 at {level}"),
            &short,
            front,
            p.id(),
        )?;
        drop(p);
    }
    if args.compare {
        let (front, p) = proxy(bin, dir, reg, args, None, args.max_conn)?;
        run_point("FIFO (no levels)".into(), "FIFO", front, p.id())?;
        drop(p);
        // The same load and levels with nothing queued in the proxy: what the proxy's CPU per
        // request is without its queue, at the same rate (the wake-ups per request of a
        // lightly loaded proxy are a cost of the rate, not of queueing).
        let level = args.levels.first().copied();
        let (front, p) = proxy(bin, dir, reg, args, level, UNQUEUED_MAX_CONN)?;
        let name = format!(
            "levels, client 1 at {}, no queue in the proxy (max-conn {UNQUEUED_MAX_CONN})",
            level.unwrap_or(1)
        );
        run_point(name, UNQUEUED, front, p.id())?;
        drop(p);
    }
    if haproxy {
        let front = local(free_port()?);
        let path = dir.join("haproxy.cfg");
        std::fs::write(
            &path,
            format!(
                "global\n    nbthread 2\n    maxconn 8000\n\
                 defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n    timeout queue {}ms\n\
                 frontend web\n    bind {front}\n    http-request set-priority-class int(-10) if {{ src {CLIENT1} }}\n    default_backend pool\n\
                 backend pool\n    balance roundrobin\n    server s1 {} maxconn {}\n    server s2 {} maxconn {}\n",
                args.queue_timeout_ms, pes[0], args.max_conn, pes[1], args.max_conn
            ),
        )?;
        let p = Proc::spawn(
            Command::new("haproxy").arg("-db").arg("-f").arg(&path),
            &dir.join("haproxy.log"),
        )?;
        run_point("HAProxy priority classes".into(), "HAProxy", front, p.id())?;
        drop(p);
    }
    drop(procs);
    let cost = admission_cost()?;
    let text = render(args, capacity, rate, &points, cost);
    print!("{text}");
    if let Some(d) = &args.plots {
        plot_points(d, &points, args.load)?;
    }
    if let Some(path) = &args.markdown {
        // One section per offered load, so that runs at several loads stand side by side.
        let section = format!("levels load {}", args.load);
        report::write_section(path, &section, &format!("{}{text}", report::provenance()))?;
        println!("written into {}", path.display());
    }
    Ok(())
}

/// A proxy in front of the pool, with client 1 at `level` (or without levels).
fn proxy(
    bin: &Path,
    dir: &Path,
    reg: SocketAddr,
    args: &LevelsArgs,
    level: Option<usize>,
    max_conn: u32,
) -> Result<(SocketAddr, Proc)> {
    let front = local(free_port()?);
    let mut cfg = format!(
        "registrars = [\"{reg}\"]\nrefresh-ms = 200\n\
         [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"{POOL}\"\n\
         [pool.{POOL}]\nmax-conn = {max_conn}\nqueue = 100000\nqueue-timeout-ms = {}\n",
        args.queue_timeout_ms
    );
    if let Some(l) = level {
        let _ = write!(
            cfg,
            "[levels]\nscheduler = \"{}\"\n[[levels.rule]]\nsource = \"{CLIENT1}\"\nlevel = {l}\n",
            args.scheduler
        );
    }
    let path = dir.join("proxy.toml");
    std::fs::write(&path, cfg)?;
    let p = Proc::spawn(
        crate::product::command(bin)
            .arg("proxy")
            .arg("--config")
            .arg(&path),
        &dir.join("proxy.log"),
    )?;
    Ok((front, p))
}

/// Both clients at `rate` each for the duration; their rows.
async fn load(front: SocketAddr, rate: f64, args: &LevelsArgs) -> [ClientRow; 2] {
    let duration = Duration::from_secs(args.duration_s);
    let path = format!("/work?cpu_us={}&bytes=1024", args.cpu_us);
    let timeout = Duration::from_millis(args.queue_timeout_ms) * 2 + Duration::from_secs(5);
    let mut handles = Vec::new();
    for (i, src) in [CLIENT1, CLIENT2].into_iter().enumerate() {
        let path = path.clone();
        handles.push(tokio::spawn(async move {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(17 + i as u64);
            let start = tokio::time::Instant::now();
            let mut at = Duration::ZERO;
            let mut tasks = Vec::new();
            loop {
                // Poisson arrivals: exponential gaps.
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                at += Duration::from_secs_f64(-(1.0 - u).ln() / rate);
                if at >= duration {
                    break;
                }
                tokio::time::sleep_until(start + at).await;
                let path = path.clone();
                tasks.push(tokio::spawn(async move {
                    let t = Instant::now();
                    let r = tokio::time::timeout(timeout, one(front, src, &path)).await;
                    (r.ok().flatten(), t.elapsed(), tokio::time::Instant::now())
                }));
            }
            let mut lat = Vec::new();
            let mut row = ClientRow::default();
            let mut in_window = 0usize;
            for t in tasks {
                row.sent += 1;
                match t.await {
                    Ok((Some((200, _)), took, done)) => {
                        row.ok += 1;
                        lat.push(took.as_secs_f64() * 1e3);
                        if done.saturating_duration_since(start) <= duration {
                            in_window += 1;
                        }
                    }
                    Ok((Some((503, _)), _, _)) => row.refused += 1,
                    _ => {}
                }
            }
            lat.sort_by(f64::total_cmp);
            if !lat.is_empty() {
                row.mean_ms = lat.iter().sum::<f64>() / lat.len() as f64;
                row.p99_ms = lat[((lat.len() as f64 * 0.99) as usize).min(lat.len() - 1)];
            }
            // Served per second while both clients send (both are backlogged then).
            row.per_s = in_window as f64 / duration.as_secs_f64();
            row
        }));
    }
    let mut rows: [ClientRow; 2] = Default::default();
    for (i, h) in handles.into_iter().enumerate() {
        rows[i] = h.await.unwrap_or_default();
    }
    rows
}

/// One request from `src` on a new connection: its status and body length.
async fn one(front: SocketAddr, src: Ipv4Addr, path: &str) -> Option<(u16, usize)> {
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    sock.bind(SocketAddr::new(IpAddr::V4(src), 0)).ok()?;
    let mut s = sock.connect(front).await.ok()?;
    let _ = s.set_nodelay(true);
    let req = format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut got = Vec::with_capacity(2048);
    s.read_to_end(&mut got).await.ok()?;
    let head_end = got.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let status = std::str::from_utf8(got.get(9..12)?).ok()?.parse().ok()?;
    Some((status, got.len() - head_end))
}

/// What admission costs per request: the scheduler alone (9 levels waiting; set waiting,
/// draw, serve, charge) for lottery and stride, ns; and the proxy's whole admission path on
/// one thread (50 clients through two PEs, task wakeups included), µs: every request queued
/// with 9 levels, every request queued in one FIFO, and the fast path (no limit, no queue).
struct Cost {
    lottery_ns: f64,
    stride_ns: f64,
    queued_levels_us: f64,
    queued_fifo_us: f64,
    fast_us: f64,
}

fn admission_cost() -> Result<Cost> {
    let domains: Vec<Domain> = (1..=9).map(Domain::default_for).collect();
    let [lottery_ns, stride_ns] = [Discipline::Lottery, Discipline::Stride].map(|d| {
        let mut s = Share::new(&domains, d, Duration::from_secs(1), 5);
        let n = 2_000_000u32;
        let t0 = Instant::now();
        let mut now = t0;
        for i in 0..n {
            let l = (i % 9) as usize;
            s.set_waiting(l, true);
            if i % 64 == 0 {
                now = Instant::now();
            }
            if let Some(pick) = s.peek(now) {
                s.served(pick);
                s.consumed(pick, Duration::from_micros(100), now);
                s.set_waiting(pick, false);
            }
        }
        t0.elapsed().as_nanos() as f64 / f64::from(n)
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let us = |levels, limited| {
        let d = rt.block_on(rserpool_proxy::balance::pools::admission_cost(
            levels, limited, 50, 20_000,
        ));
        d.as_nanos() as f64 / 1e3
    };
    Ok(Cost {
        lottery_ns,
        stride_ns,
        queued_levels_us: us(Some(9), true),
        queued_fifo_us: us(None, true),
        fast_us: us(Some(9), false),
    })
}

fn render(args: &LevelsArgs, capacity: f64, rate: f64, points: &[Point], cost: Cost) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Pool: 2 × `rserpool example http --workers 1 --levels 9`, {} µs of CPU per request \
         (`/work?cpu_us={}&bytes=1024`), so {capacity:.0} requests/s nominal. Two open-loop \
         clients (Poisson), {rate:.0} requests/s each for {} s; client 2 (source {CLIENT2}) at \
         level 1, client 1 (source {CLIENT1}) at the level of the row. Requests in flight \
         per PE at most {} (`max-conn`, HAProxy `maxconn`); queue timeout {} ms; scheduler {}. \
         Response time is from connect to the last byte, of the requests answered 200; \
         *served/s* counts those answered while both clients were sending (both backlogged); \
         *refused* are 503s (queue timeout).\n",
        args.cpu_us,
        args.cpu_us,
        args.duration_s,
        args.max_conn,
        args.queue_timeout_ms,
        args.scheduler
    );
    let _ = writeln!(
        s,
        "| front | client 1 mean / p99 ms | client 1 served/s | client 1 refused | client 2 mean / p99 ms | client 2 served/s | client 2 refused | client 1 : client 2 mean | front CPU µs/request |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for p in points {
        let [a, b] = &p.clients;
        let _ = writeln!(
            s,
            "| {} | {:.0} / {:.0} | {:.1} | {} | {:.0} / {:.0} | {:.1} | {} | {:.2} | {:.1} |",
            p.name,
            a.mean_ms,
            a.p99_ms,
            a.per_s,
            a.refused,
            b.mean_ms,
            b.p99_ms,
            b.per_s,
            b.refused,
            a.mean_ms / b.mean_ms.max(1e-9),
            p.front_us
        );
    }
    let _ = writeln!(
        s,
        "\nAdmission per request, one thread: the scheduler alone (9 levels waiting) lottery \
         {:.0} ns, stride {:.0} ns; the proxy's whole admission path (50 clients through two \
         PEs, task wakeups included) {:.2} µs when every request queues among 9 levels, {:.2} µs \
         when every request queues in one FIFO, {:.2} µs on the fast path (nobody waits).\n",
        cost.lottery_ns, cost.stride_ns, cost.queued_levels_us, cost.queued_fifo_us, cost.fast_us
    );
    let queued = points.first().map(|p| p.front_us);
    let unqueued = points
        .iter()
        .find(|p| p.short == UNQUEUED)
        .map(|p| p.front_us);
    if let (Some(q), Some(u)) = (queued, unqueued)
        && u > 0.0
    {
        let _ = writeln!(
            s,
            "The front's CPU per request at this load, queued in the proxy (the first row) \
             against nothing queued in it (max-conn {UNQUEUED_MAX_CONN}): {q:.1} / {u:.1} µs = \
             {:.2}× (target ≤ 1.3×: {}).\n",
            q / u,
            if q / u <= 1.3 { "met" } else { "**not met**" }
        );
    }
    s
}

fn plot_points(dir: &Path, points: &[Point], load: f64) -> Result<()> {
    let groups: Vec<String> = points.iter().map(|p| p.short.clone()).collect();
    let series = vec![
        (
            "client 1".to_string(),
            points.iter().map(|p| p.clients[0].mean_ms).collect(),
        ),
        (
            "client 2 (level 1)".to_string(),
            points.iter().map(|p| p.clients[1].mean_ms).collect(),
        ),
    ];
    plot::bars(
        &dir.join(format!("bench-levels-mean-{load}.png"))
            .to_string_lossy(),
        "Mean response time by client",
        "ms",
        &groups,
        &series,
    )?;
    let served = vec![
        (
            "client 1".to_string(),
            points.iter().map(|p| p.clients[0].per_s).collect(),
        ),
        (
            "client 2 (level 1)".to_string(),
            points.iter().map(|p| p.clients[1].per_s).collect(),
        ),
    ];
    plot::bars(
        &dir.join(format!("bench-levels-served-{load}.png"))
            .to_string_lossy(),
        "Requests served per second by client",
        "requests/s",
        &groups,
        &served,
    )
}
