//! A pool element as the proxy uses it: where to connect, what the proxy saw of its health,
//! its counters, its credits and its reusable connections (a set per protocol, `conns`).
//!
//! In flight: the requests (connections in TCP mode) under way at the PE plus the picks of it
//! not yet under way; the proxy-local selections (least connections, P2C, Prequal-style) go
//! by it. For the Prequal-style selection the proxy also keeps the PE's latency (request sent
//! to response head; connect in TCP mode) per number in flight when the request was sent,
//! as a moving average: Prequal's latency estimate at the current load.
//!
//! Credits (policy `credits`, docs/CREDITS.md): the PE reports how much work it can take now,
//! and that figure already counts the requests this proxy had in flight there. Until the next
//! report the proxy spends from it locally: each request it starts there takes one, and each
//! of its requests there that finishes gives one back — the slot it held is free, and waiting
//! for the PE to say so would leave it idle for a sampling period and a push. Nor does the
//! proxy ever have more in flight at a PE than the PE's capacity. (When the PE's accept queue
//! holds connections of other clients, a finished request's slot goes to one of them, and
//! the credit given back is one too many until the PE's next report.) A pick reserves
//! a credit until its request is under way (or its connection failed), so that requests picked
//! at the same moment do not all spend the same credit.
//!
//! The registrar's view of a PE is refreshed every interval; what the proxy learns itself
//! lives here and outlives refreshes while the registrar keeps listing the PE at the same
//! addresses. Passive health: a PE that fails `max-fails` times in a row is ejected locally
//! for a back-off that doubles with every ejection in a row and is forgotten after a success.

use crate::balance::conns::Conns;
use crate::balance::outlier::{AnswerWindow, EjectCause};

use rserpool_wire::{PoolElement, PoolHandle, UserTransport};
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tracing::warn;

/// A PE is reported unreachable to a registrar at most this often (per proxy).
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Settings of passive health.
#[derive(Debug, Clone)]
pub struct HealthSettings {
    /// Failures in a row that eject a PE.
    pub max_fails: u32,
    /// First ejection; doubled per ejection in a row up to `eject_max`.
    pub eject: Duration,
    pub eject_max: Duration,
}

/// A pool element: where to connect, its counters, its health and (in HTTP mode) its
/// reusable connections.
#[derive(Debug)]
pub struct Backend {
    pub pool: PoolHandle,
    pub id: u32,
    pub addrs: Vec<SocketAddr>,
    pub stats: BackendStats,
    health: Mutex<Health>,
    /// When the ejection and the busy back-off end, in ms of [`clock_ms`], read by every pick
    /// without the lock.
    ejected_until_ms: AtomicU64,
    busy_until_ms: AtomicU64,
    /// When the PE was last reported unreachable to a registrar, in ms of [`clock_ms`] (0:
    /// never).
    reported_ms: AtomicU64,
    /// 5xx answers in a row (503 aside).
    fives: std::sync::atomic::AtomicU32,
    /// Answers in the success-rate rule's current interval.
    pub(crate) answers: AnswerWindow,
    /// When the proxy first saw the PE, in ms of [`clock_ms`]: slow start ramps from it (or
    /// from the end of the last ejection).
    joined_ms: u64,
    /// Connections kept for reuse, of whatever protocol the pool speaks.
    pub(crate) conns: Conns,
    /// The credits last reported (−1: none yet), and the capacity reported with them.
    credit_reported: AtomicI64,
    credit_capacity: AtomicI64,
    /// `stats.active` when they were.
    credit_base: AtomicU64,
    /// Picks not yet under way.
    picking: AtomicI64,
    /// What the PE's policy says it can take relative to the others (a WRR weight, a credits
    /// capacity; 1 when it says nothing): least connections and P2C compare in flight per
    /// weight, as HAProxy's `leastconn` with server weights.
    weight: std::sync::atomic::AtomicU32,
    /// Latency in µs (moving average) by requests in flight when sent, 0 = none seen.
    latency_us: [AtomicU64; LATENCY_BUCKETS],
}

/// Milliseconds since the process's first look at the clock: a time an atomic can hold.
pub(crate) fn clock_ms(t: Instant) -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    t.saturating_duration_since(epoch).as_millis() as u64 + 1
}

/// In flight 0 .. 15, and 16 or more.
const LATENCY_BUCKETS: usize = 17;

#[derive(Debug, Default)]
struct Health {
    fails: u32,
    ejections: u32,
    ejected_until: Option<Instant>,
}

