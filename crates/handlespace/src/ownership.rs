//! The ownership set (paper §3.4): per home registrar, the PEs it owns and their incremental
//! RFC 1071 PE checksum (RFC 5353 §3.6.2).
//!
//! Why it exists: registrars announce and compare these checksums to find out whether their
//! copies of an owner's PEs agree, so the checksum must cost O(1) per change rather than a pass
//! over the owner's PEs. Each owner keeps a dense member array (swap-remove, positions
//! in the PE's [`SelLink`](crate::pool::SelLink)) that the sync traversal walks.

use crate::{Handlespace, PeRef};
use rserpool_wire::checksum::PeChecksum;

#[derive(Debug, Default)]
pub(crate) struct Owner {
    pub(crate) members: Vec<u32>,
    pub(crate) checksum: PeChecksum,
}

impl Handlespace {
    /// The ENRP PE checksum over the PEs owned by `owner` (0xffff when it owns none).
    pub fn checksum(&self, owner: u32) -> u16 {
        self.owners
            .get(&owner)
            .map_or(PeChecksum::new().value(), |o| o.checksum.value())
    }

    /// Number of PEs owned by `owner`.
    pub fn owned_count(&self, owner: u32) -> usize {
        self.owners.get(&owner).map_or(0, |o| o.members.len())
    }

    /// The PEs owned by `owner`, in no particular order.
    pub fn owned(&self, owner: u32) -> impl Iterator<Item = PeRef> + '_ {
        let members: &[u32] = self.owners.get(&owner).map_or(&[], |o| &o.members);
        members.iter().map(|&i| PeRef(i))
    }

    /// The home registrars that own at least one PE.
    pub fn owners(&self) -> impl Iterator<Item = u32> + '_ {
        self.owners.keys().copied()
    }

    /// Moves a PE to another home registrar (ENRP takeover).
    pub fn set_home(&mut self, r: PeRef, home: u32) {
        let old = self.pes[r.0 as usize].element.home_registrar;
        if old != home {
            self.owner_remove(r.0, old);
            self.pes[r.0 as usize].element.home_registrar = home;
            self.owner_insert(r.0, home);
        }
    }

    pub(crate) fn owner_insert(&mut self, i: u32, owner: u32) {
        let block = self.block_sum(i);
        let o = self.owners.entry(owner).or_default();
        self.links[i as usize].owner_pos = o.members.len() as u32;
        o.members.push(i);
        o.checksum.add(block);
    }

    pub(crate) fn owner_remove(&mut self, i: u32, owner: u32) {
        let block = self.block_sum(i);
        let pos = self.links[i as usize].owner_pos as usize;
        let Some(o) = self.owners.get_mut(&owner) else {
            return;
        };
        o.checksum.remove(block);
        let last = o.members.len() - 1;
        o.members.swap_remove(pos);
        let moved = o.members.get(pos).copied();
        if let Some(m) = moved {
            self.links[m as usize].owner_pos = pos as u32;
        }
        if o.members.is_empty() {
            self.owners.remove(&owner);
        }
        if !self.cursors.is_empty() {
            self.fix_cursors(owner, i, pos, last, moved);
        }
    }

    /// The PE's block in the checksum: its pool handle's sum plus its PE ID's two halves.
    fn block_sum(&self, i: u32) -> u64 {
        let e = &self.pes[i as usize];
        let id = e.element.id;
        self.pool_ref(e.pool).handle_sum + u64::from(id >> 16) + u64::from(id & 0xffff)
    }
}
