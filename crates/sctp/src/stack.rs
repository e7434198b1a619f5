//! Many associations behind one socket, sans-IO: what a driver owns per UDP socket (SCTP over
//! UDP) or raw socket. Datagrams in with their source address ([`Stack::handle_datagram`]),
//! datagrams out with their destination ([`Stack::poll_transmit`]); associations are found by
//! the peer's address and the two SCTP ports, and named by an [`AssocId`] that a driver maps
//! to its own connection handles (the registrar's `ConnId`, say).
//!
//! A stack listens on the ports it is given ([`Stack::listen`]): INITs to them get the
//! endpoint's stateless answer, and a valid COOKIE ECHO becomes an accepted association.
//! A multi-homed peer's association is found from each of its addresses.

use crate::assoc::{Association, Config, Event, SendError, State};
use crate::chunk::{Chunk, InitParam};
use crate::cookie::CookieState;
use crate::endpoint::{Endpoint, Outcome};
use crate::packet::Packet;
use crate::path::PathEvent;
use crate::recv::Message;
use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Instant;

/// An association of a stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AssocId(pub u64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StackEvent {
    /// A peer's association to one of our listening ports is up.
    Accepted {
        id: AssocId,
        /// The peer's address as datagrams come from it (with its UDP port, or 0 on raw IP).
        peer: SocketAddr,
        local_port: u16,
        /// The peer's SCTP port.
        peer_port: u16,
    },
    /// An association we opened is up.
    Connected(AssocId),
    Message(AssocId, Message),
    /// Ended, gracefully (`None`) or not (why); the id is free afterwards.
    Closed(AssocId, Option<String>),
    /// One of the peer's addresses came up or went down (for the log).
    Path(AssocId, PathEvent),
}

/// Where an association is: the peer's address (with its UDP port, or 0 on raw IP) and the
/// SCTP ports of both ends.
type Key = (SocketAddr, u16, u16);

struct Entry {
    assoc: Association,
    /// Where it is found: its primary first, then the peer's other addresses.
    keys: Vec<Key>,
    /// Made from a peer's COOKIE ECHO at a listening port (else opened here).
    accepted: bool,
    /// Its timer as filed in `Stack::timers`.
    deadline: Option<Instant>,
}

pub struct Stack {
    cfg: Config,
    rng: Xoshiro256PlusPlus,
    secret: [u8; 32],
    epoch: Instant,
    endpoints: HashMap<u16, Endpoint>,
    assocs: HashMap<AssocId, Entry>,
    by_key: HashMap<Key, AssocId>,
    next: u64,
    out: VecDeque<(SocketAddr, Bytes)>,
    events: VecDeque<StackEvent>,
    /// Associations given work outside `handle_*` (a send, a connect, a shutdown): their
    /// packets are taken at the next `poll_transmit`, without looking at the others.
    touched: Vec<AssocId>,
    /// Every association's next timer, in order: a registrar holds thousands of
    /// associations, and looking at each for the next deadline on every wake-up would cost
    /// more than the messages.
    timers: BTreeSet<(Instant, AssocId)>,
    /// Datagrams that did not decode (bad checksum, malformed), for the driver's counters.
    pub malformed: u64,
}

impl Stack {
    /// `secret` signs cookies and `seed` draws tags: both from the operating system's
    /// randomness.
    pub fn new(cfg: Config, secret: [u8; 32], seed: u64, now: Instant) -> Self {
        Self {
            cfg,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            secret,
            epoch: now,
            endpoints: HashMap::new(),
            assocs: HashMap::new(),
            by_key: HashMap::new(),
            next: 1,
            out: VecDeque::new(),
            events: VecDeque::new(),
            touched: Vec::new(),
            timers: BTreeSet::new(),
            malformed: 0,
        }
    }

    /// A stack whose cookie secret and tag seed come from the operating system's randomness
    /// (the clock's nanoseconds where it has none: tags then still differ per process).
    pub fn with_os_randomness(cfg: Config, now: Instant) -> Self {
        use rand_core::{OsRng, TryRngCore};
        let mut secret = [0u8; 32];
        let seed = match OsRng.try_fill_bytes(&mut secret) {
            Ok(()) => OsRng.try_next_u64().unwrap_or_default(),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        };
        Self::new(cfg, secret, seed ^ u64::from(std::process::id()), now)
    }

