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

mod replay;
mod wiki;

use crate::net::{free_port, local, registrar_status};
use crate::process::{Proc, raise_nofile_limit, wait_for};
use crate::{plot, procfs, report};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SCHEMES: &str =
    "rr,wrr,lu,least-connections,p2c,prequal,dpr,dpr-q,haproxy-leastconn,haproxy-agent";

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Schemes to compare (comma-separated), of: rr, wrr, lu, least-connections, p2c, prequal,
    /// dpr, dpr-q, haproxy-leastconn, haproxy-agent.
    #[arg(long, value_delimiter = ',', default_value = SCHEMES)]
    pub schemes: Vec<String>,
    /// Scale factors of the trace (fractions of its requests replayed).
    #[arg(long, value_delimiter = ',', default_value = "1/32,1/16,1/8")]
    pub factors: Vec<String>,
    /// Seconds of trace replayed per factor and scheme.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// Workers of each back end: their capacities.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub workers: Vec<usize>,
    /// Accept queue of each back end.
    #[arg(long, default_value_t = 64)]
    pub backlog: u32,
    /// Share of the pool's capacity the largest factor offers (costs are scaled to it).
    #[arg(long, default_value_t = 0.9)]
    pub utilisation: f64,
    /// Replay this wikibench trace file instead of a synthetic one.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synthetic trace: mean requests/s at factor 1 (2,640 makes the seed's 82.6 / 165 /
    /// 330 requests/s at 1/32, 1/16, 1/8).
    #[arg(long, default_value_t = 2640.0)]
    pub rate: f64,
    /// Synthetic trace: burst amplitude (rate alternates between 1 ± this times the mean).
    #[arg(long, default_value_t = 0.25)]
    pub burst: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A request not answered in full within this is an error.
    #[arg(long, default_value_t = 10)]
    pub timeout_s: u64,
    /// Write the results as a Markdown section into this file (e.g. docs/CREDITS.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write the plots (PNG) into this directory (e.g. docs).
    #[arg(long)]
    pub plots: Option<PathBuf>,
}

/// One scheme: how the PEs register and what is in front of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Rr,
    Wrr,
    Lu,
    LeastConnections,
    P2c,
    Prequal,
    Dpr,
    DprQ,
    HaproxyLeastconn,
    HaproxyAgent,
}

impl Scheme {
    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "rr" => Self::Rr,
            "wrr" => Self::Wrr,
            "lu" => Self::Lu,
            "least-connections" => Self::LeastConnections,
            "p2c" => Self::P2c,
            "prequal" => Self::Prequal,
            "dpr" => Self::Dpr,
            "dpr-q" => Self::DprQ,
            "haproxy-leastconn" => Self::HaproxyLeastconn,
            "haproxy-agent" => Self::HaproxyAgent,
            _ => bail!("unknown scheme {s:?} (one of {SCHEMES})"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Rr => "RR",
            Self::Wrr => "WRR",
            Self::Lu => "LU",
            Self::LeastConnections => "least-conn",
            Self::P2c => "P2C",
            Self::Prequal => "Prequal",
            Self::Dpr => "DPR",
            Self::DprQ => "DPR-Q",
            Self::HaproxyLeastconn => "HAProxy leastconn",
            Self::HaproxyAgent => "HAProxy+agent",
        }
    }

    fn haproxy(self) -> bool {
        matches!(self, Self::HaproxyLeastconn | Self::HaproxyAgent)
    }

    /// The PEs' `example` flags for a back end of `workers`.
    fn pe_flags(self, workers: usize) -> Vec<String> {
        let v: Vec<&str> = match self {
            Self::Wrr => {
                return ["--policy", "wrr", "--weight", &workers.to_string()]
                    .map(String::from)
                    .to_vec();
            }
            Self::Lu => vec!["--policy", "lu"],
            Self::Dpr => vec!["--policy", "credits", "--credit-reporting", "dpr"],
            Self::DprQ => vec!["--policy", "credits", "--credit-reporting", "dpr-q"],
            _ => vec!["--policy", "rr"],
        };
        v.into_iter().map(String::from).collect()
    }

    /// `rserpool proxy --select`.
    fn select(self) -> &'static str {
        match self {
            Self::LeastConnections => "least-connections",
            Self::P2c => "p2c",
            Self::Prequal => "prequal",
            _ => "policy",
        }
    }
}

