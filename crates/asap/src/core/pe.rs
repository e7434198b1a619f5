//! The pool element's protocol state machine, sans-IO.
//!
//! It registers, answers ENDPOINT_KEEP_ALIVEs (adopting a new home registrar on the H bit),
//! re-registers every reregistration interval and whenever the policy changes (e.g. a new
//! load), and when the association fails it moves to the next registrar it knows (configured,
//! or heard in SERVER_ANNOUNCE) with exponential back-off and jitter.
//!
//! Takeover (RFC 5353 §3.5): the PE announces an ASAP transport where registrars reach it (the
//! driver's listener; [`PeCore::accept`] names each incoming connection). When its home
//! registrar dies, the registrar that takes over connects there and sends ENDPOINT_KEEP_ALIVE
//! with the H bit; the PE answers and carries on over that connection as over a home
//! association (keep-alives, re-registrations, deregistration), without registering again. A
//! PE that loses its home adopts such a takeover whenever one arrives, however many registrars
//! it knows: while it waits `takeover_wait` for one (when it knows another registrar it could
//! register with instead), while it backs off, while it connects or registers elsewhere, and
//! for [`TAKEOVER_RACE`] after it registered elsewhere (a takeover of the old home by its peers
//! may race that registration); registered again with the home it lost, or past that, it
//! checks a takeover with its home as below. The last takeover wins. A takeover that cuts short a registration made after the loss is
//! followed by a registration over the new home, so that the registrars agree on it again.
//!
//! A takeover is only real when the home is gone (RFC 5355 §3.1: anyone who reaches the
//! takeover address could claim to be a registrar). One that arrives while the PE's home
//! association is up is answered (its keep-alive acknowledged, as the registrar expects) but
//! not obeyed at once: the PE registers again with its home, and adopts the takeover only if
//! the home does not answer within the response timeout or the association fails meanwhile.
//! A home that answers keeps the PE, and the claimant's connection is closed (claims are
//! logged at most once a minute).
//! Nothing changes on the wire.
//! Without a takeover it keeps trying the registrars it knows with back-off, and registers
//! again once one is reachable.
//!
//! [`PeCore::stop`] and [`PeCore::set_active`]`(false)` deregister.
//!
//! Hand-over (an upgrade of the process that runs the PE): [`PeCore::hand_over`] gives the
//! registration association away without deregistering, and the next process carries on over
//! it with [`PeCore::from_hand_over`]. The registrar sees one association throughout, so the
//! PE never leaves its pool; the successor registers again at once, which also answers for a
//! keep-alive the old process read but did not acknowledge.

use super::{Action, ConnId, Instant, Outbox, earliest, jitter, nonzero_u32};
use crate::registrars::RegistrarSet;
use rand_core::RngCore;
use rserpool_wire::{
    Address, AsapMessage, Policy, PoolHandle, Protocol, Scheme, TransportAddress, UserTransport,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tracing::{debug, info, warn};

/// Time a registrar connecting to the takeover address has to send its first message.
const TAKEOVER_FIRST_MESSAGE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct PoolElementConfig {
    pub pool_handle: PoolHandle,
    /// Where pool users reach the service (TCP).
    pub transport: SocketAddr,
    pub policy: Policy,
    /// PE identifier; random when `None`.
    pub id: Option<u32>,
    pub registrars: Vec<SocketAddr>,
    /// The registrars of `registrars` reached over SCTP, with how (the others: TCP); see
    /// [`set_registrars`](Self::set_registrars).
    pub registrar_schemes: BTreeMap<SocketAddr, Scheme>,
    /// Pool users reach the service over SCTP (a transport parameter for SCTP, data plus
    /// control, is registered), not TCP.
    pub service_over_sctp: bool,
    /// Listen for SERVER_ANNOUNCE here (UDP; multicast groups are joined).
    pub announce_listen: Option<SocketAddr>,
    /// Re-registration interval (rsplib: 30 s). The registration life sent is three times it.
    pub reregistration_interval: Duration,
    pub connect_timeout: Duration,
    /// Time the registrar has to answer a (de)registration.
    pub response_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Register at start (false: wait for [`PeUpdater::set_active`](crate::PeUpdater::set_active)).
    pub initially_active: bool,
    /// Where registrars taking over reach this PE (TCP; port 0 picks one; a wildcard address
    /// means the local address the PE reaches its first registrar from, so a PE whose
    /// registrar is on loopback listens on loopback only). `None`: no takeover.
    pub takeover_listen: Option<SocketAddr>,
    /// After losing its home registrar, time to wait for a takeover before registering with
    /// another one (only when another one is known). A takeover is adopted at any time.
    pub takeover_wait: Duration,
    /// TLS with the registrars (RFC 5355): this process's certificate and the CA; `None`:
    /// plain TCP.
    pub tls: Option<std::sync::Arc<rserpool_tls::Tls>>,
}

impl PoolElementConfig {
    /// A PE of `pool_handle` serving at `transport` with `policy`. By default: the registrar
    /// at 127.0.0.1:3863, a re-registration every 30 s, 2 s to connect
    /// and 3 s for an answer, back-off from 200 ms to 10 s, 5 s for a takeover before
    /// registering elsewhere, the takeover listener on an ephemeral port.
    pub fn new(pool_handle: impl Into<PoolHandle>, transport: SocketAddr, policy: Policy) -> Self {
        Self {
            pool_handle: pool_handle.into(),
            transport,
            policy,
            id: None,
            registrars: vec![SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))],
            registrar_schemes: BTreeMap::new(),
            service_over_sctp: false,
            announce_listen: None,
            reregistration_interval: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            initially_active: true,
            takeover_listen: Some(SocketAddr::from(([0, 0, 0, 0], 0))),
            takeover_wait: Duration::from_secs(5),
            tls: None,
        }
    }

    /// The registrars, each over the transport its address names (`tcp://`, `sctp+udp://`…).
    pub fn set_registrars(&mut self, registrars: &[Address]) {
        (self.registrars, self.registrar_schemes) = crate::registrars::split(registrars);
    }

    /// Registration life in seconds (RFC 5354 unit): three reregistration intervals.
    fn registration_life(&self) -> i32 {
        let ms = self.reregistration_interval.as_millis().saturating_mul(3);
        i32::try_from(ms.div_ceil(1000)).unwrap_or(i32::MAX).max(1)
    }
}

