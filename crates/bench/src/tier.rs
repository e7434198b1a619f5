//! `rserpool-bench tier`: the fault-tolerant proxy tier (docs/TIER.md) measured as in the TCP
//! splice seed's Tables 2–7, with every hop limited by `tc` (htb) to the seed's 100 Mbit/s and
//! to 1 Gbit/s. Needs root.
//!
//! The tier's test network (client | router with registrar and distributor | proxies |
//! servers, `rserpool_ksplice::testbed::tier_topology`) is built afresh for every run. N
//! concurrent clients each upload (PUT) or download (GET) one object; a run reports the
//! average, shortest and longest transfer time, the time for all, the throughput, and the
//! longest stall a client saw (the longest wait for one write or read to make progress).
//!
//! - C-S: the clients talk to the servers directly (through the router).
//! - C-LB-P-S and C-LB-2P-S: through the distributor and one or two proxies (kernel splice).
//! - A failure: two proxies, one cut off (the router's bridge drops its frames, then SIGKILL:
//!   a machine that dies, so only the distributor's heartbeats find it) at half the
//!   no-failure time, for each heartbeat interval (3 misses = dead).
//! - C-LB-P-S*: one proxy with a split splice at both servers, for downloads (the answers
//!   bypass the proxy).

use crate::ksplice::Links;
use crate::process::Proc;
use anyhow::{Context, Result, bail};
use clap::Args;
use rserpool_ksplice::testbed::{TIER_VIP, TierNet, in_ns, tier_topology};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct TierArgs {
    /// Rate of every hop (each veth's egress), Mbit/s.
    #[arg(long, value_delimiter = ',', default_values_t = [100u64, 1000])]
    pub link_mbit: Vec<u64>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 100)]
    pub clients: usize,
    /// Size of each upload or download, KB.
    #[arg(long, default_value_t = 10_000)]
    pub size_kb: usize,
    /// Heartbeat intervals of the failure runs, ms.
    #[arg(long, value_delimiter = ',', default_values_t = [5000u64, 1000, 200, 100])]
    pub heartbeats_ms: Vec<u64>,
    /// Write the results section into this Markdown file (docs/TIER.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// One measured run.
#[derive(Debug, Clone)]
struct Run {
    name: String,
    mean: f64,
    min: f64,
    max: f64,
    all: f64,
    mbit: f64,
    /// The longest time one client waited for progress, s.
    stall: f64,
    /// The longest wait for progress that spanned the failure (without one: mid-run), s.
    at_failure: f64,
    /// Retransmission timeouts of the clients' TCP.
    rtos: u64,
    /// The share of the machine's CPU busy during the run, and of its busiest core.
    busy: Option<f64>,
    busiest: Option<f64>,
    /// Transfers that failed (a connection broken).
    broken: usize,
}

/// How proxy 1 dies in a failure run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Death {
    /// Its host goes silent, its link up: only the heartbeats find it.
    Silent,
    /// Its link goes down as well.
    LinkDown,
    /// Silent, with the distributor watching the traffic (`--watch`).
    Watched,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Path3 {
    Direct,
    Proxies { proxies: usize, split: bool },
}

impl Path3 {
    /// Through `proxies` proxies, without split splice.
    const fn via(proxies: usize) -> Path3 {
        Path3::Proxies {
            proxies,
            split: false,
        }
    }
}

