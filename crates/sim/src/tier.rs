//! The proxy tier under the simulated clock: member cores and a distributor core
//! (`rserpool-tier`, the code the proxies and `rserpool distributor` run) with a model of each
//! member's datapath (its flow table, expiry and forwarding by port) and of the router (the
//! distributor's group; a flow stays on its member until that member leaves the group). A
//! seed decides everything, so a failure replays.
//!
//! One run ([`run_seed`]): 3 or 4 members start; spliced connections are made at members
//! over time, carry packets through whichever member the router picks, and end by FINs or an
//! RST. Rounds of faults (members crash, silently or not, and start again as new processes;
//! pairs of members are cut from each other; a member is isolated from everyone; datagrams
//! are lost) alternate with calm. Checked all along (docs/TIER.md):
//! - (a) once the tier has been calm for [`SETTLE_MS`], every live member holds every open
//!   connection some live member holds (a member that joins or comes back got the table);
//!   no packet of such a connection meets a member that neither holds nor forwards it; and
//!   no open connection's entry is removed by a DEL;
//! - (b) no entry outlives its connection by more than [`ENTRY_BOUND_MS`];
//! - (c) the distributor's group holds every member reachable and alive for
//!   [`JOIN_BOUND_MS`], and none dead or cut off from it for its detection bound.

use crate::net::Ms;
use crate::rng::Rng;
use rserpool_tier::distributor::{DistributorConfig, DistributorCore};
use rserpool_tier::member::{Action, Expiry, Forward, LinkId, TableEntry};
use rserpool_tier::{Hello, Instant, MemberCore, Message, Splice};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

/// The simulation's step.
const STEP_MS: Ms = 5;
pub const HEARTBEAT_MS: Ms = 100;
const ANSWER_MS: Ms = 20;
const MISSES: u32 = 3;
pub const IDLE_MS: Ms = 20_000;
pub const CLOSING_MS: Ms = 1_000;
/// How often members and the distributor resolve the tier pool.
const DISCOVERY_MS: Ms = 1_000;
/// From a process's start to its being listed in the pool; from a death to its leaving the
/// pool (a killed process's registrar connection closes), or for a host that died silently
/// (the registrar's keep-alive).
const LIST_LAG_MS: Ms = 200;
const KILL_LAG_MS: Ms = 100;
const SILENT_LAG_MS: Ms = 3_000;
/// A link's unacknowledged data older than this resets it; a connection attempt gives up
/// after `CONNECT_TIMEOUT_MS` (the driver's).
const LINK_TIMEOUT_MS: Ms = 1_500;
const CONNECT_TIMEOUT_MS: Ms = 2_000;
/// Calm needed before (a) is checked: a listing lag, a discovery round, a connection attempt
/// that times out and the next one, the table's transfer.
pub const SETTLE_MS: Ms = LIST_LAG_MS + 2 * DISCOVERY_MS + CONNECT_TIMEOUT_MS + 1_000;
/// A new splice reaches every member within this (a link's delay, in calm).
const REPLICATION_MS: Ms = 200;
/// (b): an entry goes at most this long after its connection ended: idle at a member that
/// missed the end, plus a pass and the expiry's own period.
pub const ENTRY_BOUND_MS: Ms = IDLE_MS + 3_000;
/// (c): a member alive and reachable is in the group within this: listed, resolved, answered.
pub const JOIN_BOUND_MS: Ms = LIST_LAG_MS + DISCOVERY_MS + 2 * HEARTBEAT_MS + 200;

const WARM_UP_MS: Ms = 3_000;
const ROUNDS: usize = 4;
const FAULTS_MS: Ms = 6_000;
const CALM_MS: Ms = 8_000;
const FINAL_MS: Ms = ENTRY_BOUND_MS + 2_000;

fn t(ms: Ms) -> Instant {
    Instant::from_millis(ms)
}

fn tier_addr(k: usize) -> SocketAddr {
    SocketAddr::from(([10, 88, 1, 11 + k as u8], 9950))
}

fn distributor_addr() -> SocketAddr {
    SocketAddr::from(([10, 88, 1, 1], 40000))
}

const SHARED: Ipv4Addr = Ipv4Addr::new(10, 88, 9, 2);

fn ports(k: usize) -> (u16, u16) {
    let lo = 20_000 + 1_000 * k as u16;
    (lo, lo + 999)
}

/// One datapath entry pair (a connection) in a member's flow table.
#[derive(Debug, Clone)]
struct Entry {
    splice: Splice,
    /// When it was installed here.
    installed: Ms,
    fin: [bool; 2],
    last: [Ms; 2],
    packets: [u64; 2],
}

/// A live member process: its core and its datapath.
struct Proc {
    core: MemberCore,
    id: u32,
    life: u32,
    table: BTreeMap<(SocketAddrV4, SocketAddrV4), Entry>,
    forward: Vec<Forward>,
    next_expire: Ms,
    next_discovery: Ms,
}

struct Member {
    proc: Option<Proc>,
    life: u32,
    /// Listed in the tier pool from/until (the registrars' view lags).
    listed_from: Option<Ms>,
    listed_until: Option<Ms>,
    /// Cut from everyone (members, router, distributor) until then.
    isolated_until: Ms,
    /// Alive and reachable by the distributor since (for (c)), or dead/cut off since.
    healthy_since: Option<Ms>,
    down_since: Option<Ms>,
}

