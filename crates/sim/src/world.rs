//! The processes of the simulation and the loop that runs them: registrar, pool element and
//! pool user cores, each fed the events of the simulated network and clock ([`crate::net`]),
//! each action carried out there. Processes crash (their connections reset, their state is
//! lost) and start again as new processes (a registrar with a new ID, a PE with a new PE
//! identifier).

use crate::net::{Conn, End, Ev, Local, Ms, Net, Node, SYN_TIMEOUT, Seg, Service, TCP_TIMEOUT};
use crate::rng::Rng;
use rserpool_asap::{
    Action as AsapAction, Answer, Instant, PeCore, PeEvent, PoolElementConfig, PoolUserConfig,
    PuCore, PuEvent, QueryId,
};
use rserpool_registrar::{Action, Config, Registrar};
use rserpool_wire::{Policy, PoolHandle};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// The registrars' keep-alive interval and timeout.
pub const KEEP_ALIVE_MS: u64 = 2_000;
/// How fast registrars notice a silent peer and take over its PEs.
pub const PEER_HEARTBEAT_MS: u64 = 500;
pub const MAX_TIME_LAST_HEARD_MS: u64 = 1_200;
pub const MAX_TIME_NO_RESPONSE_MS: u64 = 1_000;
pub const TAKEOVER_EXPIRY_MS: u64 = 1_500;
/// The PEs' reregistration interval (their registration life is three times it).
pub const REREGISTRATION_MS: u64 = 5_000;

/// The pools: PEs alternate between them.
pub const POOLS: [&str; 2] = ["even", "odd"];

pub fn reg_host(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, i as u8 + 1))
}

pub fn asap_addr(i: usize) -> SocketAddr {
    SocketAddr::new(reg_host(i), rserpool_wire::ASAP_PORT)
}

pub fn enrp_addr(i: usize) -> SocketAddr {
    SocketAddr::new(reg_host(i), rserpool_wire::ENRP_PORT)
}

fn pe_host(k: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 1, (k >> 8) as u8, k as u8))
}

fn pu_host(u: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 2, 0, u as u8))
}

pub fn takeover_addr(k: usize) -> SocketAddr {
    SocketAddr::new(pe_host(k), 7000)
}

pub fn pool_of(k: usize) -> PoolHandle {
    PoolHandle::from(POOLS[k % 2])
}

pub fn registrar_config(n: usize) -> Config {
    Config {
        peer: (0..n).map(enrp_addr).map(Into::into).collect(),
        peer_heartbeat_ms: PEER_HEARTBEAT_MS,
        max_time_last_heard_ms: MAX_TIME_LAST_HEARD_MS,
        max_time_no_response_ms: MAX_TIME_NO_RESPONSE_MS,
        mentor_discovery_ms: 1_000,
        takeover_expiry_ms: TAKEOVER_EXPIRY_MS,
        keep_alive_interval_ms: KEEP_ALIVE_MS,
        keep_alive_timeout_ms: KEEP_ALIVE_MS,
        max_elements_per_ht_request: 7,
        ..Config::default()
    }
}

pub struct RegNode {
    pub core: Option<Registrar>,
    /// Processes started so far.
    pub life: u32,
}

pub struct PeNode {
    pub core: Option<PeCore>,
    pub life: u32,
    /// The registrars it is configured with.
    pub registrars: Vec<usize>,
    /// It listens for SERVER_ANNOUNCE.
    pub announces: bool,
    /// Identifiers of its earlier processes, and when each died.
    pub dead: Vec<(u32, Ms)>,
    /// Takeovers adopted.
    pub takeovers: u64,
}

/// Why a pool user asked.
#[derive(Debug, Clone)]
pub enum Purpose {
    Resolve(PoolHandle),
    Report,
}

