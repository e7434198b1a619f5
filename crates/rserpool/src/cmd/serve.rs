//! `rserpool serve`: a sidecar that makes an existing TCP service a pool element.
//!
//! It checks the target with a TCP connect every check interval: after `--fall` failures in a
//! row it deregisters, after `--rise` successes it registers again (same PE identifier). For
//! adaptive policies it reads the target's load from the kernel — the accept backlog of its
//! listening socket plus its established connections, by sock_diag netlink
//! ([`rserpool_asap::metric::port_load`]) — and reports load = (backlog + established) /
//! capacity when it moved by at least the threshold, at most once per load interval. With
//! policy `credits` it samples the same figures every few milliseconds and pushes credits
//! (docs/CREDITS.md): the accept queue by one sock_diag lookup, the established connections
//! from an eBPF counter the kernel moves per connection event (`--count-connections`; with
//! root), corrected by a sock_diag dump once a second — a dump walks every TCP socket of the
//! host, too costly for every sample (docs/PERFORMANCE.md). With `--agent ADDR` it also answers HAProxy's agent-check there
//! ([`super::agent`]). With `--status ADDR` it serves its state as JSON (`/status`) and its
//! metrics (`/metrics`).

use crate::{CreditOpts, PeOpts};
use anyhow::{Context, Result, anyhow};
use clap::Args;
use rserpool_asap::metric::port_load;
use rserpool_asap::port_sampler::{ConnectionCount, PortSampler};
use rserpool_ksplice::conncount::ConnCounter;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::{info, warn};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ServeArgs {
    /// The service to register, HOST:PORT.
    #[arg(long)]
    pub target: String,
    /// Address pool users should connect to, if not the target's (e.g. a public address).
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// Health check (TCP connect) interval.
    #[arg(long, default_value_t = 1000)]
    pub check_interval_ms: u64,
    /// Health check connect timeout.
    #[arg(long, default_value_t = 1000)]
    pub check_timeout_ms: u64,
    /// Failed checks in a row that deregister the PE.
    #[arg(long, default_value_t = 2)]
    pub fall: u32,
    /// Successful checks in a row that register it again.
    #[arg(long, default_value_t = 1)]
    pub rise: u32,
    /// Connections (backlog + established) at which the reported load is 100%; with policy
    /// `credits`, the connections the target takes at once.
    #[arg(long, default_value_t = 100)]
    pub capacity: u32,
    /// Report the load when it changed by at least this fraction (0.05 = 5 points).
    #[arg(long, default_value_t = 0.05)]
    pub load_threshold: f64,
    /// At most one load report per this interval.
    #[arg(long, default_value_t = 1000)]
    pub load_interval_ms: u64,
    /// Answer HAProxy's agent-check here (HOST:PORT): `up ready N%` with the weight from the
    /// credits or the load, `down` while the target does not answer.
    #[arg(long)]
    pub agent: Option<SocketAddr>,
    /// `rserpool drain` deregisters the PE (the target goes on serving what reaches it;
    /// `--agent` says `drain`), `rserpool undrain` registers it again once the target is
    /// healthy.
    #[command(flatten)]
    pub control: super::control::ControlOpts,
    /// Status listener (HOST:PORT): the sidecar's state as JSON on `/status`, its metrics in
    /// the Prometheus format on `/metrics`. Off by default (one sidecar per service).
    #[arg(long)]
    pub status: Option<SocketAddr>,
    /// With policy `credits`, how the target's established connections are counted between
    /// the sock_diag dumps: `ebpf` (a sock_ops program on the root cgroup, moved per
    /// connection event; needs root and cgroup v2), `dump` (a dump every 100 ms), `auto`
    /// (eBPF where it loads, else dumps; says which).
    #[arg(long, default_value = "auto", value_parser = ["auto", "ebpf", "dump"])]
    pub count_connections: String,
    #[command(flatten)]
    pub pe: PeOpts,
    #[command(flatten)]
    pub credits: CreditOpts,
}

