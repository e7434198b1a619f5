//! The pools the proxy serves, each a local copy of the registrar's pool.
//!
//! This is where the other rooms meet: [`crate::discovery`] writes each copy, the request
//! paths pick PEs from it (the selection itself is in `select.rs`, the PEs' own state in
//! [`crate::backend`]) and report the PEs they could not reach, and the stats endpoint reads
//! a snapshot.

use crate::backend::{Backend, BackendSnapshot, HealthSettings};
use crate::config::{PoolConfig, ProxyConfig, Select};
use crate::select::Selector;
use rserpool_wire::{PoolElement, PoolHandle};
use serde::Serialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Settings of the pool view and of passive health.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub registrars: Vec<SocketAddr>,
    pub refresh: Duration,
    pub connect_timeout: Duration,
    pub health: HealthSettings,
    /// Idle keep-alive connections kept per PE (HTTP mode).
    pub max_idle_per_pe: usize,
    /// Idle connections older than this are not reused.
    pub idle_timeout: Duration,
}

/// Why no PE was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// No PE (left to try) in the pool.
    NoPe,
    /// A `credits` pool whose PEs had no credit within the pool's credit wait.
    NoCredit,
    /// A `credits` pool with its credit queue full.
    QueueFull,
}

impl NoPick {
    /// The text of the 503 for a client.
    pub fn text(self) -> &'static str {
        match self {
            Self::NoPe => "no pool element available",
            Self::NoCredit => "no pool element has credit left",
            Self::QueueFull => "too many requests waiting for credit",
        }
    }
}

/// One pool's local copy.
pub struct Pool {
    pub handle: PoolHandle,
    state: Mutex<PoolState>,
    /// A new copy arrived (a PE may have credit again).
    changed: tokio::sync::Notify,
    waiting: std::sync::atomic::AtomicUsize,
}

struct PoolState {
    selector: Selector,
    refreshed: Option<Instant>,
    config: PoolConfig,
}

