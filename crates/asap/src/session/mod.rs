//! The ASAP session layer (RFC 5351 §2, RFC 5352 §2.2.11–13) over TCP: a pool user's
//! [`Session`] with a pool survives the failure of the pool element serving it, because the PE
//! hands the PU its state in cookies ([`CookieSealer`]) and the next PE restores it from the
//! COOKIE_ECHO ([`PeSession`]).
//!
//! Control and data share the PU↔PE connection in the chunks of
//! [`rserpool_wire::mapping`] (docs/SESSION.md).

mod channel;
pub mod cookie;
pub mod pe;
pub mod pu;

pub use cookie::{CookieError, CookieSealer};
pub use pe::{PeSession, PeSessionEvent, SessionAcceptor};
pub use pu::{Failover, FailoverCause, Session, SessionConfig, SessionEvent, SessionStats};
