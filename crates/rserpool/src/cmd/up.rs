//! `rserpool up`: the built-in default. A registrar on loopback, the EchoPool (three echo PEs,
//! least used), the WebPool (three small HTTP PEs, least used) and a proxy in front of both
//! (HTTP onto the WebPool, TCP onto the EchoPool), in one process; prints where everything
//! listens and how to try it.

use super::example::{self, Service, ServiceOpts};
use crate::{PeOpts, RegistrarOpts};
use anyhow::{Context, Result};
use clap::Args;
use rserpool_proxy::{ListenerConfig, Mode, Proxy, ProxyConfig};
use rserpool_registrar::{Config, RegistrarThread};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct UpArgs {
    /// Registrar ASAP address.
    #[arg(long, default_value = "127.0.0.1:3863")]
    pub asap: SocketAddr,
    /// Pool handle of the example pool.
    #[arg(long, default_value = "EchoPool")]
    pub pool: String,
    /// Number of echo pool elements (and of HTTP ones).
    #[arg(long, default_value_t = 3)]
    pub pes: usize,
    /// Where the proxy takes HTTP requests for the WebPool.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub proxy_http: SocketAddr,
    /// Where the proxy takes TCP connections for the EchoPool.
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub proxy_tcp: SocketAddr,
    /// The proxy's status listener: its dashboard, `/status` and `/metrics`.
    #[arg(long, default_value = "127.0.0.1:8864")]
    pub proxy_status: SocketAddr,
}

const WEB_POOL: &str = "WebPool";

/// A line on stdout; a closed stdout (`rserpool up | head`) is no reason to stop serving.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub fn run(args: UpArgs) -> Result<()> {
    super::init_logging();
    let cfg = Config {
        asap: args.asap.into(),
        ..Config::default()
    };
    let registrar = RegistrarThread::start(cfg).with_context(|| {
        format!(
            "cannot start the registrar on {} (is another one running? choose another with --asap)",
            args.asap
        )
    })?;
    let asap = registrar.asap_addr();
    let rt = super::runtime()?;
    let result = rt.block_on(async {
        let opts = PeOpts {
            pool: args.pool.clone(),
            policy: "lu".into(),
            weight: 1,
            id: None,
            reregistration_interval_ms: 30_000,
            registrars: RegistrarOpts {
                registrars: vec![asap.into()],
                announce_listen: None,
                tls_cert: None,
                tls_key: None,
                tls_ca: None,
            },
            csp: None,
            csp_interval_ms: 1000,
        };
        let mut pes = Vec::new();
        let web_opts = PeOpts {
            pool: WEB_POOL.into(),
            ..opts.clone()
        };
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        for _ in 0..args.pes.max(1) {
            pes.push(
                example::start(
                    Service::Echo,
                    loopback,
                    &ServiceOpts::default(),
                    &opts,
                    None,
                )
                .await?,
            );
        }
        let echo_count = pes.len();
        for _ in 0..args.pes.max(1) {
            pes.push(
                example::start(
                    Service::Http,
                    loopback,
                    &ServiceOpts::default(),
                    &web_opts,
                    None,
                )
                .await?,
            );
        }
        for ex in &pes {
            ex.pe.wait_registered(Duration::from_secs(5)).await?;
        }
        let proxy = Proxy::start(ProxyConfig {
            registrars: vec![asap.into()],
            listeners: vec![
                ListenerConfig {
                    listen: args.proxy_http,
                    mode: Mode::Http,
                    pool: Some(WEB_POOL.into()),
                    routes: Vec::new(),
                    splice: None,
                    certificates: Vec::new(),
                    http2: true,
                    defer_accept: None,
                },
                ListenerConfig {
                    listen: args.proxy_tcp,
                    mode: Mode::Tcp,
                    pool: Some(args.pool.clone()),
                    routes: Vec::new(),
                    splice: None,
                    certificates: Vec::new(),
                    http2: true,
                    defer_accept: None,
                },
            ],
            status: Some(args.proxy_status),
            ..ProxyConfig::default()
        })
        .await
        .context(
            "cannot start the proxy (choose other ports with --proxy-http / --proxy-tcp / \
             --proxy-status)",
        )?;
        let proxied = proxy.local_addrs();
        let flag = if asap.port() == rserpool_wire::ASAP_PORT {
            String::new()
        } else {
            format!(" --registrar {asap}")
        };
        say!();
        say!(
            "rserpool {} is up. Registrar {:#010x} listens for ASAP on {asap} (TCP).",
            env!("CARGO_PKG_VERSION"),
            registrar.server_id()
        );
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        say!(
            "Pool {} (least used) has {echo_count} echo pool element{}:",
            args.pool,
            plural(echo_count)
        );
        for ex in &pes[..echo_count] {
            say!("  PE {:#010x} at {}", ex.pe.id(), ex.addr);
        }
        say!(
            "Pool {WEB_POOL} (least used) has {} HTTP pool element{}:",
            pes.len() - echo_count,
            plural(pes.len() - echo_count)
        );
        for ex in &pes[echo_count..] {
            say!("  PE {:#010x} at {}", ex.pe.id(), ex.addr);
        }
        say!(
            "The proxy takes HTTP for {WEB_POOL} on {} and TCP for {} on {}.",
            proxied[0],
            args.pool,
            proxied[1]
        );
        say!();
        say!("Try, in another terminal:");
        say!("  cargo run --release -- resolve {}{flag}", args.pool);
        let status = registrar.status_addr();
        if let Some(a) = status {
            let flag = if a == rserpool_registrar::DEFAULT_STATUS {
                String::new()
            } else {
                format!(" --status {a}")
            };
            say!("  cargo run --release -- status{flag}");
        }
        say!(
            "  echo hello | cargo run --release -- connect {}{flag}",
            args.pool
        );
        say!(
            "  curl http://{}/hello{}",
            proxied[0],
            if pes.len() - echo_count > 1 {
                "          (run it twice: another PE answers)"
            } else {
                ""
            }
        );
        say!(
            "  echo hello | nc -q1 {} {}",
            proxied[1].ip(),
            proxied[1].port()
        );
        if let Some(a) = status {
            say!("  curl http://{a}/metrics");
        }
        say!();
        say!("Dashboards (live, in a browser):");
        if let Some(a) = status {
            say!("  registrar: http://{a}/");
        }
        say!("  proxy:     http://{}/", args.proxy_status);
        say!();
        say!("Ctrl-C stops everything.");
        super::shutdown_signal().await;
        say!("stopping: draining the proxy, deregistering the pool elements");
        proxy.drain(Duration::from_secs(5)).await;
        for ex in pes {
            ex.task.abort();
            ex.pe.stop().await;
        }
        Ok::<_, anyhow::Error>(())
    });
    registrar.stop();
    result
}
