//! `rserpool distributor`: the stateless front of a proxy tier (docs/TIER.md; the TCP splice
//! seed's load balancer). Its decisions (heartbeats, liveness, weights, the group, whom to
//! tell of a death) are `rserpool_tier`'s sans-IO distributor core; this command carries its
//! datagrams, resolves the pool, reads the eBPF traffic watch and runs `ip`. It runs beside the router and keeps a resilient nexthop group equal
//! to the live proxies of the tier pool, weighted by their workload factors. The router's ECMP
//! hash then spreads the clients' packets (and the PEs' answers to the shared server-facing
//! address) over them. A resilient group moves only the buckets of a member that went (and,
//! for one that came or a weight that changed, only buckets idle for `--idle-timer-s`): the
//! connections on the other members keep their member.
//!
//! A proxy is dead after `--misses` heartbeats in a row without an answer (every
//! `--heartbeat-ms`, each answered within `--answer-ms`), or as soon as it leaves the tier
//! pool (the registrars' own supervision), whichever comes first: 2–3 heartbeat intervals
//! after it died. With `--watch DEV` (the router's interface towards the proxies) a proxy is
//! also dead as soon as the router has kept sending it frames for `--silence-ms` and it sent
//! none back (`rserpool_ksplice::watch`): tens of milliseconds instead of heartbeats, before
//! the TCP senders behind it lose a retransmission. The group is changed with iproute2 (`ip
//! nexthop`), which every Linux router has. Then the live proxies hear of the death, and
//! nudge the TCP senders that were backing off on packets the dead one lost
//! (`rserpool_ksplice::nudge`).

