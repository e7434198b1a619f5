//! The application side of RSerPool (RFC 5352 ASAP, over TCP): a [`PoolElement`] registers a
//! service in a pool and keeps it registered; a [`PoolUser`] resolves a pool handle and connects
//! to a pool element, failing over to the next one and reporting the failed one; a
//! [`SharedPoolUser`] is one that many tasks share.
//!
//! A [`session::Session`] goes further: a pool user's conversation with a pool that survives
//! the failure of its pool element, its state carried in cookies (the ASAP session layer).
//!
//! Both find registrars in a configured list and in SERVER_ANNOUNCEs ([`RegistrarSet`]) and move
//! to another registrar when theirs fails. Their protocol logic is sans-IO ([`core`]: state
//! machines with events and time in and actions out, which a simulation can drive too); the
//! types above are their tokio drivers.

pub mod connection;
pub mod core;
pub mod credit_source;
pub mod credits;
pub mod csp;
mod driver;
pub mod level_gate;
mod link;
pub mod metric;
pub mod pool_element;
pub mod pool_user;
pub mod port_sampler;
pub mod registrars;
pub mod sctp;
pub mod session;
pub mod share;
pub mod shared_pool_user;
pub mod sock_diag;

pub use connection::AsapConnection;
pub use core::pe::{HandedOver, PeCore, PeEvent};
pub use core::pu::{Answer, PuCore, PuEvent, QueryId};
pub use core::{Action, ConnId, Instant};
pub use credit_source::{CreditGauge, CreditSource, InFlight, InFlightGuard, MetricSource};
pub use credits::{CreditConfig, CreditReporter, Metric, Reporting};
pub use pool_element::{Association, PeState, PeUpdater, PoolElement, PoolElementConfig};
pub use pool_user::{PoolUser, PoolUserConfig, Resolution};
pub use registrars::{AnnounceListener, RegistrarSet};
/// The wire types every application of this library names (a pool's handle, a PE's policy),
/// so that it needs no dependency on `rserpool-wire` for them.
pub use rserpool_wire::{Policy, PoolHandle};
pub use shared_pool_user::SharedPoolUser;

use rserpool_wire::{CauseCode, DecodeError};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
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
    /// A registrar refused the PE's registration (its cause, as the registrar gave it).
    #[error("registration refused: {0}")]
    RegistrationRefused(String),
    #[error("unknown pool handle {0}")]
    UnknownPool(String),
    #[error("no pool element of pool {0} could be reached")]
    NoPoolElement(String),
    /// The pool's PEs take another transport than TCP (SCTP, say): this pool user cannot
    /// reach them, and does not report them unreachable.
    #[error(
        "the pool elements of pool {pool} take {transport}, not TCP, which this pool user speaks"
    )]
    OtherTransport { pool: String, transport: String },
    #[error("cookie refused: {0}")]
    Cookie(#[from] session::CookieError),
}

/// A generator seeded from the operating system, for a core's randomness (PE identifiers,
/// back-off jitter). Without one, the time and process ID make a seed.
pub(crate) fn os_seeded_rng() -> Box<dyn rand_core::RngCore + Send> {
    use rand_core::{OsRng, SeedableRng, TryRngCore};
    let seed = OsRng.try_next_u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 ^ u64::from(std::process::id()))
            .unwrap_or(1)
    });
    Box::new(rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed))
}