pub fn run(args: TierArgs, bin: &Path) -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("the tier benchmark needs root (network namespaces, eBPF, tc)");
    }
    let size = args.size_kb * 1000;
    let mut s = crate::report::provenance();
    let _ = writeln!(
        s,
        "{} concurrent clients, {} KB each, every hop limited to the rate shown (tc htb on each \
         veth). Times in seconds; throughput = all bytes / time for all; longest stall = the \
         longest a client waited for one write (read) to make progress; stall at failure = \
         the longest such wait that spanned the failure (in a run without one: that spanned \
         the middle of the run, the same measure of the bottleneck's own waits); client RTOs \
         = the clients' TCP retransmission timeouts; CPU busy = the share of the machine's \
         CPU (all cores) busy during the run, and of its busiest core. Failure: proxy 1 cut \
         off by the router's bridge (its link up unless said) and its process killed at half \
         the no-failure time; the distributor finds it after 3 missed heartbeats, or, with \
         the traffic watch, once it has sent nothing for 20 ms while being sent frames.\n",
        args.clients, args.size_kb
    );
    for &mbit in &args.link_mbit {
        let mut ups = Vec::new();
        for (name, path) in [
            ("C-S (direct)", Path3::Direct),
            ("C-LB-P-S", Path3::via(1)),
            ("C-LB-2P-S", Path3::via(2)),
        ] {
            ups.push(measure(
                bin,
                mbit,
                path,
                true,
                args.clients,
                size,
                None,
                name,
            )?);
        }
        let half = ups[2].mean / 2.0;
        // Each heartbeat with a silent death; the shortest also with the link down (the
        // seed's failure) and with the traffic watch.
        let shortest = args.heartbeats_ms.iter().copied().min();
        let runs = args
            .heartbeats_ms
            .iter()
            .map(|&hb| (hb, Death::Silent))
            .chain(shortest.map(|hb| (hb, Death::LinkDown)))
            .chain(shortest.map(|hb| (hb, Death::Watched)));
        for (hb, death) in runs {
            let name = match death {
                Death::Silent => format!("C-LB-2P-S, failure, heartbeat {hb} ms"),
                Death::LinkDown => {
                    format!("C-LB-2P-S, failure with link down, heartbeat {hb} ms")
                }
                Death::Watched => {
                    format!("C-LB-2P-S, failure, heartbeat {hb} ms + traffic watch")
                }
            };
            ups.push(measure(
                bin,
                mbit,
                Path3::via(2),
                true,
                args.clients,
                size,
                Some((hb, Duration::from_secs_f64(half), death)),
                &name,
            )?);
        }
        let mut downs = Vec::new();
        for (name, path) in [
            ("C-S (direct)", Path3::Direct),
            ("C-LB-P-S", Path3::via(1)),
            (
                "C-LB-P-S* (split splice)",
                Path3::Proxies {
                    proxies: 1,
                    split: true,
                },
            ),
        ] {
            downs.push(measure(
                bin,
                mbit,
                path,
                false,
                args.clients,
                size,
                None,
                name,
            )?);
        }
        table(&mut s, &format!("Uploads (PUT), {mbit} Mbit/s hops"), &ups);
        table(
            &mut s,
            &format!("Downloads (GET), {mbit} Mbit/s hops"),
            &downs,
        );
    }
    print!("{s}");
    if let Some(path) = &args.markdown {
        crate::report::write_section(path, "tier", &s)?;
        eprintln!("results written to {}", path.display());
    }
    Ok(())
}

fn table(s: &mut String, title: &str, runs: &[Run]) {
    let base = runs.first().map_or(1.0, |r| r.mean);
    let _ = writeln!(s, "**{title}**\n");
    let _ = writeln!(
        s,
        "| path | average | vs direct | shortest | longest | all | Mbit/s | longest stall | stall at failure | client RTOs | broken | CPU busy (busiest core) |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in runs {
        let _ = writeln!(
            s,
            "| {} | {:.2} | {:.3}× | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} | {:.3} | {} | {} | {} |",
            r.name,
            r.mean,
            r.mean / base,
            r.min,
            r.max,
            r.all,
            r.mbit,
            r.stall,
            r.at_failure,
            r.rtos,
            r.broken,
            match (r.busy, r.busiest) {
                (Some(b), Some(c)) => format!("{:.0} % ({:.0} %)", b * 100.0, c * 100.0),
                _ => "–".to_string(),
            }
        );
    }
    let _ = writeln!(s);
}

