//! `rserpool-bench upgrade`: upgrading a proxy under load, rserpool's hand-over (a second
//! process started with the same configuration takes the listening sockets over) beside
//! HAProxy's master-worker reload (`kill -USR2` of the master, listeners passed on through a
//! stats socket with `expose-fd listeners`), in one run on one machine (docs/OPERATIONS.md).
//!
//! Each system serves the proxy bench's bed (nginx backends made pool elements by sidecars).
//! wrk drives it twice for the same time, with kept-alive connections and with a new connection
//! per request: once steady, once while it is upgraded `--upgrades` times, one every
//! `--interval-ms`. What counts: connections refused (wrk's connect errors), other socket
//! errors, non-2xx answers, and p99 and maximum latency during the upgrades against steady state.

use crate::process::Proc;
use crate::proxy::bed::Bed;
use crate::proxy::wrk::{Wrk, parse_wrk};
use crate::proxy::{POOL, SMALL};
use crate::report::{machine, write_section};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
pub struct UpgradeArgs {
    /// Upgrades in a row during each measured run.
    #[arg(long, default_value_t = 10)]
    pub upgrades: u32,
    /// Time between two upgrades.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// wrk's connections.
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Where the results go (a generated section).
    #[arg(long, default_value = "docs/OPERATIONS.md")]
    pub output: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum System {
    Rserpool,
    Haproxy,
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::Rserpool => "rserpool",
            System::Haproxy => "HAProxy",
        }
    }
}

/// One wrk run's figures.
struct Row {
    system: System,
    close: bool,
    upgrading: bool,
    wrk: Wrk,
    /// Upgrades done during the run (for rserpool: hand-overs the log confirms).
    upgrades: u32,
}

pub fn run(args: UpgradeArgs, rserpool: &Path) -> Result<()> {
    if args.upgrades == 0 || args.interval_ms < 100 {
        bail!("--upgrades must be at least 1 and --interval-ms at least 100");
    }
    which("wrk")?;
    which("haproxy")?;
    let bed = Bed::start(&[], rserpool, false)?;
    let run_for = Duration::from_millis(args.interval_ms * u64::from(args.upgrades + 1));
    let mut rows = Vec::new();
    for system in [System::Rserpool, System::Haproxy] {
        for close in [false, true] {
            for upgrading in [false, true] {
                let mut front = Front::start(&bed, system)?;
                let row = measure(&mut front, &args, run_for, close, upgrading)?;
                eprintln!(
                    "{} {} {}: {:.0} req/s, p99 {:.2} ms, max {:.1} ms, refused {}, socket errors {:?}, non-2xx {}, upgrades {}",
                    system.label(),
                    if close {
                        "new connections"
                    } else {
                        "keep-alive"
                    },
                    if upgrading { "upgrading" } else { "steady" },
                    row.wrk.rps,
                    row.wrk.p99_ms,
                    row.wrk.max_ms,
                    row.wrk.socket[0],
                    row.wrk.socket,
                    non_2xx(&row.wrk),
                    row.upgrades
                );
                rows.push(Row {
                    system,
                    close,
                    upgrading,
                    upgrades: row.upgrades,
                    wrk: row.wrk,
                });
            }
        }
    }
    let text = report(&args, &rows);
    print!("{text}");
    write_section(&args.output, "upgrade", &text)?;
    eprintln!("written to {}", args.output.display());
    Ok(())
}

fn which(tool: &str) -> Result<()> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if found {
        Ok(())
    } else {
        Err(anyhow!("{tool} is not installed"))
    }
}

fn non_2xx(w: &Wrk) -> u64 {
    w.errors - w.socket.iter().sum::<u64>()
}

/// A system under test with one HTTP listener onto the bed's pool.
struct Front {
    system: System,
    http: SocketAddr,
    conf: PathBuf,
    dir: PathBuf,
    /// Every process started; the current one last.
    procs: Vec<Proc>,
    rserpool: PathBuf,
}

