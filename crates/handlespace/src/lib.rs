//! The RSerPool handlespace (seed paper §3): pools of pool elements, their selection by pool
//! policy (RFC 5356), the timer schedule, the ownership set with per-owner checksums, and the
//! resumable traversal that ENRP synchronisation needs.
//!
//! Why it exists: every ASAP and ENRP message a registrar handles ends in one of the six
//! operations here, so their cost bounds what one registrar can serve. It is sans-IO: time is a
//! millisecond count passed in, randomness comes from a seeded RNG, and results are
//! reproducible for a given seed and input sequence.
//!
//! Structures (DESIGN.md principle 3, instead of the paper's one tree for all):
//! - a slab of PE entries addressed by [`PeRef`]; per pool a hash index PE ID → entry and a
//!   dense member array (O(1) insert and swap-remove);
//! - per policy the cheapest selection structure: an intrusive ring for Round Robin, a 4-ary
//!   indexed heap keyed by (value, sequence) for the ordered policies, nothing but the member
//!   array for Random, a Fenwick tree for the weighted random ones;
//! - a hierarchical timing wheel with exactly one timer per PE;
//! - per owner (home registrar) a dense member array and an incremental RFC 1071 checksum.

mod select;
pub mod timer;

use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_wire::checksum::{PeChecksum, handle_sum};
use rserpool_wire::param::ptype;
use rserpool_wire::policy::policy_type as pt;
use rserpool_wire::{
    CauseCode, ErrorCause, PoolElement, PoolHandle, Protocol, UserTransport, policy::Policy,
};
use select::{Fenwick, Heap, HeapItem, Key};
use std::collections::HashMap;
use timer::Wheel;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

const NIL: u32 = u32::MAX;

/// A reference to a PE entry, valid until that PE is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeRef(u32);

impl PeRef {
    pub fn index(self) -> u32 {
        self.0
    }
}

/// The one timer a PE has at any time (paper §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimerKind {
    /// Home registrar: time to send the next ENDPOINT_KEEP_ALIVE.
    KeepAliveTransmission,
    /// Home registrar: the ENDPOINT_KEEP_ALIVE_ACK is overdue at this time.
    KeepAliveTimeout,
    /// Other registrars: the registration life runs out.
    LifetimeExpiry,
}

impl TimerKind {
    fn tag(self) -> u8 {
        self as u8
    }

    fn from_tag(t: u8) -> Self {
        match t {
            0 => Self::KeepAliveTransmission,
            1 => Self::KeepAliveTimeout,
            _ => Self::LifetimeExpiry,
        }
    }
}

/// Settings of a handlespace.
#[derive(Debug, Clone)]
pub struct Config {
    /// How many of the returned PEs a handle resolution advances in an ordered policy
    /// (rsplib's MaxIncrement); 0 = the policy's default (1; random policies keep no state).
    pub max_increment: u32,
    /// Limits: registrations beyond them are refused with Lack of Resources.
    pub max_pools: usize,
    pub max_pes_per_pool: usize,
    pub max_pool_handle_len: usize,
    /// Seed of the RNG used by the random policies.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_increment: 0,
            max_pools: 100_000,
            max_pes_per_pool: 1_000_000,
            max_pool_handle_len: 1024,
            seed: 0x5eed_5eed,
        }
    }
}

/// Why a registration was refused; [`cause`](Self::cause) gives the RFC error cause.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    #[error("the pool uses policy {}, the registration another", .0.short_name())]
    InconsistentPolicy(Policy),
    #[error("pool uses another transport type")]
    InconsistentTransport(UserTransport),
    #[error("pool uses another data/control configuration")]
    InconsistentDataControl,
    #[error("policy type {:#010x} is not supported", .0.policy_type())]
    UnsupportedPolicy(Policy),
    #[error("invalid pool handle (empty or longer than the limit)")]
    InvalidPoolHandle,
    #[error("limit reached: {0}")]
    LackOfResources(&'static str),
}