use crate::RegistrarOpts;
use anyhow::{Context, Result, bail};
use clap::Args;
use rserpool_asap::PoolUser;
use rserpool_ksplice::watch::Watch;
use rserpool_tier::distributor::{DistributorConfig, DistributorCore, Group, Traffic};
use rserpool_wire::{PoolHandle, UserTransport};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::time::Instant;
use tracing::{info, warn};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct DistributorArgs {
    /// The tier's pool handle (the proxies' `[tier] pool`).
    #[arg(long)]
    pub pool: String,
    /// The nexthop group to keep (its ID); the members' nexthops get IDs from `--first-id`.
    #[arg(long, default_value_t = 100)]
    pub group: u32,
    #[arg(long, default_value_t = 1000)]
    pub first_id: u32,
    /// Routes to point at the group, e.g. the clients' address and the shared server-facing
    /// address (`10.9.0.1/32`; repeatable).
    #[arg(long = "route", value_name = "PREFIX")]
    pub routes: Vec<String>,
    /// Heartbeat interval.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// Heartbeats in a row without an answer that make a proxy dead.
    #[arg(long, default_value_t = 3)]
    pub misses: u32,
    /// A heartbeat not answered within this is missed (default: a fifth of the heartbeat
    /// interval, at least 5 ms).
    #[arg(long)]
    pub answer_ms: Option<u64>,
    /// The router's interface towards the proxies: watch their traffic there (eBPF) and take
    /// a proxy for dead once it answers none of the frames it is sent for `--silence-ms`.
    #[arg(long, value_name = "DEV")]
    pub watch: Option<String>,
    /// With `--watch`: how long a proxy may send nothing while it is sent frames. Shorter
    /// than a TCP sender's tail loss probe (2 round trips), so that few senders lose one.
    #[arg(long, default_value_t = 20)]
    pub silence_ms: u64,
    /// With `--watch`: how many frames it must have been sent meanwhile (an idle proxy is
    /// left to the heartbeats).
    #[arg(long, default_value_t = 32)]
    pub silence_frames: u64,
    /// Buckets of the resilient group.
    #[arg(long, default_value_t = 128)]
    pub buckets: u32,
    /// A bucket idle this long may move to rebalance (a member that came, a new weight).
    #[arg(long, default_value_t = 1)]
    pub idle_timer_s: u32,
    /// Weight levels from the workload factor: a proxy's weight is 1 + its free capacity ×
    /// (levels − 1), rounded; a weight changes only when it moves by 2 or more. 1: equal
    /// weights.
    #[arg(long, default_value_t = 8)]
    pub weight_levels: u32,
    /// Print the `ip` commands instead of running them.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

pub fn run(args: DistributorArgs) -> Result<()> {
    super::init_logging();
    if args.misses == 0 || args.heartbeat_ms == 0 {
        bail!("--misses and --heartbeat-ms must be above 0");
    }
    if !args.dry_run && !has_net_admin() {
        bail!(
            "the distributor changes the router's nexthop group and routes, which needs \
             CAP_NET_ADMIN: run it as root (or with --dry-run, to print the commands instead)"
        );
    }
    let cfg = super::pu_config(&args.registrars)?;
    super::runtime()?.block_on(async move {
        let pu = PoolUser::new(rserpool_asap::PoolUserConfig {
            subscribe: true,
            ..cfg
        })?;
        let udp = UdpSocket::bind("0.0.0.0:0")
            .await
            .context("binding the heartbeat socket")?;
        let handle = PoolHandle::from(args.pool.as_str());
        let epoch = std::time::Instant::now();
        let now = || rserpool_tier::Instant::since(epoch, std::time::Instant::now());
        let mut core = DistributorCore::new(core_config(&args), now());
        let mut group = Nexthops::new(&args);
        let mut watch = match &args.watch {
            Some(dev) => Some(TrafficWatch::attach(dev).with_context(|| {
                format!("--watch {dev} (eBPF on the router: root, CAP_BPF and CAP_NET_ADMIN)")
            })?),
            None => None,
        };
        // The last failure to update the group, logged once until it changes or succeeds.
        let mut group_failing: Option<String> = None;
        let mut look = tokio::time::interval(Duration::from_millis(5));
        look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut resolutions = resolver(pu, handle);
        let mut buf = [0u8; 64];
        info!(
            "distributor: tier pool {}, nexthop group {}, heartbeat {} ms × {}{}",
            args.pool,
            args.group,
            args.heartbeat_ms,
            args.misses,
            args.watch.as_ref().map_or(String::new(), |d| format!(
                ", traffic watched on {d} (silence {} ms)",
                args.silence_ms
            ))
        );
        let shutdown = super::shutdown_signal();
        tokio::pin!(shutdown);
        loop {
            let due = core.poll_timeout().to_std(epoch).map_or_else(
                || Instant::now() + Duration::from_secs(3600),
                Instant::from_std,
            );
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep_until(due) => core.tick(now()),
                got = udp.recv_from(&mut buf) => {
                    if let Ok((n, from)) = got {
                        core.handle_datagram(from, &buf[..n], now());
                    }
                }
                _ = look.tick(), if watch.is_some() => {
                    if let Some(traffic) = watch.as_mut().and_then(TrafficWatch::read) {
                        core.traffic(&traffic, now());
                    }
                }
                Some(resolved) = resolutions.recv() => {
                    match resolved {
                        Ok(pes) => {
                            let listed = listed(&pes);
                            core.set_listed(&listed, now());
                            // Members the core keeps (one gone from the pool that still
                            // answers) keep their nexthops.
                            group.listed(&core.members().collect());
                            if let Some(w) = watch.as_mut() {
                                w.listed(&listed, core.members());
                            }
                        }
                        Err(e) => warn!("distributor: resolving {}: {e}", args.pool),
                    }
                }
            }
            if let Some(g) = core.poll_group() {
                match group.apply(&args, &g) {
                    // The living hear of the deaths.
                    Ok(()) => {
                        core.group_applied(&g);
                        if group_failing.take().is_some() {
                            info!("distributor: the nexthop group is updated again");
                        }
                    }
                    Err(e) => {
                        let e = format!("{e:#}");
                        if group_failing.as_ref() != Some(&e) {
                            warn!("distributor: updating the nexthop group: {e} (retrying)");
                            group_failing = Some(e);
                        }
                    }
                }
            }
            while let Some((to, bytes)) = core.poll_transmit() {
                let _ = udp.send_to(&bytes, to).await;
            }
        }
    })
}

