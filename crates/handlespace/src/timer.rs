//! The timer schedule: a hierarchical timing wheel with intrusive per-slot lists.
//!
//! Each PE has exactly one timer at a time (paper §3.3), so the wheel keeps one link per PE,
//! indexed like the PE slab. Scheduling and cancelling are O(1); finding the next occupied slot
//! is a bit scan per level. Time is an input in milliseconds; nothing here reads a clock.
//!
//! [`Wheel::next_deadline`] is exact for timers due within the current 64 ms block and a lower
//! bound otherwise (the start of the slot holding the earliest timer). A driver that sleeps until
//! then and calls [`Wheel::expire`] may see nothing fire; the slot's timers have then moved to
//! finer levels and the next call gives a tighter bound.

const SLOT_BITS: u32 = 6;
const SLOTS: usize = 1 << SLOT_BITS;
const LEVELS: usize = 6;
/// The farthest a timer can be placed ahead of the wheel's time (about 2.2 years).
const MAX_SPAN: u64 = (1 << (SLOT_BITS as usize * LEVELS)) - 1;
const NIL: u32 = u32::MAX;
const UNSCHEDULED: u16 = u16::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    deadline: u64,
    prev: u32,
    next: u32,
    /// level * SLOTS + slot, or UNSCHEDULED.
    slot: u16,
    tag: u8,
}

impl Default for Link {
    fn default() -> Self {
        Self {
            deadline: 0,
            prev: NIL,
            next: NIL,
            slot: UNSCHEDULED,
            tag: 0,
        }
    }
}

/// A timing wheel holding at most one timer per index.
#[derive(Debug)]
pub struct Wheel {
    elapsed: u64,
    heads: Box<[u32; SLOTS * LEVELS]>,
    occupied: [u64; LEVELS],
    links: Vec<Link>,
    len: usize,
}

impl Wheel {
    pub fn new(now: u64) -> Self {
        Self {
            elapsed: now,
            heads: Box::new([NIL; SLOTS * LEVELS]),
            occupied: [0; LEVELS],
            links: Vec::new(),
            len: 0,
        }
    }

    /// Number of scheduled timers.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The deadline and tag of `idx`'s timer, if scheduled.
    pub fn get(&self, idx: u32) -> Option<(u64, u8)> {
        self.links
            .get(idx as usize)
            .filter(|l| l.slot != UNSCHEDULED)
            .map(|l| (l.deadline, l.tag))
    }

    /// Schedules (or reschedules) the timer of `idx` for `deadline`, with a caller's tag.
    pub fn schedule(&mut self, idx: u32, deadline: u64, tag: u8) {
        let i = idx as usize;
        if i >= self.links.len() {
            self.links.resize(i + 1, Link::default());
        }
        if self.links[i].slot != UNSCHEDULED {
            self.unlink(idx);
        } else {
            self.len += 1;
        }
        self.links[i].deadline = deadline;
        self.links[i].tag = tag;
        self.link(idx);
    }

    /// Cancels the timer of `idx`; returns whether one was scheduled.
    pub fn cancel(&mut self, idx: u32) -> bool {
        match self.links.get(idx as usize) {
            Some(l) if l.slot != UNSCHEDULED => {
                self.unlink(idx);
                self.links[idx as usize].slot = UNSCHEDULED;
                self.len -= 1;
                true
            }
            _ => false,
        }
    }

    /// When to call [`expire`](Self::expire) next (see the module docs), or `None` if idle.
    pub fn next_deadline(&self) -> Option<u64> {
        self.next_slot().map(|(_, d)| d)
    }

    /// Fires every timer due at or before `now`: pushes `(idx, tag)` to `fired` and unschedules
    /// it. Advances the wheel's time to `now` (time never goes backwards).
    pub fn expire(&mut self, now: u64, fired: &mut Vec<(u32, u8)>) {
        while let Some((slot, start)) = self.next_slot() {
            if start > now {
                break;
            }
            let mut cur = self.heads[slot];
            self.heads[slot] = NIL;
            self.occupied[slot / SLOTS] &= !(1u64 << (slot % SLOTS));
            self.elapsed = self.elapsed.max(start);
            while cur != NIL {
                let l = &mut self.links[cur as usize];
                let next = l.next;
                l.prev = NIL;
                l.next = NIL;
                if l.deadline <= now {
                    l.slot = UNSCHEDULED;
                    self.len -= 1;
                    fired.push((cur, l.tag));
                } else {
                    self.link(cur);
                }
                cur = next;
            }
        }
        self.elapsed = self.elapsed.max(now);
    }

