//! The pool user's protocol state machine, sans-IO.
//!
//! With a stale-cache value above zero (RFC 5352 §7.2) the pool user asks the registrar for the
//! whole pool, keeps it in a local handlespace and selects by the pool's policy itself until the
//! entry is older than the stale-cache value; with zero (the default, as in rsplib's tools) every
//! resolution asks the registrar. A pool element that cannot be reached is reported with
//! ENDPOINT_UNREACHABLE and dropped from the cache.
//!
//! Queries ([`PuCore::resolve`], [`PuCore::pool_elements`], [`PuCore::report_unreachable`]) are
//! served one at a time, in order, over one association with a registrar; each is answered by a
//! [`PuEvent::Answered`] with its [`QueryId`]. Connecting tries the known registrars (configured,
//! then announced) in turn from the last one that worked; a handle resolution that fails on an
//! association (closed, no answer in time, bad input) moves to the next registrar and tries
//! again, once per registrar known.
//!
//! With [`PoolUserConfig::subscribe`], [`PuCore::pool_elements`] also asks the registrar to push
//! the pool again whenever it changes (RFC 5352's S bit); each push is a [`PuEvent::Pushed`].

use super::{Action, ConnId, Instant, Outbox, earliest};
use crate::Error;
use crate::registrars::RegistrarSet;
use rserpool_handlespace::Handlespace;
use rserpool_wire::{Address, AsapMessage, CauseCode, Policy, PoolElement, PoolHandle, Scheme};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;
use tracing::debug;

#[derive(Debug, Clone)]
pub struct PoolUserConfig {
    pub registrars: Vec<SocketAddr>,
    /// The registrars of `registrars` reached over SCTP, with how (the others: TCP); see
    /// [`set_registrars`](Self::set_registrars).
    pub registrar_schemes: BTreeMap<SocketAddr, Scheme>,
    /// Listen for SERVER_ANNOUNCE here (UDP; multicast groups are joined).
    pub announce_listen: Option<SocketAddr>,
    /// How long a resolution may be served from the cache (0 = no cache).
    pub stale_cache: Duration,
    /// PEs to ask for per resolution without a cache (Handle Resolution Option); `None` lets
    /// the registrar decide (MaxHResItems).
    pub items: Option<u32>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// Ask for every pool fetched with [`PuCore::pool_elements`] to be pushed again whenever
    /// it changes (the S bit; [`PuEvent::Pushed`]), for the life of the association with the
    /// registrar. A pool user that keeps its own copy of a pool (the proxy) sees new PEs,
    /// departures and policy information (credits) within a registrar hop.
    pub subscribe: bool,
    /// TLS with the registrars (RFC 5355): this process's certificate and the CA; `None`:
    /// plain TCP.
    pub tls: Option<std::sync::Arc<rserpool_tls::Tls>>,
}

impl PoolUserConfig {
    /// The registrars, each over the transport its address names (`tcp://`, `sctp+udp://`…).
    pub fn set_registrars(&mut self, registrars: &[Address]) {
        (self.registrars, self.registrar_schemes) = crate::registrars::split(registrars);
    }
}

impl Default for PoolUserConfig {
    fn default() -> Self {
        Self {
            registrars: vec![SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))],
            registrar_schemes: BTreeMap::new(),
            announce_listen: None,
            stale_cache: Duration::ZERO,
            items: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(3),
            subscribe: false,
            tls: None,
        }
    }
}

/// The answer to a handle resolution.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub pool_handle: PoolHandle,
    pub policy: Option<Policy>,
    /// In the order to try them.
    pub pool_elements: Vec<PoolElement>,
    /// The registrar that answered; `None` when served from the cache.
    pub registrar: Option<SocketAddr>,
}

/// Names a query until its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueryId(u64);

/// What a query got.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A handle resolution's answer, or the pool's PEs.
    Resolution(Resolution),
    /// The ENDPOINT_UNREACHABLE went out.
    Reported,
}

/// What the pool user tells its application.
#[derive(Debug)]
pub enum PuEvent {
    Answered(QueryId, Result<Answer, Error>),
    /// A subscribed pool as it is now, pushed by the registrar (no PEs: the pool is gone).
    Pushed(Resolution),
}

