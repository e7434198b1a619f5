//! `rserpool serve`: a sidecar that makes an existing TCP service a pool element.
//!
//! It checks the target with a TCP connect every check interval: after `--fall` failures in a
//! row it deregisters, after `--rise` successes it registers again (same PE identifier). For
//! adaptive policies it reads the target's load from the kernel — the accept backlog of its
//! listening socket plus its established connections, by sock_diag netlink
//! ([`rserpool_asap::metric::port_load`]) — and reports load = (backlog + established) /
//! capacity when it moved by at least the threshold, at most once per load interval. With
//! policy `credits` it samples the same figures every few milliseconds and pushes credits
//! (docs/CREDITS.md). With `--agent ADDR` it also answers HAProxy's agent-check there
//! ([`super::agent`]).

use crate::{CreditOpts, PeOpts};
use anyhow::{Context, Result, anyhow};
use clap::Args;
use rserpool_asap::metric::port_load;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::{info, warn};

#[derive(Args, Debug)]
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
    let credits = super::credit_source(
        &pe,
        &args.credits,
        args.capacity.max(1),
        rserpool_asap::MetricSource::Port(target),
    )?;
    // Credits are pushed by their own task; other adaptive policies report load here.
    let adaptive = pe.updater().policy().is_adaptive() && credits.is_none();
    let agent = super::agent::AgentState::new(healthy, credits.as_ref().map(|c| c.gauge()));
    if let Some(addr) = args.agent {
        let listener = super::agent::bind(addr).await?;
        info!("answering HAProxy's agent-check on {addr}");
        tokio::spawn(super::agent::run(listener, agent.clone()));
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
        if check(target, check_timeout).await {
            oks += 1;
            fails = 0;
            if !healthy && oks >= args.rise.max(1) {
                healthy = true;
                agent.set_healthy(true);
                info!("target {target} is back: registering");
                pe.set_active(true);
            }
        } else {
            fails += 1;
            oks = 0;
            if healthy && fails >= args.fall.max(1) {
                healthy = false;
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
    drop(credits);
    pe.stop().await;
    Ok(())
}

async fn check(target: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, TcpStream::connect(target)).await,
        Ok(Ok(_))
    )
}
