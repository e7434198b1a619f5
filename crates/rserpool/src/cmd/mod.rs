//! The subcommands, one module each, and what they share.

pub mod agent;
pub mod attack;
pub mod calc;
pub mod cert;
pub mod check;
pub mod client;
pub mod control;
pub mod distributor;
pub mod example;
pub mod example_sctp;
pub mod manual;
pub mod proxy;
pub mod registrar;
pub mod serve;
pub mod service;
pub mod split;
pub mod up;

use crate::{PeOpts, RegistrarOpts};
use anyhow::{Result, anyhow};
use rserpool_asap::{PoolElementConfig, PoolUserConfig};
use rserpool_wire::Policy;
use std::net::SocketAddr;
use std::time::Duration;

pub use rserpool::util::{Shutdown, runtime};

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, fields (the message among them).
    Json,
}

static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// Chosen once, from the command line, before any command logs.
pub fn set_log_format(f: LogFormat) {
    let _ = LOG_FORMAT.set(f);
}

/// Descriptors kept beside the connections: listeners, peers, the status listener, files.
const RESERVED_FILES: u64 = 256;

/// Raises the open-file limit to its hard limit, and fits `max` connections (each taking
/// `per_connection` descriptors) within it, warning when `setting` asks for more (saying so
/// only when it is left at its `default`). A limit above what the process may open is never
/// reached: accepting fails instead, on every listener (the status listener too), without
/// the limit's clear refusal and count.
pub fn fit_to_open_files(max: usize, default: usize, per_connection: u64, setting: &str) -> usize {
    use rlimit::Resource;
    let Ok((soft, hard)) = Resource::NOFILE.get() else {
        return max;
    };
    let soft = if soft < hard && Resource::NOFILE.set(hard, hard).is_ok() {
        hard
    } else {
        soft
    };
    let fits = usize::try_from(soft.saturating_sub(RESERVED_FILES) / per_connection.max(1))
        .unwrap_or(usize::MAX)
        .max(1);
    if max > fits {
        let say = format!(
            "{setting} = {max} is more than the open-file limit allows ({soft} descriptors): \
             {fits} connections at most; raise the limit (LimitNOFILE= in a systemd unit, \
             ulimit -n) to allow more"
        );
        if max == default {
            tracing::info!("{say}");
        } else {
            tracing::warn!("{say}");
        }
        return fits;
    }
    max
}

/// Logs to stderr; `RUST_LOG` overrides the level (default info).
pub fn init_logging() {
    let spec = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    // The h2 and rustls crates warn once per misbehaving client, unpaced: a flood of log
    // lines for a flood of connections (rustls: at each client that names an IP address in
    // SNI, as load generators do). The proxy logs what matters itself, paced (unless
    // RUST_LOG names the crate).
    let mut spec = spec;
    for quiet in ["h2", "rustls"] {
        if !spec.contains(quiet) {
            spec = format!("{spec},{quiet}=error");
        }
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,h2=error,rustls=error"));
    // Colours only for a terminal (not a log file or journald), and not under NO_COLOR.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match LOG_FORMAT.get().copied().unwrap_or_default() {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Before the process exits: the SCTP associations it dropped finish their shutdown (at most
/// half a second), so that the registrar does not retransmit into silence for them.
pub(crate) async fn sctp_settle() {
    rserpool_asap::sctp::settle(Duration::from_millis(500)).await;
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    match Shutdown::watch() {
        Ok(mut s) => s.recv().await,
        Err(_) => std::future::pending::<()>().await,
    }
}

/// Accepts decimal or 0x-prefixed hexadecimal.
pub fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s}: {e}"))
}

/// A Component Status monitor's address: `host:port`, or an IP address alone for rsplib's
/// port 2960 (`rserpool_wire::csp`).
pub fn parse_csp_monitor(s: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, rserpool_wire::csp::CSP_PORT));
    }
    s.parse().map_err(|e| format!("{s}: {e}"))
}

/// Starts the PE's component status reports when `--csp` asks for them.
pub fn report_status(pe: &rserpool_asap::PoolElement, opts: &PeOpts, transport: SocketAddr) {
    if let Some(monitor) = opts.csp {
        let interval = std::time::Duration::from_millis(opts.csp_interval_ms);
        pe.report_status(monitor, interval, transport);
    }
}

