//! The model of the tier: member processes (a core and a [`Datapath`] each), the links
//! between them, the distributor's datagrams, the distributor core and the router's group,
//! and the spliced connections whose packets cross it. [`TierWorld::step`] moves it on by one
//! step of simulated time.
//!
//! The model does not judge. What the invariants are about and only a packet or an action
//! shows as it happens (a packet that met a member without the entry, an open connection's
//! entry removed by a DEL or expired, a connection that ended) it records as a [`Fact`];
//! the checks (`check.rs`) read the facts and the model's state after each step. So the model
//! never calls the checks, and the checks never move the model.

use super::datapath::{Datapath, Key, Kind};
use crate::net::Ms;
use crate::rng::Rng;
use rserpool_tier::distributor::{DistributorConfig, DistributorCore};
use rserpool_tier::member::{Action, LinkId};
use rserpool_tier::{Hello, Instant, MemberCore, Message, Splice};
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

/// The simulation's step.
pub const STEP_MS: Ms = 5;
pub const HEARTBEAT_MS: Ms = 100;
const ANSWER_MS: Ms = 20;
const MISSES: u32 = 3;
/// How often members and the distributor resolve the tier pool.
pub const DISCOVERY_MS: Ms = 1_000;
/// From a process's start to its being listed in the pool; from a death to its leaving the
/// pool (a killed process's registrar connection closes), or for a host that died silently
/// (the registrar's keep-alive).
pub const LIST_LAG_MS: Ms = 200;
const KILL_LAG_MS: Ms = 100;
const SILENT_LAG_MS: Ms = 3_000;
/// A link's unacknowledged data older than this resets it; a connection attempt gives up
/// after `CONNECT_TIMEOUT_MS` (the driver's).
const LINK_TIMEOUT_MS: Ms = 1_500;
pub const CONNECT_TIMEOUT_MS: Ms = 2_000;

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

/// A live member process: its core and its datapath.
pub(super) struct Proc {
    core: MemberCore,
    pub(super) id: u32,
    life: u32,
    pub(super) dp: Datapath,
    next_discovery: Ms,
}

pub(super) struct Member {
    pub(super) proc: Option<Proc>,
    life: u32,
    /// Listed in the tier pool from/until (the registrars' view lags).
    listed_from: Option<Ms>,
    listed_until: Option<Ms>,
    /// Cut from everyone (members, router, distributor) until then.
    isolated_until: Ms,
    /// Alive and reachable by the distributor since (for (c)), or dead/cut off since.
    pub(super) healthy_since: Option<Ms>,
    pub(super) down_since: Option<Ms>,
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

pub(super) struct Conn {
    pub(super) splice: Splice,
    pub(super) owner: usize,
    pub(super) created: Ms,
    end_at: Ms,
    rst: bool,
    fin_done: [bool; 2],
    pub(super) ended: Option<Ms>,
    /// The member ID each direction's packets go to (the router's bucket).
    bucket: [Option<u32>; 2],
    next_packet: Ms,
    next_dir: usize,
}

/// A datagram in flight: when due, from, to (a member, or `None`: the distributor), bytes.
type Datagram = (Ms, Option<usize>, Option<usize>, Vec<u8>);

/// What the model saw happen that the checks judge.
pub(super) enum Fact {
    /// A packet of connection `conn` met member `at`, which neither held its entry nor
    /// forwarded it to a member that did: the connection broke. `held`: some member still
    /// held it then.
    Broken {
        conn: usize,
        at: usize,
        why: &'static str,
        held: bool,
    },
    /// Member `at` (`id`) removed an open connection's entry on a DEL.
    RemovedOpen {
        at: usize,
        id: u32,
        client: SocketAddrV4,
    },
    /// Member `at`'s datapath expired an open connection's entry.
    ExpiredOpen {
        at: usize,
        id: u32,
        client: SocketAddrV4,
    },
    /// Connection `conn` ended (FINs both ways, an RST, or it broke).
    Ended(usize),
}

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

pub(super) struct TierWorld {
    pub(super) now: Ms,
    pub(super) rng: Rng,
    pub(super) members: Vec<Member>,
    links: BTreeMap<(usize, u32, LinkId), Link>,
    /// Datagrams in flight: due, from, to, bytes (`None`: the distributor).
    datagrams: Vec<Datagram>,
    pub(super) dist: DistributorCore,
    next_dist_discovery: Ms,
    /// The group the router uses (member IDs).
    pub(super) group: Vec<u32>,
    pub(super) conns: Vec<Conn>,
    /// Connections open.
    pub(super) open: Vec<usize>,
    by_key: BTreeMap<Key, usize>,
    /// Pairs of members cut from each other until then.
    cuts: BTreeMap<(usize, usize), Ms>,
    /// Datagram loss (per mille) until then.
    pub(super) loss: (u64, Ms),
    /// When the last fault ends (or ended).
    pub(super) disturbed_at: Ms,
    next_port: u32,
    sabotage: Break,
    pub(super) counts: Counts,
    /// What happened since the checks last looked.
    pub(super) facts: Vec<Fact>,
    log: bool,
}

impl TierWorld {
    pub(super) fn new(seed: u64, members: usize, sabotage: Break, log: bool) -> Self {
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
            by_key: BTreeMap::new(),
            cuts: BTreeMap::new(),
            loss: (0, 0),
            disturbed_at: 0,
            next_port: 0,
            sabotage,
            counts: Counts::default(),
            facts: Vec::new(),
            log,
        };
        for k in 0..members {
            w.start(k);
        }
        w
    }

