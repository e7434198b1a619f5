//! A pool user: resolves pool handles at a registrar and connects to pool elements.
//!
//! The protocol (cache with a stale-cache value, resolution, ENDPOINT_UNREACHABLE reports,
//! registrar failover) is the sans-IO [`PuCore`]; its module docs say what it does. This is its
//! tokio driver: each call hands the core a query and carries out the core's actions until the
//! answer comes; the registrar association lives on between calls.
//! Connecting to a pool element (the application's own data) happens here: a PE that cannot be
//! reached is reported and the next one is tried.

use crate::Error;
use crate::core::pu::{Answer, PuCore, PuEvent, QueryId};
use crate::driver::{Conns, sleep_until};
use rserpool_wire::{Policy, PoolElement, PoolHandle};
use tokio::net::TcpStream;
use tracing::debug;

pub use crate::core::pu::{PoolUserConfig, Resolution};

pub struct PoolUser {
    core: PuCore,
    conns: Conns,
    /// Pools pushed while a call ran, for [`next_push`](Self::next_push).
    pushed: std::collections::VecDeque<Resolution>,
}

impl PoolUser {
    pub fn new(cfg: PoolUserConfig) -> std::io::Result<Self> {
        Ok(Self {
            conns: Conns::new(
                cfg.announce_listen,
                cfg.tls.clone(),
                cfg.registrar_schemes.clone(),
            )?,
            core: PuCore::new(cfg),
            pushed: std::collections::VecDeque::new(),
        })
    }

    /// Resolves `handle`: from the cache when fresh, else at a registrar.
    pub async fn resolve(&mut self, handle: &PoolHandle) -> Result<Resolution, Error> {
        let now = self.now();
        let q = self.core.resolve(handle, now);
        self.resolution(q).await
    }

    /// Asks a registrar for every PE of the pool, bypassing the cache: for pool users that
    /// keep their own copy of a pool (the proxy) and select locally.
    pub async fn pool_elements(
        &mut self,
        handle: &PoolHandle,
    ) -> Result<(Option<Policy>, Vec<PoolElement>), Error> {
        let now = self.now();
        let q = self.core.pool_elements(handle, now);
        let r = self.resolution(q).await?;
        Ok((r.policy, r.pool_elements))
    }

    /// Tells a registrar that a PE could not be reached (ENDPOINT_UNREACHABLE) and drops it
    /// from the cache.
    pub async fn report_unreachable(
        &mut self,
        handle: &PoolHandle,
        pe_id: u32,
    ) -> Result<(), Error> {
        let now = self.now();
        let q = self.core.report_unreachable(handle, pe_id, now);
        self.run(q).await.map(|_| ())
    }

    /// Connects to a PE of the pool, trying the resolved PEs in order; each one that refuses is
    /// reported unreachable. Returns the stream and the PE it reached.
    pub async fn connect(
        &mut self,
        handle: &PoolHandle,
    ) -> Result<(TcpStream, PoolElement), Error> {
        self.connect_avoiding(handle, &[]).await
    }

    /// Like [`connect`](Self::connect), but never to the PEs in `avoid` (ones that just
    /// failed, while the registrar may still list them).
    pub async fn connect_avoiding(
        &mut self,
        handle: &PoolHandle,
        avoid: &[u32],
    ) -> Result<(TcpStream, PoolElement), Error> {
        let timeout = self.core.config().connect_timeout;
        connect_avoiding(self, handle, avoid, timeout).await
    }

    /// Connects to one PE's user transport (each of its addresses in turn, each within the
    /// connect timeout); `None` also for a transport other than TCP.
    pub async fn connect_to(&self, pe: &PoolElement) -> Option<TcpStream> {
        connect_to(pe, self.core.config().connect_timeout).await
    }

    /// The pool's cached PEs are dropped: the next resolution asks a registrar.
    pub fn forget(&mut self, handle: &PoolHandle) {
        self.core.forget(handle);
    }

    pub(crate) fn connect_timeout(&self) -> std::time::Duration {
        self.core.config().connect_timeout
    }

    /// The next pool a registrar pushed ([`PoolUserConfig::subscribe`]; a pool is subscribed
    /// to by [`pool_elements`](Self::pool_elements)). No PEs: the pool is gone. Cancel-safe:
    /// meant for a `select!` beside other work; it also keeps the association served between
    /// calls.
    pub async fn next_push(&mut self) -> Resolution {
        loop {
            self.drain_actions(None);
            if let Some(r) = self.pushed.pop_front() {
                return r;
            }
            self.step().await;
        }
    }

