//! Maglev consistent hashing (Eisenbud et al., "Maglev: A Fast and Reliable Software Network
//! Load Balancer", NSDI 2016, §3.4): a lookup table of a prime size M, filled by every PE in
//! turn along its own permutation of the slots, so that each PE holds M/N slots (±1) and, when
//! one of N PEs leaves, about 1/N of the keys move, those it held and few others.
//!
//! The table depends only on the set of PE identifiers (their order does not matter) and on
//! fixed hash functions, so every proxy of a tier that sees the same pool builds the same
//! table and sends the same key to the same PE.

use crate::balance::keys::mix;

/// Table sizes (primes): the small one up to 160 PEs, at least 100 slots per PE (Maglev's
/// advice for a small imbalance). The size must not change when one PE comes or goes, or
/// every key would move: it changes only across 160 PEs.
const SMALL: usize = 16_381;
const LARGE: usize = 65_521;

/// A Maglev lookup table over a set of PE identifiers.
#[derive(Debug, Clone, Default)]
pub(crate) struct Maglev {
    /// The PE identifiers, sorted.
    ids: Vec<u32>,
    /// Slot → index into `ids`.
    table: Vec<u32>,
}

impl Maglev {
    /// The table for these PEs.
    pub(crate) fn new(ids: &[u32]) -> Self {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let n = ids.len();
        if n == 0 {
            return Self::default();
        }
        let m = if n <= SMALL / 100 { SMALL } else { LARGE };
        let perm: Vec<(usize, usize)> = ids
            .iter()
            .map(|&id| {
                let offset = (mix(u64::from(id) ^ 0x6d61_676c_6576_3031) % m as u64) as usize;
                let skip =
                    (mix(u64::from(id) ^ 0x6d61_676c_6576_3032) % (m as u64 - 1)) as usize + 1;
                (offset, skip)
            })
            .collect();
        let mut next = vec![0usize; n];
        let mut table = vec![u32::MAX; m];
        let mut filled = 0;
        'fill: loop {
            for i in 0..n {
                let (offset, skip) = perm[i];
                let mut c = (offset + next[i] * skip) % m;
                while table[c] != u32::MAX {
                    next[i] += 1;
                    c = (offset + next[i] * skip) % m;
                }
                table[c] = i as u32;
                next[i] += 1;
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
        }
        Self { ids, table }
    }

    /// The PEs for `key`, its own first, then the owners of the following slots (each once):
    /// where the key goes while its PE is ejected, gone or full.
    pub(crate) fn lookup(&self, key: u64) -> impl Iterator<Item = u32> + '_ {
        let m = self.table.len();
        let start = if m == 0 { 0 } else { (key % m as u64) as usize };
        // Which PEs were named already: made only when the first one will not do.
        let mut seen: Vec<bool> = Vec::new();
        (0..m).filter_map(move |i| {
            let k = self.table[(start + i) % m] as usize;
            if i == 0 {
                return Some(self.ids[k]);
            }
            if seen.is_empty() {
                seen = vec![false; self.ids.len()];
                seen[self.table[start] as usize] = true;
            }
            (!std::mem::replace(&mut seen[k], true)).then(|| self.ids[k])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::keys::mix;

    fn owners(t: &Maglev, keys: u64) -> Vec<u32> {
        (0..keys)
            .map(|k| t.lookup(mix(k)).next().unwrap())
            .collect()
    }

    #[test]
    fn every_pe_holds_its_share_of_the_slots() {
        let ids: Vec<u32> = (1..=10).map(|i| i * 7919).collect();
        let t = Maglev::new(&ids);
        assert_eq!(t.table.len(), SMALL);
        for (i, _) in ids.iter().enumerate() {
            let held = t.table.iter().filter(|&&k| k as usize == i).count();
            assert!((1638..=1639).contains(&held), "{held}");
        }
    }

    #[test]
    fn the_table_is_the_same_whatever_the_order_of_the_pes() {
        let a = Maglev::new(&[5, 3, 9, 1]);
        let b = Maglev::new(&[9, 1, 5, 3]);
        assert_eq!(a.table, b.table);
        assert_eq!(owners(&a, 1000), owners(&b, 1000));
    }

    #[test]
    fn when_one_of_n_pes_leaves_about_one_nth_of_the_keys_move() {
        for n in [3u32, 5, 10, 20] {
            let ids: Vec<u32> = (1..=n).map(|i| 0x1000 + i * 31).collect();
            let before = owners(&Maglev::new(&ids), 100_000);
            let gone = ids[(n / 2) as usize];
            let rest: Vec<u32> = ids.iter().copied().filter(|&i| i != gone).collect();
            let after = owners(&Maglev::new(&rest), 100_000);
            let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
            let share = moved as f64 / 100_000.0;
            assert!(share <= 1.0 / f64::from(n) + 0.02, "{n} PEs: {share}");
            // Of the keys the others held, few move.
            let others = before
                .iter()
                .zip(&after)
                .filter(|(a, b)| a != b && **a != gone)
                .count();
            assert!(
                others as f64 / 100_000.0 <= 0.02,
                "{n} PEs: {others} moved needlessly"
            );
        }
    }

    #[test]
    fn a_lookup_names_every_pe_once_its_own_first() {
        let t = Maglev::new(&[1, 2, 3, 4]);
        let all: Vec<u32> = t.lookup(42).collect();
        assert_eq!(all.len(), 4);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [1, 2, 3, 4]);
        assert_eq!(Maglev::new(&[]).lookup(1).count(), 0);
    }
}
