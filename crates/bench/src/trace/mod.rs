//! `rserpool-bench trace`: the comparison (docs/CREDITS.md) of selection schemes on a replayed
//! Wikipedia-like trace, after salbnet (seed `salbnet-credit-based-slb.txt`).
//!
//! Three `rserpool example http` back ends with 2, 4 and 8 workers (capacities 1 : 2 : 4; each
//! worker serves one connection at a time and closes it, further connections wait in the
//! accept queue of `--backlog`), a registrar, and in front either `rserpool proxy` (with the
//! PEs' policy, or a proxy-local selection) or HAProxy. The trace ([`wiki`]) is replayed open
//! loop ([`replay`]) at each scale factor; a request's cost (sleep) and size come from its URL,
//! scaled so that the largest factor offers `--utilisation` of the pool's capacity.
//!
//! Reported per factor and scheme: requests, errors, first response time (mean, p50, p99,
//! max), the normalised first response time (mean of first response time / service time),
//! salbnet's penalty p_ISP = (mean / max first response time) × (errors / requests), the
//! selection's reports per second (re-registrations at the registrar; HAProxy's agent polls),
//! and the CPU the back ends (and `serve` sidecars) used.

mod args;
mod render;
mod replay;
mod results;
mod scheme;
mod wiki;

pub use args::TraceArgs;
use results::{Row, Run};
use scheme::Scheme;

use crate::net::{free_port, local, registrar_status};
use crate::process::{Proc, raise_nofile_limit, wait_for};
use crate::{procfs, report};
use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn parse_factor(s: &str) -> Result<f64> {
    let v = match s.split_once('/') {
        Some((a, b)) => a.trim().parse::<f64>()? / b.trim().parse::<f64>()?,
        None => s.trim().parse::<f64>()?,
    };
    if !(v > 0.0 && v <= 1.0) {
        bail!("factor {s} is not in (0, 1]");
    }
    Ok(v)
}

