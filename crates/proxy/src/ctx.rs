//! What a client connection needs from the proxy, taken when it is accepted.
//!
//! A connection holds its own [`Ctx`] (configuration, pools, its listener's routes, the access
//! log, the drain signal), so a reload, which builds new ones, never changes one under a
//! request. An HTTP connection asks [`Ctx::newer`] before each request (an HTTP/2 one before
//! each stream), so that after a reload its next request takes the new routes, pools and
//! levels, as HAProxy's and nginx's new workers do.

use crate::access_log::AccessLog;
use crate::balance::failover::FailoverPolicy;
use crate::balance::pools::Pools;
use crate::config::ProxyConfig;
use crate::routes::Routes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use tokio::sync::watch;

/// What a connection needs; taken when it is accepted, so a reload does not touch it.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) cfg: Arc<ProxyConfig>,
    pub(crate) pools: Arc<Pools>,
    pub(crate) routes: Arc<Routes>,
    pub(crate) log: Option<AccessLog>,
    pub(crate) draining: watch::Receiver<bool>,
    /// The kernel splice, for a listener with `splice = "kernel"` when it could be loaded.
    pub(crate) kernel: Option<Arc<crate::l4::kernel::KernelSplice>>,
    /// HTTPS: the listener's TLS (its certificates by SNI).
    pub(crate) tls: Option<Arc<rserpool_tls::rustls::ServerConfig>>,
    /// The listener takes HTTP/2 (ALPN `h2`, h2c with prior knowledge).
    pub(crate) http2: bool,
    /// HTTPS handshakes that failed, for the metrics.
    pub(crate) tls_failures: Arc<std::sync::atomic::AtomicU64>,
    /// Requests the proxy answered itself before any pool (`http::rejected`).
    pub(crate) rejected: Arc<crate::http::rejected::Rejected>,
    /// TLS to the PEs of the pools with `[pool.NAME.tls]`, by pool handle.
    pub(crate) pe_tls:
        Arc<std::collections::HashMap<String, Arc<rserpool_tls::rustls::ClientConfig>>>,
    /// Where its listener's current one is, and which reload this one came from.
    pub(crate) current: Option<Current>,
    /// Where a connection idle for a while waits without a task (none: it waits in its own).
    pub(crate) park: Option<crate::http::park::Parker>,
}

/// A listener's current [`Ctx`], as a connection finds it after a reload.
#[derive(Clone)]
pub(crate) struct Current {
    ctx: Weak<RwLock<Arc<Ctx>>>,
    /// Bumped by every reload of the listener.
    generation: Arc<AtomicU64>,
    /// The generation the holding `Ctx` belongs to.
    seen: u64,
}

/// Makes `ctx` its listener's current one, in `slot`: the first (`previous` none) or the
/// one after a reload (`previous`: what was current), which connections then pick up.
pub(crate) fn install(slot: &Arc<RwLock<Arc<Ctx>>>, mut ctx: Ctx, previous: Option<&Ctx>) {
    let generation = previous
        .and_then(|p| p.current.as_ref())
        .map_or_else(Arc::default, |c| c.generation.clone());
    let seen = generation.fetch_add(1, Ordering::AcqRel) + 1;
    ctx.current = Some(Current {
        ctx: Arc::downgrade(slot),
        generation,
        seen,
    });
    *slot.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(ctx);
}

impl Ctx {
    /// The listener's current settings, when a reload changed them since this was taken.
    pub(crate) fn newer(&self) -> Option<Arc<Ctx>> {
        let c = self.current.as_ref()?;
        if c.generation.load(Ordering::Acquire) == c.seen {
            return None;
        }
        let slot = c.ctx.upgrade()?;
        let ctx = slot.read().unwrap_or_else(|p| p.into_inner()).clone();
        Some(ctx)
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.connect_timeout_ms)
    }
    pub(crate) fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.idle_timeout_ms)
    }
    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.request_timeout_ms)
    }
    pub(crate) fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.header_timeout_ms)
    }
    /// When a request or connection stops moving on to other PEs.
    pub(crate) fn failover(&self) -> FailoverPolicy {
        FailoverPolicy::default()
    }

    /// The header that carries the level to the PE, and whether it is sent (with `[levels]`);
    /// a client's copies of it are dropped either way.
    pub(crate) fn level_header(&self) -> (&str, bool) {
        match &self.cfg.levels {
            Some(l) => (&l.header, true),
            None => (crate::balance::levels::DEFAULT_HEADER, false),
        }
    }

    /// Writes an access log line, formatted only if there is an access log.
    pub(crate) fn log(&self, line: impl FnOnce() -> String) {
        if let Some(l) = &self.log {
            l.write(line());
        }
    }

    /// A request the proxy answered `code` itself, before any pool: counted, and logged with
    /// the method and target of its `head` if it has one (`http::rejected`).
    pub(crate) fn refused(&self, peer: std::net::SocketAddr, head: Option<&[u8]>, code: u16) {
        self.rejected.note(code);
        self.log(|| crate::http::rejected::log_line(peer, head, code));
    }
}

/// Returns once the flag is set (or its sender is gone).
pub(crate) async fn until_set(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
