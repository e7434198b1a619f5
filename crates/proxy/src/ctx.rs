//! What a client connection needs from the proxy, taken once when it is accepted.
//!
//! A connection holds its own [`Ctx`] (configuration, pools, its listener's routes, the access
//! log, the drain signal), so a reload, which builds new ones for new connections, never
//! changes what an open connection sees.

use crate::access_log::AccessLog;
use crate::balance::failover::FailoverPolicy;
use crate::balance::pools::Pools;
use crate::config::ProxyConfig;
use crate::routes::Routes;
use std::sync::Arc;
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
    /// TLS to the PEs of the pools with `[pool.NAME.tls]`, by pool handle.
    pub(crate) pe_tls:
        Arc<std::collections::HashMap<String, Arc<rserpool_tls::rustls::ClientConfig>>>,
}

impl Ctx {
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
}

/// Returns once the flag is set (or its sender is gone).
pub(crate) async fn until_set(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}