impl RegistrationError {
    pub fn cause(&self) -> ErrorCause {
        match self {
            Self::InconsistentPolicy(p) => {
                ErrorCause::with_info(CauseCode::INCONSISTENT_POOLING_POLICY, p.to_tlv())
            }
            Self::InconsistentTransport(t) => {
                ErrorCause::with_info(CauseCode::INCONSISTENT_TRANSPORT_TYPE, t.to_tlv())
            }
            Self::InconsistentDataControl => ErrorCause::new(CauseCode::INCONSISTENT_DATA_CONTROL),
            Self::UnsupportedPolicy(p) => {
                ErrorCause::with_info(CauseCode::INVALID_VALUES, p.to_tlv())
            }
            Self::InvalidPoolHandle => ErrorCause::new(CauseCode::INVALID_VALUES),
            Self::LackOfResources(_) => ErrorCause::new(CauseCode::LACK_OF_RESOURCES),
        }
    }
}

/// A PE entry: the registered Pool Element plus the handlespace's bookkeeping.
#[derive(Debug, Clone)]
pub struct PeEntry {
    pub element: PoolElement,
    /// Time (ms) of the last sign of life (keep-alive ACK or re-registration).
    pub last_heard: u64,
    /// ENDPOINT_UNREACHABLE reports since registration (or the last [`Handlespace::touch`]).
    pub unreachable_reports: u32,
    pool: u32,
}

/// The positions of a PE in the handlespace's structures, kept apart from the (large, mostly
/// cold) entries so that heap sifts, ring walks and swap-removes touch one dense array.
#[derive(Debug, Clone, Copy)]
struct SelLink {
    /// Heap position, or ring predecessor.
    sel: u32,
    /// Ring successor.
    next: u32,
    /// Index in the pool's member array.
    pool_pos: u32,
    /// Index in the owner's member array.
    owner_pos: u32,
}

/// How a pool selects, chosen by its policy type.
#[derive(Debug)]
enum Selection {
    Ring { head: u32 },
    Heap(Heap),
    Uniform,
    Weighted(Fenwick),
}

#[derive(Debug)]
struct Pool {
    handle: PoolHandle,
    handle_sum: u64,
    policy_type: u32,
    transport_ptype: u16,
    transport_use: Option<u16>,
    by_id: FastMap<u32, u32>,
    members: Vec<u32>,
    sel: Selection,
}

#[derive(Debug, Default)]
struct Owner {
    members: Vec<u32>,
    checksum: PeChecksum,
}

/// A resumable traversal (ENRP HANDLE_TABLE_RESPONSE blocks); see [`Handlespace::sync_begin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncCursor {
    slot: u32,
    generation: u32,
}

#[derive(Debug, Default)]
struct CursorState {
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
/// WRR passes are renormalised before they could overflow.
const WRR_RENORMALISE: u64 = 1 << 62;

/// The handlespace of one registrar.
#[derive(Debug)]
pub struct Handlespace {
    config: Config,
    pes: Vec<PeEntry>,
    links: Vec<SelLink>,
    free: Vec<u32>,
    pools: Vec<Option<Pool>>,
    free_pools: Vec<u32>,
    pool_index: FastMap<Bytes, u32>,
    owners: FastMap<u32, Owner>,
    timers: Wheel,
    rng: Xoshiro256PlusPlus,
    seq: u64,
    cursors: Vec<CursorState>,
    cursor_clock: u64,
    scratch: Vec<usize>,
    scratch2: Vec<usize>,
    weights: Vec<u64>,
    fired: Vec<(u32, u8)>,
    len: usize,
}

/// Outcome of a successful registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub pe: PeRef,
    /// False for a re-registration (an update of an existing PE).
    pub new: bool,
}

/// Whether a policy is served, and by which structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ring,
    Heap,
    Uniform,
    Weighted,
}

fn kind_of(policy_type: u32) -> Option<Kind> {
    Some(match policy_type {
        pt::ROUND_ROBIN => Kind::Ring,
        pt::WEIGHTED_ROUND_ROBIN
        | pt::PRIORITY
        | pt::LEAST_USED
        | pt::LEAST_USED_DEGRADATION
        | pt::PRIORITY_LEAST_USED => Kind::Heap,
        pt::RANDOM => Kind::Uniform,
        pt::WEIGHTED_RANDOM | pt::RANDOMIZED_LEAST_USED => Kind::Weighted,
        _ => return None,
    })
}