pub fn run(args: ServeArgs) -> Result<()> {
    super::init_logging();
    super::runtime()?.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let target = tokio::net::lookup_host(&args.target)
        .await
        .with_context(|| format!("cannot resolve --target {}", args.target))?
        .next()
        .ok_or_else(|| anyhow!("--target {} resolves to no address", args.target))?;
    let advertise = args.advertise.unwrap_or(target);
    let mut cfg = super::pe_config(&args.pe, advertise)?;
    super::set_capacity(&mut cfg, args.capacity.max(1));
    let check_timeout = Duration::from_millis(args.check_timeout_ms.max(1));
    let mut healthy = check(target, check_timeout).await;
    cfg.initially_active = healthy;
    let pe = rserpool_asap::PoolElement::start(cfg)?;
    super::report_status(&pe, &args.pe, advertise);
    let is_credits = matches!(pe.updater().policy(), rserpool_wire::Policy::Credits { .. });
    let sampler = if is_credits {
        sampler(target, &args.count_connections)?
    } else {
        PortSampler::new(target)
    };
    let counted_by = if sampler.counted() {
        "ebpf"
    } else {
        "sock_diag"
    };
    let credits = super::credit_source(
        &pe,
        &args.credits,
        args.capacity.max(1),
        rserpool_asap::MetricSource::Port(Box::new(sampler)),
    )?;
    // Credits are pushed by their own task; other adaptive policies report load here.
    let adaptive = pe.updater().policy().is_adaptive() && credits.is_none();
    let agent = super::agent::AgentState::new(healthy, credits.as_ref().map(|c| c.gauge()));
    if let Some(addr) = args.agent {
        let listener = super::agent::bind(addr).await?;
        info!("answering HAProxy's agent-check on {addr}");
        tokio::spawn(super::agent::run(listener, agent.clone()));
    }
    let seen = Arc::new(Seen::default());
    seen.target_up.store(healthy, Ordering::Relaxed);
    seen.healthy.store(healthy, Ordering::Relaxed);
    {
        let (pe, seen, agent) = (pe.updater(), seen.clone(), agent.clone());
        args.control
            .listen(args.pe.registrars.tls()?, move |drained| {
                seen.drained.store(drained, Ordering::Relaxed);
                agent.set_drained(drained);
                pe.set_active(!drained && seen.healthy.load(Ordering::Relaxed));
            })
            .await?;
    }
    if let Some(addr) = args.status {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for status on {addr}"))?;
        info!("status on http://{}/status", listener.local_addr()?);
        let view = StatusView {
            pool: args.pe.pool.clone(),
            pe: pe.id(),
            target,
            state: pe.watch_state(),
            seen: seen.clone(),
            credits: credits.as_ref().map(|c| c.gauge()),
            counted_by: credits.as_ref().map(|_| counted_by),
        };
        tokio::spawn(rserpool_status::serve(
            listener,
            &["/status", "/", "/metrics"],
            move |path| match path {
                "/metrics" => rserpool_status::Reply::metrics(view.metrics()),
                _ => rserpool_status::Reply::json(&view.status()),
            },
        ));
    }
    info!(
        "serving {target} as PE {:#010x} of pool {} (target {})",
        pe.id(),
        args.pe.pool,
        if healthy {
            "up"
        } else {
            "down: not registered until it answers"
        }
    );
    let mut ticker = tokio::time::interval(Duration::from_millis(args.check_interval_ms.max(10)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut fails, mut oks) = (0u32, 0u32);
    let mut reported: Option<f64> = None;
    let mut last_report = Instant::now() - Duration::from_secs(3600);
    let load_interval = Duration::from_millis(args.load_interval_ms);
    let mut warned_no_socket = false;
    let shutdown = super::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        let up = check(target, check_timeout).await;
        seen.checks.fetch_add(1, Ordering::Relaxed);
        seen.target_up.store(up, Ordering::Relaxed);
        if up {
            oks += 1;
            fails = 0;
            if !healthy && oks >= args.rise.max(1) {
                healthy = true;
                seen.healthy.store(true, Ordering::Relaxed);
                agent.set_healthy(true);
                if seen.drained.load(Ordering::Relaxed) {
                    info!("target {target} is back; drained, so not registering");
                } else {
                    info!("target {target} is back: registering");
                    pe.set_active(true);
                }
            }
        } else {
            fails += 1;
            oks = 0;
            seen.check_failures.fetch_add(1, Ordering::Relaxed);
            if healthy && fails >= args.fall.max(1) {
                healthy = false;
                seen.healthy.store(false, Ordering::Relaxed);
                agent.set_healthy(false);
                warn!("target {target} does not accept connections: deregistering");
                pe.set_active(false);
            }
        }
        if adaptive && healthy && last_report.elapsed() >= load_interval {
            match port_load(target) {
                Ok(Some(l)) => {
                    let f = (f64::from(l.backlog + l.established)
                        / f64::from(args.capacity.max(1)))
                    .min(1.0);
                    if reported.is_none_or(|r| (r - f).abs() >= args.load_threshold) {
                        agent.set_percent(((1.0 - f) * 100.0).round() as u32);
                        pe.update_load(f);
                        seen.load_reports.fetch_add(1, Ordering::Relaxed);
                        seen.load_permille
                            .store((f * 1000.0).round() as u64, Ordering::Relaxed);
                        reported = Some(f);
                        last_report = Instant::now();
                    }
                }
                Ok(None) if !warned_no_socket => {
                    warn!(
                        "no listening socket on port {}: not reporting load (is the target on this host, in this network namespace?)",
                        target.port()
                    );
                    warned_no_socket = true;
                }
                Err(e) if !warned_no_socket => {
                    warn!("cannot read the target's socket load (sock_diag): {e}");
                    warned_no_socket = true;
                }
                Ok(None) | Err(_) => {}
            }
        }
    }
    args.control.remove();
    drop(credits);
    pe.stop().await;
    super::sctp_settle().await;
    Ok(())
}

