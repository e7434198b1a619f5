//! A pool element: registers a service under a pool handle and keeps it registered.
//!
//! The protocol (registration, keep-alives, takeover adoption, back-off) is the sans-IO
//! [`PeCore`]; its module docs say what it does. This is its tokio driver: a background task
//! owns the core, the registrar connections, the takeover listener (the PE's ASAP transport,
//! where a registrar taking over connects) and the announce listener, and carries out the
//! core's actions. [`PeUpdater`] passes the application's wishes (policy,
//! activity) to the task.
//!
//! [`PoolElement::stop`] deregisters and returns once the registrar has been told. Dropping
//! the [`PoolElement`] deregisters too, from its background task, which needs the tokio
//! runtime to run on: a program that ends right after (returning from `main`) should `stop`
//! instead, or the registrar only sees the connection close (and removes the PE as gone).
//! [`PoolElement::hand_over`] gives the registration to the process that replaces this one
//! instead ([`PoolElement::from_hand_over`]), so that the PE stays in its pool across an
//! upgrade.

use crate::Error;
use crate::core::pe::{HandedOver, PeCore, PeEvent};
use crate::driver::{Conns, sleep_until};
use rserpool_wire::Policy;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, warn};

pub use crate::core::pe::{PeState, PoolElementConfig};

#[derive(Debug, Clone)]
struct Desired {
    active: bool,
    policy: Policy,
    stop: bool,
}

/// A registered pool element; see the module docs.
pub struct PoolElement {
    id: u32,
    updater: PeUpdater,
    state: watch::Receiver<PeState>,
    task: Option<tokio::task::JoinHandle<()>>,
    hand_over: mpsc::UnboundedSender<HandOverAsk>,
}

/// The registration association as given away: its state and its socket.
pub type Association = (HandedOver, std::net::TcpStream);

/// Asks the driver for the association.
type HandOverAsk = oneshot::Sender<Option<Association>>;

/// A cloneable handle that changes a PE's policy information or activity from other tasks.
#[derive(Clone)]
pub struct PeUpdater {
    desired: Arc<watch::Sender<Desired>>,
}

impl PeUpdater {
    /// Changes the policy information (e.g. a new load); sent as a re-registration at once.
    /// Updates made faster than the registrar round trip are coalesced.
    pub fn update_policy(&self, policy: Policy) {
        self.desired.send_if_modified(|d| {
            let changed = d.policy != policy;
            d.policy = policy;
            changed
        });
    }

    /// For adaptive policies: reports a load (0.0 idle ..= 1.0 full). False, and nothing
    /// sent, when the PE's policy carries no load (round robin, weighted ones, credits).
    pub fn update_load(&self, fraction: f64) -> bool {
        let policy = self.desired.borrow().policy.clone();
        if policy.load().is_none() {
            return false;
        }
        let load = rserpool_wire::policy::load_from_fraction(fraction);
        self.update_policy(policy.with_load(load));
        true
    }

    /// Deregisters (false) or registers again (true), keeping the PE identifier.
    pub fn set_active(&self, active: bool) {
        self.desired.send_if_modified(|d| {
            let changed = d.active != active;
            d.active = active;
            changed
        });
    }

    /// The policy currently asked for.
    pub fn policy(&self) -> Policy {
        self.desired.borrow().policy.clone()
    }
}

impl PoolElement {
    /// Starts registering in the background (needs a tokio runtime).
    pub fn start(cfg: PoolElementConfig) -> std::io::Result<Self> {
        Self::spawn(cfg, None)
    }

    /// Carries on with a registration association another process gave away with
    /// [`hand_over`](Self::hand_over) (needs a tokio runtime): the PE of `cfg` with the
    /// identifier of `association`, registered all along.
    pub fn from_hand_over(
        cfg: PoolElementConfig,
        association: Association,
    ) -> std::io::Result<Self> {
        Self::spawn(cfg, Some(association))
    }

    fn spawn(cfg: PoolElementConfig, handed: Option<Association>) -> std::io::Result<Self> {
        let takeover = cfg
            .takeover_listen
            .map(|a| towards_registrars(a, &cfg.registrars));
        let listener = takeover.and_then(|addr| match listen(addr) {
            Ok(l) => Some(l),
            Err(e) => {
                warn!("PE: no takeover listener on {addr}: {e}");
                None
            }
        });
        let asap_transport = listener.as_ref().and_then(|l| l.local_addr().ok());
        let conns = Conns::new(
            cfg.announce_listen,
            cfg.tls.clone(),
            cfg.registrar_schemes.clone(),
        )?;
        let desired = Desired {
            active: cfg.initially_active,
            policy: cfg.policy.clone(),
            stop: false,
        };
        let mut conns = conns;
        let rng = crate::os_seeded_rng();
        let core = match handed {
            None => PeCore::new(cfg, asap_transport, rng, conns.now()),
            Some((h, stream)) => {
                stream.set_nonblocking(true)?;
                let stream = tokio::net::TcpStream::from_std(stream)?;
                let now = conns.now();
                let (mut core, conn) = PeCore::from_hand_over(cfg, asap_transport, rng, &h, now);
                conns.adopt(conn, stream);
                if !h.unread.is_empty() {
                    core.handle_data(conn, &h.unread, now);
                }
                core
            }
        };
        let id = core.id();
        let (hand_over, asks) = mpsc::unbounded_channel();
        let (desired_tx, desired_rx) = watch::channel(desired);
        let (state_tx, state_rx) = watch::channel(core.state().clone());
        let task = tokio::spawn(
            Driver {
                core,
                conns,
                desired: desired_rx,
                state: state_tx,
                asks,
            }
            .run(listener),
        );
        Ok(Self {
            id,
            updater: PeUpdater {
                desired: Arc::new(desired_tx),
            },
            state: state_rx,
            task: Some(task),
            hand_over,
        })
    }

