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
//!
//! Where each part lives: this file holds [`Handlespace`], its [`Config`] and what can be read
//! from it; `registration` (register, update, deregister), `resolution` (handle resolution),
//! `liveness` (the PE's timer and signs of life), `ownership` (per-owner lists and the
//! checksum) and `sync` (the ENRP traversal) each add one part of `impl Handlespace`. `pool`
//! keeps a pool's indexes and selection structure in step; `select` and [`timer`] are the data
//! structures themselves.
//!
//! # Use
//!
//! A registrar registers PEs as their REGISTRATIONs arrive, schedules each PE's one timer,
//! answers HANDLE_RESOLUTIONs, and acts on the timers that [`Handlespace::expire_timers`]
//! returns:
//!
//! ```
//! use rserpool_handlespace::{Config, Handlespace, TimerKind};
//! use rserpool_wire::{Policy, PoolElement, PoolHandle, Protocol, TransportAddress, UserTransport};
//! use std::net::{IpAddr, Ipv4Addr};
//!
//! let mut hs = Handlespace::new(Config::default());
//! let handle = PoolHandle::from("echo");
//! let home = 0x0a00_0001; // this registrar's ID: it owns the PEs registered here
//! for id in 1..=3 {
//!     let element = PoolElement {
//!         id,
//!         home_registrar: home,
//!         registration_life: 30_000,
//!         user_transport: UserTransport::Address(TransportAddress {
//!             protocol: Protocol::TCP,
//!             port: 7000 + id as u16,
//!             addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
//!         }),
//!         policy: Policy::RoundRobin,
//!         asap_transport: None,
//!     };
//!     let registered = hs.register(&handle, element, 0)?;
//!     hs.schedule_timer(registered.pe, TimerKind::KeepAliveTransmission, 10_000);
//! }
//!
//! // Handle resolution: Round Robin hands the PEs out in turn.
//! let mut selected = Vec::new();
//! assert!(hs.resolve(b"echo", 2, &mut selected));
//! let ids: Vec<u32> = selected.iter().map(|&r| hs.pe(r).element.id).collect();
//! assert_eq!(ids, [1, 2]);
//!
//! // Ten seconds later every PE is due a keep-alive; the caller sends them.
//! let mut due = Vec::new();
//! hs.expire_timers(10_000, &mut due);
//! assert_eq!(due.len(), 3);
//! assert!(due.iter().all(|&(_, kind)| kind == TimerKind::KeepAliveTransmission));
//!
//! // What ENRP peers compare: the owner's PEs and their checksum.
//! assert_eq!(hs.owned_count(home), 3);
//! let _announced: u16 = hs.checksum(home);
//!
//! // Deregistration; the last PE takes its pool with it.
//! for id in 1..=3 {
//!     assert!(hs.deregister(b"echo", id).is_some());
//! }
//! assert_eq!(hs.pool_count(), 0);
//! # Ok::<(), rserpool_handlespace::RegistrationError>(())
//! ```

mod liveness;
mod ownership;
mod pool;
mod registration;
mod resolution;
mod select;
mod sync;
pub mod timer;

pub use liveness::TimerKind;
pub use registration::{Registered, RegistrationError};
pub use sync::SyncCursor;

use bytes::Bytes;
use ownership::Owner;
use pool::{Pool, SelLink};
use rand_core::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_wire::{PoolElement, PoolHandle};
use std::collections::HashMap;
use sync::CursorState;
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
    /// Changes a pool user can see, counted; each pool keeps the count of its last one.
    changes: u64,
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
            changes: 0,
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

    /// Changes pool users can see, in all pools, so far: when it has not moved, no
    /// [`pool_version`](Self::pool_version) has.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// A number that changes whenever the pool changes in a way its pool users can see: a PE
    /// joins or leaves, or changes its policy information (a load, credits) or transport.
    /// A re-registration with nothing new and a selection leave it as it is. `None` when the
    /// pool does not exist; a pool created anew never repeats an earlier number.
    pub fn pool_version(&self, handle: &[u8]) -> Option<u64> {
        self.pool_by_handle(handle).map(|p| p.version)
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
}
