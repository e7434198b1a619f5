//! `rserpool-bench registrar`: the seed paper's Figures 7 (left) and 8 (left), and beyond.
//!
//! Each point starts a fresh registrar process and, in a second process
//! (`rserpool-bench load-gen`, see [`load_gen`](mod@load_gen)), N simulated PEs, each on its
//! own TCP connection, re-registering every `a` ms with a new load (least used), and M
//! simulated PUs resolving every `b` ms. After the connections are up and a warm-up, the
//! registrar's CPU time (sum of /proc/PID/task/*/schedstat) and resident memory (VmRSS) are
//! read around a measurement window; the load generator measures response latency from send
//! to the complete answer, so it includes its own scheduling delay.
//!
//! With `--registrars K` (or `--figure 7r`, the paper's Figure 7 right) K registrar processes
//! form an ENRP cluster first; the PEs register at the first one, which sends every change to
//! the K - 1 others. Both the CPU of that home registrar and of one that only synchronises
//! (`sync_cpu`) are measured.

mod load_gen;
mod report;
mod rsplib;

pub use load_gen::{LoadGenArgs, run as load_gen};

use crate::net::{free_port, local, registrar_status};
use crate::process::{Reaper, raise_nofile_limit, wait_for};
use crate::procfs::{cpu_ns, rss_bytes};
use crate::report::{machine, write_section};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    /// PEs sharing one TCP connection (RFC 5352 has one per association; rserpool's
    /// registrar takes up to `max-pes-per-connection`): more PEs than the open-file limit
    /// allows connections.
    #[arg(long, default_value_t = 1)]
    pub pes_per_connection: usize,
    /// Measurement window per point.
    #[arg(long, default_value_t = 3000)]
    pub duration_ms: u64,
    /// Warm-up after all connections are up.
    #[arg(long, default_value_t = 1000)]
    pub warmup_ms: u64,
    /// Runs per point; each figure is the median over the runs (this machine is noisy).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Measure every point twice, side by side: ASAP in plain TCP and over TLS with mutual
    /// authentication (ECDSA P-256 certificates of a test CA); the report gives the ratio.
    #[arg(long)]
    pub tls: bool,
    /// Measure every point twice, side by side: ASAP over TCP and over SCTP in UDP (RFC 6951;
    /// rserpool's user-space SCTP at both ends); the report gives the ratio.
    #[arg(long, conflicts_with = "tls")]
    pub sctp: bool,
    /// Instead: rserpool's registrar and rsplib's `rspregistrar` (from DIR, built for SCTP over
    /// UDP by the interoperability script) under the same load over SCTP in UDP, in network
    /// namespaces (root); the report gives registrations per CPU second of each.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tls", "sctp"])]
    pub against_rsplib: Option<std::path::PathBuf>,
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
    /// ASAP over TLS.
    #[serde(default)]
    pub tls: bool,
    /// ASAP over SCTP in UDP.
    #[serde(default)]
    pub sctp: bool,
    /// Runs behind this point (each figure is their median) and the spread of CPU and p99.
    pub runs: u32,
    pub registrar_cpu_min: f64,
    pub registrar_cpu_max: f64,
    pub p99_us_max: u64,
}

