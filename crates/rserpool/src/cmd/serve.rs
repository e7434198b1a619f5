//! `rserpool serve`: a sidecar that makes an existing TCP service a pool element.
//!
//! It checks the target with a TCP connect every check interval: after `--fall` failures in a
//! row it deregisters, after `--rise` successes it registers again (same PE identifier). For
//! adaptive policies it reads the target's load from the kernel — the accept backlog of its
//! listening socket plus its established connections, from /proc/net/tcp{,6} — and reports
//! load = (backlog + established) / capacity when it moved by at least the threshold, at most
//! once per load interval.

use crate::PeOpts;
use anyhow::{Context, Result, anyhow};
use clap::Args;
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
    /// Connections (backlog + established) at which the reported load is 100%.
    #[arg(long, default_value_t = 100)]
    pub capacity: u32,
    /// Report the load when it changed by at least this fraction (0.05 = 5 points).
    #[arg(long, default_value_t = 0.05)]
    pub load_threshold: f64,
    /// At most one load report per this interval.
    #[arg(long, default_value_t = 1000)]
    pub load_interval_ms: u64,
    #[command(flatten)]
    pub pe: PeOpts,
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
    let check_timeout = Duration::from_millis(args.check_timeout_ms.max(1));
    let mut healthy = check(target, check_timeout).await;
    cfg.initially_active = healthy;
    let adaptive = cfg.policy.is_adaptive();
    let pe = rserpool_asap::PoolElement::start(cfg)?;
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
                info!("target {target} is back: registering");
                pe.set_active(true);
            }
        } else {
            fails += 1;
            oks = 0;
            if healthy && fails >= args.fall.max(1) {
                healthy = false;
                warn!("target {target} does not accept connections: deregistering");
                pe.set_active(false);
            }
        }
        if adaptive && healthy && last_report.elapsed() >= load_interval {
            match read_load(target.port()) {
                Some(l) => {
                    let f = (f64::from(l.backlog + l.established)
                        / f64::from(args.capacity.max(1)))
                    .min(1.0);
                    if reported.is_none_or(|r| (r - f).abs() >= args.load_threshold) {
                        pe.update_load(f);
                        reported = Some(f);
                        last_report = Instant::now();
                    }
                }
                None if !warned_no_socket => {
                    warn!(
                        "no listening socket on port {} in /proc/net/tcp: not reporting load (is the target on this host?)",
                        target.port()
                    );
                    warned_no_socket = true;
                }
                None => {}
            }
        }
    }
    pe.stop().await;
    Ok(())
}

async fn check(target: SocketAddr, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, TcpStream::connect(target)).await,
        Ok(Ok(_))
    )
}

/// A listening port's load as the kernel sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLoad {
    /// Connections waiting in the accept queue.
    pub backlog: u32,
    /// Established connections on the port.
    pub established: u32,
}

/// Reads /proc/net/tcp and /proc/net/tcp6; `None` if no socket listens on `port`.
pub fn read_load(port: u16) -> Option<PortLoad> {
    let mut total = PortLoad {
        backlog: 0,
        established: 0,
    };
    let mut listening = false;
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(f)
            && let Some(l) = parse_proc_net_tcp(&text, port)
        {
            listening = true;
            total.backlog += l.backlog;
            total.established += l.established;
        }
    }
    listening.then_some(total)
}

/// Parses one /proc/net/tcp table: for LISTEN sockets (state 0A) `rx_queue` is the current
/// accept backlog; ESTABLISHED sockets (01) on the port are counted.
pub fn parse_proc_net_tcp(text: &str, port: u16) -> Option<PortLoad> {
    let mut load = PortLoad {
        backlog: 0,
        established: 0,
    };
    let mut listening = false;
    for line in text.lines().skip(1) {
        let mut fields = line.split_whitespace();
        let (Some(_sl), Some(local), Some(_remote), Some(state), Some(queues)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let Some(lport) = local
            .rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
        else {
            continue;
        };
        if lport != port {
            continue;
        }
        match state {
            "0A" => {
                listening = true;
                let rx = queues
                    .split(':')
                    .nth(1)
                    .and_then(|q| u32::from_str_radix(q, 16).ok())
                    .unwrap_or(0);
                load.backlog += rx;
            }
            "01" => load.established += 1,
            _ => {}
        }
    }
    listening.then_some(load)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_listen_backlog_and_established() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:C000 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:C001 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
   3: 0100007F:C002 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4 1 0 20 4 30 10 -1
   4: 0100007F:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5 1 0 100 0 0 10 0
";
        assert_eq!(
            parse_proc_net_tcp(text, 8080),
            Some(PortLoad {
                backlog: 3,
                established: 2
            })
        );
        assert_eq!(
            parse_proc_net_tcp(text, 80),
            Some(PortLoad {
                backlog: 0,
                established: 0
            })
        );
        assert_eq!(parse_proc_net_tcp(text, 81), None);
    }
}
