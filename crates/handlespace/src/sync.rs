//! Resumable traversal of the handlespace in blocks, for ENRP handle table synchronisation
//! (HANDLE_TABLE_RESPONSE blocks, RFC 5353).
//!
//! Why it exists: a full handle table does not fit one message, and the handlespace keeps
//! changing between blocks. A [`SyncCursor`] walks the owners' member arrays and stays exact
//! across swap-removes ([`Handlespace::fix_cursors`], called by the ownership set): every PE
//! present throughout the traversal is returned exactly once.

use crate::{Handlespace, PeRef};

/// A resumable traversal (ENRP HANDLE_TABLE_RESPONSE blocks); see [`Handlespace::sync_begin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncCursor {
    slot: u32,
    generation: u32,
}

#[derive(Debug, Default)]
pub(crate) struct CursorState {
    generation: u32,
    active: bool,
    /// Owners still to traverse (reversed: the next one is last).
    owners: Vec<u32>,
    current: Option<u32>,
    pos: usize,
    /// Entries moved behind `pos` by a swap-remove, still to be sent.
    pending: Vec<u32>,
    started: u64,
}

const MAX_CURSORS: usize = 64;

impl Handlespace {
    /// Starts a traversal of the PEs owned by `owner`, or of all PEs when `None`. At most 64
    /// traversals are open; opening another ends the oldest.
    pub fn sync_begin(&mut self, owner: Option<u32>) -> SyncCursor {
        self.cursor_clock += 1;
        let slot = match self.cursors.iter().position(|c| !c.active) {
            Some(s) => s,
            None if self.cursors.len() < MAX_CURSORS => {
                self.cursors.push(CursorState::default());
                self.cursors.len() - 1
            }
            None => self
                .cursors
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| c.started)
                .map_or(0, |(i, _)| i),
        };
        let mut owners: Vec<u32> = match owner {
            Some(o) => vec![o],
            None => {
                let mut v: Vec<u32> = self.owners.keys().copied().collect();
                v.sort_unstable_by(|a, b| b.cmp(a));
                v
            }
        };
        let current = owners.pop();
        let c = &mut self.cursors[slot];
        c.generation = c.generation.wrapping_add(1);
        c.active = true;
        c.owners = owners;
        c.current = current;
        c.pos = 0;
        c.pending.clear();
        c.started = self.cursor_clock;
        SyncCursor {
            slot: slot as u32,
            generation: c.generation,
        }
    }

    /// Appends up to `max` further PEs of the traversal to `out`; returns `true` while more
    /// remain. A PE added meanwhile may or may not be included; one removed meanwhile is not;
    /// every PE present throughout is returned exactly once.
    pub fn sync_next(&mut self, cursor: SyncCursor, max: usize, out: &mut Vec<PeRef>) -> bool {
        let Some(c) = self.cursors.get_mut(cursor.slot as usize) else {
            return false;
        };
        if !c.active || c.generation != cursor.generation {
            return false;
        }
        let mut budget = max;
        while budget > 0 {
            if let Some(p) = c.pending.pop() {
                out.push(PeRef(p));
                budget -= 1;
                continue;
            }
            let Some(owner) = c.current else { break };
            let members: &[u32] = self.owners.get(&owner).map_or(&[], |o| &o.members);
            if c.pos < members.len() {
                let take = budget.min(members.len() - c.pos);
                out.extend(members[c.pos..c.pos + take].iter().map(|&i| PeRef(i)));
                c.pos += take;
                budget -= take;
            } else {
                c.current = c.owners.pop();
                c.pos = 0;
            }
        }
        let members_left = c.current.is_some_and(|o| {
            c.pos < self.owners.get(&o).map_or(0, |x| x.members.len()) || !c.owners.is_empty()
        });
        let more = !c.pending.is_empty() || members_left;
        if !more {
            c.active = false;
        }
        more
    }

    /// Ends a traversal early.
    pub fn sync_end(&mut self, cursor: SyncCursor) {
        if let Some(c) = self.cursors.get_mut(cursor.slot as usize)
            && c.generation == cursor.generation
        {
            c.active = false;
        }
    }

    /// Keeps open traversals exact across a swap-remove at `pos` of `owner`'s member array.
    pub(crate) fn fix_cursors(
        &mut self,
        owner: u32,
        removed: u32,
        pos: usize,
        last: usize,
        moved: Option<u32>,
    ) {
        for c in self.cursors.iter_mut().filter(|c| c.active) {
            if let Some(k) = c.pending.iter().position(|&p| p == removed) {
                c.pending.swap_remove(k);
            }
            if c.current != Some(owner) {
                continue;
            }
            if pos < c.pos {
                if last >= c.pos {
                    // The last, not yet visited entry moved behind the cursor.
                    if let Some(m) = moved {
                        c.pending.push(m);
                    }
                } else {
                    // Removed and moved both visited: the visited prefix shrank by one.
                    c.pos -= 1;
                }
            }
        }
    }
}