/// An outgoing link from one member process to another.
struct Link {
    to: usize,
    /// The process that accepted it.
    to_life: Option<u32>,
    opened: Ms,
    connect_due: Ms,
    /// Messages: when due, when sent.
    queue: VecDeque<(Ms, Ms, Message)>,
}

struct Conn {
    splice: Splice,
    owner: usize,
    created: Ms,
    end_at: Ms,
    rst: bool,
    fin_done: [bool; 2],
    ended: Option<Ms>,
    /// The member ID each direction's packets go to (the router's bucket).
    bucket: [Option<u32>; 2],
    next_packet: Ms,
    next_dir: usize,
}

/// A datagram in flight: when due, from, to (a member, or `None`: the distributor), bytes.
type Datagram = (Ms, Option<usize>, Option<usize>, Vec<u8>);

/// What a run counted.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    pub faults: BTreeMap<&'static str, u64>,
    pub connections: u64,
    pub packets: u64,
    pub forwarded: u64,
    pub lost_packets: u64,
    /// Connections broken while some member that held them lived but the tier was not
    /// calm (allowed), and connections no live member held any more (all holders died).
    pub broken_unsettled: u64,
    pub lost_connections: u64,
    pub group_changes: u64,
    pub messages: u64,
    /// Entries installed after their connection ended (a table sent to a member that
    /// joined, or after a death, still had them): each lives up to the idle timeout again.
    pub revived: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
        self.connections += o.connections;
        self.packets += o.packets;
        self.forwarded += o.forwarded;
        self.lost_packets += o.lost_packets;
        self.broken_unsettled += o.broken_unsettled;
        self.lost_connections += o.lost_connections;
        self.group_changes += o.group_changes;
        self.messages += o.messages;
        self.revived += o.revived;
    }
}

/// A sabotage for checking that the checks can fail: the core's output is tampered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Break {
    None,
    /// A link that comes up carries HELLO only, not the table.
    NoTableOnJoin,
    /// The pass touches every entry of the table, not only those that carried packets:
    /// entries of ended connections then never idle out.
    TouchAll,
    /// The router's group takes members that come, never drops those that go.
    GroupNeverShrinks,
}

pub struct TierWorld {
    now: Ms,
    rng: Rng,
    members: Vec<Member>,
    links: BTreeMap<(usize, u32, LinkId), Link>,
    /// Datagrams in flight: due, from, to, bytes (`None`: the distributor).
    datagrams: Vec<Datagram>,
    dist: DistributorCore,
    next_dist_discovery: Ms,
    /// The group the router uses (member IDs).
    group: Vec<u32>,
    conns: Vec<Conn>,
    /// Connections open, and ended ones some member may still hold.
    open: Vec<usize>,
    ended: Vec<usize>,
    by_key: BTreeMap<(SocketAddrV4, SocketAddrV4), usize>,
    /// Pairs of members cut from each other until then.
    cuts: BTreeMap<(usize, usize), Ms>,
    /// Datagram loss (per mille) until then.
    loss: (u64, Ms),
    disturbed_at: Ms,
    expiry: Expiry,
    next_port: u32,
    sabotage: Break,
    pub counts: Counts,
    log: bool,
    violation: Option<String>,
}

impl TierWorld {
    pub fn new(seed: u64, members: usize, sabotage: Break, log: bool) -> Self {
        let cfg = DistributorConfig {
            heartbeat: Duration::from_millis(HEARTBEAT_MS),
            answer: Duration::from_millis(ANSWER_MS),
            misses: MISSES,
            weight_levels: 8,
            silence: Duration::from_millis(20),
            silence_frames: 32,
        };
        let mut w = Self {
            now: 0,
            rng: Rng::new(seed),
            members: (0..members)
                .map(|_| Member {
                    proc: None,
                    life: 0,
                    listed_from: None,
                    listed_until: None,
                    isolated_until: 0,
                    healthy_since: None,
                    down_since: Some(0),
                })
                .collect(),
            links: BTreeMap::new(),
            datagrams: Vec::new(),
            dist: DistributorCore::new(cfg, t(0)),
            next_dist_discovery: 0,
            group: Vec::new(),
            conns: Vec::new(),
            open: Vec::new(),
            ended: Vec::new(),
            by_key: BTreeMap::new(),
            cuts: BTreeMap::new(),
            loss: (0, 0),
            disturbed_at: 0,
            expiry: Expiry {
                idle: Duration::from_millis(IDLE_MS),
                closing: Duration::from_millis(CLOSING_MS),
            },
            next_port: 0,
            sabotage,
            counts: Counts::default(),
            log,
            violation: None,
        };
        for k in 0..members {
            w.start(k);
        }
        w
    }

    fn say(&self, f: impl FnOnce() -> String) {
        if self.log {
            eprintln!("{:>6} ms  {}", self.now, f());
        }
    }

    fn fail(&mut self, why: String) {
        if self.violation.is_none() {
            self.say(|| format!("VIOLATION: {why}"));
            self.violation = Some(format!("at {} ms: {why}", self.now));
        }
    }

    fn count(&mut self, fault: &'static str) {
        *self.counts.faults.entry(fault).or_default() += 1;
    }