/// What the PE is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeState {
    /// Not registered on purpose ([`PoolElement::set_active`](crate::PoolElement::set_active)`(false)`).
    Inactive,
    /// Looking for a registrar or waiting for its answer.
    Registering,
    /// Registered; `home` is the home registrar's ID, 0 until the registrar names itself (in
    /// its first keep-alive: a REGISTRATION_RESPONSE does not carry it).
    Registered {
        registrar: SocketAddr,
        home: u32,
    },
    /// The last registration was refused; retrying after back-off.
    Rejected(String),
    Stopped,
}

/// What the PE tells its application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeEvent {
    /// The state changed (to the one given).
    State(PeState),
    /// A registrar at `registrar` took over as home (`home` is its ID).
    TakenOver { registrar: SocketAddr, home: u32 },
    /// The association over which the PE was registered failed.
    LostHome { registrar: SocketAddr },
}

/// A registration association given to the process that replaces this one
/// ([`PeCore::hand_over`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedOver {
    /// The PE identifier.
    pub id: u32,
    /// The registrar at the other end, and its Server Identifier (the PE's home).
    pub registrar: SocketAddr,
    pub home: u32,
    /// What was read from the association and is not a whole message yet: the successor reads
    /// it first.
    pub unread: Vec<u8>,
}

/// One association with a registrar, from registration (or takeover) to failure or stop.
#[derive(Debug)]
struct Session {
    conn: ConnId,
    addr: SocketAddr,
    /// Registered over it (by a positive answer, or because a registrar took over over it).
    registered: bool,
    /// Opened by a registrar that took over.
    adopted: bool,
    home: u32,
    /// Deadline for the answer to the registration in flight, if any.
    pending: Option<Instant>,
    rereg_at: Instant,
}

#[derive(Debug)]
enum Phase {
    /// Not registered on purpose.
    Inactive,
    /// Waiting until `until` before the next attempt; `for_takeover`: after losing the home,
    /// giving another registrar time to take over first.
    Waiting {
        until: Instant,
        for_takeover: bool,
    },
    Connecting {
        conn: ConnId,
        addr: SocketAddr,
        deadline: Instant,
    },
    Session(Session),
    /// A DEREGISTRATION is out; its answer is awaited until `deadline`.
    Deregistering {
        conn: ConnId,
        deadline: Instant,
    },
    Stopped,
}

/// A connection to the takeover address whose first message has not arrived yet.
struct Offer {
    peer: SocketAddr,
    deadline: Instant,
}

/// A takeover claimed while the home association was up, waiting for the home's answer to the
/// registration sent to check it.
struct Claim {
    conn: ConnId,
    peer: SocketAddr,
    home: u32,
    /// Whether the log said so (claims are logged at most once a minute: a forged one may
    /// come every few seconds).
    logged: bool,
}

/// Claims of a takeover are logged at most once per this.
const CLAIM_LOG_EVERY: Duration = Duration::from_secs(60);

/// How long after registering elsewhere, having lost its home, a PE still obeys a takeover
/// without asking its new home: the old home's peers take it over within their
/// MAX-TIME-LAST-HEARD and takeover expiry (5 s each by default) after it went silent, which a
/// registration elsewhere (after `takeover_wait`) may precede. Past this, a takeover is a
/// claim like any other, checked with the home first (RFC 5355 §3.1).
pub const TAKEOVER_RACE: Duration = Duration::from_secs(30);