    /// Feeds the core the next connection event, or its timer when that comes first
    /// (cancel-safe).
    async fn step(&mut self) {
        let deadline = self.conns.deadline(self.core.poll_timeout());
        tokio::select! {
            e = self.conns.next() => self.conns.feed(e, &mut self.core),
            () = sleep_until(deadline) => {
                let now = self.now();
                self.core.handle_timeout(now);
            }
        }
    }

    /// Carries out the core's actions, keeping pushes; returns query `q`'s answer if it came.
    fn drain_actions(&mut self, q: Option<QueryId>) -> Option<Result<Answer, Error>> {
        let mut answer = None;
        while let Some(a) = self.core.poll_action() {
            match self.conns.carry_out(a) {
                Some(PuEvent::Answered(id, r)) if Some(id) == q => answer = Some(r),
                Some(PuEvent::Pushed(r)) => self.pushed.push_back(r),
                _ => {}
            }
        }
        answer
    }

    async fn resolution(&mut self, q: QueryId) -> Result<Resolution, Error> {
        match self.run(q).await? {
            Answer::Resolution(r) => Ok(r),
            Answer::Reported => Err(Error::Protocol("unexpected answer".into())),
        }
    }

    fn now(&mut self) -> rserpool_wire::Instant {
        self.conns.now_for(&mut self.core)
    }

    /// Carries out the core's actions until query `q` is answered. (The answer of a query
    /// whose call was cancelled is dropped.)
    async fn run(&mut self, q: QueryId) -> Result<Answer, Error> {
        loop {
            if let Some(r) = self.drain_actions(Some(q)) {
                return r;
            }
            self.step().await;
        }
    }
}

/// What connecting to a pool asks of a pool user, whether one task owns it ([`PoolUser`]) or
/// many share it ([`SharedPoolUser`](crate::SharedPoolUser), which holds its lock for these
/// and not while it connects).
pub(crate) trait Resolver {
    async fn resolve(&mut self, handle: &PoolHandle) -> Result<Resolution, Error>;
    async fn report_unreachable(&mut self, handle: &PoolHandle, pe_id: u32);
    async fn forget(&mut self, handle: &PoolHandle);
}

impl Resolver for PoolUser {
    async fn resolve(&mut self, handle: &PoolHandle) -> Result<Resolution, Error> {
        PoolUser::resolve(self, handle).await
    }
    async fn report_unreachable(&mut self, handle: &PoolHandle, pe_id: u32) {
        let _ = PoolUser::report_unreachable(self, handle, pe_id).await;
    }
    async fn forget(&mut self, handle: &PoolHandle) {
        PoolUser::forget(self, handle);
    }
}

/// Tries the resolved PEs of `handle` in order, but not those in `avoid`; each one that cannot
/// be reached is reported. When every PE came from the cache and none answered, the cache is
/// dropped and a registrar asked once more.
pub(crate) async fn connect_avoiding(
    pu: &mut impl Resolver,
    handle: &PoolHandle,
    avoid: &[u32],
    timeout: std::time::Duration,
) -> Result<(TcpStream, PoolElement), Error> {
    let mut other_transport = None;
    for attempt in 0..2 {
        let res = pu.resolve(handle).await?;
        let from_cache = res.registrar.is_none();
        for pe in res.pool_elements {
            if avoid.contains(&pe.id) {
                continue;
            }
            // Not reachable over TCP, which says nothing about the PE: not reported.
            if pe.user_transport.tcp().is_none() {
                other_transport.get_or_insert_with(|| pe.user_transport.to_string());
                continue;
            }
            if let Some(s) = connect_to(&pe, timeout).await {
                return Ok((s, pe));
            }
            debug!("PE {:#010x} of pool {handle} unreachable", pe.id);
            pu.report_unreachable(handle, pe.id).await;
        }
        // Stale cache entries only: ask the registrar once more.
        if !from_cache || attempt == 1 {
            break;
        }
        pu.forget(handle).await;
    }
    Err(match other_transport {
        Some(transport) => Error::OtherTransport {
            pool: handle.to_string(),
            transport,
        },
        None => Error::NoPoolElement(handle.to_string()),
    })
}

/// Connects to one PE's user transport: each of its addresses in turn, each within `timeout`.
pub(crate) async fn connect_to(
    pe: &PoolElement,
    timeout: std::time::Duration,
) -> Option<TcpStream> {
    let t = pe.user_transport.tcp()?;
    for addr in t.socket_addrs() {
        if let Ok(Ok(s)) = tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            return Some(s);
        }
    }
    None
}