/// The figures of one run (a scheme at a factor).
struct Row {
    requests: usize,
    errors: usize,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    normalised: f64,
    penalty: f64,
    reports_per_s: f64,
    /// CPU of the back ends (and sidecars), % of one core.
    pe_cpu: f64,
    late_ms: f64,
}

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
    if schemes.iter().any(|s| s.haproxy()) && Command::new("haproxy").arg("-v").output().is_err() {
        bail!("the HAProxy schemes need haproxy (apt-get install -y haproxy)");
    }
    raise_nofile_limit(65_536);
    let dir =
        TempDir(std::env::temp_dir().join(format!("rserpool-bench-trace-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    let dir = &dir.0;
    let trace = match &args.trace {
        Some(p) => p.clone(),
        None => {
            let p = dir.join("wiki.trace");
            let n = wiki::generate(&p, args.duration_s as f64, args.rate, args.burst, args.seed)?;
            println!("synthetic trace: {n} requests in {} s", args.duration_s);
            p
        }
    };
    let duration = args.duration_s as f64;
    // Costs scaled so that the largest factor offers `utilisation` of the pool's worker time.
    let largest = factors.iter().map(|f| f.1).fold(0.0, f64::max);
    let busiest = wiki::read(&trace, largest, duration)?;
    let worker_us: f64 = args.workers.iter().sum::<usize>() as f64 * duration * 1e6;
    let cost_sum: f64 = busiest.iter().map(|e| wiki::work(&e.url).0).sum();
    let scale = args.utilisation * worker_us / cost_sum.max(1.0);
    let mean_cost_ms = cost_sum * scale / busiest.len() as f64 / 1000.0;
    println!(
        "costs scaled by {scale:.3}: mean service time {mean_cost_ms:.1} ms at factor {largest}"
    );
    let mut results: Vec<(Scheme, Vec<Row>)> = Vec::new();
    let mut offered = Vec::new();
    for (_, f) in &factors {
        let entries = wiki::read(&trace, *f, duration)?;
        let cost: f64 = entries.iter().map(|e| wiki::work(&e.url).0 * scale).sum();
        offered.push((entries.len() as f64 / duration, cost / worker_us));
    }
    for &scheme in &schemes {
        println!("== {}", scheme.name());
        let rows = run_scheme(scheme, &args, &factors, &trace, scale, bin, dir)
            .with_context(|| format!("scheme {}", scheme.name()))?;
        results.push((scheme, rows));
    }
    let text = render(&args, &factors, &offered, mean_cost_ms, &results);
    print!("{text}");
    if let Some(dir) = &args.plots {
        plots(dir, &factors, &results)?;
    }
    if let Some(path) = &args.markdown {
        report::write_section(path, "trace", &format!("{}{text}", report::provenance()))?;
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
    if scheme.haproxy() {
        let mut servers = String::new();
        for (i, &(addr, w)) in backends.iter().enumerate() {
            let _ = write!(servers, "    server s{} {addr} weight {}", i + 1, w * 10);
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
        let cfg = format!(
            "global\n    nbthread 2\n    maxconn 8000\n\
             defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n    retries 3\n    option redispatch\n\
             frontend web\n    bind {front}\n    default_backend pool\n\
             backend pool\n    balance leastconn\n{servers}"
        );
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, cfg)?;
        procs.push(Proc::spawn(
            Command::new("haproxy").arg("-db").arg("-f").arg(&path),
            &dir.join("haproxy.log"),
        )?);
    } else {
        // A request may wait for credit as long as a connection may wait in a back end's
        // accept queue here: until the client's timeout, less a margin.
        let cfg = format!(
            "registrars = [\"{reg}\"]\n\
             [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"{pool}\"\n\
             [pool.{pool}]\nselect = \"{}\"\nqueue-timeout-ms = {}\nqueue = 8192\n",
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
    }
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
                    cost_us,
                }
            })
            .collect();
        let before = registrar_status(reg_status)?.counters.reregistrations;
        let cpu_before: u64 = measured
            .iter()
            .filter_map(|&p| procfs::cpu_ns(p).ok())
            .sum();
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
        let row = summarise(
            &outcomes,
            reports,
            (cpu - cpu_before) as f64 / took / 1e7,
            late,
        );
        println!(
            "  {name}: {} requests, {} errors, p99 {:.1} ms, p_ISP {:.2e}",
            row.requests, row.errors, row.p99_ms, row.penalty
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

fn summarise(outcomes: &[replay::Outcome], reports: f64, pe_cpu: f64, late: Duration) -> Row {
    let mut ok: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.first.map(|d| d.as_secs_f64() * 1000.0))
        .collect();
    ok.sort_by(f64::total_cmp);
    let errors = outcomes.len() - ok.len();
    let q = |p: f64| {
        ok.get(((ok.len() as f64 - 1.0) * p).round().max(0.0) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let mean = ok.iter().sum::<f64>() / ok.len().max(1) as f64;
    let max = ok.last().copied().unwrap_or(f64::NAN);
    let norm: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| Some(o.first?.as_secs_f64() * 1e6 / o.cost_us.max(1) as f64))
        .collect();
    let normalised = norm.iter().sum::<f64>() / norm.len().max(1) as f64;
    Row {
        requests: outcomes.len(),
        errors,
        mean_ms: mean,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: max,
        normalised,
        penalty: if max > 0.0 {
            mean / max * errors as f64 / outcomes.len().max(1) as f64
        } else {
            0.0
        },
        reports_per_s: reports,
        pe_cpu,
        late_ms: late.as_secs_f64() * 1000.0,
    }
}

fn render(
    args: &TraceArgs,
    factors: &[(String, f64)],
    offered: &[(f64, f64)],
    mean_cost_ms: f64,
    results: &[(Scheme, Vec<Row>)],
) -> String {
    let mut s = String::new();
    let source = match &args.trace {
        Some(p) => format!("trace file `{}`", p.display()),
        None => format!(
            "synthetic wikibench trace ({} requests/s at factor 1, burst ±{}, seed {})",
            args.rate, args.burst, args.seed
        ),
    };
    let workers: Vec<String> = args.workers.iter().map(|w| w.to_string()).collect();
    let _ = writeln!(
        s,
        "{} s of the {source} per factor and scheme, open loop; back ends with {} workers (accept queue {}); mean service time {mean_cost_ms:.1} ms at the largest factor; a request is an error when it is not answered 200 in full within {} s.\n",
        args.duration_s,
        workers.join(" / "),
        args.backlog,
        args.timeout_s
    );
    for (i, (name, _)) in factors.iter().enumerate() {
        let (rate, util) = offered[i];
        let _ = writeln!(
            s,
            "**Factor {name}**: {rate:.1} requests/s, {:.0} % of the pool's capacity offered.\n",
            util * 100.0
        );
        let _ = writeln!(
            s,
            "| scheme | requests | errors | first response mean / p50 / p99 / max, ms | normalised | p_ISP | reports/s | PE CPU % |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for (scheme, rows) in results {
            let r = &rows[i];
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} / {:.1} / {:.1} / {:.0} | {:.2} | {:.2e} | {:.1} | {:.1} |",
                scheme.name(),
                r.requests,
                r.errors,
                r.mean_ms,
                r.p50_ms,
                r.p99_ms,
                r.max_ms,
                r.normalised,
                r.penalty,
                r.reports_per_s,
                r.pe_cpu
            );
        }
        let late = results
            .iter()
            .map(|(_, rows)| rows[i].late_ms)
            .fold(0.0, f64::max);
        let _ = writeln!(s, "\nLatest send behind its trace time: {late:.1} ms.\n");
    }
    s
}

fn plots(dir: &Path, factors: &[(String, f64)], results: &[(Scheme, Vec<Row>)]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let groups: Vec<String> = factors.iter().map(|f| format!("factor {}", f.0)).collect();
    let series = |pick: &dyn Fn(&Row) -> f64| -> Vec<(String, Vec<f64>)> {
        results
            .iter()
            .map(|(s, rows)| (s.name().to_string(), rows.iter().map(pick).collect()))
            .collect()
    };
    let path = |name: &str| -> Result<String> {
        dir.join(name)
            .to_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("plot path is not UTF-8"))
    };
    plot::bars(
        &path("bench-trace-p99.png")?,
        "First response time p99 by scheme (lower is better)",
        "ms",
        &groups,
        &series(&|r| r.p99_ms),
    )?;
    plot::bars(
        &path("bench-trace-errors.png")?,
        "Request errors by scheme (lower is better)",
        "% of requests",
        &groups,
        &series(&|r| 100.0 * r.errors as f64 / r.requests.max(1) as f64),
    )?;
    plot::bars(
        &path("bench-trace-normalised.png")?,
        "Normalised first response time (response / service time)",
        "×",
        &groups,
        &series(&|r| r.normalised),
    )?;
    Ok(())
}