/// The home the PE lost, and until when a registration elsewhere may race its takeover
/// (`None` until the PE registered elsewhere).
#[derive(Clone, Copy, Debug)]
struct LostHome {
    registrar: SocketAddr,
    race_until: Option<Instant>,
}

/// A pool element's protocol state; see the module docs.
pub struct PeCore {
    cfg: PoolElementConfig,
    id: u32,
    asap_transport: Option<SocketAddr>,
    rng: Box<dyn RngCore + Send>,
    registrars: RegistrarSet,
    out: Outbox<PeEvent>,
    phase: Phase,
    state: PeState,
    /// What the application asks for.
    active: bool,
    stop: bool,
    policy: Policy,
    /// The policy of the last registration sent, which the home registrar holds.
    sent_policy: Policy,
    backoff: Duration,
    /// Index of the next registrar to try.
    next: usize,
    /// The PE lost its home and has not been taken over since: a registration elsewhere may
    /// race a takeover of the old home by its peers.
    lost_home: Option<LostHome>,
    offers: BTreeMap<ConnId, Offer>,
    claim: Option<Claim>,
    /// When a claim was last logged, and how many came since.
    claims_logged: Option<(Instant, u32)>,
    /// A registrar could not be reached and the log said so: it says it again only after a
    /// registration (once per outage, not at every back-off).
    unreachable_said: bool,
}

impl PeCore {
    /// Where pool users reach the service, as registered.
    fn service_transport(&self) -> TransportAddress {
        let mut t = TransportAddress::tcp(self.cfg.transport);
        if self.cfg.service_over_sctp {
            // Data plus control, as rsplib's PEs register: a pool's PEs must agree on it
            // (RFC 5352 §3.10's Inconsistent Data/Control Configuration), so only so can
            // rserpool's and rsplib's PEs share a pool.
            t.protocol = Protocol::Sctp { transport_use: 1 };
        }
        t
    }

    /// A pool element with the settings of `cfg`; `asap_transport` is where registrars taking
    /// over reach it (the driver's listener; `None`: no takeover). Randomness (the PE
    /// identifier when `cfg.id` is `None`, back-off jitter) comes from `rng`.
    pub fn new(
        cfg: PoolElementConfig,
        asap_transport: Option<SocketAddr>,
        rng: Box<dyn RngCore + Send>,
        now: Instant,
    ) -> Self {
        let mut core = Self::idle_core(cfg, asap_transport, rng);
        if core.active {
            core.attempt(now);
        } else {
            core.set_state(PeState::Inactive);
        }
        core
    }

    /// The PE of `cfg` carrying on over a registration association another process handed
    /// over ([`hand_over`](Self::hand_over)); the identifier is `h.id`, whatever `cfg` says.
    /// The driver serves the association as the returned connection and hands the core
    /// `h.unread` as its first data. A registration is sent at once.
    pub fn from_hand_over(
        mut cfg: PoolElementConfig,
        asap_transport: Option<SocketAddr>,
        rng: Box<dyn RngCore + Send>,
        h: &HandedOver,
        now: Instant,
    ) -> (Self, ConnId) {
        cfg.id = Some(h.id);
        cfg.initially_active = true;
        let mut core = Self::idle_core(cfg, asap_transport, rng);
        let conn = core.out.open();
        core.start_session(conn, h.registrar, Some((h.home, true)), now);
        if let Phase::Session(s) = &mut core.phase {
            // This PE opened the association (in the process before), no registrar taking over.
            s.adopted = false;
        }
        info!(
            "PE {:#010x}: carrying on in pool {} over the association with {} handed over",
            core.id, core.cfg.pool_handle, h.registrar
        );
        (core, conn)
    }

    /// The association the PE is registered over, if any (the one [`hand_over`](Self::hand_over)
    /// would give away).
    pub fn registered_conn(&self) -> Option<ConnId> {
        match &self.phase {
            Phase::Session(s) if s.registered => Some(s.conn),
            _ => None,
        }
    }

    /// Gives the registration association away, for a process that replaces this one
    /// ([`from_hand_over`](Self::from_hand_over)): the core forgets it without
    /// deregistering or closing it, closes every other connection and stops. `None` (and
    /// nothing changes) unless registered. The caller must have read everything the driver
    /// received on the association into the core, or pass it on after `unread`.
    pub fn hand_over(&mut self) -> Option<(ConnId, HandedOver)> {
        let Phase::Session(s) = &self.phase else {
            return None;
        };
        if !s.registered {
            return None;
        }
        let (conn, registrar, home) = (s.conn, s.addr, s.home);
        let unread = self.out.release(conn)?;
        self.stop = true;
        // Stopped, as after a deregistration, but the PE stays registered.
        self.idle();
        info!(
            "PE {:#010x}: association with {registrar} handed over; still registered",
            self.id
        );
        Some((
            conn,
            HandedOver {
                id: self.id,
                registrar,
                home,
                unread,
            },
        ))
    }

