//! A pool element: registers a service under a pool handle and keeps it registered.
//!
//! A background task owns the registrar association. It registers, answers
//! ENDPOINT_KEEP_ALIVEs (adopting a new home registrar on the H bit), re-registers every
//! reregistration interval and whenever the policy changes (e.g. a new load), and when the
//! association fails it moves to the next registrar with exponential back-off and jitter.
//!
//! Takeover (RFC 5353 §3.5): the PE listens on a TCP port of its own and announces it as its
//! ASAP transport. When its home registrar dies, the registrar that takes over connects there
//! and sends ENDPOINT_KEEP_ALIVE with the H bit; the PE answers and carries on over that
//! connection as over a home association (keep-alives, re-registrations, deregistration),
//! without registering again. A PE that loses its home adopts such a takeover whenever one
//! arrives, however many registrars it knows: while it waits `takeover_wait` for one (when it
//! knows another registrar it could register with instead), while it backs off, and while it
//! connects or registers elsewhere. The last takeover wins. A takeover that cuts short a
//! registration made after the loss is followed by a registration over the new home, so that
//! the registrars agree on it again. Without a takeover it keeps trying the registrars it knows
//! (configured and announced) with back-off, and registers again once one is reachable.
//!
//! Dropping the [`PoolElement`] or calling [`PoolElement::stop`] deregisters.

use crate::connection::AsapConnection;
use crate::registrars::RegistrarSet;
use crate::{Error, jitter, random_u32};
use rserpool_wire::{AsapMessage, Policy, PoolHandle, TransportAddress, UserTransport};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

#[derive(Debug, Clone)]
pub struct PoolElementConfig {
    pub pool_handle: PoolHandle,
    /// Where pool users reach the service (TCP).
    pub transport: SocketAddr,
    pub policy: Policy,
    /// PE identifier; random when `None`.
    pub id: Option<u32>,
    pub registrars: Vec<SocketAddr>,
    /// Listen for SERVER_ANNOUNCE here (UDP; multicast groups are joined).
    pub announce_listen: Option<SocketAddr>,
    /// Re-registration interval (rsplib: 30 s). The registration life sent is three times it.
    pub reregistration_interval: Duration,
    pub connect_timeout: Duration,
    /// Time the registrar has to answer a (de)registration.
    pub response_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Register at start (false: wait for [`PeUpdater::set_active`]).
    pub initially_active: bool,
    /// Where registrars taking over reach this PE (TCP; port 0 picks one; a wildcard address
    /// means the address the PE connects to registrars from). `None`: no takeover.
    pub takeover_listen: Option<SocketAddr>,
    /// After losing its home registrar, time to wait for a takeover before registering with
    /// another one (only when another one is known). A takeover is adopted at any time.
    pub takeover_wait: Duration,
}

