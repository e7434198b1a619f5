//! The RSerPool front-end proxy: unmodified clients reach a pool through it.
//!
//! It is a pool user (RFC 5351) that serves others: it keeps a copy of each pool it serves,
//! selects a PE locally by the pool's policy for every TCP connection or HTTP request, fails
//! over when a PE cannot be reached and tells the registrar.
//!
//! Its rooms (docs/ARCHITECTURE.md): [`balance`] which PE gets the work (pools, discovery,
//! selection, admission and service levels, PE state, the failover loop), [`http`] the HTTP
//! fronts, the version-neutral pipeline and the relays to PEs, [`l4`] connections carried
//! whole (TCP mode, splice(2), the kernel splice), [`tier`] membership of a proxy tier,
//! [`config`] the settings. This file holds [`Proxy`] (start, reload, drain) and the accept
//! loop; `ctx` is what a connection takes along, `routes` which pool serves a request,
//! `listener` the listening sockets.
//!
//! Operations: a connection limit (further clients wait in the listen backlog), timeouts,
//! [`Proxy::drain`] (stop accepting, finish what is in flight), [`Proxy::reload`] (listeners and
//! routes change, open connections keep going), an optional access log and a status
//! listener with per-PE counters as JSON.

mod access_log;
pub mod balance;
pub mod config;
mod csp;
mod ctx;
#[doc(hidden)]
pub mod fuzzing;
pub mod handover;
pub mod http;
pub mod l4;
mod listener;
pub mod metrics;
mod routes;
pub mod tier;
pub mod workers;

pub use balance::admit::LevelStats;
pub use balance::pools::{Pool, PoolSettings, Pools};
pub use config::{ListenerConfig, Mode, PoolConfig, ProxyConfig, Route, Select};
/// For tools that speak HTTP/2 as the proxy does (the benchmark's bare relay).
pub use http::h2::inflow::small_frame_budget;

use access_log::AccessLog;
use ctx::{Ctx, until_set};
use handover::Inherited;
use routes::Routes;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tracing::{info, warn};

/// What the status listener serves: the same JSON under each (`/stats` is the older name).
const STATUS_PATHS: &[&str] = &["/status", "/stats", "/", "/events", "/metrics"];

/// How long a proxy waits for its first view of the pools before it listens.
const FIRST_FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// The same for a proxy taking over from a running one, which serves meanwhile.
const HANDOVER_FETCH_TIMEOUT: Duration = Duration::from_secs(5);

struct Listener {
    local: SocketAddr,
    mode: Mode,
    config: ListenerConfig,
    ctx: Arc<RwLock<Arc<Ctx>>>,
    stop: watch::Sender<bool>,
    /// The listening socket (a second descriptor of it), for options a reload sets and for a
    /// hand-over.
    socket: std::net::TcpListener,
    /// Its connections are deferred until their first bytes (the accept loop reads it).
    deferred: Arc<std::sync::atomic::AtomicBool>,
}

/// The status listener: its configured address, a second descriptor of its socket (for a
/// hand-over) and what stops it.
struct StatusListener {
    configured: SocketAddr,
    socket: std::net::TcpListener,
    stop: watch::Sender<bool>,
}

struct Inner {
    pools: Arc<Pools>,
    cfg: RwLock<Arc<ProxyConfig>>,
    listeners: Mutex<HashMap<SocketAddr, Listener>>,
    status: Mutex<Option<StatusListener>>,
    conns: Arc<Semaphore>,
    /// Accept loops holding a permit of `conns` while they wait for a client (one each): not
    /// connections being served.
    accepting: Arc<std::sync::atomic::AtomicUsize>,
    max_conns: usize,
    draining: watch::Sender<bool>,
    log: RwLock<Option<AccessLog>>,
    /// The kernel splice's datapath, loaded when a listener first asks for it (at start or
    /// on a reload).
    kernel: RwLock<Option<Arc<l4::kernel::KernelSplice>>>,
    /// Membership of a proxy tier (`[tier]`), once joined.
    tier: RwLock<Option<Arc<tier::Tier>>>,
    /// HTTPS clients whose TLS handshake failed or timed out.
    tls_failures: Arc<std::sync::atomic::AtomicU64>,
    rejected: Arc<http::rejected::Rejected>,
    /// Where idle kept-alive connections wait without a task (`http::park`).
    park: Option<http::park::Parker>,
}