/// Resolves the tier pool once a second, and at once when a registrar pushes a change, in a
/// task of its own: a resolution waits for a registrar (seconds when the one it asks is cut
/// off), and the heartbeats, the traffic watch and the group must not wait with it — a dead
/// proxy stayed in the group for the 3 s a registrar's link was cut, and the connections of
/// its successor's first second were reset when it was taken out.
fn resolver(
    mut pu: PoolUser,
    handle: PoolHandle,
) -> tokio::sync::mpsc::Receiver<Result<Vec<rserpool_wire::PoolElement>, String>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut resolve_at = Instant::now();
        loop {
            tokio::select! {
                // A change of the pool: resolve it now.
                _ = pu.next_push(), if Instant::now() < resolve_at => resolve_at = Instant::now(),
                () = tokio::time::sleep_until(resolve_at) => {
                    resolve_at = Instant::now() + Duration::from_secs(1);
                    let got = pu
                        .pool_elements(&handle)
                        .await
                        .map(|(_, pes)| pes)
                        .map_err(|e| e.to_string());
                    if tx.send(got).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The core's settings from the command line.
fn core_config(args: &DistributorArgs) -> DistributorConfig {
    DistributorConfig {
        heartbeat: Duration::from_millis(args.heartbeat_ms),
        answer: Duration::from_millis(
            args.answer_ms
                .unwrap_or(args.heartbeat_ms / 5)
                .clamp(5, args.heartbeat_ms.max(5)),
        ),
        misses: args.misses,
        weight_levels: args.weight_levels,
        silence: Duration::from_millis(args.silence_ms),
        silence_frames: args.silence_frames,
    }
}

/// The tier's members as the registrars list them: ID and tier address.
fn listed(pes: &[rserpool_wire::PoolElement]) -> BTreeMap<u32, SocketAddr> {
    pes.iter()
        .filter_map(|pe| match &pe.user_transport {
            UserTransport::Address(a) => a.socket_addrs().next().map(|s| (pe.id, s)),
            _ => None,
        })
        .collect()
}

/// Nexthops per member in the group (see [`Nexthops`]).
const TWINS: u32 = 2;

/// The router's nexthops for the members and the group over them.
///
/// Each member has two nexthops in the group, both via its address ([`TWINS`]): the kernel
/// hashes a packet to a bucket (and marks the bucket busy) only when the group has more than
/// one nexthop. With a single member's single nexthop, every bucket would look idle after
/// `idle_timer` however busy it was, and the member that comes back next would be given
/// half of them at once, the buckets of connections still held on the other's sockets too.
struct Nexthops {
    /// Each listed member's first nexthop ID (the others follow it), and whether they are
    /// made.
    ids: BTreeMap<u32, (u32, bool)>,
    next: u32,
    /// The routes point at the group.
    routed: bool,
}

impl Nexthops {
    fn new(args: &DistributorArgs) -> Self {
        Self {
            ids: BTreeMap::new(),
            next: args.first_id,
            routed: false,
        }
    }

    /// A nexthop ID for every listed member; none for those gone.
    fn listed(&mut self, listed: &BTreeMap<u32, SocketAddr>) {
        self.ids.retain(|id, _| listed.contains_key(id));
        for id in listed.keys() {
            self.ids.entry(*id).or_insert_with(|| {
                self.next += TWINS;
                (self.next - TWINS, false)
            });
        }
    }

    /// Makes the router's group the core's: a member's own nexthop is made once, so a death
    /// then costs one `ip` call.
    fn apply(&mut self, args: &DistributorArgs, g: &Group) -> Result<()> {
        let mut new = Vec::new();
        let mut want = Vec::new();
        for &(id, addr, w) in &g.members {
            let Some(&(nh, made)) = self.ids.get(&id) else {
                continue;
            };
            for twin in nh..nh + TWINS {
                if !made {
                    new.push((twin, addr));
                }
                want.push((twin, w));
            }
        }
        apply(args, &new, &want, !self.routed)?;
        for (id, _, _) in &g.members {
            if let Some(n) = self.ids.get_mut(id) {
                n.1 = true;
            }
        }
        self.routed = true;
        info!(
            "distributor: group {} = {}",
            args.group,
            want.iter()
                .map(|(nh, w)| format!("{nh}×{w}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        Ok(())
    }
}

/// The eBPF traffic watch on the router's interface towards the members, by member.
struct TrafficWatch {
    watch: Watch,
    /// The members' MAC addresses (from the neighbour table).
    macs: BTreeMap<u32, [u8; 6]>,
}

impl TrafficWatch {
    fn attach(dev: &str) -> Result<Self> {
        Ok(Self {
            watch: Watch::attach(dev).with_context(|| format!("watching the traffic on {dev}"))?,
            macs: BTreeMap::new(),
        })
    }

    /// What each member was sent and sent back so far.
    fn read(&mut self) -> Option<BTreeMap<u32, Traffic>> {
        match self.watch.read() {
            Ok(counts) => Some(
                self.macs
                    .iter()
                    .filter_map(|(id, m)| {
                        let t = counts.get(m)?;
                        Some((
                            *id,
                            Traffic {
                                to: t.to,
                                from: t.from,
                            },
                        ))
                    })
                    .collect(),
            ),
            Err(e) => {
                warn!("distributor: reading the traffic watch: {e}");
                None
            }
        }
    }

    /// Watches the members the core knows, once their MAC addresses are known.
    fn listed(
        &mut self,
        listed: &BTreeMap<u32, SocketAddr>,
        members: impl Iterator<Item = (u32, SocketAddr)>,
    ) {
        self.macs.retain(|id, _| listed.contains_key(id));
        for (id, addr) in members {
            if !self.macs.contains_key(&id)
                && let Some(m) = neighbour_mac(addr.ip())
            {
                self.macs.insert(id, m);
            }
        }
        let all: Vec<[u8; 6]> = self.macs.values().copied().collect();
        if let Err(e) = self.watch.set(&all) {
            warn!("distributor: the traffic watch: {e}");
        }
    }
}

/// Makes the nexthops of `new` members, then the group (and, the first time, the routes)
/// what `want` says.
fn apply(
    args: &DistributorArgs,
    new: &[(u32, SocketAddr)],
    want: &[(u32, u32)],
    first: bool,
) -> Result<()> {
    for &(nh, addr) in new {
        let IpAddr::V4(v4) = addr.ip() else {
            bail!("proxy at {addr}: IPv4 only");
        };
        let dev = device_towards(&v4.to_string(), args.dry_run)?;
        ip(
            args.dry_run,
            &[
                "nexthop",
                "replace",
                "id",
                &nh.to_string(),
                "via",
                &v4.to_string(),
                "dev",
                &dev,
            ],
        )?;
    }
    let group = want
        .iter()
        .map(|(nh, w)| format!("{nh},{w}"))
        .collect::<Vec<_>>()
        .join("/");
    ip(
        args.dry_run,
        &[
            "nexthop",
            "replace",
            "id",
            &args.group.to_string(),
            "group",
            &group,
            "type",
            "resilient",
            "buckets",
            &args.buckets.to_string(),
            "idle_timer",
            &args.idle_timer_s.to_string(),
        ],
    )?;
    if first {
        for r in &args.routes {
            ip(
                args.dry_run,
                &["route", "replace", r, "nhid", &args.group.to_string()],
            )?;
        }
    }
    Ok(())
}

/// The MAC address of `ip` in the router's neighbour table (the heartbeats keep it there).
fn neighbour_mac(ip: IpAddr) -> Option<[u8; 6]> {
    let out = std::process::Command::new("ip")
        .args(["neigh", "show", &ip.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    words.find(|w| *w == "lladdr")?;
    let mut mac = [0u8; 6];
    let mut parts = words.next()?.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    Some(mac)
}

/// The interface of the route towards `ip`.
fn device_towards(ip: &str, dry_run: bool) -> Result<String> {
    if dry_run {
        return Ok("DEV".into());
    }
    let out = std::process::Command::new("ip")
        .args(["-o", "route", "get", ip])
        .output()
        .context("running ip (iproute2)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "dev" {
            return words
                .next()
                .map(str::to_string)
                .context("`ip route get` named no device");
        }
    }
    bail!("no route towards {ip}")
}

/// Whether this process may change routes and nexthops (CAP_NET_ADMIN in its effective set,
/// as `/proc/self/status` gives it; root has it).
fn has_net_admin() -> bool {
    const CAP_NET_ADMIN: u32 = 12;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_owned();
            u64::from_str_radix(&hex, 16).ok()
        })
        // Unreadable: let `ip` say what is wrong.
        .is_none_or(|caps| caps & (1 << CAP_NET_ADMIN) != 0)
}

fn ip(dry_run: bool, args: &[&str]) -> Result<()> {
    if dry_run {
        println!("ip {}", args.join(" "));
        return Ok(());
    }
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