/// The processes of one run, killed when dropped (before the namespaces go).
struct Bed {
    procs: Vec<Proc>,
    proxies: Vec<Option<Proc>>,
    /// The rate limits, removed before the namespaces go.
    links: Option<Links>,
    net: TierNet,
    dir: PathBuf,
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.proxies.clear();
        self.procs.clear();
        // RSERPOOL_BENCH_KEEP=1 keeps the processes' logs of the last run.
        if std::env::var_os("RSERPOOL_BENCH_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn spawn(bin: &Path, ns: &str, dir: &Path, log: &str, args: &[&str]) -> Result<Proc> {
    let mut c = std::process::Command::new("ip");
    c.args(["netns", "exec", ns]).arg(bin).args(args).env(
        "RUST_LOG",
        std::env::var("RSERPOOL_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
    );
    Proc::spawn(&mut c, &dir.join(format!("{log}.log")))
}

impl Bed {
    fn start(bin: &Path, mbit: u64, path: Path3, heartbeat_ms: u64, watch: bool) -> Result<Bed> {
        let net = tier_topology(2, 2).context("the tier network (root, clang)")?;
        let dir = std::env::temp_dir().join(format!("rserpool-bench-tier-{}", net.router));
        std::fs::create_dir_all(&dir)?;
        let mut bed = Bed {
            procs: Vec::new(),
            proxies: vec![None, None],
            links: None,
            net,
            dir,
        };
        let reg = format!("{}:3863", TierNet::ROUTER);
        let router = bed.net.router.clone();
        bed.procs.push(spawn(
            bin,
            &router,
            &bed.dir,
            "registrar",
            &["registrar", "--asap", &reg, "--status", "off"],
        )?);
        std::thread::sleep(Duration::from_millis(200));
        for j in 1..=2 {
            let ns = bed.net.servers[j - 1].clone();
            let listen = format!("{}:8080", TierNet::server_addr(j));
            let id = j.to_string();
            bed.procs.push(spawn(
                bin,
                &ns,
                &bed.dir,
                &format!("server{j}"),
                &[
                    "example",
                    "http",
                    "--pool",
                    "WebPool",
                    "--id",
                    &id,
                    "--listen",
                    &listen,
                    "--registrar",
                    &reg,
                ],
            )?);
        }
        // Every hop limited: both ends of every veth.
        let mut devs: Vec<(String, String)> = vec![
            (bed.net.client.clone(), "t0".into()),
            (router.clone(), "rc".into()),
        ];
        for i in 1..=2 {
            devs.push((bed.net.proxies[i - 1].clone(), "t0".into()));
            devs.push((router.clone(), format!("rp{i}")));
            devs.push((bed.net.servers[i - 1].clone(), "t0".into()));
            devs.push((router.clone(), format!("rs{i}")));
        }
        bed.links = Some(Links::limit(
            mbit,
            devs.iter().map(|(ns, dev)| (ns, dev.as_str())),
        )?);
        let Path3::Proxies { proxies, split } = path else {
            wait_for_get(
                &bed.net.client,
                SocketAddr::from((TierNet::server_addr(1), 8080)),
            )?;
            return Ok(bed);
        };
        if split {
            for j in 1..=2 {
                let ns = bed.net.servers[j - 1].clone();
                let args = bed.net.split_splice_args(j);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                bed.procs
                    .push(spawn(bin, &ns, &bed.dir, &format!("split{j}"), &args)?);
            }
        }
        for i in 1..=proxies {
            let file = bed.dir.join(format!("proxy{i}.toml"));
            std::fs::write(&file, bed.net.proxy_config(i, ""))?;
            let ns = bed.net.proxies[i - 1].clone();
            bed.proxies[i - 1] = Some(spawn(
                bin,
                &ns,
                &bed.dir,
                &format!("proxy{i}"),
                &["proxy", "--config", file.to_str().unwrap_or_default()],
            )?);
        }
        let args = TierNet::distributor_args(heartbeat_ms, watch);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        bed.procs
            .push(spawn(bin, &router, &bed.dir, "distributor", &args)?);
        // Up: the group has every proxy and a GET goes through.
        let t0 = Instant::now();
        loop {
            let members = bed.net.group_members(TierNet::GROUP);
            if members == proxies
                && wait_for_get(
                    &bed.net.client,
                    SocketAddr::V4(SocketAddrV4::new(TIER_VIP, 7000)),
                )
                .is_ok()
            {
                // The members' links (and the split servers') settle.
                std::thread::sleep(Duration::from_secs(2));
                return Ok(bed);
            }
            if t0.elapsed() > Duration::from_secs(60) {
                bail!("the tier did not come up: {members} of {proxies} proxies in the group");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A GET through `to` answers (within a few seconds).
fn wait_for_get(client: &str, to: SocketAddr) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let ok = in_ns(client, move || {
            let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            s.write_all(b"GET / HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut t = String::new();
            s.read_to_string(&mut t).ok()?;
            t.starts_with("HTTP/1.1 200").then_some(())
        })
        .join()
        .ok()
        .flatten();
        if ok.is_some() {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("no answer through {to}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One run: `clients` concurrent transfers of `size` bytes (uploads or downloads) along
/// `path`; with `failure` (heartbeat ms, when, how), proxy 1 dies during it.
#[allow(clippy::too_many_arguments)]
fn measure(
    bin: &Path,
    mbit: u64,
    path: Path3,
    upload: bool,
    clients: usize,
    size: usize,
    failure: Option<(u64, Duration, Death)>,
    name: &str,
) -> Result<Run> {
    let hb = failure.map_or(200, |(hb, _, _)| hb);
    let watch = failure.is_some_and(|(_, _, d)| d == Death::Watched);
    let mut bed = Bed::start(bin, mbit, path, hb, watch)?;
    eprintln!("{mbit} Mbit/s, {name}: running");
    let body = Arc::new(vec![b'x'; if upload { size } else { 0 }]);
    let start = Arc::new(std::sync::Barrier::new(clients + 1));
    let handles: Vec<_> = (0..clients)
        .map(|k| {
            let to = match path {
                Path3::Direct => SocketAddr::from((TierNet::server_addr(1 + k % 2), 8080)),
                Path3::Proxies { .. } => SocketAddr::V4(SocketAddrV4::new(TIER_VIP, 7000)),
            };
            let (body, start) = (body.clone(), start.clone());
            in_ns(&bed.net.client, move || {
                transfer(to, upload, size, body, start)
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    let ticks = crate::procfs::machine_cpu_ticks();
    let core_ticks = crate::procfs::core_cpu_ticks();
    if let Some((_, at, death)) = failure {
        std::thread::sleep(at);
        let out = std::process::Command::new("ip")
            .args([
                "-n",
                &bed.net.router,
                "nexthop",
                "bucket",
                "show",
                "id",
                "100",
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let on_first = text.lines().filter(|l| l.contains("nhid 1000")).count();
        // The time of day as the processes' logs print it, to find the death in them.
        let day = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            % 86_400.0;
        eprintln!(
            "  proxy 1 dies at {:02}:{:02}:{:06.3} UTC; {on_first} of {} buckets on nexthop 1000",
            (day / 3600.0) as u64,
            (day / 60.0) as u64 % 60,
            day % 60.0,
            text.lines().count()
        );
        // A machine that dies silently: the router's bridge drops every frame to and from it,
        // its link staying up, then its process. With `Death::LinkDown` its interface goes
        // down as well (the seed's failure: the bridge then floods the frames for its MAC to the
        // other proxies, which carry them at once: see docs/TIER.md).
        if death == Death::LinkDown {
            bed.net.cut_proxy(1);
        }
        bed.net.silence_proxy(1).map_err(anyhow::Error::msg)?;
        if let Some(mut p) = bed.proxies[0].take() {
            p.kill();
        }
    }
    let mut times = Vec::new();
    let mut stall: f64 = 0.0;
    let mut progress = Vec::new();
    let mut broken = 0;
    for h in handles {
        match h.join().map_err(|_| anyhow::anyhow!("a client panicked"))? {
            Ok((t, s, p)) => {
                times.push(t);
                stall = stall.max(s);
                progress.push(p);
            }
            Err(e) => {
                if broken == 0 {
                    eprintln!("  {name}: a transfer broke: {e}");
                }
                broken += 1;
            }
        }
    }
    let all = t0.elapsed().as_secs_f64();
    let busy = crate::procfs::machine_busy_since(ticks);
    let busiest = crate::procfs::busiest_core_since(&core_ticks);
    let counters = stack_counters(&bed.net.client);
    let count = |k: &str| counters.get(k).copied().unwrap_or(0);
    let rtos = count("TcpExt:TCPTimeouts");
    if failure.is_some() {
        eprintln!(
            "  the clients' TCP: {rtos} timeouts, {} retransmitted segments, {} ICMP \
             unreachables ({} out of window)",
            count("Tcp:RetransSegs"),
            count("Icmp:InDestUnreachs"),
            count("TcpExt:OutOfWindowIcmps")
        );
    }
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let mark = t0 + failure.map_or(Duration::from_secs_f64(mean / 2.0), |(_, at, _)| at);
    let at_failure = progress
        .iter()
        .filter_map(|p| {
            let after = p.iter().position(|t| *t > mark)?;
            let before = after.checked_sub(1).map_or(t0, |i| p[i]);
            Some((p[after] - before).as_secs_f64())
        })
        .fold(0.0, f64::max);
    let run = Run {
        name: name.to_string(),
        mean,
        min: times.iter().copied().fold(f64::INFINITY, f64::min),
        max: times.iter().copied().fold(0.0, f64::max),
        all,
        mbit: (times.len() * size) as f64 * 8.0 / all / 1e6,
        stall,
        at_failure,
        rtos,
        busy,
        busiest,
        broken,
    };
    eprintln!(
        "  average {:.2} s, longest {:.2} s, all {:.2} s, longest stall {:.2} s, at failure \
         {:.3} s, {} broken",
        run.mean, run.max, run.all, run.stall, run.at_failure, run.broken
    );
    Ok(run)
}

/// The network stack's counters in namespace `ns` (/proc/net/snmp and netstat), as
/// "Tcp:RetransSegs", "TcpExt:TCPTimeouts", …
fn stack_counters(ns: &str) -> std::collections::HashMap<String, u64> {
    let mut out = std::collections::HashMap::new();
    for file in ["/proc/net/snmp", "/proc/net/netstat"] {
        let Ok(o) = std::process::Command::new("ip")
            .args(["netns", "exec", ns, "cat", file])
            .output()
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let lines: Vec<&str> = text.lines().collect();
        // Each group is a line of names and a line of values, both starting "Prefix:".
        for pair in lines.chunks(2) {
            let [names, values] = pair else { continue };
            let mut n = names.split_whitespace();
            let mut v = values.split_whitespace();
            let (Some(prefix), Some(_)) = (n.next(), v.next()) else {
                continue;
            };
            for (name, value) in n.zip(v) {
                if let Ok(value) = value.parse() {
                    out.insert(format!("{prefix}{name}"), value);
                }
            }
        }
    }
    out
}

/// One client's transfer: its time and its longest wait for progress, s, and when it made
/// progress.
fn transfer(
    to: SocketAddr,
    upload: bool,
    size: usize,
    body: Arc<Vec<u8>>,
    start: Arc<std::sync::Barrier>,
) -> std::io::Result<(f64, f64, Vec<Instant>)> {
    start.wait();
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    let mut last = Instant::now();
    let mut stall: f64 = 0.0;
    let mut progress = Vec::new();
    let mut note = |last: &mut Instant| {
        let now = Instant::now();
        stall = stall.max((now - *last).as_secs_f64());
        progress.push(now);
        *last = now;
    };
    if upload {
        write!(
            s,
            "PUT /up HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )?;
        for piece in body.chunks(16 << 10) {
            s.write_all(piece)?;
            note(&mut last);
        }
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        if !answer.contains(&format!("received {size} bytes")) {
            return Err(std::io::Error::other(format!("bad answer: {answer}")));
        }
    } else {
        write!(
            s,
            "GET /bytes/{size} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
        )?;
        let mut buf = vec![0u8; 64 << 10];
        let mut got = 0usize;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
            note(&mut last);
        }
        if got < size {
            return Err(std::io::Error::other(format!("{got} of {size} bytes")));
        }
    }
    Ok((t.elapsed().as_secs_f64(), stall, progress))
}