/// How much a selection should avoid a PE, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Avoid {
    /// Healthy.
    No,
    /// Busy: its connect timed out or it answered 503; not dead.
    Busy,
    /// Ejected as dead by passive health.
    Ejected,
}

/// Per-PE counters, shown by the stats endpoint.
#[derive(Debug, Default)]
pub struct BackendStats {
    /// Connections (TCP mode) or requests (HTTP mode) sent to this PE.
    pub requests: AtomicU64,
    /// Connections opened to this PE; in HTTP mode far fewer than requests while kept-alive
    /// connections are reused.
    pub connections: AtomicU64,
    pub active: AtomicU64,
    pub failures: AtomicU64,
    pub ejections: AtomicU64,
    /// Ejections by cause, in the order of [`EjectCause::ALL`].
    pub ejections_by: [AtomicU64; 3],
    /// Ejections the pool's `max-ejection-percent` refused (the PE failed, but too many of
    /// the pool were ejected already).
    pub ejections_capped: AtomicU64,
    /// Times the PE was found busy (connect timeout, 503) and got no new work for a while.
    pub busy: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub responses_5xx: AtomicU64,
    /// Requests or connections moved on to another PE after this one failed them.
    pub failovers: AtomicU64,
    /// Time to the response head (HTTP) or to the connection (TCP).
    pub latency: rserpool_status::metrics::LatencyHistogram,
}

impl Backend {
    pub(crate) fn new(pool: &PoolHandle, pe: &PoolElement) -> Self {
        Self {
            pool: pool.clone(),
            id: pe.id,
            addrs: addrs_of(pe),
            stats: BackendStats::default(),
            health: Mutex::new(Health::default()),
            ejected_until_ms: AtomicU64::new(0),
            reported_ms: AtomicU64::new(0),
            busy_until_ms: AtomicU64::new(0),
            joined_ms: clock_ms(Instant::now()),
            fives: std::sync::atomic::AtomicU32::new(0),
            answers: AnswerWindow::default(),
            conns: Conns::default(),
            credit_reported: AtomicI64::new(-1),
            credit_capacity: AtomicI64::new(0),
            credit_base: AtomicU64::new(0),
            picking: AtomicI64::new(0),
            weight: std::sync::atomic::AtomicU32::new(1),
            latency_us: Default::default(),
        }
    }

