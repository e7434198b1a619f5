//! What a tier member hands the process that replaces it (an upgrade, docs/OPERATIONS.md):
//! the tier's TCP listener (where the other members link) and UDP socket (where the
//! distributor's heartbeats arrive), and its registration in the tier pool. With the same
//! sockets and the same registration association, the member never leaves the pool: the
//! distributor keeps sending it flows, heartbeats are answered throughout, and no other member
//! takes it for dead. The datapath's maps are pinned and need no passing.

use rserpool_asap::{Association, HandedOver, PoolElement};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::Arc;

/// The tier part of a hand-over's state; its descriptors follow the listeners' in this
/// order: the TCP listener, the UDP socket, then the registration association if any.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct TierState {
    /// The tier address the sockets are bound to.
    pub(crate) listen: SocketAddr,
    /// The member's PE identifier in the tier pool.
    pub(crate) id: u32,
    /// The registration association, when it could move (plain TCP to the registrar); else
    /// the successor registers with the same identifier once the old association closes.
    pub(crate) registration: Option<Registration>,
}

/// A registration association as the state names it (its descriptor travels apart).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registration {
    pub(crate) registrar: SocketAddr,
    pub(crate) home: u32,
    pub(crate) unread: Vec<u8>,
}

impl Registration {
    pub(crate) fn of(h: &HandedOver) -> Registration {
        Registration {
            registrar: h.registrar,
            home: h.home,
            unread: h.unread.clone(),
        }
    }

    pub(crate) fn handed_over(&self, id: u32) -> HandedOver {
        HandedOver {
            id,
            registrar: self.registrar,
            home: self.home,
            unread: self.unread.clone(),
        }
    }
}

/// A member's sockets and registration, taken from the process before.
pub(crate) struct TakenMember {
    pub(crate) listen: SocketAddr,
    pub(crate) tcp: std::net::TcpListener,
    pub(crate) udp: std::net::UdpSocket,
    pub(crate) id: u32,
    /// The registration association, until the member carries on over it.
    pub(crate) registration: Option<Association>,
    /// The pool element carrying on over it: started as early as possible, since the
    /// registrar's keep-alives wait meanwhile.
    pub(crate) pe: Option<Arc<PoolElement>>,
}
