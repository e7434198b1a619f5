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
}