    /// Narrates on stderr when the run is logged.
    pub(super) fn say(&self, f: impl FnOnce() -> String) {
        if self.log {
            eprintln!("{:>6} ms  {}", self.now, f());
        }
    }

    pub(super) fn alive(&self, k: usize) -> bool {
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

    fn disturb(&mut self, until: Ms) {
        self.disturbed_at = self.disturbed_at.max(until);
    }

    /// Whether some live member's datapath holds an entry of `s`.
    pub(super) fn held(&self, s: &Splice) -> bool {
        self.members
            .iter()
            .any(|m| m.proc.as_ref().is_some_and(|p| p.dp.holds(s)))
    }

    /// Member `k` starts as a new process (a new pool element identifier).
    pub(super) fn start(&mut self, k: usize) {
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
            dp: Datapath::new(now),
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
    pub(super) fn crash(&mut self, k: usize, silent: bool) {
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

    /// Members `a` and `b` cannot reach each other for `span`.
    pub(super) fn cut(&mut self, a: usize, b: usize, span: Ms) {
        let until = self.now + span;
        self.cuts.insert((a.min(b), a.max(b)), until);
        self.disturb(until);
    }

    /// Member `k` reaches nobody (members, router, distributor) for `span`.
    pub(super) fn isolate(&mut self, k: usize, span: Ms) {
        let now = self.now;
        let m = &mut self.members[k];
        m.isolated_until = now + span;
        m.healthy_since = None;
        m.down_since.get_or_insert(now);
        self.disturb(now + span);
    }

    /// `per_mille` of datagrams and segments are lost (late, for segments) for `span`.
    pub(super) fn lose(&mut self, per_mille: u64, span: Ms) {
        self.loss = (per_mille, self.now + span);
        self.disturb(self.now + span);
    }

    /// Every connection ends from now on.
    pub(super) fn end_connections(&mut self) {
        let now = self.now;
        for c in &mut self.conns {
            c.end_at = c.end_at.min(now);
        }
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
                p.dp.directions()
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
                if p.dp.install(s, now)
                    && let Some(&c) = self.by_key.get(&s.key())
                    && self.conns[c].ended.is_some()
                {
                    self.counts.revived += 1;
                }
            }
            Action::Remove(s) => {
                if p.dp.remove(&s)
                    && let Some(&c) = self.by_key.get(&s.key())
                    && self.conns[c].ended.is_none()
                {
                    self.facts.push(Fact::RemovedOpen {
                        at: k,
                        id: p.id,
                        client: s.client,
                    });
                }
            }
            Action::MarkFin(from, to) => p.dp.mark_fin(from, to),
            Action::Touch(flows) => p.dp.touch(flows, now),
            Action::SetTier(f) => p.dp.set_tier(f),
            Action::ReadTable => {
                let table = p.dp.read();
                p.core.compare(table, t(now));
            }
            Action::Nudge { .. } => p.core.nudge_done(Some((0, 0))),
        }
    }

    /// One step of simulated time.
    pub(super) fn step(&mut self) {
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
                        let Some(p) = self.members[k].proc.as_mut() else {
                            continue;
                        };
                        let table = p.dp.splices();
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
                        let from = self.members[k].proc.as_ref().map(|p| p.core.me().id);
                        if let Some(p) = self.members[to].proc.as_mut() {
                            p.core.handle_message_from(from, m, t(now));
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

    /// The datapath's expiry pass at member `k`, when it is due.
    fn expire(&mut self, k: usize) {
        let now = self.now;
        let Some(p) = self.members[k].proc.as_mut() else {
            return;
        };
        for key in p.dp.expire(now) {
            if let Some(&c) = self.by_key.get(&key)
                && self.conns[c].ended.is_none()
            {
                self.facts.push(Fact::ExpiredOpen {
                    at: k,
                    id: p.id,
                    client: key.0,
                });
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
        self.facts.extend(ended.into_iter().map(Fact::Ended));
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
        p.dp.splice(s, now);
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
        let s = self.conns[c].splice;
        // The member that carries it: its own entry for the direction, or the member its
        // port range names.
        let mut at = k;
        let holds = |w: &Self, j: usize| {
            w.members[j]
                .proc
                .as_ref()
                .is_some_and(|p| p.dp.carries(&s, dir))
        };
        if !holds(self, k) {
            let target = (dir == 1)
                .then(|| {
                    self.members[k]
                        .proc
                        .as_ref()
                        .and_then(|p| p.dp.forward_to(SHARED, s.back.port()))
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
        if !p.dp.carry(&s, dir, kind, now) {
            return;
        }
        match kind {
            Kind::Data => {}
            Kind::Fin => {
                self.conns[c].fin_done[dir] = true;
                if self.conns[c].fin_done == [true, true] {
                    self.conns[c].ended = Some(now);
                }
            }
            Kind::Rst => self.conns[c].ended = Some(now),
        }
    }

    /// A member without the connection's entry answered its packet: the connection broke.
    fn broken(&mut self, c: usize, k: usize, why: &'static str) {
        self.conns[c].ended = Some(self.now);
        let held = self.held(&self.conns[c].splice);
        self.facts.push(Fact::Broken {
            conn: c,
            at: k,
            why,
            held,
        });
    }
}