pub fn policy(name: &str, weight: u32) -> Result<Policy> {
    Policy::from_name(name, weight).ok_or_else(|| {
        anyhow!(
            "unknown policy {name:?}; use rr, wrr, rand, wrand, prio, lu, lud, plu, rlu or credits"
        )
    })
}

pub fn pe_config(opts: &PeOpts, transport: SocketAddr) -> Result<PoolElementConfig> {
    if opts.pool.is_empty() {
        return Err(anyhow!("--pool must not be empty"));
    }
    let mut cfg = PoolElementConfig::new(
        opts.pool.as_str(),
        transport,
        policy(&opts.policy, opts.weight)?,
    );
    cfg.id = opts.id;
    cfg.set_registrars(&opts.registrars.registrars);
    cfg.announce_listen = opts.registrars.announce_listen;
    cfg.reregistration_interval = Duration::from_millis(opts.reregistration_interval_ms.max(100));
    cfg.tls = opts.registrars.tls()?;
    Ok(cfg)
}

/// A PE with policy `credits` registers with full credit: `capacity`.
pub fn set_capacity(cfg: &mut PoolElementConfig, capacity: u32) {
    if let Policy::Credits { .. } = cfg.policy {
        cfg.policy = Policy::Credits {
            credits: capacity,
            capacity,
        };
    }
}

/// Starts reporting credits for a PE with policy `credits`, from `source`; `capacity` is the
/// work it takes at once. `None` for any other policy.
pub fn credit_source(
    pe: &rserpool_asap::PoolElement,
    opts: &crate::CreditOpts,
    capacity: u32,
    source: rserpool_asap::MetricSource,
) -> Result<Option<rserpool_asap::CreditSource>> {
    if !matches!(pe.updater().policy(), Policy::Credits { .. }) {
        return Ok(None);
    }
    let reporting = rserpool_asap::Reporting::from_name(&opts.credit_reporting, capacity)
        .ok_or_else(|| {
            anyhow!(
                "unknown --credit-reporting {:?}; use dpr or dpr-q",
                opts.credit_reporting
            )
        })?;
    let cfg = rserpool_asap::CreditConfig {
        capacity,
        reporting,
        min_interval: Duration::from_millis(opts.credit_min_interval_ms),
    };
    Ok(Some(rserpool_asap::CreditSource::start(
        pe.updater(),
        source,
        cfg,
        Duration::from_millis(opts.credit_sample_ms.max(1)),
    )))
}

/// The registrars of a command that reaches them over TCP only.
pub fn tcp_registrars(opts: &RegistrarOpts) -> Result<Vec<SocketAddr>> {
    opts.registrars
        .iter()
        .map(|a| match a.scheme {
            rserpool_wire::Scheme::Tcp => Ok(a.addr),
            _ => Err(anyhow!(
                "{a}: this command reaches registrars over TCP only"
            )),
        })
        .collect()
}

/// A registrar that requires TLS closes a plaintext connection without a word: a pool user
/// without TLS whose registrar closed the connection is told so.
pub fn tls_hint(e: rserpool_asap::Error, opts: &RegistrarOpts) -> anyhow::Error {
    let closed = matches!(e, rserpool_asap::Error::Closed);
    let e = anyhow::Error::new(e);
    match (closed, opts.tls_ca.is_none()) {
        (true, true) => e.context(
            "the registrar closed the connection without an answer; if it requires TLS, give \
             --tls-cert, --tls-key and --tls-ca",
        ),
        (true, false) => e.context(
            "the registrar closed the connection without an answer; if it runs TLS, it may not \
             trust this certificate (signed by another CA than its own?), or --tls-ca may not \
             be the CA of its certificate; if it does not run TLS, leave the --tls options out",
        ),
        _ => e,
    }
}

pub fn pu_config(opts: &RegistrarOpts) -> Result<PoolUserConfig> {
    let mut cfg = PoolUserConfig {
        announce_listen: opts.announce_listen,
        tls: opts.tls()?,
        ..PoolUserConfig::default()
    };
    cfg.set_registrars(&opts.registrars);
    Ok(cfg)
}
