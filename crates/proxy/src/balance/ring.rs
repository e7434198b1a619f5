//! Ring hash (Karger et al., "Consistent Hashing and Random Trees", STOC 1997; as Ketama and
//! Envoy's `RING_HASH`): every PE places points on a ring of 64-bit hashes, a key goes to the
//! PE of the first point at or after its own hash. When a PE leaves, only the keys of its
//! points move, each to the next point's PE; unlike Maglev, nothing else is rebuilt, at the
//! cost of a less even share (with 256 points per PE, within about ±15 %).

use crate::balance::keys::mix;

/// Points per PE, the same for every pool size: a count that changed with the number of PEs
/// would move every key when one came or went.
const POINTS_PER_PE: u64 = 256;

/// A ring over a set of PE identifiers.
#[derive(Debug, Clone, Default)]
pub(crate) struct RingHash {
    /// (point, PE identifier), by point.
    ring: Vec<(u64, u32)>,
    pes: usize,
}

impl RingHash {
    /// The ring of these PEs; the same whatever their order.
    pub(crate) fn new(ids: &[u32]) -> Self {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let mut ring: Vec<(u64, u32)> = ids
            .iter()
            .flat_map(|&id| {
                (0..POINTS_PER_PE).map(move |i| (mix(u64::from(id) << 32 ^ i ^ 0x7269_6e67), id))
            })
            .collect();
        ring.sort_unstable();
        Self {
            ring,
            pes: ids.len(),
        }
    }

    /// The PEs for `key`: the owner of the first point at or after it, then the owners of the
    /// points that follow (each once).
    pub(crate) fn lookup(&self, key: u64) -> impl Iterator<Item = u32> + '_ {
        let start = self.ring.partition_point(|&(p, _)| p < key);
        let n = self.ring.len();
        let mut named: Vec<u32> = Vec::new();
        (0..n)
            .map(move |i| self.ring[(start + i) % n].1)
            .filter(move |id| {
                if named.contains(id) {
                    return false;
                }
                named.push(*id);
                true
            })
            .take(self.pes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(t: &RingHash, keys: u64) -> Vec<u32> {
        (0..keys)
            .map(|k| t.lookup(mix(k)).next().unwrap())
            .collect()
    }

    #[test]
    fn shares_are_near_even_and_independent_of_order() {
        let ids: Vec<u32> = (1..=8).map(|i| i * 101).collect();
        let t = RingHash::new(&ids);
        let o = owners(&t, 80_000);
        for id in &ids {
            let share = o.iter().filter(|x| *x == id).count() as f64 / 80_000.0;
            assert!(
                (0.125 * 0.75..=0.125 * 1.25).contains(&share),
                "{id}: {share}"
            );
        }
        let mut rev = ids.clone();
        rev.reverse();
        assert_eq!(owners(&RingHash::new(&rev), 1000), owners(&t, 1000));
    }

    #[test]
    fn when_a_pe_leaves_only_its_keys_move() {
        let ids: Vec<u32> = (1..=5).collect();
        let before = owners(&RingHash::new(&ids), 50_000);
        let after = owners(&RingHash::new(&[1, 2, 4, 5]), 50_000);
        for (b, a) in before.iter().zip(&after) {
            if *b != 3 {
                assert_eq!(a, b);
            }
        }
        let moved = before.iter().filter(|&&b| b == 3).count() as f64 / 50_000.0;
        assert!(moved <= 0.2 + 0.05, "{moved}");
    }

    #[test]
    fn a_lookup_names_every_pe_once() {
        let t = RingHash::new(&[4, 3, 2, 1]);
        let mut all: Vec<u32> = t.lookup(7).collect();
        assert_eq!(all.len(), 4);
        all.sort_unstable();
        assert_eq!(all, [1, 2, 3, 4]);
        assert_eq!(RingHash::new(&[]).lookup(1).count(), 0);
    }
}