    /// Gives the registration association away, for the process that replaces this one
    /// ([`from_hand_over`](Self::from_hand_over)): the PE stops here without deregistering.
    /// `None` (and the PE carries on) unless it is registered over plain TCP: a TLS session
    /// cannot move to another process, so with TLS the successor registers anew.
    pub async fn hand_over(&self) -> Option<Association> {
        let (tx, rx) = oneshot::channel();
        self.hand_over.send(tx).ok()?;
        rx.await.ok().flatten()
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn state(&self) -> PeState {
        self.state.borrow().clone()
    }

    /// A receiver that sees every state change.
    pub fn watch_state(&self) -> watch::Receiver<PeState> {
        self.state.clone()
    }

    /// A handle for changing the policy information from elsewhere.
    pub fn updater(&self) -> PeUpdater {
        self.updater.clone()
    }

    /// Waits until registered; returns the registrar's address. A registration a registrar
    /// refuses (an inconsistent pooling policy, say) ends the wait with
    /// [`Error::RegistrationRefused`] (the PE keeps trying after its back-off); none in time
    /// with [`Error::Timeout`].
    pub async fn wait_registered(&self, timeout: Duration) -> Result<SocketAddr, Error> {
        let mut rx = self.state.clone();
        let wait = rx.wait_for(|s| matches!(s, PeState::Registered { .. } | PeState::Rejected(_)));
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(s)) => match &*s {
                PeState::Registered { registrar, .. } => Ok(*registrar),
                PeState::Rejected(why) => Err(Error::RegistrationRefused(why.clone())),
                _ => Err(Error::Closed),
            },
            Ok(Err(_)) => Err(Error::Closed),
            Err(_) => Err(Error::Timeout),
        }
    }

    /// See [`PeUpdater::update_policy`].
    pub fn update_policy(&self, policy: Policy) {
        self.updater.update_policy(policy);
    }

    /// See [`PeUpdater::update_load`].
    pub fn update_load(&self, fraction: f64) -> bool {
        self.updater.update_load(fraction)
    }

    /// See [`PeUpdater::set_active`].
    pub fn set_active(&self, active: bool) {
        self.updater.set_active(active);
    }

    /// Deregisters and ends the background task.
    pub async fn stop(mut self) {
        self.updater.desired.send_modify(|d| d.stop = true);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for PoolElement {
    fn drop(&mut self) {
        // The task sees the stop and deregisters on its own.
        self.updater.desired.send_modify(|d| d.stop = true);
    }
}

/// Where the takeover listener binds: a wildcard address becomes the local address the PE
/// reaches its first registrar from (the route's source), so that the listener is not open on
/// every interface of the host (RFC 5355 §3.1); a wildcard stays when no registrar is
/// configured (found by SERVER_ANNOUNCE) or no route is known.
fn towards_registrars(addr: SocketAddr, registrars: &[SocketAddr]) -> SocketAddr {
    if !addr.ip().is_unspecified() {
        return addr;
    }
    let Some(reg) = registrars.iter().find(|r| r.is_ipv4() == addr.is_ipv4()) else {
        return addr;
    };
    // Connecting a UDP socket sends nothing; it only picks the route and its source address.
    let local = std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0))
        .and_then(|u| u.connect(reg).and_then(|()| u.local_addr()));
    match local {
        Ok(l) => SocketAddr::new(l.ip(), addr.port()),
        Err(_) => addr,
    }
}

/// The takeover listener (SO_REUSEADDR, as tokio's own bind).
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    tokio::net::TcpListener::from_std(sock.into())
}

