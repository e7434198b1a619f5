//! The simulation's one source of randomness: everything (faults, delays, the cores' own
//! generators) derives from the seed, so a seed replays exactly.

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

pub struct Rng(Xoshiro256PlusPlus);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.0.next_u64() % n }
    }

    /// True with probability `per_mille` / 1000.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// One of `items`, if any.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            return None;
        }
        Some(items[self.below(items.len() as u64) as usize])
    }

    /// A generator of its own for a core, seeded from this one.
    pub fn fork(&mut self) -> Box<dyn RngCore + Send> {
        Box::new(Xoshiro256PlusPlus::seed_from_u64(self.0.next_u64()))
    }
}
