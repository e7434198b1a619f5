//! The calculator: a stateful service that keeps its session through failures of its pool
//! elements, like rsplib's CalcApp. `rserpool example calc` is the PE, `rserpool session` the
//! pool user.
//!
//! A job counts the primes below N in steps of 10,000 numbers (paced by `--step-ms` to make
//! jobs long). The PE sends `PROGRESS done total` after every step and a cookie holding the
//! job (N, steps done, primes so far) every `--cookie-every` steps; a PE that receives the
//! cookie in a COOKIE_ECHO after a failover answers `RESUMED done total` and goes on from
//! there, so at most the steps since the last cookie are computed twice. Messages are
//! one-line ASCII, one per DATA chunk.

use crate::{PeOpts, RegistrarOpts};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use rserpool_asap::PoolUser;
use rserpool_asap::session::{
    CookieSealer, PeSession, PeSessionEvent, Session, SessionAcceptor, SessionConfig, SessionEvent,
};
use rserpool_wire::{PoolElement as PeEntry, PoolHandle, TransportAddress, UserTransport};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

/// Numbers per step.
pub const STEP: u64 = 10_000;
/// The largest job: 10^5 steps.
const MAX_JOB: u64 = 1_000_000_000;

/// The calculator PE's settings (`rserpool example calc`).
#[derive(Args, Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CalcOpts {
    /// calc: the pool secret that seals session cookies (HMAC-SHA256); every PE of the pool
    /// needs the same. Without one, cookies are not sealed and a pool user could forge its
    /// state. Visible in `ps`: prefer --pool-secret-file.
    #[arg(long, value_name = "TEXT")]
    pub pool_secret: Option<String>,
    /// calc: read the pool secret from the first line of this file.
    #[arg(long, value_name = "FILE")]
    pub pool_secret_file: Option<PathBuf>,
    /// calc: refuse cookies older than this [default: any age].
    #[arg(long, value_name = "MS")]
    pub cookie_max_age_ms: Option<u64>,
    /// calc: time each step of a job takes at least (a step is 10,000 numbers).
    #[arg(long, default_value_t = 20)]
    pub step_ms: u64,
    /// calc: send a cookie after every this many steps.
    #[arg(long, default_value_t = 5)]
    pub cookie_every: u64,
    /// calc: hand every pool user a business card naming this PE to fail over to
    /// (repeatable, in order).
    #[arg(long = "business-card", value_name = "ID@ADDR")]
    pub business_card: Vec<String>,
}

impl CalcOpts {
    fn secrets(&self) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        if let Some(s) = &self.pool_secret {
            out.push(s.as_bytes().to_vec());
        }
        if let Some(f) = &self.pool_secret_file {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the pool secret from {}", f.display()))?;
            let line = text.lines().next().unwrap_or("").trim();
            if line.is_empty() {
                bail!("{}: the pool secret is empty", f.display());
            }
            out.push(line.as_bytes().to_vec());
        }
        Ok(out)
    }

    fn business_card(&self) -> Result<Vec<PeEntry>> {
        self.business_card
            .iter()
            .map(|s| {
                let (id, addr) = s
                    .split_once('@')
                    .ok_or_else(|| anyhow!("--business-card {s:?}: expected ID@ADDR"))?;
                let id = super::parse_u32(id).map_err(|e| anyhow!("--business-card: {e}"))?;
                let addr = addr
                    .parse()
                    .map_err(|e| anyhow!("--business-card {s:?}: {e}"))?;
                Ok(PeEntry {
                    id,
                    home_registrar: 0,
                    registration_life: -1,
                    user_transport: UserTransport::Address(TransportAddress::tcp(addr)),
                    policy: rserpool_wire::Policy::RoundRobin,
                    asap_transport: None,
                })
            })
            .collect()
    }
}

/// What every session of the PE shares.
struct Calc {
    acceptor: SessionAcceptor,
    pool: PoolHandle,
    card: Vec<PeEntry>,
    step: Duration,
    cookie_every: u64,
}

