//! The application side of RSerPool (RFC 5352 ASAP, over TCP): a [`PoolElement`] registers a
//! service in a pool and keeps it registered; a [`PoolUser`] resolves a pool handle and connects
//! to a pool element, failing over to the next one and reporting the failed one.
//!
//! Both find registrars in a configured list and in SERVER_ANNOUNCEs ([`RegistrarSet`]) and move
//! to another registrar when theirs fails.

pub mod connection;
pub mod pool_element;
pub mod pool_user;
pub mod registrars;

pub use connection::AsapConnection;
pub use pool_element::{PeState, PeUpdater, PoolElement, PoolElementConfig};
pub use pool_user::{PoolUser, PoolUserConfig, Resolution};
pub use registrars::RegistrarSet;

use rserpool_wire::{CauseCode, DecodeError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no registrar reachable (tried: {0})")]
    NoRegistrar(String),
    #[error("no registrar configured or announced")]
    NoRegistrarKnown,
    #[error("connection to the registrar closed")]
    Closed,
    #[error("timed out")]
    Timeout,
    #[error("bad message from the registrar: {0}")]
    Decode(#[from] DecodeError),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("registrar refused: {0}")]
    Refused(CauseCode),
    #[error("unknown pool handle {0}")]
    UnknownPool(String),
    #[error("no pool element of pool {0} could be reached")]
    NoPoolElement(String),
}

/// A random nonzero u32 (PE identifiers).
pub(crate) fn random_u32() -> u32 {
    use rand_core::{OsRng, TryRngCore};
    loop {
        let v = OsRng.try_next_u32().unwrap_or_else(|_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() ^ std::process::id())
                .unwrap_or(1)
        });
        if v != 0 {
            return v;
        }
    }
}

/// `d` scaled by a random factor in [0.5, 1.5): spreads retries of many clients.
pub(crate) fn jitter(d: std::time::Duration) -> std::time::Duration {
    let f = 0.5 + f64::from(random_u32() % 1000) / 1000.0;
    d.mul_f64(f)
}