    /// A core with nothing under way yet.
    fn idle_core(
        cfg: PoolElementConfig,
        asap_transport: Option<SocketAddr>,
        mut rng: Box<dyn RngCore + Send>,
    ) -> Self {
        let id = cfg.id.unwrap_or_else(|| nonzero_u32(&mut *rng));
        Self {
            id,
            asap_transport,
            rng,
            registrars: RegistrarSet::new(cfg.registrars.clone()),
            out: Outbox::new(),
            phase: Phase::Inactive,
            state: PeState::Registering,
            active: cfg.initially_active,
            stop: false,
            policy: cfg.policy.clone(),
            sent_policy: cfg.policy.clone(),
            backoff: cfg.backoff_min,
            next: 0,
            lost_home: None,
            offers: BTreeMap::new(),
            claim: None,
            claims_logged: None,
            unreachable_said: false,
            cfg,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn config(&self) -> &PoolElementConfig {
        &self.cfg
    }

    pub fn state(&self) -> &PeState {
        &self.state
    }

    /// The policy currently asked for.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// True once stopped: no action will come any more.
    pub fn is_stopped(&self) -> bool {
        matches!(self.phase, Phase::Stopped)
    }

    /// Changes the policy information (e.g. a new load); sent as a re-registration at once.
    pub fn update_policy(&mut self, policy: Policy, now: Instant) {
        if policy == self.policy {
            return;
        }
        self.policy = policy;
        if let Phase::Session(s) = &mut self.phase
            && self.policy != self.sent_policy
        {
            self.sent_policy = self.policy.clone();
            if s.pending.is_none() {
                s.pending = Some(now + self.cfg.response_timeout);
            }
            let (conn, msg) = (s.conn, self.registration());
            self.out.send(conn, &msg);
        }
    }

    /// Deregisters (false) or registers again (true), keeping the PE identifier.
    pub fn set_active(&mut self, active: bool, now: Instant) {
        if active != self.active {
            self.active = active;
            self.follow_wishes(now);
        }
    }

    /// Deregisters and stops.
    pub fn stop(&mut self, now: Instant) {
        if !self.stop {
            self.stop = true;
            self.follow_wishes(now);
        }
    }

    /// A SERVER_ANNOUNCE datagram from `from`.
    pub fn handle_announce(&mut self, datagram: &[u8], from: SocketAddr, now: Instant) {
        self.registrars.heard_announce(datagram, from, now);
    }

    /// A connection to the takeover address from `peer` (a registrar taking over, or not).
    pub fn accept(&mut self, peer: SocketAddr, now: Instant) -> ConnId {
        let conn = self.out.open();
        if self.is_stopped() {
            self.out.close(conn);
        } else {
            let deadline = now + TAKEOVER_FIRST_MESSAGE;
            self.offers.insert(conn, Offer { peer, deadline });
        }
        conn
    }

    /// A connection asked for with [`Action::Connect`] is up.
    pub fn handle_connected(&mut self, conn: ConnId, now: Instant) {
        if let Phase::Connecting { conn: c, addr, .. } = self.phase
            && c == conn
        {
            self.start_session(conn, addr, None, now);
        }
    }

    /// The connection closed, or could not be opened.
    pub fn handle_close(&mut self, conn: ConnId, now: Instant) {
        if !self.out.closed(conn) {
            return;
        }
        if let Some(o) = self.offers.remove(&conn) {
            debug!("PE {:#010x}: {} is not a takeover; closed", self.id, o.peer);
            return;
        }
        if self.claim.as_ref().is_some_and(|c| c.conn == conn) {
            self.claim = None;
            return;
        }
        match &self.phase {
            Phase::Connecting { conn: c, .. } if *c == conn => self.failed(false, false, now),
            Phase::Session(s) if s.conn == conn => {
                let (registered, addr) = (s.registered, s.addr);
                if registered {
                    warn!(
                        "PE {:#010x}: lost registrar {addr}: connection closed",
                        self.id
                    );
                } else {
                    let why = if self.cfg.tls.is_some() {
                        "it closed the connection before answering the registration: does it \
                         trust this PE's certificate (signed by its CA)?"
                    } else {
                        "it closed the connection before answering the registration: one that \
                         runs TLS closes a PE without it (tls-cert, tls-key, tls-ca)"
                    };
                    self.unreachable(addr, why);
                }
                self.failed(registered, false, now);
            }
            Phase::Deregistering { conn: c, .. } if *c == conn => self.deregistered(false, now),
            _ => {}
        }
    }

    /// A connection asked for with [`Action::Connect`] could not be opened (`why`, for the
    /// log).
    pub fn handle_connect_error(&mut self, conn: ConnId, why: &str, now: Instant) {
        if let Phase::Connecting { conn: c, addr, .. } = &self.phase
            && *c == conn
        {
            let addr = *addr;
            self.unreachable(addr, why);
        }
        self.handle_close(conn, now);
    }

    /// Says that registrar `addr` cannot be reached, once until a registration (then at debug
    /// level).
    fn unreachable(&mut self, addr: SocketAddr, why: &str) {
        if self.unreachable_said {
            debug!("PE {:#010x}: registrar {addr}: {why}", self.id);
            return;
        }
        self.unreachable_said = true;
        // Over SCTP a wrong address, port or encapsulation port looks like silence.
        let hint = match self.cfg.registrar_schemes.get(&addr) {
            Some(Scheme::SctpUdp { udp_port }) => format!(
                " — over SCTP in UDP (port {udp_port}): check the registrar's SCTP port and \
                 that it listens on SCTP at all"
            ),
            Some(Scheme::Sctp) => {
                " — over SCTP: check the registrar's SCTP port and that it listens on SCTP at all"
                    .to_owned()
            }
            _ => String::new(),
        };
        warn!(
            "PE {:#010x}: registrar {addr} cannot be reached ({why}{hint}); not registered, \
             trying again with back-off (said once until a registration)",
            self.id
        );
    }

    /// Bytes read from a connection.
    pub fn handle_data(&mut self, conn: ConnId, data: &[u8], now: Instant) {
        let (msgs, err) = self.out.messages(conn, data);
        for m in msgs {
            if !self.out.is_open(conn) {
                return;
            }
            self.dispatch(conn, m, now);
        }
        if let Some(e) = err
            && self.out.is_open(conn)
        {
            debug!("PE {:#010x}: bad message on {conn}: {e}", self.id);
            // The driver is asked to close it and does not report back: handle the loss now.
            self.out.close(conn);
            self.lost(conn, now);
        }
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout) has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let phase = match &self.phase {
            Phase::Waiting { until, .. } => Some(*until),
            Phase::Connecting { deadline, .. } | Phase::Deregistering { deadline, .. } => {
                Some(*deadline)
            }
            Phase::Session(s) => earliest([s.pending, Some(s.rereg_at)]),
            Phase::Inactive | Phase::Stopped => None,
        };
        earliest([phase, self.offers.values().map(|o| o.deadline).min()])
    }

    /// Runs what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let late: Vec<ConnId> = self
            .offers
            .iter()
            .filter(|(_, o)| o.deadline <= now)
            .map(|(c, _)| *c)
            .collect();
        for c in late {
            if let Some(o) = self.offers.remove(&c) {
                debug!("PE {:#010x}: {} is not a takeover; closed", self.id, o.peer);
                self.out.close(c);
            }
        }
        match &mut self.phase {
            Phase::Waiting {
                until,
                for_takeover,
            } if *until <= now => {
                if *for_takeover {
                    info!(
                        "PE {:#010x}: no registrar took over within {:?}: registering again",
                        self.id, self.cfg.takeover_wait
                    );
                    self.backoff = self.cfg.backoff_min;
                    self.back_off(now);
                } else {
                    self.attempt(now);
                }
            }
            Phase::Connecting {
                conn,
                addr,
                deadline,
            } if *deadline <= now => {
                let (conn, addr) = (*conn, *addr);
                let why = if self.cfg.tls.is_some() {
                    "no connection within the connect timeout; this PE runs TLS, and a \
                     registrar without it does not answer its handshake"
                } else {
                    "no connection within the connect timeout"
                };
                self.unreachable(addr, why);
                self.out.close(conn);
                self.failed(false, false, now);
            }
            Phase::Session(s) => {
                if s.pending.is_some_and(|p| p <= now) {
                    warn!(
                        "PE {:#010x}: registrar {} did not answer within {:?}",
                        self.id, s.addr, self.cfg.response_timeout
                    );
                    let (conn, registered) = (s.conn, s.registered);
                    self.out.close(conn);
                    self.failed(registered, false, now);
                } else if s.rereg_at <= now {
                    s.rereg_at = now + self.cfg.reregistration_interval;
                    if s.pending.is_none() {
                        s.pending = Some(now + self.cfg.response_timeout);
                    }
                    let (conn, msg) = (s.conn, self.registration());
                    self.out.send(conn, &msg);
                }
            }
            Phase::Deregistering { conn, deadline } if *deadline <= now => {
                let conn = *conn;
                self.out.close(conn);
                self.deregistered(false, now);
            }
            _ => {}
        }
    }