/// `rserpool example calc`: the service on `listen`, registered by `pe`'s settings.
pub fn run_pe(listen: std::net::SocketAddr, pe: PeOpts, o: CalcOpts) -> Result<()> {
    super::init_logging();
    let o = &o;
    let sealer = CookieSealer::new(PoolHandle::from(pe.pool.as_str()), o.secrets()?)
        .with_max_age(o.cookie_max_age_ms.map(Duration::from_millis));
    if !sealer.sealed() {
        warn!("no pool secret: session cookies are not sealed, a pool user could forge its state");
    }
    let calc = Arc::new(Calc {
        acceptor: SessionAcceptor::new(sealer),
        pool: PoolHandle::from(pe.pool.as_str()),
        card: o.business_card()?,
        step: Duration::from_millis(o.step_ms),
        cookie_every: o.cookie_every.max(1),
    });
    super::runtime()?.block_on(async move {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        let opts = pe;
        let pe = rserpool_asap::PoolElement::start(super::pe_config(&opts, addr)?)?;
        super::report_status(&pe, &opts, addr);
        info!(
            "calc service at {addr} is PE {:#010x} of pool {}",
            pe.id(),
            opts.pool
        );
        let accept = async {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                let session = calc.acceptor.accept(stream);
                let calc = calc.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(session, &calc).await {
                        debug!("session from {peer}: {e:#}");
                    }
                });
            }
        };
        tokio::select! {
            () = accept => {}
            () = super::shutdown_signal() => {}
        }
        pe.stop().await;
        super::sctp_settle().await;
        Ok(())
    })
}

/// A job: the primes below `n`, `done` steps of it counted (`count` primes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Job {
    n: u64,
    done: u64,
    count: u64,
}

impl Job {
    fn steps(&self) -> u64 {
        self.n.div_ceil(STEP)
    }

    fn state(&self) -> String {
        format!("calc1 {} {} {}", self.n, self.done, self.count)
    }

    fn from_state(s: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(s).ok()?;
        let mut w = s.strip_prefix("calc1 ")?.split(' ');
        let mut next = || w.next()?.parse::<u64>().ok();
        let job = Self {
            n: next()?,
            done: next()?,
            count: next()?,
        };
        (job.n <= MAX_JOB && job.done <= job.steps()).then_some(job)
    }

    /// Counts the primes of the next step.
    fn step(&mut self) {
        let from = self.done * STEP;
        let to = (from + STEP).min(self.n);
        self.count += (from..to).filter(|&k| is_prime(k)).count() as u64;
        self.done += 1;
    }
}

