//! The soak's proxy tier (docs/TIER.md): two proxies that hand their connections to the kernel
//! splice and replicate them to each other, behind a router whose nexthop group
//! `rserpool distributor` keeps equal to the live proxies, in front of two `example http`
//! servers. Everything registers with the soak's registrar cluster, so the tier lives through
//! the cluster's faults; its own faults are a proxy's host dying (`kill -9` and its link cut)
//! and a proxy's upgrade. The servers are never killed: a spliced TCP connection cannot outlive
//! its server, and what is checked here is that none breaks because of a proxy.
//!
//! The network hangs on the router, a host of the soak's bridge: a client namespace
//! (10.202.0.2, the router 10.202.0.1), the proxies on a bridge inside the router (10.202.1.1,
//! proxy i at 10.202.1.1i) with the clients' address [`VIP`] and the server-facing address
//! [`SHARED`] on their loopback. Every other host routes 10.202.0.0/16 through the router, so
//! the servers' answers to [`SHARED`] reach the group.

use super::netns::{Host, Net, ip, netns_name};
use anyhow::{Context, Result, bail};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The servers' pool, behind the tier.
pub const SERVER_POOL: &str = "ChaosTierServers";
/// The proxies' own pool (the tier's).
pub const PROXY_POOL: &str = "ChaosProxyTier";
/// Where clients reach the tier.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 202, 9, 1);
pub const FRONT_PORT: u16 = 7000;
/// The proxies' common address towards the servers.
pub const SHARED: Ipv4Addr = Ipv4Addr::new(10, 202, 9, 2);
pub const PROXIES: usize = 2;
/// The router's nexthop group.
const GROUP: u32 = 100;
const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 202, 1, 1);
const SERVER_PORT: u16 = 8080;
const STATUS_PORT: u16 = 8404;
/// The distributor's heartbeats.
const HEARTBEAT_MS: u64 = 100;

/// Where the tier is: its hosts' indices in [`Net::hosts`], the client's namespace, and the
/// bpffs the proxies pin their maps on (shared by a proxy and its successor).
pub struct Tier {
    pub router: usize,
    pub servers: Vec<usize>,
    pub proxies: Vec<usize>,
    pub client_ns: String,
    pub bpffs: PathBuf,
}

/// Proxy `i`'s (0-based) address on the router's bridge.
pub fn proxy_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 202, 1, 11 + i as u8)
}

/// Proxy `i`'s status listener.
pub fn proxy_status(i: usize) -> SocketAddr {
    SocketAddr::from((proxy_addr(i), STATUS_PORT))
}

/// How many connections proxy `i` holds on its own sockets (not yet, or never, spliced): those
/// die with it. `None` if it does not answer.
pub fn on_sockets(net: &Net, router: usize, i: usize) -> Option<u64> {
    status(net, router, i)?.get("active_connections")?.as_u64()
}

/// Whether proxy `i` is a whole member of the tier of `members`: linked to every other, their
/// tables arrived, and answering the distributor. `None` if it does not answer.
pub fn whole(net: &Net, router: usize, i: usize, members: usize) -> Option<bool> {
    let v = status(net, router, i)?;
    let t = v.get("tier")?;
    let count = |k: &str| t.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as usize;
    let others = members.saturating_sub(1);
    Some(
        count("links") >= others
            && count("members_known") >= others
            && count("tables_received") >= others
            && t.get("answering").and_then(|a| a.as_bool()) == Some(true),
    )
}

/// Proxy `i`'s status page, asked from the router's namespace.
fn status(net: &Net, router: usize, i: usize) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    let ns = net.hosts[router].netns.clone();
    rserpool_ksplice::testbed::in_ns(&ns, move || {
        let timeout = std::time::Duration::from_millis(500);
        let mut s = std::net::TcpStream::connect_timeout(&proxy_status(i), timeout).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        s.write_all(b"GET /status HTTP/1.0\r\n\r\n").ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let (_, body) = answer.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    })
    .join()
    .ok()
    .flatten()
}

