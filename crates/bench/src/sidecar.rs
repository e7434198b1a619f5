//! `rserpool-bench sidecar`: what an `rserpool serve` sidecar with policy credits costs
//! (docs/PERFORMANCE.md).
//!
//! A registrar and a target on loopback (the target is this process: an HTTP responder that
//! answers and closes), and one sidecar registering the target with policy `credits`. Its CPU
//! is read from /proc, first idle, then while a client opens `--rate` connections per second
//! (one request each). Each way of counting the target's connections is measured
//! (`--count-connections ebpf` and `dump`), and, with `--baseline PATH`, the same for another
//! `rserpool` binary (an older version, with its defaults), side by side in one run.

use crate::net::{free_port, local};
use crate::process::Proc;
use crate::report;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::fmt::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Args, Debug)]
pub struct SidecarArgs {
    /// New connections per second to the target, each one request.
    #[arg(long, default_value_t = 330)]
    pub rate: u32,
    /// How long each measurement lasts.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Measurements per variant; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Another `rserpool` binary measured the same way (with its default counting).
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// The baseline's way of counting (`ebpf` or `dump`; a build that has the option), to
    /// compare one way of counting between two builds.
    #[arg(long)]
    pub baseline_count_connections: Option<String>,
    /// Write the results as a Markdown section into this file (e.g. docs/PERFORMANCE.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// One sidecar configuration measured.
struct Variant {
    label: String,
    bin: PathBuf,
    extra: Vec<String>,
}

/// A variant's medians: CPU idle and under load (% of one core), credit reports per second.
struct Figures {
    idle: f64,
    loaded: f64,
    reports: f64,
    counted_by: String,
}

pub fn run(args: SidecarArgs, bin: &Path) -> Result<()> {
    crate::process::raise_nofile_limit(65_536);
    let dir = std::env::temp_dir().join(format!("rserpool-bench-sidecar-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (mut registrar, asap, _) = crate::product::start_registrar(bin, &dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let target = rt.block_on(target())?;
    let mut variants = Vec::new();
    for how in ["ebpf", "dump"] {
        variants.push(Variant {
            label: format!("this build, `--count-connections {how}`"),
            bin: bin.to_path_buf(),
            extra: vec!["--count-connections".into(), how.into()],
        });
    }
    if let Some(b) = &args.baseline {
        let how = args.baseline_count_connections.as_deref();
        variants.push(Variant {
            label: match how {
                Some(how) => format!("baseline `{}`, `--count-connections {how}`", b.display()),
                None => format!("baseline `{}`", b.display()),
            },
            bin: b.clone(),
            extra: how
                .map(|h| vec!["--count-connections".into(), h.into()])
                .unwrap_or_default(),
        });
    }
    let mut rows = Vec::new();
    let mut failure = None;
    for v in &variants {
        match measure(&args, v, asap, target, &dir, &rt) {
            Ok(f) => rows.push((v, f)),
            Err(e) => {
                failure = Some(e.context(v.label.clone()));
                break;
            }
        }
    }
    registrar.kill();
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(e) = failure {
        return Err(e);
    }
    let mut out = String::new();
    writeln!(
        out,
        "One `rserpool serve --policy credits` sidecar (default sampling, every 5 ms) of a target \
         on loopback; CPU of the sidecar process from /proc, {} s per measurement, median of {}; \
         idle, then with {} new connections per second to the target (one request each). The \
         host's TCP established hash has {} buckets.\n",
        args.duration_s,
        args.repeat,
        args.rate,
        ehash_entries().map_or_else(|| "an unknown number of".into(), |n| n.to_string())
    )?;
    writeln!(
        out,
        "| sidecar | connections counted by | CPU idle, % of a core | CPU at {} conn/s | credit reports/s |",
        args.rate
    )?;
    writeln!(out, "|---|---|---|---|---|")?;
    for (v, f) in &rows {
        writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.0} |",
            v.label, f.counted_by, f.idle, f.loaded, f.reports
        )?;
    }
    if let Some((_, base)) = rows.iter().find(|(v, _)| v.extra.is_empty()) {
        for (v, f) in rows.iter().filter(|(v, _)| !v.extra.is_empty()) {
            writeln!(
                out,
                "\n{}: {:.3}× the baseline's CPU at {} conn/s.",
                v.label,
                f.loaded / base.loaded.max(1e-9),
                args.rate
            )?;
        }
    }
    print!("{out}");
    if let Some(path) = &args.markdown {
        report::write_section(path, "sidecar", &format!("{}{out}", report::provenance()))?;
        println!("written into {}", path.display());
    }
    Ok(())
}

/// `net.ipv4.tcp_ehash_entries` (what a sock_diag dump walks).
fn ehash_entries() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_ehash_entries")
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .map(i64::unsigned_abs)
}

