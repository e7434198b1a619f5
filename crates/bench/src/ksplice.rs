//! `rserpool-bench ksplice`: the kernel splice (docs/KSPLICE.md) beside the user-space proxy, HAProxy
//! and direct forwarding, in one run in one network-namespace topology.
//!
//! client | proxy | server namespaces joined by veth pairs (the kernel splice tests'
//! topology). The server runs `rserpool example http` as the pool's one PE; the proxy's
//! namespace runs the registrar, `rserpool proxy` (a TCP listener relaying in user space, one
//! with `splice = "kernel"`) and HAProxy in TCP mode; it
//! also routes, so that the client can reach the server directly through it — the baseline,
//! the same hops without a proxy.
//!
//! Measured per system: bulk download throughput with the machine's and the proxy process's
//! CPU per GiB; the same over hops limited by `tc` (as on the seed paper's testbed); the seed's
//! 100 concurrent PUTs (Tables 2–4) over the limited hops; and the time to the first response
//! byte of a fresh connection, which is where a hand-over could add delay.

use crate::process::{Proc, wait_for};
use crate::procfs::{cpu_ns, machine_busy_since, machine_cpu_ticks};
use crate::report;
use anyhow::{Context, Result, bail};
use clap::Args;
use rserpool_ksplice::testbed::{in_ns, topology};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct KspliceArgs {
    /// Seconds of each bulk run.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Bulk runs per system, interleaved (the table has their medians: this machine's CPU
    /// is shared by client, server and proxy, and one run is noisy).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Concurrent connections of the bulk runs.
    #[arg(long, default_value_t = 4)]
    pub bulk_connections: usize,
    /// Rate of every hop (each veth's egress) for the limited runs, Mbit/s; 0 skips them.
    #[arg(long, default_value_t = 1000)]
    pub link_mbit: u64,
    /// Concurrent PUTs of the seed's Tables 2–4.
    #[arg(long, default_value_t = 100)]
    pub puts: usize,
    /// Sizes of the PUTs, KB (the seed's: 10 MB, 20 MB, 100 KB).
    #[arg(long, value_delimiter = ',', default_values_t = [10_000usize, 20_000, 100])]
    pub put_kb: Vec<usize>,
    /// Fresh connections timed to their first response byte, per system.
    #[arg(long, default_value_t = 300)]
    pub first_responses: usize,
    /// Write the results section into this Markdown file (docs/KSPLICE.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// The systems side by side, and where the client reaches each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum System {
    Direct,
    User,
    Kernel,
    Haproxy,
}

impl System {
    const ALL: [System; 4] = [Self::Direct, Self::User, Self::Kernel, Self::Haproxy];

    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct (routed)",
            Self::User => "rserpool, user space",
            Self::Kernel => "rserpool, kernel splice",
            Self::Haproxy => "HAProxy (tcp)",
        }
    }

    /// Where the client connects.
    fn tcp(self) -> SocketAddr {
        match self {
            Self::Direct => PE,
            Self::User => "10.77.1.1:7000",
            Self::Kernel => "10.77.1.1:7001",
            Self::Haproxy => "10.77.1.1:7002",
        }
        .parse()
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)))
    }
}

const PE: &str = "10.77.2.2:9080";
const STATUS: &str = "10.77.2.1:8404";
const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// One system's figures.
#[derive(Debug, Default, Clone)]
struct Row {
    bulk_mib_s: f64,
    /// CPU-seconds per GiB moved: the whole machine (client, server, kernel), and the proxy
    /// process alone.
    machine_cpu_gib: f64,
    proxy_cpu_gib: Option<f64>,
    limited_mib_s: Option<f64>,
    /// Bulk throughput as a share of direct's in the same round: lowest and highest.
    vs_direct: (f64, f64),
    /// Per PUT size: mean and longest transfer time, s, and the whole batch's.
    puts: Vec<(f64, f64, f64)>,
    /// First response byte of a fresh connection: median and p99, µs.
    first_us: (f64, f64),
}