impl PoolElementConfig {
    pub fn new(pool_handle: impl Into<PoolHandle>, transport: SocketAddr, policy: Policy) -> Self {
        Self {
            pool_handle: pool_handle.into(),
            transport,
            policy,
            id: None,
            registrars: vec![SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))],
            announce_listen: None,
            reregistration_interval: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            initially_active: true,
            takeover_listen: Some(SocketAddr::from(([0, 0, 0, 0], 0))),
            takeover_wait: Duration::from_secs(5),
        }
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
    /// Not registered on purpose ([`PoolElement::set_active`]`(false)`).
    Inactive,
    /// Looking for a registrar or waiting for its answer.
    Registering,
    /// Registered; `home` is the home registrar's ID.
    Registered {
        registrar: SocketAddr,
        home: u32,
    },
    /// The last registration was refused; retrying after back-off.
    Rejected(String),
    Stopped,
}

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
    announce: Option<tokio::task::JoinHandle<()>>,
}

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

    /// For adaptive policies: reports a load (0.0 idle ..= 1.0 full).
    pub fn update_load(&self, fraction: f64) {
        let load = rserpool_wire::policy::load_from_fraction(fraction);
        let p = self.desired.borrow().policy.with_load(load);
        self.update_policy(p);
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
        let id = cfg.id.unwrap_or_else(random_u32);
        let registrars = RegistrarSet::new(cfg.registrars.clone());
        let announce = match cfg.announce_listen {
            Some(a) => Some(registrars.listen(a)?),
            None => None,
        };
        let (desired_tx, desired_rx) = watch::channel(Desired {
            active: cfg.initially_active,
            policy: cfg.policy.clone(),
            stop: false,
        });
        let (state_tx, state_rx) = watch::channel(PeState::Registering);
        let task = tokio::spawn(run(cfg, id, registrars, desired_rx, state_tx));
        Ok(Self {
            id,
            updater: PeUpdater {
                desired: Arc::new(desired_tx),
            },
            state: state_rx,
            task: Some(task),
            announce,
        })
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

    /// Waits until registered; returns the registrar's address.
    pub async fn wait_registered(&self, timeout: Duration) -> Result<SocketAddr, Error> {
        let mut rx = self.state.clone();
        let wait = rx.wait_for(|s| matches!(s, PeState::Registered { .. }));
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(s)) => match &*s {
                PeState::Registered { registrar, .. } => Ok(*registrar),
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
    pub fn update_load(&self, fraction: f64) {
        self.updater.update_load(fraction);
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
        if let Some(a) = self.announce.take() {
            a.abort();
        }
    }
}

enum SessionEnd {
    Stopped,
    Inactive,
    Failed {
        registered: bool,
        rejected: bool,
    },
    /// Another registrar took over as home over this new connection. `cut_short`: it ended an
    /// association over which the PE had registered by itself.
    TakenOver {
        takeover: Takeover,
        cut_short: bool,
    },
}

/// A connection from a registrar that took over as home (its ENDPOINT_KEEP_ALIVE with the H bit
/// already answered).
struct Takeover {
    conn: AsapConnection,
    home: u32,
}

/// Aborts a task when dropped.
struct TaskGuard(tokio::task::JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Accepts registrars taking over: the first message must be an ENDPOINT_KEEP_ALIVE with the
/// H bit for this PE, within a few seconds; anything else closes the connection.
async fn listen_for_takeovers(
    listener: tokio::net::TcpListener,
    pool_handle: PoolHandle,
    id: u32,
    tx: mpsc::Sender<Takeover>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!("PE {id:#010x}: takeover listener: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = pool_handle.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut conn = AsapConnection::from_stream(stream, peer);
            let first = tokio::time::timeout(Duration::from_secs(5), conn.recv()).await;
            match first {
                Ok(Ok(AsapMessage::EndpointKeepAlive {
                    home: true,
                    server_id,
                    pool_handle,
                    pe_id,
                })) if pool_handle == handle && pe_id.is_none_or(|p| p == id) => {
                    let ack = AsapMessage::EndpointKeepAliveAck {
                        pool_handle: handle,
                        pe_id: id,
                    };
                    if conn.send(&ack).await.is_ok() {
                        let _ = tx
                            .send(Takeover {
                                conn,
                                home: server_id,
                            })
                            .await;
                    }
                }
                _ => debug!("PE {id:#010x}: {peer} is not a takeover; closed"),
            }
        });
    }
}

/// Runs `fut` unless a registrar takes over first.
async fn unless_taken_over<T>(
    takeovers: &mut mpsc::Receiver<Takeover>,
    fut: impl Future<Output = T>,
) -> Result<T, Takeover> {
    tokio::select! {
        Some(t) = takeovers.recv() => Err(t),
        r = fut => Ok(r),
    }
}

/// Waits `d`, less if the PE is to stop or to go inactive. A takeover ends it at once.
async fn pause(
    desired: &mut watch::Receiver<Desired>,
    takeovers: &mut mpsc::Receiver<Takeover>,
    d: Duration,
) -> Result<(), Takeover> {
    let stop = async {
        loop {
            if desired.changed().await.is_err() {
                return;
            }
            let d = desired.borrow();
            if d.stop || !d.active {
                return;
            }
        }
    };
    unless_taken_over(takeovers, async {
        tokio::select! {
            () = tokio::time::sleep(d) => {}
            () = stop => {}
        }
    })
    .await
}

