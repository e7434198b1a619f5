//! `rserpool distributor`: the stateless front of a proxy tier (docs/TIER.md; the TCP splice
//! seed's load balancer). It runs beside the router and keeps a resilient nexthop group equal
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
use rserpool_ksplice::watch::{Traffic, Watch};
use rserpool_wire::{PoolHandle, UserTransport};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::time::Instant;
use tracing::{info, warn};

#[derive(Args, Debug, serde::Serialize)]
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

/// What the distributor knows of one proxy.
#[derive(Debug)]
struct Proxy {
    addr: SocketAddr,
    /// Its nexthop's ID, and whether it is made.
    nh: u32,
    nh_made: bool,
    /// Heartbeats in a row not answered in time.
    missed: u32,
    answered: bool,
    /// The free fraction of its capacity, from its last answer.
    free: f64,
    weight: u32,
    /// In the group now.
    live: bool,
    sent_at: Option<Instant>,
    /// Its MAC address, for the traffic watch (from the router's neighbour table).
    mac: Option<[u8; 6]>,
    /// The watch's counts at the last look, when it last sent a frame, and the frames sent
    /// to it until then.
    seen: Traffic,
    heard_at: Instant,
    to_at_heard: u64,
}

pub fn run(args: DistributorArgs) -> Result<()> {
    super::init_logging();
    if args.misses == 0 || args.heartbeat_ms == 0 {
        bail!("--misses and --heartbeat-ms must be above 0");
    }
    let cfg = super::pu_config(&args.registrars)?;
    super::runtime()?.block_on(async move {
        let mut pu = PoolUser::new(rserpool_asap::PoolUserConfig {
            subscribe: true,
            ..cfg
        })?;
        let udp = UdpSocket::bind("0.0.0.0:0")
            .await
            .context("binding the heartbeat socket")?;
        let handle = PoolHandle::from(args.pool.as_str());
        let mut proxies: BTreeMap<u32, Proxy> = BTreeMap::new();
        let mut next_nh = args.first_id;
        let mut applied: Option<Vec<(u32, u32)>> = None;
        let mut routed = false;
        let mut beat = tokio::time::interval(Duration::from_millis(args.heartbeat_ms));
        let answer = Duration::from_millis(
            args.answer_ms
                .unwrap_or(args.heartbeat_ms / 5)
                .clamp(5, args.heartbeat_ms.max(5)),
        );
        // When this round's heartbeats must have been answered.
        let mut answers_due: Option<Instant> = None;
        // Proxies found dead whose peers have not heard of it yet (told once the group no
        // longer has them).
        let mut died: Vec<u32> = Vec::new();
        let mut resolve_at = Instant::now();
        let mut seq = 0u32;
        let mut buf = [0u8; 64];
        let mut watch = match &args.watch {
            Some(dev) => Some(
                Watch::attach(dev).with_context(|| format!("watching the traffic on {dev}"))?,
            ),
            None => None,
        };
        let mut look = tokio::time::interval(Duration::from_millis(5));
        look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let silence = Duration::from_millis(args.silence_ms);
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
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                _ = beat.tick() => {
                    seq = seq.wrapping_add(1);
                    let mut hb = [0u8; 8];
                    hb[..4].copy_from_slice(rserpool_proxy::tier::HEARTBEAT_MAGIC);
                    hb[4..].copy_from_slice(&seq.to_be_bytes());
                    for p in proxies.values_mut() {
                        let _ = udp.send_to(&hb, p.addr).await;
                        p.sent_at = Some(Instant::now());
                    }
                    answers_due = Some(Instant::now() + answer);
                }
                () = tokio::time::sleep_until(answers_due.unwrap_or_else(Instant::now)),
                    if answers_due.is_some() =>
                {
                    answers_due = None;
                    for (id, p) in proxies.iter_mut() {
                        if p.sent_at.take().is_none() {
                            continue;
                        }
                        p.missed += 1;
                        if p.live && p.missed >= args.misses {
                            warn!(
                                "distributor: proxy {id:#010x} at {} is dead: {} heartbeats \
                                 without an answer",
                                p.addr, p.missed
                            );
                            p.live = false;
                            died.push(*id);
                        }
                    }
                }
                got = udp.recv_from(&mut buf) => {
                    let Ok((n, from)) = got else { continue };
                    if n < 16 || &buf[..4] != rserpool_proxy::tier::HEARTBEAT_MAGIC {
                        continue;
                    }
                    let id = u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]);
                    let free = u32::from_be_bytes([buf[12], buf[13], buf[14], buf[15]]);
                    if let Some(p) = proxies.get_mut(&id).filter(|p| p.addr == from) {
                        p.missed = 0;
                        p.sent_at = None;
                        p.free = f64::from(free.min(1_000_000)) / 1e6;
                        if !p.answered || !p.live {
                            info!("distributor: proxy {id:#010x} at {} is alive", p.addr);
                            p.heard_at = Instant::now();
                            p.to_at_heard = p.seen.to;
                        }
                        p.answered = true;
                        p.live = true;
                    }
                }
                _ = look.tick(), if watch.is_some() => {
                    let Some(w) = watch.as_mut() else { continue };
                    let counts = match w.read() {
                        Ok(c) => c,
                        Err(e) => {
                            warn!("distributor: reading the traffic watch: {e}");
                            continue;
                        }
                    };
                    let now = Instant::now();
                    for (id, p) in proxies.iter_mut() {
                        let Some(t) = p.mac.and_then(|m| counts.get(&m)) else { continue };
                        if t.from > p.seen.from || t.to < p.seen.to {
                            p.heard_at = now;
                            p.to_at_heard = t.to;
                        }
                        p.seen = *t;
                        let unanswered = t.to.saturating_sub(p.to_at_heard);
                        if p.live
                            && now - p.heard_at >= silence
                            && unanswered >= args.silence_frames
                        {
                            warn!(
                                "distributor: proxy {id:#010x} at {} is dead: it was sent \
                                 {unanswered} frames in {} ms and sent none",
                                p.addr,
                                (now - p.heard_at).as_millis()
                            );
                            p.live = false;
                            died.push(*id);
                        }
                    }
                }
                _ = pu.next_push(), if Instant::now() < resolve_at => {
                    resolve_at = Instant::now();
                }
                () = tokio::time::sleep_until(resolve_at) => {
                    resolve_at = Instant::now() + Duration::from_secs(1);
                    match pu.pool_elements(&handle).await {
                        Ok((_, pes)) => {
                            let listed: HashMap<u32, SocketAddr> = pes
                                .iter()
                                .filter_map(|pe| match &pe.user_transport {
                                    UserTransport::Address(a) => {
                                        a.socket_addrs().next().map(|s| (pe.id, s))
                                    }
                                    _ => None,
                                })
                                .collect();
                            for (id, p) in proxies.iter_mut() {
                                if p.live && !listed.contains_key(id) {
                                    warn!(
                                        "distributor: proxy {id:#010x} at {} left the tier pool",
                                        p.addr
                                    );
                                    p.live = false;
                                    died.push(*id);
                                }
                            }
                            proxies.retain(|id, _| listed.contains_key(id));
                            for (id, addr) in listed {
                                proxies.entry(id).or_insert_with(|| {
                                    info!("distributor: proxy {id:#010x} at {addr} in the tier pool");
                                    let nh = next_nh;
                                    next_nh += 1;
                                    Proxy {
                                        addr,
                                        nh,
                                        nh_made: false,
                                        missed: 0,
                                        answered: false,
                                        free: 1.0,
                                        weight: 1,
                                        live: false,
                                        sent_at: None,
                                        mac: None,
                                        seen: Traffic::default(),
                                        heard_at: Instant::now(),
                                        to_at_heard: 0,
                                    }
                                });
                            }
                            if let Some(w) = watch.as_mut() {
                                for p in proxies.values_mut().filter(|p| p.mac.is_none()) {
                                    p.mac = neighbour_mac(p.addr.ip());
                                }
                                let macs: Vec<[u8; 6]> =
                                    proxies.values().filter_map(|p| p.mac).collect();
                                if let Err(e) = w.set(&macs) {
                                    warn!("distributor: the traffic watch: {e}");
                                }
                            }
                        }
                        Err(e) => warn!("distributor: resolving {}: {e}", args.pool),
                    }
                }
            }
            // The group the live proxies make, with weights that move only by 2 or more.
            let levels = args.weight_levels.max(1);
            for p in proxies.values_mut() {
                let w = 1 + (p.free * f64::from(levels - 1)).round() as u32;
                if w.abs_diff(p.weight) >= 2 || levels == 1 {
                    p.weight = w;
                }
            }
            let want: Vec<(u32, u32)> = proxies
                .values()
                .filter(|p| p.live)
                .map(|p| (p.nh, if levels == 1 { 1 } else { p.weight }))
                .collect();
            if applied.as_ref() != Some(&want) {
                if want.is_empty() {
                    warn!("distributor: no proxy of the tier is alive; the group stays as it was");
                    applied = Some(want);
                    continue;
                }
                // A member's own nexthop is made once: a death then costs one `ip` call.
                let new: Vec<&Proxy> = proxies
                    .values()
                    .filter(|p| p.live && !p.nh_made)
                    .collect();
                if let Err(e) = apply(&args, &new, &want, !routed) {
                    warn!("distributor: updating the nexthop group: {e:#}");
                    continue;
                }
                for p in proxies.values_mut().filter(|p| p.live) {
                    p.nh_made = true;
                }
                routed = true;
                tell_the_living(&udp, &proxies, &mut died).await;
                info!(
                    "distributor: group {} = {}",
                    args.group,
                    want.iter()
                        .map(|(nh, w)| format!("{nh}×{w}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                );
                applied = Some(want);
            }
        }
    })
}