pub fn run(args: KspliceArgs, bin: &Path) -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("the kernel splice benchmark needs root (network namespaces, eBPF)");
    }
    if let Some(why) = rserpool_ksplice::unavailable() {
        bail!("{why}");
    }
    crate::undo::on_signal()?;
    let haproxy = Command::new("haproxy").arg("-v").output().is_ok();
    if !haproxy {
        println!("haproxy not found (apt-get install -y haproxy): its column is left out");
    }
    let Some((ns, c, p, s)) = topology(0) else {
        bail!("no namespace topology");
    };
    for n in &ns.0 {
        crate::undo::lock().add_command(crate::undo::command(&["ip", "netns", "del", n]));
    }
    let dir = std::env::temp_dir().join(format!("ksplice-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let bed = Bed::start(bin, &dir, &ns.1, (&c, &p, &s), haproxy)?;
    let systems: Vec<System> = System::ALL
        .into_iter()
        .filter(|&s| haproxy || s != System::Haproxy)
        .collect();
    let mut rows = vec![Row::default(); systems.len()];
    // Per system: (MiB/s, machine CPU s/GiB, proxy CPU s/GiB) of each round.
    let mut runs: Vec<Vec<(f64, f64, Option<f64>)>> = vec![Vec::new(); systems.len()];
    for round in 1..=args.rounds.max(1) {
        for (i, &sys) in systems.iter().enumerate() {
            let (bytes, secs, busy, proxy_ns) = bulk(&c, sys, &args, bed.pid(sys))?;
            let gib = bytes as f64 / GIB;
            let run = (
                bytes as f64 / MIB / secs,
                busy * cores() as f64 * secs / gib,
                proxy_ns.map(|n| n as f64 / 1e9 / gib),
            );
            println!(
                "round {round}, {}: bulk {:.0} MiB/s, machine CPU {:.2} s/GiB, proxy CPU {}",
                sys.name(),
                run.0,
                run.1,
                run.2.map_or("-".into(), |v| format!("{v:.3} s/GiB"))
            );
            runs[i].push(run);
        }
    }
    for (i, &sys) in systems.iter().enumerate() {
        let row = &mut rows[i];
        let r = &runs[i];
        row.bulk_mib_s = report::median(r.iter().map(|x| x.0).collect()).unwrap_or(0.0);
        row.machine_cpu_gib = report::median(r.iter().map(|x| x.1).collect()).unwrap_or(0.0);
        row.proxy_cpu_gib = report::median(r.iter().filter_map(|x| x.2).collect());
        let ratios: Vec<f64> = r
            .iter()
            .zip(&runs[0])
            .map(|(x, d)| x.0 / d.0.max(1e-9))
            .collect();
        row.vs_direct = (
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
        row.first_us = first_responses(&c, sys, args.first_responses)?;
        println!(
            "{}: first response median {:.0} µs, p99 {:.0} µs",
            sys.name(),
            row.first_us.0,
            row.first_us.1
        );
    }
    if args.link_mbit > 0 {
        let _links = Links::limit(
            args.link_mbit,
            [(&c, "c0"), (&p, "p0"), (&p, "p1"), (&s, "s0")],
        )?;
        for (sys, row) in systems.iter().zip(&mut rows) {
            let (bytes, secs, _, _) = bulk(&c, *sys, &args, None)?;
            row.limited_mib_s = Some(bytes as f64 / MIB / secs);
            for &kb in &args.put_kb {
                let t = puts(&c, *sys, args.puts, kb * 1000)?;
                println!(
                    "  {}: {} PUTs of {kb} KB: mean {:.2} s, longest {:.2} s, all {:.2} s",
                    sys.name(),
                    args.puts,
                    t.0,
                    t.1,
                    t.2
                );
                row.puts.push(t);
            }
        }
    }
    let stats = bed.kernel_stats(&c);
    let md = markdown(&args, &systems, &rows, &stats);
    println!("{md}");
    if let Some(path) = &args.markdown {
        report::write_section(path, "ksplice", &md)?;
        println!("written to {}", path.display());
    }
    drop(bed);
    drop(ns);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The processes of the run.
struct Bed {
    _registrar: Proc,
    _pe: Proc,
    proxy: Proc,
    haproxy: Option<Proc>,
}

impl Bed {
    fn start(
        bin: &Path,
        dir: &Path,
        pins: &Path,
        (c, p, s): (&str, &str, &str),
        haproxy: bool,
    ) -> Result<Bed> {
        // The proxy's namespace routes too: the direct path.
        sh(&[
            "ip",
            "netns",
            "exec",
            p,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ])?;
        for (ns, net, via) in [
            (c, "10.77.2.0/24", "10.77.1.1"),
            (s, "10.77.1.0/24", "10.77.2.1"),
        ] {
            sh(&["ip", "-n", ns, "route", "add", net, "via", via])?;
        }
        let spawn = |ns: &str, args: &[&str], log: &str| {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(bin).args(args);
            cmd.env("RUST_LOG", "warn");
            Proc::spawn(&mut cmd, &dir.join(log))
        };
        let registrar = spawn(
            p,
            &["registrar", "--asap", "10.77.2.1:3863", "--status", "off"],
            "registrar.log",
        )?;
        std::thread::sleep(Duration::from_millis(200));
        let pe = spawn(
            s,
            &[
                "example",
                "http",
                "--listen",
                PE,
                "--pool",
                "BPool",
                "--registrar",
                "10.77.2.1:3863",
            ],
            "pe.log",
        )?;
        let cfg = format!(
            r#"registrars = ["10.77.2.1:3863"]
refresh-ms = 200
status = "{STATUS}"
[[listener]]
listen = "10.77.1.1:7000"
mode = "tcp"
pool = "BPool"
[[listener]]
listen = "10.77.1.1:7001"
mode = "tcp"
pool = "BPool"
splice = "kernel"
[kernel-splice]
interfaces = ["p0", "p1"]
pin-dir = "{}"
"#,
            pins.display()
        );
        let path = dir.join("proxy.toml");
        std::fs::write(&path, cfg)?;
        let proxy = spawn(
            p,
            &["proxy", "--config", &path.display().to_string()],
            "proxy.log",
        )?;
        let haproxy = if haproxy {
            let cfg = format!(
                "global\n  maxconn 4000\ndefaults\n  mode tcp\n  timeout connect 5s\n  \
                 timeout client 60s\n  timeout server 60s\nlisten bulk\n  bind {}\n  \
                 server pe {PE}\n",
                System::Haproxy.tcp()
            );
            let path = dir.join("haproxy.cfg");
            std::fs::write(&path, cfg)?;
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", p, "haproxy", "-db", "-f"])
                .arg(&path);
            Some(Proc::spawn(&mut cmd, &dir.join("haproxy.log"))?)
        } else {
            None
        };
        let bed = Bed {
            _registrar: registrar,
            _pe: pe,
            proxy,
            haproxy,
        };
        for sys in System::ALL
            .into_iter()
            .filter(|&s| bed.haproxy.is_some() || s != System::Haproxy)
        {
            let c = c.to_string();
            wait_for(sys.name(), Duration::from_secs(20), || {
                let c = c.clone();
                in_ns(&c, move || download(sys.tcp(), 1000, None).is_ok())
                    .join()
                    .unwrap_or(false)
            })?;
        }
        Ok(bed)
    }

    /// The process whose CPU counts as the proxy's.
    fn pid(&self, sys: System) -> Option<u32> {
        match sys {
            System::Direct => None,
            System::User | System::Kernel => Some(self.proxy.id()),
            System::Haproxy => self.haproxy.as_ref().map(Proc::id),
        }
    }

    /// The proxy's `kernel_splice` stats, read from the client's side of the routed path.
    fn kernel_stats(&self, c: &str) -> serde_json::Value {
        in_ns(c, || -> Option<serde_json::Value> {
            let mut s = TcpStream::connect(STATUS).ok()?;
            s.write_all(b"GET /status HTTP/1.0\r\n\r\n").ok()?;
            let mut reply = String::new();
            s.read_to_string(&mut reply).ok()?;
            let v: serde_json::Value =
                serde_json::from_str(reply.split("\r\n\r\n").nth(1)?).ok()?;
            Some(v["kernel_splice"].clone())
        })
        .join()
        .ok()
        .flatten()
        .unwrap_or_default()
    }
}

fn sh(words: &[&str]) -> Result<()> {
    let st = Command::new(words[0])
        .args(&words[1..])
        .status()
        .with_context(|| format!("running {words:?}"))?;
    if !st.success() {
        bail!("{words:?} failed");
    }
    Ok(())
}

/// `GET /bytes/N` on a fresh connection to `to`; the body's length. Stops reading at
/// `deadline` (the bytes so far count).
fn download(to: SocketAddr, n: u64, deadline: Option<Instant>) -> std::io::Result<u64> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /bytes/{n} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let k = s.read(&mut buf)?;
        if k == 0 {
            break;
        }
        total += k as u64;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    Ok(total)
}

/// Bulk downloads through `sys` for the configured time: bytes, seconds, the machine's busy
/// share and the proxy process's CPU time (ns).
fn bulk(
    c: &str,
    sys: System,
    args: &KspliceArgs,
    pid: Option<u32>,
) -> Result<(u64, f64, f64, Option<u64>)> {
    let d = Duration::from_secs(args.duration_s);
    let ticks = machine_cpu_ticks();
    let cpu0 = pid.and_then(|p| cpu_ns(p).ok());
    let t0 = Instant::now();
    let handles: Vec<_> = (0..args.bulk_connections)
        .map(|_| {
            in_ns(c, move || -> std::io::Result<u64> {
                let deadline = Instant::now() + d;
                let mut total = 0;
                while Instant::now() < deadline {
                    // One long download per connection: a long-lived bulk connection (the
                    // kernel splice takes over once, early in it).
                    total += download(sys.tcp(), 1 << 40, Some(deadline))?;
                }
                Ok(total)
            })
        })
        .collect();
    let mut bytes = 0;
    for h in handles {
        bytes += h
            .join()
            .map_err(|_| anyhow::anyhow!("a bulk client panicked"))?
            .with_context(|| format!("bulk through {}", sys.name()))?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let busy = machine_busy_since(ticks).unwrap_or(0.0);
    let proxy = match (pid, cpu0) {
        (Some(p), Some(a)) => cpu_ns(p).ok().map(|b| b.saturating_sub(a)),
        _ => None,
    };
    Ok((bytes, secs, busy, proxy))
}

/// `n` concurrent PUTs of `size` bytes through `sys`: mean and longest time of one, and of
/// all, in seconds.
fn puts(c: &str, sys: System, n: usize, size: usize) -> Result<(f64, f64, f64)> {
    let body = Arc::new(vec![b'x'; size]);
    let start = Arc::new(std::sync::Barrier::new(n));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (body, start) = (body.clone(), start.clone());
            in_ns(c, move || -> std::io::Result<f64> {
                start.wait();
                let t = Instant::now();
                let mut s = TcpStream::connect_timeout(&sys.tcp(), Duration::from_secs(10))?;
                s.set_read_timeout(Some(Duration::from_secs(120)))?;
                write!(
                    s,
                    "PUT /up HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )?;
                s.write_all(&body)?;
                let mut answer = String::new();
                s.read_to_string(&mut answer)?;
                if !answer.contains(&format!("received {} bytes", body.len())) {
                    return Err(std::io::Error::other(format!("bad answer: {answer}")));
                }
                Ok(t.elapsed().as_secs_f64())
            })
        })
        .collect();
    let mut times = Vec::new();
    for h in handles {
        times.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("a PUT client panicked"))?
                .with_context(|| format!("PUT through {}", sys.name()))?,
        );
    }
    let all = t0.elapsed().as_secs_f64();
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let longest = times.iter().copied().fold(0.0, f64::max);
    Ok((mean, longest, all))
}