/// A running proxy. Its tasks run on the tokio runtime it was started on.
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("cannot open the access log {0}: {1}")]
    Log(String, std::io::Error),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("listener {0}: {1}")]
    Tls(SocketAddr, rserpool_tls::TlsError),
}

/// The longest a stopping tier member waits for the distributor to take it out of the group
/// before it closes its listeners.
const TIER_LEAVE_LIMIT: Duration = Duration::from_secs(5);

impl Proxy {
    /// Binds every listener (and the status listener) and starts serving.
    pub async fn start(cfg: ProxyConfig) -> Result<Proxy, StartError> {
        Self::start_with(cfg, Inherited::default()).await
    }

    /// [`start`](Self::start), listening on the sockets a running proxy handed over where
    /// their addresses are configured (binding the others); the rest are closed.
    pub async fn start_with(
        cfg: ProxyConfig,
        mut inherited: Inherited,
    ) -> Result<Proxy, StartError> {
        let mut carried = None;
        let started = Self::start_carrying(cfg, &mut inherited, &mut carried).await;
        if started.is_err()
            && let Some(pe) = carried
        {
            tier::let_go(&pe).await;
        }
        started
    }

    /// [`start_with`](Self::start_with); `carried` is the tier registration it carries on
    /// with, once it does.
    async fn start_carrying(
        cfg: ProxyConfig,
        inherited: &mut Inherited,
        carried: &mut Option<Arc<rserpool_asap::PoolElement>>,
    ) -> Result<Proxy, StartError> {
        cfg.validate()?;
        let registrar_tls = cfg
            .registrar_tls
            .as_ref()
            .map(|f| rserpool_tls::Tls::load(f).map(Arc::new))
            .transpose()
            .map_err(|e| {
                StartError::Config(config::ConfigError::Invalid(format!(
                    "[registrar-tls]: {e}"
                )))
            })?;
        // A tier member's registration carries on at once: the registrar waits on it.
        if let (Some(taken), Some(t)) = (inherited.tier.as_mut(), &cfg.tier) {
            let access = tier::RegistrarAccess {
                addrs: cfg.registrars.clone(),
                tls: registrar_tls.clone(),
            };
            *carried = tier::carry_on(taken, t, &access);
        }
        let pools = balance::discovery::start(PoolSettings {
            registrar_tls,
            registrars: cfg.registrars.clone(),
            refresh: Duration::from_millis(cfg.refresh_ms),
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
            health: balance::backend::HealthSettings {
                max_fails: cfg.max_fails,
                eject: Duration::from_millis(cfg.eject_ms),
                eject_max: Duration::from_millis(cfg.eject_max_ms),
            },
            max_idle_per_pe: cfg.max_idle_per_pe,
            idle_timeout: Duration::from_millis(cfg.idle_timeout_ms.min(30_000)),
        });
        let log = open_log(&cfg)?;
        let fresh = inherited.is_empty();
        if !fresh {
            warn_if_no_flow_table(&cfg);
        }
        let kernel = load_kernel_splice(&cfg);
        let (draining, _) = watch::channel(false);
        let park = http::park::Parker::start(draining.subscribe(), http::h1::DRAIN_IDLE_GRACE)
            .map_err(|e| warn!("proxy: idle connections wait in their tasks: {e}"))
            .ok();
        let proxy = Proxy {
            inner: Arc::new(Inner {
                pools,
                max_conns: cfg.max_connections,
                conns: Arc::new(Semaphore::new(cfg.max_connections)),
                accepting: Arc::default(),
                cfg: RwLock::new(Arc::new(cfg.clone())),
                listeners: Mutex::new(HashMap::new()),
                status: Mutex::new(None),
                draining,
                log: RwLock::new(log),
                kernel: RwLock::new(kernel),
                tier: RwLock::new(None),
                tls_failures: Arc::default(),
                rejected: Arc::default(),
                park,
            }),
        };
        proxy.inner.pools.configure(&cfg);
        // Listeners open (and a tier member joins) with the pools known: the first clients
        // get PEs, not 503s or closed connections. A process taking over waits longer, as the
        // running one serves meanwhile; without a registrar the proxy starts anyway.
        for h in cfg.pools() {
            proxy.inner.pools.pool(&h);
        }
        let limit = if fresh {
            FIRST_FETCH_TIMEOUT
        } else {
            HANDOVER_FETCH_TIMEOUT
        };
        if !proxy.inner.pools.wait_fetched(limit).await {
            warn!("proxy: starting with pools not fetched yet (is a registrar reachable?)");
        }
        if let Some(t) = &cfg.tier {
            proxy
                .join_tier(t.clone(), &cfg, inherited.tier.take())
                .await?;
        }
        // Started afresh, the proxy waits a while for an address a proxy stopping still holds.
        let patience = if fresh {
            listener::ADDRESS_PATIENCE
        } else {
            Duration::ZERO
        };
        for l in &cfg.listeners {
            let taken = match inherited.listeners.remove(&l.listen) {
                Some(t) => t,
                None => listener::when_free(l.listen, patience, || listener::bind(l.listen))
                    .await
                    .map_err(|e| StartError::Bind(l.listen, e))?,
            };
            proxy.add_listener(l.clone(), Some(taken)).await?;
        }
        for a in inherited.listeners.keys() {
            info!("proxy: listener {a} handed over but no longer configured: closed");
        }
        if let Some(addr) = cfg.status {
            let taken = match inherited.status.take().filter(|(a, _)| *a == addr) {
                Some((_, l)) => l,
                None => listener::when_free(addr, patience, || std::net::TcpListener::bind(addr))
                    .await
                    .map_err(|e| StartError::Bind(addr, e))?,
            };
            proxy.serve_status(addr, taken)?;
        }
        if let Some(monitor) = cfg.csp {
            proxy.report_status(monitor, Duration::from_millis(cfg.csp_interval_ms));
        }
        Ok(proxy)
    }

