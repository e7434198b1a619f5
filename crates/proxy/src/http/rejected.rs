//! Requests the proxy answers itself before any pool takes them: malformed (400), without a
//! route (404), CONNECT (405), too slow to arrive (408), too large (414 for the request line,
//! 431 for the head), of an HTTP version it does not speak (505). They reach no pool's
//! counters and no PE, so they are counted here, by status, for
//! `rserpool_proxy_rejected_requests_total`, and written to the access log as any request is
//! (pool and PE `-`), as HAProxy logs its `<BADREQ>` (`Ctx::refused` does both).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// The statuses counted, in the order of [`Rejected`]'s counters.
pub(crate) const CODES: [u16; 7] = [400, 404, 405, 408, 414, 431, 505];

/// Requests the proxy answered itself, per status of [`CODES`].
#[derive(Debug, Default)]
pub(crate) struct Rejected([AtomicU64; CODES.len()]);

impl Rejected {
    /// One more request answered `code`.
    pub(crate) fn note(&self, code: u16) {
        if let Some(i) = CODES.iter().position(|&c| c == code) {
            self.0[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Each status with its count.
    pub(crate) fn counts(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        CODES
            .iter()
            .zip(&self.0)
            .map(|(&c, n)| (c, n.load(Ordering::Relaxed)))
    }
}

/// The access log line of a request answered `code` by the proxy itself, with the method and
/// target of its `head` (`-` for a head that could not be read).
pub(crate) fn log_line(peer: SocketAddr, head: Option<&[u8]>, code: u16) -> String {
    let mut line = head
        .and_then(|h| h.split(|&b| b == b'\r' || b == b'\n').next())
        .unwrap_or(b"")
        .split(|&b| b == b' ')
        .map(String::from_utf8_lossy);
    let method = line.next().filter(|m| !m.is_empty()).unwrap_or("-".into());
    let target = line.next().unwrap_or("-".into());
    format!("{peer} {method} {target} {code} - - 0 0")
}
