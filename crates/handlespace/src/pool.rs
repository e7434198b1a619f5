//! A pool and its members: the PE ID index, the dense member array and the selection structure
//! the pool's policy type chose, kept in step as a PE joins, changes its policy information and
//! leaves.
//!
//! Why it exists: registration, re-registration and removal all touch the same three indexes
//! of a pool; keeping the per-policy upkeep in one place means every selection structure sees
//! the same sequence of changes, whoever causes them. Reading them for handle resolution is
//! `resolution`'s job.

use crate::select::{Fenwick, Heap, HeapItem};
use crate::{FastMap, NIL};
use rserpool_wire::checksum::handle_sum;
use rserpool_wire::policy::policy_type as pt;
use rserpool_wire::ptype;
use rserpool_wire::{PoolElement, PoolHandle, Protocol, UserTransport, policy::Policy};

/// The positions of a PE in the handlespace's structures, kept apart from the (large, mostly
/// cold) entries so that heap sifts, ring walks and swap-removes touch one dense array.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SelLink {
    /// Heap position, or ring predecessor.
    pub(crate) sel: u32,
    /// Ring successor.
    pub(crate) next: u32,
    /// Index in the pool's member array.
    pub(crate) pool_pos: u32,
    /// Index in the owner's member array.
    pub(crate) owner_pos: u32,
}

/// How a pool selects, chosen by its policy type.
#[derive(Debug)]
pub(crate) enum Selection {
    Ring { head: u32 },
    Heap(Heap),
    Uniform,
    Weighted(Fenwick),
}

#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) handle: PoolHandle,
    pub(crate) handle_sum: u64,
    pub(crate) policy_type: u32,
    pub(crate) transport_ptype: u16,
    pub(crate) transport_use: Option<u16>,
    pub(crate) by_id: FastMap<u32, u32>,
    pub(crate) members: Vec<u32>,
    pub(crate) sel: Selection,
    /// The handlespace's change count at the last change a pool user can see (a PE joined,
    /// left, or changed its policy information or transport); see
    /// [`Handlespace::pool_version`](crate::Handlespace::pool_version).
    pub(crate) version: u64,
}

/// Whether a policy is served, and by which structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Ring,
    Heap,
    Uniform,
    Weighted,
}

pub(crate) fn kind_of(policy_type: u32) -> Option<Kind> {
    Some(match policy_type {
        pt::ROUND_ROBIN => Kind::Ring,
        pt::WEIGHTED_ROUND_ROBIN
        | pt::PRIORITY
        | pt::LEAST_USED
        | pt::LEAST_USED_DEGRADATION
        | pt::PRIORITY_LEAST_USED
        | pt::CREDITS => Kind::Heap,
        pt::RANDOM => Kind::Uniform,
        pt::WEIGHTED_RANDOM | pt::RANDOMIZED_LEAST_USED => Kind::Weighted,
        _ => return None,
    })
}

/// The transport a pool requires of its members: parameter type and, for SCTP, the
/// data/control use.
pub(crate) fn transport_kind(t: &UserTransport) -> (u16, Option<u16>) {
    match t {
        UserTransport::Address(a) => match a.protocol {
            Protocol::Sctp { transport_use } => (ptype::SCTP_TRANSPORT, Some(transport_use)),
            _ => (t.ptype(), None),
        },
        UserTransport::Opaque(_) => (ptype::OPAQUE_TRANSPORT, None),
    }
}

/// The primary heap value of an ordered policy at (re-)registration; smaller is selected
/// first. The heap key holds the live value: LUD adds its degradation counter there (reset to
/// zero by a re-registration), WRR keeps its virtual pass there (`pass` is the value to keep).
fn primary(policy: &Policy, pass: u64) -> u64 {
    match *policy {
        Policy::WeightedRoundRobin { weight: 0 } => u64::MAX,
        Policy::WeightedRoundRobin { .. } => pass,
        Policy::Priority { priority } => u64::from(u32::MAX - priority),
        Policy::LeastUsed { load } | Policy::LeastUsedDegradation { load, .. } => u64::from(load),
        Policy::PriorityLeastUsed { load, degradation } => u64::from(load) + u64::from(degradation),
        // Most credits first.
        Policy::Credits { credits, .. } => u64::from(u32::MAX - credits),
        _ => 0,
    }
}

/// The current WRR virtual time: the smallest pass of a PE that can serve.
fn wrr_now(heap: &Heap) -> u64 {
    heap.items()
        .first()
        .map(|top| top.key.0)
        .filter(|&v| v != u64::MAX)
        .unwrap_or(0)
}