    fn alive(&self, k: usize) -> bool {
        self.members[k].proc.is_some()
    }

    fn isolated(&self, k: usize) -> bool {
        self.members[k].isolated_until > self.now
    }

    fn reachable(&self, a: usize, b: usize) -> bool {
        !self.isolated(a)
            && !self.isolated(b)
            && self
                .cuts
                .get(&(a.min(b), a.max(b)))
                .is_none_or(|&until| until <= self.now)
    }

    fn delay(&mut self) -> Ms {
        let d = 1 + self.rng.below(10);
        if self.loss.1 > self.now && self.rng.chance(self.loss.0) {
            d + 200 + self.rng.below(600)
        } else {
            d
        }
    }

    fn settled(&self) -> bool {
        self.now >= self.disturbed_at + SETTLE_MS
    }

    fn disturb(&mut self, until: Ms) {
        self.disturbed_at = self.disturbed_at.max(until);
    }

    /// Member `k` starts as a new process (a new pool element identifier).
    fn start(&mut self, k: usize) {
        let m = &mut self.members[k];
        m.life += 1;
        let life = m.life;
        let id = loop {
            let id = self.rng.below(u64::from(u32::MAX)) as u32;
            if id != 0
                && !self
                    .members
                    .iter()
                    .any(|m| m.proc.as_ref().is_some_and(|p| p.id == id))
            {
                break id;
            }
        };
        let (lo, hi) = ports(k);
        let hello = Hello {
            id,
            mac: [2, 0, 0, 0, 0, k as u8 + 1],
            shared: SHARED,
            lo,
            hi,
        };
        let now = self.now;
        let m = &mut self.members[k];
        m.proc = Some(Proc {
            core: MemberCore::new(hello, true, t(now)),
            id,
            life,
            table: BTreeMap::new(),
            forward: Vec::new(),
            next_expire: now + 500,
            next_discovery: now + LIST_LAG_MS + 50,
        });
        m.listed_from = Some(now + LIST_LAG_MS);
        m.listed_until = None;
        if m.isolated_until <= now {
            m.healthy_since = Some(now);
            m.down_since = None;
        }
        self.disturb(now);
        self.say(|| format!("member {k} starts as {id:#010x}"));
    }

    /// Member `k`'s process dies (`silent`: its host, so the registrars notice late).
    fn crash(&mut self, k: usize, silent: bool) {
        let now = self.now;
        let m = &mut self.members[k];
        let Some(p) = m.proc.take() else { return };
        m.listed_until = Some(now + if silent { SILENT_LAG_MS } else { KILL_LAG_MS });
        m.healthy_since = None;
        m.down_since.get_or_insert(now);
        self.links.retain(|(from, _, _), _| *from != k);
        self.disturb(now);
        self.say(|| {
            format!(
                "member {k} ({:#010x}) dies{}",
                p.id,
                if silent { " silently" } else { "" }
            )
        });
    }

    fn listing(&self) -> BTreeMap<u32, SocketAddr> {
        let now = self.now;
        self.members
            .iter()
            .enumerate()
            .filter_map(|(k, m)| {
                let p = m.proc.as_ref()?;
                (m.listed_from.is_some_and(|f| f <= now)).then_some((p.id, tier_addr(k)))
            })
            .collect()
    }

