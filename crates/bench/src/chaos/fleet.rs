//! Every process of the soak, each a command line that can be started, killed with SIGKILL and
//! started again: three registrars (an ENRP cluster), the pool elements (`rserpool serve`
//! sidecars in front of HTTP targets, `rserpool example http` and `example echo` registering
//! themselves), the targets, an HTTP proxy onto the HTTP pool, and the proxy tier
//! ([`super::tier`]: its distributor, servers and proxies). Each start logs to a file of its
//! own, so that a finding can be traced to the incarnation that made it.

use super::netns::Net;
use super::tier::Tier;
use crate::process::Proc;
use anyhow::Result;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

/// The pool the proxy serves.
pub const HTTP_POOL: &str = "ChaosHttp";
/// A second pool, only registered (its PEs are watched at the registrars like the others).
pub const ECHO_POOL: &str = "ChaosEcho";
/// Pool elements per PE host.
pub const PES_PER_HOST: usize = 10;

/// The registrars' timers: short, so that a failure is handled within seconds and a run sees
/// many faults. Flags of `rserpool registrar`.
pub const REGISTRAR_TIMERS: [(&str, u64); 7] = [
    ("--peer-heartbeat-ms", 500),
    ("--max-time-last-heard-ms", 1500),
    ("--max-time-no-response-ms", 1000),
    ("--mentor-discovery-ms", 2000),
    ("--takeover-expiry-ms", 3000),
    ("--keep-alive-interval-ms", 1000),
    ("--keep-alive-timeout-ms", 1000),
];
/// The PEs' re-registration interval (registration life: three times it).
pub const REREGISTRATION_MS: u64 = 5000;

const ASAP_PORT: u16 = 3863;
const ENRP_PORT: u16 = 9901;
const STATUS_PORT: u16 = 8863;
const PROXY_PORT: u16 = 8080;
const PROXY_STATUS_PORT: u16 = 8404;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Registrar,
    /// A pool element: `rserpool serve` in front of a target.
    Serve,
    /// A pool element: `rserpool example http`.
    ExampleHttp,
    /// A pool element: `rserpool example echo`.
    ExampleEcho,
    /// The HTTP server behind a sidecar: `rserpool example http` that reaches no registrar.
    Target,
    Proxy,
    /// The proxy tier's: `rserpool distributor`, its servers and its proxies.
    Distributor,
    TierServer,
    TierProxy,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Registrar => "registrar",
            Kind::Serve => "serve",
            Kind::ExampleHttp => "example http",
            Kind::ExampleEcho => "example echo",
            Kind::Target => "target",
            Kind::Proxy => "proxy",
            Kind::Distributor => "distributor",
            Kind::TierServer => "tier server",
            Kind::TierProxy => "tier proxy",
        }
    }
}

/// One process: what it is, where it runs and how it is started.
pub struct Member {
    pub name: String,
    pub kind: Kind,
    /// Index of its host in [`Net::hosts`].
    pub host: usize,
    /// The PE identifier (pool elements).
    pub pe_id: Option<u32>,
    args: Vec<String>,
    proc: Option<Proc>,
    starts: u32,
}

pub struct Fleet {
    rserpool: PathBuf,
    logs: PathBuf,
    pub members: Vec<Member>,
    /// Member indices of the registrars, the pool elements and the proxy.
    pub registrars: Vec<usize>,
    pub pes: Vec<usize>,
    pub proxy: usize,
    /// The proxy tier's, in the order of starting.
    pub tier: Vec<usize>,
    pub tier_proxies: Vec<usize>,
    /// The registrars' status listeners, in the order of `registrars`.
    pub status: Vec<SocketAddr>,
    /// Where clients reach the proxy.
    pub front: SocketAddr,
    /// Processes an upgrade replaced, draining until they exit.
    retiring: Vec<Proc>,
}

/// The host names on the bridge: r1..r3, h1..hK for `pes` PEs, front (the proxy), and the
/// proxy tier's router and servers (its proxies hang on the router).
pub fn host_names(pes: usize) -> Vec<String> {
    let mut v: Vec<String> = (1..=3).map(|i| format!("r{i}")).collect();
    v.extend((1..=pe_hosts(pes)).map(|i| format!("h{i}")));
    v.extend(["front", "trouter", "ts1", "ts2"].map(String::from));
    v
}

