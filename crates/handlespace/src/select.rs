//! Selection structures, one per kind of policy (DESIGN.md principle 3): an indexed 4-ary
//! min-heap for the ordered policies (LU family, Priority, Weighted Round Robin) and a Fenwick
//! tree for the weighted random ones. Round Robin's ring lives in the PE entries themselves and
//! Random needs nothing but the pool's member array.

/// A heap key: the policy's primary value, then a sequence number that makes equal values take
/// turns (round robin among ties, RFC 5356 §4).
pub type Key = (u64, u64);

#[derive(Debug, Clone, Copy)]
pub struct HeapItem {
    pub key: Key,
    pub pe: u32,
}

/// Indexed 4-ary min-heap. Positions are written back through `pos`, which the handlespace
/// stores in the PE entry, so any PE's key can be changed in O(log n).
#[derive(Debug, Default)]
pub struct Heap {
    items: Vec<HeapItem>,
}

const D: usize = 4;

impl Heap {
    pub fn items(&self) -> &[HeapItem] {
        &self.items
    }

    /// Subtracts `base` from every primary value except `u64::MAX`; all values must be at least
    /// `base`. Order is preserved, so nothing moves.
    pub fn rebase(&mut self, base: u64) {
        for item in &mut self.items {
            if item.key.0 != u64::MAX {
                item.key.0 -= base;
            }
        }
    }

    pub fn push(&mut self, item: HeapItem, pos: &mut impl FnMut(u32, u32)) {
        self.items.push(item);
        self.sift_up(self.items.len() - 1, pos);
    }

    pub fn remove(&mut self, at: usize, pos: &mut impl FnMut(u32, u32)) {
        let last = self.items.len() - 1;
        self.items.swap(at, last);
        self.items.pop();
        if at < self.items.len() {
            pos(self.items[at].pe, at as u32);
            self.restore(at, pos);
        }
    }

    pub fn set_key(&mut self, at: usize, key: Key, pos: &mut impl FnMut(u32, u32)) {
        self.items[at].key = key;
        self.restore(at, pos);
    }

    fn restore(&mut self, at: usize, pos: &mut impl FnMut(u32, u32)) {
        if at > 0 && self.items[at].key < self.items[(at - 1) / D].key {
            self.sift_up(at, pos);
        } else {
            self.sift_down(at, pos);
        }
    }

    fn sift_up(&mut self, mut at: usize, pos: &mut impl FnMut(u32, u32)) {
        let item = self.items[at];
        while at > 0 {
            let parent = (at - 1) / D;
            if self.items[parent].key <= item.key {
                break;
            }
            self.items[at] = self.items[parent];
            pos(self.items[at].pe, at as u32);
            at = parent;
        }
        self.items[at] = item;
        pos(item.pe, at as u32);
    }

    fn sift_down(&mut self, mut at: usize, pos: &mut impl FnMut(u32, u32)) {
        let item = self.items[at];
        let n = self.items.len();
        loop {
            let first = at * D + 1;
            if first >= n {
                break;
            }
            let mut best = first;
            for c in first + 1..(first + D).min(n) {
                if self.items[c].key < self.items[best].key {
                    best = c;
                }
            }
            if self.items[best].key >= item.key {
                break;
            }
            self.items[at] = self.items[best];
            pos(self.items[at].pe, at as u32);
            at = best;
        }
        self.items[at] = item;
        pos(item.pe, at as u32);
    }

    /// Appends the heap positions of the `k` smallest keys, in ascending order, to `out`.
    /// Explores only the frontier below already chosen items: O(k · D · k).
    pub fn smallest(&self, k: usize, out: &mut Vec<usize>, frontier: &mut Vec<usize>) {
        let n = self.items.len();
        if n == 0 || k == 0 {
            return;
        }
        let start = out.len();
        // Small candidate frontier; k is tiny (MaxHResItems), so a linear scan beats a heap.
        frontier.clear();
        frontier.push(0);
        while out.len() - start < k && !frontier.is_empty() {
            let (fi, _) = frontier
                .iter()
                .enumerate()
                .min_by_key(|(_, p)| self.items[**p].key)
                .unwrap_or((0, &0));
            let p = frontier.swap_remove(fi);
            out.push(p);
            let first = p * D + 1;
            frontier.extend(first..(first + D).min(n));
        }
    }
}

