//! The pools the proxy serves, each a local copy of the registrar's pool.
//!
//! This is where the other rooms meet: `discovery` writes each copy, the request
//! paths pick PEs from it (the selection itself is in `select.rs`, the PEs' own state in
//! [`crate::balance::backend`]) and report the PEs they could not reach, and the stats endpoint reads
//! a snapshot.

pub use crate::balance::admit::NoPick;
use crate::balance::admit::{Admission, AdmissionConfig, LevelStats};
use crate::balance::backend::{Backend, BackendSnapshot, HealthSettings, clock_ms};
use crate::balance::outlier::{EjectCause, SuccessRateRule, success_rate_outliers};
use crate::balance::select::{Affinity, Selector};
use crate::config::LevelsConfig;
use crate::config::{PoolConfig, ProxyConfig};
use rserpool_wire::{PoolElement, PoolHandle};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Settings of the pool view and of passive health.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub registrars: Vec<rserpool_wire::Address>,
    pub refresh: Duration,
    pub connect_timeout: Duration,
    pub health: HealthSettings,
    /// Idle keep-alive connections kept per PE (HTTP mode).
    pub max_idle_per_pe: usize,
    /// Idle connections older than this are not reused.
    pub idle_timeout: Duration,
    /// TLS with the registrars (`[registrar-tls]`).
    pub registrar_tls: Option<Arc<rserpool_tls::Tls>>,
}

/// One pool's local copy.
pub struct Pool {
    pub handle: PoolHandle,
    state: Mutex<PoolState>,
    /// Requests waiting in the admission queue (the admission's own count).
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    /// Whether finished requests are charged to their level (`[levels]` configured).
    charges: AtomicBool,
    /// `protocol = "h2"`: read for every request, so kept out of the lock.
    h2: AtomicBool,
    /// `select = "maglev"` or `"ring-hash"`: requests bring a key.
    hashing: AtomicBool,
    /// `sticky-cookie` set: requests may name their PE.
    sticky: AtomicBool,
    /// `try-timeout-ms`: read by every request, so kept out of the lock.
    try_timeout_ms: std::sync::atomic::AtomicU64,
    /// Requests the circuit breaker (`max-requests`) refused.
    circuit_refused: std::sync::atomic::AtomicU64,
    /// Retries under way, and those the retry budget refused.
    retries: Arc<std::sync::atomic::AtomicU64>,
    retries_refused: std::sync::atomic::AtomicU64,
    /// When the success-rate rule looks next, in ms of the backends' clock (0: not yet set).
    success_rate_due_ms: std::sync::atomic::AtomicU64,
    /// Responses to clients of requests routed here, by status class (1xx to 5xx).
    responses: [std::sync::atomic::AtomicU64; 5],
    /// Ejections of the pool's PEs by cause ([`EjectCause::ALL`]): kept when a PE leaves, as
    /// its own series go with it.
    ejections: [std::sync::atomic::AtomicU64; EjectCause::ALL.len()],
    /// Whether a waiting request looks for room every 100 ms on behalf of all (see
    /// [`Pool::admit_keyed`]), and how it hands that on when it leaves.
    looker: AtomicBool,
    look_handoff: tokio::sync::Notify,
}

/// The status classes of [`Pool::responses`], as the metrics label them.
pub const RESPONSE_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// A retry's place in its pool's retry budget, given back when dropped.
pub(crate) struct RetryPermit(Arc<std::sync::atomic::AtomicU64>);

impl Drop for RetryPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct PoolState {
    selector: Selector,
    /// PEs over another transport than TCP were left out, and the log said so.
    other_transport_said: bool,
    refreshed: Option<Instant>,
    config: PoolConfig,
    admission: Admission,
}

impl PoolState {
    fn pick(
        &mut self,
        handle: &PoolHandle,
        tried: &[u32],
        affinity: Affinity,
    ) -> Option<Arc<Backend>> {
        self.selector.pick(handle, tried, affinity, &self.config)
    }

    /// Whether another PE may be ejected: fewer than `max-ejection-percent` of the pool
    /// (at least one) are.
    fn may_eject(&self) -> bool {
        let n = self.selector.len();
        let cap = (n * self.config.max_ejection_percent as usize / 100).max(1);
        self.selector.ejected(Instant::now()) < cap
    }