    /// The next thing for the driver to do.
    pub fn poll_action(&mut self) -> Option<Action<PeEvent>> {
        self.out.poll()
    }

    fn set_state(&mut self, s: PeState) {
        if matches!(s, PeState::Registered { .. }) {
            self.unreachable_said = false;
        }
        if self.state != s {
            self.state = s.clone();
            self.out.event(PeEvent::State(s));
        }
    }

    fn registration(&self) -> AsapMessage {
        AsapMessage::Registration {
            pool_handle: self.cfg.pool_handle.clone(),
            pool_element: rserpool_wire::PoolElement {
                id: self.id,
                home_registrar: 0,
                registration_life: self.cfg.registration_life(),
                user_transport: UserTransport::Address(self.service_transport()),
                policy: self.sent_policy.clone(),
                asap_transport: self.asap_transport.map(TransportAddress::tcp),
            },
        }
    }

    /// Connects to the next registrar known.
    fn attempt(&mut self, now: Instant) {
        if !matches!(self.state, PeState::Rejected(_)) {
            self.set_state(PeState::Registering);
        }
        let candidates = self.registrars.candidates(now);
        if candidates.is_empty() {
            debug!("PE {:#010x}: no registrar known yet", self.id);
            self.failed(false, false, now);
            return;
        }
        let addr = candidates[self.next % candidates.len()];
        self.next = self.next.wrapping_add(1);
        let conn = self.out.connect(addr);
        self.phase = Phase::Connecting {
            conn,
            addr,
            deadline: now + self.cfg.connect_timeout,
        };
    }

