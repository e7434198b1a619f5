//! Selecting a PE of one pool by the pool's policy, locally.
//!
//! Selecting at the registrar would cost a round trip per connection or request, so each pool
//! keeps its PEs in a small handlespace of its own, with the policy information (load) the
//! registrar reported last, and resolves there. Selection skips the PEs a request has tried
//! and those passive health ejected ([`crate::balance::backend`]).
//!
//! A pool with policy `credits` is chosen from by the credits left at each PE by the proxy's
//! own count ([`Backend::credits_left`]): the most first, and none without credit left.
//!
//! A pool may instead be configured to be chosen from by what this proxy sees itself
//! ([`Select`]): its requests in flight at each PE (least connections, power of two choices),
//! or those and its latency estimates (Prequal-style). They need nothing from the PEs, and
//! they see only this proxy's own traffic. Every pick counts in flight at once
//! ([`Backend::reserve`]), so that picks at the same moment spread.

use crate::balance::backend::{Avoid, Backend};
use crate::balance::hashing::{Kind, Table};
use crate::config::{PoolConfig, Select};
use rserpool_handlespace::{Handlespace, PeRef};
use rserpool_wire::policy::policy_type;
use rserpool_wire::{Policy, PoolElement, PoolHandle};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// One pool's PEs as a selection structure.
pub(crate) struct Selector {
    hs: Handlespace,
    backends: HashMap<u32, Arc<Backend>>,
    /// Reused by every resolution, so selecting does not allocate.
    scratch: Vec<PeRef>,
    candidates: Vec<Arc<Backend>>,
    /// xorshift64* state for the random choices.
    rng: u64,
    /// In panic mode at the last pick (logged when it changes), and the times it began.
    panicking: bool,
    panics: u64,
    /// The Maglev table of the PEs, built when a hashing selection first needs it after they
    /// changed (`replace` drops it).
    table: Option<Table>,
}

/// What ties a request to a PE, beside the pool's selection.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Affinity {
    /// Its key for a hashing selection (`maglev`, `ring-hash`).
    pub(crate) key: Option<u64>,
    /// The PE its sticky cookie names (`sticky-cookie`).
    pub(crate) pe: Option<u32>,
}

/// PEs probed per pick by the Prequal-style selection.
const PREQUAL_PROBES: usize = 5;
/// Consistent hashing with bounded loads: a PE takes a key's request while its requests in
/// flight stay below this factor times its weighted share of all of them (in quarters: 1.25).
const HASH_BALANCE_QUARTERS: u64 = 5;
/// Of the probed, those with at most this quantile of in flight are cold.
const PREQUAL_Q_RIF: f64 = 0.75;

impl Selector {
    pub(crate) fn new() -> Self {
        Self {
            hs: new_handlespace(),
            backends: HashMap::new(),
            scratch: Vec::new(),
            candidates: Vec::new(),
            rng: u64::from(rand_seed()) | 1,
            panicking: false,
            panics: 0,
            table: None,
        }
    }

    fn random(&mut self, n: usize) -> usize {
        (xorshift(&mut self.rng) >> 32) as usize % n.max(1)
    }

    /// The next PE by the pool's policy (or the one `affinity` asks for), skipping the PEs in `tried` and ejected ones. When
    /// every untried PE is ejected, the least recently ejected is tried anyway: an answer
    /// from a doubtful PE beats a certain 503.
    pub(crate) fn pick(
        &mut self,
        handle: &PoolHandle,
        tried: &[u32],
        affinity: Affinity,
        cfg: &PoolConfig,
    ) -> Option<Arc<Backend>> {
        let picked = self.pick_by(handle, tried, affinity, cfg);
        if let Some(b) = &picked {
            b.reserve();
        }
        picked
    }