    /// Whether a request that found no PE may wait: PEs are left to try but all are at
    /// their limit, which frees up, unlike missing PEs.
    fn may_wait(&self, handle: &PoolHandle, tried: &[u32]) -> bool {
        self.selector
            .at_limit(handle, tried, self.config.max_conn.is_some())
    }

    /// Gives free places to waiting requests, by level, until none is free or none waits.
    fn dispatch(&mut self, handle: &PoolHandle) {
        let now = Instant::now();
        while self.admission.is_waiting() {
            let Some((front, tried)) = self.admission.front(now) else {
                break;
            };
            let tried = tried.to_vec();
            let outcome = match self.pick(handle, &tried, Affinity::default()) {
                Some(b) => Ok(b),
                // No room for this waiter (its own tried PEs aside): the next event looks again.
                None if self.may_wait(handle, &tried) => break,
                None => Err(NoPick::NoPe),
            };
            if let Err(b) = self.admission.take(front, outcome, now) {
                b.pick_done();
            }
        }
    }
}

/// A waiting request's place in its queue; leaving it (timeout, or the client went away)
/// takes the request out, and a PE handed to it at that moment back.
struct Queued<'a> {
    pool: &'a Pool,
    level: usize,
    id: u64,
    rx: tokio::sync::oneshot::Receiver<crate::balance::admit::Outcome>,
    done: bool,
    /// This request is the pool's looker.
    looking: bool,
}

impl Queued<'_> {
    /// Stops looking for the others, and wakes one of them to look instead.
    fn resign(&mut self) {
        if std::mem::take(&mut self.looking) {
            self.pool.looker.store(false, Ordering::SeqCst);
            self.pool.look_handoff.notify_one();
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.resign();
        if self.done {
            return;
        }
        let mut st = self.pool.lock();
        st.admission.remove(self.level, self.id, false);
        if let Ok(Ok(b)) = self.rx.try_recv() {
            b.pick_done();
            st.dispatch(&self.pool.handle);
        }
    }
}