/// WRR: a selection advances the pass by 2^32 / weight, so shares follow the weights and
/// selections interleave as evenly as the weights allow (stride scheduling).
fn wrr_stride(policy: &Policy) -> u64 {
    match *policy {
        Policy::WeightedRoundRobin { weight } if weight > 0 => (1u64 << 32) / u64::from(weight),
        _ => 0,
    }
}

/// The primary heap value of an ordered policy at (re-)registration; smaller is selected
/// first. The heap key holds the live value: LUD adds its degradation counter there (reset to
/// zero by a re-registration), WRR keeps its virtual pass there (`pass` is the value to keep).
fn primary(policy: &Policy, pass: u64) -> u64 {
    match *policy {
        Policy::WeightedRoundRobin { weight: 0 } => u64::MAX,
        Policy::WeightedRoundRobin { .. } => pass,
        Policy::Priority { priority } => u64::from(u32::MAX - priority),
        Policy::LeastUsed { load } | Policy::LeastUsedDegradation { load, .. } => u64::from(load),
        Policy::PriorityLeastUsed { load, degradation } => u64::from(load) + u64::from(degradation),
        _ => 0,
    }
}

/// The current WRR virtual time: the smallest pass of a PE that can serve.
fn wrr_now(heap: &Heap) -> u64 {
    heap.items()
        .first()
        .map(|top| top.key.0)
        .filter(|&v| v != u64::MAX)
        .unwrap_or(0)
}

/// Selection weight of a weighted random policy.
fn weight(policy: &Policy) -> u64 {
    match *policy {
        Policy::WeightedRandom { weight } => u64::from(weight),
        // RFC 5356: weight 0xFFFFFFFF - load; like rsplib, a fully loaded PE keeps weight 1 so
        // a pool of busy PEs still answers.
        Policy::RandomizedLeastUsed { load } => u64::from(u32::MAX - load).max(1),
        _ => 1,
    }
}

fn transport_kind(t: &UserTransport) -> (u16, Option<u16>) {
    match t {
        UserTransport::Address(a) => match a.protocol {
            Protocol::Sctp { transport_use } => (ptype::SCTP_TRANSPORT, Some(transport_use)),
            _ => (t.ptype(), None),
        },
        UserTransport::Opaque(_) => (ptype::OPAQUE_TRANSPORT, None),
    }
}