pub struct PuNode {
    pub core: PuCore,
    pub announces: bool,
    pub outstanding: BTreeMap<QueryId, Purpose>,
    /// Answers to resolutions: when, the pool, the PE identifiers or the error.
    pub answers: Vec<(Ms, PoolHandle, Result<Vec<u32>, String>)>,
}

/// What happened, for the report.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub faults: BTreeMap<&'static str, u64>,
    pub takeovers_adopted: u64,
    pub unreachable_reports: u64,
    pub resolutions: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
        self.takeovers_adopted += o.takeovers_adopted;
        self.unreachable_reports += o.unreachable_reports;
        self.resolutions += o.resolutions;
    }
}

pub struct World {
    pub net: Net,
    pub rng: Rng,
    pub regs: Vec<RegNode>,
    pub pes: Vec<PeNode>,
    pub pus: Vec<PuNode>,
    /// Each live process's connections: its name → connection and which end it is.
    locals: BTreeMap<(Node, Local), (u64, usize)>,
    /// The wake-up scheduled for each process.
    wake: BTreeMap<Node, Ms>,
    ports: u16,
    pub counts: Counts,
    pub log: bool,
}

impl World {
    /// `regs` registrars, `pes` pool elements and `pus` pool users, all started.
    pub fn new(seed: u64, regs: usize, pes: usize, pus: usize, log: bool) -> Self {
        let mut w = Self {
            net: Net::new(),
            rng: Rng::new(seed),
            regs: (0..regs)
                .map(|_| RegNode {
                    core: None,
                    life: 0,
                })
                .collect(),
            pes: (0..pes)
                .map(|k| PeNode {
                    core: None,
                    life: 0,
                    // A third know only the first registrar (its death leaves them to find
                    // another), a third know them all, a third only hear their announces.
                    registrars: match k % 3 {
                        0 => vec![0],
                        1 => (0..regs).collect(),
                        _ => Vec::new(),
                    },
                    announces: k % 3 == 2,
                    dead: Vec::new(),
                    takeovers: 0,
                })
                .collect(),
            pus: (0..pus)
                .map(|u| {
                    let cfg = PoolUserConfig {
                        registrars: if u % 3 == 1 {
                            Vec::new()
                        } else {
                            (0..regs).map(asap_addr).collect()
                        },
                        stale_cache: if u % 3 == 2 {
                            Duration::from_secs(1)
                        } else {
                            Duration::ZERO
                        },
                        connect_timeout: Duration::from_secs(1),
                        request_timeout: Duration::from_millis(1_500),
                        ..PoolUserConfig::default()
                    };
                    PuNode {
                        core: PuCore::new(cfg),
                        announces: u % 3 == 1,
                        outstanding: BTreeMap::new(),
                        answers: Vec::new(),
                    }
                })
                .collect(),
            locals: BTreeMap::new(),
            wake: BTreeMap::new(),
            ports: 20_000,
            counts: Counts::default(),
            log,
        };
        for i in 0..regs {
            w.start_registrar(i);
        }
        for k in 0..pes {
            w.start_pe(k);
        }
        w
    }

    pub fn now(&self) -> Ms {
        self.net.now
    }

    fn at(&self) -> Instant {
        Instant::from_millis(self.net.now)
    }

    pub fn say(&self, what: impl FnOnce() -> String) {
        if self.log {
            eprintln!("[{:>7} ms] {}", self.net.now, what());
        }
    }

    pub fn count(&mut self, fault: &'static str) {
        *self.counts.faults.entry(fault).or_default() += 1;
    }

    /// Runs everything scheduled up to `t`.
    pub fn run_until(&mut self, t: Ms) {
        while let Some(ev) = self.net.pop(t) {
            self.handle(ev);
        }
        self.net.now = self.net.now.max(t);
    }

    /// The live process on `n`, as its incarnation.
    fn life(&self, n: Node) -> Option<u32> {
        match n {
            Node::Reg(i) => self.regs[i].core.as_ref().map(|_| self.regs[i].life),
            Node::Pe(k) => self.pes[k].core.as_ref().map(|_| self.pes[k].life),
            Node::Pu(_) => Some(0),
        }
    }

