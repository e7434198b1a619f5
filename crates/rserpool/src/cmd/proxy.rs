//! `rserpool proxy`: the front-end proxy, from a TOML file (`--config`) or, for one listener,
//! from flags. SIGTERM or Ctrl-C drains it; SIGHUP reads the file again.

use anyhow::{Context, Result, anyhow};
use clap::Args;
use rserpool_proxy::handover::{self, Inherited};
use rserpool_proxy::{ListenerConfig, Mode, Proxy, ProxyConfig, Select};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// TOML file with settings and listeners (see `--print-config`); SIGHUP re-reads it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// One listener: the address clients connect to.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// One listener: the pool its connections or requests go to.
    #[arg(long)]
    pub pool: Option<String>,
    /// One listener: tcp or http.
    #[arg(long, default_value = "http", value_parser = ["tcp", "http"])]
    pub mode: String,
    /// One listener: how its pool's PEs are chosen: by the pool's own `policy` (as its PEs
    /// registered it), or by this proxy's own view: `least-connections`, `p2c` (power of two
    /// choices) or `prequal` (Prequal-style hot-cold selection).
    #[arg(long, value_name = "HOW", value_parser = Select::NAMES)]
    pub select: Option<String>,
    /// Registrar ASAP address (repeatable, tried in order; `sctp+udp://ADDR` for SCTP over
    /// UDP); overrides the file's.
    #[arg(long = "registrar", value_name = "ADDR")]
    pub registrars: Vec<rserpool_wire::Address>,
    /// Status listener: per-PE counters as JSON on http://ADDR/status; `off` for none
    /// (overrides the file's).
    #[arg(long, visible_alias = "stats", value_name = "ADDR", value_parser = status_addr)]
    pub status: Option<StatusAddr>,
    /// Append a line per request or connection to FILE (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    pub access_log: Option<PathBuf>,
    /// Worker threads (0 = one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// How often the pools are fetched from a registrar.
    #[arg(long)]
    pub refresh_ms: Option<u64>,
    /// Send rsplib's Component Status reports to this monitor (`cspmonitor`, UDP 2960);
    /// overrides the file's `csp`. rsplib's `CSP_SERVER` works too.
    #[arg(long, env = "CSP_SERVER", value_name = "ADDR", value_parser = super::parse_csp_monitor)]
    pub csp: Option<SocketAddr>,
}

/// `--status`: an address, or none (`off`).
#[derive(Debug, Clone, Copy, serde::Serialize)]
#[serde(transparent)]
pub struct StatusAddr(pub Option<SocketAddr>);

fn status_addr(s: &str) -> Result<StatusAddr, String> {
    match s {
        "off" | "none" => Ok(StatusAddr(None)),
        _ => s
            .parse()
            .map(|a| StatusAddr(Some(a)))
            .map_err(|e| format!("{e}: an address (127.0.0.1:8404), or `off`")),
    }
}
pub fn load(args: &ProxyArgs) -> Result<ProxyConfig> {
    let mut cfg = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            ProxyConfig::from_toml(&text)
                .with_context(|| format!("bad settings in {}", p.display()))?
        }
        None => ProxyConfig::default(),
    };
    if let Some(listen) = args.listen {
        let pool = args
            .pool
            .clone()
            .ok_or_else(|| anyhow!("--listen needs --pool"))?;
        let mode = if args.mode == "tcp" {
            Mode::Tcp
        } else {
            Mode::Http
        };
        cfg.listeners.retain(|l| l.listen != listen);
        if let Some(how) = &args.select {
            let select: Select = how.parse().map_err(|e: String| anyhow!(e))?;
            cfg.pool_settings.entry(pool.clone()).or_default().select = select;
        }
        cfg.listeners.push(ListenerConfig {
            listen,
            mode,
            pool: Some(pool),
            routes: Vec::new(),
            splice: None,
            certificates: Vec::new(),
            http2: true,
            defer_accept: None,
        });
    } else if args.pool.is_some() || args.select.is_some() {
        return Err(anyhow!("--pool and --select need --listen"));
    }
    if !args.registrars.is_empty() {
        cfg.registrars = args.registrars.clone();
    }
    if let Some(StatusAddr(status)) = args.status {
        cfg.status = status;
    }
    if args.access_log.is_some() {
        cfg.access_log = args.access_log.clone();
    }
    if let Some(t) = args.threads {
        cfg.threads = t;
    }
    if args.csp.is_some() {
        cfg.csp = args.csp;
    }
    if let Some(r) = args.refresh_ms {
        cfg.refresh_ms = r;
    }
    if cfg.listeners.is_empty() {
        return Err(anyhow!(
            "no listener: give --listen ADDR --pool NAME [--mode tcp|http] or --config FILE"
        ));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// The proxy's runtime on this thread, and `threads - 1` worker threads beside it (0 = one
/// thread per core): each a single-threaded runtime serving its own client connections
/// (`rserpool_proxy::workers`), none of tokio's work stealing.
pub fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    rserpool_proxy::workers::start(threads - 1).context("cannot start the worker threads")?;
    super::runtime()
}

