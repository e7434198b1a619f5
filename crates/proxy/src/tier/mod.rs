//! The proxy tier's driver (docs/TIER.md; the TCP splice seed, §2–5): several proxies carry
//! the spliced connections of each other, so that one of them can die without breaking any.
//! What a member decides — whom it links to, what it sends each, what its datapath does with
//! what arrives, where the datapath forwards — is the sans-IO core of `rserpool_tier`
//! ([`MemberCore`]); this module gives it sockets, tasks, a clock and the datapath.
//!
//! - **A pool.** Each proxy registers as a pool element of the tier's pool handle, its tier
//!   address as its transport and its free capacity (the workload factor) as its load, so
//!   the registrars know the tier and the distributor (`rserpool distributor`) finds it.
//! - **Links.** A pool user resolves the tier pool (and is pushed its changes); the core
//!   opens a TCP link to every other member and says what each carries.
//! - **Heartbeats** (UDP on the tier address) are answered with the workload factor; the
//!   distributor's word that a member died starts a nudge.
//!
//! A partition: both sides go on carrying what they have; splices made meanwhile reach the
//! other side when the link is back (a member that links sends everything it knows).
//!
//! An upgrade ([`handover`]): the member gives its tier sockets and its registration to the
//! process that replaces it, and retires once that one serves; it stays a member throughout.

mod handover;
mod leave;
pub mod split;
use crate::config::TierConfig;
use crate::ctx::until_set;
use crate::l4::kernel::KernelSplice;
use crate::listener::when_free;
use bytes::Bytes;
pub(crate) use handover::{Registration, TakenMember, TierState};
use leave::Leaving;
use rserpool_asap::{Association, PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_ksplice::Error as DatapathError;
use rserpool_ksplice::{Splice, SpliceState, TierMember};
use rserpool_tier::member::{Action, Counters, LinkId, TableEntry};
use rserpool_tier::{Hello, Instant, MemberCore, Message};
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{debug, info, warn};

/// The pool the servers of split splices register in: the tier's, with `.split`.
pub(crate) fn split_pool(tier: &str) -> rserpool_wire::PoolHandle {
    rserpool_wire::PoolHandle::from(format!("{tier}.split").as_str())
}

/// Messages queued towards one member; past that the link is dropped and, once it is back,
/// everything is sent again.
const QUEUE: usize = 65_536;

/// A splice as the members exchange it (no interfaces).
fn to_core(s: &Splice) -> rserpool_tier::Splice {
    rserpool_tier::Splice {
        client: s.client,
        front: s.front,
        back: s.back,
        server: s.server,
        client_seq_delta: s.client_seq_delta,
        server_seq_delta: s.server_seq_delta,
        client_wscale: s.client_wscale,
        front_wscale: s.front_wscale,
        server_wscale: s.server_wscale,
        back_wscale: s.back_wscale,
        timestamps: s.timestamps,
    }
}

/// A splice for this host's datapath: each member finds its own interfaces.
fn to_datapath(s: &rserpool_tier::Splice) -> Splice {
    Splice {
        client: s.client,
        front: s.front,
        back: s.back,
        server: s.server,
        client_seq_delta: s.client_seq_delta,
        server_seq_delta: s.server_seq_delta,
        client_if: 0,
        server_if: 0,
        client_wscale: s.client_wscale,
        front_wscale: s.front_wscale,
        server_wscale: s.server_wscale,
        back_wscale: s.back_wscale,
        timestamps: s.timestamps,
    }
}

fn to_entry(s: &SpliceState) -> TableEntry {
    TableEntry {
        splice: to_core(&s.splice),
        fin: s.fin,
        packets: s.packets,
    }
}

/// What a member does with the splices of the tier: a proxy carries them whole; a server of
/// a split splice carries the answers of its own connections (`split::ServerSide`).
pub(crate) trait Side: Send + Sync {
    /// Installs a splice another member made.
    fn install(&self, s: Splice) -> Result<(), String>;
    fn remove(&self, s: &Splice);
    fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4);
    fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]);
    /// The other members to forward to by port (a proxy's datapath).
    fn set_tier(&self, _members: &[TierMember]) -> Result<(), DatapathError> {
        Ok(())
    }
    fn forwarded(&self) -> u64 {
        0
    }
    /// What the once-a-second pass compares, per connection: the splice, and what passed
    /// here in each direction.
    fn state(&self) -> Vec<SpliceState>;
    /// Sends splices to a member that links here (a proxy: all it knows).
    fn shares(&self) -> bool {
        true
    }
    /// After another member died: the probes and ICMP errors that end the backoff of the
    /// TCP senders whose packets it lost (a proxy's datapath; blocks for a moment).
    fn nudge(&self, _prober: bool) -> Result<(usize, usize), String> {
        Ok((0, 0))
    }
}

