//! The simulated network and clock: TCP-like connections, UDP-like datagrams, reachability,
//! and the queue of everything scheduled.
//!
//! A connection is reliable and in order, like TCP: each segment arrives after a random delay,
//! and a "lost" one arrives late (its retransmission), never out of order. While two hosts
//! cannot reach each other their segments wait; data that waits longer than [`TCP_TIMEOUT`]
//! resets the connection at the sender, and the receiver learns of it once the cut heals. An
//! idle connection survives a cut, as TCP does. A connection attempt across a cut is retried
//! until [`SYN_TIMEOUT`]. Datagrams (SERVER_ANNOUNCE) are lost outright.

use crate::rng::Rng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::net::SocketAddr;

/// Simulated time, in milliseconds.
pub type Ms = u64;

/// Unacknowledged data older than this resets its connection (at the sender).
pub const TCP_TIMEOUT: Ms = 3_000;
/// A connection attempt that gets no answer fails after this long.
pub const SYN_TIMEOUT: Ms = 3_000;

/// A host of the simulation; each runs one process (a core) at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    Reg(usize),
    Pe(usize),
    Pu(usize),
}

/// A core's own name for a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Local {
    Reg(rserpool_registrar::ConnId),
    Asap(rserpool_asap::ConnId),
}

/// What a connection's initiator asked to reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Service {
    /// A registrar's ASAP port.
    Asap(usize),
    /// A registrar's ENRP port.
    Enrp(usize),
    /// A pool element's takeover listener.
    Takeover(usize),
}

impl Service {
    pub fn node(self) -> Node {
        match self {
            Service::Asap(i) | Service::Enrp(i) => Node::Reg(i),
            Service::Takeover(k) => Node::Pe(k),
        }
    }
}

#[derive(Debug)]
pub enum Seg {
    Data(Vec<u8>),
    /// The sender closed (or its process died: then it is a reset).
    Fin,
}

/// One end of a connection: the process (node and incarnation) and its name for it.
#[derive(Debug, Clone, Copy)]
pub struct End {
    pub node: Node,
    pub life: u32,
    /// `None` until the acceptor accepted.
    pub local: Option<Local>,
    pub open: bool,
}

/// A segment in flight: when it is due, when it was sent, what it is.
type InFlight = (Ms, Ms, Seg);

pub struct Conn {
    /// Initiator, acceptor.
    pub ends: [End; 2],
    pub service: Service,
    /// The initiator's address, as the acceptor sees it.
    pub from_addr: SocketAddr,
    /// The acceptor answered (segments flow).
    pub up: bool,
    pub opened: Ms,
    /// `pipes[d]` carries segments from `ends[d]` to the other end.
    pub pipes: [VecDeque<InFlight>; 2],
}

/// What the queue holds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ev {
    /// Run the node's timers, if it asked for this time.
    Wake(Node),
    /// A connection attempt reaches its target.
    Syn(u64),
    /// The answer to a connection attempt reaches the initiator.
    SynAck(u64, bool),
    /// Segments of a direction of a connection may be due.
    Deliver(u64, usize),
    /// A SERVER_ANNOUNCE from registrar `from` for a process.
    Datagram {
        from: usize,
        to: Node,
        life: u32,
        bytes: Vec<u8>,
    },
}

pub struct Net {
    pub now: Ms,
    pub conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    queue: BinaryHeap<Reverse<(Ms, u64, Ev)>>,
    seq: u64,
    /// Pairs of hosts that cannot reach each other (smaller first).
    cut: BTreeSet<(Node, Node)>,
    /// Hosts that reach no one.
    isolated: BTreeSet<Node>,
    /// Largest delay of a segment or datagram.
    pub max_delay: Ms,
    /// Segments retransmitted late and datagrams lost, per mille.
    pub loss: u64,
}

impl Default for Net {
    fn default() -> Self {
        Self::new()
    }
}

impl Net {
    pub fn new() -> Self {
        Self {
            now: 0,
            conns: BTreeMap::new(),
            next_conn: 0,
            queue: BinaryHeap::new(),
            seq: 0,
            cut: BTreeSet::new(),
            isolated: BTreeSet::new(),
            max_delay: 20,
            loss: 0,
        }
    }

    pub fn schedule(&mut self, at: Ms, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((at.max(self.now), self.seq, ev)));
    }

    /// The next event due at or before `until`.
    pub fn pop(&mut self, until: Ms) -> Option<Ev> {
        let Reverse((at, _, _)) = self.queue.peek()?;
        if *at > until {
            return None;
        }
        let Reverse((at, _, ev)) = self.queue.pop()?;
        self.now = at;
        Some(ev)
    }

    pub fn reachable(&self, a: Node, b: Node) -> bool {
        !self.isolated.contains(&a)
            && !self.isolated.contains(&b)
            && !self.cut.contains(&(a.min(b), a.max(b)))
    }

    pub fn cut(&mut self, a: Node, b: Node) {
        self.cut.insert((a.min(b), a.max(b)));
    }

    pub fn isolate(&mut self, a: Node) {
        self.isolated.insert(a);
    }

    pub fn is_cut(&self) -> bool {
        !self.cut.is_empty() || !self.isolated.is_empty()
    }

    /// Every host reaches every other again; waiting segments go on their way.
    pub fn heal(&mut self) {
        self.cut.clear();
        self.isolated.clear();
        let now = self.now;
        let waiting: Vec<(u64, usize)> = self
            .conns
            .iter()
            .flat_map(|(&id, c)| {
                (0..2)
                    .filter(|&d| !c.pipes[d].is_empty())
                    .map(move |d| (id, d))
            })
            .collect();
        for (id, d) in waiting {
            self.schedule(now, Ev::Deliver(id, d));
        }
    }

    /// The delay of one segment or datagram; `lost` adds a retransmission's.
    pub fn delay(&self, rng: &mut Rng) -> (Ms, bool) {
        let d = 1 + rng.below(self.max_delay);
        if rng.chance(self.loss) {
            (d + 200 + rng.below(800), true)
        } else {
            (d, false)
        }
    }

    /// A new connection from `from` (an open end) to `service`; the attempt is scheduled.
    pub fn open(
        &mut self,
        from: End,
        service: Service,
        from_addr: SocketAddr,
        rng: &mut Rng,
    ) -> u64 {
        let id = self.next_conn;
        self.next_conn += 1;
        let to = End {
            node: service.node(),
            life: 0,
            local: None,
            open: false,
        };
        self.conns.insert(
            id,
            Conn {
                ends: [from, to],
                service,
                from_addr,
                up: false,
                opened: self.now,
                pipes: [VecDeque::new(), VecDeque::new()],
            },
        );
        let (d, _) = self.delay(rng);
        self.schedule(self.now + d, Ev::Syn(id));
        id
    }

    /// Queues a segment from end `dir` of connection `id`.
    pub fn push(&mut self, id: u64, dir: usize, seg: Seg, rng: &mut Rng) {
        let (d, _) = self.delay(rng);
        let now = self.now;
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let due = c.pipes[dir].back().map_or(0, |b| b.0).max(now + d);
        c.pipes[dir].push_back((due, now, seg));
        self.schedule(due, Ev::Deliver(id, dir));
    }
}
