//! A pool user: resolves pool handles at a registrar and connects to pool elements.
//!
//! With a stale-cache value above zero (RFC 5352 §7.2) the pool user asks the registrar for the
//! whole pool, keeps it in a local handlespace and selects by the pool's policy itself until the
//! entry is older than the stale-cache value; with zero (the default, as in rsplib's tools) every
//! resolution asks the registrar. A pool element that cannot be reached is reported with
//! ENDPOINT_UNREACHABLE and dropped from the cache, and the next one is tried.

use crate::Error;
use crate::connection::AsapConnection;
use crate::registrars::{AnnounceListener, RegistrarSet};
use rserpool_handlespace::Handlespace;
use rserpool_wire::{AsapMessage, CauseCode, Policy, PoolElement, PoolHandle, UserTransport};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tracing::debug;

#[derive(Debug, Clone)]
pub struct PoolUserConfig {
    pub registrars: Vec<SocketAddr>,
    /// Listen for SERVER_ANNOUNCE here (UDP; multicast groups are joined).
    pub announce_listen: Option<SocketAddr>,
    /// How long a resolution may be served from the cache (0 = no cache).
    pub stale_cache: Duration,
    /// PEs to ask for per resolution without a cache (Handle Resolution Option); `None` lets
    /// the registrar decide (MaxHResItems).
    pub items: Option<u32>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

impl Default for PoolUserConfig {
    fn default() -> Self {
        Self {
            registrars: vec![SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))],
            announce_listen: None,
            stale_cache: Duration::ZERO,
            items: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(3),
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

pub struct PoolUser {
    cfg: PoolUserConfig,
    registrars: RegistrarSet,
    conn: Option<AsapConnection>,
    next_registrar: usize,
    cache: Handlespace,
    fetched: HashMap<PoolHandle, (Instant, Option<Policy>)>,
    announce: Option<AnnounceListener>,
    epoch: Instant,
}

impl PoolUser {
    pub fn new(cfg: PoolUserConfig) -> std::io::Result<Self> {
        let registrars = RegistrarSet::new(cfg.registrars.clone());
        let announce = cfg
            .announce_listen
            .map(AnnounceListener::start)
            .transpose()?;
        Ok(Self {
            cfg,
            registrars,
            conn: None,
            next_registrar: 0,
            cache: Handlespace::new(rserpool_handlespace::Config::default()),
            fetched: HashMap::new(),
            announce,
            epoch: Instant::now(),
        })
    }

    fn candidates(&mut self) -> Vec<SocketAddr> {
        if let Some(a) = &self.announce {
            let set = &mut self.registrars;
            a.drain(self.epoch, |d, from, at| set.heard_announce(d, from, at));
        }
        self.registrars
            .candidates(rserpool_wire::Instant::since(self.epoch, Instant::now()))
    }

    /// Resolves `handle`: from the cache when fresh, else at a registrar.
    pub async fn resolve(&mut self, handle: &PoolHandle) -> Result<Resolution, Error> {
        if let Some(r) = self.cached(handle) {
            return Ok(r);
        }
        self.fetch(handle).await
    }