impl Pool {
    fn new(handle: PoolHandle) -> Self {
        Self {
            handle,
            state: Mutex::new(PoolState {
                selector: Selector::new(),
                refreshed: None,
                config: PoolConfig::default(),
            }),
            changed: tokio::sync::Notify::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next PE by the pool's selection (its policy unless configured otherwise), skipping
    /// the PEs in `tried` and ejected ones; with every untried PE ejected, the least recently
    /// ejected. The pick counts in flight at the PE until [`Backend::pick_done`].
    pub fn pick(&self, tried: &[u32]) -> Option<Arc<Backend>> {
        let st = &mut *self.lock();
        st.selector.pick(&self.handle, tried, st.config.select)
    }

    /// The pool's settings.
    pub fn config(&self) -> PoolConfig {
        self.lock().config.clone()
    }

    /// [`pick`](Self::pick), but in a `credits` pool whose untried PEs have all spent their
    /// credit, waits up to the pool's `credit-wait-ms` for one to have credit again (a new
    /// report, or a request finishing here), in a queue of at most `credit-queue`.
    pub async fn pick_or_wait(&self, tried: &[u32]) -> Result<Arc<Backend>, NoPick> {
        if let Some(b) = self.pick(tried) {
            return Ok(b);
        }
        let (wait, queue) = {
            let st = self.lock();
            if st.config.select != Select::Policy || !st.selector.out_of_credit(&self.handle, tried)
            {
                return Err(NoPick::NoPe);
            }
            (
                Duration::from_millis(st.config.credit_wait_ms),
                st.config.credit_queue,
            )
        };
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(NoPick::QueueFull);
        }
        let deadline = tokio::time::Instant::now() + wait;
        let picked = loop {
            // Finished requests free credit without a report: look again every millisecond.
            let next = (tokio::time::Instant::now() + Duration::from_millis(1)).min(deadline);
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep_until(next) => {}
            }
            if let Some(b) = self.pick(tried) {
                break Ok(b);
            }
            if tokio::time::Instant::now() >= deadline {
                break Err(NoPick::NoCredit);
            }
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        picked
    }

    /// Replaces the copy with what a registrar reported.
    pub(crate) fn update(&self, pes: Vec<PoolElement>) {
        let mut st = self.lock();
        st.selector.replace(&self.handle, pes);
        st.refreshed = Some(Instant::now());
        drop(st);
        self.changed.notify_waiters();
    }

    pub fn backends(&self) -> Vec<Arc<Backend>> {
        let mut v: Vec<_> = self.lock().selector.backends().cloned().collect();
        v.sort_by_key(|b| b.id);
        v
    }

    pub fn len(&self) -> usize {
        self.lock().selector.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn age(&self) -> Option<Duration> {
        self.lock().refreshed.map(|t| t.elapsed())
    }
}

/// A PE the proxy could not reach, to be reported to a registrar.
#[derive(Debug)]
pub(crate) struct Unreachable {
    pub(crate) pool: PoolHandle,
    pub(crate) pe_id: u32,
}

/// Every pool the proxy serves, kept fresh by one refresh task ([`crate::discovery`]).
pub struct Pools {
    pools: Mutex<HashMap<PoolHandle, Arc<Pool>>>,
    pub settings: PoolSettings,
    reports: mpsc::UnboundedSender<Unreachable>,
    registrar_ok: AtomicBool,
    /// Wakes the refresh task when a pool is added.
    added: Arc<tokio::sync::Notify>,
    /// The configuration's `[pool.HANDLE]` settings, for pools added later.
    configs: Mutex<std::collections::BTreeMap<String, PoolConfig>>,
}

impl Pools {
    /// No pools yet, and the receiving end of the unreachable reports.
    pub(crate) fn new(settings: PoolSettings) -> (Arc<Self>, mpsc::UnboundedReceiver<Unreachable>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pools = Arc::new(Self {
            pools: Mutex::new(HashMap::new()),
            settings,
            reports: tx,
            registrar_ok: AtomicBool::new(true),
            added: Arc::new(tokio::sync::Notify::new()),
            configs: Mutex::new(Default::default()),
        });
        (pools, rx)
    }

    fn map(&self) -> MutexGuard<'_, HashMap<PoolHandle, Arc<Pool>>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pool with this handle, added (and fetched at the next refresh) if new.
    pub fn pool(&self, handle: &str) -> Arc<Pool> {
        let handle = PoolHandle::from(handle);
        let mut map = self.map();
        if let Some(p) = map.get(&handle) {
            return p.clone();
        }
        let p = Arc::new(Pool::new(handle.clone()));
        if let Some(c) = self
            .configs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&handle.to_string())
        {
            p.lock().config = c.clone();
        }
        map.insert(handle, p.clone());
        drop(map);
        self.added.notify_one();
        p
    }

    /// Keeps only the pools the configuration names, with its settings for each (at start
    /// and after a reload).
    pub fn configure(&self, cfg: &ProxyConfig) {
        *self.configs.lock().unwrap_or_else(|p| p.into_inner()) = cfg.pool_settings.clone();
        let keep = cfg.pools();
        let mut map = self.map();
        map.retain(|h, _| keep.iter().any(|k| k.as_bytes() == h.as_bytes()));
        for (h, p) in map.iter() {
            p.lock().config = cfg.pool_config(&h.to_string());
        }
    }

    /// The pool with this handle, if the proxy serves it.
    pub fn get(&self, handle: &PoolHandle) -> Option<Arc<Pool>> {
        self.map().get(handle).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Pool>> {
        let mut v: Vec<_> = self.map().values().cloned().collect();
        v.sort_by(|a, b| a.handle.as_bytes().cmp(b.handle.as_bytes()));
        v
    }

    /// A PE could not be reached: eject it locally (per passive health) and tell a registrar.
    pub fn unreachable(&self, b: &Backend) {
        b.failed(&self.settings.health);
        let _ = self.reports.send(Unreachable {
            pool: b.pool.clone(),
            pe_id: b.id,
        });
    }

    pub fn registrar_reachable(&self) -> bool {
        self.registrar_ok.load(Ordering::Relaxed)
    }

    /// Records whether a registrar answered the last refresh; returns what was recorded before.
    pub(crate) fn set_registrar_reachable(&self, ok: bool) -> bool {
        self.registrar_ok.swap(ok, Ordering::Relaxed)
    }

    /// Notified when a pool is added.
    pub(crate) fn added(&self) -> Arc<tokio::sync::Notify> {
        self.added.clone()
    }

    /// Waits until every pool has been fetched once (or the timeout passes).
    pub async fn wait_fetched(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.all().iter().all(|p| p.age().is_some()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A JSON snapshot of every pool and PE for the stats endpoint.
    pub fn snapshot(&self) -> Vec<PoolSnapshot> {
        let now = Instant::now();
        self.all()
            .iter()
            .map(|p| PoolSnapshot {
                pool: p.handle.to_string(),
                refreshed_ms_ago: p.age().map(|a| a.as_millis() as u64),
                pool_elements: p.backends().iter().map(|b| b.snapshot(now)).collect(),
            })
            .collect()
    }
}

#[derive(Debug, Serialize)]
pub struct PoolSnapshot {
    pub pool: String,
    pub refreshed_ms_ago: Option<u64>,
    pub pool_elements: Vec<BackendSnapshot>,
}