/// Fenwick (binary indexed) tree of u64 weights over positions 0..n, with sampling by prefix
/// sum. Grows and shrinks at the end, matching the pool's swap-remove member array.
#[derive(Debug, Default)]
pub struct Fenwick {
    tree: Vec<u64>,
    weights: Vec<u64>,
    total: u64,
}

impl Fenwick {
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn weight(&self, i: usize) -> u64 {
        self.weights[i]
    }

    pub fn push(&mut self, w: u64) {
        let i = self.tree.len() + 1; // 1-based index of the new node
        let low = i & i.wrapping_neg();
        // The new node covers (i - low, i]: its own weight plus the existing tail of that range.
        let mut v = w;
        let mut j = i - 1;
        let stop = i - low;
        while j > stop {
            v += self.tree[j - 1];
            j -= j & j.wrapping_neg();
        }
        self.tree.push(v);
        self.weights.push(w);
        self.total += w;
    }

    /// Removes the last position (its weight must be moved elsewhere by the caller first).
    pub fn pop(&mut self) {
        if let Some(w) = self.weights.pop() {
            self.tree.pop();
            self.total -= w;
        }
    }

    pub fn set(&mut self, i: usize, w: u64) {
        let old = self.weights[i];
        if old == w {
            return;
        }
        self.weights[i] = w;
        self.total = self.total - old + w;
        let mut j = i + 1;
        while j <= self.tree.len() {
            self.tree[j - 1] = self.tree[j - 1] - old + w;
            j += j & j.wrapping_neg();
        }
    }

    /// The position whose cumulative range contains `r` (0 <= r < total).
    pub fn find(&self, mut r: u64) -> usize {
        let n = self.tree.len();
        let mut pos = 0usize;
        let mut step = if n == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - n.leading_zeros())
        };
        while step > 0 {
            let next = pos + step;
            if next <= n && self.tree[next - 1] <= r {
                pos = next;
                r -= self.tree[next - 1];
            }
            step >>= 1;
        }
        pos.min(n.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn fenwick_matches_prefix_sums(ws in prop::collection::vec(0u64..100, 1..200), sets in prop::collection::vec((0usize..200, 0u64..100), 0..50), pops in 0usize..20) {
            let mut f = Fenwick::default();
            let mut model = ws.clone();
            ws.iter().for_each(|&w| f.push(w));
            for (i, w) in sets { let i = i % model.len(); f.set(i, w); model[i] = w; }
            for _ in 0..pops.min(model.len() - 1) { let last = model.len() - 1; f.set(last, 0); model[last] = 0; f.pop(); model.pop(); }
            prop_assert_eq!(f.total(), model.iter().sum::<u64>());
            let mut acc = 0;
            for (i, &w) in model.iter().enumerate() {
                for r in acc..acc + w { prop_assert_eq!(f.find(r), i); }
                acc += w;
            }
        }

        #[test]
        fn heap_smallest_matches_sort(keys in prop::collection::vec(0u64..50, 1..100), k in 1usize..8, changes in prop::collection::vec((0usize..100, 0u64..50), 0..30)) {
            let mut h = Heap::default();
            let mut pos = vec![0u32; keys.len()];
            let mut model: Vec<(u64, u64)> = Vec::new();
            for (i, &kk) in keys.iter().enumerate() {
                h.push(HeapItem { key: (kk, i as u64), pe: i as u32 }, &mut |pe, p| pos[pe as usize] = p);
                model.push((kk, i as u64));
            }
            for (i, kk) in changes {
                let i = i % keys.len();
                h.set_key(pos[i] as usize, (kk, i as u64), &mut |pe, p| pos[pe as usize] = p);
                model[i] = (kk, i as u64);
            }
            let mut out = Vec::new();
            h.smallest(k, &mut out, &mut Vec::new());
            let got: Vec<u64> = out.iter().map(|&p| h.items()[p].key.1).collect();
            let mut sorted = model.clone();
            sorted.sort();
            let want: Vec<u64> = sorted.iter().take(k).map(|x| x.1).collect();
            prop_assert_eq!(got, want);
        }
    }
}