#[derive(Debug, Clone)]
enum Ask {
    /// A resolution for [`PuCore::resolve`] (through the cache when there is one).
    Resolve(PoolHandle),
    /// Every PE of the pool, bypassing the cache.
    Pool(PoolHandle),
    Unreachable(PoolHandle, u32),
}

struct Query {
    id: QueryId,
    ask: Ask,
    /// Registrars still to try after the current one.
    attempts: usize,
    /// Deadline for the answer, once sent.
    sent: Option<Instant>,
}

enum Assoc {
    None,
    Connecting {
        conn: ConnId,
        addr: SocketAddr,
        candidates: Vec<SocketAddr>,
        /// Offset from `next_registrar` of `addr` in `candidates`.
        offset: usize,
        failures: Vec<String>,
        deadline: Instant,
    },
    Up {
        conn: ConnId,
        addr: SocketAddr,
        /// The registrar has answered on it: a close found when the next query goes out is
        /// of a kept association gone stale (the registrar restarted), not the registrar's
        /// answer to that query.
        answered: bool,
    },
}

/// A pool user's protocol state; see the module docs.
pub struct PuCore {
    cfg: PoolUserConfig,
    registrars: RegistrarSet,
    out: Outbox<PuEvent>,
    assoc: Assoc,
    next_registrar: usize,
    cache: Handlespace,
    /// When each cached pool was fetched, and its policy.
    fetched: HashMap<PoolHandle, (Instant, Option<Policy>)>,
    queue: VecDeque<Query>,
    current: Option<Query>,
    next_query: u64,
}

impl PuCore {
    pub fn new(cfg: PoolUserConfig) -> Self {
        Self {
            registrars: RegistrarSet::new(cfg.registrars.clone()),
            cfg,
            out: Outbox::new(),
            assoc: Assoc::None,
            next_registrar: 0,
            cache: Handlespace::new(rserpool_handlespace::Config::default()),
            fetched: HashMap::new(),
            queue: VecDeque::new(),
            current: None,
            next_query: 0,
        }
    }

    pub fn config(&self) -> &PoolUserConfig {
        &self.cfg
    }

    /// Resolves `handle`: from the cache when fresh (answered at once), else at a registrar.
    pub fn resolve(&mut self, handle: &PoolHandle, now: Instant) -> QueryId {
        if let Some(r) = self.cached(handle, now) {
            let id = self.query_id();
            self.out
                .event(PuEvent::Answered(id, Ok(Answer::Resolution(r))));
            return id;
        }
        self.submit(Ask::Resolve(handle.clone()), now)
    }

    /// Asks a registrar for every PE of the pool, bypassing the cache: for pool users that
    /// keep their own copy of a pool (the proxy) and select locally.
    pub fn pool_elements(&mut self, handle: &PoolHandle, now: Instant) -> QueryId {
        self.submit(Ask::Pool(handle.clone()), now)
    }

    /// Tells a registrar that a PE could not be reached (ENDPOINT_UNREACHABLE) and drops it
    /// from the cache.
    pub fn report_unreachable(&mut self, handle: &PoolHandle, pe_id: u32, now: Instant) -> QueryId {
        self.cache.deregister(handle.as_bytes(), pe_id);
        self.submit(Ask::Unreachable(handle.clone(), pe_id), now)
    }

    /// Drops the cached copy of a pool.
    pub fn forget(&mut self, handle: &PoolHandle) {
        let ids: Vec<u32> = self
            .cache
            .members(handle.as_bytes())
            .map(|r| self.cache.pe(r).element.id)
            .collect();
        for id in ids {
            self.cache.deregister(handle.as_bytes(), id);
        }
        self.fetched.remove(handle);
    }

    /// A SERVER_ANNOUNCE datagram from `from`.
    pub fn handle_announce(&mut self, datagram: &[u8], from: SocketAddr, now: Instant) {
        self.registrars.heard_announce(datagram, from, now);
    }

