//! The fault-tolerant proxy tier (docs/TIER.md; the TCP splice seed, §2–5) as sans-IO cores:
//! state machines that take messages, events and the current time in, and give messages,
//! timers and datapath actions out. They hold no socket, no task and no clock, so the proxy
//! (`rserpool_proxy`'s tier driver), the distributor (`rserpool distributor`) and the
//! deterministic simulation (`rserpool-sim`) run the same code.
//!
//! - [`wire`]: the member protocol (TCP between members) and the distributor's datagrams
//!   (heartbeats, answers, the word that a member died): one definition each.
//! - [`member`]: one member of the tier: which members it links to, what it sends each of
//!   them (a new splice to all, everything it knows to a member that links anew, what the
//!   once-a-second pass found), what its datapath must do with what others send, and where
//!   the datapath forwards a packet it has no entry for.
//! - [`expiry`]: when the datapath removes a flow-table entry, the one rule of the kernel's
//!   datapath and of the simulation's model of it.
//! - [`distributor`]: the heartbeat schedule, liveness, workload-factor weights, the group of
//!   live members the router should spread packets over, and telling the living of a death.
//!
//! Time is [`Instant`] (milliseconds from an origin the driver chooses), as in the other cores.

pub mod distributor;
pub mod expiry;
pub mod member;
pub mod wire;

pub use distributor::{DistributorConfig, DistributorCore, Group};
pub use expiry::{Expiry, Gone, Seen};
pub use member::{Action, Forward, MemberCore, TableEntry, Transmit};
pub use rserpool_wire::Instant;
pub use wire::{Hello, Message, Splice};