impl crate::l4::kernel::TierShare for Tier {
    fn ports(&self) -> std::ops::RangeInclusive<u16> {
        self.me.lo..=self.me.hi
    }

    fn server_address(&self) -> Ipv4Addr {
        self.me.shared
    }

    /// Sends a splice just made here to every other member.
    fn spliced(&self, s: &Splice) {
        self.core().splice_made(to_core(s));
        self.drive();
    }
}

impl Side for KernelSplice {
    fn install(&self, s: Splice) -> Result<(), String> {
        self.install_replica(s)
    }
    fn remove(&self, s: &Splice) {
        self.remove_replica(s);
    }
    fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4) {
        KernelSplice::mark_fin(self, from, to);
    }
    fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]) {
        KernelSplice::touch(self, flows);
    }
    fn set_tier(&self, members: &[TierMember]) -> Result<(), DatapathError> {
        KernelSplice::set_tier(self, members)
    }
    fn forwarded(&self) -> u64 {
        self.tier_redirects()
    }
    fn state(&self) -> Vec<SpliceState> {
        self.splices()
    }
    fn nudge(&self, prober: bool) -> Result<(usize, usize), String> {
        KernelSplice::nudge(self, prober)
    }
}

/// A running tier membership.
pub(crate) struct Tier {
    cfg: TierConfig,
    me: Hello,
    side: Arc<dyn Side>,
    core: Mutex<MemberCore>,
    /// The outgoing links' queues, by the core's name for them.
    links: Mutex<HashMap<LinkId, mpsc::Sender<Bytes>>>,
    /// The core's clock starts here.
    epoch: std::time::Instant,
    /// The core's timer may have changed.
    timer: Arc<Notify>,
    this: Weak<Tier>,
    /// The free fraction of this proxy's capacity (the workload factor), 0..=1.
    free: Box<dyn Fn() -> f64 + Send + Sync>,
    /// The registration in the tier pool (replaced when a failed hand-over gives it back).
    pe: Mutex<Arc<PoolElement>>,
    registrars: RegistrarAccess,
    register_in: String,
    /// Second descriptors of the TCP listener and the UDP socket, for a successor; gone once
    /// the member has left the tier.
    sockets: Mutex<Option<[OwnedFd; 2]>>,
    /// Set once the member has left the tier: its listener and UDP socket close.
    closed: watch::Sender<bool>,
    /// The registration association given to a successor, until it serves.
    given: Mutex<Option<Association>>,
    /// Set once a successor serves: every task of the membership ends.
    retired: watch::Sender<bool>,
    /// Leaving the tier (the proxy stops), and when heartbeats came.
    leaving: Leaving,
}

/// The pool element a member registers as: its tier address as the transport, its load as
/// the policy's.
pub(crate) fn member_pe_config(
    cfg: &TierConfig,
    register_in: &str,
    registrars: &RegistrarAccess,
) -> PoolElementConfig {
    let mut pe_cfg = PoolElementConfig::new(
        register_in,
        cfg.listen,
        rserpool_wire::Policy::LeastUsed { load: 0 },
    );
    pe_cfg.set_registrars(&registrars.addrs);
    pe_cfg.tls = registrars.tls.clone();
    pe_cfg
}

