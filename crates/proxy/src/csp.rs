//! The proxy's Component Status reports (`rserpool_wire::csp`) to an rsplib monitor (`csp` in
//! the settings): the proxy reports as the pool user it is, with the client connections it
//! holds, the pools it serves and their PEs, and how full its connection limit is, so that
//! `cspmonitor` lists it beside rsplib's pool users.

use crate::Proxy;
use rserpool_wire::csp::{Component, Report};
use std::net::SocketAddr;
use std::sync::Weak;
use std::time::Duration;

impl Proxy {
    /// Reports to `monitor` every `interval` while the proxy runs; a last report when it
    /// drains or is gone. A pool user's component ID carries 56 random bits (as rsplib's do).
    pub(crate) fn report_status(&self, monitor: SocketAddr, interval: Duration) {
        let inner: Weak<_> = std::sync::Arc::downgrade(&self.inner);
        // Random per process (the standard library's keyed hasher), never 0.
        let object = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            std::process::id(),
        ) | 1;
        let sender = Component::PoolUser.id(object);
        let listeners: Vec<SocketAddr> = self.config().listeners.iter().map(|l| l.listen).collect();
        let location = rserpool_wire::csp::location(&rserpool_wire::csp::host_name(), &listeners);
        let who = "proxy".to_owned();
        rserpool_asap::csp::spawn_reports(monitor, interval, who, move |uptime_us, interval_us| {
            let proxy = inner.upgrade().map(|inner| Proxy { inner });
            let Some(p) = proxy.filter(|p| !*p.inner.draining.borrow()) else {
                return Report::last(sender, uptime_us, interval_us);
            };
            let pools = p.inner.pools.all();
            let pes: usize = pools.iter().map(|p| p.backends().len()).sum();
            let conns = p.active_connections();
            let plural = |n: usize| if n == 1 { "" } else { "s" };
            Report {
                sender,
                uptime_us,
                interval_us,
                location: location.clone(),
                status: format!(
                    "{conns} Connection{} to {} Pool{} of {pes} PE{}",
                    plural(conns),
                    pools.len(),
                    plural(pools.len()),
                    plural(pes)
                ),
                workload: Some(conns as f64 / p.inner.max_conns.max(1) as f64),
                associations: Vec::new(),
                last: false,
            }
        });
    }
}