    /// A connection asked for with [`Action::Connect`] is up.
    pub fn handle_connected(&mut self, conn: ConnId, now: Instant) {
        if let Assoc::Connecting {
            conn: c,
            addr,
            candidates,
            offset,
            ..
        } = &self.assoc
            && *c == conn
        {
            self.next_registrar = (self.next_registrar + offset) % candidates.len().max(1);
            self.assoc = Assoc::Up {
                conn,
                addr: *addr,
                answered: false,
            };
            self.pump(now);
        }
    }

    /// A connection asked for with [`Action::Connect`] could not be opened (`why`, for the
    /// error that names the registrars tried).
    pub fn handle_connect_error(&mut self, conn: ConnId, why: &str, now: Instant) {
        if !self.out.closed(conn) {
            return;
        }
        self.connect_failed(conn, why, now);
    }

    /// The connection closed, or could not be opened.
    pub fn handle_close(&mut self, conn: ConnId, now: Instant) {
        if !self.out.closed(conn) {
            return;
        }
        match &self.assoc {
            Assoc::Connecting { conn: c, .. } if *c == conn => {
                self.connect_failed(conn, "connection closed", now);
            }
            Assoc::Up { conn: c, .. } if *c == conn => {
                self.attempt_failed(Error::Closed, now);
            }
            _ => {}
        }
    }

