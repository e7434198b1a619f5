//! SCTP (RFC 9260) for ASAP and ENRP on hosts whose kernel has none, and for talking to rsplib.
//!
//! Why a crate of our own: RFC 5352 and RFC 5353 run ASAP and ENRP over SCTP (PPIDs 11 and
//! 12), and the one other RSerPool implementation, rsplib, speaks nothing else. The SCTP crate
//! that exists on crates.io (`sctp-proto`) is made for WebRTC data channels: it carries only
//! their PPIDs and refuses INITs with address parameters, which every multi-homed peer sends.
//! So the protocol is here, sans-IO like the rest of rserpool's cores (docs/ARCHITECTURE.md):
//! bytes in, bytes and events out, time passed in; drivers put it on UDP (RFC 6951) or raw IP.
//!
//! What is here: the wire format — [`packet`] (the common header, CRC32c, the chunk list)
//! and [`chunk`] (each chunk type, and INIT's parameters); decoding never panics and never
//! trusts a length field, and what it does not know it keeps, with what RFC 9260 §3.2 says to
//! do about it. Then one association ([`assoc`], with its halves [`send`] and [`recv`]) and
//! the listening side's [`endpoint`], which answers INIT statelessly with a signed [`cookie`].
//! Many associations behind one socket are a [`stack`]; with the `tokio` feature, [`host`]
//! runs one on a UDP or raw IP socket for the PE and PU library (the registrar drives the
//! stack from its own event loop). An association's paths (the peer's addresses, with
//! heartbeats and failover) are [`path`]. Not yet: peer restart, addresses added to a live
//! association.

pub mod assoc;
pub mod chunk;
pub mod cookie;
pub mod endpoint;
#[cfg(feature = "tokio")]
pub mod host;
#[cfg(feature = "sockets")]
pub mod kernel;
pub mod packet;
pub mod path;
pub mod recv;
pub mod send;
#[cfg(feature = "sockets")]
pub mod socket;
pub mod stack;

pub use assoc::{Association, Config, Event, State};
pub use chunk::{Chunk, Data, Init, InitParam, Sack, Unrecognized};
pub use endpoint::{Endpoint, Outcome};
pub use packet::{Packet, PacketError};
pub use stack::{AssocId, Stack, StackEvent};