    fn pick_by(
        &mut self,
        handle: &PoolHandle,
        tried: &[u32],
        affinity: Affinity,
        cfg: &PoolConfig,
    ) -> Option<Arc<Backend>> {
        let (select, max_conn, panic_threshold) = (cfg.select, cfg.max_conn, cfg.panic_threshold);
        let slow_start = Duration::from_millis(cfg.slow_start_ms);
        let now = Instant::now();
        // Slow start: a PE in its ramp takes a pick with the probability of its share.
        let rng = std::cell::Cell::new(xorshift(&mut self.rng) | 1);
        let ramp = |b: &Backend| {
            let share = b.ramp(now, slow_start);
            share >= 1.0 || {
                let mut x = rng.get();
                let draw = (xorshift(&mut x) >> 11) as f64 / (1u64 << 53) as f64;
                rng.set(x);
                draw < share
            }
        };
        let room = |b: &Backend| max_conn.is_none_or(|m| b.in_flight() < m) && ramp(b);
        // Room without slow start's draw: for hashing, credits and the last resort.
        let room_hashed = |b: &Backend| max_conn.is_none_or(|m| b.in_flight() < m);
        // Panic mode: too few healthy PEs to carry the pool, so every PE takes its share.
        let panic = self.healthy(now) * 100 < self.backends.len() * panic_threshold as usize;
        if panic != self.panicking {
            self.panicking = panic;
            if panic {
                self.panics += 1;
                warn!(
                    "pool {handle}: panic mode: fewer than {panic_threshold} % of its PEs are \
                     healthy (neither ejected nor busy), spreading over all of them"
                );
            } else {
                info!("pool {handle}: panic mode over");
            }
        }
        let usable = |b: &Backend| panic || b.avoid(now) == Avoid::No;
        // The PE the client's sticky cookie names, while it can take the request.
        if let Some(b) = affinity.pe.and_then(|id| self.backends.get(&id))
            && !tried.contains(&b.id)
            && usable(b)
            && room_hashed(b)
        {
            return Some(b.clone());
        }
        if let (Some(kind), Some(key)) = (Kind::of(select), affinity.key) {
            return self.pick_hashed(kind, key, tried, &room_hashed, &usable, now);
        }
        if select != Select::Policy {
            // The load-aware selections see a busy PE's pending connects in its count and
            // send it less by themselves; shutting it out for `busy-ms` would move its whole
            // share onto the others at once, the start of a cascade. Only ejected PEs are out.
            let by_load = |b: &Backend| panic || b.avoid(now) != Avoid::Ejected;
            return self.pick_local(tried, select, &room, &room_hashed, &by_load, now);
        }
        let Self {
            hs,
            backends,
            scratch,
            ..
        } = self;
        let n = backends.len();
        if n == 0 {
            return None;
        }
        if hs.pool_policy_type(handle.as_bytes()) == Some(policy_type::CREDITS) {
            return backends
                .values()
                .filter(|b| !tried.contains(&b.id) && usable(b) && room_hashed(b))
                .filter_map(|b| Some((b.credits_left()?, b)))
                .filter(|(c, _)| *c > 0)
                .max_by_key(|(c, b)| (*c, std::cmp::Reverse(b.requests())))
                .map(|(_, b)| b.clone());
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
                    && usable(b)
                    && room(b)
                {
                    return Some(b.clone());
                }
            }
            if k >= n {
                break;
            }
            k = n;
        }
        least_avoided(backends, tried, &room_hashed, now)
    }

    /// Consistent hashing: the key's PE, or while it cannot take the request (or holds more
    /// than its share of the load) the next of the key's table that can.
    fn pick_hashed(
        &mut self,
        kind: Kind,
        key: u64,
        tried: &[u32],
        room: &dyn Fn(&Backend) -> bool,
        usable: &dyn Fn(&Backend) -> bool,
        now: Instant,
    ) -> Option<Arc<Backend>> {
        let backends = &self.backends;
        if self.table.as_ref().is_some_and(|t| t.kind() != kind) {
            self.table = None;
        }
        let table = self
            .table
            .get_or_insert_with(|| Table::new(kind, &backends.keys().copied().collect::<Vec<_>>()));
        let candidate = |id: u32| {
            backends
                .get(&id)
                .filter(|b| !tried.contains(&b.id) && usable(b) && room(b))
        };
        // Bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
        // Loads", SODA 2018): a PE past 1.25 times its share of the requests in flight (this
        // one counted) is passed over for the next of the key's table, so an uneven table or a
        // hot key does not queue requests at one PE while others idle. With even loads every
        // key stays with its PE.
        let (in_flight, weights) = backends
            .values()
            .filter(|b| usable(b))
            .fold((0u64, 0u64), |(f, w), b| {
                (f + b.in_flight(), w + b.weight())
            });
        let within = |b: &&Arc<Backend>| {
            let share = (in_flight + 1) * b.weight() * HASH_BALANCE_QUARTERS;
            b.in_flight() * weights.max(1) * 4 < share
        };
        table
            .lookup(key)
            .filter_map(candidate)
            .find(within)
            .or_else(|| table.lookup(key).find_map(candidate))
            .cloned()
            .or_else(|| least_avoided(backends, tried, room, now))
    }

    /// The proxy-local selections.
    fn pick_local(
        &mut self,
        tried: &[u32],
        select: Select,
        room: &dyn Fn(&Backend) -> bool,
        any_room: &dyn Fn(&Backend) -> bool,
        usable: &dyn Fn(&Backend) -> bool,
        now: Instant,
    ) -> Option<Arc<Backend>> {
        let mut c = std::mem::take(&mut self.candidates);
        c.clear();
        c.extend(
            self.backends
                .values()
                .filter(|b| !tried.contains(&b.id) && usable(b) && room(b))
                .cloned(),
        );
        let picked = match (select, c.len()) {
            (_, 0) => least_avoided(&self.backends, tried, any_room, now),
            (_, 1) => c.first().cloned(),
            // Maglev without a key (a request waiting in the queue) balances by load.
            (Select::LeastConnections | Select::Policy | Select::Maglev | Select::RingHash, _) => c
                .iter()
                .min_by_key(|b| (b.load_per_weight(), b.requests()))
                .cloned(),
            (Select::P2c, n) => {
                self.sample(&mut c, 2.min(n));
                c[..2]
                    .iter()
                    .min_by_key(|b| (b.load_per_weight(), b.requests()))
                    .cloned()
            }
            (Select::Prequal, n) => {
                let k = PREQUAL_PROBES.min(n);
                self.sample(&mut c, k);
                prequal(&c[..k])
            }
        };
        self.candidates = c;
        picked
    }

    /// Moves `k` distinct random elements to the front (a partial Fisher-Yates shuffle).
    fn sample(&mut self, c: &mut [Arc<Backend>], k: usize) {
        for i in 0..k.min(c.len()) {
            let j = i + self.random(c.len() - i);
            c.swap(i, j);
        }
    }

    /// After a pick found nothing: true when untried PEs are left and the pool has a limit
    /// (policy `credits`, or `limited` by `max-conn`) — they are at it, and room comes back,
    /// unlike PEs.
    pub(crate) fn at_limit(&self, handle: &PoolHandle, tried: &[u32], limited: bool) -> bool {
        (limited || self.hs.pool_policy_type(handle.as_bytes()) == Some(policy_type::CREDITS))
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
                    note_policy(b, &pe.policy);
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
                        note_policy(&b, &pe.policy);
                    }
                    b
                }
                kept => {
                    if let Some(old) = kept {
                        old.retire();
                    }
                    let b = Arc::new(Backend::new(handle, &pe));
                    note_policy(&b, &pe.policy);
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
        // Other PEs: the hashing table is made again when next needed.
        self.table = None;
    }

    pub(crate) fn backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.backends.values()
    }

    /// Whether the last pick was in panic mode, and how often panic mode began.
    pub(crate) fn panic(&self) -> (bool, u64) {
        (self.panicking, self.panics)
    }

    pub(crate) fn len(&self) -> usize {
        self.backends.len()
    }

    /// Requests (connections) under way at the PEs, and picks not yet under way.
    pub(crate) fn active(&self) -> u64 {
        self.backends.values().map(|b| b.in_flight()).sum()
    }

    /// PEs neither ejected nor busy.
    pub(crate) fn healthy(&self, now: Instant) -> usize {
        self.backends
            .values()
            .filter(|b| b.avoid(now) == Avoid::No)
            .count()
    }

    /// PEs ejected now.
    pub(crate) fn ejected(&self, now: Instant) -> usize {
        self.backends
            .values()
            .filter(|b| b.avoid(now) == Avoid::Ejected)
            .count()
    }
}

