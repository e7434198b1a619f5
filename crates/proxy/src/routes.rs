//! A listener's routes: which pool serves a request (or, in TCP mode, a connection).
//!
//! HTTP requests are routed by Host and the longest matching path prefix (`[[listener.route]]`
//! in the configuration), else to the listener's own pool. A reload builds new routes for new
//! connections; open ones keep theirs.

use crate::balance::pools::{Pool, Pools};
use crate::config::{ListenerConfig, SpliceMode};
use std::sync::Arc;

/// A listener's routing table.
pub(crate) struct Routes {
    /// The pool for TCP connections and for requests no route matches.
    default: Option<Target>,
    /// Longest prefix first.
    routes: Vec<RouteEntry>,
}

/// Where a route sends a request.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) pool: Arc<Pool>,
    /// Pin the connection to the request's PE and hand it to the kernel splice.
    pub(crate) kernel: bool,
}

/// (host, path prefix, target).
type RouteEntry = (Option<Vec<u8>>, Vec<u8>, Target);

impl Routes {
    pub(crate) fn new(l: &ListenerConfig, pools: &Pools) -> Self {
        let kernel = |s: Option<SpliceMode>| s.or(l.splice) == Some(SpliceMode::Kernel);
        let mut routes: Vec<_> = l
            .routes
            .iter()
            .map(|r| {
                (
                    r.host.as_ref().map(|h| h.to_ascii_lowercase().into_bytes()),
                    r.prefix.as_bytes().to_vec(),
                    Target {
                        pool: pools.pool(&r.pool),
                        kernel: kernel(r.splice),
                    },
                )
            })
            .collect();
        routes.sort_by(|a, b| {
            b.1.len()
                .cmp(&a.1.len())
                .then(b.0.is_some().cmp(&a.0.is_some()))
        });
        Self {
            default: l.pool.as_ref().map(|p| Target {
                pool: pools.pool(p),
                kernel: kernel(None),
            }),
            routes,
        }
    }

    /// The pool for TCP connections.
    pub(crate) fn default_pool(&self) -> Option<&Arc<Pool>> {
        self.default.as_ref().map(|t| &t.pool)
    }

    /// Where a request to `host` (a Host header value, port allowed) and `path` goes.
    pub(crate) fn route(&self, host: &[u8], path: &[u8]) -> Option<&Target> {
        let host = strip_port(host);
        self.routes
            .iter()
            .find(|(h, prefix, _)| {
                path.starts_with(prefix) && h.as_ref().is_none_or(|h| host.eq_ignore_ascii_case(h))
            })
            .map(|(_, _, p)| p)
            .or(self.default.as_ref())
    }
}

fn strip_port(host: &[u8]) -> &[u8] {
    if host.first() == Some(&b'[') {
        return host
            .iter()
            .position(|&b| b == b']')
            .map_or(host, |i| &host[..=i]);
    }
    match host.iter().rposition(|&b| b == b':') {
        Some(i) => &host[..i],
        None => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port(b"example.com:8080"), b"example.com");
        assert_eq!(strip_port(b"example.com"), b"example.com");
        assert_eq!(strip_port(b"[::1]:80"), b"[::1]");
    }
}