    fn member_of(&self, id: u32) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.proc.as_ref().is_some_and(|p| p.id == id))
    }

    /// Carries out what member `k`'s core asks until it asks nothing more.
    fn drain(&mut self, k: usize) {
        loop {
            let now = self.now;
            let Some(p) = self.members[k].proc.as_mut() else {
                return;
            };
            let life = p.life;
            let mut did = false;
            let every: Vec<_> = if self.sabotage == Break::TouchAll {
                p.table
                    .values()
                    .flat_map(|e| e.splice.directions())
                    .collect()
            } else {
                Vec::new()
            };
            while let Some(mut tx) = p.core.poll_transmit() {
                did = true;
                if self.sabotage == Break::TouchAll && matches!(tx.message, Message::Touch(_)) {
                    tx.message = Message::Touch(every.clone());
                }
                self.counts.messages += 1;
                let d = 1 + self.rng.below(10);
                let lossy = self.loss.1 > now && self.rng.chance(self.loss.0);
                let d = if lossy {
                    d + 200 + self.rng.below(600)
                } else {
                    d
                };
                if let Some(l) = self.links.get_mut(&(k, life, tx.link)) {
                    let due = l.queue.back().map_or(0, |b| b.0).max(now + d);
                    l.queue.push_back((due, now, tx.message));
                }
            }
            let Some(p) = self.members[k].proc.as_mut() else {
                return;
            };
            let Some(a) = p.core.poll_action() else {
                if did {
                    continue;
                }
                return;
            };
            self.act(k, a);
        }
    }

    fn act(&mut self, k: usize, a: Action) {
        let now = self.now;
        let Some(p) = self.members[k].proc.as_mut() else {
            return;
        };
        let life = p.life;
        match a {
            Action::Connect { link, addr, .. } => {
                let Some(to) = (0..self.members.len()).find(|&j| tier_addr(j) == addr) else {
                    return;
                };
                let d = self.delay();
                self.links.insert(
                    (k, life, link),
                    Link {
                        to,
                        to_life: None,
                        opened: now,
                        connect_due: now + d,
                        queue: VecDeque::new(),
                    },
                );
            }
            Action::Disconnect { link, .. } => {
                self.links.remove(&(k, life, link));
            }
            Action::Install(s) => {
                if !p.table.contains_key(&s.key())
                    && let Some(&c) = self.by_key.get(&s.key())
                    && self.conns[c].ended.is_some()
                {
                    self.counts.revived += 1;
                }
                p.table.entry(s.key()).or_insert(Entry {
                    splice: s,
                    installed: now,
                    fin: [false; 2],
                    last: [now; 2],
                    packets: [0; 2],
                });
            }
            Action::Remove(s) => {
                if p.table.remove(&s.key()).is_some()
                    && let Some(&c) = self.by_key.get(&s.key())
                    && self.conns[c].ended.is_none()
                {
                    let id = p.id;
                    self.fail(format!(
                        "(a) member {k} ({id:#010x}) removed open connection {} on a DEL",
                        s.client
                    ));
                }
            }
            Action::MarkFin(from, to) => {
                for e in p.table.values_mut() {
                    for (d, dir) in e.splice.directions().into_iter().enumerate() {
                        if dir == (from, to) {
                            e.fin[d] = true;
                        }
                    }
                }
            }
            Action::Touch(flows) => {
                let flows: BTreeSet<_> = flows.into_iter().collect();
                for e in p.table.values_mut() {
                    for (d, dir) in e.splice.directions().into_iter().enumerate() {
                        if flows.contains(&dir) {
                            e.last[d] = e.last[d].max(now);
                        }
                    }
                }
            }
            Action::SetTier(f) => p.forward = f,
            Action::ReadTable => {
                let table: Vec<TableEntry> = p
                    .table
                    .values()
                    .map(|e| TableEntry {
                        splice: e.splice,
                        fin: e.fin,
                        packets: e.packets,
                    })
                    .collect();
                p.core.compare(table, t(now));
            }
            Action::Nudge { .. } => p.core.nudge_done(Some((0, 0))),
        }
    }

    /// One step of simulated time.
    fn step(&mut self) {
        self.now += STEP_MS;
        let now = self.now;
        // Cut-offs end.
        for k in 0..self.members.len() {
            let m = &mut self.members[k];
            if m.proc.is_some() && m.isolated_until <= now && m.down_since.is_some() {
                m.down_since = None;
                m.healthy_since = Some(now);
            }
        }
        self.links_step();
        self.datagrams_step();
        // Timers and discovery.
        let discovery_due = self.next_dist_discovery <= now
            || self
                .members
                .iter()
                .any(|m| m.proc.as_ref().is_some_and(|p| p.next_discovery <= now));
        let listing = if discovery_due {
            self.listing()
        } else {
            BTreeMap::new()
        };
        for k in 0..self.members.len() {
            let isolated = self.isolated(k);
            let Some(p) = self.members[k].proc.as_mut() else {
                continue;
            };
            if p.core.poll_timeout().is_some_and(|d| d <= t(now)) {
                p.core.tick(t(now));
            }
            if p.next_discovery <= now {
                p.next_discovery = now + DISCOVERY_MS;
                if !isolated {
                    p.core.set_listed(listing.clone(), t(now));
                }
            }
            self.expire(k);
            self.drain(k);
        }
        if self.next_dist_discovery <= now {
            self.next_dist_discovery = now + DISCOVERY_MS;
            self.dist.set_listed(&listing, t(now));
        }
        if self.dist.poll_timeout() <= t(now) {
            self.dist.tick(t(now));
        }
        self.dist_drain();
        self.traffic();
        if now % 50 == 0 {
            self.check();
        }
    }

    fn dist_drain(&mut self) {
        if let Some(g) = self.dist.poll_group() {
            self.dist.group_applied(&g);
            let old = std::mem::take(&mut self.group);
            self.group = g.members.iter().map(|&(id, _, _)| id).collect();
            if self.sabotage == Break::GroupNeverShrinks {
                self.group.extend(
                    old.into_iter()
                        .filter(|id| !g.members.iter().any(|m| m.0 == *id)),
                );
            }
            self.counts.group_changes += 1;
            let group = self.group.clone();
            self.say(|| format!("group = {group:08x?}"));
        }
        while let Some((to, bytes)) = self.dist.poll_transmit() {
            let Some(k) = (0..self.members.len()).find(|&j| tier_addr(j) == to) else {
                continue;
            };
            let d = self.delay();
            if !(self.loss.1 > self.now && self.rng.chance(self.loss.0)) {
                self.datagrams.push((self.now + d, None, Some(k), bytes));
            }
        }
    }

    fn datagrams_step(&mut self) {
        let now = self.now;
        if !self.datagrams.iter().any(|d| d.0 <= now) {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.datagrams)
            .into_iter()
            .partition(|d| d.0 <= now);
        self.datagrams = later;
        for (_, from, to, bytes) in due {
            match (from, to) {
                (None, Some(k)) => {
                    if self.isolated(k) {
                        continue;
                    }
                    let Some(p) = self.members[k].proc.as_mut() else {
                        continue;
                    };
                    let reply = p
                        .core
                        .handle_datagram(distributor_addr(), &bytes, 0.5, t(now));
                    self.drain(k);
                    if let Some(r) = reply {
                        let d = self.delay();
                        if !(self.loss.1 > now && self.rng.chance(self.loss.0)) {
                            self.datagrams.push((now + d, Some(k), None, r));
                        }
                    }
                }
                (Some(k), None) if !self.isolated(k) => {
                    self.dist.handle_datagram(tier_addr(k), &bytes, t(now));
                }
                _ => {}
            }
        }
    }

    fn links_step(&mut self) {
        let now = self.now;
        let keys: Vec<_> = self.links.keys().copied().collect();
        for key in keys {
            let (k, _, link) = key;
            let Some(l) = self.links.get(&key) else {
                continue;
            };
            let (to, to_life) = (l.to, l.to_life);
            match to_life {
                None => {
                    if now < l.connect_due {
                        continue;
                    }
                    let opened = l.opened;
                    if self.reachable(k, to) {
                        let Some(accepting) = self.members[to].proc.as_ref().map(|p| p.life) else {
                            // Refused.
                            self.link_down(key);
                            continue;
                        };
                        let table: Vec<Splice> = self.members[k]
                            .proc
                            .as_ref()
                            .map(|p| p.table.values().map(|e| e.splice).collect())
                            .unwrap_or_default();
                        let Some(p) = self.members[k].proc.as_mut() else {
                            continue;
                        };
                        let mut first = p.core.link_up(link, table, t(now));
                        if self.sabotage == Break::NoTableOnJoin {
                            first.truncate(1);
                        }
                        let d = self.delay();
                        if let Some(l) = self.links.get_mut(&key) {
                            l.to_life = Some(accepting);
                            for m in first.into_iter().rev() {
                                l.queue.push_front((now + d, now, m));
                            }
                        }
                    } else if now >= opened + CONNECT_TIMEOUT_MS {
                        self.link_down(key);
                    } else if let Some(l) = self.links.get_mut(&key) {
                        l.connect_due = now + 100;
                    }
                }
                Some(to_life) => {
                    while let Some(&(due, sent, _)) =
                        self.links.get(&key).and_then(|l| l.queue.front())
                    {
                        if due > now {
                            break;
                        }
                        if !self.reachable(k, to) {
                            if now > sent + LINK_TIMEOUT_MS {
                                self.say(|| format!("link {k} → {to} reset"));
                                self.link_down(key);
                            }
                            break;
                        }
                        if self.members[to].proc.as_ref().map(|p| p.life) != Some(to_life) {
                            // The other end's process is gone: a reset.
                            self.link_down(key);
                            break;
                        }
                        let Some(l) = self.links.get_mut(&key) else {
                            break;
                        };
                        let Some((_, _, m)) = l.queue.pop_front() else {
                            break;
                        };
                        if let Some(p) = self.members[to].proc.as_mut() {
                            p.core.handle_message(m, t(now));
                        }
                        self.drain(to);
                    }
                }
            }
        }
    }

    fn link_down(&mut self, key: (usize, u32, LinkId)) {
        self.links.remove(&key);
        let (k, life, link) = key;
        if let Some(p) = self.members[k].proc.as_mut()
            && p.life == life
        {
            p.core.link_down(link, false, t(self.now));
        }
    }

    /// The datapath's expiry pass at member `k`.
    fn expire(&mut self, k: usize) {
        let now = self.now;
        let Some(p) = self.members[k].proc.as_mut() else {
            return;
        };
        if p.next_expire > now {
            return;
        }
        p.next_expire = now + self.expiry.period().as_millis() as Ms;
        let expiry = self.expiry;
        let gone: Vec<_> = p
            .table
            .iter()
            .filter(|(_, e)| expiry.expired(e.fin, [t(e.last[0]), t(e.last[1])], t(now)))
            .map(|(key, _)| *key)
            .collect();
        let long_calm = now >= self.disturbed_at + SETTLE_MS + IDLE_MS;
        for key in gone {
            p.table.remove(&key);
            if let Some(&c) = self.by_key.get(&key)
                && self.conns[c].ended.is_none()
                && long_calm
            {
                let id = p.id;
                self.fail(format!(
                    "(a) member {k} ({id:#010x}) let open connection {} idle out in calm",
                    key.0
                ));
                return;
            }
        }
    }

    /// New connections, packets, ends.
    fn traffic(&mut self) {
        let now = self.now;
        // About two new connections a second, at a member the router reaches.
        if self.rng.chance(10) {
            let candidates: Vec<usize> = self
                .group
                .iter()
                .filter_map(|&id| self.member_of(id))
                .filter(|&k| !self.isolated(k))
                .collect();
            if let Some(k) = self.rng.pick(&candidates) {
                self.splice_made(k);
            }
        }
        let open = std::mem::take(&mut self.open);
        for &c in &open {
            if self.conns[c].ended.is_some() || self.conns[c].next_packet > now {
                continue;
            }
            let gap = 100 + self.rng.below(300);
            self.conns[c].next_packet = now + gap;
            let conn = &self.conns[c];
            let (dir, kind) = if now >= conn.end_at {
                if conn.rst {
                    (0, Kind::Rst)
                } else if !conn.fin_done[0] {
                    (0, Kind::Fin)
                } else {
                    (1, Kind::Fin)
                }
            } else {
                (conn.next_dir, Kind::Data)
            };
            self.conns[c].next_dir = 1 - dir;
            self.packet(c, dir, kind);
        }
        let (open, ended): (Vec<usize>, Vec<usize>) = open
            .into_iter()
            .partition(|&c| self.conns[c].ended.is_none());
        self.open.extend(open);
        self.ended.extend(ended);
    }

    fn splice_made(&mut self, k: usize) {
        let now = self.now;
        let n = self.next_port;
        self.next_port += 1;
        let (lo, _) = ports(k);
        let s = Splice {
            client: SocketAddrV4::new(
                Ipv4Addr::new(10, 88, 0, 2 + (n % 200) as u8),
                30_000 + (n / 200) as u16,
            ),
            front: SocketAddrV4::new(Ipv4Addr::new(10, 88, 9, 1), 80),
            back: SocketAddrV4::new(SHARED, lo + (n % 1000) as u16),
            server: SocketAddrV4::new(Ipv4Addr::new(10, 88, 2, 11 + (n % 2) as u8), 8080),
            client_seq_delta: self.rng.below(u64::from(u32::MAX)) as u32,
            server_seq_delta: self.rng.below(u64::from(u32::MAX)) as u32,
            client_wscale: 7,
            front_wscale: 7,
            server_wscale: 7,
            back_wscale: 7,
            timestamps: None,
        };
        let Some(p) = self.members[k].proc.as_mut() else {
            return;
        };
        // A port reused by a later connection: the earlier one has long ended.
        if let Some(&old) = self.by_key.get(&s.key())
            && self.conns[old].ended.is_none()
        {
            return;
        }
        p.table.insert(
            s.key(),
            Entry {
                splice: s,
                installed: now,
                fin: [false; 2],
                last: [now; 2],
                packets: [0; 2],
            },
        );
        p.core.splice_made(s);
        let owner_id = p.id;
        self.drain(k);
        let life = 2_000 + self.rng.below(14_000);
        let server_bucket = self.rng.pick(&self.group);
        let rst = self.rng.chance(200);
        self.by_key.insert(s.key(), self.conns.len());
        self.open.push(self.conns.len());
        self.conns.push(Conn {
            splice: s,
            owner: k,
            created: now,
            end_at: now + life,
            rst,
            fin_done: [false; 2],
            ended: None,
            bucket: [Some(owner_id), server_bucket],
            next_packet: now + 50,
            next_dir: 0,
        });
        self.counts.connections += 1;
    }

    /// A packet of connection `c` in direction `dir` through the router.
    fn packet(&mut self, c: usize, dir: usize, kind: Kind) {
        let now = self.now;
        let in_group = |w: &Self, id: Option<u32>| id.is_some_and(|id| w.group.contains(&id));
        if !in_group(self, self.conns[c].bucket[dir]) {
            self.conns[c].bucket[dir] = self.rng.pick(&self.group);
        }
        self.counts.packets += 1;
        let Some(k) = self.conns[c].bucket[dir].and_then(|id| self.member_of(id)) else {
            self.counts.lost_packets += 1;
            return;
        };
        if self.isolated(k) {
            self.counts.lost_packets += 1;
            return;
        }
        let key = self.conns[c].splice.key();
        let back_port = self.conns[c].splice.back.port();
        // The member that carries it: its own entry, or the member its port range names.
        let mut at = k;
        let holds = |w: &Self, j: usize| {
            w.members[j]
                .proc
                .as_ref()
                .is_some_and(|p| p.table.contains_key(&key))
        };
        if !holds(self, k) {
            let target = (dir == 1)
                .then(|| {
                    self.members[k].proc.as_ref().and_then(|p| {
                        p.forward
                            .iter()
                            .find(|f| f.shared == SHARED && f.ports.contains(&back_port))
                            .map(|f| f.id)
                    })
                })
                .flatten();
            match target {
                Some(id) => {
                    self.counts.forwarded += 1;
                    match self.member_of(id) {
                        Some(j) if !self.isolated(j) => at = j,
                        _ => {
                            self.counts.lost_packets += 1;
                            return;
                        }
                    }
                }
                None => {
                    self.broken(c, k, "no entry and no member to forward to");
                    return;
                }
            }
            if !holds(self, at) {
                self.broken(c, at, "forwarded to a member without the entry");
                return;
            }
        }
        let Some(p) = self.members[at].proc.as_mut() else {
            return;
        };
        let Some(e) = p.table.get_mut(&key) else {
            return;
        };
        e.packets[dir] += 1;
        e.last[dir] = now;
        match kind {
            Kind::Data => {}
            Kind::Fin => {
                e.fin[dir] = true;
                self.conns[c].fin_done[dir] = true;
                if self.conns[c].fin_done == [true, true] {
                    self.conns[c].ended = Some(now);
                }
            }
            Kind::Rst => {
                p.table.remove(&key);
                self.conns[c].ended = Some(now);
            }
        }
    }

    /// A member without the connection's entry answered its packet: the connection broke.
    fn broken(&mut self, c: usize, k: usize, why: &str) {
        let now = self.now;
        let key = self.conns[c].splice.key();
        self.conns[c].ended = Some(now);
        let held = (0..self.members.len()).any(|j| {
            self.members[j]
                .proc
                .as_ref()
                .is_some_and(|p| p.table.contains_key(&key))
        });
        if !held {
            self.counts.lost_connections += 1;
        } else if self.settled() && self.conns[c].created + REPLICATION_MS <= now {
            let owner = self.conns[c].owner;
            self.fail(format!(
                "(a) connection {} (made at member {owner}) broke at member {k}: {why}",
                key.0
            ));
        } else {
            self.counts.broken_unsettled += 1;
        }
    }

    /// The invariants.
    fn check(&mut self) {
        let now = self.now;
        // (a) In calm, every live member holds every open connection a live member holds.
        if self.settled() {
            for &c in &self.open {
                let conn = &self.conns[c];
                if conn.ended.is_some() || conn.created + REPLICATION_MS > now {
                    continue;
                }
                let key = conn.splice.key();
                let holds = |m: &Member| m.proc.as_ref().map(|p| p.table.contains_key(&key));
                let any = self.members.iter().any(|m| holds(m) == Some(true));
                if let Some(k) = self.members.iter().position(|m| holds(m) == Some(false))
                    && any
                {
                    let owner = conn.owner;
                    self.fail(format!(
                        "(a) member {k} holds no entry of open connection {} (made at member \
                         {owner}, {} ms ago) after {} ms of calm",
                        key.0,
                        now - conn.created,
                        now - self.disturbed_at
                    ));
                    return;
                }
            }
        }
        // (b) No entry outlives its connection by more than the bound. A connection no
        // member holds any more past the bound is not looked at again.
        let held = |w: &Self, c: usize| {
            let key = w.conns[c].splice.key();
            w.members
                .iter()
                .any(|m| m.proc.as_ref().is_some_and(|p| p.table.contains_key(&key)))
        };
        let ended = std::mem::take(&mut self.ended);
        self.ended = ended
            .into_iter()
            .filter(|&c| {
                self.conns[c]
                    .ended
                    .is_some_and(|e| now <= e + ENTRY_BOUND_MS)
                    || held(self, c)
            })
            .collect();
        for i in 0..self.ended.len() {
            let c = self.ended[i];
            let Some(ended) = self.conns[c].ended else {
                continue;
            };
            if now <= ended + ENTRY_BOUND_MS {
                continue;
            }
            let key = self.conns[c].splice.key();
            // Counted from the end, or from the entry's installation when a table sent
            // after the end revived it.
            if let Some(k) = (0..self.members.len()).find(|&k| {
                self.members[k].proc.as_ref().is_some_and(|p| {
                    p.table
                        .get(&key)
                        .is_some_and(|e| now > e.installed.max(ended) + ENTRY_BOUND_MS)
                })
            }) {
                self.fail(format!(
                    "(b) member {k} still holds connection {} {} ms after it ended",
                    key.0,
                    now - ended
                ));
                return;
            }
        }
        // (c) The group is the live members, within the bounds.
        let bound = self.dist.config().detection_bound().as_millis() as Ms + 2 * STEP_MS;
        // With no member alive the group stays as it was: dead members leave it once one
        // has been alive long enough to join.
        let any_up = self.members.iter().any(|m| {
            m.healthy_since
                .is_some_and(|s| now >= s.max(self.loss.1) + JOIN_BOUND_MS)
        });
        for k in 0..self.members.len() {
            let m = &self.members[k];
            let id = m.proc.as_ref().map(|p| p.id);
            let in_group = id.is_some_and(|id| self.group.contains(&id));
            if let Some(since) = m.healthy_since
                && now >= since.max(self.loss.1) + JOIN_BOUND_MS
                && !in_group
            {
                self.fail(format!(
                    "(c) member {k} alive and reachable for {} ms is not in the group",
                    now - since
                ));
                return;
            }
            if let Some(since) = m.down_since
                && any_up
                && now >= since + bound
                && in_group
            {
                self.fail(format!(
                    "(c) member {k}, dead or cut off for {} ms, is still in the group",
                    now - since
                ));
                return;
            }
        }
    }

    /// Whether a check failed.
    fn verdict(&self) -> Result<(), String> {
        self.violation.clone().map_or(Ok(()), Err)
    }

    fn run_for(&mut self, ms: Ms) -> Result<(), String> {
        let end = self.now + ms;
        while self.now < end {
            self.step();
            self.verdict()?;
        }
        Ok(())
    }

    /// One fault, chosen at random.
    fn fault(&mut self) {
        let n = self.members.len();
        let now = self.now;
        let live: Vec<usize> = (0..n).filter(|&k| self.alive(k)).collect();
        let dead: Vec<usize> = (0..n).filter(|&k| !self.alive(k)).collect();
        let span = 1_000 + self.rng.below(3_000);
        match self.rng.below(6) {
            0 | 1 if live.len() > 1 => {
                if let Some(k) = self.rng.pick(&live) {
                    let silent = self.rng.chance(500);
                    self.count(if silent { "silent death" } else { "kill" });
                    self.crash(k, silent);
                }
            }
            2 => {
                if let Some(k) = self.rng.pick(&dead) {
                    self.count("restart");
                    self.start(k);
                }
            }
            3 => {
                let a = self.rng.below(n as u64) as usize;
                let b = (a + 1 + self.rng.below(n as u64 - 1) as usize) % n;
                self.count("members cut");
                self.say(|| format!("members {a} and {b} cut for {span} ms"));
                self.cuts.insert((a.min(b), a.max(b)), now + span);
                self.disturb(now + span);
            }
            4 if live.len() > 1 => {
                let k = self.rng.below(n as u64) as usize;
                self.count("member isolated");
                self.say(|| format!("member {k} isolated for {span} ms"));
                let m = &mut self.members[k];
                m.isolated_until = now + span;
                m.healthy_since = None;
                m.down_since.get_or_insert(now);
                self.disturb(now + span);
            }
            _ => {
                self.count("datagram loss");
                self.say(|| format!("10 % of datagrams and segments lost for {span} ms"));
                self.loss = (100, now + span);
                self.disturb(now + span);
            }
        }
    }

    /// Every member runs again and nothing is cut.
    fn heal(&mut self) {
        for k in 0..self.members.len() {
            if !self.alive(k) {
                self.start(k);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Data,
    Fin,
    Rst,
}

/// What a run gave.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub counts: Counts,
}

/// The command that replays `seed` with its log.
pub fn replay_command(seed: u64) -> String {
    format!("cargo run --release -p rserpool-sim -- --tier --seed {seed}")
}

/// Runs one seed (`log`: narrate it on stderr).
pub fn run_seed(seed: u64, log: bool) -> Result<Outcome, String> {
    run_seed_with(seed, Break::None, log)
}

/// Runs one seed with a sabotaged core (to see that the checks fail).
pub fn run_seed_with(seed: u64, sabotage: Break, log: bool) -> Result<Outcome, String> {
    let members = 3 + (seed % 2) as usize;
    let mut w = TierWorld::new(seed, members, sabotage, log);
    w.run_for(WARM_UP_MS)?;
    for _ in 0..ROUNDS {
        let end = w.now + FAULTS_MS;
        while w.now < end {
            w.run_for(100)?;
            if w.rng.chance(60) {
                w.fault();
            }
        }
        w.say(|| "calm".into());
        w.heal();
        w.run_for(CALM_MS)?;
    }
    // No new connections: every entry must go.
    w.say(|| "last connections end".into());
    let now = w.now;
    for c in &mut w.conns {
        c.end_at = c.end_at.min(now);
    }
    w.run_for(FINAL_MS)?;
    let open = w.conns.iter().filter(|c| c.ended.is_none()).count();
    let held: usize = w
        .members
        .iter()
        .filter_map(|m| m.proc.as_ref())
        .map(|p| p.table.len())
        .sum();
    if held > 0 && open == 0 {
        return Err(format!(
            "(b) {held} entries left {FINAL_MS} ms after the last connection ended"
        ));
    }
    Ok(Outcome { counts: w.counts })
}

/// What many seeds gave.
#[derive(Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    pub failures: Vec<(u64, String)>,
    pub counts: Counts,
    pub elapsed: Duration,
}