    /// The identifiers of the live PEs.
    pub fn live_pes(&self) -> BTreeSet<u32> {
        self.pes
            .iter()
            .filter_map(|p| p.core.as_ref().map(PeCore::id))
            .collect()
    }

    pub fn live_registrars(&self) -> Vec<usize> {
        (0..self.regs.len())
            .filter(|&i| self.regs[i].core.is_some())
            .collect()
    }

    fn ephemeral(&mut self, host: IpAddr) -> SocketAddr {
        self.ports = self.ports.checked_add(1).unwrap_or(20_000);
        SocketAddr::new(host, self.ports)
    }

    // Processes starting and dying.

    pub fn start_registrar(&mut self, i: usize) {
        let node = &mut self.regs[i];
        node.life += 1;
        let id = 0x1000_0000 + (i as u32) * 0x100 + node.life;
        let now = Instant::from_millis(self.net.now);
        let mut r = Registrar::new(registrar_config(self.regs.len()), id, now);
        r.enable_enrp(enrp_addr(i), now);
        r.enable_announce(asap_addr(i), now);
        self.regs[i].core = Some(r);
        self.say(|| format!("registrar {i} starts as {id:#x}"));
        self.flush(Node::Reg(i));
    }

    pub fn start_pe(&mut self, k: usize) {
        let node = &mut self.pes[k];
        node.life += 1;
        let policy = if k.is_multiple_of(2) {
            Policy::RoundRobin
        } else {
            Policy::LeastUsed { load: 0 }
        };
        let mut cfg = PoolElementConfig::new(pool_of(k), SocketAddr::new(pe_host(k), 80), policy);
        cfg.registrars = node.registrars.iter().map(|&i| asap_addr(i)).collect();
        cfg.reregistration_interval = Duration::from_millis(REREGISTRATION_MS);
        cfg.connect_timeout = Duration::from_secs(1);
        cfg.response_timeout = Duration::from_millis(1_500);
        cfg.backoff_min = Duration::from_millis(100);
        cfg.backoff_max = Duration::from_secs(2);
        let core = PeCore::new(cfg, Some(takeover_addr(k)), self.rng.fork(), self.at());
        let id = core.id();
        self.pes[k].core = Some(core);
        self.say(|| format!("PE {k} starts as {id:#x}"));
        self.flush(Node::Pe(k));
    }

    /// The process on `n` dies: its connections are reset, its state is lost.
    pub fn crash(&mut self, n: Node) {
        let ends: Vec<(Local, (u64, usize))> = self
            .locals
            .iter()
            .filter(|((m, _), _)| *m == n)
            .map(|((_, l), v)| (*l, *v))
            .collect();
        for (l, (id, dir)) in ends {
            self.locals.remove(&(n, l));
            if let Some(c) = self.net.conns.get_mut(&id) {
                c.ends[dir].open = false;
            }
            // The peer learns with a reset, when it can be reached.
            self.net.push(id, dir, Seg::Fin, &mut self.rng);
        }
        self.wake.remove(&n);
        match n {
            Node::Reg(i) => {
                self.regs[i].core = None;
                self.say(|| format!("registrar {i} crashes"));
            }
            Node::Pe(k) => {
                if let Some(c) = self.pes[k].core.take() {
                    let now = self.net.now;
                    self.pes[k].dead.push((c.id(), now));
                    self.say(|| format!("PE {k} ({:#x}) crashes", c.id()));
                }
            }
            Node::Pu(_) => {}
        }
    }

    /// Resets connection `id` at both ends at once.
    pub fn reset(&mut self, id: u64) {
        let Some(c) = self.net.conns.remove(&id) else {
            return;
        };
        for e in c.ends {
            if let (true, Some(l)) = (e.open, e.local) {
                self.locals.remove(&(e.node, l));
                self.closed(e.node, l);
            }
        }
    }