/// `n` fresh connections, one after another, each `GET /bytes/100`: the time from connect to
/// the first response byte, median and p99 in µs. Every system connects to the PE afresh
/// for each (TCP listeners), so the difference between the proxy's two rows is what the
/// kernel splice adds: the watched connect (the hand-over never stands between a request and
/// its answer).
fn first_responses(c: &str, sys: System, n: usize) -> Result<(f64, f64)> {
    let mut us = in_ns(c, move || -> std::io::Result<Vec<f64>> {
        let mut us = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let mut s = TcpStream::connect_timeout(&sys.tcp(), Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"GET /bytes/100 HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
            let mut rest = Vec::new();
            s.read_to_end(&mut rest)?;
        }
        Ok(us)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the first-response client panicked"))?
    .with_context(|| format!("first responses through {}", sys.name()))?;
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us.get(((us.len() as f64 * q) as usize).min(us.len().saturating_sub(1)));
    Ok((
        at(0.5).copied().unwrap_or(0.0),
        at(0.99).copied().unwrap_or(0.0),
    ))
}

/// Rate limits on the veths' egress (htb), removed on drop (with the namespaces at worst).
pub(crate) struct Links(Vec<(String, String)>);

impl Links {
    pub(crate) fn limit<'a>(
        mbit: u64,
        devs: impl IntoIterator<Item = (&'a String, &'a str)>,
    ) -> Result<Links> {
        let mut links = Links(Vec::new());
        for (ns, dev) in devs {
            sh(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle",
                "1:", "htb", "default", "1",
            ])?;
            links.0.push((ns.clone(), dev.to_string()));
            sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                &format!("{mbit}mbit"),
                "quantum",
                "60000",
            ])?;
        }
        Ok(links)
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        for (ns, dev) in &self.0 {
            let _ = sh(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
            ]);
        }
    }
}