    /// Bytes read from a connection.
    pub fn handle_data(&mut self, conn: ConnId, data: &[u8], now: Instant) {
        let Assoc::Up {
            conn: c,
            addr,
            ref mut answered,
        } = self.assoc
        else {
            return;
        };
        if c != conn {
            return;
        }
        let (msgs, err) = self.out.messages(conn, data);
        // A whole message, not any bytes: a TLS registrar's alert to a plaintext pool user
        // is no answer, and its close would be taken for a kept association gone stale
        // (asked again at once, without end).
        *answered |= !msgs.is_empty();
        for m in msgs {
            if !self.out.is_open(conn) {
                return;
            }
            self.on_message(m, addr, now);
        }
        if let Some(e) = err
            && self.out.is_open(conn)
        {
            self.attempt_failed(Error::Decode(e), now);
        }
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout) has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let connect = match &self.assoc {
            Assoc::Connecting { deadline, .. } => Some(*deadline),
            _ => None,
        };
        earliest([connect, self.current.as_ref().and_then(|q| q.sent)])
    }

    /// Runs what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Assoc::Connecting { conn, deadline, .. } = self.assoc
            && deadline <= now
        {
            self.out.close(conn);
            self.connect_failed(conn, "timed out", now);
        }
        if self
            .current
            .as_ref()
            .and_then(|q| q.sent)
            .is_some_and(|d| d <= now)
        {
            self.attempt_failed(Error::Timeout, now);
        }
    }

    /// The next thing for the driver to do.
    pub fn poll_action(&mut self) -> Option<Action<PuEvent>> {
        self.out.poll()
    }

    fn query_id(&mut self) -> QueryId {
        self.next_query += 1;
        QueryId(self.next_query)
    }

    fn submit(&mut self, ask: Ask, now: Instant) -> QueryId {
        let id = self.query_id();
        self.queue.push_back(Query {
            id,
            ask,
            attempts: 0,
            sent: None,
        });
        self.pump(now);
        id
    }

    fn answer(&mut self, id: QueryId, r: Result<Answer, Error>) {
        self.out.event(PuEvent::Answered(id, r));
    }

    /// Serves the queries in order: connects if needed, sends the current one.
    fn pump(&mut self, now: Instant) {
        loop {
            if self.current.as_ref().is_some_and(|q| q.sent.is_some()) {
                return;
            }
            if self.current.is_none() {
                let Some(mut q) = self.queue.pop_front() else {
                    return;
                };
                q.attempts = match q.ask {
                    Ask::Unreachable(..) => 1,
                    _ => self.registrars.candidates(now).len().max(1),
                };
                self.current = Some(q);
            }
            match self.assoc {
                Assoc::Connecting { .. } => return,
                Assoc::None => {
                    let candidates = self.registrars.candidates(now);
                    if candidates.is_empty() {
                        self.fail_current(Error::NoRegistrarKnown);
                    } else {
                        self.connect(candidates, 0, Vec::new(), now);
                    }
                }
                Assoc::Up { conn, .. } => self.send_current(conn, now),
            }
        }
    }

    /// Connects to the candidate `offset` places after the last one that worked (`candidates`
    /// is not empty: the registrars known when the connecting began).
    fn connect(
        &mut self,
        candidates: Vec<SocketAddr>,
        offset: usize,
        failures: Vec<String>,
        now: Instant,
    ) {
        let addr = candidates[(self.next_registrar + offset) % candidates.len()];
        let conn = self.out.connect(addr);
        self.assoc = Assoc::Connecting {
            conn,
            addr,
            candidates,
            offset,
            failures,
            deadline: now + self.cfg.connect_timeout,
        };
    }

    fn connect_failed(&mut self, conn: ConnId, why: &str, now: Instant) {
        let Assoc::Connecting {
            conn: c,
            addr,
            candidates,
            offset,
            failures,
            ..
        } = std::mem::replace(&mut self.assoc, Assoc::None)
        else {
            return;
        };
        debug_assert_eq!(c, conn);
        let mut failures = failures;
        failures.push(format!("{addr}: {why}"));
        if offset + 1 < candidates.len() {
            self.connect(candidates, offset + 1, failures, now);
            return;
        }
        self.fail_current(Error::NoRegistrar(failures.join("; ")));
        self.pump(now);
    }

    fn fail_current(&mut self, e: Error) {
        if let Some(q) = self.current.take() {
            if let (Ask::Resolve(h), Error::UnknownPool(_) | Error::Refused(_)) = (&q.ask, &e) {
                self.forget(h);
            }
            self.answer(q.id, Err(e));
        }
    }

    fn send_current(&mut self, conn: ConnId, now: Instant) {
        let Some(q) = self.current.as_mut() else {
            return;
        };
        let msg = match &q.ask {
            Ask::Resolve(handle) => AsapMessage::HandleResolution {
                subscribe: false,
                pool_handle: handle.clone(),
                items: if self.cfg.stale_cache.is_zero() {
                    self.cfg.items
                } else {
                    Some(u32::MAX)
                },
            },
            Ask::Pool(handle) => AsapMessage::HandleResolution {
                subscribe: self.cfg.subscribe,
                pool_handle: handle.clone(),
                items: Some(u32::MAX),
            },
            Ask::Unreachable(handle, pe_id) => AsapMessage::EndpointUnreachable {
                pool_handle: handle.clone(),
                pe_id: *pe_id,
            },
        };
        self.out.send(conn, &msg);
        if matches!(q.ask, Ask::Unreachable(..)) {
            let id = q.id;
            self.current = None;
            self.answer(id, Ok(Answer::Reported));
        } else {
            q.sent = Some(now + self.cfg.request_timeout);
        }
    }

    /// The association failed while the current query was out: the next registrar is tried,
    /// unless every one has been. A kept association found closed is a stale one: the same
    /// registrar is asked again on a new one, and that costs the query no attempt (with one
    /// registrar that restarted, the first query after would fail otherwise).
    fn attempt_failed(&mut self, e: Error, now: Instant) {
        let mut stale = false;
        if let Assoc::Up {
            conn,
            addr,
            answered,
        } = std::mem::replace(&mut self.assoc, Assoc::None)
        {
            self.out.close(conn);
            stale = answered && matches!(e, Error::Closed);
            if stale {
                debug!("registrar {addr}: the kept association closed; asking again on a new one");
            } else {
                debug!("registrar {addr}: {e}; trying the next one");
            }
        }
        if !stale {
            self.next_registrar = self.next_registrar.wrapping_add(1);
        }
        if let Some(q) = self.current.as_mut()
            && q.sent.is_some()
        {
            q.sent = None;
            if !stale {
                q.attempts = q.attempts.saturating_sub(1);
                if q.attempts == 0 {
                    self.fail_current(e);
                }
            }
        }
        self.pump(now);
    }

    fn on_message(&mut self, msg: AsapMessage, registrar: SocketAddr, now: Instant) {
        let awaited = match self.current.as_ref().filter(|q| q.sent.is_some()) {
            Some(Query {
                ask: Ask::Resolve(h) | Ask::Pool(h),
                ..
            }) => Some(h),
            _ => None,
        };
        if let AsapMessage::HandleResolutionResponse {
            accept: true,
            pool_handle,
            ..
        } = &msg
            && self.cfg.subscribe
            && awaited != Some(pool_handle)
        {
            return self.on_push(msg, registrar);
        }
        let Some(q) = self.current.as_ref().filter(|q| q.sent.is_some()) else {
            return;
        };
        let handle = match &q.ask {
            Ask::Resolve(h) | Ask::Pool(h) => h.clone(),
            Ask::Unreachable(..) => return,
        };
        let (policy, pool_elements) = match msg {
            AsapMessage::HandleResolutionResponse {
                pool_handle,
                policy,
                pool_elements,
                error,
                ..
            } if pool_handle == handle => {
                if let Some(cause) = error.and_then(|e| e.causes.first().cloned()) {
                    if cause.code == CauseCode::LACK_OF_RESOURCES {
                        // A registrar still synchronising its handlespace: ask another.
                        self.attempt_failed(Error::Refused(cause.code), now);
                        return;
                    }
                    self.fail_current(if cause.code == CauseCode::UNKNOWN_POOL_HANDLE {
                        Error::UnknownPool(handle.to_string())
                    } else {
                        Error::Refused(cause.code)
                    });
                    self.pump(now);
                    return;
                }
                (policy, pool_elements)
            }
            AsapMessage::Error { error } => {
                let code = error
                    .causes
                    .first()
                    .map_or(CauseCode::UNSPECIFIED, |c| c.code);
                self.fail_current(Error::Refused(code));
                self.pump(now);
                return;
            }
            _ => return,
        };
        let Some(q) = self.current.take() else {
            return;
        };
        let r = match q.ask {
            Ask::Resolve(_) if !self.cfg.stale_cache.is_zero() => {
                self.fill_cache(&handle, policy, pool_elements, now);
                self.cached(&handle, now)
                    .map(|mut r| {
                        r.registrar = Some(registrar);
                        r
                    })
                    .ok_or_else(|| Error::UnknownPool(handle.to_string()))
            }
            _ => Ok(Resolution {
                pool_handle: handle,
                policy,
                pool_elements,
                registrar: Some(registrar),
            }),
        };
        self.answer(q.id, r.map(Answer::Resolution));
        self.pump(now);
    }

    /// A pool the registrar pushed to its subscriber.
    fn on_push(&mut self, msg: AsapMessage, registrar: SocketAddr) {
        let AsapMessage::HandleResolutionResponse {
            pool_handle,
            policy,
            pool_elements,
            error,
            ..
        } = msg
        else {
            return;
        };
        let pool_elements = if error.is_some() {
            Vec::new()
        } else {
            pool_elements
        };
        self.out.event(PuEvent::Pushed(Resolution {
            pool_handle,
            policy,
            pool_elements,
            registrar: Some(registrar),
        }));
    }

    fn fill_cache(
        &mut self,
        handle: &PoolHandle,
        policy: Option<Policy>,
        pool_elements: Vec<PoolElement>,
        now: Instant,
    ) {
        self.forget(handle);
        for pe in pool_elements {
            if let Err(e) = self.cache.register(handle, pe, now.as_millis()) {
                debug!("cache: PE not kept: {e}");
            }
        }
        self.fetched.insert(handle.clone(), (now, policy));
    }

    /// A resolution from the cache, if it holds the pool and is fresh.
    fn cached(&mut self, handle: &PoolHandle, now: Instant) -> Option<Resolution> {
        let (at, policy) = self.fetched.get(handle)?;
        if self.cfg.stale_cache.is_zero()
            || now.saturating_duration_since(*at) >= self.cfg.stale_cache
        {
            return None;
        }
        let policy = policy.clone();
        let mut refs = Vec::new();
        let n = self.cfg.items.unwrap_or(u32::MAX) as usize;
        if !self.cache.resolve(handle.as_bytes(), n, &mut refs) || refs.is_empty() {
            return None;
        }
        Some(Resolution {
            pool_handle: handle.clone(),
            policy,
            pool_elements: refs
                .iter()
                .map(|&r| self.cache.pe(r).element.clone())
                .collect(),
            registrar: None,
        })
    }
}