async fn run(
    cfg: PoolElementConfig,
    id: u32,
    registrars: Arc<RegistrarSet>,
    mut desired: watch::Receiver<Desired>,
    state: watch::Sender<PeState>,
) {
    let mut backoff = cfg.backoff_min;
    let mut next = 0usize;
    let (takeover_tx, mut takeovers) = mpsc::channel(4);
    let mut asap_transport = None;
    let mut _listener = None;
    if let Some(addr) = cfg.takeover_listen {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                asap_transport = l.local_addr().ok();
                let task = listen_for_takeovers(l, cfg.pool_handle.clone(), id, takeover_tx);
                _listener = Some(TaskGuard(tokio::spawn(task)));
            }
            Err(e) => warn!("PE {id:#010x}: no takeover listener on {addr}: {e}"),
        }
    }
    // A takeover to carry on with, and whether to register over it at once.
    let mut adopted: Option<(Takeover, bool)> = None;
    // The PE lost its home and has not been taken over since: a registration elsewhere may
    // race a takeover.
    let mut lost_home = false;
    let mut policy = cfg.policy.clone();
    loop {
        // Wait until we should be registered.
        loop {
            let d = desired.borrow_and_update().clone();
            if d.stop {
                state.send_replace(PeState::Stopped);
                return;
            }
            if d.active {
                break;
            }
            // Deregistered: no home to lose, no takeover to follow.
            adopted = None;
            lost_home = false;
            state.send_replace(PeState::Inactive);
            tokio::select! {
                r = desired.changed() => if r.is_err() {
                    state.send_replace(PeState::Stopped);
                    return;
                },
                Some(t) = takeovers.recv() => {
                    debug!("PE {id:#010x}: inactive: takeover by registrar {:#010x} closed", t.home);
                }
            }
        }
        if !matches!(*state.borrow(), PeState::Rejected(_)) {
            state.send_replace(PeState::Registering);
        }
        let candidates = registrars.candidates();
        let mut ctx = SessionCtx {
            cfg: &cfg,
            id,
            asap_transport,
            desired: &mut desired,
            state: &state,
            takeovers: &mut takeovers,
            policy: &mut policy,
        };
        let end = if let Some((t, refresh)) = adopted.take() {
            lost_home = false;
            adopted_session(&mut ctx, t, refresh).await
        } else if candidates.is_empty() {
            debug!("PE {id:#010x}: no registrar known yet");
            SessionEnd::Failed {
                registered: false,
                rejected: false,
            }
        } else {
            let addr = candidates[next % candidates.len()];
            next = next.wrapping_add(1);
            let connect = AsapConnection::connect(addr, cfg.connect_timeout);
            match unless_taken_over(ctx.takeovers, connect).await {
                Ok(Ok(conn)) => session(&mut ctx, conn, None).await,
                Ok(Err(e)) => {
                    debug!("PE {id:#010x}: registrar {addr}: {e}");
                    SessionEnd::Failed {
                        registered: false,
                        rejected: false,
                    }
                }
                Err(takeover) => SessionEnd::TakenOver {
                    takeover,
                    cut_short: false,
                },
            }
        };
        match end {
            SessionEnd::Stopped => {
                state.send_replace(PeState::Stopped);
                return;
            }
            SessionEnd::Inactive => backoff = cfg.backoff_min,
            SessionEnd::TakenOver {
                takeover,
                cut_short,
            } => {
                // Registered elsewhere while hunting: that registrar told its peers it is home.
                // A registration over the new home makes them agree again.
                adopted = Some((takeover, cut_short && lost_home));
            }
            SessionEnd::Failed {
                registered,
                rejected,
            } => {
                if registered {
                    lost_home = true;
                    // Another registrar may take over. Before registering with another one
                    // (if any is known), give it time to; a takeover is adopted at any time.
                    if candidates.len() > 1 && !cfg.takeover_wait.is_zero() && _listener.is_some() {
                        match pause(&mut desired, &mut takeovers, cfg.takeover_wait).await {
                            Err(t) => {
                                adopted = Some((t, false));
                                continue;
                            }
                            Ok(()) => {
                                let d = desired.borrow();
                                if d.stop || !d.active {
                                    continue;
                                }
                                info!(
                                    "PE {id:#010x}: no registrar took over within {:?}: registering again",
                                    cfg.takeover_wait
                                );
                            }
                        }
                    }
                    backoff = cfg.backoff_min;
                } else if rejected {
                    backoff = cfg.backoff_max;
                }
                let wait = jitter(backoff);
                backoff = (backoff * 2).min(cfg.backoff_max);
                if let Err(t) = pause(&mut desired, &mut takeovers, wait).await {
                    adopted = Some((t, false));
                }
            }
        }
    }
}