    fn next_slot(&self) -> Option<(usize, u64)> {
        for level in 0..LEVELS {
            let occ = self.occupied[level];
            if occ == 0 {
                continue;
            }
            let shift = SLOT_BITS * level as u32;
            let now_slot = ((self.elapsed >> shift) as usize) % SLOTS;
            let rotated = occ.rotate_right(now_slot as u32);
            let slot = (now_slot + rotated.trailing_zeros() as usize) % SLOTS;
            let level_span = 1u64 << (shift + SLOT_BITS);
            let level_start = self.elapsed & !(level_span - 1);
            let mut start = level_start + ((slot as u64) << shift);
            if slot < now_slot {
                // Only reachable for timers placed at the wheel's horizon.
                start += level_span;
            }
            return Some((level * SLOTS + slot, start.max(self.elapsed)));
        }
        None
    }

    fn link(&mut self, idx: u32) {
        let deadline = self.links[idx as usize].deadline;
        let when = deadline.clamp(self.elapsed, self.elapsed + MAX_SPAN);
        let masked = (self.elapsed ^ when) | (SLOTS as u64 - 1);
        let significant = 63 - masked.leading_zeros();
        let level = ((significant / SLOT_BITS) as usize).min(LEVELS - 1);
        let slot = level * SLOTS + ((when >> (SLOT_BITS * level as u32)) as usize % SLOTS);
        let head = self.heads[slot];
        let l = &mut self.links[idx as usize];
        l.slot = slot as u16;
        l.prev = NIL;
        l.next = head;
        if head != NIL {
            self.links[head as usize].prev = idx;
        }
        self.heads[slot] = idx;
        self.occupied[level] |= 1u64 << (slot % SLOTS);
    }

    fn unlink(&mut self, idx: u32) {
        let Link {
            prev, next, slot, ..
        } = self.links[idx as usize];
        if prev != NIL {
            self.links[prev as usize].next = next;
        } else {
            self.heads[slot as usize] = next;
            if next == NIL {
                let s = slot as usize;
                self.occupied[s / SLOTS] &= !(1u64 << (s % SLOTS));
            }
        }
        if next != NIL {
            self.links[next as usize].prev = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fires_in_order_and_cancels() {
        let mut w = Wheel::new(1000);
        w.schedule(1, 1005, 1);
        w.schedule(2, 1000 + 70_000, 2);
        w.schedule(3, 1003, 3);
        w.schedule(4, 2000, 4);
        assert!(w.cancel(4));
        assert!(!w.cancel(4));
        assert_eq!(w.next_deadline(), Some(1003));
        let mut fired = Vec::new();
        w.expire(1004, &mut fired);
        assert_eq!(fired, vec![(3, 3)]);
        w.expire(1005, &mut fired);
        assert_eq!(fired, vec![(3, 3), (1, 1)]);
        fired.clear();
        w.expire(70_999, &mut fired);
        assert!(fired.is_empty());
        w.expire(71_000, &mut fired);
        assert_eq!(fired, vec![(2, 2)]);
        assert!(w.is_empty());
        assert_eq!(w.next_deadline(), None);
    }

    proptest! {
        /// Against a naive model: after any schedule/cancel/expire sequence, exactly the timers
        /// due fire, nothing early, and next_deadline never overshoots the true minimum.
        #[test]
        fn matches_model(ops in prop::collection::vec((0u8..3, 0u32..40, 0u64..300_000), 1..300)) {
            let mut w = Wheel::new(0);
            let mut model: std::collections::BTreeMap<u32, u64> = Default::default();
            let mut now = 0u64;
            let mut fired = Vec::new();
            for (op, idx, t) in ops {
                match op {
                    0 => { w.schedule(idx, now + t, 0); model.insert(idx, now + t); }
                    1 => { prop_assert_eq!(w.cancel(idx), model.remove(&idx).is_some()); }
                    _ => {
                        if let Some(&min) = model.values().min() {
                            prop_assert!(w.next_deadline().unwrap() <= min);
                        }
                        now += t % 5000;
                        fired.clear();
                        w.expire(now, &mut fired);
                        let mut got: Vec<u32> = fired.iter().map(|f| f.0).collect();
                        got.sort();
                        let due: Vec<u32> = model.iter().filter(|(_, d)| **d <= now).map(|(i, _)| *i).collect();
                        model.retain(|_, d| *d > now);
                        prop_assert_eq!(got, due);
                    }
                }
                prop_assert_eq!(w.len(), model.len());
            }
        }
    }
}