    /// Accepts associations to SCTP port `port`.
    pub fn listen(&mut self, port: u16) {
        let seed = self.rng.next_u64();
        self.endpoints.insert(
            port,
            Endpoint::new(self.cfg.clone(), port, self.secret, seed, self.epoch),
        );
    }

    /// Opens an association from `local_port` to `peer_port` at `peer`.
    pub fn connect(
        &mut self,
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
        now: Instant,
    ) -> AssocId {
        let tag = loop {
            let t = self.rng.next_u32();
            if t != 0 {
                break t;
            }
        };
        let tsn = self.rng.next_u32();
        let a = Association::connect(self.cfg.clone(), peer, local_port, peer_port, tag, tsn, now);
        let id = self.insert((peer, local_port, peer_port), a, false);
        self.touched.push(id);
        id
    }

    fn insert(&mut self, key: Key, assoc: Association, accepted: bool) -> AssocId {
        let id = AssocId(self.next);
        self.next += 1;
        self.by_key.insert(key, id);
        self.assocs.insert(
            id,
            Entry {
                assoc,
                keys: vec![key],
                accepted,
                deadline: None,
            },
        );
        id
    }

    pub fn send(
        &mut self,
        id: AssocId,
        stream: u16,
        ppid: u32,
        data: Bytes,
    ) -> Result<(), SendError> {
        self.assocs
            .get_mut(&id)
            .ok_or(SendError::Closed)?
            .assoc
            .send(stream, ppid, data, false)?;
        self.touched.push(id);
        Ok(())
    }

    pub fn shutdown(&mut self, id: AssocId, now: Instant) {
        if let Some(e) = self.assocs.get_mut(&id) {
            e.assoc.shutdown(now);
            self.touched.push(id);
        }
    }

    pub fn abort(&mut self, id: AssocId, why: &str) {
        if let Some(e) = self.assocs.get_mut(&id) {
            e.assoc.abort(why);
            self.touched.push(id);
        }
    }

    pub fn state(&self, id: AssocId) -> Option<State> {
        self.assocs.get(&id).map(|e| e.assoc.state())
    }

    /// The association with `peer` between these SCTP ports, if there is one (opened by
    /// either end): SCTP allows one per pair of endpoints.
    pub fn find(&self, peer: SocketAddr, local_port: u16, peer_port: u16) -> Option<AssocId> {
        self.by_key.get(&(peer, local_port, peer_port)).copied()
    }

    /// Payload bytes sent on the association and not yet acknowledged (0 when it is gone).
    pub fn buffered(&self, id: AssocId) -> usize {
        self.assocs.get(&id).map_or(0, |e| e.assoc.buffered())
    }

    /// Associations open or opening.
    pub fn len(&self) -> usize {
        self.assocs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.assocs.is_empty()
    }

    /// A datagram from `from` (its payload: one SCTP packet).
    pub fn handle_datagram(&mut self, from: SocketAddr, data: &[u8], now: Instant) {
        let p = match Packet::decode(data) {
            Ok(p) => p,
            Err(_) => {
                self.malformed += 1;
                return;
            }
        };
        let key = (from, p.dst_port, p.src_port);
        if let Some(id) = self.by_key.get(&key).copied() {
            let keys = Keys {
                secret: &self.secret,
                epoch: self.epoch,
                cookie_life: self.cfg.cookie_life,
            };
            if let Some(e) = self.assocs.get_mut(&id)
                && let Some(reply) = collision(&keys, &mut e.assoc, p, from, now)
            {
                self.out.push_back((from, reply.encode()));
            }
            self.collect(id, now);
            return;
        }
        let Some(endpoint) = self.endpoints.get_mut(&p.dst_port) else {
            // Nobody listens there.
            if let Some(r) = crate::endpoint::out_of_the_blue(&p) {
                self.out.push_back((from, r.encode()));
            }
            return;
        };
        let (local_port, peer_port) = (p.dst_port, p.src_port);
        match endpoint.handle(p, from, now) {
            Outcome::Reply(r) => self.out.push_back((from, r.encode())),
            Outcome::Accept(a) => {
                let id = self.insert((from, local_port, peer_port), *a, true);
                self.collect(id, now);
            }
            Outcome::Ignore | Outcome::BadCookie(_) => {}
        }
    }