/// Tells the live proxies which ones died, so that they nudge the connections that lost
/// packets to it; the first live one sends the probes.
async fn tell_the_living(udp: &UdpSocket, proxies: &BTreeMap<u32, Proxy>, died: &mut Vec<u32>) {
    for dead in died.drain(..) {
        let mut first = true;
        for p in proxies.values().filter(|p| p.live) {
            let mut m = [0u8; 9];
            m[..4].copy_from_slice(rserpool_proxy::tier::DEAD_MAGIC);
            m[4..8].copy_from_slice(&dead.to_be_bytes());
            m[8] = u8::from(first);
            first = false;
            let _ = udp.send_to(&m, p.addr).await;
        }
    }
}

/// Makes the nexthops of `new` members, then the group (and, the first time, the routes)
/// what `want` says.
fn apply(args: &DistributorArgs, new: &[&Proxy], want: &[(u32, u32)], first: bool) -> Result<()> {
    for p in new {
        let IpAddr::V4(v4) = p.addr.ip() else {
            bail!("proxy at {}: IPv4 only", p.addr);
        };
        let dev = device_towards(&v4.to_string(), args.dry_run)?;
        ip(
            args.dry_run,
            &[
                "nexthop",
                "replace",
                "id",
                &p.nh.to_string(),
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
