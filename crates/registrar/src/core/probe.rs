//! Checking ENDPOINT_UNREACHABLE reports before acting on them (RFC 5355 §3.6): anyone with an
//! ASAP association may report any PE, so when a PE reaches MAX-BAD-PE-REPORT reports the
//! registrar connects to the PE's service itself (plain TCP, nothing sent) and removes the PE
//! only if that fails. A service that accepts the connection refutes the reports.

use super::Instant;
use super::conns::{ConnId, Conns};
use rserpool_wire::{PoolElement, PoolHandle, UserTransport};
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// The PE a probe checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Probed {
    pub(super) pool: PoolHandle,
    pub(super) pe_id: u32,
}

/// The probes under way, by the connection that tests the service.
#[derive(Default)]
pub(super) struct Probes {
    out: BTreeMap<ConnId, Probed>,
}

impl Probes {
    /// Starts a probe of `pe` of `pool` unless one is under way; `false` when the PE has no
    /// TCP service address to probe or no connection can be opened (then the reports stand).
    pub(super) fn start(
        &mut self,
        pool: &PoolHandle,
        pe: &PoolElement,
        conns: &mut Conns,
        now: Instant,
    ) -> bool {
        let probed = Probed {
            pool: pool.clone(),
            pe_id: pe.id,
        };
        if self.out.values().any(|p| *p == probed) {
            return true;
        }
        let Some(addr) = service_addr(pe) else {
            return false;
        };
        match conns.probe(addr, now) {
            Some(id) => {
                self.out.insert(id, probed);
                true
            }
            None => false,
        }
    }

    /// Whether `id` is a probe's connection.
    pub(super) fn is_probe(&self, id: ConnId) -> bool {
        self.out.contains_key(&id)
    }

    /// The probe on `id` ended (connected or failed): the PE it checked.
    pub(super) fn end(&mut self, id: ConnId) -> Option<Probed> {
        self.out.remove(&id)
    }
}

/// The first TCP address of the PE's service.
fn service_addr(pe: &PoolElement) -> Option<SocketAddr> {
    match &pe.user_transport {
        UserTransport::Address(t) if t.protocol == rserpool_wire::Protocol::TCP => {
            t.socket_addrs().next()
        }
        _ => None,
    }
}
