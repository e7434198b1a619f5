//! A member's datapath as the simulation models it: the flow table that the eBPF program
//! keeps in a proxy (`rserpool_ksplice`), what packets, the member core's actions and the
//! expiry pass do to it, and where a packet with no entry is forwarded by port.
//!
//! It exists apart from the world so that one member's table is one piece of state with its
//! own operations, the way the real datapath is: the world decides which member a packet
//! meets; this says what that member's table does with it. Like the kernel's, the table
//! holds one entry per direction, and its expiry pass asks the tier core's rule
//! ([`Expiry`]) for each entry with its reverse, as `rserpool_ksplice`'s pass does: an entry
//! can go while its reverse stays.

use crate::net::Ms;
use rserpool_tier::member::{Forward, TableEntry};
use rserpool_tier::{Expiry, Seen, Splice};
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// The datapath's timeouts: an idle entry, and an ended connection's last packets.
pub const IDLE_MS: Ms = 20_000;
pub const CLOSING_MS: Ms = 1_000;
const EXPIRY: Expiry = Expiry {
    idle: Duration::from_millis(IDLE_MS),
    closing: Duration::from_millis(CLOSING_MS),
};

/// A connection's key: (client, front), its first direction's.
pub(super) type Key = (SocketAddrV4, SocketAddrV4);
/// A direction: (from, to) as its packets arrive, packed into one number that sorts as the
/// pair does (the table is looked up for every connection at every check).
type Flow = u128;

fn flow((from, to): (SocketAddrV4, SocketAddrV4)) -> Flow {
    let one = |a: SocketAddrV4| u128::from(a.ip().to_bits()) << 16 | u128::from(a.port());
    one(from) << 48 | one(to)
}

/// Both directions of `s`: client → front, server → back.
fn flows(s: &Splice) -> [Flow; 2] {
    s.directions().map(flow)
}

/// What a packet carries, as far as the table cares.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Data,
    Fin,
    Rst,
}

/// One entry: one direction of a spliced connection.
#[derive(Debug, Clone)]
struct Entry {
    splice: Splice,
    /// Which of the splice's directions (0: client → front, 1: server → back).
    dir: usize,
    /// When it was installed here.
    installed: Ms,
    fin: bool,
    last: Ms,
    packets: u64,
}

impl Entry {
    fn reverse(&self) -> Flow {
        flows(&self.splice)[1 - self.dir]
    }
}

/// One member's datapath.
pub(super) struct Datapath {
    table: BTreeMap<Flow, Entry>,
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

    /// Whether there is an entry for packets in direction `dir` of `s`.
    pub(super) fn carries(&self, s: &Splice, dir: usize) -> bool {
        self.table.contains_key(&flows(s)[dir])
    }

    /// Whether both entries of `s` are here: it is carried both ways.
    pub(super) fn whole(&self, s: &Splice) -> bool {
        self.carries(s, 0) && self.carries(s, 1)
    }

    /// Whether any entry of `s` is here.
    pub(super) fn holds(&self, s: &Splice) -> bool {
        self.carries(s, 0) || self.carries(s, 1)
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// When the oldest entry of `s` here was installed, if any is.
    pub(super) fn installed(&self, s: &Splice) -> Option<Ms> {
        flows(s)
            .iter()
            .filter_map(|f| self.table.get(f).map(|e| e.installed))
            .min()
    }

    /// The connections held whole, once each (what a proxy's table gives as splices).
    fn pairs(&self) -> impl Iterator<Item = (&Entry, &Entry)> {
        self.table.values().filter(|e| e.dir == 0).filter_map(|e| {
            let r = self.table.get(&e.reverse())?;
            Some((e, r))
        })
    }

    /// Every splice held whole: what a link that comes up carries.
    pub(super) fn splices(&self) -> Vec<Splice> {
        self.pairs().map(|(e, _)| e.splice).collect()
    }

    /// Every direction held (for the sabotage that touches them all).
    pub(super) fn directions(&self) -> Vec<(SocketAddrV4, SocketAddrV4)> {
        self.table
            .values()
            .map(|e| e.splice.directions()[e.dir])
            .collect()
    }

    /// Both entries of `s`, fresh.
    fn insert(&mut self, s: Splice, now: Ms) {
        for (dir, flow) in flows(&s).into_iter().enumerate() {
            let e = Entry {
                splice: s,
                dir,
                installed: now,
                fin: false,
                last: now,
                packets: 0,
            };
            self.table.insert(flow, e);
        }
    }

    /// A splice made here.
    pub(super) fn splice(&mut self, s: Splice, now: Ms) {
        self.insert(s, now);
    }

    /// A splice another member made, unless both its entries are here already (a half
    /// left by expiry is replaced); whether it was installed.
    pub(super) fn install(&mut self, s: Splice, now: Ms) -> bool {
        if self.whole(&s) {
            return false;
        }
        self.insert(s, now);
        true
    }

    /// Removes the entries of `s`; whether there was one.
    pub(super) fn remove(&mut self, s: &Splice) -> bool {
        let [a, b] = flows(s);
        let a = self.table.remove(&a).is_some();
        let b = self.table.remove(&b).is_some();
        a || b
    }

    /// A FIN passed elsewhere in this direction.
    pub(super) fn mark_fin(&mut self, from: SocketAddrV4, to: SocketAddrV4) {
        if let Some(e) = self.table.get_mut(&flow((from, to))) {
            e.fin = true;
        }
    }

    /// Packets passed elsewhere in these directions.
    pub(super) fn touch(&mut self, touched: Vec<(SocketAddrV4, SocketAddrV4)>, now: Ms) {
        for f in touched {
            if let Some(e) = self.table.get_mut(&flow(f)) {
                e.last = e.last.max(now);
            }
        }
    }

    /// The table as the once-a-second pass reads it: connections held whole.
    pub(super) fn read(&self) -> Vec<TableEntry> {
        self.pairs()
            .map(|(e, r)| TableEntry {
                splice: e.splice,
                fin: [e.fin, r.fin],
                packets: [e.packets, r.packets],
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

    /// A packet of `s` in direction `dir` carried here (an RST removes both entries); false
    /// when there is no entry to carry it.
    pub(super) fn carry(&mut self, s: &Splice, dir: usize, kind: Kind, now: Ms) -> bool {
        let Some(e) = self.table.get_mut(&flows(s)[dir]) else {
            return false;
        };
        e.packets += 1;
        e.last = now;
        match kind {
            Kind::Data => {}
            Kind::Fin => e.fin = true,
            Kind::Rst => {
                self.remove(s);
            }
        }
        true
    }

    /// The expiry pass, when it is due: the connections whose entries it removed, one per
    /// entry. Each entry is judged with its reverse as the pass found them.
    pub(super) fn expire(&mut self, now: Ms) -> Vec<Key> {
        if self.next_expire > now {
            return Vec::new();
        }
        self.next_expire = now + EXPIRY.period().as_millis() as Ms;
        let seen = |e: &Entry| Seen {
            fin: e.fin,
            quiet: Duration::from_millis(now.saturating_sub(e.last)),
        };
        let gone: Vec<(Flow, Key)> = self
            .table
            .iter()
            .filter(|(_, e)| {
                let reverse = self.table.get(&e.reverse()).map(seen);
                EXPIRY.expires(seen(e), reverse, false).is_some()
            })
            .map(|(flow, e)| (*flow, e.splice.key()))
            .collect();
        for (flow, _) in &gone {
            self.table.remove(flow);
        }
        gone.into_iter().map(|(_, key)| key).collect()
    }
}