fn is_prime(k: u64) -> bool {
    if k < 2 {
        return false;
    }
    if k.is_multiple_of(2) {
        return k == 2;
    }
    let mut d = 3;
    while d * d <= k {
        if k.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// One session: jobs one after another, each started by `JOB n` or resumed from a cookie.
async fn serve(mut s: PeSession, calc: &Calc) -> Result<()> {
    if !calc.card.is_empty() {
        s.send_business_card(calc.pool.clone(), None, calc.card.clone())
            .await?;
    }
    loop {
        let mut job = match s.recv().await? {
            None => return Ok(()),
            Some(PeSessionEvent::Resume(state)) => {
                let Some(job) = Job::from_state(&state) else {
                    s.send(b"ERROR bad job state").await?;
                    bail!("a cookie with a bad job state");
                };
                info!(
                    "session from {}: resumed job {} at step {}/{}",
                    s.peer(),
                    job.n,
                    job.done,
                    job.steps()
                );
                s.send(format!("RESUMED {} {}", job.done, job.steps()).as_bytes())
                    .await?;
                job
            }
            Some(PeSessionEvent::Message { data, .. }) => {
                let n = std::str::from_utf8(&data)
                    .ok()
                    .and_then(|l| l.strip_prefix("JOB "))
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .filter(|&n| n <= MAX_JOB);
                let Some(n) = n else {
                    s.send(format!("ERROR expected JOB n (n at most {MAX_JOB})").as_bytes())
                        .await?;
                    continue;
                };
                debug!("session from {}: job {n}", s.peer());
                Job {
                    n,
                    done: 0,
                    count: 0,
                }
            }
        };
        let mut tick = tokio::time::interval(calc.step);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while job.done < job.steps() {
            tokio::select! {
                // Keeps heartbeats answered; the PU has nothing to say during a job.
                e = s.recv() => match e? {
                    None => return Ok(()),
                    Some(_) => continue,
                },
                _ = tick.tick() => {}
            }
            job.step();
            s.send(format!("PROGRESS {} {}", job.done, job.steps()).as_bytes())
                .await?;
            if job.done % calc.cookie_every == 0 || job.done == job.steps() {
                s.send_cookie(job.state().as_bytes()).await?;
            }
        }
        s.send(format!("RESULT {} {}", job.count, job.n).as_bytes())
            .await?;
    }
}

/// `rserpool session`.
#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SessionArgs {
    /// Pool handle of the calculator pool.
    pub pool: String,
    /// Count the primes below this number.
    #[arg(long, default_value_t = 1_000_000)]
    pub job: u64,
    /// A heartbeat goes to the PE when nothing was heard from it for this long.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// Fail over when nothing was heard from the PE for this long.
    #[arg(long, default_value_t = 2000)]
    pub response_timeout_ms: u64,
    /// Give up when no PE could be reached for this long.
    #[arg(long, default_value_t = 10_000)]
    pub failover_timeout_ms: u64,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

pub fn run_session(args: SessionArgs) -> Result<()> {
    super::init_logging();
    if args.job > MAX_JOB {
        bail!("--job: at most {MAX_JOB}");
    }
    let mut cfg = SessionConfig::new(args.pool.as_str());
    cfg.heartbeat_interval = Duration::from_millis(args.heartbeat_ms.max(1));
    cfg.response_timeout = Duration::from_millis(args.response_timeout_ms.max(1));
    cfg.failover_timeout = Duration::from_millis(args.failover_timeout_ms);
    let pu_cfg = super::pu_config(&args.registrars)?;
    super::runtime()?.block_on(async move {
        let start = Instant::now();
        let pu = PoolUser::new(pu_cfg)?;
        let mut s = Session::connect(pu, cfg).await?;
        let steps = args.job.div_ceil(STEP);
        println!(
            "session with PE {:#010x}: counting the primes below {} ({steps} steps)",
            s.pool_element().id,
            args.job
        );
        let job = format!("JOB {}", args.job);
        s.send(job.as_bytes()).await?;
        let (mut seen, mut redone, mut failed_at) = (0u64, 0u64, None);
        loop {
            let data = match s.recv().await? {
                SessionEvent::FailedOver(f) => {
                    println!(
                        "failed over from PE {:#010x} to PE {:#010x} after {}, in {:.1} ms; {}",
                        f.from,
                        f.to,
                        f.cause,
                        f.took.as_secs_f64() * 1e3,
                        if f.cookie_echoed {
                            "cookie echoed"
                        } else {
                            "no cookie yet: job restarted"
                        }
                    );
                    failed_at = Some(f.detected);
                    if !f.cookie_echoed {
                        redone += seen;
                        seen = 0;
                        s.send(job.as_bytes()).await?;
                    }
                    continue;
                }
                SessionEvent::Message { data, .. } => data,
            };
            let line = String::from_utf8_lossy(&data);
            let mut w = line.split(' ');
            let (word, a, b) = (
                w.next().unwrap_or(""),
                w.next().and_then(|v| v.parse::<u64>().ok()),
                w.next().and_then(|v| v.parse::<u64>().ok()),
            );
            match (word, a, b) {
                ("PROGRESS", Some(done), Some(total)) => {
                    if done * 10 / total.max(1) > seen * 10 / total.max(1) {
                        println!(
                            "progress {done}/{total} on PE {:#010x}",
                            s.pool_element().id
                        );
                    }
                    seen = seen.max(done);
                }
                ("RESUMED", Some(done), Some(total)) => {
                    let again = seen.saturating_sub(done);
                    redone += again;
                    let after = failed_at
                        .take()
                        .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                    println!(
                        "resumed at step {done}/{total} on PE {:#010x}, {after:.1} ms after the \
                         failure was seen (last progress seen {seen}: {again} {} to redo)",
                        s.pool_element().id,
                        plural(again, "step")
                    );
                    seen = done;
                }
                ("RESULT", Some(count), Some(n)) => {
                    let st = s.stats();
                    println!(
                        "result: {count} primes below {n}; {} {}, {redone} {} redone, \
                         {} cookies ({} bytes), {:.2} s",
                        st.failovers,
                        plural(st.failovers, "failover"),
                        plural(redone, "step"),
                        st.cookies,
                        st.cookie_bytes,
                        start.elapsed().as_secs_f64()
                    );
                    return Ok(());
                }
                _ => bail!("PE {:#010x} answered {line:?}", s.pool_element().id),
            }
        }
    })
}

fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        word.to_string()
    } else {
        format!("{word}s")
    }
}