/// xorshift64*: the next of a sequence of random numbers.
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// When no PE is usable: a busy one before an ejected one, of those the least recently
/// ejected (an answer from a doubtful PE beats a certain 503).
fn least_avoided(
    backends: &HashMap<u32, Arc<Backend>>,
    tried: &[u32],
    room: &dyn Fn(&Backend) -> bool,
    now: Instant,
) -> Option<Arc<Backend>> {
    backends
        .values()
        .filter(|b| !tried.contains(&b.id) && room(b))
        .min_by_key(|b| (b.avoid(now), b.ejected_until()))
        .cloned()
}

/// Prequal's hot-cold lexicographic rule over the probed PEs: a PE is hot when its in flight
/// is above the `PREQUAL_Q_RIF` quantile of the probed; of the cold ones the lowest latency
/// estimate wins (fewer in flight on a tie), and when all are hot, the fewest in flight.
fn prequal(probed: &[Arc<Backend>]) -> Option<Arc<Backend>> {
    let mut all = [0u64; PREQUAL_PROBES];
    for (r, b) in all.iter_mut().zip(probed) {
        *r = b.in_flight();
    }
    let rif = &mut all[..probed.len().min(PREQUAL_PROBES)];
    rif.sort_unstable();
    // Above the quantile interpolated between neighbours is above its lower neighbour: with
    // three probed, above the median (rounding up would make nothing hot below five).
    let at = ((rif.len() as f64 - 1.0) * PREQUAL_Q_RIF).floor() as usize;
    let threshold = rif.get(at).copied().unwrap_or(0);
    probed
        .iter()
        .filter(|b| b.in_flight() <= threshold)
        .min_by_key(|b| (b.latency_estimate(), b.in_flight()))
        .or_else(|| probed.iter().min_by_key(|b| b.in_flight()))
        .cloned()
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

/// A PE's policy information as the proxy uses it: its weight, and a new credit report for
/// the proxy's own count (policy `credits`).
fn note_policy(b: &Backend, policy: &Policy) {
    let weight = match *policy {
        Policy::WeightedRoundRobin { weight } | Policy::WeightedRandom { weight } => weight,
        Policy::Credits { capacity, .. } => capacity,
        _ => 1,
    };
    b.note_weight(weight);
    if let Policy::Credits { credits, capacity } = *policy {
        b.note_credits(credits, capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::backend::loopback_pe;
    use rserpool_wire::Protocol;

    fn pe(id: u32, weight: u32) -> PoolElement {
        let policy = Policy::WeightedRoundRobin { weight };
        loopback_pe(id, Protocol::TCP, 1000 + id as u16, policy)
    }

    /// Least connections and P2C fill PEs in proportion to their weights, as HAProxy's
    /// `leastconn` does with server weights.
    #[test]
    fn least_connections_and_p2c_go_by_in_flight_per_weight() {
        for select in [Select::LeastConnections, Select::P2c] {
            let handle = PoolHandle::from("W");
            let mut s = Selector::new();
            s.replace(&handle, vec![pe(1, 1), pe(2, 3)]);
            let cfg = PoolConfig {
                select,
                ..PoolConfig::default()
            };
            // Picks stay in flight (never done): the PEs fill up.
            let mut got = [0; 2];
            for _ in 0..40 {
                let b = s.pick(&handle, &[], Affinity::default(), &cfg).unwrap();
                got[b.id as usize - 1] += 1;
            }
            assert!((9..=11).contains(&got[0]), "{select:?}: {got:?}");
            assert!((29..=31).contains(&got[1]), "{select:?}: {got:?}");
        }
    }

    /// Prequal-style with three PEs: the one with the lowest latency takes picks only while
    /// its in flight is not above the median of the probed (it is hot then), so the others get
    /// theirs; in a small pool the hot-cold rule is not idle.
    #[test]
    fn prequal_passes_a_fast_pe_over_while_it_is_hot() {
        let handle = PoolHandle::from("Q");
        let mut s = Selector::new();
        s.replace(&handle, vec![pe(1, 1), pe(2, 1), pe(3, 1)]);
        for (id, ms) in [(1, 1), (2, 10), (3, 10)] {
            for rif in 0..20 {
                s.backends[&id].note_latency(rif, Duration::from_millis(ms));
            }
        }
        let cfg = PoolConfig {
            select: Select::Prequal,
            ..PoolConfig::default()
        };
        // Picks stay in flight (never done).
        let mut got = [0; 3];
        for _ in 0..30 {
            let b = s.pick(&handle, &[], Affinity::default(), &cfg).unwrap();
            got[b.id as usize - 1] += 1;
        }
        assert!(got[0] <= 12, "{got:?}");
        assert!(got[1] >= 9 && got[2] >= 9, "{got:?}");
    }

    /// Maglev and ring hash with bounded loads: a hot key's requests stay with its PE until
    /// that PE holds 1.25 times its share of what is in flight, then spill to the next PEs of
    /// the key's table; none holds more than the bound.
    #[test]
    fn a_hot_key_spills_past_its_bounded_share() {
        for select in [Select::Maglev, Select::RingHash] {
            let handle = PoolHandle::from("H");
            let mut s = Selector::new();
            s.replace(&handle, vec![pe(1, 1), pe(2, 1), pe(3, 1)]);
            let cfg = PoolConfig {
                select,
                ..PoolConfig::default()
            };
            let hot = || Affinity {
                key: Some(42),
                pe: None,
            };
            // Picks stay in flight (never done).
            let mut got = [0usize; 3];
            let first = s.pick(&handle, &[], hot(), &cfg).unwrap().id as usize;
            got[first - 1] += 1;
            for _ in 1..60 {
                let b = s.pick(&handle, &[], hot(), &cfg).unwrap();
                got[b.id as usize - 1] += 1;
            }
            // 60 in flight: a third is 20, the bound 25.
            assert!((20..=25).contains(&got[first - 1]), "{select:?}: {got:?}");
            assert!(got.iter().all(|&n| n <= 25), "{select:?}: {got:?}");
        }
    }
}