/// Carries on over the registration taken from the process before, at once: the registrar's
/// keep-alives wait on it meanwhile. Returns the pool element, for [`let_go`] should this
/// process fail to start.
pub(crate) fn carry_on(
    taken: &mut TakenMember,
    cfg: &TierConfig,
    registrars: &RegistrarAccess,
) -> Option<Arc<PoolElement>> {
    let a = taken.registration.take()?;
    match PoolElement::from_hand_over(member_pe_config(cfg, &cfg.pool, registrars), a) {
        Ok(pe) => {
            let pe = Arc::new(pe);
            taken.pe = Some(pe.clone());
            Some(pe)
        }
        Err(e) => {
            warn!("proxy: tier: cannot carry on with the registration handed over: {e}");
            None
        }
    }
}

/// This process failed to start after [`carry_on`]: the registration is left to the process
/// that handed it over (which takes it back) instead of deregistered.
pub(crate) async fn let_go(pe: &PoolElement) {
    if pe.hand_over().await.is_some() {
        info!("proxy: tier: registration left to the process before");
    }
}

/// How a member reaches the registrars: their addresses, and TLS when they run it.
#[derive(Clone, Debug)]
pub(crate) struct RegistrarAccess {
    pub(crate) addrs: Vec<rserpool_wire::Address>,
    pub(crate) tls: Option<Arc<rserpool_tls::Tls>>,
}

impl Tier {
    /// Joins the tier: registers in its pool, listens for members and heartbeats, links to
    /// the members the pool names and starts the comparison passes.
    pub(crate) async fn start(
        cfg: TierConfig,
        registrars: RegistrarAccess,
        ks: Arc<KernelSplice>,
        interface: &str,
        free: Box<dyn Fn() -> f64 + Send + Sync>,
        taken: Option<TakenMember>,
    ) -> Result<Arc<Tier>, String> {
        let ports = cfg.port_range()?;
        let pool = cfg.pool.clone();
        if taken.is_none() {
            ks.distrust_adopted();
        }
        Self::start_as(
            cfg,
            pool,
            registrars,
            ks,
            interface,
            Some(ports),
            free,
            taken,
        )
        .await
    }