    /// Starts an association over `conn`; `adopted` names the home that took over and whether
    /// to register over it at once.
    fn start_session(
        &mut self,
        conn: ConnId,
        addr: SocketAddr,
        adopted: Option<(u32, bool)>,
        now: Instant,
    ) {
        // The new home has the PE as last replicated; without news it carries on with that.
        let refresh = match adopted {
            Some((home, refresh)) => {
                self.set_state(PeState::Registered {
                    registrar: addr,
                    home,
                });
                refresh || self.policy != self.sent_policy
            }
            None => true,
        };
        let mut s = Session {
            conn,
            addr,
            registered: adopted.is_some(),
            adopted: adopted.is_some(),
            home: adopted.map_or(0, |(home, _)| home),
            pending: None,
            rereg_at: now + self.cfg.reregistration_interval,
        };
        if refresh {
            self.sent_policy = self.policy.clone();
            self.out.send(conn, &self.registration());
            s.pending = Some(now + self.cfg.response_timeout);
        }
        self.phase = Phase::Session(s);
    }

    fn dispatch(&mut self, conn: ConnId, msg: AsapMessage, now: Instant) {
        if self.offers.contains_key(&conn) {
            self.offer(conn, msg, now);
            return;
        }
        if self.claim.as_ref().is_some_and(|c| c.conn == conn) {
            // The claimant's keep-alives are answered while the home is asked.
            if let AsapMessage::EndpointKeepAlive { pool_handle, .. } = msg {
                let ack = AsapMessage::EndpointKeepAliveAck {
                    pool_handle,
                    pe_id: self.id,
                };
                self.out.send(conn, &ack);
            }
            return;
        }
        match &mut self.phase {
            Phase::Session(s) if s.conn == conn => self.in_session(msg, now),
            Phase::Deregistering { conn: c, .. } if *c == conn => {
                if let AsapMessage::DeregistrationResponse { pe_id, .. } = msg
                    && pe_id == self.id
                {
                    self.out.close(conn);
                    self.deregistered(true, now);
                }
            }
            _ => {}
        }
    }

    /// The first message on a connection to the takeover address: it must be an
    /// ENDPOINT_KEEP_ALIVE with the H bit for this PE; anything else closes the connection.
    fn offer(&mut self, conn: ConnId, msg: AsapMessage, now: Instant) {
        let Some(o) = self.offers.remove(&conn) else {
            return;
        };
        match msg {
            AsapMessage::EndpointKeepAlive {
                home: true,
                server_id,
                pool_handle,
                pe_id,
            } if pool_handle == self.cfg.pool_handle && pe_id.is_none_or(|p| p == self.id) => {
                let ack = AsapMessage::EndpointKeepAliveAck {
                    pool_handle,
                    pe_id: self.id,
                };
                self.out.send(conn, &ack);
                if self.home_is_up(now) {
                    self.check_claim(conn, o.peer, server_id, now);
                } else {
                    self.adopt(conn, o.peer, server_id, now);
                }
            }
            _ => {
                debug!("PE {:#010x}: {} is not a takeover; closed", self.id, o.peer);
                self.out.close(conn);
            }
        }
    }

    /// Whether the PE is registered over an association it did not get after losing its home:
    /// a takeover now claims a home that is not gone.
    fn home_is_up(&self, now: Instant) -> bool {
        matches!(&self.phase, Phase::Session(s) if s.registered)
            && self
                .lost_home
                .is_none_or(|l| l.race_until.is_some_and(|u| now >= u))
    }