    /// A pick of this PE: counted in flight (and against its credit) until
    /// [`pick_done`](Self::pick_done).
    pub(crate) fn reserve(&self) {
        self.picking.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests under way at the PE and picks of it not yet under way.
    pub fn in_flight(&self) -> u64 {
        self.stats.active.load(Ordering::Relaxed)
            + self.picking.load(Ordering::Relaxed).max(0) as u64
    }

    /// A request is under way: counted as active; returns how many were before it.
    pub(crate) fn start(&self) -> u64 {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.stats.active.fetch_add(1, Ordering::Relaxed)
    }

    /// A request sent with `rif` others in flight got its answer after `latency`.
    pub(crate) fn note_latency(&self, rif: u64, latency: Duration) {
        self.stats.latency.observe(latency);
        let cell = &self.latency_us[(rif as usize).min(LATENCY_BUCKETS - 1)];
        let new = (latency.as_micros() as u64).max(1);
        let old = cell.load(Ordering::Relaxed);
        // Weight 1/8 for the new sample; a lost race loses one sample, which is fine.
        let avg = if old == 0 {
            new
        } else {
            old - old / 8 + new / 8
        };
        cell.store(avg.max(1), Ordering::Relaxed);
    }

    /// The latency expected for a request sent now, in µs: the average at the current number
    /// in flight, else at the nearest number with one; 0 (try it) when none was seen.
    pub fn latency_estimate(&self) -> u64 {
        let at = (self.in_flight() as usize).min(LATENCY_BUCKETS - 1);
        let get = |i: usize| self.latency_us[i].load(Ordering::Relaxed);
        (0..LATENCY_BUCKETS)
            .flat_map(|d| [at.checked_sub(d), Some(at + d)])
            .flatten()
            .filter(|&i| i < LATENCY_BUCKETS)
            .map(get)
            .find(|&v| v != 0)
            .unwrap_or(0)
    }

    /// The request picked is under way (counted in `stats.active`) or will not be: its
    /// reservation, if it made one, ends.
    pub fn pick_done(&self) {
        let _ = self
            .picking
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n > 0).then_some(n - 1)
            });
    }

    /// The PE's weight from its policy (see the field).
    pub(crate) fn note_weight(&self, weight: u32) {
        self.weight.store(weight.max(1), Ordering::Relaxed);
    }

    /// In flight per weight (with the pick at hand, scaled): what least connections and P2C
    /// compare. With every weight 1 it orders as in flight does.
    /// Its weight (from the WRR weight or the credits capacity; 1 otherwise).
    pub(crate) fn weight(&self) -> u64 {
        u64::from(self.weight.load(Ordering::Relaxed).max(1))
    }

    pub(crate) fn load_per_weight(&self) -> u64 {
        ((self.in_flight() + 1) << 16) / u64::from(self.weight.load(Ordering::Relaxed).max(1))
    }

    /// Requests (connections in TCP mode) sent to the PE so far.
    pub fn requests(&self) -> u64 {
        self.stats.requests.load(Ordering::Relaxed)
    }

    /// A new credit report from the PE.
    pub(crate) fn note_credits(&self, credits: u32, capacity: u32) {
        self.credit_base
            .store(self.stats.active.load(Ordering::Relaxed), Ordering::Relaxed);
        self.credit_capacity
            .store(i64::from(capacity), Ordering::Relaxed);
        self.credit_reported
            .store(i64::from(credits), Ordering::Relaxed);
    }

    /// The credits left by the proxy's count (see the module docs). `None` before the first
    /// report.
    pub fn credits_left(&self) -> Option<i64> {
        let reported = self.credit_reported.load(Ordering::Relaxed);
        if reported < 0 {
            return None;
        }
        let base = self.credit_base.load(Ordering::Relaxed) as i64;
        let capacity = self.credit_capacity.load(Ordering::Relaxed);
        let active = self.stats.active.load(Ordering::Relaxed) as i64;
        let reserved = self.picking.load(Ordering::Relaxed);
        // Started since the report less finished since: may be negative.
        let started = active - base;
        Some((reported - started).min(capacity - active) - reserved)
    }

    /// Whether `pe` (as a registrar reports it) is still this PE at the same addresses.
    pub(crate) fn is_at(&self, pe: &PoolElement) -> bool {
        self.addrs == addrs_of(pe)
    }

    fn health(&self) -> MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_ejected(&self, now: Instant) -> bool {
        self.avoid(now) == Avoid::Ejected
    }

    /// Whether (and how much) a selection should avoid the PE now.
    pub(crate) fn avoid(&self, now: Instant) -> Avoid {
        let now = clock_ms(now);
        if now < self.ejected_until_ms.load(Ordering::Relaxed) {
            Avoid::Ejected
        } else if now < self.busy_until_ms.load(Ordering::Relaxed) {
            Avoid::Busy
        } else {
            Avoid::No
        }
    }

    /// An answer's status, for outlier detection: whether it made `limit` 5xx in a row (503
    /// aside, which means busy), after which the count starts again.
    pub(crate) fn answered(&self, code: u16, limit: u32) -> bool {
        if !(500..600).contains(&code) || code == 503 {
            if self.fives.load(Ordering::Relaxed) != 0 {
                self.fives.store(0, Ordering::Relaxed);
            }
            return false;
        }
        let n = self.fives.fetch_add(1, Ordering::Relaxed) + 1;
        if limit == 0 || n < limit {
            return false;
        }
        self.fives.store(0, Ordering::Relaxed);
        true
    }

    /// Slow start: the share of its full load the PE should take now, ramping linearly over
    /// `window` from when it joined or its last ejection ended (at least 5 %); 1 after it.
    pub(crate) fn ramp(&self, now: Instant, window: Duration) -> f64 {
        if window.is_zero() {
            return 1.0;
        }
        let from = self
            .joined_ms
            .max(self.ejected_until_ms.load(Ordering::Relaxed));
        let since = clock_ms(now).saturating_sub(from) as f64;
        (since / window.as_millis() as f64).clamp(0.05, 1.0)
    }

    /// Whether to report the PE unreachable to a registrar now: at most once per
    /// [`REPORT_EVERY`], however many requests fail (each failure of a burst was reported:
    /// 63,000 ENDPOINT_UNREACHABLEs in 3 s, in a walkthrough).
    pub(crate) fn report_due(&self) -> bool {
        self.report_due_at(clock_ms(Instant::now()))
    }

    /// [`report_due`](Self::report_due) at `now` ms of [`clock_ms`].
    fn report_due_at(&self, now: u64) -> bool {
        let last = self.reported_ms.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= REPORT_EVERY.as_millis() as u64)
            && self
                .reported_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The PE is overloaded, not dead: no new work for `back_off` while others have room.
    pub(crate) fn busy(&self, back_off: Duration) {
        self.stats.busy.fetch_add(1, Ordering::Relaxed);
        let until = clock_ms(Instant::now() + back_off);
        self.busy_until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Until when the PE is (or was last) ejected.
    pub(crate) fn ejected_until(&self) -> Option<Instant> {
        self.health().ejected_until
    }

    /// A failure: returns true if it ejected the PE. With `may_eject` false (the pool's
    /// ejection cap is reached) the failure is counted and the PE stays.
    pub fn failed(&self, s: &HealthSettings, may_eject: bool) -> bool {
        self.answers.note(None);
        let mut h = self.health();
        h.fails += 1;
        let ejected = if h.fails < s.max_fails.max(1) {
            false
        } else {
            drop(h);
            self.eject(s, EjectCause::Failures, may_eject)
        };
        // Counted once the ejection is done: whoever sees the count sees the PE out.
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        ejected
    }

    /// Ejects the PE for `cause`, for a back-off that doubles with every ejection in a row;
    /// with `may_eject` false (the pool's ejection cap is reached) only counts that it would
    /// have. Returns whether it ejected.
    pub(crate) fn eject(&self, s: &HealthSettings, cause: EjectCause, may_eject: bool) -> bool {
        if !may_eject {
            self.stats.ejections_capped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let mut h = self.health();
        h.fails = 0;
        if h.ejected_until.is_some_and(|u| u > Instant::now()) {
            // Out already: the failures of requests sent before its ejection (a burst fails
            // at once) neither eject it again nor double its back-off.
            return false;
        }
        let back_off = s
            .eject
            .saturating_mul(1 << h.ejections.min(16))
            .min(s.eject_max);
        h.ejections += 1;
        let until = Instant::now() + back_off;
        h.ejected_until = Some(until);
        drop(h);
        self.ejected_until_ms
            .store(clock_ms(until), Ordering::Relaxed);
        self.stats.ejections.fetch_add(1, Ordering::Relaxed);
        self.stats.ejections_by[cause.index()].fetch_add(1, Ordering::Relaxed);
        self.conns.drop_idle();
        warn!(
            "pool {} PE {:#010x} ejected for {} ms ({})",
            self.pool,
            self.id,
            back_off.as_millis(),
            cause.name()
        );
        true
    }

    pub fn succeeded(&self) {
        let mut h = self.health();
        if h.fails != 0 || h.ejections != 0 {
            *h = Health::default();
            self.ejected_until_ms.store(0, Ordering::Relaxed);
        }
    }

    /// The PE left the pool (or moved): its connections go and none are kept.
    pub(crate) fn retire(&self) {
        self.conns.close();
    }

    /// Connects to the PE (each of its addresses in turn) within the connect timeout.
    pub async fn connect(&self, timeout: Duration) -> std::io::Result<TcpStream> {
        self.connect_with(timeout, &plain_socket).await
    }

    /// [`connect`](Self::connect) from sockets that `socket` makes for each address (the
    /// kernel splice binds and watches them first).
    pub(crate) async fn connect_with(
        &self,
        timeout: Duration,
        socket: &(dyn Fn(SocketAddr) -> std::io::Result<tokio::net::TcpSocket> + Sync),
    ) -> std::io::Result<TcpStream> {
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "PE has no address");
        for &a in &self.addrs {
            let attempt = async { socket(a)?.connect(a).await };
            match tokio::time::timeout(timeout, attempt).await {
                Ok(Ok(s)) => {
                    let _ = s.set_nodelay(true);
                    self.stats.connections.fetch_add(1, Ordering::Relaxed);
                    return Ok(s);
                }
                Ok(Err(e)) => last = e,
                Err(_) => {
                    last = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
                }
            }
        }
        Err(last)
    }

    /// The PE and its counters as the stats endpoint shows them.
    pub fn snapshot(&self, now: Instant, slow_start: Duration) -> BackendSnapshot {
        let s = &self.stats;
        let by = |c: EjectCause| s.ejections_by[c.index()].load(Ordering::Relaxed);
        BackendSnapshot {
            id: format!("{:#010x}", self.id),
            addrs: self.addrs.iter().map(|a| a.to_string()).collect(),
            ejected: self.is_ejected(now),
            busy: self.avoid(now) == Avoid::Busy,
            ramp: self.ramp(now, slow_start),
            requests: s.requests.load(Ordering::Relaxed),
            connections: s.connections.load(Ordering::Relaxed),
            active: s.active.load(Ordering::Relaxed),
            in_flight: self.in_flight(),
            latency_us: self.latency_estimate(),
            credits: self.credits_left(),
            failures: s.failures.load(Ordering::Relaxed),
            ejections: s.ejections.load(Ordering::Relaxed),
            ejections_by_cause: EjectCause::ALL.map(|c| (c.name(), by(c))).into(),
            responses_5xx: s.responses_5xx.load(Ordering::Relaxed),
            failovers: s.failovers.load(Ordering::Relaxed),
            bytes_in: s.bytes_in.load(Ordering::Relaxed),
            bytes_out: s.bytes_out.load(Ordering::Relaxed),
        }
    }
}