/// Builds the tier's network on `router` (a host of the bridge) for the servers on `servers`.
pub fn attach(net: &mut Net, router: usize, servers: &[usize]) -> Result<Tier> {
    let rns = net.hosts[router].netns.clone();
    sysctl(&rns, "net.ipv4.ip_forward=1")?;
    sysctl(&rns, "net.ipv4.fib_multipath_hash_policy=1")?;
    // A packet over veth keeps its sender's socket hash, which the router's multipath choice
    // takes as the flow's, and TCP draws a new one after a timeout: the ends keep theirs, so
    // that a flow stays with its proxy (docs/TIER.md, "A flow's hash over veth").
    let client_ns = netns_name("tclient");
    new_netns(net, &client_ns)?;
    for h in servers.iter().map(|&s| net.hosts[s].netns.clone()) {
        sysctl(&h, "net.core.txrehash=0")?;
    }
    sysctl(&client_ns, "net.core.txrehash=0")?;
    ip(&[
        "-n", &client_ns, "link", "add", "t0", "type", "veth", "peer", "name", "tc", "netns", &rns,
    ])?;
    ip(&[
        "-n",
        &client_ns,
        "addr",
        "add",
        "10.202.0.2/24",
        "dev",
        "t0",
    ])?;
    ip(&["-n", &rns, "addr", "add", "10.202.0.1/24", "dev", "tc"])?;
    ip(&["-n", &client_ns, "link", "set", "t0", "up"])?;
    ip(&["-n", &client_ns, "link", "set", "lo", "up"])?;
    ip(&["-n", &rns, "link", "set", "tc", "up"])?;
    ip(&[
        "-n",
        &client_ns,
        "route",
        "add",
        "default",
        "via",
        "10.202.0.1",
    ])?;
    ip(&["-n", &rns, "link", "add", "brp", "type", "bridge"])?;
    ip(&[
        "-n",
        &rns,
        "addr",
        "add",
        &format!("{ROUTER}/24"),
        "dev",
        "brp",
    ])?;
    ip(&["-n", &rns, "link", "set", "brp", "up"])?;
    let mut proxies = Vec::new();
    for i in 0..PROXIES {
        let name = format!("tp{}", i + 1);
        let ns = netns_name(&name);
        new_netns(net, &ns)?;
        let port = format!("rp{}", i + 1);
        ip(&[
            "-n", &ns, "link", "add", "t0", "type", "veth", "peer", "name", &port, "netns", &rns,
        ])?;
        ip(&["-n", &rns, "link", "set", &port, "master", "brp", "up"])?;
        let addr = proxy_addr(i);
        ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "t0"])?;
        for a in [VIP, SHARED] {
            ip(&["-n", &ns, "addr", "add", &format!("{a}/32"), "dev", "lo"])?;
        }
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &ns, "link", "set", "t0", "up"])?;
        ip(&[
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &ROUTER.to_string(),
        ])?;
        net.hosts.push(Host {
            name,
            netns: ns,
            veth: port,
            ip: addr,
            behind: Some(rns.clone()),
        });
        proxies.push(net.hosts.len() - 1);
    }
    // Every host of the bridge reaches the tier's addresses through the router.
    let via = net.hosts[router].ip.to_string();
    for h in 0..net.hosts.len() {
        if h != router && net.hosts[h].behind.is_none() {
            let ns = net.hosts[h].netns.clone();
            ip(&["-n", &ns, "route", "add", "10.202.0.0/16", "via", &via])?;
        }
    }
    let bpffs = PathBuf::from(format!("/run/{}-bpf", netns_name("tier")));
    std::fs::create_dir_all(&bpffs).with_context(|| format!("creating {}", bpffs.display()))?;
    let dir = bpffs.display().to_string();
    net.made(&["umount", &dir], || {
        let ok = Command::new("mount")
            .args(["-t", "bpf", "bpf", &dir])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            Ok(())
        } else {
            bail!("cannot mount a bpffs at {dir}")
        }
    })?;
    Ok(Tier {
        router,
        servers: servers.to_vec(),
        proxies,
        client_ns,
        bpffs,
    })
}

