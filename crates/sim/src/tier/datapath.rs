//! A member's datapath as the simulation models it: the flow table that the eBPF program
//! keeps in a proxy (`rserpool_ksplice`), what packets, the member core's actions and the
//! expiry pass do to it, and where a packet with no entry is forwarded by port.
//!
//! It exists apart from the world so that one member's table is one piece of state with its
//! own operations, the way the real datapath is: the world decides which member a packet
//! meets; this says what that member's table does with it. Expiry asks the tier core's rule
//! ([`Expiry`]), the one the real datapath's pass asks.

use crate::net::Ms;
use rserpool_tier::member::{Expiry, Forward, TableEntry};
use rserpool_tier::{Instant, Splice};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// The datapath's timeouts: an idle entry, and an ended connection's last packets.
pub const IDLE_MS: Ms = 20_000;
pub const CLOSING_MS: Ms = 1_000;
const EXPIRY: Expiry = Expiry {
    idle: Duration::from_millis(IDLE_MS),
    closing: Duration::from_millis(CLOSING_MS),
};

/// A connection's key in the table: (client, front).
pub(super) type Key = (SocketAddrV4, SocketAddrV4);

fn t(ms: Ms) -> Instant {
    Instant::from_millis(ms)
}

/// What a packet carries, as far as the table cares.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Data,
    Fin,
    Rst,
}

/// One datapath entry pair (a connection).
#[derive(Debug, Clone)]
struct Entry {
    splice: Splice,
    /// When it was installed here.
    installed: Ms,
    fin: [bool; 2],
    last: [Ms; 2],
    packets: [u64; 2],
}

impl Entry {
    fn new(splice: Splice, now: Ms) -> Self {
        Self {
            splice,
            installed: now,
            fin: [false; 2],
            last: [now; 2],
            packets: [0; 2],
        }
    }
}

/// One member's datapath.
pub(super) struct Datapath {
    table: BTreeMap<Key, Entry>,
    forward: Vec<Forward>,
    next_expire: Ms,
}

impl Datapath {
    pub(super) fn new(now: Ms) -> Self {
        Self {
            table: BTreeMap::new(),
            forward: Vec::new(),
            next_expire: now + 500,
        }
    }

    pub(super) fn holds(&self, key: &Key) -> bool {
        self.table.contains_key(key)
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// When the entry of `key` was installed, if it is held.
    pub(super) fn installed(&self, key: &Key) -> Option<Ms> {
        self.table.get(key).map(|e| e.installed)
    }

    /// Every splice held: what a link that comes up carries.
    pub(super) fn splices(&self) -> Vec<Splice> {
        self.table.values().map(|e| e.splice).collect()
    }

    /// Every direction held (for the sabotage that touches them all).
    pub(super) fn directions(&self) -> Vec<(SocketAddrV4, SocketAddrV4)> {
        self.table
            .values()
            .flat_map(|e| e.splice.directions())
            .collect()
    }

    /// A splice made here: its entries, fresh.
    pub(super) fn splice(&mut self, s: Splice, now: Ms) {
        self.table.insert(s.key(), Entry::new(s, now));
    }

    /// A splice another member made, unless it is held already; whether it was installed.
    pub(super) fn install(&mut self, s: Splice, now: Ms) -> bool {
        if self.table.contains_key(&s.key()) {
            return false;
        }
        self.table.insert(s.key(), Entry::new(s, now));
        true
    }

    /// Whether there was an entry to remove.
    pub(super) fn remove(&mut self, key: &Key) -> bool {
        self.table.remove(key).is_some()
    }

    /// A FIN passed elsewhere in this direction.
    pub(super) fn mark_fin(&mut self, from: SocketAddrV4, to: SocketAddrV4) {
        for e in self.table.values_mut() {
            for (d, dir) in e.splice.directions().into_iter().enumerate() {
                if dir == (from, to) {
                    e.fin[d] = true;
                }
            }
        }
    }

    /// Packets passed elsewhere in these directions.
    pub(super) fn touch(&mut self, flows: Vec<(SocketAddrV4, SocketAddrV4)>, now: Ms) {
        let flows: BTreeSet<_> = flows.into_iter().collect();
        for e in self.table.values_mut() {
            for (d, dir) in e.splice.directions().into_iter().enumerate() {
                if flows.contains(&dir) {
                    e.last[d] = e.last[d].max(now);
                }
            }
        }
    }

    /// The table as the once-a-second pass reads it.
    pub(super) fn read(&self) -> Vec<TableEntry> {
        self.table
            .values()
            .map(|e| TableEntry {
                splice: e.splice,
                fin: e.fin,
                packets: e.packets,
            })
            .collect()
    }

    pub(super) fn set_tier(&mut self, forward: Vec<Forward>) {
        self.forward = forward;
    }

    /// The member a packet to `shared`:`port` with no entry here is forwarded to.
    pub(super) fn forward_to(&self, shared: Ipv4Addr, port: u16) -> Option<u32> {
        self.forward
            .iter()
            .find(|f| f.shared == shared && f.ports.contains(&port))
            .map(|f| f.id)
    }

    /// A packet of `key` in direction `dir` carried here (an RST removes the entries); false
    /// when there is no entry to carry it.
    pub(super) fn carry(&mut self, key: &Key, dir: usize, kind: Kind, now: Ms) -> bool {
        let Some(e) = self.table.get_mut(key) else {
            return false;
        };
        e.packets[dir] += 1;
        e.last[dir] = now;
        match kind {
            Kind::Data => {}
            Kind::Fin => e.fin[dir] = true,
            Kind::Rst => {
                self.table.remove(key);
            }
        }
        true
    }

    /// The expiry pass, when it is due: the keys it removed.
    pub(super) fn expire(&mut self, now: Ms) -> Vec<Key> {
        if self.next_expire > now {
            return Vec::new();
        }
        self.next_expire = now + EXPIRY.period().as_millis() as Ms;
        let gone: Vec<Key> = self
            .table
            .iter()
            .filter(|(_, e)| EXPIRY.expired(e.fin, [t(e.last[0]), t(e.last[1])], t(now)))
            .map(|(key, _)| *key)
            .collect();
        for key in &gone {
            self.table.remove(key);
        }
        gone
    }
}
