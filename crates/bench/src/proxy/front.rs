//! Starting a system under test (rserpool's proxy, HAProxy, nginx, or none for direct) in
//! front of the test bed, afresh for every part.

use super::args::System;
use super::bed::Bed;
use super::config;
use super::load::client_runtime;
use super::{BACKENDS, SMALL};
use crate::net::{free_port, local};
use crate::process::Proc;
use anyhow::{Result, bail};
use rserpool_proxy::http::client::Client;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

/// A running system under test: where clients send HTTP and TCP-mode traffic.
pub(super) struct Front {
    pub(super) http: Vec<SocketAddr>,
    pub(super) tcp: Vec<SocketAddr>,
    /// HTTPS terminated by the proxy (the bed's certificate; ALPN h2 or http/1.1).
    pub(super) https: Option<SocketAddr>,
    /// HTTP/2 in cleartext (prior knowledge), onto the HTTP/1.1 backends.
    pub(super) h2c: SocketAddr,
    /// HTTP/2 onto the gRPC backends.
    pub(super) grpc: SocketAddr,
    pub(super) proc: Option<Proc>,
}

impl Front {
    /// The process group whose CPU is the system's (none for direct).
    pub(super) fn group(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::id)
    }
}

/// Starts `system` in front of the bed's backends; ready once every backend has answered
/// through it.
pub(super) fn start(bed: &Bed, system: System, threads: usize) -> Result<Front> {
    if system == System::Direct {
        return Ok(Front {
            http: bed.backends.clone(),
            tcp: bed.backends.clone(),
            https: None,
            h2c: bed.backends[0],
            grpc: bed
                .grpc_backends
                .first()
                .copied()
                .unwrap_or(bed.backends[0]),
            proc: None,
        });
    }
    if system == System::H2Relay {
        return relay(bed);
    }
    let http = local(free_port()?);
    let tcp = local(free_port()?);
    let https = local(free_port()?);
    let h2c = local(free_port()?);
    let grpc = local(free_port()?);
    let fronts = config::Fronts {
        http,
        tcp,
        https,
        h2c,
        grpc,
    };
    let d = &bed.dir;
    let name = system.label().to_lowercase();
    let conf_path = d.join(format!("{name}.conf"));
    let mut cmd = match system {
        System::Direct | System::H2Relay => unreachable!("handled above"),
        System::Rserpool | System::Baseline => {
            let conf = config::rserpool_proxy(bed.registrar, threads, &fronts, &bed.tls);
            std::fs::write(&conf_path, conf)?;
            let bin = match (system, &bed.baseline) {
                (System::Baseline, Some(b)) => b,
                (System::Baseline, None) => bail!("the system baseline needs --baseline PATH"),
                _ => &bed.rserpool,
            };
            let mut c = Command::new(bin);
            // BENCH_PROXY_LOG: the proxy's log filter (its log is in the bed's directory), to
            // see why a part failed.
            let log = std::env::var("BENCH_PROXY_LOG").unwrap_or_else(|_| "warn".into());
            c.args(["proxy", "--config"])
                .arg(&conf_path)
                .env("RUST_LOG", log);
            c
        }
        System::Haproxy => {
            let conf = config::haproxy(threads, &fronts, &bed.upstreams(), &bed.tls);
            std::fs::write(&conf_path, conf)?;
            let mut c = Command::new("haproxy");
            c.args(["-db", "-f"]).arg(&conf_path);
            c
        }
        System::Nginx => {
            let conf = config::nginx_proxy(threads, &fronts, &bed.upstreams(), d, &bed.tls);
            std::fs::write(&conf_path, conf)?;
            let mut c = Command::new("nginx");
            c.arg("-e")
                .arg(d.join("nginx-proxy.err"))
                .arg("-c")
                .arg(&conf_path);
            c
        }
    };
    let proc = Proc::spawn(&mut cmd, &d.join(format!("{name}.log")))?;
    let front = Front {
        http: vec![http],
        tcp: vec![tcp],
        https: Some(https),
        h2c,
        grpc,
        proc: Some(proc),
    };
    // Ready when every backend has answered through it.
    let rt = client_runtime(1)?;
    let reached = rt.block_on(async {
        let start = Instant::now();
        let mut seen = std::collections::HashSet::new();
        while start.elapsed() < Duration::from_secs(15) && seen.len() < BACKENDS {
            if let Ok(mut c) = Client::connect(http).await {
                for _ in 0..2 * BACKENDS {
                    match tokio::time::timeout(Duration::from_secs(2), c.get(SMALL)).await {
                        Ok(Ok(r)) if r.code == 200 => {
                            seen.extend(r.header("x-backend"));
                        }
                        _ => break,
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen.len()
    });
    if reached < BACKENDS {
        bail!(
            "{} reached {reached} of {BACKENDS} backends within 15 s (see {})",
            system.label(),
            d.display()
        );
    }
    Ok(front)
}

/// The bare HTTP/2 relay onto the gRPC backends; only its `grpc` address serves.
fn relay(bed: &Bed) -> Result<Front> {
    let grpc = local(free_port()?);
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["h2-relay", "--listen", &grpc.to_string()]);
    for b in &bed.grpc_backends {
        cmd.args(["--backend", &b.to_string()]);
    }
    let proc = Proc::spawn(&mut cmd, &bed.dir.join("h2-relay.log"))?;
    let start = Instant::now();
    while std::net::TcpStream::connect(grpc).is_err() {
        if start.elapsed() > Duration::from_secs(10) {
            bail!(
                "the bare h2 relay did not listen within 10 s (see {})",
                bed.dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Front {
        http: Vec::new(),
        tcp: Vec::new(),
        https: None,
        h2c: grpc,
        grpc,
        proc: Some(proc),
    })
}
