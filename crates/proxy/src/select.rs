//! Selecting a PE of one pool by the pool's policy, locally.
//!
//! Selecting at the registrar would cost a round trip per connection or request, so each pool
//! keeps its PEs in a small handlespace of its own, with the policy information (load) the
//! registrar reported last, and resolves there. Selection skips the PEs a request has tried
//! and those passive health ejected ([`crate::backend`]).
//!
//! A pool with policy `credits` is chosen from by the credits left at each PE by the proxy's
//! own count ([`Backend::credits_left`]): the most first, and none without credit left.

use crate::backend::Backend;
use rserpool_handlespace::{Handlespace, PeRef};
use rserpool_wire::policy::policy_type;
use rserpool_wire::{Policy, PoolElement, PoolHandle};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// One pool's PEs as a selection structure.
pub(crate) struct Selector {
    hs: Handlespace,
    backends: HashMap<u32, Arc<Backend>>,
    /// Reused by every resolution, so selecting does not allocate.
    scratch: Vec<PeRef>,
}

impl Selector {
    pub(crate) fn new() -> Self {
        Self {
            hs: new_handlespace(),
            backends: HashMap::new(),
            scratch: Vec::new(),
        }
    }

    /// The next PE by the pool's policy, skipping the PEs in `tried` and ejected ones. When
    /// every untried PE is ejected, the least recently ejected is tried anyway: an answer
    /// from a doubtful PE beats a certain 503.
    pub(crate) fn pick(&mut self, handle: &PoolHandle, tried: &[u32]) -> Option<Arc<Backend>> {
        let Self {
            hs,
            backends,
            scratch,
        } = self;
        let n = backends.len();
        if n == 0 {
            return None;
        }
        let now = Instant::now();
        if hs.pool_policy_type(handle.as_bytes()) == Some(policy_type::CREDITS) {
            return backends
                .values()
                .filter(|b| !tried.contains(&b.id) && !b.is_ejected(now))
                .filter_map(|b| Some((b.credits_left()?, b)))
                .filter(|(c, _)| *c > 0)
                .max_by_key(|(c, b)| (*c, std::cmp::Reverse(b.requests())))
                .map(|(_, b)| {
                    b.reserve_credit();
                    b.clone()
                });
        }
        let mut k = (1 + tried.len()).min(n);
        loop {
            scratch.clear();
            hs.resolve(handle.as_bytes(), k, scratch);
            for &r in scratch.iter() {
                let id = hs.pe(r).element.id;
                if tried.contains(&id) {
                    continue;
                }
                if let Some(b) = backends.get(&id)
                    && !b.is_ejected(now)
                {
                    return Some(b.clone());
                }
            }
            if k >= n {
                break;
            }
            k = n;
        }
        backends
            .values()
            .filter(|b| !tried.contains(&b.id))
            .min_by_key(|b| b.ejected_until())
            .cloned()
    }

    /// True for a `credits` pool with untried PEs that have all spent their credit: credit
    /// may come back, unlike PEs.
    pub(crate) fn out_of_credit(&self, handle: &PoolHandle, tried: &[u32]) -> bool {
        self.hs.pool_policy_type(handle.as_bytes()) == Some(policy_type::CREDITS)
            && self.backends.values().any(|b| !tried.contains(&b.id))
    }

    /// Replaces the PEs with what a registrar reported. A PE still listed at the same
    /// addresses keeps its state (health, counters, idle connections); the others retire.
    pub(crate) fn replace(&mut self, handle: &PoolHandle, pes: Vec<PoolElement>) {
        // The same PEs at the same addresses (a push of new credits or a refresh): the policy
        // information changes in place, which keeps the policy state (round-robin position)
        // and allocates nothing.
        let same = pes.len() == self.backends.len()
            && pes
                .iter()
                .all(|pe| self.backends.get(&pe.id).is_some_and(|b| b.is_at(pe)));
        if same {
            for pe in pes {
                let (Some(b), Some(r)) = (
                    self.backends.get(&pe.id),
                    self.hs.find(handle.as_bytes(), pe.id),
                ) else {
                    continue;
                };
                if self.hs.pe(r).element.policy != pe.policy {
                    note_credits(b, &pe.policy);
                    let _ = self.hs.update_policy(r, pe.policy, 0);
                }
            }
            return;
        }
        let mut backends = HashMap::with_capacity(pes.len());
        let mut hs = new_handlespace();
        for pe in pes {
            let old_policy = self
                .hs
                .find(handle.as_bytes(), pe.id)
                .map(|r| &self.hs.pe(r).element.policy);
            let b = match self.backends.remove(&pe.id) {
                // A report the PE did not repeat keeps the count since it came.
                Some(b) if b.is_at(&pe) => {
                    if old_policy != Some(&pe.policy) {
                        note_credits(&b, &pe.policy);
                    }
                    b
                }
                kept => {
                    if let Some(old) = kept {
                        old.retire();
                    }
                    let b = Arc::new(Backend::new(handle, &pe));
                    note_credits(&b, &pe.policy);
                    b
                }
            };
            // The local copy only selects: no homes, no timers.
            let mut pe = pe;
            pe.home_registrar = 0;
            if hs.register(handle, pe, 0).is_ok() {
                backends.insert(b.id, b);
            }
        }
        for (_, old) in self.backends.drain() {
            old.retire();
        }
        self.hs = hs;
        self.backends = backends;
    }

    pub(crate) fn backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.backends.values()
    }

    pub(crate) fn len(&self) -> usize {
        self.backends.len()
    }
}

fn new_handlespace() -> Handlespace {
    Handlespace::new(rserpool_handlespace::Config {
        seed: u64::from(rand_seed()),
        ..Default::default()
    })
}

fn rand_seed() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

/// A PE's new credit report, for the proxy's own count (policy `credits` only).
fn note_credits(b: &Backend, policy: &Policy) {
    if let Policy::Credits { credits, capacity } = *policy {
        b.note_credits(credits, capacity);
    }
}