/// A uniformly distributed integer in 0..n (Lemire's multiply-shift; bias < n / 2^64).
fn below(rng: &mut Xoshiro256PlusPlus, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

impl Handlespace {
    pub fn new(config: Config) -> Self {
        Self {
            rng: Xoshiro256PlusPlus::seed_from_u64(config.seed),
            config,
            pes: Vec::new(),
            links: Vec::new(),
            free: Vec::new(),
            pools: Vec::new(),
            free_pools: Vec::new(),
            pool_index: FastMap::default(),
            owners: FastMap::default(),
            timers: Wheel::new(0),
            seq: 0,
            cursors: Vec::new(),
            cursor_clock: 0,
            scratch: Vec::new(),
            scratch2: Vec::new(),
            weights: Vec::new(),
            fired: Vec::new(),
            len: 0,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Number of PEs in all pools.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pool_count(&self) -> usize {
        self.pool_index.len()
    }

    pub fn pe(&self, r: PeRef) -> &PeEntry {
        &self.pes[r.0 as usize]
    }

    /// Records a sign of life of a PE (e.g. a keep-alive ACK): resets its unreachable reports.
    pub fn touch(&mut self, r: PeRef, now: u64) {
        let e = &mut self.pes[r.0 as usize];
        e.last_heard = now;
        e.unreachable_reports = 0;
    }

    /// Records a keep-alive ACK: the PE's registrar association is alive, but that says nothing
    /// about its reachability from pool users, so the unreachable reports stay.
    pub fn heard(&mut self, r: PeRef, now: u64) {
        self.pes[r.0 as usize].last_heard = now;
    }

    /// Counts an ENDPOINT_UNREACHABLE report; returns the count since the last sign of life.
    pub fn report_unreachable(&mut self, r: PeRef) -> u32 {
        let e = &mut self.pes[r.0 as usize];
        e.unreachable_reports = e.unreachable_reports.saturating_add(1);
        e.unreachable_reports
    }

    /// The pool handle of a PE.
    pub fn pool_handle_of(&self, r: PeRef) -> &PoolHandle {
        &self.pool_ref(self.pes[r.0 as usize].pool).handle
    }

    pub fn find(&self, handle: &[u8], pe_id: u32) -> Option<PeRef> {
        let pool = self.pool_by_handle(handle)?;
        pool.by_id.get(&pe_id).map(|&i| PeRef(i))
    }

    /// The PEs of a pool, in no particular order.
    pub fn members(&self, handle: &[u8]) -> impl Iterator<Item = PeRef> + '_ {
        self.pool_by_handle(handle)
            .into_iter()
            .flat_map(|p| p.members.iter().map(|&i| PeRef(i)))
    }

    /// All pools: handle, policy type and number of PEs, in no particular order.
    pub fn pools(&self) -> impl Iterator<Item = (&PoolHandle, u32, usize)> + '_ {
        self.pools
            .iter()
            .flatten()
            .map(|p| (&p.handle, p.policy_type, p.members.len()))
    }

    /// The policy type of a pool.
    pub fn pool_policy_type(&self, handle: &[u8]) -> Option<u32> {
        self.pool_by_handle(handle).map(|p| p.policy_type)
    }

    fn pool_by_handle(&self, handle: &[u8]) -> Option<&Pool> {
        self.pool_index.get(handle).map(|&i| self.pool_ref(i))
    }

    fn pool_ref(&self, i: u32) -> &Pool {
        match &self.pools[i as usize] {
            Some(p) => p,
            None => unreachable!("pool index points to a free pool slot"),
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    // -----------------------------------------------------------------------------------------
    // Registration, re-registration, deregistration

    /// Registers `element` in the pool `handle`, or updates it if its PE ID is already there
    /// (re-registration). The PE's owner is `element.home_registrar`.
    pub fn register(
        &mut self,
        handle: &PoolHandle,
        element: PoolElement,
        now: u64,
    ) -> Result<Registered, RegistrationError> {
        let ptype_ = element.policy.policy_type();
        let kind = kind_of(ptype_)
            .ok_or_else(|| RegistrationError::UnsupportedPolicy(element.policy.clone()))?;
        let (tp, tuse) = transport_kind(&element.user_transport);
        let pool_idx = match self.pool_index.get(handle.as_bytes()) {
            Some(&pi) => {
                self.check_consistent(pi, &element)?;
                let pool = self.pool_ref(pi);
                if let Some(&i) = pool.by_id.get(&element.id) {
                    self.update(i, element, now);
                    return Ok(Registered {
                        pe: PeRef(i),
                        new: false,
                    });
                }
                if pool.members.len() >= self.config.max_pes_per_pool {
                    return Err(RegistrationError::LackOfResources("PEs per pool"));
                }
                pi
            }
            None => {
                let h = handle.as_bytes();
                if h.is_empty() || h.len() > self.config.max_pool_handle_len {
                    return Err(RegistrationError::InvalidPoolHandle);
                }
                if self.pool_index.len() >= self.config.max_pools {
                    return Err(RegistrationError::LackOfResources("pools"));
                }
                self.create_pool(handle, ptype_, kind, tp, tuse)
            }
        };
        Ok(Registered {
            pe: PeRef(self.insert(pool_idx, element, now)),
            new: true,
        })
    }

    fn create_pool(
        &mut self,
        handle: &PoolHandle,
        policy_type: u32,
        kind: Kind,
        transport_ptype: u16,
        transport_use: Option<u16>,
    ) -> u32 {
        let pool = Pool {
            handle: handle.clone(),
            handle_sum: handle_sum(handle.as_bytes()),
            policy_type,
            transport_ptype,
            transport_use,
            by_id: FastMap::default(),
            members: Vec::new(),
            sel: match kind {
                Kind::Ring => Selection::Ring { head: NIL },
                Kind::Heap => Selection::Heap(Heap::default()),
                Kind::Uniform => Selection::Uniform,
                Kind::Weighted => Selection::Weighted(Fenwick::default()),
            },
        };
        let idx = match self.free_pools.pop() {
            Some(i) => {
                self.pools[i as usize] = Some(pool);
                i
            }
            None => {
                self.pools.push(Some(pool));
                (self.pools.len() - 1) as u32
            }
        };
        self.pool_index.insert(handle.0.clone(), idx);
        idx
    }

    fn insert(&mut self, pool_idx: u32, element: PoolElement, now: u64) -> u32 {
        let seq = self.next_seq();
        let owner = element.home_registrar;
        let entry = PeEntry {
            element,
            last_heard: now,
            unreachable_reports: 0,
            pool: pool_idx,
        };
        let link = SelLink {
            sel: NIL,
            next: NIL,
            pool_pos: 0,
            owner_pos: 0,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.pes[i as usize] = entry;
                self.links[i as usize] = link;
                i
            }
            None => {
                self.pes.push(entry);
                self.links.push(link);
                (self.pes.len() - 1) as u32
            }
        };
        self.len += 1;
        let Self {
            pes, pools, links, ..
        } = self;
        let Some(pool) = pools[pool_idx as usize].as_mut() else {
            unreachable!("insert into a free pool slot")
        };
        let id = pes[i as usize].element.id;
        pool.by_id.insert(id, i);
        links[i as usize].pool_pos = pool.members.len() as u32;
        pool.members.push(i);
        match &mut pool.sel {
            Selection::Ring { head } => {
                if *head == NIL {
                    links[i as usize].sel = i;
                    links[i as usize].next = i;
                    *head = i;
                } else {
                    // New PEs join at the end of the current round (before the head).
                    let h = *head;
                    let tail = links[h as usize].sel;
                    links[i as usize].sel = tail;
                    links[i as usize].next = h;
                    links[tail as usize].next = i;
                    links[h as usize].sel = i;
                }
            }
            Selection::Heap(heap) => {
                // A WRR newcomer joins at the current virtual time, so it gets no burst.
                let key = (primary(&pes[i as usize].element.policy, wrr_now(heap)), seq);
                heap.push(HeapItem { key, pe: i }, &mut |pe, p| {
                    links[pe as usize].sel = p
                });
            }
            Selection::Uniform => {}
            Selection::Weighted(f) => f.push(weight(&pes[i as usize].element.policy)),
        }
        self.owner_insert(i, owner);
        i
    }

    fn update(&mut self, i: u32, element: PoolElement, now: u64) {
        let old_owner = self.pes[i as usize].element.home_registrar;
        let new_owner = element.home_registrar;
        if old_owner != new_owner {
            self.owner_remove(i, old_owner);
        }
        let Self {
            pes, pools, links, ..
        } = self;
        let e = &mut pes[i as usize];
        e.element = element;
        // Reports survive re-registration (as in rsplib): a PE that updates its load often must
        // still be removable by MAX-BAD-PE-REPORT reports.
        e.last_heard = now;
        let pool_idx = e.pool;
        let Some(pool) = pools[pool_idx as usize].as_mut() else {
            unreachable!("PE in a free pool slot")
        };
        match &mut pool.sel {
            Selection::Ring { .. } | Selection::Uniform => {}
            Selection::Heap(heap) => {
                // Keeps the tie-break position and a WRR pass; resets LUD's degradation
                // (RFC 5356: on every (re-)registration).
                let at = links[i as usize].sel as usize;
                let (old, seq) = heap.items()[at].key;
                let pass = if old == u64::MAX { wrr_now(heap) } else { old };
                let key = (primary(&pes[i as usize].element.policy, pass), seq);
                heap.set_key(at, key, &mut |pe, p| links[pe as usize].sel = p);
            }
            Selection::Weighted(f) => {
                let w = weight(&pes[i as usize].element.policy);
                f.set(links[i as usize].pool_pos as usize, w);
            }
        }
        if old_owner != new_owner {
            self.owner_insert(i, new_owner);
        }
    }

    /// Re-registers a PE found with [`find`](Self::find): the same checks as
    /// [`register`](Self::register) without looking the PE up again.
    pub fn reregister(
        &mut self,
        r: PeRef,
        element: PoolElement,
        now: u64,
    ) -> Result<(), RegistrationError> {
        debug_assert_eq!(element.id, self.pes[r.0 as usize].element.id);
        self.check_consistent(self.pes[r.0 as usize].pool, &element)?;
        self.update(r.0, element, now);
        Ok(())
    }

    /// A PE may join or stay in a pool only with the pool's policy type and transport.
    fn check_consistent(&self, pi: u32, element: &PoolElement) -> Result<(), RegistrationError> {
        let pool = self.pool_ref(pi);
        let first = || {
            let m = pool.members.first().copied().unwrap_or(NIL);
            self.pes.get(m as usize).map(|e| &e.element)
        };
        if pool.policy_type != element.policy.policy_type() {
            let p = first().map_or(&element.policy, |e| &e.policy);
            return Err(RegistrationError::InconsistentPolicy(p.clone()));
        }
        let (tp, tuse) = transport_kind(&element.user_transport);
        if pool.transport_ptype != tp {
            let t = first().map_or(&element.user_transport, |e| &e.user_transport);
            return Err(RegistrationError::InconsistentTransport(t.clone()));
        }
        if pool.transport_use != tuse {
            return Err(RegistrationError::InconsistentDataControl);
        }
        Ok(())
    }

    /// Updates only the policy information of a PE (e.g. its load), the cheap re-registration.
    /// The policy type must stay the same.
    pub fn update_policy(
        &mut self,
        r: PeRef,
        policy: Policy,
        now: u64,
    ) -> Result<(), RegistrationError> {
        let e = &self.pes[r.0 as usize];
        if e.element.policy.policy_type() != policy.policy_type() {
            return Err(RegistrationError::InconsistentPolicy(
                e.element.policy.clone(),
            ));
        }
        let mut element = e.element.clone();
        element.policy = policy;
        self.update(r.0, element, now);
        Ok(())
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

    /// Deregisters a PE; returns it, or `None` if it was not registered.
    pub fn deregister(&mut self, handle: &[u8], pe_id: u32) -> Option<PoolElement> {
        let r = self.find(handle, pe_id)?;
        Some(self.remove(r))
    }

    /// Removes a PE (and its pool, if it was the last member).
    pub fn remove(&mut self, r: PeRef) -> PoolElement {
        let i = r.0;
        self.timers.cancel(i);
        let owner = self.pes[i as usize].element.home_registrar;
        self.owner_remove(i, owner);
        let Self {
            pes, pools, links, ..
        } = self;
        let (pool_idx, pool_pos, id) = {
            let e = &pes[i as usize];
            (e.pool, links[i as usize].pool_pos, e.element.id)
        };
        let Some(pool) = pools[pool_idx as usize].as_mut() else {
            unreachable!("PE in a free pool slot")
        };
        pool.by_id.remove(&id);
        match &mut pool.sel {
            Selection::Ring { head } => {
                let SelLink {
                    sel: prev, next, ..
                } = links[i as usize];
                if next == i {
                    *head = NIL;
                } else {
                    links[prev as usize].next = next;
                    links[next as usize].sel = prev;
                    if *head == i {
                        *head = next;
                    }
                }
            }
            Selection::Heap(heap) => {
                let at = links[i as usize].sel as usize;
                heap.remove(at, &mut |pe, p| links[pe as usize].sel = p);
            }
            Selection::Uniform => {}
            Selection::Weighted(f) => {
                let last = pool.members.len() - 1;
                let w_last = f.weight(last);
                f.set(pool_pos as usize, w_last);
                f.set(last, 0);
                f.pop();
            }
        }
        pool.members.swap_remove(pool_pos as usize);
        if let Some(&moved) = pool.members.get(pool_pos as usize) {
            links[moved as usize].pool_pos = pool_pos;
        }
        let empty = pool.members.is_empty();
        if empty {
            let handle = pool.handle.0.clone();
            self.pool_index.remove(&handle);
            self.pools[pool_idx as usize] = None;
            self.free_pools.push(pool_idx);
        }
        self.len -= 1;
        self.free.push(i);
        let e = &mut self.pes[i as usize];
        // Leave a cheap placeholder; the element is handed back to the caller.
        std::mem::replace(
            &mut e.element,
            PoolElement {
                id: 0,
                home_registrar: 0,
                registration_life: 0,
                user_transport: UserTransport::Opaque(Bytes::new()),
                policy: Policy::RoundRobin,
                asap_transport: None,
            },
        )
    }

    // -----------------------------------------------------------------------------------------
    // Handle resolution

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
        let n = pool.members.len();
        let k = max_items.min(n);
        let start = out.len();
        match &mut pool.sel {
            Selection::Ring { head } => {
                let mut cur = *head;
                for _ in 0..k {
                    out.push(PeRef(cur));
                    cur = links[cur as usize].next;
                }
                for _ in 0..inc.min(k) {
                    *head = links[*head as usize].next;
                }
            }
            Selection::Heap(heap) => {
                scratch.clear();
                heap.smallest(k, scratch, scratch2);
                for &p in scratch.iter() {
                    let item = heap.items()[p];
                    if item.key.0 == u64::MAX {
                        break; // WRR weight 0: cannot serve
                    }
                    out.push(PeRef(item.pe));
                }
                let chosen = out.len() - start;
                for j in 0..inc.min(chosen) {
                    let pe = out[start + j].0 as usize;
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
            Selection::Uniform => {
                if k * 2 >= n {
                    // Dense request: partial Fisher-Yates over a copy.
                    scratch.clear();
                    scratch.extend(pool.members.iter().map(|&m| m as usize));
                    for j in 0..k {
                        let r = j + below(rng, (n - j) as u64) as usize;
                        scratch.swap(j, r);
                        out.push(PeRef(scratch[j] as u32));
                    }
                } else {
                    while out.len() - start < k {
                        let m = pool.members[below(rng, n as u64) as usize];
                        if !out[start..].contains(&PeRef(m)) {
                            out.push(PeRef(m));
                        }
                    }
                }
            }
            Selection::Weighted(f) => {
                // Without replacement: zero each chosen weight, restore afterwards.
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
                    out.push(PeRef(pool.members[p]));
                }
                for (&p, &w) in scratch.iter().zip(weights.iter()) {
                    f.set(p, w);
                }
            }
        }
        true
    }

    // -----------------------------------------------------------------------------------------
    // Timers

    /// Schedules the PE's one timer (replacing any other it had).
    pub fn schedule_timer(&mut self, r: PeRef, kind: TimerKind, deadline: u64) {
        self.timers.schedule(r.0, deadline, kind.tag());
    }

    pub fn cancel_timer(&mut self, r: PeRef) -> bool {
        self.timers.cancel(r.0)
    }

    pub fn timer(&self, r: PeRef) -> Option<(TimerKind, u64)> {
        self.timers
            .get(r.0)
            .map(|(d, t)| (TimerKind::from_tag(t), d))
    }

    /// When to call [`expire_timers`](Self::expire_timers) next: exact for timers due within
    /// the current 64 ms, a lower bound otherwise (see [`timer::Wheel`]).
    pub fn next_timer(&self) -> Option<u64> {
        self.timers.next_deadline()
    }

    /// Unschedules and returns every timer due at `now`. The PEs stay; the caller acts.
    pub fn expire_timers(&mut self, now: u64, out: &mut Vec<(PeRef, TimerKind)>) {
        let mut fired = std::mem::take(&mut self.fired);
        fired.clear();
        self.timers.expire(now, &mut fired);
        out.extend(
            fired
                .iter()
                .map(|&(i, t)| (PeRef(i), TimerKind::from_tag(t))),
        );
        self.fired = fired;
    }

    // -----------------------------------------------------------------------------------------
    // Ownership set and checksums

    fn owner_insert(&mut self, i: u32, owner: u32) {
        let block = self.block_sum(i);
        let o = self.owners.entry(owner).or_default();
        self.links[i as usize].owner_pos = o.members.len() as u32;
        o.members.push(i);
        o.checksum.add(block);
    }

    fn owner_remove(&mut self, i: u32, owner: u32) {
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

    fn block_sum(&self, i: u32) -> u64 {
        let e = &self.pes[i as usize];
        let id = e.element.id;
        self.pool_ref(e.pool).handle_sum + u64::from(id >> 16) + u64::from(id & 0xffff)
    }

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

    // -----------------------------------------------------------------------------------------
    // Synchronisation: resumable traversal in blocks

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
    fn fix_cursors(
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

/// Subtracts the smallest WRR pass from all, keeping order; runs once per ~2^30 selections.
fn renormalise_wrr(heap: &mut Heap) {
    let base = heap.items().first().map_or(0, |t| t.key.0);
    heap.rebase(base);
}