    /// Serves the status listener, configured at `addr`, on `socket` (handed over or bound).
    fn serve_status(
        &self,
        addr: SocketAddr,
        socket: std::net::TcpListener,
    ) -> Result<(), StartError> {
        socket
            .set_nonblocking(true)
            .map_err(|e| StartError::Bind(addr, e))?;
        let sock = socket
            .try_clone()
            .and_then(TcpListener::from_std)
            .map_err(|e| StartError::Bind(addr, e))?;
        info!(
            "proxy: status on http://{}/status",
            sock.local_addr().unwrap_or(addr)
        );
        let inner = Arc::downgrade(&self.inner);
        let (stop, mut stopped) = watch::channel(false);
        let serve = rserpool_status::serve(sock, STATUS_PATHS, move |path| {
            match (inner.upgrade(), path) {
                (Some(inner), "/metrics") => {
                    rserpool_status::Reply::metrics(Proxy { inner }.metrics())
                }
                (Some(inner), _) => rserpool_status::Reply::json(&Proxy { inner }.stats_json()),
                (None, _) => rserpool_status::Reply::text(503, "the proxy is stopping"),
            }
        });
        tokio::spawn(async move {
            tokio::select! {
                () = serve => {}
                () = until_set(&mut stopped) => {}
            }
        });
        *self.inner.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(StatusListener {
            configured: addr,
            socket,
            stop,
        });
        Ok(())
    }