/// Where host `name` is in [`host_names`].
pub fn host_index(pes: usize, name: &str) -> Option<usize> {
    host_names(pes).iter().position(|n| n == name)
}

/// Hosts whose link faults may cut: the registrars' and the PEs'.
pub fn faulted_hosts(pes: usize) -> usize {
    3 + pe_hosts(pes)
}

fn pe_hosts(pes: usize) -> usize {
    pes.div_ceil(PES_PER_HOST).max(1)
}

impl Fleet {
    /// The command lines for `pes` pool elements on the hosts of `net` (made from
    /// [`host_names`]) and for the proxy tier. Nothing is started.
    pub fn plan(net: &Net, tier: &Tier, pes: usize, rserpool: &Path, logs: &Path) -> Result<Fleet> {
        let ip = |h: usize| net.hosts[h].ip;
        let at = |h: usize, port: u16| SocketAddr::from((ip(h), port)).to_string();
        let front_host = faulted_hosts(pes);
        let mut f = Fleet {
            rserpool: rserpool.to_path_buf(),
            logs: logs.to_path_buf(),
            members: Vec::new(),
            registrars: Vec::new(),
            pes: Vec::new(),
            proxy: 0,
            tier: Vec::new(),
            tier_proxies: Vec::new(),
            status: (0..3)
                .map(|r| SocketAddr::from((ip(r), STATUS_PORT)))
                .collect(),
            front: SocketAddr::from((ip(front_host), PROXY_PORT)),
            retiring: Vec::new(),
        };
        for r in 0..3 {
            let mut args = vec!["registrar".to_string()];
            args.extend(flag("--asap", at(r, ASAP_PORT)));
            args.extend(flag("--enrp", at(r, ENRP_PORT)));
            args.extend(flag("--status", at(r, STATUS_PORT)));
            for other in (0..3).filter(|&o| o != r) {
                args.extend(flag("--peer", at(other, ENRP_PORT)));
            }
            for (name, ms) in REGISTRAR_TIMERS {
                args.extend(flag(name, ms.to_string()));
            }
            let m = f.add(format!("r{}", r + 1), Kind::Registrar, r, None, args);
            f.registrars.push(m);
        }
        let hosts = pe_hosts(pes);
        for k in 0..pes {
            let h = 3 + k % hosts;
            let id = 0x100 + k as u32;
            let kind = match k % 5 {
                0 | 1 => Kind::Serve,
                2 | 3 => Kind::ExampleHttp,
                _ => Kind::ExampleEcho,
            };
            let mut args: Vec<String> = match kind {
                Kind::Serve => {
                    let port = 20_000 + k as u16;
                    // The target answers on every address: the sidecar checks it on loopback.
                    f.add(
                        format!("target{k:02}"),
                        Kind::Target,
                        h,
                        None,
                        vec![
                            "example".into(),
                            "http".into(),
                            "--listen".into(),
                            SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).to_string(),
                            "--pool".into(),
                            "ChaosTarget".into(),
                        ],
                    );
                    let mut a = vec!["serve".to_string()];
                    a.extend(flag("--target", format!("127.0.0.1:{port}")));
                    a.extend(flag("--advertise", at(h, port)));
                    a.extend(flag("--check-interval-ms", "500".into()));
                    a.extend(flag("--pool", HTTP_POOL.into()));
                    a
                }
                _ => {
                    let service = if kind == Kind::ExampleHttp {
                        "http"
                    } else {
                        "echo"
                    };
                    let pool = if kind == Kind::ExampleHttp {
                        HTTP_POOL
                    } else {
                        ECHO_POOL
                    };
                    let mut a = vec!["example".to_string(), service.to_string()];
                    a.extend(flag("--listen", at(h, 10_000 + k as u16)));
                    a.extend(flag("--pool", pool.into()));
                    a
                }
            };
            args.extend(flag("--id", format!("{id:#x}")));
            args.extend(flag(
                "--reregistration-interval-ms",
                REREGISTRATION_MS.to_string(),
            ));
            // Each PE tries the registrars from a different one first, so that homes spread.
            for j in 0..3 {
                args.extend(flag("--registrar", at((k + j) % 3, ASAP_PORT)));
            }
            let m = f.add(format!("pe{k:02}"), kind, h, Some(id), args);
            f.pes.push(m);
        }
        let mut args = vec!["proxy".to_string()];
        args.extend(flag("--listen", f.front.to_string()));
        args.extend(flag("--pool", HTTP_POOL.into()));
        for r in 0..3 {
            args.extend(flag("--registrar", at(r, ASAP_PORT)));
        }
        args.extend(flag("--status", at(front_host, PROXY_STATUS_PORT)));
        args.extend(flag("--threads", "1".into()));
        f.proxy = f.add("proxy".into(), Kind::Proxy, front_host, None, args);
        let registrars: Vec<SocketAddr> = (0..3)
            .map(|r| SocketAddr::from((ip(r), ASAP_PORT)))
            .collect();
        let d = tier.distributor_args(&registrars);
        let m = f.add(
            "distributor".into(),
            Kind::Distributor,
            tier.router,
            None,
            d,
        );
        f.tier.push(m);
        for (j, &h) in tier.servers.iter().enumerate() {
            let a = tier.server_args(net, j, &registrars);
            let m = f.add(format!("ts{}", j + 1), Kind::TierServer, h, None, a);
            f.tier.push(m);
        }
        for (i, &h) in tier.proxies.iter().enumerate() {
            let a = tier.proxy_args(i, &registrars, logs)?;
            let m = f.add(format!("tp{}", i + 1), Kind::TierProxy, h, None, a);
            f.tier.push(m);
            f.tier_proxies.push(m);
        }
        Ok(f)
    }

    fn add(
        &mut self,
        name: String,
        kind: Kind,
        host: usize,
        pe_id: Option<u32>,
        args: Vec<String>,
    ) -> usize {
        self.members.push(Member {
            name,
            kind,
            host,
            pe_id,
            args,
            proc: None,
            starts: 0,
        });
        self.members.len() - 1
    }

    /// Starts member `m` in its host's namespace (again, after a kill).
    pub fn start(&mut self, net: &Net, m: usize) -> Result<()> {
        let member = &mut self.members[m];
        member.starts += 1;
        let log = self
            .logs
            .join(format!("{}.{}.log", member.name, member.starts));
        // RSERPOOL_CHAOS_LOG: another filter for all but the targets (to look closer).
        let chosen = std::env::var("RSERPOOL_CHAOS_LOG").unwrap_or_else(|_| "info".into());
        let filter = if member.kind == Kind::Target {
            // It reaches no registrar, and need not say so.
            "error"
        } else {
            chosen.as_str()
        };
        let mut cmd = net.command(member.host, &self.rserpool);
        cmd.args(&member.args)
            .env("RUST_LOG", filter)
            .env("NO_COLOR", "1");
        member.proc = Some(Proc::spawn(&mut cmd, &log)?);
        Ok(())
    }

    /// Upgrades member `m`: a second process with the same flags takes it over (its sockets,
    /// and for a registrar its PEs); the first drains and exits on its own, reaped quietly.
    pub fn upgrade(&mut self, net: &Net, m: usize) -> Result<()> {
        if let Some(old) = self.members[m].proc.take() {
            self.retiring.push(old);
        }
        self.start(net, m)
    }

    /// SIGKILL to member `m`.
    pub fn kill(&mut self, m: usize) {
        if let Some(mut p) = self.members[m].proc.take() {
            p.kill();
        }
    }

    /// Members that were running and have exited on their own since the last call.
    pub fn exits(&mut self) -> Vec<(usize, ExitStatus)> {
        self.retiring.retain_mut(|p| p.exited().is_none());
        let mut v = Vec::new();
        for (i, member) in self.members.iter_mut().enumerate() {
            if let Some(status) = member.proc.as_mut().and_then(Proc::exited) {
                member.proc = None;
                v.push((i, status));
            }
        }
        v
    }

    /// The log of member `m`'s latest start.
    pub fn log(&self, m: usize) -> PathBuf {
        let member = &self.members[m];
        self.logs
            .join(format!("{}.{}.log", member.name, member.starts))
    }
}

fn flag(name: &str, value: String) -> [String; 2] {
    [name.to_string(), value]
}
