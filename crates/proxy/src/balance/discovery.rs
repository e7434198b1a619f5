//! Discovery: keeping the proxy's copy of each pool fresh from the registrars.
//!
//! One task per proxy acts as a pool user (RFC 5351): every refresh interval it asks a
//! registrar for every PE of each pool the proxy serves (the next registrar in the list if one
//! does not answer) and replaces the pool's copy with the answer; a pool a route adds is
//! fetched at once. Each question also subscribes to the pool (RFC 5352's S bit), so the
//! registrar pushes the pool again as soon as it changes — a PE joins or leaves, or pushes new
//! credits — and the copy follows within a registrar hop; the refresh stays as the fallback
//! (a registrar that ignores the S bit, a push lost with its association). If no registrar
//! answers, the copies keep serving. The same task sends the ENDPOINT_UNREACHABLE reports for
//! PEs the proxy could not reach. A pool no registrar knows (a typo in a route, PEs not started)
//! is logged once it has stayed unknown for [`UNKNOWN_SAID_AFTER`], and again when it is known.

use crate::balance::pools::{PoolSettings, Pools, Unreachable};
use rserpool_asap::{PoolUser, PoolUserConfig};
use rserpool_wire::PoolHandle;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{info, warn};

/// How long a pool stays unknown to the registrars before the log says so: PEs starting with
/// the proxy take a moment to register.
const UNKNOWN_SAID_AFTER: Duration = Duration::from_secs(5);

/// Starts the refresh task on the current tokio runtime and returns the pools it keeps fresh.
pub fn start(settings: PoolSettings) -> Arc<Pools> {
    let (pools, reports) = Pools::new(settings);
    tokio::spawn(refresh_task(Arc::downgrade(&pools), reports));
    pools
}

/// Fetches every pool each refresh interval and sends the unreachable reports. Ends when the
/// [`Pools`] is dropped.
async fn refresh_task(
    pools: std::sync::Weak<Pools>,
    mut reports: mpsc::UnboundedReceiver<Unreachable>,
) {
    let Some(p) = pools.upgrade() else { return };
    let s = p.settings.clone();
    let added = p.added();
    drop(p);
    let mut cfg = PoolUserConfig {
        connect_timeout: s.connect_timeout.max(Duration::from_millis(500)),
        request_timeout: s.refresh.max(Duration::from_secs(1)),
        subscribe: true,
        tls: s.registrar_tls.clone(),
        ..Default::default()
    };
    cfg.set_registrars(&s.registrars);
    let mut pu = match PoolUser::new(cfg) {
        Ok(pu) => pu,
        Err(e) => {
            warn!("proxy: cannot start the pool user: {e}");
            return;
        }
    };
    let mut next = tokio::time::Instant::now();
    // Pools the registrars did not know: since when, and whether the log said so.
    let mut unknown: HashMap<PoolHandle, (Instant, bool)> = HashMap::new();
    loop {
        let Some(p) = pools.upgrade() else { return };
        let added = added.notified();
        if tokio::time::Instant::now() >= next {
            next = tokio::time::Instant::now() + s.refresh;
            let mut ok = true;
            for pool in p.all() {
                match pu.pool_elements(&pool.handle).await {
                    Ok((_, pes)) => {
                        if let Some((_, true)) = unknown.remove(&pool.handle) {
                            info!(
                                "proxy: pool {} is known now ({} PEs)",
                                pool.handle,
                                pes.len()
                            );
                        }
                        pool.update(pes);
                    }
                    Err(rserpool_asap::Error::UnknownPool(_)) => {
                        let now = Instant::now();
                        let (since, said) =
                            unknown.entry(pool.handle.clone()).or_insert((now, false));
                        if !*said && now >= *since + UNKNOWN_SAID_AFTER {
                            *said = true;
                            warn!(
                                "proxy: no registrar knows pool {} (no PE is registered in it): \
                                 its requests get 503 until one does",
                                pool.handle
                            );
                        }
                        pool.update(Vec::new());
                    }
                    Err(e) => {
                        ok = false;
                        if p.set_registrar_reachable(false) {
                            warn!(
                                "proxy: no registrar answers ({e}); serving pools from the cache"
                            );
                        }
                        break;
                    }
                }
            }
            if ok && !p.set_registrar_reachable(true) {
                info!("proxy: a registrar answers again");
            }
        }
        drop(p);
        tokio::select! {
            pushed = pu.next_push() => {
                let Some(p) = pools.upgrade() else { return };
                if let Some(pool) = p.get(&pushed.pool_handle) {
                    pool.update(pushed.pool_elements);
                }
            }
            r = reports.recv() => {
                let Some(r) = r else { return };
                if let Err(e) = pu.report_unreachable(&r.pool, r.pe_id).await {
                    tracing::debug!("proxy: ENDPOINT_UNREACHABLE not sent: {e}");
                }
            }
            _ = tokio::time::sleep_until(next) => {}
            _ = added => { next = tokio::time::Instant::now(); }
        }
    }
}