/// The target: answers each request with a short `200` and closes.
async fn target() -> Result<SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    Ok(addr)
}

fn measure(
    args: &SidecarArgs,
    v: &Variant,
    asap: SocketAddr,
    target: SocketAddr,
    dir: &Path,
    rt: &tokio::runtime::Runtime,
) -> Result<Figures> {
    let (mut idle, mut loaded, mut reports) = (Vec::new(), Vec::new(), Vec::new());
    let mut counted_by = String::from("?");
    for i in 0..args.repeat {
        let status = local(free_port()?);
        let mut sidecar = Proc::spawn(
            crate::product::command(&v.bin)
                .args(["serve", "--target", &target.to_string()])
                .args(["--pool", "BenchSidecar", "--policy", "credits"])
                .args(["--registrar", &asap.to_string()])
                .args(["--capacity", "100", "--status", &status.to_string()])
                .args(&v.extra),
            &dir.join(format!("sidecar-{}-{i}.log", v.extra.join("-"))),
        )?;
        let st = rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(s) = status_of(status).await
                    && s.get("registered").and_then(|r| r.as_bool()) == Some(true)
                {
                    return Ok(s);
                }
                if Instant::now() > deadline {
                    bail!("the sidecar did not register within 10 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })?;
        if let Some(c) = st.get("connections_counted_by").and_then(|c| c.as_str()) {
            counted_by = c.to_string();
        } else {
            counted_by = "sock_diag (every sample)".into();
        }
        let pid = sidecar.id();
        let span = Duration::from_secs(args.duration_s);
        // Idle.
        let t0 = Instant::now();
        let c0 = crate::procfs::cpu_ns(pid)?;
        std::thread::sleep(span);
        let c1 = crate::procfs::cpu_ns(pid)?;
        idle.push(percent(c1 - c0, t0.elapsed()));
        // Loaded.
        let before = rt.block_on(status_of(status))?;
        let stop = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicU64::new(0));
        let load = rt.spawn(open_loop(target, args.rate, stop.clone(), failed.clone()));
        let t0 = Instant::now();
        let c0 = crate::procfs::cpu_ns(pid)?;
        std::thread::sleep(span);
        let c1 = crate::procfs::cpu_ns(pid)?;
        let elapsed = t0.elapsed();
        stop.store(true, Ordering::Relaxed);
        let _ = rt.block_on(load);
        let after = rt.block_on(status_of(status))?;
        loaded.push(percent(c1 - c0, elapsed));
        let n = |s: &serde_json::Value| {
            s.get("credit_reports")
                .and_then(|r| r.as_u64())
                .unwrap_or(0)
        };
        reports.push(n(&after).saturating_sub(n(&before)) as f64 / elapsed.as_secs_f64());
        let failed = failed.load(Ordering::Relaxed);
        if failed > 0 {
            println!("  {}: {failed} connection(s) to the target failed", v.label);
        }
        sidecar.kill();
    }
    let m = |v: Vec<f64>| report::median(v).unwrap_or(f64::NAN);
    let f = Figures {
        idle: m(idle),
        loaded: m(loaded),
        reports: m(reports),
        counted_by,
    };
    println!(
        "{}: idle {:.1} %, loaded {:.1} % of a core, {:.0} credit reports/s",
        v.label, f.idle, f.loaded, f.reports
    );
    Ok(f)
}

fn percent(cpu_ns: u64, over: Duration) -> f64 {
    cpu_ns as f64 / over.as_nanos() as f64 * 100.0
}

/// The sidecar's status document.
async fn status_of(addr: SocketAddr) -> Result<serde_json::Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /status HTTP/1.0\r\n\r\n").await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut answer))
        .await
        .context("the sidecar's status timed out")??;
    let text = String::from_utf8_lossy(&answer);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .context("no status body")?;
    Ok(serde_json::from_str(body)?)
}

/// Opens `rate` connections per second to `target` (open loop), one request each, until
/// `stop`; counts those that fail.
async fn open_loop(target: SocketAddr, rate: u32, stop: Arc<AtomicBool>, failed: Arc<AtomicU64>) {
    let gap = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut tick = tokio::time::interval(gap);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let failed = failed.clone();
        tokio::spawn(async move {
            let ok = async {
                let mut s = tokio::net::TcpStream::connect(target).await?;
                s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await?;
                let mut b = Vec::new();
                s.read_to_end(&mut b).await?;
                Ok::<_, std::io::Error>(b.starts_with(b"HTTP/1.1 200"))
            };
            if !matches!(
                tokio::time::timeout(Duration::from_secs(5), ok).await,
                Ok(Ok(true))
            ) {
                failed.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
}