fn registration(
    cfg: &PoolElementConfig,
    id: u32,
    policy: &Policy,
    asap_transport: Option<SocketAddr>,
) -> AsapMessage {
    AsapMessage::Registration {
        pool_handle: cfg.pool_handle.clone(),
        pool_element: rserpool_wire::PoolElement {
            id,
            home_registrar: 0,
            registration_life: cfg.registration_life(),
            user_transport: UserTransport::Address(TransportAddress::tcp(cfg.transport)),
            policy: policy.clone(),
            asap_transport: asap_transport.map(TransportAddress::tcp),
        },
    }
}

/// What a session needs from the PE's task.
struct SessionCtx<'a> {
    cfg: &'a PoolElementConfig,
    id: u32,
    asap_transport: Option<SocketAddr>,
    desired: &'a mut watch::Receiver<Desired>,
    state: &'a watch::Sender<PeState>,
    takeovers: &'a mut mpsc::Receiver<Takeover>,
    /// The policy of the last registration sent, which the home registrar holds.
    policy: &'a mut Policy,
}

fn log_takeover(id: u32, home: u32, addr: SocketAddr) {
    info!("PE {id:#010x}: taken over by registrar {home:#010x} at {addr}; home now");
}

/// Carries on over a connection from a registrar that took over as home; `refresh`: registers
/// over it at once.
async fn adopted_session(ctx: &mut SessionCtx<'_>, t: Takeover, refresh: bool) -> SessionEnd {
    log_takeover(ctx.id, t.home, t.conn.peer());
    session(ctx, t.conn, Some((t.home, refresh))).await
}