    /// A takeover by `home` at `peer` while the home association is up: the home is asked (a
    /// registration over it) before the PE moves. A newer claim replaces an older one.
    fn check_claim(&mut self, conn: ConnId, peer: SocketAddr, home: u32, now: Instant) {
        if let Some(old) = self.claim.take() {
            self.out.close(old.conn);
        }
        let Phase::Session(s) = &mut self.phase else {
            return;
        };
        let logged = match &mut self.claims_logged {
            Some((at, since)) if now < *at + CLAIM_LOG_EVERY => {
                *since += 1;
                false
            }
            last => {
                let since = last.map_or(0, |(_, n)| n);
                let more = if since > 0 {
                    format!(" ({since} more claims in the last minute, not logged)")
                } else {
                    String::new()
                };
                info!(
                    "PE {:#010x}: registrar {home:#010x} at {peer} claims to take over while home \
                     {:#010x} at {} is up: asking the home first{more}",
                    self.id, s.home, s.addr
                );
                *last = Some((now, 0));
                true
            }
        };
        if s.pending.is_none() {
            s.pending = Some(now + self.cfg.response_timeout);
            let (c, msg) = (s.conn, self.registration());
            self.out.send(c, &msg);
        }
        self.claim = Some(Claim {
            conn,
            peer,
            home,
            logged,
        });
    }

    /// Registrar `home` at `peer` took over as home over `conn` (its H-bit keep-alive answered).
    fn adopt(&mut self, conn: ConnId, peer: SocketAddr, home: u32, now: Instant) {
        // Whether to register over the new home at once: only when the takeover cuts short an
        // association the PE registered over by itself after losing its home, since that
        // registrar told its peers it is home.
        let refresh = match &self.phase {
            Phase::Inactive | Phase::Stopped | Phase::Deregistering { .. } => {
                debug!(
                    "PE {:#010x}: inactive: takeover by registrar {home:#010x} closed",
                    self.id
                );
                self.out.close(conn);
                return;
            }
            Phase::Waiting { .. } => false,
            Phase::Connecting { conn: c, .. } => {
                let c = *c;
                self.out.close(c);
                false
            }
            Phase::Session(s) => {
                let (c, cut_short) = (s.conn, !s.adopted);
                self.out.close(c);
                cut_short && self.lost_home.is_some()
            }
        };
        self.lost_home = None;
        info!(
            "PE {:#010x}: taken over by registrar {home:#010x} at {peer}; home now",
            self.id
        );
        self.out.event(PeEvent::TakenOver {
            registrar: peer,
            home,
        });
        self.start_session(conn, peer, Some((home, refresh)), now);
    }

    fn in_session(&mut self, msg: AsapMessage, now: Instant) {
        let id = self.id;
        let Phase::Session(s) = &mut self.phase else {
            return;
        };
        let (conn, addr) = (s.conn, s.addr);
        match msg {
            AsapMessage::EndpointKeepAlive {
                home: h, server_id, ..
            } => {
                if server_id != s.home {
                    if h {
                        info!(
                            "PE {id:#010x}: taken over by registrar {server_id:#010x} at {addr}; home now"
                        );
                    }
                    s.home = server_id;
                    if s.registered {
                        let st = PeState::Registered {
                            registrar: addr,
                            home: server_id,
                        };
                        self.set_state(st);
                    }
                }
                let ack = AsapMessage::EndpointKeepAliveAck {
                    pool_handle: self.cfg.pool_handle.clone(),
                    pe_id: id,
                };
                self.out.send(conn, &ack);
            }
            AsapMessage::RegistrationResponse {
                reject,
                pe_id,
                error,
                ..
            } if pe_id == id => {
                s.pending = None;
                if reject {
                    let why = error
                        .and_then(|e| e.causes.first().map(|c| c.code.to_string()))
                        .unwrap_or_else(|| "no reason given".into());
                    warn!(
                        "PE {id:#010x}: registration in pool {} refused by {addr}: {why}",
                        self.cfg.pool_handle
                    );
                    let registered = s.registered;
                    self.set_state(PeState::Rejected(why));
                    self.out.close(conn);
                    self.failed(registered, true, now);
                    return;
                }
                if !s.registered {
                    s.registered = true;
                    info!(
                        "PE {id:#010x}: registered in pool {} at {addr}",
                        self.cfg.pool_handle
                    );
                }
                let home = s.home;
                if let Some(c) = self.claim.take() {
                    // The home's identifier is known from its first keep-alive on.
                    let known = if home == 0 {
                        String::new()
                    } else {
                        format!(" {home:#010x}")
                    };
                    if c.logged {
                        warn!(
                            "PE {id:#010x}: takeover by registrar {:#010x} at {} refused: home \
                             registrar{known} at {addr} answers",
                            c.home, c.peer
                        );
                    }
                    self.out.close(c.conn);
                }
                self.set_state(PeState::Registered {
                    registrar: addr,
                    home,
                });
                if let Some(l) = &mut self.lost_home {
                    if l.registrar == addr {
                        // Back with the home it lost: no takeover of another to race.
                        self.lost_home = None;
                    } else if l.race_until.is_none() {
                        l.race_until = Some(now + TAKEOVER_RACE);
                    }
                }
            }
            AsapMessage::DeregistrationResponse { pe_id, .. } if pe_id == id => {
                // The registration life ran out at the registrar: register again.
                s.pending = Some(now + self.cfg.response_timeout);
                self.out.send(conn, &self.registration());
            }
            AsapMessage::Error { error } => {
                let causes: Vec<String> = error.causes.iter().map(|c| c.code.to_string()).collect();
                warn!(
                    "PE {id:#010x}: registrar {addr} reports: {}",
                    causes.join(", ")
                );
            }
            other => debug!("PE {id:#010x}: ignored {} from {addr}", other.name()),
        }
    }