/// A PE record at 127.0.0.1:`port`, for tests and benchmarks that never connect to it.
#[doc(hidden)]
pub(crate) fn loopback_pe(
    id: u32,
    protocol: rserpool_wire::Protocol,
    port: u16,
    policy: rserpool_wire::Policy,
) -> PoolElement {
    PoolElement {
        id,
        home_registrar: 0,
        registration_life: -1,
        user_transport: UserTransport::Address(rserpool_wire::TransportAddress {
            protocol,
            port,
            addresses: vec![std::net::IpAddr::from([127, 0, 0, 1])].into(),
        }),
        policy,
        asap_transport: None,
    }
}

fn addrs_of(pe: &PoolElement) -> Vec<SocketAddr> {
    match &pe.user_transport {
        UserTransport::Address(t) => t.socket_addrs().collect(),
        UserTransport::Opaque(_) => Vec::new(),
    }
}

#[derive(Debug, Serialize)]
pub struct BackendSnapshot {
    pub id: String,
    pub addrs: Vec<String>,
    pub ejected: bool,
    /// Found busy lately (connect timeout, 503): no new work while others have room.
    pub busy: bool,
    /// Its share under slow start (1: full; below while it ramps up).
    pub ramp: f64,
    pub requests: u64,
    pub connections: u64,
    pub active: u64,
    /// Active plus picks not yet under way: what least connections and P2C compare.
    pub in_flight: u64,
    /// The Prequal-style latency estimate at the current number in flight (0: none seen).
    pub latency_us: u64,
    /// Credits left by the proxy's count (policy `credits`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credits: Option<i64>,
    pub failures: u64,
    pub ejections: u64,
    /// Ejections by cause: failures (in a row), 5xx (in a row), success-rate.
    pub ejections_by_cause: std::collections::BTreeMap<&'static str, u64>,
    pub responses_5xx: u64,
    pub failovers: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// A socket of `addr`'s family, as `TcpStream::connect` makes it.
pub(crate) fn plain_socket(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a_backend() -> Backend {
        let pe = loopback_pe(
            7,
            rserpool_wire::Protocol::TCP,
            9,
            rserpool_wire::Policy::RoundRobin,
        );
        Backend::new(&PoolHandle::from("P"), &pe)
    }

    /// A burst of requests sent before the PE failed all fail at once: one ejection, not one
    /// per request with the back-off doubled each time (1 s to 30 s and a warning each, in a
    /// walkthrough); once the ejection is over, the next failure doubles it.
    #[test]
    fn a_burst_of_failures_ejects_a_pe_once() {
        let b = a_backend();
        let s = HealthSettings {
            max_fails: 1,
            eject: Duration::from_millis(50),
            eject_max: Duration::from_secs(30),
        };
        let ejected = (0..40).filter(|_| b.failed(&s, true)).count();
        assert_eq!(ejected, 1);
        let until = b.ejected_until().unwrap();
        assert!(until <= Instant::now() + Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            b.failed(&s, true),
            "failing again after the ejection ejects again"
        );
        let again = b.ejected_until().unwrap();
        assert!(
            again > Instant::now() + Duration::from_millis(60),
            "doubled"
        );
        assert_eq!(b.stats.failures.load(Ordering::Relaxed), 41);
    }

    #[test]
    fn a_pe_is_reported_unreachable_once_a_second_at_most() {
        let b = a_backend();
        assert_eq!((0..1000).filter(|i| b.report_due_at(50 + i)).count(), 1);
        assert!(!b.report_due_at(1049));
        assert!(b.report_due_at(1050), "due again a second on");
    }
}