impl Front {
    fn start(bed: &Bed, system: System) -> Result<Front> {
        let http = crate::net::local(crate::net::free_port()?);
        let dir = bed
            .dir
            .join(format!("upgrade-{}", system.label().to_lowercase()));
        std::fs::create_dir_all(&dir)?;
        let conf = dir.join("proxy.conf");
        let text = match system {
            System::Rserpool => format!(
                "registrars = [\"{}\"]\ndrain-timeout-ms = 30000\n\n\
                 [[listener]]\nlisten = \"{http}\"\nmode = \"http\"\npool = \"{POOL}\"\n",
                bed.registrar
            ),
            System::Haproxy => haproxy_config(http, &bed.backends, &dir),
        };
        std::fs::write(&conf, text)?;
        let mut front = Front {
            system,
            http,
            conf,
            dir,
            procs: Vec::new(),
            rserpool: bed.rserpool.clone(),
        };
        front.spawn()?;
        crate::process::wait_for("the proxy", Duration::from_secs(15), || small_ok(http))?;
        Ok(front)
    }

    fn spawn(&mut self) -> Result<()> {
        let n = self.procs.len();
        let log = self.dir.join(format!("proxy-{n}.log"));
        let mut cmd = match self.system {
            System::Rserpool => {
                let mut c = Command::new(&self.rserpool);
                c.args(["proxy", "--config"])
                    .arg(&self.conf)
                    .env("RUST_LOG", "info")
                    .env("NO_COLOR", "1");
                c
            }
            System::Haproxy => {
                let mut c = Command::new("haproxy");
                c.args(["-W", "-db", "-f"]).arg(&self.conf);
                c
            }
        };
        self.procs.push(Proc::spawn(&mut cmd, &log)?);
        Ok(())
    }

    /// One upgrade: rserpool, a second process with the same configuration; HAProxy, SIGUSR2
    /// to its master.
    fn upgrade(&mut self) -> Result<()> {
        match self.system {
            System::Rserpool => self.spawn(),
            System::Haproxy => {
                let master = self
                    .procs
                    .first()
                    .ok_or_else(|| anyhow!("no HAProxy master"))?;
                let pid = rustix::process::Pid::from_raw(master.id() as i32)
                    .ok_or_else(|| anyhow!("bad pid"))?;
                rustix::process::kill_process(pid, rustix::process::Signal::USR2)
                    .context("signalling HAProxy's master")?;
                Ok(())
            }
        }
    }

    /// rserpool processes that say they took over.
    fn hand_overs(&self) -> u32 {
        (1..self.procs.len())
            .filter(|n| {
                std::fs::read_to_string(self.dir.join(format!("proxy-{n}.log")))
                    .is_ok_and(|l| l.contains("stopped accepting; this one serves"))
            })
            .count() as u32
    }
}

