//! Registration, re-registration and deregistration of pool elements (ASAP, RFC 5351).
//!
//! Why it exists: these are the writes to the handlespace, and each must keep the PE slab, the
//! pool's indexes ([`Pool`]), the owner's member list and checksum, and the PE's timer in
//! step. A registration runs as named steps: validate the policy, find or create the pool
//! (checking the PE may join it and the limits), then update the existing entry or insert a
//! new one into the pool's indexes and its owner's list. The caller schedules the PE's timer;
//! removal cancels it.

use crate::pool::{Kind, Pool, SelLink, kind_of, transport_kind};
use crate::{Handlespace, NIL, PeEntry, PeRef};
use bytes::Bytes;
use rserpool_wire::{
    CauseCode, ErrorCause, PoolElement, PoolHandle, UserTransport, policy::Policy,
};

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

/// Outcome of a successful registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub pe: PeRef,
    /// False for a re-registration (an update of an existing PE).
    pub new: bool,
}

/// Where a registration lands, once its pool is found or created.
enum Place {
    /// The PE ID is already in the pool: a re-registration of this entry.
    Update(u32),
    /// A new PE joins this pool.
    Join(u32),
}

/// Step 1: the policy must be one the handlespace serves; returns the structure serving it.
fn validate_policy(policy: &Policy) -> Result<Kind, RegistrationError> {
    kind_of(policy.policy_type())
        .ok_or_else(|| RegistrationError::UnsupportedPolicy(policy.clone()))
}

impl Handlespace {
    /// Registers `element` in the pool `handle`, or updates it if its PE ID is already there
    /// (re-registration). The PE's owner is `element.home_registrar`.
    pub fn register(
        &mut self,
        handle: &PoolHandle,
        element: PoolElement,
        now: u64,
    ) -> Result<Registered, RegistrationError> {
        let kind = validate_policy(&element.policy)?;
        match self.place(handle, &element, kind)? {
            Place::Update(i) => {
                self.update(i, element, now);
                Ok(Registered {
                    pe: PeRef(i),
                    new: false,
                })
            }
            Place::Join(pool_idx) => Ok(Registered {
                pe: PeRef(self.insert(pool_idx, element, now)),
                new: true,
            }),
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
        self.leave_pool(i);
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

    /// Step 2: finds the pool (checking that the PE may join it and that it has room) or
    /// creates it (checking the handle and the pool limit).
    fn place(
        &mut self,
        handle: &PoolHandle,
        element: &PoolElement,
        kind: Kind,
    ) -> Result<Place, RegistrationError> {
        let Some(&pi) = self.pool_index.get(handle.as_bytes()) else {
            let h = handle.as_bytes();
            if h.is_empty() || h.len() > self.config.max_pool_handle_len {
                return Err(RegistrationError::InvalidPoolHandle);
            }
            if self.pool_index.len() >= self.config.max_pools {
                return Err(RegistrationError::LackOfResources("pools"));
            }
            return Ok(Place::Join(self.create_pool(handle, element, kind)));
        };
        self.check_consistent(pi, element)?;
        let pool = self.pool_ref(pi);
        if let Some(&i) = pool.by_id.get(&element.id) {
            return Ok(Place::Update(i));
        }
        if pool.members.len() >= self.config.max_pes_per_pool {
            return Err(RegistrationError::LackOfResources("PEs per pool"));
        }
        Ok(Place::Join(pi))
    }

    /// Policy compatibility: a PE may join or stay in a pool only with the pool's policy type
    /// and transport.
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

    /// A new pool for `element` in a free pool slot, entered in the handle index.
    fn create_pool(&mut self, handle: &PoolHandle, element: &PoolElement, kind: Kind) -> u32 {
        let pool = Pool::new(handle, element, kind);
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

    /// Step 3 for a new PE: a slab entry, the pool's indexes, the owner's list.
    fn insert(&mut self, pool_idx: u32, element: PoolElement, now: u64) -> u32 {
        let seq = self.next_seq();
        let owner = element.home_registrar;
        let i = self.alloc_entry(PeEntry {
            element,
            last_heard: now,
            unreachable_reports: 0,
            pool: pool_idx,
        });
        self.len += 1;
        let Self {
            pes, pools, links, ..
        } = self;
        let Some(pool) = pools[pool_idx as usize].as_mut() else {
            unreachable!("insert into a free pool slot")
        };
        let e = &pes[i as usize].element;
        pool.join(i, e.id, &e.policy, seq, links);
        self.changes += 1;
        pool.version = self.changes;
        self.owner_insert(i, owner);
        i
    }

    /// Step 3 for a known PE: the new element, re-keyed in the pool, moved to its new owner.
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
        let seen = e.element.policy != element.policy
            || e.element.user_transport != element.user_transport;
        e.element = element;
        // Reports survive re-registration (as in rsplib): a PE that updates its load often must
        // still be removable by MAX-BAD-PE-REPORT reports.
        e.last_heard = now;
        let Some(pool) = pools[e.pool as usize].as_mut() else {
            unreachable!("PE in a free pool slot")
        };
        pool.rekey(i, &e.element.policy, links);
        if seen {
            self.changes += 1;
            pool.version = self.changes;
        }
        if old_owner != new_owner {
            self.owner_insert(i, new_owner);
        }
    }

    /// A slab slot for `entry`, reusing a freed one first.
    fn alloc_entry(&mut self, entry: PeEntry) -> u32 {
        let link = SelLink {
            sel: NIL,
            next: NIL,
            pool_pos: 0,
            owner_pos: 0,
        };
        match self.free.pop() {
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
        }
    }

    /// Takes entry `i` out of its pool's indexes; frees the pool if `i` was its last member.
    fn leave_pool(&mut self, i: u32) {
        let e = &self.pes[i as usize];
        let (pool_idx, id) = (e.pool, e.element.id);
        let Some(pool) = self.pools[pool_idx as usize].as_mut() else {
            unreachable!("PE in a free pool slot")
        };
        pool.leave(i, id, &mut self.links);
        self.changes += 1;
        pool.version = self.changes;
        if pool.members.is_empty() {
            let handle = pool.handle.0.clone();
            self.pool_index.remove(&handle);
            self.pools[pool_idx as usize] = None;
            self.free_pools.push(pool_idx);
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}