pub fn run(args: TraceArgs, bin: &Path) -> Result<()> {
    let schemes = args
        .schemes
        .iter()
        .map(|s| Scheme::parse(s))
        .collect::<Result<Vec<_>>>()?;
    let factors = args
        .factors
        .iter()
        .map(|f| Ok((f.clone(), parse_factor(f)?)))
        .collect::<Result<Vec<_>>>()?;
    if args.workers.is_empty() || args.workers.contains(&0) {
        bail!("--workers needs positive worker counts");
    }
    if args.seeds.is_empty() || args.bursts.is_empty() {
        bail!("--seeds and --bursts need at least one value each");
    }
    if args.bursts.iter().any(|b| !(0.0..1.0).contains(b)) {
        bail!("--bursts are amplitudes in [0, 1)");
    }
    if schemes.iter().any(|s| s.haproxy()) && Command::new("haproxy").arg("-v").output().is_err() {
        bail!("the HAProxy schemes need haproxy (apt-get install -y haproxy)");
    }
    raise_nofile_limit(65_536);
    let dir =
        TempDir(std::env::temp_dir().join(format!("rserpool-bench-trace-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    let dir = &dir.0;
    let duration = args.duration_s as f64;
    let mut runs = Vec::new();
    for &burst in &args.bursts {
        for &seed in &args.seeds {
            let trace = match &args.trace {
                Some(p) => p.clone(),
                None => {
                    let p = dir.join(format!("wiki-{seed}-{burst}.trace"));
                    let n = wiki::generate(&p, duration, args.rate, burst, seed)?;
                    println!(
                        "synthetic trace (seed {seed}, burst ±{burst}): {n} requests in {} s",
                        args.duration_s
                    );
                    p
                }
            };
            // Costs scaled so that the largest factor offers `utilisation` of the pool's
            // worker time.
            let largest = factors.iter().map(|f| f.1).fold(0.0, f64::max);
            let busiest = wiki::read(&trace, largest, duration)?;
            let worker_us: f64 = args.workers.iter().sum::<usize>() as f64 * duration * 1e6;
            let cost_sum: f64 = busiest.iter().map(|e| wiki::work(&e.url).0).sum();
            let scale = args.utilisation * worker_us / cost_sum.max(1.0);
            let mean_cost_ms = cost_sum * scale / busiest.len().max(1) as f64 / 1000.0;
            println!(
                "costs scaled by {scale:.3}: mean service time {mean_cost_ms:.1} ms at factor {largest}"
            );
            let mut offered = Vec::new();
            for (_, f) in &factors {
                let entries = wiki::read(&trace, *f, duration)?;
                let cost: f64 = entries.iter().map(|e| wiki::work(&e.url).0 * scale).sum();
                offered.push((entries.len() as f64 / duration, cost / worker_us));
            }
            let mut results = Vec::new();
            for &scheme in &schemes {
                println!("== {} (seed {seed}, burst ±{burst})", scheme.name());
                let rows = run_scheme(scheme, &args, &factors, &trace, scale, bin, dir)
                    .with_context(|| format!("scheme {}", scheme.name()))?;
                results.push((scheme, rows));
            }
            runs.push(Run {
                burst,
                seed,
                offered,
                mean_cost_ms,
                results,
            });
        }
    }
    let mut text = String::new();
    if runs.len() == 1 {
        text.push_str(&render::single(&args, &factors, &runs[0]));
    } else {
        text.push_str(&render::matrix(&args, &factors, &runs));
    }
    text.push_str(&render::targets(&factors, &runs));
    text.push_str(&render::disruption(&schemes));
    print!("{text}");
    if let Some(dir) = &args.plots {
        render::plots(dir, &factors, &runs[0].results)?;
    }
    if let Some(path) = &args.markdown {
        report::write_section(
            path,
            &args.section,
            &format!("{}{text}", report::provenance()),
        )?;
        println!("written into {}", path.display());
    }
    Ok(())
}

/// The logs and files of a run, removed at its end (also when it fails).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run_scheme(
    scheme: Scheme,
    args: &TraceArgs,
    factors: &[(String, f64)],
    trace: &Path,
    scale: f64,
    bin: &Path,
    dir: &Path,
) -> Result<Vec<Row>> {
    let (registrar, reg, reg_status) = crate::product::start_registrar(bin, dir)?;
    let mut procs = vec![registrar];
    let pool = "TracePool";
    let mut backends = Vec::new();
    let mut measured = Vec::new();
    for (i, &w) in args.workers.iter().enumerate() {
        let addr = local(free_port()?);
        let p = Proc::spawn(
            crate::product::command(bin)
                .args(["example", "http", "--listen", &addr.to_string()])
                .args(["--workers", &w.to_string()])
                .args(["--backlog", &args.backlog.to_string()])
                .args(["--pool", pool, "--id", &(i + 1).to_string()])
                .args(["--registrar", &reg.to_string()])
                .args(scheme.pe_flags(w)),
            &dir.join(format!("pe{}.log", i + 1)),
        )?;
        measured.push(p.id());
        procs.push(p);
        backends.push((addr, w));
    }
    wait_for("the PEs registered", Duration::from_secs(10), || {
        registrar_status(reg_status).is_ok_and(|s| s.pool_elements == backends.len())
    })?;
    let front = local(free_port()?);
    let mut agent_polls_per_s = 0.0;
    let counters = if scheme.haproxy() {
        let (balance, weighted) = scheme.haproxy_balance();
        let mut servers = String::new();
        for (i, &(addr, w)) in backends.iter().enumerate() {
            let weight = if weighted { w * 10 } else { 10 };
            let _ = write!(servers, "    server s{} {addr} weight {weight}", i + 1);
            if scheme == Scheme::HaproxyAgent {
                let agent = local(free_port()?);
                let p = Proc::spawn(
                    crate::product::command(bin)
                        .args(["serve", "--target", &addr.to_string()])
                        .args(["--pool", "TraceAgents", "--policy", "credits"])
                        .args(["--capacity", &w.to_string(), "--credit-reporting", "dpr"])
                        .args(["--agent", &agent.to_string()])
                        .args(["--registrar", &reg.to_string()]),
                    &dir.join(format!("serve{}.log", i + 1)),
                )?;
                measured.push(p.id());
                procs.push(p);
                wait_for("the agent", Duration::from_secs(10), || {
                    std::net::TcpStream::connect(agent).is_ok()
                })?;
                let _ = write!(
                    servers,
                    " agent-check agent-addr {} agent-port {} agent-inter 100ms",
                    agent.ip(),
                    agent.port()
                );
                agent_polls_per_s += 10.0;
            }
            servers.push('\n');
        }
        let socket = dir.join("haproxy.sock");
        let cfg = format!(
            "global\n    nbthread 2\n    maxconn 8000\n    stats socket {} mode 600 level admin\n\
             defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n    retries 3\n    option redispatch\n\
             frontend web\n    bind {front}\n    default_backend pool\n\
             backend pool\n    balance {balance}\n{servers}",
            socket.display()
        );
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, cfg)?;
        procs.push(Proc::spawn(
            Command::new("haproxy").arg("-db").arg("-f").arg(&path),
            &dir.join("haproxy.log"),
        )?);
        Counters::Haproxy(socket)
    } else {
        // A request may wait for credit as long as a connection may wait in a back end's
        // accept queue here: until the client's timeout, less a margin.
        // Hashing selections hash the page (X-Page), as a cache-affine deployment would.
        let status = local(free_port()?);
        let cfg = format!(
            "registrars = [\"{reg}\"]\nstatus = \"{status}\"\n\
             [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"{pool}\"\n\
             [pool.{pool}]\nselect = \"{}\"\nhash-key = \"header:x-page\"\nqueue-timeout-ms = {}\nqueue = 8192\n",
            scheme.select(),
            args.timeout_s * 1000 / 2
        );
        let path = dir.join("proxy.toml");
        std::fs::write(&path, cfg)?;
        procs.push(Proc::spawn(
            crate::product::command(bin)
                .arg("proxy")
                .arg("--config")
                .arg(&path),
            &dir.join("proxy.log"),
        )?);
        Counters::Proxy(status)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // Ready when the front answers (the PEs were registered before it started; a credits
    // pool at rest sends everything to its largest PE), then a second for HAProxy's agent
    // polls and the proxy's subscription.
    let ready = Instant::now();
    while rt.block_on(pe_of_answer(front)).is_none() {
        if ready.elapsed() > Duration::from_secs(15) {
            bail!("the front does not answer");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let mut rows = Vec::new();
    for (name, f) in factors {
        let entries = wiki::read(trace, *f, args.duration_s as f64)?;
        let requests: Vec<replay::Request> = entries
            .iter()
            .map(|e| {
                let (us, bytes) = wiki::work(&e.url);
                let cost_us = (us * scale).round().max(1.0) as u64;
                replay::Request {
                    at: Duration::from_secs_f64(e.at),
                    path: format!("/work?us={cost_us}&bytes={bytes}&r={}", e.seq),
                    page: e.url.clone(),
                    cost_us,
                }
            })
            .collect();
        let before = registrar_status(reg_status)?.counters.reregistrations;
        let cpu_before: u64 = measured
            .iter()
            .filter_map(|&p| procfs::cpu_ns(p).ok())
            .sum();
        let (retries_before, ejections_before) = rt.block_on(counters.read());
        let t0 = Instant::now();
        let (outcomes, late) = rt.block_on(replay::replay(
            front,
            requests,
            Duration::from_secs(args.timeout_s),
        ));
        let took = t0.elapsed().as_secs_f64();
        let cpu: u64 = measured
            .iter()
            .filter_map(|&p| procfs::cpu_ns(p).ok())
            .sum();
        let after = registrar_status(reg_status)?.counters.reregistrations;
        let reports = if scheme == Scheme::HaproxyAgent {
            agent_polls_per_s
        } else if scheme.haproxy() {
            0.0
        } else {
            (after - before) as f64 / took
        };
        let (retries, ejections) = rt.block_on(counters.read());
        let mut row = results::summarise(
            &outcomes,
            reports,
            (cpu - cpu_before) as f64 / took / 1e7,
            late,
        );
        row.retries = retries - retries_before;
        row.ejections = ejections - ejections_before;
        println!(
            "  {name}: {} requests, {} errors, p99 {:.1} ms, p_ISP {:.2e}, {} retries, {} ejections",
            row.requests, row.errors, row.p99_ms, row.penalty, row.retries, row.ejections
        );
        rows.push(row);
        // Queues drain before the next factor.
        std::thread::sleep(Duration::from_secs(3));
    }
    drop(procs);
    Ok(rows)
}

/// The PE (its `X-Pe-Id`) that answered a plain GET through `front`.
async fn pe_of_answer(front: SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(front).await.ok()?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut v = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut v))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&v);
    // HAProxy sends header names in lower case.
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("x-pe-id")
            .then(|| v.trim().to_string())
    })
}

