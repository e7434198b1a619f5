//! Balancing: which pool element gets a request or connection. The pools served and their
//! discovery from the registrars ([`pools`], [`discovery`]), the choice of a PE by policy
//! (`select`), admission with service levels under overload (`admit`, [`levels`]), and what
//! the proxy knows of each PE ([`backend`]: health, counters, credits, reusable connections).
//! Nothing here knows an HTTP version: the PE side of a protocol keeps its connections in a
//! PE's [`backend::Backend`] through a generic set.

pub(crate) mod admit;
pub mod backend;
pub(crate) mod conns;
pub mod discovery;
pub(crate) mod failover;
pub mod hashing;
pub(crate) mod keys;
pub mod levels;
pub(crate) mod maglev;
pub(crate) mod outlier;
pub mod pools;
pub(crate) mod ring;
pub(crate) mod select;