/// Accepts connections to the takeover address for the driver until the receiver is gone.
async fn accept_takeovers(
    listener: tokio::net::TcpListener,
    tx: mpsc::Sender<(tokio::net::TcpStream, SocketAddr)>,
) {
    loop {
        match listener.accept().await {
            Ok(s) => {
                if tx.send(s).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                debug!("takeover listener: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The background task: the core and its I/O.
struct Driver {
    core: PeCore,
    conns: Conns,
    desired: watch::Receiver<Desired>,
    state: watch::Sender<PeState>,
    asks: mpsc::UnboundedReceiver<HandOverAsk>,
}

impl Driver {
    async fn run(mut self, listener: Option<tokio::net::TcpListener>) {
        let (accepted_tx, mut accepted) = mpsc::channel(4);
        let _accepting = listener.map(|l| Guard(tokio::spawn(accept_takeovers(l, accepted_tx))));
        let mut sctp_takeovers = self.conns.take_sctp_takeovers();
        loop {
            self.carry_out();
            if self.core.is_stopped() {
                return;
            }
            let deadline = self.conns.deadline(self.core.poll_timeout());
            tokio::select! {
                e = self.conns.next() => self.conns.feed(e, &mut self.core),
                Some((stream, peer)) = accepted.recv() => {
                    let now = self.now();
                    let c = self.core.accept(peer, now);
                    self.conns.adopt(c, stream);
                }
                Some(a) = sctp_takeovers.recv() => {
                    let now = self.now();
                    let c = self.core.accept(a.peer(), now);
                    self.conns.adopt_sctp(c, a);
                }
                r = self.desired.changed() => {
                    let now = self.now();
                    let d = match r {
                        Ok(()) => self.desired.borrow_and_update().clone(),
                        Err(_) => Desired { active: false, policy: self.core.policy().clone(), stop: true },
                    };
                    if d.stop {
                        self.core.stop(now);
                    } else {
                        self.core.update_policy(d.policy, now);
                        self.core.set_active(d.active, now);
                    }
                }
                () = sleep_until(deadline) => {
                    let now = self.now();
                    self.core.handle_timeout(now);
                }
                Some(ask) = self.asks.recv() => {
                    let _ = ask.send(self.hand_over().await);
                }
            }
        }
    }

    /// Takes the registration association back from its task and gives it away with the
    /// core's state (see [`PeCore::hand_over`]).
    async fn hand_over(&mut self) -> Option<Association> {
        let conn = self.core.registered_conn()?;
        // Released first: the core acts on nothing meanwhile, so all it sent is written and
        // all that was read and not yet handed to it comes back as `unread`.
        let (stream, more) = self.conns.release(conn).await?;
        let (_, mut h) = self.core.hand_over()?;
        h.unread.extend_from_slice(&more);
        self.carry_out();
        let stream = stream.into_std().ok()?;
        // Blocking again, as a descriptor passed to another process is expected to be.
        stream.set_nonblocking(false).ok()?;
        Some((h, stream))
    }

    fn now(&mut self) -> rserpool_wire::Instant {
        self.conns.now_for(&mut self.core)
    }

    fn carry_out(&mut self) {
        while let Some(a) = self.core.poll_action() {
            if let Some(PeEvent::State(s)) = self.conns.carry_out(a) {
                self.state.send_replace(s);
            }
        }
    }
}

/// Aborts a task when dropped.
struct Guard(tokio::task::JoinHandle<()>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PoolElement {
    /// Sends rsplib's Component Status reports (`rserpool_wire::csp`) about this PE to the
    /// monitor at `monitor` (rsplib's `cspmonitor`, UDP 2960) every `interval`, until the PE
    /// stops, which the last report says. `transport` is where pool users reach it (the
    /// report's location). The PE reports as rsplib's do: its identifier, whether it is
    /// registered and with which registrar (also as an association), and its load where its
    /// policy carries one.
    pub fn report_status(&self, monitor: SocketAddr, interval: Duration, transport: SocketAddr) {
        use rserpool_wire::csp::{Association, Component, PPID_ASAP, PROTOCOL_TCP, Report};
        let state = self.state.clone();
        let desired = self.updater.desired.subscribe();
        let sender = Component::PoolElement.id(u64::from(self.id));
        let location = rserpool_wire::csp::location(&rserpool_wire::csp::host_name(), &[transport]);
        let who = format!("PE {:#010x}", self.id);
        crate::csp::spawn_reports(monitor, interval, who, move |uptime_us, interval_us| {
            let now = state.borrow().clone();
            // Stopped, or the PE is gone (its driver task dropped the state).
            if now == PeState::Stopped || state.has_changed().is_err() {
                return Report::last(sender, uptime_us, interval_us);
            }
            let (status, associations) = match &now {
                PeState::Registered { home, .. } => (
                    format!("Registered at registrar ${home:08x}"),
                    vec![Association {
                        peer: Component::Registrar.id(u64::from(*home)),
                        duration_us: None,
                        protocol: PROTOCOL_TCP,
                        ppid: PPID_ASAP,
                    }],
                ),
                PeState::Registering => ("Looking for Registrar ...".into(), Vec::new()),
                PeState::Inactive => ("Inactive (drained)".into(), Vec::new()),
                PeState::Rejected(why) => (format!("Registration refused: {why}"), Vec::new()),
                PeState::Stopped => (String::new(), Vec::new()),
            };
            Report {
                sender,
                uptime_us,
                interval_us,
                location: location.clone(),
                status,
                workload: desired
                    .borrow()
                    .policy
                    .load()
                    .map(rserpool_wire::policy::load_to_fraction),
                associations,
                last: false,
            }
        });
    }
}