    /// A member of the tier `cfg.pool` registered in `register_in`: with `ports`, a proxy;
    /// without, a server of a split splice. `taken`: the sockets and registration of the
    /// process before (an upgrade).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start_as(
        cfg: TierConfig,
        register_in: String,
        registrars: RegistrarAccess,
        side: Arc<dyn Side>,
        interface: &str,
        ports: Option<std::ops::RangeInclusive<u16>>,
        free: Box<dyn Fn() -> f64 + Send + Sync>,
        taken: Option<TakenMember>,
    ) -> Result<Arc<Tier>, String> {
        let mac = mac_of(interface)?;
        // A member started afresh waits for an address the member stopping here still holds.
        let patience = if taken.is_none() {
            crate::listener::ADDRESS_PATIENCE
        } else {
            Duration::ZERO
        };
        let (taken_sockets, taken_pe) = match taken {
            Some(t) if t.listen == cfg.listen => (Some((t.tcp, t.udp)), Some((t.id, t.pe))),
            Some(t) => {
                info!(
                    "proxy: tier: the address handed over ({}) is no longer configured; \
                     binding {}",
                    t.listen, cfg.listen
                );
                (None, Some((t.id, t.pe)))
            }
            None => (None, None),
        };
        let handed_over = taken_sockets.is_some();
        let (tcp, udp) = match taken_sockets {
            Some((tcp, udp)) => {
                let tcp = tcp
                    .set_nonblocking(true)
                    .and_then(|()| TcpListener::from_std(tcp))
                    .map_err(|e| format!("[tier] listener handed over: {e}"))?;
                let udp = udp
                    .set_nonblocking(true)
                    .and_then(|()| UdpSocket::from_std(udp))
                    .map_err(|e| format!("[tier] UDP socket handed over: {e}"))?;
                (tcp, udp)
            }
            None => {
                let at = cfg.listen;
                let tcp = when_free(at, patience, || std::net::TcpListener::bind(at))
                    .await
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .and_then(TcpListener::from_std)
                    .map_err(|e| format!("[tier] listen {at}: {e}"))?;
                let udp = when_free(at, patience, || std::net::UdpSocket::bind(at))
                    .await
                    .and_then(|u| u.set_nonblocking(true).map(|()| u))
                    .and_then(UdpSocket::from_std)
                    .map_err(|e| format!("[tier] listen {at} (UDP): {e}"))?;
                (tcp, udp)
            }
        };
        let dup = |fd: std::os::fd::BorrowedFd<'_>| {
            rserpool_handover::dup(fd).map_err(|e| format!("[tier] {e}"))
        };
        let sockets = [dup(tcp.as_fd())?, dup(udp.as_fd())?];
        let pe = match taken_pe {
            Some((_, Some(pe))) => pe,
            other => {
                let mut pe_cfg = member_pe_config(&cfg, &register_in, &registrars);
                // The registration could not move (TLS): the same member registers again.
                pe_cfg.id = other.map(|(id, _)| id);
                let pe =
                    PoolElement::start(pe_cfg).map_err(|e| format!("[tier] registering: {e}"))?;
                Arc::new(pe)
            }
        };
        let me = Hello {
            id: pe.id(),
            mac,
            shared: cfg.server_address,
            lo: ports.as_ref().map_or(0, |p| *p.start()),
            hi: ports.as_ref().map_or(0, |p| *p.end()),
        };
        info!(
            "proxy: tier {}: member {:#010x} at {}, ports {}-{} on {}",
            cfg.pool, me.id, cfg.listen, me.lo, me.hi, me.shared
        );
        let epoch = std::time::Instant::now();
        let mut core = MemberCore::new(me, side.shares(), Instant::from_millis(0));
        if handed_over {
            // The pinned maps hold the table; the old process answered the distributor until
            // now, and this one goes on at once.
            core.taking_over();
        }
        let (retired, _) = watch::channel(false);
        let (closed, _) = watch::channel(false);
        let tier = Arc::new_cyclic(|this| Tier {
            cfg,
            me,
            side,
            core: Mutex::new(core),
            links: Mutex::new(HashMap::new()),
            epoch,
            timer: Arc::new(Notify::new()),
            this: this.clone(),
            free,
            pe: Mutex::new(pe),
            registrars: registrars.clone(),
            register_in,
            sockets: Mutex::new(Some(sockets)),
            closed,
            given: Mutex::new(None),
            retired,
            leaving: Leaving::default(),
        });
        let until_retired = |tier: &Arc<Tier>| {
            let mut r = tier.retired.subscribe();
            async move { until_set(&mut r).await }
        };
        let weak = Arc::downgrade(&tier);
        let spawn = |task: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| {
            let retired = until_retired(&tier);
            tokio::spawn(async move {
                tokio::select! {
                    () = task => {}
                    () = retired => {}
                }
            });
        };
        // The listener and the UDP socket close once the member has left: nobody links to a
        // member out of the pool, and a proxy started meanwhile binds the same address.
        let until_closed = |tier: &Arc<Tier>| {
            let mut c = tier.closed.subscribe();
            async move { until_set(&mut c).await }
        };
        let spawn_open = |task: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| {
            let closed = until_closed(&tier);
            spawn(Box::pin(async move {
                tokio::select! {
                    () = task => {}
                    () = closed => {}
                }
            }));
        };
        spawn_open(Box::pin(accept_loop(weak.clone(), tcp)));
        if ports.is_some() {
            spawn_open(Box::pin(heartbeat_loop(weak.clone(), udp)));
        }
        spawn(Box::pin(discovery_loop(weak.clone(), registrars)));
        spawn(Box::pin(timer_loop(weak)));
        Ok(tier)
    }

    fn pe(&self) -> Arc<PoolElement> {
        self.pe.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// For a successor: the tier's state and second descriptors of its sockets, and the
    /// registration association, which this member gives away (its PE stops here without
    /// deregistering; [`resume`](Self::resume) takes it back if the successor fails). This
    /// member carries on meanwhile, links and heartbeats included.
    pub(crate) async fn hand_over(&self) -> std::io::Result<(TierState, Vec<OwnedFd>)> {
        let mut fds = Vec::with_capacity(3);
        {
            let sockets = self.sockets.lock().unwrap_or_else(|p| p.into_inner());
            let sockets = sockets
                .as_ref()
                .ok_or_else(|| std::io::Error::other("the tier member has left the tier"))?;
            for s in sockets {
                fds.push(rserpool_handover::dup(s.as_fd())?);
            }
        }
        let registration = match self.pe().hand_over().await {
            Some((h, stream)) => {
                fds.push(rserpool_handover::dup(stream.as_fd())?);
                let r = Registration::of(&h);
                *self.given.lock().unwrap_or_else(|p| p.into_inner()) = Some((h, stream));
                Some(r)
            }
            None => {
                info!(
                    "proxy: tier: the registration cannot move (TLS): the successor registers \
                     again once this process lets go"
                );
                None
            }
        };
        let state = TierState {
            listen: self.cfg.listen,
            id: self.me.id,
            registration,
        };
        Ok((state, fds))
    }

    /// The successor failed: this member registers over the association it gave away again.
    pub(crate) fn resume(&self) {
        let Some(mut a) = self.given.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        // The successor read from the association: what was unread is its now, gone.
        a.0.unread.clear();
        let cfg = member_pe_config(&self.cfg, &self.register_in, &self.registrars);
        match PoolElement::from_hand_over(cfg, a) {
            Ok(pe) => *self.pe.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(pe),
            Err(e) => warn!("proxy: tier: cannot take the registration back: {e}"),
        }
    }

    /// The proxy stops: this member leaves the tier pool and answers no more heartbeats, and
    /// returns once the distributor sends none (it took the member out of the router's
    /// group), at most after `limit`; meanwhile it serves what still comes (see `leave.rs`).
    /// Its tier listener and heartbeat socket are closed then.
    pub(crate) async fn leave(&self, limit: Duration) {
        self.leaving.start();
        self.pe().set_active(false);
        info!(
            "proxy: tier member {:#010x}: leaving the tier (deregistered, heartbeats no longer \
             answered); serving what comes until the distributor takes it out of the group",
            self.me.id
        );
        if self.leaving.heartbeats_stopped(limit).await {
            info!(
                "proxy: tier member {:#010x}: out of the group (no more heartbeats)",
                self.me.id
            );
        } else {
            warn!(
                "proxy: tier member {:#010x}: the distributor still sends heartbeats after \
                 {limit:?}; closing the listeners anyway",
                self.me.id
            );
        }
        let _ = self.closed.send(true);
        self.sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }

    /// A successor serves as this member: every task of the membership ends here (links,
    /// heartbeats, the passes), and the registration is its.
    pub(crate) fn retire(&self) {
        let _ = self.retired.send(true);
        self.links.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.given.lock().unwrap_or_else(|p| p.into_inner()).take();
        info!(
            "proxy: tier member {:#010x}: the next process carries on",
            self.me.id
        );
    }

    fn core(&self) -> std::sync::MutexGuard<'_, MemberCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Instant {
        Instant::since(self.epoch, std::time::Instant::now())
    }

    /// Carries out what the core asks: messages onto their links, links opened and closed,
    /// the datapath changed.
    fn drive(&self) {
        loop {
            let (transmits, actions) = {
                let mut core = self.core();
                let t: Vec<_> = std::iter::from_fn(|| core.poll_transmit()).collect();
                let a: Vec<_> = std::iter::from_fn(|| core.poll_action()).collect();
                (t, a)
            };
            if transmits.is_empty() && actions.is_empty() {
                return;
            }
            for t in transmits {
                let sent = {
                    let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
                    links
                        .get(&t.link)
                        .map(|tx| tx.try_send(t.message.encode()).is_ok())
                };
                if sent == Some(false) {
                    // Full or gone: dropped, and linked again (with everything) by discovery.
                    warn!(
                        "proxy: tier link to member {:#010x} fell behind; linking again",
                        t.to
                    );
                    self.drop_link(t.link, true);
                }
            }
            for a in actions {
                self.act(a);
            }
        }
    }

    fn drop_link(&self, link: LinkId, fell_behind: bool) {
        self.links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&link);
        let now = self.now();
        self.core().link_down(link, fell_behind, now);
    }

    fn act(&self, a: Action) {
        match a {
            Action::Connect { link, id, addr } => {
                let (tx, rx) = mpsc::channel(QUEUE);
                self.links
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(link, tx);
                tokio::spawn(run_link(self.this.clone(), link, id, addr, rx));
            }
            Action::Disconnect { link, .. } => {
                // Its task ends once its queue is dropped.
                self.links
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&link);
            }
            Action::Install(s) => {
                if let Err(e) = self.side.install(to_datapath(&s)) {
                    debug!("proxy: tier: a splice from another member: {e}");
                }
            }
            Action::Remove(s) => self.side.remove(&to_datapath(&s)),
            Action::MarkFin(a, b) => self.side.mark_fin(a, b),
            Action::Touch(flows) => self.side.touch(&flows),
            Action::SetTier(forward) => {
                let members: Vec<TierMember> = forward
                    .into_iter()
                    .map(|f| TierMember {
                        shared: f.shared,
                        ports: f.ports,
                        mac: f.mac,
                        src: f.src,
                    })
                    .collect();
                if let Err(e) = self.side.set_tier(&members) {
                    warn!("proxy: tier: {e}");
                }
            }
            Action::ReadTable => {
                let weak = self.this.clone();
                tokio::spawn(async move {
                    let Some(t) = weak.upgrade() else { return };
                    let side = t.side.clone();
                    drop(t);
                    let Ok(state) = tokio::task::spawn_blocking(move || side.state()).await else {
                        return;
                    };
                    let Some(t) = weak.upgrade() else { return };
                    let now = t.now();
                    t.core().compare(state.iter().map(to_entry).collect(), now);
                    t.drive();
                    t.timer.notify_one();
                });
            }
            Action::Nudge { dead, prober } => {
                let Some(t) = self.this.upgrade() else { return };
                tokio::task::spawn_blocking(move || {
                    let done = match t.side.nudge(prober) {
                        Ok((probes, reverts)) => {
                            info!(
                                "tier: member {dead:#010x} died; nudged: {probes} probes, \
                                 {reverts} ICMP errors"
                            );
                            Some((probes, reverts))
                        }
                        Err(e) => {
                            warn!("tier: member {dead:#010x} died; the nudge failed: {e}");
                            None
                        }
                    };
                    t.core().nudge_done(done);
                });
            }
        }
    }

    fn counters(&self) -> (Counters, usize, usize) {
        let core = self.core();
        (core.counters, core.links(), core.members_known())
    }

    pub(crate) fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        let (c, links, _) = self.counters();
        m.gauge(
            "rserpool_proxy_tier_links",
            "Links to other members of the proxy tier.",
            &[],
            links as f64,
        );
        let counters = [
            (
                "rserpool_proxy_tier_messages_sent",
                "Messages sent to other members of the tier.",
                c.sent,
            ),
            (
                "rserpool_proxy_tier_messages_received",
                "Messages received from other members of the tier.",
                c.received,
            ),
            (
                "rserpool_proxy_tier_splices_received",
                "Splices installed from other members of the tier.",
                c.splices_in,
            ),
            (
                "rserpool_proxy_tier_links_dropped",
                "Links to other members dropped.",
                c.links_dropped,
            ),
            (
                "rserpool_proxy_tier_nudges",
                "Nudges after another member of the tier died.",
                c.nudges,
            ),
            (
                "rserpool_proxy_tier_nudge_probes",
                "SYN probes sent by nudges (to both ends of every spliced connection).",
                c.nudge_probes,
            ),
            (
                "rserpool_proxy_tier_nudge_reverts",
                "ICMP errors sent by nudges to end a TCP sender's backoff.",
                c.nudge_reverts,
            ),
            (
                "rserpool_proxy_tier_forwarded_packets",
                "Packets forwarded to the member owning their port range.",
                self.side.forwarded(),
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
    }

    pub(crate) fn snapshot(&self) -> serde_json::Value {
        // Members forwarded to: listed in the pool, and their HELLO received.
        let (c, links, members) = self.counters();
        let (tables, answering) = {
            let core = self.core();
            (core.tables_received(), core.answering())
        };
        serde_json::json!({
            "pool": self.cfg.pool,
            "member": format!("{:#010x}", self.me.id),
            "links": links,
            "members_known": members,
            "tables_received": tables,
            "answering": answering,
            "messages_sent": c.sent,
            "messages_received": c.received,
            "splices_received": c.splices_in,
            "links_dropped": c.links_dropped,
            "heartbeats": c.heartbeats,
            "nudges": c.nudges,
            "nudge_probes": c.nudge_probes,
            "nudge_reverts": c.nudge_reverts,
            "forwarded_packets": self.side.forwarded(),
        })
    }
}