    /// `conn` is gone without the driver's report (bad input).
    fn lost(&mut self, conn: ConnId, now: Instant) {
        self.offers.remove(&conn);
        if self.claim.as_ref().is_some_and(|c| c.conn == conn) {
            self.claim = None;
        }
        match &self.phase {
            Phase::Session(s) if s.conn == conn => {
                let registered = s.registered;
                if registered {
                    warn!(
                        "PE {:#010x}: lost registrar {}: bad message",
                        self.id, s.addr
                    );
                }
                self.failed(registered, false, now);
            }
            Phase::Deregistering { conn: c, .. } if *c == conn => self.deregistered(false, now),
            _ => {}
        }
    }

    /// The association failed (`registered`: the PE was registered over it; `rejected`: its
    /// registration was refused).
    fn failed(&mut self, registered: bool, rejected: bool, now: Instant) {
        if registered {
            if let Phase::Session(s) = &self.phase {
                let registrar = s.addr;
                self.out.event(PeEvent::LostHome { registrar });
                self.lost_home = Some(LostHome {
                    registrar,
                    race_until: None,
                });
            }
            // A takeover claimed while the home was up was real: the home did not answer.
            if let Some(c) = self.claim.take()
                && self.out.is_open(c.conn)
            {
                self.phase = Phase::Waiting {
                    until: now + self.cfg.takeover_wait,
                    for_takeover: true,
                };
                self.adopt(c.conn, c.peer, c.home, now);
                return;
            }
            // Another registrar may take over. Before registering with another one (if any is
            // known), give it time to; a takeover is adopted at any time.
            let known = self.registrars.candidates(now).len();
            if known > 1 && !self.cfg.takeover_wait.is_zero() && self.asap_transport.is_some() {
                self.phase = Phase::Waiting {
                    until: now + self.cfg.takeover_wait,
                    for_takeover: true,
                };
                return;
            }
            self.backoff = self.cfg.backoff_min;
        } else if rejected {
            self.backoff = self.cfg.backoff_max;
        }
        self.back_off(now);
    }

    fn back_off(&mut self, now: Instant) {
        let wait = jitter(self.backoff, &mut *self.rng);
        self.backoff = (self.backoff * 2).min(self.cfg.backoff_max);
        self.phase = Phase::Waiting {
            until: now + wait,
            for_takeover: false,
        };
    }

    /// Moves toward what the application asks for after [`set_active`](Self::set_active) or
    /// [`stop`](Self::stop).
    fn follow_wishes(&mut self, now: Instant) {
        if self.stop || !self.active {
            match &self.phase {
                Phase::Session(s) => {
                    let conn = s.conn;
                    let msg = AsapMessage::Deregistration {
                        pool_handle: self.cfg.pool_handle.clone(),
                        pe_id: self.id,
                    };
                    self.out.send(conn, &msg);
                    self.phase = Phase::Deregistering {
                        conn,
                        deadline: now + self.cfg.response_timeout,
                    };
                }
                Phase::Connecting { conn, .. } => {
                    let conn = *conn;
                    self.out.close(conn);
                    self.idle();
                }
                Phase::Waiting { .. } | Phase::Inactive => self.idle(),
                Phase::Deregistering { .. } | Phase::Stopped => {}
            }
        } else if matches!(self.phase, Phase::Inactive) {
            self.attempt(now);
        }
    }

    /// The deregistration ended (`answered`: the registrar confirmed it).
    fn deregistered(&mut self, answered: bool, now: Instant) {
        if answered {
            info!(
                "PE {:#010x}: deregistered from pool {}",
                self.id, self.cfg.pool_handle
            );
        }
        self.idle();
        // Asked to register again meanwhile.
        if !self.stop && self.active {
            self.attempt(now);
        }
    }

    /// Not registered on purpose: inactive, or stopped for good.
    fn idle(&mut self) {
        // Deregistered: no home to lose, no takeover to follow.
        self.lost_home = None;
        self.backoff = self.cfg.backoff_min;
        if self.stop {
            self.phase = Phase::Stopped;
            for c in std::mem::take(&mut self.offers).into_keys() {
                self.out.close(c);
            }
            if let Some(c) = self.claim.take() {
                self.out.close(c.conn);
            }
            self.set_state(PeState::Stopped);
        } else {
            self.phase = Phase::Inactive;
            self.set_state(PeState::Inactive);
        }
    }
}
