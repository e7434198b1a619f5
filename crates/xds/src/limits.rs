//! What one xDS server may take, and what it did (for the registrar's status and metrics).

use std::sync::atomic::AtomicU64;

/// How much one server takes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_streams: usize,
    /// Resource names one request may name.
    pub max_names: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_streams: 10_000,
            max_names: 10_000,
        }
    }
}

/// What the server did, for the registrar's status and metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub streams_opened: AtomicU64,
    pub streams_refused: AtomicU64,
    pub responses: AtomicU64,
    pub acks: AtomicU64,
    pub nacks: AtomicU64,
    pub unknown_types: AtomicU64,
    /// When a NACK was last logged (seconds since the Unix epoch): one line a second at most.
    pub(crate) nack_logged: AtomicU64,
}

impl Counters {
    /// Whether a NACK may be logged now (one a second: a client that rejects everything,
    /// or thousands that do, make one line a second, not a flood).
    pub(crate) fn may_log_nack(&self) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.nack_logged.load(std::sync::atomic::Ordering::Relaxed);
        now > last
            && self
                .nack_logged
                .compare_exchange(
                    last,
                    now,
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_ok()
    }
}