/// One association with one registrar, from registration (or takeover, when `adopted` names
/// the new home and whether to register over it at once) to failure or stop.
async fn session(
    ctx: &mut SessionCtx<'_>,
    mut conn: AsapConnection,
    adopted: Option<(u32, bool)>,
) -> SessionEnd {
    let (cfg, id, state, asap_transport) = (ctx.cfg, ctx.id, ctx.state, ctx.asap_transport);
    let desired = &mut *ctx.desired;
    let takeovers = &mut *ctx.takeovers;
    let policy = &mut *ctx.policy;
    let addr = conn.peer();
    let failed = |registered, rejected| SessionEnd::Failed {
        registered,
        rejected,
    };
    let registration = |policy: &Policy| registration(cfg, id, policy, asap_transport);
    let mut registered = adopted.is_some();
    let mut home = adopted.map_or(0, |(home, _)| home);
    // Deadline for the answer to the registration in flight, if any.
    let mut pending = None;
    // The new home has the PE as last replicated; without news it carries on with that.
    let refresh = match adopted {
        Some((home, refresh)) => {
            state.send_replace(PeState::Registered {
                registrar: addr,
                home,
            });
            refresh || desired.borrow().policy != *policy
        }
        None => true,
    };
    if refresh {
        *policy = desired.borrow().policy.clone();
        if conn.send(&registration(policy)).await.is_err() {
            return failed(registered, false);
        }
        pending = Some(Instant::now() + cfg.response_timeout);
    }
    let mut rereg = tokio::time::interval_at(
        Instant::now() + cfg.reregistration_interval,
        cfg.reregistration_interval,
    );
    rereg.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let deadline = pending.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        tokio::select! {
            m = conn.recv() => match m {
                Ok(AsapMessage::EndpointKeepAlive { home: h, server_id, .. }) => {
                    if server_id != home {
                        if h {
                            log_takeover(id, server_id, addr);
                        }
                        home = server_id;
                        if registered {
                            state.send_replace(PeState::Registered { registrar: addr, home });
                        }
                    }
                    let ack = AsapMessage::EndpointKeepAliveAck {
                        pool_handle: cfg.pool_handle.clone(),
                        pe_id: id,
                    };
                    if conn.send(&ack).await.is_err() {
                        return failed(registered, false);
                    }
                }
                Ok(AsapMessage::RegistrationResponse { reject, pe_id, error, .. }) if pe_id == id => {
                    pending = None;
                    if reject {
                        let why = error
                            .and_then(|e| e.causes.first().map(|c| c.code.to_string()))
                            .unwrap_or_else(|| "no reason given".into());
                        warn!("PE {id:#010x}: registration in pool {} refused by {addr}: {why}", cfg.pool_handle);
                        state.send_replace(PeState::Rejected(why));
                        return failed(registered, true);
                    }
                    if !registered {
                        registered = true;
                        info!("PE {id:#010x}: registered in pool {} at {addr}", cfg.pool_handle);
                    }
                    let s = PeState::Registered { registrar: addr, home };
                    state.send_if_modified(|old| if *old != s { *old = s; true } else { false });
                }
                Ok(AsapMessage::DeregistrationResponse { pe_id, .. }) if pe_id == id => {
                    // The registration life ran out at the registrar: register again.
                    pending = Some(Instant::now() + cfg.response_timeout);
                    if conn.send(&registration(policy)).await.is_err() {
                        return failed(registered, false);
                    }
                }
                Ok(AsapMessage::Error { error }) => {
                    let causes: Vec<String> = error.causes.iter().map(|c| c.code.to_string()).collect();
                    warn!("PE {id:#010x}: registrar {addr} reports: {}", causes.join(", "));
                }
                Ok(other) => debug!("PE {id:#010x}: ignored {} from {addr}", other.name()),
                Err(e) => {
                    if registered {
                        warn!("PE {id:#010x}: lost registrar {addr}: {e}");
                    }
                    return failed(registered, false);
                }
            },
            Some(takeover) = takeovers.recv() => {
                // Our home was declared dead; the new one reached us first.
                return SessionEnd::TakenOver { takeover, cut_short: adopted.is_none() };
            }
            _ = rereg.tick() => {
                if pending.is_none() {
                    pending = Some(Instant::now() + cfg.response_timeout);
                }
                if conn.send(&registration(policy)).await.is_err() {
                    return failed(registered, false);
                }
            }
            r = desired.changed() => {
                let d = match r {
                    Ok(()) => desired.borrow_and_update().clone(),
                    Err(_) => Desired { active: false, policy: policy.clone(), stop: true },
                };
                if d.stop || !d.active {
                    deregister(cfg, id, &mut conn).await;
                    return if d.stop { SessionEnd::Stopped } else { SessionEnd::Inactive };
                }
                if d.policy != *policy {
                    *policy = d.policy;
                    if pending.is_none() {
                        pending = Some(Instant::now() + cfg.response_timeout);
                    }
                    if conn.send(&registration(policy)).await.is_err() {
                        return failed(registered, false);
                    }
                }
            }
            () = tokio::time::sleep_until(deadline), if pending.is_some() => {
                warn!("PE {id:#010x}: registrar {addr} did not answer within {:?}", cfg.response_timeout);
                return failed(registered, false);
            }
        }
    }
}

async fn deregister(cfg: &PoolElementConfig, id: u32, conn: &mut AsapConnection) {
    let msg = AsapMessage::Deregistration {
        pool_handle: cfg.pool_handle.clone(),
        pe_id: id,
    };
    if conn.send(&msg).await.is_err() {
        return;
    }
    let wait = async {
        loop {
            match conn.recv().await {
                Ok(AsapMessage::DeregistrationResponse { pe_id, .. }) if pe_id == id => return,
                Ok(_) => {}
                Err(_) => return,
            }
        }
    };
    if tokio::time::timeout(cfg.response_timeout, wait)
        .await
        .is_ok()
    {
        info!("PE {id:#010x}: deregistered from pool {}", cfg.pool_handle);
    }
}