    /// The listening sockets for a successor (second descriptors; this proxy keeps
    /// accepting on them until [`stop_accepting`](Self::stop_accepting)) and the state that
    /// names them ([`handover::Inherited::from_taken`] reads it).
    pub async fn handover_sockets(&self) -> std::io::Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
        let mut state = handover::State::default();
        let mut fds = Vec::new();
        for (configured, l) in self.listeners().iter() {
            fds.push(rserpool_handover::dup(std::os::fd::AsFd::as_fd(&l.socket))?);
            state.listeners.push(*configured);
        }
        if let Some(s) = &*self.inner.status.lock().unwrap_or_else(|p| p.into_inner()) {
            fds.push(rserpool_handover::dup(std::os::fd::AsFd::as_fd(&s.socket))?);
            state.status = Some(s.configured);
        }
        if let Some(t) = self.tier() {
            let (tier, more) = t.hand_over().await?;
            state.tier = Some(tier);
            fds.extend(more);
        }
        let state = serde_json::to_vec(&state).map_err(std::io::Error::other)?;
        Ok((state, fds))
    }

    /// A successor given [`handover_sockets`](Self::handover_sockets) failed: what cannot be
    /// shared (a tier member's registration) comes back, and the listening sockets get this
    /// proxy's settings again.
    pub fn handover_failed(&self) {
        if let Some(t) = self.tier() {
            t.resume();
        }
        // The successor may have set its own deferral on the listening sockets they share.
        for (addr, x) in self.listeners().iter() {
            let on = listener::defer(&x.socket, *addr, x.config.defers_accept());
            x.deferred.store(on, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A successor serves in this proxy's place: it stops accepting
    /// ([`stop_accepting`](Self::stop_accepting)) and leaves the tier membership to the
    /// successor; it drains next.
    pub fn handed_over(&self) {
        self.stop_accepting();
        let tier = self
            .inner
            .tier
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(t) = tier {
            t.retire();
        }
    }

    /// Whether this proxy is a member of a proxy tier.
    pub fn in_tier(&self) -> bool {
        self.tier().is_some()
    }

    fn tier(&self) -> Option<Arc<tier::Tier>> {
        self.inner
            .tier
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How a tier member reaches the registrars.
    fn registrar_access(&self, cfg: &ProxyConfig) -> tier::RegistrarAccess {
        tier::RegistrarAccess {
            addrs: cfg.registrars.clone(),
            tls: self.inner.pools.settings.registrar_tls.clone(),
        }
    }

    /// Joins the proxy tier of `[tier]`: needs the kernel splice.
    async fn join_tier(
        &self,
        t: config::TierConfig,
        cfg: &ProxyConfig,
        taken: Option<tier::TakenMember>,
    ) -> Result<(), StartError> {
        let Some(ks) = self.kernel() else {
            return Err(StartError::Config(config::ConfigError::Invalid(
                "[tier] needs the kernel splice: a listener with splice = \"kernel\", and the \
                 datapath loaded (the warning above says why it was not)"
                    .into(),
            )));
        };
        let interface = t
            .interface
            .clone()
            .or_else(|| cfg.kernel_splice.interfaces.first().cloned())
            .unwrap_or_default();
        let (conns, max) = (self.inner.conns.clone(), self.inner.max_conns.max(1));
        let free = Box::new(move || conns.available_permits() as f64 / max as f64);
        let registrars = self.registrar_access(cfg);
        let joined = tier::Tier::start(t, registrars, ks.clone(), &interface, free, taken)
            .await
            .map_err(|e| StartError::Config(config::ConfigError::Invalid(e)))?;
        let joined_dyn: Arc<dyn l4::kernel::TierShare> = joined.clone();
        ks.join(Arc::downgrade(&joined_dyn));
        *self.inner.tier.write().unwrap_or_else(|p| p.into_inner()) = Some(joined);
        Ok(())
    }

    /// What the connections of `l` are served with; its certificates are (re)read here.
    fn ctx(&self, l: &ListenerConfig) -> Result<Ctx, StartError> {
        let i = &self.inner;
        let tls = (!l.certificates.is_empty())
            .then(|| {
                let alpn = if l.http2 {
                    rserpool_tls::ALPN_H2_HTTP1
                } else {
                    rserpool_tls::ALPN_HTTP1
                };
                rserpool_tls::https_server(&l.certificates, alpn)
            })
            .transpose()
            .map_err(|e| StartError::Tls(l.listen, e))?;
        let cfg = i.cfg.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut pe_tls = std::collections::HashMap::new();
        for (name, p) in &cfg.pool_settings {
            if let Some(t) = &p.tls {
                let client = t.client().map_err(|e| {
                    StartError::Config(config::ConfigError::Invalid(format!(
                        "[pool.{name}.tls]: {e}"
                    )))
                })?;
                let client = if p.protocol == config::PeProtocol::H2 {
                    // HTTP/2 to the PEs: asked for by ALPN, as gRPC servers expect.
                    let mut c = (*client).clone();
                    c.alpn_protocols = vec![b"h2".to_vec()];
                    Arc::new(c)
                } else {
                    client
                };
                pe_tls.insert(name.clone(), client);
            }
        }
        Ok(Ctx {
            cfg,
            pools: i.pools.clone(),
            routes: Arc::new(Routes::new(l, &i.pools)),
            log: i.log.read().unwrap_or_else(|p| p.into_inner()).clone(),
            draining: i.draining.subscribe(),
            kernel: l.kernel_splice().then(|| self.kernel()).flatten(),
            tls,
            pe_tls: Arc::new(pe_tls),
            current: None,
            http2: l.http2,
            tls_failures: i.tls_failures.clone(),
            rejected: i.rejected.clone(),
            park: i.park.clone(),
        })
    }

    fn kernel(&self) -> Option<Arc<l4::kernel::KernelSplice>> {
        self.inner
            .kernel
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Has `l`'s socket save each SYN when `l` hands connections to a loaded kernel splice:
    /// the hand-over reads the client's first timestamp from it.
    fn save_syn(&self, l: &ListenerConfig, socket: Option<&std::net::TcpListener>) {
        if let (true, Some(_), Some(socket)) = (l.kernel_splice(), self.kernel(), socket)
            && let Err(e) = rserpool_ksplice::save_syn(socket)
        {
            warn!("proxy: listener {}: TCP_SAVE_SYN: {e}", l.listen);
        }
    }

    /// Serves `l` on `taken` (a socket handed over) or on a socket bound now.
    async fn add_listener(
        &self,
        l: ListenerConfig,
        taken: Option<std::net::TcpListener>,
    ) -> Result<(), StartError> {
        if l.kernel_splice() && self.kernel().is_none() {
            warn!(
                "proxy: listener {} relays in user space: the kernel splice is not loaded",
                l.listen
            );
        }
        let listening = listener::open(l.listen, taken, l.defers_accept())
            .map_err(|e| StartError::Bind(l.listen, e))?;
        let sock = &listening.sock;
        let socket = sock
            .get_ref()
            .try_clone()
            .map_err(|e| StartError::Bind(l.listen, e))?;
        self.save_syn(&l, Some(&socket));
        let local = sock
            .get_ref()
            .local_addr()
            .map_err(|e| StartError::Bind(l.listen, e))?;
        let first = self.ctx(&l)?;
        let ctx = Arc::new(RwLock::new(Arc::new(first.clone())));
        ctx::install(&ctx, first, None);
        let (stop, stopped) = watch::channel(false);
        info!(
            "proxy: {}{} listener on {local}",
            l.mode,
            if l.certificates.is_empty() {
                ""
            } else {
                " (TLS)"
            }
        );
        let deferred = listening.deferred.clone();
        tokio::spawn(accept_loop(
            listening,
            l.mode,
            ctx.clone(),
            self.inner.conns.clone(),
            self.inner.accepting.clone(),
            stopped,
        ));
        self.listeners().insert(
            l.listen,
            Listener {
                local,
                mode: l.mode,
                config: l,
                ctx,
                stop,
                socket,
                deferred,
            },
        );
        Ok(())
    }

    fn listeners(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Listener>> {
        self.inner
            .listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The addresses the listeners are bound to, in configuration order.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        let cfg = self.config();
        let ls = self.listeners();
        cfg.listeners
            .iter()
            .filter_map(|l| ls.get(&l.listen).map(|x| x.local))
            .collect()
    }

    pub fn config(&self) -> Arc<ProxyConfig> {
        self.inner
            .cfg
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn pools(&self) -> &Arc<Pools> {
        &self.inner.pools
    }

    /// Idle kept-alive client connections parked without a task of their own (counted among
    /// the active ones).
    pub fn parked_connections(&self) -> usize {
        self.inner.park.as_ref().map_or(0, |p| p.parked())
    }

    /// Client connections being served.
    pub fn active_connections(&self) -> usize {
        let waiting = self
            .inner
            .accepting
            .load(std::sync::atomic::Ordering::Relaxed);
        (self.inner.max_conns - self.inner.conns.available_permits()).saturating_sub(waiting)
    }

    /// Applies a new configuration: listeners are added and removed, routes and timeouts
    /// change for new connections and for the next request of open HTTP connections (the
    /// next stream of HTTP/2 ones); a request under way keeps what it started with. Settings
    /// that need a restart (registrars, refresh, limits, threads, status) are reported. A
    /// configuration whose new listeners cannot be bound, or whose certificates cannot be
    /// loaded, changes nothing.
    pub async fn reload(&self, new: ProxyConfig) -> Result<Vec<String>, StartError> {
        new.validate()?;
        let mut bound = HashMap::new();
        for l in &new.listeners {
            self.ctx(l)?;
            if !self.listeners().contains_key(&l.listen) {
                let socket = listener::bind(l.listen).map_err(|e| StartError::Bind(l.listen, e))?;
                bound.insert(l.listen, socket);
            }
        }
        let old = self.config();
        let mut ignored = Vec::new();
        for (name, changed) in [
            ("registrars", old.registrars != new.registrars),
            ("refresh-ms", old.refresh_ms != new.refresh_ms),
            (
                "max-connections",
                old.max_connections != new.max_connections,
            ),
            ("threads", old.threads != new.threads),
            ("status", old.status != new.status),
            (
                "max-fails / eject-ms",
                old.max_fails != new.max_fails
                    || old.eject_ms != new.eject_ms
                    || old.eject_max_ms != new.eject_max_ms,
            ),
        ] {
            if changed {
                ignored.push(format!("{name} changes only with a restart"));
            }
        }
        // Opened again even when its path is the same: a rotated log (moved away, then the
        // reload signal, as logrotate does) goes on in a new file of that name.
        *self.inner.log.write().unwrap_or_else(|p| p.into_inner()) = open_log(&new)?;
        match self.kernel() {
            None if new.listeners.iter().any(ListenerConfig::kernel_splice) => {
                let loaded = load_kernel_splice(&new);
                *self.inner.kernel.write().unwrap_or_else(|p| p.into_inner()) = loaded;
            }
            Some(_) if old.kernel_splice != new.kernel_splice => {
                ignored.push("[kernel-splice] changes only with a restart".into());
            }
            _ => {}
        }
        *self.inner.cfg.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new.clone());
        // Removed listeners stop accepting.
        let gone: Vec<SocketAddr> = self
            .listeners()
            .keys()
            .filter(|a| !new.listeners.iter().any(|l| l.listen == **a))
            .copied()
            .collect();
        for a in gone {
            if let Some(l) = self.listeners().remove(&a) {
                let _ = l.stop.send(true);
                info!("proxy: listener on {} closed", l.local);
            }
        }
        for l in &new.listeners {
            let existing = self
                .listeners()
                .get(&l.listen)
                .map(|x| (x.mode, x.ctx.clone()));
            match existing {
                Some((mode, ctx)) if mode == l.mode => {
                    let previous = ctx.read().unwrap_or_else(|p| p.into_inner()).clone();
                    ctx::install(&ctx, self.ctx(l)?, Some(previous.as_ref()));
                    let socket = self.listeners().get_mut(&l.listen).and_then(|x| {
                        if x.config.defers_accept() != l.defers_accept() {
                            let on = listener::defer(&x.socket, l.listen, l.defers_accept());
                            x.deferred.store(on, std::sync::atomic::Ordering::Relaxed);
                        }
                        x.config = l.clone();
                        x.socket.try_clone().ok()
                    });
                    self.save_syn(l, socket.as_ref());
                }
                Some(_) => {
                    // Another mode: a new accept loop on the same listening socket (binding the
                    // address anew would find it still in use by the old loop).
                    let taken = self.listeners().remove(&l.listen).map(|x| {
                        let _ = x.stop.send(true);
                        x.socket
                    });
                    self.add_listener(l.clone(), taken).await?;
                }
                None => {
                    self.add_listener(l.clone(), bound.remove(&l.listen))
                        .await?
                }
            }
        }
        self.inner.pools.configure(&new);
        Ok(ignored)
    }

    /// Stops accepting, lets in-flight requests and connections finish (idle keep-alive
    /// connections are closed) and returns when none is left or `timeout` has passed; returns
    /// the connections still open. A tier member leaves the tier first (`tier/leave.rs`).
    pub async fn drain(&self, timeout: Duration) -> usize {
        // A tier member first leaves the router's group, serving what still comes meanwhile.
        if let Some(t) = self.tier() {
            t.leave(timeout.min(TIER_LEAVE_LIMIT)).await;
        }
        self.stop_accepting();
        let _ = self.inner.draining.send(true);
        let deadline = tokio::time::Instant::now() + timeout;
        while self.active_connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.active_connections()
    }

    /// Closes every listener, the status listener too (their sockets live on in a process
    /// they were handed over to).
    pub fn stop_accepting(&self) {
        for (_, l) in self.listeners().drain() {
            let _ = l.stop.send(true);
        }
        if let Some(s) = self
            .inner
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = s.stop.send(true);
        }
    }

    /// Counters for the status listener.
    pub fn stats_json(&self) -> serde_json::Value {
        let listeners: Vec<_> = self
            .listeners()
            .values()
            .map(|l| serde_json::json!({"listen": l.local.to_string(), "mode": l.mode, "pool": l.config.pool}))
            .collect();
        serde_json::json!({
            "registrar_reachable": self.inner.pools.registrar_reachable(),
            "active_connections": self.active_connections(),
            "parked_connections": self.parked_connections(),
            "listeners": listeners,
            "pools": self.inner.pools.snapshot(),
            "kernel_splice": self.kernel().map(|k| k.snapshot()),
            "tier": self
                .inner
                .tier
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|t| t.snapshot()),
        })
    }
}

fn open_log(cfg: &ProxyConfig) -> Result<Option<AccessLog>, StartError> {
    cfg.access_log
        .as_ref()
        .map(|p| AccessLog::open(p).map_err(|e| StartError::Log(p.display().to_string(), e)))
        .transpose()
}

async fn accept_loop(
    listening: listener::Listening,
    mode: Mode,
    ctx: Arc<RwLock<Arc<Ctx>>>,
    conns: Arc<Semaphore>,
    accepting: Arc<std::sync::atomic::AtomicUsize>,
    mut stop: watch::Receiver<bool>,
) {
    /// Counts this loop in `accepting` while it holds a permit without a client.
    struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let mut warned = false;
    // Whether accepted connections come with `TCP_NODELAY`: known after the first.
    let mut inherited: Option<bool> = None;
    loop {
        let permit = tokio::select! {
            p = conns.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            () = until_set(&mut stop) => return,
        };
        accepting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let waiting = Waiting(&accepting);
        let accepted = async {
            loop {
                let mut ready = listening.sock.readable().await?;
                match ready.try_io(|l| listener::accept(l.get_ref())) {
                    Ok(r) => return r,
                    Err(_would_block) => continue,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            r = accepted => match r {
                Ok(v) => v,
                // The client gave up before it was accepted.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // Out of descriptors and the like: wait a moment, say it once.
                    if !warned {
                        warn!("proxy: accept failed: {e}");
                        warned = true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = until_set(&mut stop) => return,
        };
        drop(waiting);
        warned = false;
        if inherited.is_none() {
            // Linux copies it from the listener; checked once, in case a kernel does not.
            inherited = Some(listening.nodelay && stream.nodelay().unwrap_or(false));
        }
        if inherited != Some(true) {
            let _ = stream.set_nodelay(true);
        }
        if mode == Mode::Http
            && !listening
                .deferred
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            // The response will carry the ACK of the request: one packet less per connection.
            // (A deferred accept comes after the kernel has acknowledged the request.)
            let _ = socket2::SockRef::from(&stream).set_quickack(false);
        }
        let ctx = ctx.read().unwrap_or_else(|p| p.into_inner()).clone();
        // A plain HTTP/1.1 connection's future is the task itself, nothing around it (an
        // idle connection costs its task's size); the others are boxed in a small one.
        match (mode, ctx.tls.clone()) {
            (Mode::Http, None) => {
                workers::spawn(http::h1::serve(stream, peer, ctx, Some(permit)));
            }
            (Mode::Http, Some(tls)) => {
                workers::spawn(async move {
                    Box::pin(http::h1::serve_tls(stream, peer, ctx, tls)).await;
                    drop(permit);
                });
            }
            (Mode::Tcp, _) => {
                workers::spawn(async move {
                    match TcpStream::from_std(stream) {
                        Ok(s) => Box::pin(l4::tcp::serve(s, peer, ctx)).await,
                        Err(e) => warn!("proxy: cannot register a connection: {e}"),
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// A process taking over from another (an upgrade) with the kernel splice, whose `pin-dir`
/// holds no flow table: the other one pinned it where this one does not look (under `ip
/// netns exec` each process has a /sys of its own, and so its own /sys/fs/bpf). Its spliced
/// connections are unknown here and will be reset: said before it happens.
fn warn_if_no_flow_table(cfg: &ProxyConfig) {
    let dir = &cfg.kernel_splice.pin_dir;
    if cfg.listeners.iter().any(ListenerConfig::kernel_splice)
        && !rserpool_ksplice::has_flow_table(dir)
    {
        warn!(
            "proxy: taking over from the process before, but {} holds no flow table: it pinned \
             its maps where this process does not see them, and the connections it spliced \
             will be reset. Under `ip netns exec`, put pin-dir on a bpffs mounted outside /sys \
             (docs/OPERATIONS.md, upgrades)",
            dir.display()
        );
    }
}

/// Loads the kernel splice when a listener asks for it; says once why not when it cannot.
fn load_kernel_splice(cfg: &ProxyConfig) -> Option<Arc<l4::kernel::KernelSplice>> {
    if !cfg.listeners.iter().any(ListenerConfig::kernel_splice) {
        if let Some(why) = rserpool_ksplice::unavailable() {
            info!("proxy: kernel splice unavailable in this build: {why}");
        }
        return None;
    }
    let k = &cfg.kernel_splice;
    let names: Vec<&str> = k.interfaces.iter().map(String::as_str).collect();
    match rserpool_ksplice::Datapath::load(&names, k.max_flows, &k.pin_dir) {
        Ok(dp) => {
            info!(
                "proxy: kernel splice on {} ({} flows, pinned in {})",
                k.interfaces.join(", "),
                k.max_flows,
                k.pin_dir.display()
            );
            let ks = Arc::new(l4::kernel::KernelSplice::new(dp, k));
            tokio::spawn(l4::kernel::expire_loop(Arc::downgrade(&ks)));
            Some(ks)
        }
        Err(e) => {
            let hint = if rustix::process::geteuid().is_root() {
                ""
            } else {
                " (the kernel splice needs root: CAP_BPF and CAP_NET_ADMIN)"
            };
            warn!("proxy: {e}{hint}; spliced listeners relay in user space");
            None
        }
    }
}