impl Summary {
    pub fn report(&self, threads: usize) -> String {
        let mut out = String::new();
        for (seed, why) in &self.failures {
            out.push_str(&format!(
                "tier seed {seed} failed: {why}\n  replay: {}\n",
                replay_command(*seed)
            ));
        }
        let secs = self.elapsed.as_secs_f64();
        out.push_str(&format!(
            "{} tier seeds in {secs:.1} s ({:.0} seeds/s, {threads} thread(s)): {} failed\n",
            self.seeds,
            self.seeds as f64 / secs.max(1e-9),
            self.failures.len()
        ));
        let c = &self.counts;
        let faults: Vec<String> = c.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
        out.push_str(&format!(
            "injected: {}\nconnections {}, packets {} ({} forwarded by port, {} lost to dead or \
             cut-off members), group changes {}, messages {}; connections broken outside calm \
             {}, lost with every member that held them {}; entries revived after their end {}\n",
            faults.join(", "),
            c.connections,
            c.packets,
            c.forwarded,
            c.lost_packets,
            c.group_changes,
            c.messages,
            c.broken_unsettled,
            c.lost_connections,
            c.revived
        ));
        out
    }
}

/// Runs seeds `from..from + count` on `threads` threads.
pub fn run_seeds(from: u64, count: u64, threads: usize, sabotage: Break) -> Summary {
    let started = std::time::Instant::now();
    let threads = threads.max(1) as u64;
    let parts: Vec<Summary> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                s.spawn(move || {
                    let mut part = Summary::default();
                    for seed in (from..from + count).filter(|seed| seed % threads == th) {
                        part.seeds += 1;
                        match run_seed_with(seed, sabotage, false) {
                            Ok(o) => part.counts.add(&o.counts),
                            Err(e) => part.failures.push((seed, e)),
                        }
                    }
                    part
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Summary {
                    failures: vec![(u64::MAX, "a simulation thread panicked".into())],
                    ..Summary::default()
                })
            })
            .collect()
    });
    let mut all = Summary::default();
    for p in parts {
        all.seeds += p.seeds;
        all.failures.extend(p.failures);
        all.counts.add(&p.counts);
    }
    all.failures.sort();
    all.elapsed = started.elapsed();
    all
}