pub fn run(args: ProxyArgs) -> Result<()> {
    let mut cfg = load(&args)?;
    super::init_logging();
    // A connection takes two descriptors: the client's and the PE's.
    cfg.max_connections = super::fit_to_open_files(
        cfg.max_connections,
        ProxyConfig::default().max_connections,
        2,
        "max-connections",
    );
    let handover = handover_address(&args, &cfg)?;
    // A proxy running with this configuration hands its listening sockets over: no moment
    // with nobody listening (docs/OPERATIONS.md).
    let mut taken = match handover.as_ref().map(rserpool_handover::take).transpose() {
        Ok(t) => t.flatten(),
        Err(e) => {
            warn!("proxy: no hand-over, binding afresh: {e}");
            None
        }
    };
    let successor = super::service::Successor::here();
    runtime(cfg.threads)?.block_on(async move {
        let drain = Duration::from_millis(cfg.drain_timeout_ms);
        // Signals are caught before the listeners open, so none can kill a serving proxy.
        let mut shutdown = super::Shutdown::watch()?;
        let mut hup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
        let mut usr2 = signal(SignalKind::user_defined2()).context("cannot watch SIGUSR2")?;
        let inherited = match taken.as_mut() {
            Some(t) => {
                info!("proxy: taking the listeners over from process {}", t.pid);
                Inherited::from_taken(t).map_err(|e| anyhow!(e))?
            }
            None => Inherited::default(),
        };
        let proxy = Proxy::start_with(cfg, inherited).await?;
        for (l, a) in proxy.config().listeners.iter().zip(proxy.local_addrs()) {
            info!(
                "proxy: {} {} → pool {}",
                a,
                l.mode,
                l.pool.as_deref().unwrap_or("(routes)")
            );
        }
        if let Some(t) = taken {
            let pid = t.pid;
            match tokio::task::spawn_blocking(move || t.ready(HANDOVER_DONE_TIMEOUT)).await {
                Ok(Ok(())) => info!("proxy: process {pid} stopped accepting; this one serves"),
                Ok(Err(e)) => warn!("proxy: process {pid}: {e}"),
                Err(e) => warn!("proxy: hand-over: {e}"),
            }
        }
        let offer = match &handover {
            Some(a) => offer(a).await,
            None => None,
        };
        super::service::notify_ready();
        // Waits for a successor to take over, beside the signals.
        let mut successor_task = offer.map(|o| {
            let p = proxy.clone();
            tokio::spawn(async move {
                let r =
                    handover::next_successor(&o, || p.handover_sockets(), || p.handover_failed())
                        .await;
                (o, r)
            })
        });
        let handed = loop {
            let successor_taken = async {
                match successor_task.as_mut() {
                    Some(t) => t.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.recv() => break None,
                _ = hup.recv() => reload(&proxy, &args).await,
                _ = usr2.recv() => match &successor {
                    Some(s) if handover.is_some() => s.start(),
                    _ => warn!("proxy: SIGUSR2 ignored: no hand-over socket"),
                },
                r = successor_taken => {
                    successor_task = None;
                    match r {
                        Ok((o, Ok(giving))) => break Some((o, giving)),
                        Ok((_, Err(e))) => {
                            warn!("proxy: the hand-over socket failed, no more hand-overs: {e}")
                        }
                        Err(e) => warn!("proxy: the hand-over task failed: {e}"),
                    }
                }
            }
        };
        // Stopping: the hand-over name is free at once for a proxy started meanwhile.
        if let Some(t) = successor_task {
            t.abort();
        }
        if let Some((o, giving)) = handed {
            proxy.handed_over();
            // Closed before the successor hears `DONE`, so that it can offer at that name.
            drop(o);
            if let Err(e) = tokio::task::spawn_blocking(move || giving.done()).await? {
                warn!("proxy: {e}");
            }
        }
        if proxy.in_tier() {
            info!(
                "proxy: stopping ({} connections open): leaving the tier, then draining",
                proxy.active_connections()
            );
        } else {
            info!(
                "proxy: draining ({} connections open)",
                proxy.active_connections()
            );
        }
        let left = proxy.drain(drain).await;
        if left > 0 {
            warn!("proxy: exiting with {left} connections still open");
        }
        Ok(())
    })
}

/// How long a new proxy waits for the old one to stop accepting once it accepts itself.
const HANDOVER_DONE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where this proxy's hand-over socket is: `handover-socket`, or made from the configuration
/// file's path or the listeners' addresses. `None`: no hand-over.
pub fn handover_address(
    args: &ProxyArgs,
    cfg: &ProxyConfig,
) -> Result<Option<rserpool_handover::Address>> {
    let addrs: Vec<SocketAddr> = cfg.listeners.iter().map(|l| l.listen).collect();
    super::service::handover_address(
        "rserpool-proxy",
        cfg.handover_socket.as_deref(),
        args.config.as_deref(),
        &addrs,
    )
}

/// Offers this proxy's sockets at `addr`. The process it took over from closes its offer as it
/// stops accepting; until then (or when another process holds the name) this retries a while.
async fn offer(addr: &rserpool_handover::Address) -> Option<rserpool_handover::Offer> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match rserpool_handover::Offer::bind(addr) {
            Ok(o) => {
                info!("proxy: a successor takes over at {addr}");
                return Some(o);
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                warn!("proxy: no hand-over to a successor: {e}");
                return None;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn reload(proxy: &Proxy, args: &ProxyArgs) {
    let cfg = match load(args) {
        Ok(c) => c,
        Err(e) => {
            warn!(
                "proxy: reload refused, keeping the running settings: {e:#} (`rserpool \
                 check-config FILE` lists every error of the file)"
            );
            return;
        }
    };
    match proxy.reload(cfg).await {
        Ok(notes) => {
            for n in notes {
                warn!("proxy: reload: {n}");
            }
            info!("proxy: settings reloaded");
        }
        Err(e) => warn!("proxy: reload refused, keeping the running settings: {e}"),
    }
}