/// The MAC address of `interface`.
fn mac_of(interface: &str) -> Result<[u8; 6], String> {
    let path = format!("/sys/class/net/{interface}/address");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("[tier] interface {interface}: {e}"))?;
    let mut mac = [0u8; 6];
    let mut parts = text.trim().split(':');
    for b in &mut mac {
        *b = parts
            .next()
            .and_then(|p| u8::from_str_radix(p, 16).ok())
            .ok_or_else(|| format!("[tier] interface {interface}: no MAC address in {path}"))?;
    }
    Ok(mac)
}

/// Reads one message's body from a member (`None`: the link closed).
async fn read_message(s: &mut TcpStream) -> std::io::Result<Option<Bytes>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = rserpool_tier::wire::frame_len(len)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Ok(Some(Bytes::from(body)))
}

/// Takes links from other members: what they send goes to the core.
async fn accept_loop(tier: Weak<Tier>, l: TcpListener) {
    loop {
        let (mut s, from) = match l.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, say: not again at once.
                debug!("proxy: tier: accepting a link: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let tier = tier.clone();
        tokio::spawn(async move {
            s.set_nodelay(true).ok();
            // The member at the other end, once its HELLO named it.
            let mut member = None;
            loop {
                let body = match read_message(&mut s).await {
                    Ok(Some(b)) => b,
                    Ok(None) => return,
                    Err(e) => {
                        debug!("proxy: tier link from {from}: {e}");
                        return;
                    }
                };
                let Some(tier) = tier.upgrade() else { return };
                let Some(m) = Message::decode(body) else {
                    warn!(
                        "proxy: tier link from {from}: a message that does not parse; closing it"
                    );
                    return;
                };
                if let Message::Hello(h) = &m {
                    member = Some(h.id);
                }
                let now = tier.now();
                tier.core().handle_message_from(member, m, now);
                tier.drive();
            }
        });
    }
}

/// Answers the distributor's heartbeats with this member's workload factor, and hears from
/// it that a member died.
async fn heartbeat_loop(tier: Weak<Tier>, udp: UdpSocket) {
    let mut buf = [0u8; 64];
    loop {
        let Ok((n, from)) = udp.recv_from(&mut buf).await else {
            continue;
        };
        let Some(tier) = tier.upgrade() else { return };
        let (now, free) = (tier.now(), (tier.free)());
        let reply = tier.core().handle_datagram(from, &buf[..n], free, now);
        if let Some(reply) = reply
            && tier.leaving.heartbeat()
        {
            let _ = udp.send_to(&reply, from).await;
        }
        tier.drive();
    }
}

/// Runs the core's timers (the once-a-second pass).
async fn timer_loop(tier: Weak<Tier>) {
    loop {
        let Some(t) = tier.upgrade() else { return };
        let due = t.core().poll_timeout();
        let at = due.and_then(|d| d.to_std(t.epoch));
        let timer = t.timer.clone();
        drop(t);
        let notified = timer.notified();
        match at {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {}
                    () = notified => continue,
                }
            }
            None => notified.await,
        }
        let Some(t) = tier.upgrade() else { return };
        let now = t.now();
        t.core().tick(now);
        t.drive();
    }
}

