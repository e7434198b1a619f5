//! The pool element's and the pool user's protocol logic as sans-IO state machines, in the
//! registrar core's shape: events and the time go in (`handle_connected`, `handle_data`,
//! `handle_close`, `handle_timeout`, API calls such as `update_policy`), and everything the
//! driver must do comes out of one queue of [`Action`]s (`poll_action`), with `poll_timeout`
//! saying when to call `handle_timeout` next. No sockets, no clock and no ambient randomness in
//! here: the tokio drivers ([`PoolElement`](crate::PoolElement), [`PoolUser`](crate::PoolUser))
//! and a simulation run the same logic.
//!
//! This file holds what both cores share: connection names and the outbox, which also frames
//! and decodes each connection's bytes. [`pe`] is the pool element, [`pu`] the pool user.

use rserpool_wire::{AsapMessage, DecodeError, Framer, Message};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;
use tracing::warn;

pub mod pe;
pub mod pu;

pub use rserpool_wire::Instant;

/// Largest message accepted from a registrar (a full handle resolution response fits).
pub(crate) const MAX_MESSAGE: usize = 65535;

/// A connection of a core, named by the core; never reused during its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a core asks of its driver, in the order it decided; `E` is the core's event type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<E> {
    /// Open a TCP connection to the address; report [`handle_connected`](pe::PeCore::handle_connected)
    /// or, on failure, `handle_close`. The core gives up on its own after its connect timeout
    /// (it then asks to [`Close`](Action::Close) the attempt).
    Connect(ConnId, SocketAddr),
    /// Write these bytes on the connection, after those of earlier transmits.
    Transmit(ConnId, Vec<u8>),
    /// Close the connection once its pending output is written. The core has forgotten it:
    /// nothing needs to be reported back.
    Close(ConnId),
    /// Something for the application.
    Event(E),
}

/// The connections' input framers and the outbox of actions.
pub(crate) struct Outbox<E> {
    actions: VecDeque<Action<E>>,
    framers: BTreeMap<ConnId, Framer>,
    next: u64,
}

impl<E> Outbox<E> {
    pub(crate) fn new() -> Self {
        Self {
            actions: VecDeque::new(),
            framers: BTreeMap::new(),
            next: 0,
        }
    }

    /// A new connection (an incoming one, or one to open).
    pub(crate) fn open(&mut self) -> ConnId {
        let id = ConnId(self.next);
        self.next += 1;
        self.framers.insert(id, Framer::new(MAX_MESSAGE));
        id
    }

    /// A connection for the driver to open to `addr`.
    pub(crate) fn connect(&mut self, addr: SocketAddr) -> ConnId {
        let id = self.open();
        self.actions.push_back(Action::Connect(id, addr));
        id
    }

    pub(crate) fn is_open(&self, id: ConnId) -> bool {
        self.framers.contains_key(&id)
    }

    pub(crate) fn send(&mut self, id: ConnId, msg: &AsapMessage) {
        if !self.is_open(id) {
            return;
        }
        match msg.to_bytes() {
            Ok(b) => self.actions.push_back(Action::Transmit(id, b)),
            Err(e) => warn!("cannot encode {}: {e}", msg.name()),
        }
    }

    /// Asks the driver to close the connection, and forgets it.
    pub(crate) fn close(&mut self, id: ConnId) {
        if self.framers.remove(&id).is_some() {
            self.actions.push_back(Action::Close(id));
        }
    }

    /// Forgets a connection the driver gives away (open still, to another owner), without
    /// closing it; returns its input not yet a whole message.
    pub(crate) fn release(&mut self, id: ConnId) -> Option<Vec<u8>> {
        self.framers
            .remove(&id)
            .map(|f| f.buffered_bytes().to_vec())
    }

    /// Forgets a connection the driver reported closed; false if it was not open.
    pub(crate) fn closed(&mut self, id: ConnId) -> bool {
        self.framers.remove(&id).is_some()
    }

    pub(crate) fn event(&mut self, e: E) {
        self.actions.push_back(Action::Event(e));
    }

    pub(crate) fn poll(&mut self) -> Option<Action<E>> {
        self.actions.pop_front()
    }

    /// The messages complete in the connection's input after `data`, and the error that ends
    /// it, if any (framing lost or an undecodable message: the connection is unusable).
    pub(crate) fn messages(
        &mut self,
        id: ConnId,
        data: &[u8],
    ) -> (Vec<AsapMessage>, Option<DecodeError>) {
        let mut out = Vec::new();
        let Some(framer) = self.framers.get_mut(&id) else {
            return (out, None);
        };
        let mut input = data;
        loop {
            match framer.next_from(&mut input) {
                Ok(Some(frame)) => match AsapMessage::decode(&frame) {
                    Ok(m) => out.push(m),
                    Err(e) => return (out, Some(e)),
                },
                Ok(None) => {
                    framer.release_if_empty();
                    return (out, None);
                }
                Err(e) => return (out, Some(e)),
            }
        }
    }
}

/// `d` scaled by a random factor in [0.5, 1.5): spreads the retries of many clients.
pub(crate) fn jitter(d: Duration, rng: &mut dyn rand_core::RngCore) -> Duration {
    let f = 0.5 + f64::from(rng.next_u32() % 1000) / 1000.0;
    d.mul_f64(f)
}

/// A random nonzero u32 (PE identifiers).
pub(crate) fn nonzero_u32(rng: &mut dyn rand_core::RngCore) -> u32 {
    loop {
        let v = rng.next_u32();
        if v != 0 {
            return v;
        }
    }
}

/// The earliest of some deadlines.
pub(crate) fn earliest(times: impl IntoIterator<Item = Option<Instant>>) -> Option<Instant> {
    times.into_iter().flatten().min()
}