/// How the load generator reaches the registrar.
#[derive(Debug, Clone, Copy)]
enum Mode<'a> {
    Tcp,
    /// TLS, with the certificates in this directory.
    Tls(&'a Path),
    /// SCTP over UDP.
    Sctp,
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
    if let Some(dir) = &args.against_rsplib {
        return rsplib::run(&args, rserpool, dir);
    }
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
    let tls_dir = args.tls.then(tls_certificates).transpose()?;
    let modes: Vec<Mode> = match &tls_dir {
        Some(d) => vec![Mode::Tcp, Mode::Tls(d.path())],
        None if args.sctp => vec![Mode::Tcp, Mode::Sctp],
        None => vec![Mode::Tcp],
    };
    let mut samples = Vec::new();
    for (p, mode) in points
        .iter()
        .flat_map(|p| modes.iter().map(move |m| (*p, *m)))
    {
        let mut runs = Vec::new();
        for _ in 0..args.repeat {
            // Ports are picked free beforehand, so a registrar's port can be taken by someone
            // else's outgoing connection before it binds: try such a point again.
            let mut attempt = 0;
            let sample = loop {
                attempt += 1;
                match run_point(p, &args, rserpool, mode) {
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
    if args.tls {
        if let Some(path) = &args.markdown {
            write_section(path, "registrar-tls", &report::tls_markdown(&samples))?;
        }
        return Ok(());
    }
    if args.sctp {
        if let Some(path) = &args.markdown {
            write_section(path, "registrar-sctp", &report::sctp_markdown(&samples))?;
        }
        return Ok(());
    }
    // A cluster run (Figure 7 right) has its own table and plot, K = 1 included.
    let cluster = args.figures.iter().any(|f| f == "7r") || args.registrars.iter().any(|&k| k > 1);
    if let Some(path) = &args.markdown {
        if cluster {
            write_section(
                path,
                "registrar-cluster",
                &report::cluster_markdown(&samples),
            )?;
        } else {
            write_section(path, "registrar", &report::markdown(&samples))?;
        }
    }
    if let Some(prefix) = &args.plot {
        if cluster {
            report::cluster_plot(&samples, prefix)?;
        } else {
            report::plot(&samples, prefix)?;
        }
    }
    Ok(())
}

fn run_point(
    p: Point,
    args: &RegistrarBenchArgs,
    rserpool: &Path,
    mode: Mode<'_>,
) -> Result<Sample> {
    let tls = match mode {
        Mode::Tls(d) => Some(d),
        _ => None,
    };
    let sctp = matches!(mode, Mode::Sctp);
    let exe = std::env::current_exe()?;
    let k = p.registrars.max(1) as usize;
    let mut asap = Vec::new();
    let mut enrp = Vec::new();
    let mut status = Vec::new();
    for _ in 0..k {
        asap.push(local(free_port()?));
        enrp.push(local(free_port()?));
        status.push(local(free_port()?));
    }
    let addr = asap[0];
    let mut reaper = Reaper::default();
    let mut pids = Vec::new();
    for i in 0..k {
        let mut cmd = Command::new(rserpool);
        let listen = if sctp && i == 0 {
            format!("tcp://{a},sctp+udp://{a}", a = asap[i])
        } else {
            asap[i].to_string()
        };
        cmd.args(["registrar", "--asap", &listen, "--max-hr-rate", "0"])
            .args([
                "--max-connections",
                "200000",
                "--max-pes-per-pool",
                "200000",
            ])
            .args(["--enrp", &enrp[i].to_string()])
            .args(["--status", &status[i].to_string()]);
        if let Some(d) = tls {
            cmd.arg("--tls-cert")
                .arg(d.join("registrar.pem"))
                .arg("--tls-key")
                .arg(d.join("registrar.key"))
                .arg("--tls-ca")
                .arg(d.join("ca.pem"));
        }
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
            || cluster_formed(&status),
        )?;
    }
    let mut generator = Command::new(&exe);
    if let Some(d) = tls {
        generator.arg("load-gen").arg("--tls-dir").arg(d);
    } else {
        generator.arg("load-gen");
    }
    generator
        .args([
            "--registrar",
            &if sctp {
                format!("sctp+udp://{addr}")
            } else {
                addr.to_string()
            },
        ])
        .args([
            "--pes",
            &p.pes.to_string(),
            "--rereg-ms",
            &p.rereg_ms.to_string(),
            "--pes-per-connection",
            &args.pes_per_connection.to_string(),
        ])
        .args([
            "--pus",
            &p.pus.to_string(),
            "--resolve-ms",
            &p.resolve_ms.to_string(),
        ]);
    let Measured {
        cpu,
        loadgen_cpu,
        sync_cpu,
        rss,
        result: r,
    } = run_generator(generator, args, &mut reaper, pid, sync_pid)?;
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
        tls: tls.is_some(),
        sctp,
        runs: 1,
        registrar_cpu_min: cpu,
        registrar_cpu_max: cpu,
        p99_us_max: r.p99_us,
    })
}

/// Runs the load generator `cmd` (its load arguments given) over the measurement window of
/// `args` and measures registrar `pid` (and `sync_pid`) in it; the processes go to `reaper`.
fn run_generator(
    mut cmd: Command,
    args: &RegistrarBenchArgs,
    reaper: &mut Reaper,
    pid: u32,
    sync_pid: Option<u32>,
) -> Result<Measured> {
    let mut generator = cmd
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
    measure(out, pid, gen_pid, sync_pid)
}

/// What one run measured: the registrar's CPU (and a synchronising peer's) over the load
/// generator's window, the generator's own CPU, the registrar's RSS and the generator's result.
struct Measured {
    cpu: f64,
    loadgen_cpu: f64,
    sync_cpu: Option<f64>,
    rss: u64,
    result: load_gen::GenResult,
}

/// Reads the load generator's output (`start`, `stop`, its result) and measures `pid` in its
/// window.
fn measure(
    out: std::process::ChildStdout,
    pid: u32,
    gen_pid: u32,
    sync_pid: Option<u32>,
) -> Result<Measured> {
    let mut lines = BufReader::new(out).lines();
    let mut cpu0 = None;
    let mut cpu = None;
    let mut sync0 = 0;
    let mut sync_cpu = None;
    let mut rss = 0;
    let mut result: Option<load_gen::GenResult> = None;
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
    let result = result.ok_or_else(|| anyhow!("load generator ended without a result"))?;
    let (cpu, loadgen_cpu) = cpu.ok_or_else(|| anyhow!("no CPU measurement"))?;
    Ok(Measured {
        cpu,
        loadgen_cpu,
        sync_cpu,
        rss,
        result,
    })
}

/// A test CA and the registrar's and the PEs' certificates, in a directory of their own.
fn tls_certificates() -> Result<crate::undo::TempDir> {
    let dir = std::env::temp_dir().join(format!("rserpool-bench-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let tmp = crate::undo::TempDir::new(dir.clone());
    let ca = rserpool_tls::issue::new_ca("rserpool-bench CA")?;
    std::fs::write(dir.join("ca.pem"), &ca.cert_pem)?;
    let sans = ["127.0.0.1".to_string(), "localhost".to_string()];
    for name in ["registrar", "pe"] {
        let c = rserpool_tls::issue::issue_as(&ca, name, &sans, name == "registrar")?;
        std::fs::write(dir.join(format!("{name}.pem")), &c.cert_pem)?;
        std::fs::write(dir.join(format!("{name}.key")), &c.key_pem)?;
    }
    Ok(tmp)
}

/// True when each registrar's status lists all the others as alive peers.
fn cluster_formed(status: &[SocketAddr]) -> bool {
    status.iter().all(|a| {
        let Ok(st) = registrar_status(*a) else {
            return false;
        };
        st.peers.iter().filter(|p| p.state == "alive").count() + 1 == status.len()
    })
}