/// Keeps the core told of the members the tier pool lists, and this member's load in it.
async fn discovery_loop(tier: Weak<Tier>, registrars: RegistrarAccess) {
    let mut cfg = PoolUserConfig {
        tls: registrars.tls,
        subscribe: true,
        ..PoolUserConfig::default()
    };
    cfg.set_registrars(&registrars.addrs);
    let Ok(mut pu) = PoolUser::new(cfg) else {
        warn!("proxy: tier: cannot start the pool user");
        return;
    };
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        // Gone: its pool element deregisters as it drops.
        let Some(t) = tier.upgrade() else {
            return;
        };
        if t.leaving.on() {
            // Out of the pool: the links it has carry on, it makes no new ones (a member
            // started in its place, with the same ports, would link to it).
            return;
        }
        t.pe().update_load(1.0 - (t.free)().clamp(0.0, 1.0));
        let handle = rserpool_wire::PoolHandle::from(t.cfg.pool.as_str());
        // A proxy also links to the servers of split splices, which register apart.
        let split = (t.me.hi > 0).then(|| split_pool(&t.cfg.pool));
        drop(t);
        let mut listed = match pu.pool_elements(&handle).await {
            Ok((_, pes)) => pes,
            Err(e) => {
                debug!("proxy: tier: resolving the tier pool: {e}");
                every.tick().await;
                continue;
            }
        };
        if let Some(split) = split
            && let Ok((_, pes)) = pu.pool_elements(&split).await
        {
            listed.extend(pes);
        }
        let Some(t) = tier.upgrade() else {
            return;
        };
        let mut now: BTreeMap<u32, SocketAddr> = BTreeMap::new();
        for p in &listed {
            if let rserpool_wire::UserTransport::Address(a) = &p.user_transport
                && let Some(addr) = a.socket_addrs().next()
            {
                now.insert(p.id, addr);
            }
        }
        let at = t.now();
        t.core().set_listed(now, at);
        t.drive();
        drop(t);
        // A push (a member came or went) or the next second, whichever is first.
        tokio::select! {
            _ = pu.next_push() => {}
            _ = every.tick() => {}
        }
    }
}