fn small_ok(http: SocketAddr) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(http) else {
        return false;
    };
    use std::io::{Read, Write};
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(
        format!("GET {SMALL} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// HAProxy in master-worker mode: the listeners go to each new worker through the stats
/// socket (`expose-fd listeners`), the old worker finishes its connections (soft stop).
fn haproxy_config(http: SocketAddr, backends: &[SocketAddr], dir: &Path) -> String {
    let servers: String = backends
        .iter()
        .enumerate()
        .map(|(i, b)| format!("    server b{i} {b} check\n"))
        .collect();
    format!(
        "global\n    master-worker\n    nbthread 2\n    maxconn 8000\n\
         \x20   stats socket {sock} mode 600 expose-fd listeners level user\n\n\
         defaults\n    mode http\n    timeout connect 1s\n    timeout client 60s\n\
         \x20   timeout server 60s\n    timeout http-keep-alive 60s\n    retries 3\n\
         \x20   option redispatch\n\n\
         frontend web\n    bind {http}\n    http-reuse always\n    default_backend pool\n\n\
         backend pool\n    balance roundrobin\n    http-reuse always\n{servers}",
        sock = dir.join("haproxy.sock").display()
    )
}

struct Measured {
    wrk: Wrk,
    upgrades: u32,
}

fn measure(
    front: &mut Front,
    args: &UpgradeArgs,
    run_for: Duration,
    close: bool,
    upgrading: bool,
) -> Result<Measured> {
    let mut cmd = Command::new("wrk");
    cmd.args(["-t1", "-c", &args.connections.to_string()])
        .args(["-d", &format!("{}s", run_for.as_secs().max(1))])
        .arg("--latency");
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    let child = cmd
        .arg(format!("http://{}{SMALL}", front.http))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting wrk")?;
    let mut done = 0;
    if upgrading {
        let start = Instant::now();
        for i in 1..=args.upgrades {
            let at = Duration::from_millis(args.interval_ms * u64::from(i));
            std::thread::sleep(at.saturating_sub(start.elapsed()));
            front.upgrade()?;
            done += 1;
        }
    }
    let out = child.wait_with_output().context("waiting for wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let wrk = parse_wrk(&text).ok_or_else(|| anyhow!("cannot read wrk's output:\n{text}"))?;
    let upgrades = match (front.system, upgrading) {
        (System::Rserpool, true) => front.hand_overs(),
        _ => done,
    };
    Ok(Measured { wrk, upgrades })
}

fn report(args: &UpgradeArgs, rows: &[Row]) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "Measured with `cargo run --release -p rserpool-bench -- upgrade --upgrades {} --interval-ms {} --connections {}` \
         on {}. wrk (one thread, {} connections) fetches a 612-byte file through each proxy for {} s, steady and \
         while the proxy is upgraded {} times, one every {} ms: rserpool by starting a second process with the same \
         configuration (hand-over), HAProxy {} by `kill -USR2` of its master (master-worker, `expose-fd listeners`). \
         Each run starts a fresh proxy.\n\n",
        args.upgrades,
        args.interval_ms,
        args.connections,
        machine(),
        args.connections,
        args.interval_ms * u64::from(args.upgrades + 1) / 1000,
        args.upgrades,
        args.interval_ms,
        haproxy_version(),
    ));
    t.push_str("| system | connections | run | upgrades | requests/s | p50 ms | p99 ms | max ms | refused | other socket errors | non-2xx |\n");
    t.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let w = &r.wrk;
        t.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} | {} |\n",
            r.system.label(),
            if r.close {
                "new per request"
            } else {
                "kept alive"
            },
            if r.upgrading { "upgrading" } else { "steady" },
            if r.upgrading {
                r.upgrades.to_string()
            } else {
                "-".into()
            },
            w.rps,
            w.p50_ms,
            w.p99_ms,
            w.max_ms,
            w.socket[0],
            w.socket[1..].iter().sum::<u64>(),
            non_2xx(w),
        ));
    }
    t.push_str("\np99 while upgrading against steady state (target ≤ 2×):\n\n");
    for system in [System::Rserpool, System::Haproxy] {
        for close in [false, true] {
            let find = |up: bool| {
                rows.iter()
                    .find(|r| r.system == system && r.close == close && r.upgrading == up)
            };
            if let (Some(s), Some(u)) = (find(false), find(true)) {
                t.push_str(&format!(
                    "- {} {}: {:.2}× (max {:.1} ms against {:.1} ms)\n",
                    system.label(),
                    if close {
                        "new connections"
                    } else {
                        "kept alive"
                    },
                    u.wrk.p99_ms / s.wrk.p99_ms.max(1e-6),
                    u.wrk.max_ms,
                    s.wrk.max_ms
                ));
            }
        }
    }
    t.push('\n');
    t
}

fn haproxy_version() -> String {
    Command::new("haproxy")
        .arg("-v")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .nth(2)
                .map(str::to_string)
        })
        .unwrap_or_default()
}