    fn cached(&mut self, handle: &PoolHandle) -> Option<Resolution> {
        let (at, policy) = self.fetched.get(handle)?;
        if self.cfg.stale_cache.is_zero() || at.elapsed() >= self.cfg.stale_cache {
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

    async fn fetch(&mut self, handle: &PoolHandle) -> Result<Resolution, Error> {
        let caching = !self.cfg.stale_cache.is_zero();
        let items = if caching {
            Some(u32::MAX)
        } else {
            self.cfg.items
        };
        let answer = self.ask(handle, items).await;
        if matches!(answer, Err(Error::UnknownPool(_) | Error::Refused(_))) {
            self.forget_pool(handle);
        }
        let (policy, pool_elements, registrar) = answer?;
        if !caching {
            return Ok(Resolution {
                pool_handle: handle.clone(),
                policy,
                pool_elements,
                registrar: Some(registrar),
            });
        }
        self.forget_pool(handle);
        for pe in pool_elements {
            if let Err(e) = self.cache.register(handle, pe, 0) {
                debug!("cache: PE not kept: {e}");
            }
        }
        self.fetched
            .insert(handle.clone(), (Instant::now(), policy.clone()));
        let mut r = self
            .cached(handle)
            .ok_or_else(|| Error::UnknownPool(handle.to_string()))?;
        r.registrar = Some(registrar);
        Ok(r)
    }

    /// Asks a registrar for every PE of the pool, bypassing the cache: for pool users that
    /// keep their own copy of a pool (the proxy) and select locally.
    pub async fn pool_elements(
        &mut self,
        handle: &PoolHandle,
    ) -> Result<(Option<Policy>, Vec<PoolElement>), Error> {
        let (policy, pes, _) = self.ask(handle, Some(u32::MAX)).await?;
        Ok((policy, pes))
    }

    /// One handle resolution at a registrar: the pool's policy, its PEs and who answered.
    async fn ask(
        &mut self,
        handle: &PoolHandle,
        items: Option<u32>,
    ) -> Result<(Option<Policy>, Vec<PoolElement>, SocketAddr), Error> {
        let req = AsapMessage::HandleResolution {
            subscribe: false,
            pool_handle: handle.clone(),
            items,
        };
        let (resp, registrar) = self.request(&req, handle).await?;
        let AsapMessage::HandleResolutionResponse {
            policy,
            pool_elements,
            error,
            ..
        } = resp
        else {
            return Err(Error::Protocol("unexpected answer".into()));
        };
        if let Some(cause) = error.and_then(|e| e.causes.first().cloned()) {
            return Err(if cause.code == CauseCode::UNKNOWN_POOL_HANDLE {
                Error::UnknownPool(handle.to_string())
            } else {
                Error::Refused(cause.code)
            });
        }
        Ok((policy, pool_elements, registrar))
    }

    fn forget_pool(&mut self, handle: &PoolHandle) {
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

    /// Tells a registrar that a PE could not be reached (ENDPOINT_UNREACHABLE) and drops it
    /// from the cache.
    pub async fn report_unreachable(
        &mut self,
        handle: &PoolHandle,
        pe_id: u32,
    ) -> Result<(), Error> {
        self.cache.deregister(handle.as_bytes(), pe_id);
        let msg = AsapMessage::EndpointUnreachable {
            pool_handle: handle.clone(),
            pe_id,
        };
        for _ in 0..2 {
            let conn = self.connected().await?;
            if conn.send(&msg).await.is_ok() {
                return Ok(());
            }
            self.conn = None;
        }
        Err(Error::Closed)
    }

    /// Connects to a PE of the pool, trying the resolved PEs in order; each one that refuses is
    /// reported unreachable. Returns the stream and the PE it reached.
    pub async fn connect(
        &mut self,
        handle: &PoolHandle,
    ) -> Result<(TcpStream, PoolElement), Error> {
        for attempt in 0..2 {
            let res = self.resolve(handle).await?;
            let from_cache = res.registrar.is_none();
            for pe in res.pool_elements {
                if let Some(s) = self.try_connect(&pe).await {
                    return Ok((s, pe));
                }
                debug!("PE {:#010x} of pool {handle} unreachable", pe.id);
                let _ = self.report_unreachable(handle, pe.id).await;
            }
            // Stale cache entries only: ask the registrar once more.
            if !from_cache || attempt == 1 {
                break;
            }
            self.forget_pool(handle);
        }
        Err(Error::NoPoolElement(handle.to_string()))
    }

    async fn try_connect(&self, pe: &PoolElement) -> Option<TcpStream> {
        let UserTransport::Address(t) = &pe.user_transport else {
            return None;
        };
        for addr in t.socket_addrs() {
            if let Ok(Ok(s)) =
                tokio::time::timeout(self.cfg.connect_timeout, TcpStream::connect(addr)).await
            {
                return Some(s);
            }
        }
        None
    }

    /// The registrar association, connecting (with failover over the candidates) if needed.
    async fn connected(&mut self) -> Result<&mut AsapConnection, Error> {
        if self.conn.is_none() {
            let candidates = self.candidates();
            if candidates.is_empty() {
                return Err(Error::NoRegistrarKnown);
            }
            let mut tried = Vec::new();
            for i in 0..candidates.len() {
                let addr = candidates[(self.next_registrar + i) % candidates.len()];
                match AsapConnection::connect(addr, self.cfg.connect_timeout).await {
                    Ok(c) => {
                        self.next_registrar = (self.next_registrar + i) % candidates.len();
                        self.conn = Some(c);
                        break;
                    }
                    Err(e) => tried.push(format!("{addr}: {e}")),
                }
            }
            if self.conn.is_none() {
                return Err(Error::NoRegistrar(tried.join("; ")));
            }
        }
        self.conn.as_mut().ok_or(Error::Closed)
    }

    /// Sends a handle resolution and waits for its answer; on failure moves to the next
    /// registrar and tries again, once per known registrar.
    async fn request(
        &mut self,
        msg: &AsapMessage,
        handle: &PoolHandle,
    ) -> Result<(AsapMessage, SocketAddr), Error> {
        let attempts = self.candidates().len().max(1);
        let timeout = self.cfg.request_timeout;
        let mut last = Error::NoRegistrarKnown;
        for _ in 0..attempts {
            let conn = self.connected().await?;
            let peer = conn.peer();
            let exchange = async {
                conn.send(msg).await?;
                loop {
                    match conn.recv().await? {
                        m @ AsapMessage::HandleResolutionResponse { .. } => {
                            if let AsapMessage::HandleResolutionResponse { pool_handle, .. } = &m
                                && pool_handle != handle
                            {
                                continue;
                            }
                            return Ok(m);
                        }
                        AsapMessage::Error { error } => {
                            let code = error
                                .causes
                                .first()
                                .map_or(CauseCode::UNSPECIFIED, |c| c.code);
                            return Err(Error::Refused(code));
                        }
                        _ => {}
                    }
                }
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(Ok(m)) => return Ok((m, peer)),
                Ok(Err(e @ Error::Refused(_))) => return Err(e),
                Ok(Err(e)) => last = e,
                Err(_) => last = Error::Timeout,
            }
            debug!("registrar {peer}: {last}; trying the next one");
            self.conn = None;
            self.next_registrar = self.next_registrar.wrapping_add(1);
        }
        Err(last)
    }
}