    // The event loop.

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Wake(n) => {
                if self.wake.get(&n) == Some(&self.net.now) {
                    self.wake.remove(&n);
                    self.timeout(n);
                    self.flush(n);
                }
            }
            Ev::Syn(id) => self.syn(id),
            Ev::SynAck(id, ok) => self.syn_ack(id, ok),
            Ev::Deliver(id, dir) => self.deliver(id, dir),
            Ev::Datagram {
                from,
                to,
                life,
                bytes,
            } => {
                if self.life(to) != Some(life) || !self.net.reachable(Node::Reg(from), to) {
                    return;
                }
                let now = self.at();
                match to {
                    Node::Pe(k) => {
                        if let Some(p) = self.pes[k].core.as_mut() {
                            p.handle_announce(&bytes, asap_addr(from), now);
                        }
                    }
                    Node::Pu(u) => self.pus[u]
                        .core
                        .handle_announce(&bytes, asap_addr(from), now),
                    Node::Reg(_) => {}
                }
                self.flush(to);
            }
        }
    }

    fn timeout(&mut self, n: Node) {
        let now = self.at();
        match n {
            Node::Reg(i) => {
                if let Some(r) = self.regs[i].core.as_mut()
                    && r.poll_timeout().is_some_and(|t| t <= now)
                {
                    r.handle_timeout(now);
                }
            }
            Node::Pe(k) => {
                if let Some(p) = self.pes[k].core.as_mut()
                    && p.poll_timeout().is_some_and(|t| t <= now)
                {
                    p.handle_timeout(now);
                }
            }
            Node::Pu(u) => {
                let p = &mut self.pus[u].core;
                if p.poll_timeout().is_some_and(|t| t <= now) {
                    p.handle_timeout(now);
                }
            }
        }
    }

    fn poll_timeout(&self, n: Node) -> Option<Instant> {
        match n {
            Node::Reg(i) => self.regs[i].core.as_ref()?.poll_timeout(),
            Node::Pe(k) => self.pes[k].core.as_ref()?.poll_timeout(),
            Node::Pu(u) => self.pus[u].core.poll_timeout(),
        }
    }

    /// Carries out the actions of the process on `n`, then schedules its next wake-up.
    pub fn flush(&mut self, n: Node) {
        match n {
            Node::Reg(i) => self.flush_registrar(i),
            Node::Pe(k) => {
                while let Some(a) = self.pes[k].core.as_mut().and_then(PeCore::poll_action) {
                    self.asap_action(n, a);
                }
            }
            Node::Pu(u) => {
                while let Some(a) = self.pus[u].core.poll_action() {
                    self.asap_action(n, a);
                }
            }
        }
        let Some(t) = self.poll_timeout(n) else {
            return;
        };
        // A core may ask early, never late; at least a millisecond on, so none spins.
        let t = t.as_millis().max(self.net.now + 1);
        if self.wake.get(&n).is_none_or(|&w| w > t) {
            self.wake.insert(n, t);
            self.net.schedule(t, Ev::Wake(n));
        }
    }

    fn flush_registrar(&mut self, i: usize) {
        let n = Node::Reg(i);
        loop {
            let Some(r) = self.regs[i].core.as_mut() else {
                return;
            };
            let Some(a) = r.poll_action() else {
                return;
            };
            match a {
                Action::Transmit(c) => self.registrar_output(i, c),
                Action::Connect(c, addr) => {
                    let service = self.service_at(addr);
                    let from = match service {
                        Some(Service::Enrp(_)) => enrp_addr(i),
                        _ => self.ephemeral(reg_host(i)),
                    };
                    self.open(n, Local::Reg(c), service, from);
                }
                Action::Close(c) => {
                    self.registrar_output(i, c);
                    self.close(n, Local::Reg(c));
                    let now = self.at();
                    if let Some(r) = self.regs[i].core.as_mut() {
                        r.handle_close(c, now);
                    }
                }
                Action::Abort(c) => {
                    // A reset: what this end still has in flight is dropped.
                    if let Some(&(id, dir)) = self.locals.get(&(n, Local::Reg(c)))
                        && let Some(conn) = self.net.conns.get_mut(&id)
                    {
                        conn.pipes[dir].retain(|s| !matches!(s.2, Seg::Data(_)));
                    }
                    self.close(n, Local::Reg(c));
                    let now = self.at();
                    if let Some(r) = self.regs[i].core.as_mut() {
                        r.handle_close(c, now);
                    }
                }
                Action::Announce(bytes) => self.announce(i, &bytes),
                Action::Presence(_) => {}
                // Not asked: the simulation does not enable delivery checks.
                Action::CheckDelivery(_) => {}
                // The simulated PEs have no service to connect to: a probe finds none, and
                // the reports stand, as before probes.
                Action::Probe(c, _) => {
                    let now = self.at();
                    if let Some(r) = self.regs[i].core.as_mut() {
                        r.handle_close(c, now);
                    }
                }
            }
        }
    }

    fn registrar_output(&mut self, i: usize, c: rserpool_registrar::ConnId) {
        let Some(r) = self.regs[i].core.as_mut() else {
            return;
        };
        let out = r.output(c).to_vec();
        if out.is_empty() {
            return;
        }
        r.consume_output(c, out.len());
        if let Some(&(id, dir)) = self.locals.get(&(Node::Reg(i), Local::Reg(c))) {
            self.net.push(id, dir, Seg::Data(out), &mut self.rng);
        }
    }

    fn asap_action<E: Into<AppEvent>>(&mut self, n: Node, a: AsapAction<E>) {
        match a {
            AsapAction::Connect(c, addr) => {
                let host = match n {
                    Node::Pe(k) => pe_host(k),
                    Node::Pu(u) => pu_host(u),
                    Node::Reg(i) => reg_host(i),
                };
                let from = self.ephemeral(host);
                let service = self.service_at(addr);
                self.open(n, Local::Asap(c), service, from);
            }
            AsapAction::Transmit(c, bytes) => {
                if let Some(&(id, dir)) = self.locals.get(&(n, Local::Asap(c))) {
                    self.net.push(id, dir, Seg::Data(bytes), &mut self.rng);
                }
            }
            AsapAction::Close(c) => self.close(n, Local::Asap(c)),
            AsapAction::Event(e) => match e.into() {
                AppEvent::Pe(e) => self.pe_event(n, e),
                AppEvent::Pu(e) => self.pu_event(n, e),
            },
        }
    }

    fn service_at(&self, addr: SocketAddr) -> Option<Service> {
        let regs = 0..self.regs.len();
        if let Some(i) = regs.clone().find(|&i| asap_addr(i) == addr) {
            return Some(Service::Asap(i));
        }
        if let Some(i) = regs.into_iter().find(|&i| enrp_addr(i) == addr) {
            return Some(Service::Enrp(i));
        }
        (0..self.pes.len())
            .find(|&k| takeover_addr(k) == addr)
            .map(Service::Takeover)
    }

    /// The process on `n` opens connection `local` to `service` (`None`: no such address).
    fn open(&mut self, n: Node, local: Local, service: Option<Service>, from: SocketAddr) {
        let Some(life) = self.life(n) else { return };
        let Some(service) = service else {
            self.refused(n, local, "no route to host");
            return;
        };
        let end = End {
            node: n,
            life,
            local: Some(local),
            open: true,
        };
        let id = self.net.open(end, service, from, &mut self.rng);
        self.locals.insert((n, local), (id, 0));
    }

    /// The process closes its end: the other end gets a FIN after what was sent before.
    fn close(&mut self, n: Node, local: Local) {
        if let Some((id, dir)) = self.locals.remove(&(n, local)) {
            if let Some(c) = self.net.conns.get_mut(&id) {
                c.ends[dir].open = false;
            }
            self.net.push(id, dir, Seg::Fin, &mut self.rng);
        }
    }

    /// Tells the process its connection closed.
    fn closed(&mut self, n: Node, local: Local) {
        let now = self.at();
        match (n, local) {
            (Node::Reg(i), Local::Reg(c)) => {
                if let Some(r) = self.regs[i].core.as_mut() {
                    r.handle_close(c, now);
                }
            }
            (Node::Pe(k), Local::Asap(c)) => {
                if let Some(p) = self.pes[k].core.as_mut() {
                    p.handle_close(c, now);
                }
            }
            (Node::Pu(u), Local::Asap(c)) => self.pus[u].core.handle_close(c, now),
            _ => {}
        }
        self.flush(n);
    }

    /// Tells the process its connection attempt failed.
    fn refused(&mut self, n: Node, local: Local, why: &str) {
        let now = self.at();
        match (n, local) {
            (Node::Pe(k), Local::Asap(c)) => {
                if let Some(p) = self.pes[k].core.as_mut() {
                    p.handle_connect_error(c, why, now);
                }
            }
            (Node::Pu(u), Local::Asap(c)) => self.pus[u].core.handle_connect_error(c, why, now),
            _ => {
                self.closed(n, local);
                return;
            }
        }
        self.flush(n);
    }

    fn syn(&mut self, id: u64) {
        let now = self.net.now;
        let Some(c) = self.net.conns.get(&id) else {
            return;
        };
        let (from, service, from_addr, opened) = (c.ends[0], c.service, c.from_addr, c.opened);
        if !from.open {
            self.net.conns.remove(&id);
            return;
        }
        let to = service.node();
        if !self.net.reachable(from.node, to) {
            if now < opened + SYN_TIMEOUT {
                self.net.schedule(now + 500, Ev::Syn(id));
            } else {
                self.net.schedule(now, Ev::SynAck(id, false));
            }
            return;
        }
        let at = self.at();
        let local = match service {
            Service::Asap(i) => self.regs[i]
                .core
                .as_mut()
                .and_then(|r| r.accept(from_addr, at))
                .map(Local::Reg),
            Service::Enrp(i) => self.regs[i]
                .core
                .as_mut()
                .and_then(|r| r.accept_enrp(from_addr, at))
                .map(Local::Reg),
            Service::Takeover(k) => self.pes[k]
                .core
                .as_mut()
                .map(|p| Local::Asap(p.accept(from_addr, at))),
        };
        let (d, _) = self.net.delay(&mut self.rng);
        match (local, self.life(to)) {
            (Some(l), Some(life)) => {
                if let Some(c) = self.net.conns.get_mut(&id) {
                    c.ends[1] = End {
                        node: to,
                        life,
                        local: Some(l),
                        open: true,
                    };
                }
                self.locals.insert((to, l), (id, 1));
                self.net.schedule(now + d, Ev::SynAck(id, true));
                self.flush(to);
            }
            _ => self.net.schedule(now + d, Ev::SynAck(id, false)),
        }
    }

    fn syn_ack(&mut self, id: u64, ok: bool) {
        let now = self.net.now;
        let Some(c) = self.net.conns.get_mut(&id) else {
            return;
        };
        let (from, opened) = (c.ends[0], c.opened);
        if !ok {
            self.net.conns.remove(&id);
            if let (true, Some(l)) = (from.open, from.local) {
                self.locals.remove(&(from.node, l));
                let why = if now >= opened + SYN_TIMEOUT {
                    "timed out"
                } else {
                    "connection refused"
                };
                self.refused(from.node, l, why);
            }
            return;
        }
        c.up = true;
        let waiting: Vec<usize> = (0..2).filter(|&d| !c.pipes[d].is_empty()).collect();
        for d in waiting {
            self.net.schedule(now, Ev::Deliver(id, d));
        }
        if let (true, Some(Local::Asap(l))) = (from.open, from.local) {
            let at = self.at();
            match from.node {
                Node::Pe(k) => {
                    if let Some(p) = self.pes[k].core.as_mut() {
                        p.handle_connected(l, at);
                    }
                }
                Node::Pu(u) => self.pus[u].core.handle_connected(l, at),
                Node::Reg(_) => {}
            }
            self.flush(from.node);
        }
    }

    fn deliver(&mut self, id: u64, dir: usize) {
        let now = self.net.now;
        let Some(c) = self.net.conns.get(&id) else {
            return;
        };
        let (from, to) = (c.ends[dir], c.ends[1 - dir]);
        let Some(&(_, sent, _)) = c.pipes[dir].front() else {
            return;
        };
        if !c.up {
            return;
        }
        if !self.net.reachable(from.node, to.node) {
            let data_waits = c.pipes[dir].iter().any(|s| matches!(s.2, Seg::Data(_)));
            if !(from.open && data_waits) {
                return;
            }
            if now < sent + TCP_TIMEOUT {
                self.net.schedule(sent + TCP_TIMEOUT, Ev::Deliver(id, dir));
                return;
            }
            // Retransmissions gave up: the sender's end is reset; the receiver learns of it
            // when the cut heals.
            self.say(|| format!("connection {id} times out at {:?}", from.node));
            if let Some(c) = self.net.conns.get_mut(&id) {
                c.pipes[dir].clear();
                c.ends[dir].open = false;
            }
            if let Some(l) = from.local {
                self.locals.remove(&(from.node, l));
                self.net.push(id, dir, Seg::Fin, &mut self.rng);
                self.closed(from.node, l);
            }
            return;
        }
        let mut due = Vec::new();
        let mut next = None;
        if let Some(c) = self.net.conns.get_mut(&id) {
            while c.pipes[dir].front().is_some_and(|s| s.0 <= now) {
                if let Some((_, _, seg)) = c.pipes[dir].pop_front() {
                    due.push(seg);
                }
            }
            next = c.pipes[dir].front().map(|s| s.0);
        }
        if let Some(t) = next {
            self.net.schedule(t, Ev::Deliver(id, dir));
        }
        if let Some(l) = to.local {
            for seg in due {
                if !self.is_open(id, 1 - dir) || self.life(to.node) != Some(to.life) {
                    break;
                }
                match seg {
                    Seg::Data(b) => self.data(to.node, l, &b),
                    Seg::Fin => {
                        if let Some(c) = self.net.conns.get_mut(&id) {
                            c.ends[1 - dir].open = false;
                        }
                        self.locals.remove(&(to.node, l));
                        self.closed(to.node, l);
                    }
                }
            }
            self.flush(to.node);
        }
        if self.net.conns.get(&id).is_some_and(finished) {
            self.net.conns.remove(&id);
        }
    }

    fn is_open(&self, id: u64, end: usize) -> bool {
        self.net.conns.get(&id).is_some_and(|c| c.ends[end].open)
    }

    fn data(&mut self, n: Node, local: Local, bytes: &[u8]) {
        let now = self.at();
        match (n, local) {
            (Node::Reg(i), Local::Reg(c)) => {
                if let Some(r) = self.regs[i].core.as_mut() {
                    r.handle_data(c, bytes, now);
                }
            }
            (Node::Pe(k), Local::Asap(c)) => {
                if let Some(p) = self.pes[k].core.as_mut() {
                    p.handle_data(c, bytes, now);
                }
            }
            (Node::Pu(u), Local::Asap(c)) => self.pus[u].core.handle_data(c, bytes, now),
            _ => {}
        }
    }

    fn announce(&mut self, i: usize, bytes: &[u8]) {
        let listeners: Vec<Node> = (0..self.pes.len())
            .filter(|&k| self.pes[k].announces)
            .map(Node::Pe)
            .chain(
                (0..self.pus.len())
                    .filter(|&u| self.pus[u].announces)
                    .map(Node::Pu),
            )
            .collect();
        for to in listeners {
            let Some(life) = self.life(to) else { continue };
            let (d, lost) = self.net.delay(&mut self.rng);
            if lost || !self.net.reachable(Node::Reg(i), to) {
                continue;
            }
            let ev = Ev::Datagram {
                from: i,
                to,
                life,
                bytes: bytes.to_vec(),
            };
            self.net.schedule(self.net.now + d, ev);
        }
    }

    fn pe_event(&mut self, n: Node, e: PeEvent) {
        let Node::Pe(k) = n else { return };
        match e {
            PeEvent::TakenOver { home, .. } => {
                self.pes[k].takeovers += 1;
                self.counts.takeovers_adopted += 1;
                self.say(|| format!("PE {k} taken over by {home:#x}"));
            }
            other => self.say(|| format!("PE {k}: {other:?}")),
        }
    }

    fn pu_event(&mut self, n: Node, e: PuEvent) {
        let Node::Pu(u) = n else { return };
        // The simulated pool users do not subscribe.
        let PuEvent::Answered(q, r) = e else { return };
        let Some(Purpose::Resolve(handle)) = self.pus[u].outstanding.remove(&q) else {
            return;
        };
        self.counts.resolutions += 1;
        let now = self.net.now;
        let r = match r {
            Ok(Answer::Resolution(res)) => {
                Ok(res.pool_elements.iter().map(|p| p.id).collect::<Vec<_>>())
            }
            Ok(Answer::Reported) => Err("reported".to_string()),
            Err(e) => Err(e.to_string()),
        };
        // As a pool user's connect does: a PE that cannot be reached (here: a dead one) is
        // reported.
        if let Ok(ids) = &r {
            let live = self.live_pes();
            for &id in ids.iter().filter(|id| !live.contains(id)) {
                let q = self.pus[u]
                    .core
                    .report_unreachable(&handle, id, Instant::from_millis(now));
                self.pus[u].outstanding.insert(q, Purpose::Report);
                self.counts.unreachable_reports += 1;
            }
        }
        self.pus[u].answers.push((now, handle, r));
    }

    /// Pool user `u` resolves `handle` (unless it is still waiting for an answer).
    pub fn resolve(&mut self, u: usize, handle: PoolHandle) {
        let waiting = self.pus[u]
            .outstanding
            .values()
            .any(|p| matches!(p, Purpose::Resolve(_)));
        if waiting {
            return;
        }
        let now = self.at();
        let q = self.pus[u].core.resolve(&handle, now);
        self.pus[u].outstanding.insert(q, Purpose::Resolve(handle));
        self.flush(Node::Pu(u));
    }

    /// The connections with both ends open, for faults to pick from.
    pub fn open_connections(&self) -> Vec<u64> {
        self.net
            .conns
            .iter()
            .filter(|(_, c)| c.up && c.ends.iter().all(|e| e.open))
            .map(|(&id, _)| id)
            .collect()
    }
}

/// A connection whose ends are both closed and whose segments are all delivered.
fn finished(c: &Conn) -> bool {
    c.ends.iter().all(|e| !e.open) && c.pipes.iter().all(|p| p.is_empty())
}

/// The events of either kind of ASAP core.
enum AppEvent {
    Pe(PeEvent),
    Pu(PuEvent),
}

impl From<PeEvent> for AppEvent {
    fn from(e: PeEvent) -> Self {
        AppEvent::Pe(e)
    }
}

impl From<PuEvent> for AppEvent {
    fn from(e: PuEvent) -> Self {
        AppEvent::Pu(e)
    }
}