/// Where a front's retries and ejections are read.
enum Counters {
    /// `rserpool proxy`'s status listener (its metrics).
    Proxy(SocketAddr),
    /// HAProxy's stats socket.
    Haproxy(PathBuf),
}

impl Counters {
    /// (retries, ejections) so far; zeros when they cannot be read.
    async fn read(&self) -> (f64, f64) {
        match self {
            Self::Proxy(status) => {
                let Ok((200, body)) = rserpool_status::get(*status, "/metrics").await else {
                    return (0.0, 0.0);
                };
                let text = String::from_utf8_lossy(&body);
                let sum = |name: &str| -> f64 {
                    text.lines()
                        .filter(|l| {
                            l.strip_prefix(name)
                                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
                        })
                        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                        .sum()
                };
                (
                    sum("rserpool_proxy_failovers_total") + sum("rserpool_proxy_pe_busy_total"),
                    sum("rserpool_proxy_ejections_total"),
                )
            }
            Self::Haproxy(socket) => (haproxy_retries(socket).unwrap_or(0.0), 0.0),
        }
    }
}

/// The backend's retries and redispatches, from HAProxy's `show stat`.
fn haproxy_retries(socket: &Path) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).ok()?;
    s.write_all(b"show stat\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next()?.trim_start_matches("# ").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (sv, retr, redis) = (col("svname")?, col("wretr")?, col("wredis")?);
    let row = lines.find(|l| l.split(',').nth(sv) == Some("BACKEND"))?;
    let f: Vec<&str> = row.split(',').collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    Some(n(retr) + n(redis))
}