    /// Moves an association's packets and events out; forgets it once closed.
    fn collect(&mut self, id: AssocId, now: Instant) {
        let Some(e) = self.assocs.get_mut(&id) else {
            return;
        };
        let (peer, local_port, peer_port) = e.keys[0];
        while let Some((to, p)) = e.assoc.poll_transmit(now) {
            self.out.push_back((to, p.encode()));
        }
        let mut closed = false;
        while let Some(ev) = e.assoc.poll_event() {
            self.events.push_back(match ev {
                Event::Connected if e.accepted => StackEvent::Accepted {
                    id,
                    peer,
                    local_port,
                    peer_port,
                },
                Event::Connected => StackEvent::Connected(id),
                Event::Message(m) => StackEvent::Message(id, m),
                Event::Closed => {
                    closed = true;
                    StackEvent::Closed(id, None)
                }
                Event::Aborted(why) => {
                    closed = true;
                    StackEvent::Closed(id, Some(why))
                }
                Event::Path(pe) => StackEvent::Path(id, pe),
            });
        }
        // The peer's other addresses, once its INIT or INIT ACK named them: datagrams from
        // each find the association (an address another association has stays with it).
        if !closed && e.assoc.path_count() != e.keys.len() {
            for addr in e.assoc.peer_addrs().skip(e.keys.len()) {
                let key = (addr, local_port, peer_port);
                self.by_key.entry(key).or_insert(id);
                e.keys.push(key);
            }
        }
        // Refile its timer.
        let next = if closed { None } else { e.assoc.poll_timeout() };
        if next != e.deadline {
            if let Some(t) = e.deadline {
                self.timers.remove(&(t, id));
            }
            if let Some(t) = next {
                self.timers.insert((t, id));
            }
            e.deadline = next;
        }
        if closed {
            // What is left to send (a SHUTDOWN COMPLETE, an ABORT) was taken above.
            if let Some(e) = self.assocs.remove(&id) {
                for k in e.keys {
                    if self.by_key.get(&k) == Some(&id) {
                        self.by_key.remove(&k);
                    }
                }
            }
        }
    }

    /// The next datagram to send, and where.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<(SocketAddr, Bytes)> {
        if self.out.is_empty() {
            let mut touched = std::mem::take(&mut self.touched);
            touched.sort_unstable();
            touched.dedup();
            for id in touched {
                self.collect(id, now);
            }
        }
        self.out.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<StackEvent> {
        self.events.pop_front()
    }

    /// The earliest timer of any association; up to date once
    /// [`poll_transmit`](Self::poll_transmit) has run since the last send, connect, shutdown
    /// or abort.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.first().map(|(t, _)| *t)
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.pop_first();
            if let Some(e) = self.assocs.get_mut(&id) {
                e.deadline = None;
                e.assoc.handle_timeout(now);
            }
            self.collect(id, now);
        }
    }
}

/// What opens and seals the stack's cookies.
struct Keys<'a> {
    secret: &'a [u8; 32],
    epoch: Instant,
    cookie_life: std::time::Duration,
}

/// Both ends opened the association at once (RFC 9260 §5.2): the peer's INIT while ours
/// is out is answered with an INIT ACK that keeps our tag, and its COOKIE ECHO then
/// establishes the association we have. Anything else goes to the association; the
/// returned packet is a direct answer to send.
fn collision(
    k: &Keys<'_>,
    a: &mut Association,
    p: Packet,
    from: SocketAddr,
    now: Instant,
) -> Option<Packet> {
    let ms = now.saturating_duration_since(k.epoch).as_millis() as u64;
    match p.chunks.first() {
        Some(Chunk::Init(i)) if p.tag == 0 => {
            let (mut ack, state) = a.collision_ack(i, ms)?;
            ack.params
                .push(InitParam::StateCookie(Bytes::from(state.seal(k.secret))));
            Some(Packet::new(
                p.dst_port,
                p.src_port,
                i.initiate_tag,
                vec![Chunk::InitAck(ack)],
            ))
        }
        Some(Chunk::CookieEcho(cookie))
            if matches!(a.state(), State::CookieWait | State::CookieEchoed) =>
        {
            let life = k.cookie_life.as_millis() as u64;
            if let Ok(c) = CookieState::open(cookie, k.secret, ms, life)
                && c.local_tag == p.tag
            {
                a.collision_cookie(&c, now);
                let rest = Packet::new(p.src_port, p.dst_port, p.tag, p.chunks[1..].to_vec());
                if !rest.chunks.is_empty() {
                    a.handle(rest, from, now);
                }
            }
            None
        }
        _ => {
            a.handle(p, from, now);
            None
        }
    }
}
