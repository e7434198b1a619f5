//! Handle resolution: selecting PEs of a pool by its policy (RFC 5356; paper §3.2).
//!
//! Why it exists: this is the handlespace's hottest read, and each selection structure answers
//! it differently: the ring walks and advances its head, the ordered policies take the
//! smallest heap keys and then advance them (degradation, WRR pass), Random samples the member
//! array, the weighted random policies sample the Fenwick tree without replacement. All of it
//! reuses the handlespace's scratch buffers, so a resolution allocates nothing.

use crate::pool::{SelLink, Selection};
use crate::select::{Fenwick, Heap, Key};
use crate::{Handlespace, PeEntry, PeRef};
use rand_core::RngCore;
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_wire::policy::Policy;

/// WRR passes are renormalised before they could overflow.
const WRR_RENORMALISE: u64 = 1 << 62;

impl Handlespace {
    /// Selects up to `max_items` distinct PEs of pool `handle` by its policy and appends them
    /// to `out` in policy order. Returns `false` for an unknown pool handle.
    pub fn resolve(&mut self, handle: &[u8], max_items: usize, out: &mut Vec<PeRef>) -> bool {
        let Some(&pool_idx) = self.pool_index.get(handle) else {
            return false;
        };
        let inc = match self.config.max_increment {
            0 => 1,
            m => m as usize,
        };
        let Self {
            pes,
            links,
            pools,
            rng,
            seq,
            scratch,
            scratch2,
            weights,
            ..
        } = self;
        let Some(pool) = pools[pool_idx as usize].as_mut() else {
            return false;
        };
        let k = max_items.min(pool.members.len());
        match &mut pool.sel {
            Selection::Ring { head } => ring(head, links, k, inc, out),
            Selection::Heap(heap) => {
                let start = out.len();
                smallest(heap, k, scratch, scratch2, out);
                let advanced = inc.min(out.len() - start);
                advance(heap, pes, links, seq, &out[start..start + advanced]);
            }
            Selection::Uniform => uniform(&pool.members, rng, k, scratch, out),
            Selection::Weighted(f) => weighted(f, &pool.members, rng, k, scratch, weights, out),
        }
        true
    }
}

/// Round Robin: the `k` PEs from the head on; the head moves on by `inc`.
fn ring(head: &mut u32, links: &[SelLink], k: usize, inc: usize, out: &mut Vec<PeRef>) {
    let mut cur = *head;
    for _ in 0..k {
        out.push(PeRef(cur));
        cur = links[cur as usize].next;
    }
    for _ in 0..inc.min(k) {
        *head = links[*head as usize].next;
    }
}

/// Ordered policies: the `k` smallest keys in order, stopping at a PE that cannot serve.
fn smallest(
    heap: &Heap,
    k: usize,
    scratch: &mut Vec<usize>,
    frontier: &mut Vec<usize>,
    out: &mut Vec<PeRef>,
) {
    scratch.clear();
    heap.smallest(k, scratch, frontier);
    for &p in scratch.iter() {
        let item = heap.items()[p];
        if item.key.0 == u64::MAX {
            break; // WRR weight 0: cannot serve
        }
        out.push(PeRef(item.pe));
    }
}

/// Ordered policies: the `chosen` PEs move behind their equals (a new sequence number); LUD
/// adds its degradation, WRR its stride.
fn advance(
    heap: &mut Heap,
    pes: &[PeEntry],
    links: &mut [SelLink],
    seq: &mut u64,
    chosen: &[PeRef],
) {
    for r in chosen {
        let pe = r.0 as usize;
        let e = &pes[pe];
        let at = links[pe].sel as usize;
        let value = heap.items()[at].key.0;
        let value = match e.element.policy {
            Policy::LeastUsedDegradation { degradation, .. } => {
                value.saturating_add(u64::from(degradation))
            }
            Policy::WeightedRoundRobin { .. } => {
                value.saturating_add(wrr_stride(&e.element.policy))
            }
            _ => value,
        };
        *seq += 1;
        let key: Key = (value, *seq);
        heap.set_key(at, key, &mut |pe, p| links[pe as usize].sel = p);
    }
    if heap
        .items()
        .first()
        .is_some_and(|t| t.key.0 >= WRR_RENORMALISE && t.key.0 != u64::MAX)
    {
        renormalise_wrr(heap);
    }
}

/// Random: `k` distinct members, uniformly.
fn uniform(
    members: &[u32],
    rng: &mut Xoshiro256PlusPlus,
    k: usize,
    scratch: &mut Vec<usize>,
    out: &mut Vec<PeRef>,
) {
    let n = members.len();
    let start = out.len();
    if k * 2 >= n {
        // Dense request: partial Fisher-Yates over a copy.
        scratch.clear();
        scratch.extend(members.iter().map(|&m| m as usize));
        for j in 0..k {
            let r = j + below(rng, (n - j) as u64) as usize;
            scratch.swap(j, r);
            out.push(PeRef(scratch[j] as u32));
        }
    } else {
        while out.len() - start < k {
            let m = members[below(rng, n as u64) as usize];
            if !out[start..].contains(&PeRef(m)) {
                out.push(PeRef(m));
            }
        }
    }
}

/// Weighted random policies: `k` distinct members by weight, without replacement: each chosen
/// weight is zeroed and restored afterwards.
fn weighted(
    f: &mut Fenwick,
    members: &[u32],
    rng: &mut Xoshiro256PlusPlus,
    k: usize,
    scratch: &mut Vec<usize>,
    weights: &mut Vec<u64>,
    out: &mut Vec<PeRef>,
) {
    scratch.clear();
    weights.clear();
    for _ in 0..k {
        let total = f.total();
        if total == 0 {
            break;
        }
        let p = f.find(below(rng, total));
        scratch.push(p);
        weights.push(f.weight(p));
        f.set(p, 0);
        out.push(PeRef(members[p]));
    }
    for (&p, &w) in scratch.iter().zip(weights.iter()) {
        f.set(p, w);
    }
}

/// WRR: a selection advances the pass by 2^32 / weight, so shares follow the weights and
/// selections interleave as evenly as the weights allow (stride scheduling).
fn wrr_stride(policy: &Policy) -> u64 {
    match *policy {
        Policy::WeightedRoundRobin { weight } if weight > 0 => (1u64 << 32) / u64::from(weight),
        _ => 0,
    }
}

/// Subtracts the smallest WRR pass from all, keeping order; runs once per ~2^30 selections.
fn renormalise_wrr(heap: &mut Heap) {
    let base = heap.items().first().map_or(0, |t| t.key.0);
    heap.rebase(base);
}

/// A uniformly distributed integer in 0..n (Lemire's multiply-shift; bias < n / 2^64).
fn below(rng: &mut Xoshiro256PlusPlus, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}