/// Selection weight of a weighted random policy.
fn weight(policy: &Policy) -> u64 {
    match *policy {
        Policy::WeightedRandom { weight } => u64::from(weight),
        // RFC 5356: weight 0xFFFFFFFF - load; like rsplib, a fully loaded PE keeps weight 1 so
        // a pool of busy PEs still answers.
        Policy::RandomizedLeastUsed { load } => u64::from(u32::MAX - load).max(1),
        _ => 1,
    }
}

impl Pool {
    /// An empty pool whose policy type and transport are those of its first PE, `element`.
    pub(crate) fn new(handle: &PoolHandle, element: &PoolElement, kind: Kind) -> Self {
        let (transport_ptype, transport_use) = transport_kind(&element.user_transport);
        Self {
            handle: handle.clone(),
            handle_sum: handle_sum(handle.as_bytes()),
            policy_type: element.policy.policy_type(),
            transport_ptype,
            transport_use,
            by_id: FastMap::default(),
            members: Vec::new(),
            sel: match kind {
                Kind::Ring => Selection::Ring { head: NIL },
                Kind::Heap => Selection::Heap(Heap::default()),
                Kind::Uniform => Selection::Uniform,
                Kind::Weighted => Selection::Weighted(Fenwick::default()),
            },
            version: 0,
        }
    }

    /// Adds entry `i` (PE ID `id`) as the last member and lets it join the selection
    /// structure; `seq` orders it after every PE with the same heap value.
    pub(crate) fn join(
        &mut self,
        i: u32,
        id: u32,
        policy: &Policy,
        seq: u64,
        links: &mut [SelLink],
    ) {
        self.by_id.insert(id, i);
        links[i as usize].pool_pos = self.members.len() as u32;
        self.members.push(i);
        match &mut self.sel {
            Selection::Ring { head } => {
                if *head == NIL {
                    links[i as usize].sel = i;
                    links[i as usize].next = i;
                    *head = i;
                } else {
                    // New PEs join at the end of the current round (before the head).
                    let h = *head;
                    let tail = links[h as usize].sel;
                    links[i as usize].sel = tail;
                    links[i as usize].next = h;
                    links[tail as usize].next = i;
                    links[h as usize].sel = i;
                }
            }
            Selection::Heap(heap) => {
                // A WRR newcomer joins at the current virtual time, so it gets no burst.
                let key = (primary(policy, wrr_now(heap)), seq);
                heap.push(HeapItem { key, pe: i }, &mut |pe, p| {
                    links[pe as usize].sel = p
                });
            }
            Selection::Uniform => {}
            Selection::Weighted(f) => f.push(weight(policy)),
        }
    }

    /// Re-keys member `i` after a re-registration brought new policy information.
    pub(crate) fn rekey(&mut self, i: u32, policy: &Policy, links: &mut [SelLink]) {
        match &mut self.sel {
            Selection::Ring { .. } | Selection::Uniform => {}
            Selection::Heap(heap) => {
                // Keeps the tie-break position and a WRR pass; resets LUD's degradation
                // (RFC 5356: on every (re-)registration).
                let at = links[i as usize].sel as usize;
                let (old, seq) = heap.items()[at].key;
                let pass = if old == u64::MAX { wrr_now(heap) } else { old };
                let key = (primary(policy, pass), seq);
                heap.set_key(at, key, &mut |pe, p| links[pe as usize].sel = p);
            }
            Selection::Weighted(f) => {
                let w = weight(policy);
                f.set(links[i as usize].pool_pos as usize, w);
            }
        }
    }

    /// Takes member `i` (PE ID `id`) out of the PE ID index, the selection structure and the
    /// member array; the member swapped into its place learns its new position.
    pub(crate) fn leave(&mut self, i: u32, id: u32, links: &mut [SelLink]) {
        let pool_pos = links[i as usize].pool_pos;
        self.by_id.remove(&id);
        match &mut self.sel {
            Selection::Ring { head } => {
                let SelLink {
                    sel: prev, next, ..
                } = links[i as usize];
                if next == i {
                    *head = NIL;
                } else {
                    links[prev as usize].next = next;
                    links[next as usize].sel = prev;
                    if *head == i {
                        *head = next;
                    }
                }
            }
            Selection::Heap(heap) => {
                let at = links[i as usize].sel as usize;
                heap.remove(at, &mut |pe, p| links[pe as usize].sel = p);
            }
            Selection::Uniform => {}
            Selection::Weighted(f) => {
                let last = self.members.len() - 1;
                let w_last = f.weight(last);
                f.set(pool_pos as usize, w_last);
                f.set(last, 0);
                f.pop();
            }
        }
        self.members.swap_remove(pool_pos as usize);
        if let Some(&moved) = self.members.get(pool_pos as usize) {
            links[moved as usize].pool_pos = pool_pos;
        }
    }
}