fn new_netns(net: &mut Net, ns: &str) -> Result<()> {
    net.made(&["ip", "netns", "del", ns], || ip(&["netns", "add", ns]))
}

fn sysctl(ns: &str, kv: &str) -> Result<()> {
    let ok = Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-qw", kv])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!("sysctl {kv} in {ns}");
    }
    Ok(())
}

impl Tier {
    /// `rserpool distributor`'s flags, on the router.
    pub fn distributor_args(&self, registrars: &[SocketAddr]) -> Vec<String> {
        let mut a: Vec<String> = ["distributor", "--pool", PROXY_POOL, "--group"]
            .map(String::from)
            .to_vec();
        a.push(GROUP.to_string());
        a.extend(["--heartbeat-ms".into(), HEARTBEAT_MS.to_string()]);
        for prefix in [VIP, SHARED] {
            a.extend(["--route".into(), format!("{prefix}/32")]);
        }
        for r in registrars {
            a.extend(["--registrar".into(), r.to_string()]);
        }
        a
    }

    /// Server `j`'s flags (`example http`, PE identifier 0x900 + j).
    pub fn server_args(&self, net: &Net, j: usize, registrars: &[SocketAddr]) -> Vec<String> {
        let listen = SocketAddr::from((net.hosts[self.servers[j]].ip, SERVER_PORT));
        let mut a: Vec<String> = ["example", "http", "--pool", SERVER_POOL]
            .map(String::from)
            .to_vec();
        a.extend(["--listen".into(), listen.to_string()]);
        a.extend(["--id".into(), format!("{:#x}", 0x900 + j)]);
        for r in registrars {
            a.extend(["--registrar".into(), r.to_string()]);
        }
        a
    }

    /// Writes proxy `i`'s configuration into `dir` (its access log goes there too, one line per
    /// connection: how each one ended); returns its flags. A successor started
    /// with the same file takes the proxy over (docs/OPERATIONS.md).
    pub fn proxy_args(
        &self,
        i: usize,
        registrars: &[SocketAddr],
        dir: &Path,
    ) -> Result<Vec<String>> {
        let me = proxy_addr(i);
        let list: Vec<String> = registrars.iter().map(|r| format!("\"{r}\"")).collect();
        let pins = self.bpffs.join(format!("p{}", i + 1));
        let (lo, hi) = (20_000 + 1000 * (i + 1), 20_999 + 1000 * (i + 1));
        // A held hand-over waits up to 1 s for a slow server (debug builds on a busy CPU).
        let cfg = format!(
            "registrars = [{}]\nrefresh-ms = 200\nstatus = \"{}\"\naccess-log = \"{}\"\n\
             [[listener]]\nlisten = \"{VIP}:{FRONT_PORT}\"\nmode = \"tcp\"\npool = \"{SERVER_POOL}\"\n\
             splice = \"kernel\"\n\
             [kernel-splice]\ninterfaces = [\"t0\"]\npin-dir = \"{}\"\nhold-after-ms = 50\n\
             drain-stall-ms = 1000\ndrain-timeout-ms = 10000\n\
             [tier]\npool = \"{PROXY_POOL}\"\nlisten = \"{me}:9950\"\nserver-address = \"{SHARED}\"\n\
             ports = \"{lo}-{hi}\"\n",
            list.join(", "),
            proxy_status(i),
            dir.join(format!("tp{}.access.log", i + 1)).display(),
            pins.display(),
        );
        let path = dir.join(format!("tier-proxy{}.toml", i + 1));
        std::fs::write(&path, cfg).with_context(|| format!("writing {}", path.display()))?;
        Ok(vec![
            "proxy".into(),
            "--config".into(),
            path.display().to_string(),
        ])
    }

    /// Members of the router's nexthop group now.
    pub fn group_members(&self, net: &Net) -> usize {
        rserpool_ksplice::testbed::group_members(&net.hosts[self.router].netns, GROUP)
    }
}
