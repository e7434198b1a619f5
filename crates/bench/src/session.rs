//! `rserpool-bench session`: the ASAP session layer's failover time and the cost of its
//! cookies (docs/SESSION.md).
//!
//! A registrar and three `rserpool example calc` PEs run as processes; the pool user is the
//! library's `Session` in this process, driving calculator jobs. Each round kills the PE
//! serving the session (SIGKILL: the kernel closes its connections at once) or stops it
//! (SIGSTOP: silent, found only by the response timeout), and times the kill → the failure
//! seen by the session → the new PE's `RESUMED` (state restored from the echoed cookie). The
//! victim comes back before the next round. The cookie's cost is its bytes on the wire and the
//! CPU time to seal and to open one.

use crate::net::{free_port, local};
use crate::process::{Proc, wait_for};
use crate::report;
use anyhow::{Context, Result, bail};
use clap::Args;
use rserpool_asap::session::{CookieSealer, Session, SessionConfig, SessionEvent};
use rserpool_asap::{PoolUser, PoolUserConfig};
use rserpool_wire::mapping;
use rserpool_wire::{AsapMessage, Message};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const POOL: &str = "CalcPool";

#[derive(Args, Debug)]
pub struct SessionArgs {
    /// Failovers measured after SIGKILL.
    #[arg(long, default_value_t = 30)]
    pub kills: usize,
    /// Failovers measured after SIGSTOP (found by the response timeout).
    #[arg(long, default_value_t = 10)]
    pub stops: usize,
    /// The pool user's heartbeat interval and response timeout for the SIGSTOP rounds, ms.
    #[arg(long, default_value_t = 50)]
    pub heartbeat_ms: u64,
    #[arg(long, default_value_t = 200)]
    pub response_timeout_ms: u64,
    /// Cookies sealed and opened to time them.
    #[arg(long, default_value_t = 200_000)]
    pub cookie_ops: usize,
    /// Write the results section into this Markdown file (docs/SESSION.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

pub fn run(args: SessionArgs, bin: &Path) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("rserpool-bench-session-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run_in(&args, bin, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let section = result?;
    print!("{section}");
    if let Some(path) = &args.markdown {
        report::write_section(path, "session", &section)?;
        eprintln!("results written to {}", path.display());
    }
    Ok(())
}

/// One calc PE process and where it listens.
struct Pe {
    id: u32,
    addr: SocketAddr,
    proc: Option<Proc>,
}

fn start_pe(bin: &Path, dir: &Path, reg: SocketAddr, id: u32, addr: SocketAddr) -> Result<Proc> {
    let p = Proc::spawn(
        crate::product::command(bin)
            .args(["example", "calc", "--pool", POOL, "--id", &id.to_string()])
            .args([
                "--listen",
                &addr.to_string(),
                "--registrar",
                &reg.to_string(),
            ])
            .args(["--pool-secret", "bench secret", "--step-ms", "5"])
            .args(["--cookie-every", "4"]),
        &dir.join(format!("pe{id}.log")),
    )?;
    wait_for("a calc PE", Duration::from_secs(10), || {
        std::net::TcpStream::connect(addr).is_ok()
    })?;
    Ok(p)
}

/// One failover's times, ms: kill → seen, seen → resumed.
struct Sample {
    detect: f64,
    resume: f64,
}

fn run_in(args: &SessionArgs, bin: &Path, dir: &Path) -> Result<String> {
    let (_registrar, reg, status) = crate::product::start_registrar(bin, dir)?;
    let mut pes = Vec::new();
    for id in 1..=3 {
        let addr = local(free_port()?);
        let proc = start_pe(bin, dir, reg, id, addr)?;
        pes.push(Pe {
            id,
            addr,
            proc: Some(proc),
        });
    }
    let rt = rserpool::util::runtime()?;
    wait_pool(&rt, status, 3)?;
    let mut kills = Vec::new();
    let mut stops = Vec::new();
    for round in 0..args.kills + args.stops {
        let stop = round >= args.kills;
        let sample = rt.block_on(failover_round(args, reg, &mut pes, stop))?;
        eprintln!(
            "{} round {round}: seen after {:.1} ms, resumed {:.1} ms later",
            if stop { "SIGSTOP" } else { "SIGKILL" },
            sample.detect,
            sample.resume
        );
        if stop { &mut stops } else { &mut kills }.push(sample);
        // The victim returns (a stopped one is killed first).
        for pe in pes.iter_mut().filter(|p| p.proc.is_none()) {
            pe.proc = Some(start_pe(bin, dir, reg, pe.id, pe.addr)?);
        }
        wait_pool(&rt, status, 3)?;
    }
    let cookies = cookie_cost(args.cookie_ops);
    let worst = kills
        .iter()
        .chain(&stops)
        .map(|x| x.resume)
        .fold(0.0, f64::max);

    let mut s = report::provenance();
    let _ = writeln!(
        s,
        "A registrar and three `example calc` PEs (processes; steps of 5 ms, a cookie every 4 \
         steps, sealed) on loopback; the pool user is the library's `Session` in the benchmark \
         process. Each round kills the serving PE and times the failure as the session sees \
         it and the new PE's `RESUMED` (its state restored from the echoed cookie). Times in \
         ms.\n"
    );
    let _ = writeln!(
        s,
        "| failure | rounds | kill → seen, median | p95 | max | seen → resumed, median | p95 | max |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, v) in [
        ("SIGKILL (connection reset)".to_string(), &kills),
        (
            format!(
                "SIGSTOP (heartbeat {} ms, response timeout {} ms)",
                args.heartbeat_ms, args.response_timeout_ms
            ),
            &stops,
        ),
    ] {
        if v.is_empty() {
            continue;
        }
        let d: Vec<f64> = v.iter().map(|x| x.detect).collect();
        let r: Vec<f64> = v.iter().map(|x| x.resume).collect();
        let _ = writeln!(
            s,
            "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            v.len(),
            pct(&d, 0.5),
            pct(&d, 0.95),
            pct(&d, 1.0),
            pct(&r, 0.5),
            pct(&r, 0.95),
            pct(&r, 1.0)
        );
    }
    let _ = writeln!(
        s,
        "\nTarget, resumed within 100 ms of the failure being visible to the pool user: {} \
         (slowest {worst:.1} ms of {} failovers).",
        if worst <= 100.0 { "met" } else { "missed" },
        kills.len() + stops.len()
    );
    let _ = writeln!(
        s,
        "\nCookies of the calculator (state `calc1 N done count`, {} bytes): {} bytes sealed, \
         {} bytes on the wire with the COOKIE message and its DATA chunk ({} unsealed). CPU \
         per cookie, median of 5 runs of {} each: seal {:.2} µs, open (check) {:.2} µs; \
         unsealed {:.2} / {:.2} µs.\n",
        cookies.state,
        cookies.sealed,
        cookies.wire_sealed,
        cookies.wire_unsealed,
        args.cookie_ops,
        cookies.seal_us,
        cookies.open_us,
        cookies.seal_plain_us,
        cookies.open_plain_us
    );
    Ok(s)
}

fn pct(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

fn wait_pool(rt: &tokio::runtime::Runtime, status: SocketAddr, n: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let st = rt.block_on(rserpool::util::registrar_status(&[status]));
        let have = st
            .ok()
            .and_then(|s| s.pools.into_iter().find(|p| p.handle == POOL))
            .map_or(0, |p| p.pes.len());
        if have == n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the pool has {have} PEs, not {n}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One session: a job, its PE killed (or stopped) a few steps in, the failover timed.
async fn failover_round(
    args: &SessionArgs,
    reg: SocketAddr,
    pes: &mut [Pe],
    stop: bool,
) -> Result<Sample> {
    let pu = PoolUser::new(PoolUserConfig {
        registrars: vec![reg],
        ..PoolUserConfig::default()
    })?;
    let mut cfg = SessionConfig::new(POOL);
    if stop {
        cfg.heartbeat_interval = Duration::from_millis(args.heartbeat_ms);
        cfg.response_timeout = Duration::from_millis(args.response_timeout_ms);
    }
    let mut s = Session::connect(pu, cfg).await?;
    let first = s.pool_element().id;
    s.send(b"JOB 100000000").await?;
    let mut killed = None;
    let mut seen = None;
    let limit = Instant::now() + Duration::from_secs(30);
    loop {
        let ev = tokio::time::timeout_at(limit.into(), s.recv())
            .await
            .context("no failover within 30 s")??;
        match ev {
            SessionEvent::Message { data, .. } => {
                let line = String::from_utf8_lossy(&data);
                if killed.is_none() && line.starts_with("PROGRESS 6 ") {
                    let pe = pes
                        .iter_mut()
                        .find(|p| p.id == first)
                        .context("the session's PE is not one of ours")?;
                    let proc = pe.proc.as_ref().context("PE not running")?;
                    let pid = rustix::process::Pid::from_raw(proc.id() as i32)
                        .context("bad process ID")?;
                    let sig = if stop {
                        rustix::process::Signal::STOP
                    } else {
                        rustix::process::Signal::KILL
                    };
                    killed = Some(Instant::now());
                    rustix::process::kill_process(pid, sig)?;
                } else if line.starts_with("RESUMED") {
                    let (Some(k), Some(d)) = (killed, seen) else {
                        bail!("resumed without a failover");
                    };
                    let now = Instant::now();
                    // The victim is killed for good; it returns for the next round.
                    if let Some(pe) = pes.iter_mut().find(|p| p.id == first) {
                        pe.proc = None;
                    }
                    let d: Instant = d;
                    return Ok(Sample {
                        detect: (d - k).as_secs_f64() * 1e3,
                        resume: (now - d).as_secs_f64() * 1e3,
                    });
                }
            }
            SessionEvent::FailedOver(f) => {
                if !f.cookie_echoed {
                    bail!("failed over without a cookie");
                }
                seen = Some(f.detected.into_std());
            }
        }
    }
}

struct CookieCost {
    state: usize,
    sealed: usize,
    wire_sealed: usize,
    wire_unsealed: usize,
    seal_us: f64,
    open_us: f64,
    seal_plain_us: f64,
    open_plain_us: f64,
}

fn cookie_cost(ops: usize) -> CookieCost {
    let state = b"calc1 100000000 6000 783";
    let sealed = CookieSealer::new(POOL.into(), vec![b"bench secret".to_vec()]);
    let plain = CookieSealer::new(POOL.into(), Vec::new());
    let wire = |c: &CookieSealer| {
        let mut m = Vec::new();
        let _ = AsapMessage::Cookie {
            cookie: c.seal(state),
        }
        .encode(&mut m);
        let mut b = bytes::BytesMut::new();
        mapping::put_data(&mut b, rserpool_wire::ASAP_PPID, &m);
        b.len()
    };
    let time = |c: &CookieSealer| {
        let mut seal = Vec::new();
        let mut open = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let mut last = bytes::Bytes::new();
            for _ in 0..ops {
                last = std::hint::black_box(c.seal(std::hint::black_box(state)));
            }
            seal.push(t.elapsed().as_secs_f64() * 1e6 / ops as f64);
            let t = Instant::now();
            for _ in 0..ops {
                let _ = std::hint::black_box(c.open(std::hint::black_box(&last)));
            }
            open.push(t.elapsed().as_secs_f64() * 1e6 / ops as f64);
        }
        (
            report::median(seal).unwrap_or(f64::NAN),
            report::median(open).unwrap_or(f64::NAN),
        )
    };
    let (seal_us, open_us) = time(&sealed);
    let (seal_plain_us, open_plain_us) = time(&plain);
    CookieCost {
        state: state.len(),
        sealed: sealed.seal(state).len(),
        wire_sealed: wire(&sealed),
        wire_unsealed: wire(&plain),
        seal_us,
        open_us,
        seal_plain_us,
        open_plain_us,
    }
}