/// One link to member `id`: HELLO and every splice known here first, then what the core
/// sends on it.
async fn run_link(
    tier: Weak<Tier>,
    link: LinkId,
    id: u32,
    addr: SocketAddr,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let written = async {
        let connected =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await;
        let mut s = match connected {
            Ok(Ok(s)) => s,
            other => {
                debug!("proxy: tier member {id:#010x} at {addr}: cannot connect ({other:?})");
                return;
            }
        };
        s.set_nodelay(true).ok();
        let Some(t) = tier.upgrade() else { return };
        let table = if t.side.shares() {
            t.side.state()
        } else {
            Vec::new()
        };
        let now = t.now();
        let first = t
            .core()
            .link_up(link, table.iter().map(|st| to_core(&st.splice)), now);
        drop(t);
        let splices = first
            .iter()
            .filter(|m| matches!(m, Message::Add(_)))
            .count();
        info!("proxy: tier link to member {id:#010x} at {addr}: {splices} splices sent");
        let mut bytes = Vec::new();
        for m in &first {
            bytes.extend_from_slice(&m.encode());
        }
        if s.write_all(&bytes).await.is_err() {
            return;
        }
        // The other end sends nothing: anything read means it closed (a member that exits,
        // or that handed its sockets to the process replacing it), and the link is made again
        // at once rather than at the next write.
        let (mut rd, mut wr) = s.into_split();
        let mut probe = [0u8; 1];
        loop {
            tokio::select! {
                b = rx.recv() => {
                    let Some(b) = b else { return };
                    if wr.write_all(&b).await.is_err() {
                        debug!("proxy: tier link to member {id:#010x} at {addr} broke");
                        return;
                    }
                }
                _ = rd.read(&mut probe) => {
                    debug!("proxy: tier link to member {id:#010x} at {addr} closed by it");
                    return;
                }
            }
        }
    };
    written.await;
    // Closed, failed or broken: the core links again at the next listing.
    if let Some(t) = tier.upgrade() {
        t.drop_link(link, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_parse() {
        let mut c = TierConfig {
            pool: "T".into(),
            listen: "127.0.0.1:9950".parse().unwrap(),
            server_address: Ipv4Addr::new(10, 9, 0, 2),
            ports: "20000-29999".into(),
            interface: None,
        };
        assert_eq!(c.port_range().unwrap(), 20000..=29999);
        for bad in ["", "20000", "3-2", "0-5", "a-b", "1-70000"] {
            c.ports = bad.into();
            assert!(c.port_range().is_err(), "{bad}");
        }
    }
}