/// The sampler of `target` for credits, its established connections counted as `how` says.
fn sampler(target: SocketAddr, how: &str) -> Result<PortSampler> {
    let s = PortSampler::new(target);
    let every = rserpool_asap::port_sampler::DUMP_EVERY.as_millis();
    if how == "dump" {
        info!("counting the connections of {target} by sock_diag dumps every {every} ms");
        return Ok(s);
    }
    let attached = ConnCounter::attach().and_then(|mut c| c.watch(target).map(|()| c));
    match attached {
        Ok(counter) => {
            info!("counting the connections of {target} in the kernel (eBPF)");
            Ok(s.with_counter(Box::new(KernelCount { counter, target })))
        }
        Err(e) if how == "auto" => {
            info!(
                "counting the connections of {target} by sock_diag dumps every {every} ms (the \
                 kernel counter needs root: {e})"
            );
            Ok(s)
        }
        Err(e) => Err(anyhow!("--count-connections ebpf: {e}")),
    }
}

/// The eBPF counter of the target's port.
struct KernelCount {
    counter: ConnCounter,
    target: SocketAddr,
}

impl ConnectionCount for KernelCount {
    fn established(&mut self) -> std::io::Result<i64> {
        self.counter
            .read(self.target)
            .map(|c| c.established)
            .map_err(std::io::Error::other)
    }
}

async fn check(target: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, TcpStream::connect(target)).await,
        Ok(Ok(_))
    )
}

/// What the sidecar saw, for its status listener.
#[derive(Default)]
struct Seen {
    target_up: AtomicBool,
    /// Up by the rise and fall counts: registered unless drained.
    healthy: AtomicBool,
    /// An operator drained the PE (`rserpool drain`).
    drained: AtomicBool,
    checks: AtomicU64,
    check_failures: AtomicU64,
    load_reports: AtomicU64,
    /// The last load reported, in thousandths.
    load_permille: AtomicU64,
}

struct StatusView {
    pool: String,
    pe: u32,
    target: SocketAddr,
    state: tokio::sync::watch::Receiver<rserpool_asap::PeState>,
    seen: Arc<Seen>,
    credits: Option<rserpool_asap::CreditGauge>,
    /// How the target's connections are counted, with credits.
    counted_by: Option<&'static str>,
}

impl StatusView {
    fn status(&self) -> serde_json::Value {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.seen;
        let state = self.state.borrow().clone();
        let (home, registrar) = match &state {
            rserpool_asap::PeState::Registered { registrar, home } => {
                (Some(format!("{home:#010x}")), Some(registrar.to_string()))
            }
            _ => (None, None),
        };
        serde_json::json!({
            "pool": self.pool,
            "pe": format!("{:#010x}", self.pe),
            "target": self.target.to_string(),
            "target_up": s.target_up.load(Ordering::Relaxed),
            "drained": s.drained.load(Ordering::Relaxed),
            "state": format!("{state:?}"),
            "registered": home.is_some(),
            "home_registrar": home,
            "registrar": registrar,
            "checks": n(&s.checks),
            "check_failures": n(&s.check_failures),
            "load_reports": n(&s.load_reports),
            "load": n(&s.load_permille) as f64 / 1000.0,
            "credits": self.credits.as_ref().map(|g| g.credits()),
            "capacity": self.credits.as_ref().map(|g| g.capacity()),
            "credit_reports": self.credits.as_ref().map(|g| g.reports()),
            "connections_counted_by": self.counted_by,
        })
    }

    fn metrics(&self) -> rserpool_status::metrics::Exposition {
        let mut m = rserpool_status::metrics::Exposition::default();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.seen;
        let pe = format!("{:#010x}", self.pe);
        let labels = [("pool", self.pool.as_str()), ("pe", pe.as_str())];
        let registered = matches!(
            *self.state.borrow(),
            rserpool_asap::PeState::Registered { .. }
        );
        let bit = |b: bool| f64::from(u8::from(b));
        m.gauge(
            "rserpool_serve_registered",
            "1 while the PE is registered with a registrar.",
            &labels,
            bit(registered),
        );
        m.gauge(
            "rserpool_serve_target_up",
            "1 when the last health check of the target succeeded.",
            &labels,
            bit(s.target_up.load(Ordering::Relaxed)),
        );
        m.counter(
            "rserpool_serve_health_checks",
            "Health checks (TCP connects) of the target.",
            &labels,
            n(&s.checks),
        );
        m.counter(
            "rserpool_serve_health_check_failures",
            "Health checks of the target that failed.",
            &labels,
            n(&s.check_failures),
        );
        m.counter(
            "rserpool_serve_load_reports",
            "Load reports (re-registrations) sent.",
            &labels,
            n(&s.load_reports),
        );
        m.gauge(
            "rserpool_serve_load_ratio",
            "The last load reported, 0 to 1.",
            &labels,
            n(&s.load_permille) as f64 / 1000.0,
        );
        if let Some(g) = &self.credits {
            m.gauge(
                "rserpool_serve_credits",
                "Credits the target has left (the last pushed).",
                &labels,
                f64::from(g.credits()),
            );
            m.gauge(
                "rserpool_serve_credit_capacity",
                "Requests the target takes at once.",
                &labels,
                f64::from(g.capacity()),
            );
            m.counter(
                "rserpool_serve_credit_reports",
                "Credit reports sent.",
                &labels,
                g.reports(),
            );
        }
        rserpool_status::metrics::process(&mut m);
        m
    }
}