fn markdown(
    args: &KspliceArgs,
    systems: &[System],
    rows: &[Row],
    stats: &serde_json::Value,
) -> String {
    let mut md = report::provenance();
    let direct = rows.first().map_or(1.0, |r| r.bulk_mib_s.max(1e-9));
    let user_cpu = systems
        .iter()
        .zip(rows)
        .find(|(s, _)| **s == System::User)
        .and_then(|(_, r)| r.proxy_cpu_gib);
    let _ = writeln!(
        md,
        "Topology: client | proxy | server network namespaces joined by veth pairs; the PE is \
         `rserpool example http`; the proxy's namespace also routes (the direct path). Bulk: \
         {} connections downloading for {} s, {} rounds with the systems interleaved, \
         medians shown; client, server and proxy share the machine's cores. Limited: every \
         veth's egress at {} Mbit/s (htb).\n",
        args.bulk_connections, args.duration_s, args.rounds, args.link_mbit
    );
    let _ = writeln!(
        md,
        "| system | bulk MiB/s | × direct | × direct, rounds | machine CPU s/GiB | proxy CPU \
         s/GiB | × user space | limited MiB/s | first response median / p99 µs |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (s, r) in systems.iter().zip(rows) {
        let proxy = r.proxy_cpu_gib.map_or("-".into(), |v| format!("{v:.3}"));
        let vs_user = match (r.proxy_cpu_gib, user_cpu) {
            (Some(v), Some(u)) if u > 0.0 => format!("{:.2}", v / u),
            _ => "-".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.2} | {:.2}–{:.2} | {:.2} | {proxy} | {vs_user} | {} | {:.0} / {:.0} |",
            s.name(),
            r.bulk_mib_s,
            r.bulk_mib_s / direct,
            r.vs_direct.0,
            r.vs_direct.1,
            r.machine_cpu_gib,
            r.limited_mib_s.map_or("-".into(), |v| format!("{v:.0}")),
            r.first_us.0,
            r.first_us.1
        );
    }
    if args.link_mbit > 0 && !args.put_kb.is_empty() {
        let _ = writeln!(
            md,
            "\n{} concurrent PUTs over the limited hops (the seed's Tables 2–4): mean / \
             longest transfer, and the whole batch, seconds.\n",
            args.puts
        );
        let mut head = "| system |".to_string();
        let mut rule = "|---|".to_string();
        for kb in &args.put_kb {
            let _ = write!(head, " {kb} KB |");
            rule.push_str("---:|");
        }
        let _ = writeln!(md, "{head}\n{rule}");
        for (s, r) in systems.iter().zip(rows) {
            let mut line = format!("| {} |", s.name());
            for (mean, longest, all) in &r.puts {
                let _ = write!(line, " {mean:.2} / {longest:.2} / {all:.2} |");
            }
            let _ = writeln!(md, "{line}");
        }
    }
    let _ = writeln!(
        md,
        "\nThe kernel splice's own counters at the end: {} connections handed over, {} held \
         to drain, {} left in user space; a hand-over took {:.0} µs on average, {:.0} µs at \
         most (the connection's packets held meanwhile).\n",
        stats["handed_over"],
        stats["held_to_drain"],
        stats["user_space"],
        stats["handover_mean_us"].as_f64().unwrap_or(0.0),
        stats["handover_max_us"].as_f64().unwrap_or(0.0)
    );
    md
}