impl Pool {
    fn new(handle: PoolHandle) -> Self {
        let config = PoolConfig::default();
        let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let admission = Admission::new(admission_config(&config, None), seed(), waiting.clone());
        Self {
            handle,
            waiting,
            charges: AtomicBool::new(false),
            h2: AtomicBool::new(false),
            hashing: AtomicBool::new(false),
            sticky: AtomicBool::new(false),
            try_timeout_ms: Default::default(),
            circuit_refused: Default::default(),
            retries: Arc::default(),
            retries_refused: Default::default(),
            success_rate_due_ms: Default::default(),
            responses: Default::default(),
            ejections: Default::default(),
            looker: AtomicBool::new(false),
            look_handoff: tokio::sync::Notify::new(),
            state: Mutex::new(PoolState {
                selector: Selector::new(),
                other_transport_said: false,
                refreshed: None,
                config,
                admission,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_config(&self, config: PoolConfig, levels: Option<&LevelsConfig>) {
        let st = &mut *self.lock();
        st.admission
            .reconfigure(admission_config(&config, levels), seed());
        self.charges.store(levels.is_some(), Ordering::Relaxed);
        self.h2.store(
            config.protocol == crate::config::PeProtocol::H2,
            Ordering::Relaxed,
        );
        self.hashing.store(
            crate::balance::hashing::Kind::of(config.select).is_some(),
            Ordering::Relaxed,
        );
        self.sticky
            .store(config.sticky_cookie.is_some(), Ordering::Relaxed);
        self.try_timeout_ms
            .store(config.try_timeout_ms, Ordering::Relaxed);
        st.config = config;
        st.dispatch(&self.handle);
    }

    /// The next PE by the pool's selection (its policy unless configured otherwise), skipping
    /// the PEs in `tried`, ejected ones and those at their limit; with every untried PE
    /// ejected, the least recently ejected. The pick counts in flight at the PE until
    /// [`Backend::pick_done`]. Ignores the admission queue: [`admit`](Self::admit) does not.
    pub fn pick(&self, tried: &[u32]) -> Option<Arc<Backend>> {
        let st = &mut *self.lock();
        st.pick(&self.handle, tried, Affinity::default())
    }

    /// A place for one more retry, if the pool's retry budget has one: retries under way stay
    /// within `retry-budget-percent` of the requests under way, or `retry-budget-min`.
    pub(crate) fn retry(&self) -> Option<RetryPermit> {
        let (percent, min) = {
            let st = self.lock();
            (st.config.retry_budget_percent, st.config.retry_budget_min)
        };
        let active: u64 = self
            .backends()
            .iter()
            .map(|b| b.stats.active.load(Ordering::Relaxed))
            .sum();
        let budget = (active * u64::from(percent) / 100).max(u64::from(min));
        let taken = self.retries.fetch_add(1, Ordering::Relaxed);
        if taken < budget {
            return Some(RetryPermit(self.retries.clone()));
        }
        self.retries.fetch_sub(1, Ordering::Relaxed);
        self.retries_refused.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// What a hashing selection hashes, when the pool has one.
    pub(crate) fn hash_key(&self) -> Option<crate::config::HashKey> {
        if !self.hashing.load(Ordering::Relaxed) {
            return None;
        }
        Some(self.lock().config.hash_key.clone())
    }

    /// The name of the pool's sticky cookie, when it has one.
    pub(crate) fn sticky_cookie(&self) -> Option<String> {
        if !self.sticky.load(Ordering::Relaxed) {
            return None;
        }
        self.lock().config.sticky_cookie.clone()
    }

    /// Requests the circuit breaker refused so far.
    pub fn circuit_refused(&self) -> u64 {
        self.circuit_refused.load(Ordering::Relaxed)
    }

    /// A response with status `code` went to the client of a request routed here (the PE's,
    /// or the proxy's own when no PE answered).
    pub(crate) fn responded(&self, code: u16) {
        if let Some(n) = (code / 100)
            .checked_sub(1)
            .and_then(|i| self.responses.get(usize::from(i)))
        {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A PE of the pool was ejected for `cause` (`ejected`: as the ejection returned).
    fn ejected(&self, cause: EjectCause, ejected: bool) -> bool {
        if ejected {
            self.ejections[cause.index()].fetch_add(1, Ordering::Relaxed);
        }
        ejected
    }

    /// Ejections of the pool's PEs so far, by cause ([`EjectCause::ALL`]).
    pub fn ejections(&self) -> [u64; EjectCause::ALL.len()] {
        std::array::from_fn(|i| self.ejections[i].load(Ordering::Relaxed))
    }

    /// Responses to clients so far, by status class ([`RESPONSE_CLASSES`]).
    pub fn responses(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.responses[i].load(Ordering::Relaxed))
    }

    /// Retries the retry budget refused so far.
    pub fn retries_refused(&self) -> u64 {
        self.retries_refused.load(Ordering::Relaxed)
    }

    /// The pool's settings.
    pub fn config(&self) -> PoolConfig {
        self.lock().config.clone()
    }

    /// The per-try timeout (`try-timeout-ms`), if the pool has one.
    pub(crate) fn try_timeout(&self) -> Option<Duration> {
        let ms = self.try_timeout_ms.load(Ordering::Relaxed);
        (ms > 0).then(|| Duration::from_millis(ms))
    }

    /// One of the pool's settings, without a copy of them all.
    pub(crate) fn config_value<T>(&self, get: impl FnOnce(&PoolConfig) -> T) -> T {
        get(&self.lock().config)
    }

    /// The HTTP version spoken to the pool's PEs.
    pub fn protocol(&self) -> crate::config::PeProtocol {
        if self.h2.load(Ordering::Relaxed) {
            crate::config::PeProtocol::H2
        } else {
            crate::config::PeProtocol::Http1
        }
    }

    /// Whether requests to `path` may go to another PE after one failed them (`idempotent`).
    pub fn idempotent_path(&self, path: &[u8]) -> bool {
        self.lock()
            .config
            .idempotent
            .iter()
            .any(|p| path.starts_with(p.as_bytes()))
    }

    /// A PE for a request of service level `level` (1-based): at once when nobody waits and
    /// a PE has room; else, when the pool's PEs are all at their limit (credits, `max-conn`),
    /// after waiting in the level's queue (`admit`) for up to its queue timeout.
    pub async fn admit(&self, level: usize, tried: &[u32]) -> Result<Arc<Backend>, NoPick> {
        self.admit_keyed(level, tried, Affinity::default()).await
    }

    /// [`admit`](Self::admit) with what ties the request to a PE: its key for a hashing
    /// selection, its sticky cookie's PE (a request that has to wait in the queue is
    /// dispatched by load, without them).
    pub(crate) async fn admit_keyed(
        &self,
        level: usize,
        tried: &[u32],
        affinity: Affinity,
    ) -> Result<Arc<Backend>, NoPick> {
        let (level, id, rx, timeout) = {
            let st = &mut *self.lock();
            if let Some(max) = st.config.max_requests
                && st.selector.active() >= max
            {
                self.circuit_refused.fetch_add(1, Ordering::Relaxed);
                return Err(NoPick::CircuitOpen);
            }
            let level = st.admission.index(level);
            if !st.admission.is_waiting() {
                if let Some(b) = st.pick(&self.handle, tried, affinity) {
                    st.admission.admitted(level);
                    return Ok(b);
                }
                if !st.may_wait(&self.handle, tried) {
                    return Err(NoPick::NoPe);
                }
            }
            let (id, rx) = st.admission.enqueue(level, tried, Instant::now())?;
            st.dispatch(&self.handle);
            (level, id, rx, st.admission.timeout(level))
        };
        // Boxed: the wait is a large future, and every request's attempt would carry its size
        // for a path taken only under overload.
        Box::pin(self.wait_queued(level, id, rx, timeout)).await
    }

    /// The wait of a request queued at `level` (its place `id`) until it is handed a PE, shed,
    /// or out of time.
    async fn wait_queued(
        &self,
        level: usize,
        id: u64,
        rx: tokio::sync::oneshot::Receiver<crate::balance::admit::Outcome>,
        timeout: Duration,
    ) -> Result<Arc<Backend>, NoPick> {
        let mut q = Queued {
            pool: self,
            level,
            id,
            rx,
            done: false,
            // The first to wait looks for all.
            looking: !self.looker.swap(true, Ordering::SeqCst),
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Places free on events (a request finished, a report, a new copy); a look every
            // 100 ms covers the rest (an ejection ending). One waiting request looks, for all:
            // every waiter looking took the lock 10 times a second each, which with a queue of
            // thousands cost several times the request itself.
            let next = if q.looking {
                (tokio::time::Instant::now() + Duration::from_millis(100)).min(deadline)
            } else {
                deadline
            };
            let woke = tokio::select! {
                got = &mut q.rx => Some(got),
                () = self.look_handoff.notified(), if !q.looking => {
                    q.looking = true;
                    self.looker.store(true, Ordering::SeqCst);
                    continue;
                }
                () = tokio::time::sleep_until(next) => None,
            };
            match woke {
                Some(Ok(outcome)) => {
                    q.done = true;
                    q.resign();
                    return outcome;
                }
                Some(Err(_)) => {
                    q.done = true;
                    q.resign();
                    return Err(NoPick::QueueFull);
                }
                None if tokio::time::Instant::now() < deadline => {
                    self.lock().dispatch(&self.handle);
                }
                None => {
                    q.resign();
                    let mut st = self.lock();
                    q.done = true;
                    if st.admission.remove(level, id, true) {
                        return Err(NoPick::QueueTimeout);
                    }
                    drop(st);
                    // Handed a PE (or shed) just now.
                    return match q.rx.try_recv() {
                        Ok(outcome) => outcome,
                        Err(_) => Err(NoPick::QueueTimeout),
                    };
                }
            }
        }
    }

    /// A request of `level` (1-based) at `b` is over, after `service` there: its place frees
    /// (a waiting request gets it) and its level's consumption grows.
    pub fn finished(&self, b: &Backend, level: usize, service: Duration) {
        b.stats.active.fetch_sub(1, Ordering::SeqCst);
        // The common case takes no lock: nobody waits and no level is charged. A request
        // queueing now counts itself as waiting before it looks for room, so either it sees
        // the place freed above or this sees it waiting.
        if self.waiting.load(Ordering::SeqCst) == 0 && !self.charges.load(Ordering::Relaxed) {
            return;
        }
        let st = &mut *self.lock();
        let level = st.admission.index(level);
        st.admission.finished(level, service, Instant::now());
        st.dispatch(&self.handle);
    }

    /// A pick that did not become a request (the connect failed) was released: its place
    /// may go to a waiting request.
    pub fn released(&self) {
        self.lock().dispatch(&self.handle);
    }

    /// Whether requests that end are counted per level (`finished`, service time): with
    /// `[levels]` only, so that without them a request ends without taking the pool's lock.
    pub fn counts_finished(&self) -> bool {
        self.charges.load(Ordering::Relaxed)
    }

    /// Per service level counters.
    pub fn level_stats(&self) -> Vec<LevelStats> {
        self.lock().admission.stats()
    }

    /// Replaces the copy with what a registrar reported.
    pub(crate) fn update(&self, mut pes: Vec<PoolElement>) {
        // The proxy reaches PEs over TCP: one over SCTP (rsplib's, say) it would only find
        // unreachable, and report so, taking a live PE out of the pool for everyone.
        let before = pes.len();
        let other = pes
            .iter()
            .find(|pe| pe.user_transport.tcp().is_none())
            .map(|pe| pe.user_transport.to_string());
        pes.retain(|pe| pe.user_transport.tcp().is_some());
        let st = &mut *self.lock();
        match other {
            Some(t) if !st.other_transport_said => {
                st.other_transport_said = true;
                tracing::warn!(
                    "pool {}: {} of its {before} PEs take another transport than TCP ({t}); the \
                     proxy reaches PEs over TCP only and leaves them out",
                    self.handle,
                    before - pes.len()
                );
            }
            Some(_) => {}
            None => st.other_transport_said = false,
        }
        st.selector.replace(&self.handle, pes);
        st.refreshed = Some(Instant::now());
        st.dispatch(&self.handle);
    }

    pub fn backends(&self) -> Vec<Arc<Backend>> {
        let mut v: Vec<_> = self.lock().selector.backends().cloned().collect();
        v.sort_by_key(|b| b.id);
        v
    }

    pub fn len(&self) -> usize {
        self.lock().selector.len()
    }

    /// Whether the pool is in panic mode (at its last pick), and how often it entered it.
    pub fn panic(&self) -> (bool, u64) {
        self.lock().selector.panic()
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

/// Every pool the proxy serves, kept fresh by one refresh task (`discovery`).
pub struct Pools {
    pools: Mutex<HashMap<PoolHandle, Arc<Pool>>>,
    pub settings: PoolSettings,
    reports: mpsc::UnboundedSender<Unreachable>,
    registrar_ok: AtomicBool,
    /// Wakes the refresh task when a pool is added.
    added: Arc<tokio::sync::Notify>,
    /// The configuration's `[pool.HANDLE]` and `[levels]` settings, for pools added later.
    configs: Mutex<Configs>,
}

#[derive(Default)]
struct Configs {
    pools: std::collections::BTreeMap<String, PoolConfig>,
    levels: Option<LevelsConfig>,
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
        {
            let configs = self.configs.lock().unwrap_or_else(|p| p.into_inner());
            let c = configs.pools.get(&handle.to_string()).cloned();
            if c.is_some() || configs.levels.is_some() {
                p.set_config(c.unwrap_or_default(), configs.levels.as_ref());
            }
        }
        map.insert(handle, p.clone());
        drop(map);
        self.added.notify_one();
        p
    }

    /// Keeps only the pools the configuration names, with its settings for each (at start
    /// and after a reload).
    pub fn configure(&self, cfg: &ProxyConfig) {
        *self.configs.lock().unwrap_or_else(|p| p.into_inner()) = Configs {
            pools: cfg.pool_settings.clone(),
            levels: cfg.levels.clone(),
        };
        let keep = cfg.pools();
        let mut map = self.map();
        map.retain(|h, _| keep.iter().any(|k| k.as_bytes() == h.as_bytes()));
        for (h, p) in map.iter() {
            p.set_config(cfg.pool_config(&h.to_string()), cfg.levels.as_ref());
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

    /// A PE failed like a dead one (refused, reset, broken, or no answer in time): counted,
    /// and ejected by passive health unless the pool's ejection cap is reached. Returns
    /// whether it ejected the PE.
    pub fn failed(&self, b: &Backend) -> bool {
        let pool = self.get(&b.pool);
        let may_eject = pool.as_ref().is_none_or(|p| p.lock().may_eject());
        let ejected = b.failed(&self.settings.health, may_eject);
        pool.map_or(ejected, |p| p.ejected(EjectCause::Failures, ejected))
    }

    /// An answer from a PE, for outlier detection: enough 5xx in a row (the pool's
    /// `consecutive-5xx`) eject it (within the pool's ejection cap), and it counts for the
    /// success-rate rule.
    pub fn answered(&self, pool: &Pool, b: &Backend, code: u16) {
        b.answers.note(Some(code));
        if (500..600).contains(&code) {
            let limit = pool.lock().config.consecutive_5xx;
            if b.answered(code, limit) {
                let may_eject = pool.lock().may_eject();
                let cause = EjectCause::Consecutive5xx;
                pool.ejected(cause, b.eject(&self.settings.health, cause, may_eject));
            }
        } else {
            b.answered(code, 0);
        }
        self.success_rate_due(pool);
    }

    /// Runs the success-rate rule on `pool` when its interval is over.
    fn success_rate_due(&self, pool: &Pool) {
        let now = clock_ms(Instant::now());
        let due = pool.success_rate_due_ms.load(Ordering::Relaxed);
        if due > now {
            return;
        }
        let (interval, rule) = {
            let st = pool.lock();
            let c = &st.config;
            let rule = SuccessRateRule {
                min_hosts: c.success_rate_min_hosts,
                min_requests: c.success_rate_min_requests,
                stdev_factor: c.success_rate_stdev_factor,
            };
            (c.success_rate_interval_ms, rule)
        };
        let next = now + interval.max(1000);
        // One answer of many runs it; the first interval starts now.
        if pool
            .success_rate_due_ms
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
            || due == 0
            || interval == 0
        {
            return;
        }
        let backends = pool.backends();
        let samples: Vec<(u32, u64, u64)> = backends
            .iter()
            .map(|b| {
                let (good, all) = b.answers.take();
                (b.id, good, all)
            })
            .collect();
        for id in success_rate_outliers(rule, &samples) {
            if let Some(b) = backends.iter().find(|b| b.id == id) {
                let may_eject = pool.lock().may_eject();
                let cause = EjectCause::SuccessRate;
                pool.ejected(cause, b.eject(&self.settings.health, cause, may_eject));
            }
        }
    }

    /// A PE is overloaded, not dead (its connect timed out, or it answered 503): it gets no
    /// new work for the pool's `busy-ms` while others have room, and is not ejected.
    pub fn busy(&self, b: &Backend) {
        let ms = self.get(&b.pool).map_or(1000, |p| p.lock().config.busy_ms);
        b.busy(Duration::from_millis(ms));
    }

    /// A PE could not be reached: eject it locally (per passive health) and tell a registrar.
    /// `b` failed a request or connection, which now goes to another PE (or gets an error).
    pub fn unreachable(&self, b: &Backend) {
        b.stats.failovers.fetch_add(1, Ordering::Relaxed);
        self.failed(b);
        if b.report_due() {
            let _ = self.reports.send(Unreachable {
                pool: b.pool.clone(),
                pe_id: b.id,
            });
        }
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
            .map(|p| {
                let (panic, panics) = p.panic();
                let slow_start = Duration::from_millis(p.lock().config.slow_start_ms);
                PoolSnapshot {
                    pool: p.handle.to_string(),
                    panic,
                    panics,
                    refreshed_ms_ago: p.age().map(|a| a.as_millis() as u64),
                    retries_refused: p.retries_refused(),
                    circuit_refused: p.circuit_refused(),
                    pool_elements: p
                        .backends()
                        .iter()
                        .map(|b| b.snapshot(now, slow_start))
                        .collect(),
                    levels: p
                        .level_stats()
                        .into_iter()
                        .filter(|l| l.admitted + l.shed + l.timed_out > 0 || l.waiting > 0)
                        .collect(),
                }
            })
            .collect()
    }
}

#[derive(Debug, Serialize)]
pub struct PoolSnapshot {
    pub pool: String,
    pub refreshed_ms_ago: Option<u64>,
    /// In panic mode: too few healthy PEs, so requests spread over all of them.
    pub panic: bool,
    /// Times panic mode began.
    pub panics: u64,
    /// Retries the retry budget refused.
    pub retries_refused: u64,
    /// Requests the circuit breaker (`max-requests`) refused.
    pub circuit_refused: u64,
    pub pool_elements: Vec<BackendSnapshot>,
    /// Per service level: the levels that have seen requests.
    pub levels: Vec<LevelStats>,
}

/// A pool's admission settings from its `[pool.X]` section and `[levels]`.
fn admission_config(pool: &PoolConfig, levels: Option<&LevelsConfig>) -> AdmissionConfig {
    let timeout = Duration::from_millis(pool.queue_timeout_ms);
    let Some(l) = levels else {
        return AdmissionConfig::single(pool.queue, timeout);
    };
    AdmissionConfig {
        domains: l.domains(),
        discipline: l.scheduler.into(),
        half_life: Duration::from_millis(l.half_life_ms),
        queue: pool.queue,
        level_queue: (1..=l.count)
            .map(|n| l.queue_limit(n).unwrap_or(pool.queue))
            .collect(),
        level_timeout: (1..=l.count)
            .map(|n| l.queue_timeout_ms(n).map_or(timeout, Duration::from_millis))
            .collect(),
    }
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ u64::from(std::process::id()).rotate_left(32)
}

/// The admission path's cost per request: `tasks` clients loop (admit at a level of
/// 1 ..= `levels`, start, finish) through a pool of two PEs. With `limited` (`max-conn = 1`)
/// every admission queues and every finish hands its place on; without, every admission
/// takes the fast path. `levels` `None` is a pool without `[levels]`. Returns the time per
/// request on the current (one) thread, task wakeups included. For the `levels` benchmark;
/// the PEs are never connected to.
#[doc(hidden)]
pub async fn admission_cost(
    levels: Option<usize>,
    limited: bool,
    tasks: usize,
    per_task: u32,
) -> Duration {
    use rserpool_wire::{Policy, Protocol};
    let pool = Arc::new(Pool::new(PoolHandle::from("AdmissionCost")));
    let cfg = PoolConfig {
        max_conn: limited.then_some(1),
        queue: tasks * 2,
        queue_timeout_ms: 60_000,
        ..PoolConfig::default()
    };
    let count = levels.unwrap_or(1).clamp(1, 64);
    let lv = levels.map(|_| LevelsConfig {
        count,
        ..LevelsConfig::default()
    });
    pool.set_config(cfg, lv.as_ref());
    let pes = (1..=2)
        .map(|id| crate::balance::backend::loopback_pe(id, Protocol::TCP, 1, Policy::RoundRobin))
        .collect();
    pool.update(pes);
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let pool = pool.clone();
        set.spawn(async move {
            for i in 0..per_task {
                let level = 1 + (t + i as usize) % count;
                let Ok(b) = pool.admit(level, &[]).await else {
                    continue;
                };
                b.start();
                b.pick_done();
                tokio::task::yield_now().await;
                pool.finished(&b, level, Duration::from_micros(100));
            }
        });
    }
    while set.join_next().await.is_some() {}
    started.elapsed() / (tasks as u32 * per_task).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::backend::loopback_pe;
    use rserpool_wire::{Policy, Protocol};

    fn pe(id: u32, protocol: Protocol) -> PoolElement {
        loopback_pe(id, protocol, 1, Policy::RoundRobin)
    }

    /// PEs the proxy cannot reach over TCP are not its backends: it would find them
    /// unreachable and report them to the registrar, though they are alive.
    #[test]
    fn pes_over_another_transport_than_tcp_are_left_out() {
        let pool = Pool::new(PoolHandle::from("Mixed"));
        pool.update(vec![pe(1, Protocol::TCP), pe(2, Protocol::SCTP_DATA_ONLY)]);
        let ids: Vec<u32> = pool.backends().iter().map(|b| b.id).collect();
        assert_eq!(ids, vec![1]);
        pool.update(vec![pe(2, Protocol::SCTP_DATA_ONLY)]);
        assert!(pool.is_empty());
    }
}
