//! One SCTP association, sans-IO: packets in ([`Association::handle`]), packets out
//! ([`Association::poll_transmit`]), messages and state changes out
//! ([`Association::poll_event`]), time in ([`Association::handle_timeout`]).
//!
//! The initiating side starts with [`Association::connect`]; the listening side is made by an
//! `Endpoint` (module `endpoint`) from a valid COOKIE ECHO. What is here: the four-way
//! handshake's initiator half with T1 retransmissions, data transfer in both directions
//! (the halves are `crate::send` and `crate::recv`), delayed and immediate SACKs, the
//! peer's addresses as paths with heartbeats and failover (`crate::path`), INIT collisions
//! (§5.2.1, §5.2.4 D), graceful shutdown and abort, and unknown chunks handled by their type
//! bits. Packets come in with the address they came from and go out with the address they
//! go to. Not yet: peer restart (§5.2.4 A), PMTU discovery, ECN, adding and removing
//! addresses of a live association (RFC 5061).

use crate::chunk::{Chunk, Init, InitParam, Unrecognized};
use crate::cookie::CookieState;
use crate::packet::Packet;
use crate::path::{PathConfig, PathEvent, Paths};
use crate::recv::{Message, Receiver};
use crate::send::{Sender, Timing};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Config {
    /// Largest packet (SCTP common header and chunks) sent; 1200 fits any IPv6 path with UDP
    /// encapsulation.
    pub mtu: usize,
    /// Receive window, bytes.
    pub window: usize,
    pub outbound_streams: u16,
    pub max_inbound_streams: u16,
    pub timing: Timing,
    /// INIT and COOKIE ECHO retransmissions before giving up.
    pub max_init_retransmits: u32,
    /// Retransmission timeouts in a row (data, or heartbeats on the path data goes to)
    /// before the peer counts as unreachable and the association is aborted
    /// (`Association.Max.Retrans`).
    pub max_retransmits: u32,
    /// Heartbeats and failover between the peer's addresses.
    pub paths: PathConfig,
    pub sack_delay: Duration,
    pub cookie_life: Duration,
    /// Our addresses, listed in INIT and INIT ACK so that the peer can reach us on each
    /// (multi-homing); none: the peer knows only the address our packets come from.
    pub local_addresses: Vec<IpAddr>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mtu: 1200,
            window: 256 * 1024,
            outbound_streams: 16,
            max_inbound_streams: 16,
            timing: Timing::default(),
            max_init_retransmits: 8,
            max_retransmits: 10,
            paths: PathConfig::default(),
            sack_delay: Duration::from_millis(200),
            cookie_life: Duration::from_secs(60),
            local_addresses: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The handshake finished.
    Connected,
    Message(Message),
    /// Shut down gracefully, by either side.
    Closed,
    /// Ended by an ABORT (received, or sent because the peer stopped answering).
    Aborted(String),
    /// One of the peer's addresses came up or went down.
    Path(PathEvent),
}

impl Config {
    /// Our addresses as INIT parameters.
    pub(crate) fn address_params(&self) -> Vec<InitParam> {
        self.local_addresses
            .iter()
            .map(|a| match a {
                IpAddr::V4(v4) => InitParam::Ipv4(*v4),
                IpAddr::V6(v6) => InitParam::Ipv6(*v6),
            })
            .collect()
    }
}

/// The IP addresses an INIT or INIT ACK lists.
pub fn listed_addresses(params: &[InitParam]) -> Vec<IpAddr> {
    params
        .iter()
        .filter_map(|p| match p {
            InitParam::Ipv4(a) => Some(IpAddr::V4(*a)),
            InitParam::Ipv6(a) => Some(IpAddr::V6(*a)),
            _ => None,
        })
        .take(crate::cookie::MAX_PEER_ADDRESSES)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    CookieWait,
    CookieEchoed,
    Established,
    ShutdownPending,
    ShutdownSent,
    ShutdownReceived,
    ShutdownAckSent,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    #[error("stream {0} beyond the {1} outbound streams")]
    Stream(u16, u16),
    #[error("the association is closing or closed")]
    Closed,
}

/// Why an association ended when the peer sent an ABORT (`Event::Aborted`): the one end
/// that says the peer's host is there.
pub const PEER_ABORTED: &str = "the peer aborted";

/// Error cause "Unrecognized Chunk Type" (RFC 9260 §3.3.10.6).
const CAUSE_UNRECOGNIZED_CHUNK: u16 = 6;

pub struct Association {
    cfg: Config,
    state: State,
    local_port: u16,
    peer_port: u16,
    /// Tag the peer puts in our packets, and ours in its.
    local_tag: u32,
    peer_tag: u32,
    local_tsn: u32,
    outbound_streams: u16,
    sender: Option<Sender>,
    receiver: Option<Receiver>,
    /// Messages sent before the handshake finished.
    early: Vec<(u16, u32, Bytes, bool)>,
    /// Control chunks to send, in order.
    control: VecDeque<Chunk>,
    /// Chunks for one address, each in a packet of its own (HEARTBEAT to a path, HEARTBEAT
    /// ACK to where its HEARTBEAT came from).
    directed: VecDeque<(SocketAddr, Chunk)>,
    /// Whole packets to send first (answers with a reflected tag), and where.
    replies: VecDeque<(SocketAddr, Packet)>,
    events: VecDeque<Event>,
    /// T1 (INIT, COOKIE ECHO) and T2 (SHUTDOWN, SHUTDOWN ACK): when, and how often so far.
    t1: Option<(Instant, u32)>,
    t2: Option<(Instant, u32)>,
    /// What T1 sends again.
    init_chunk: Option<Chunk>,
    /// A SACK is owed: now, or by this time.
    sack_now: bool,
    sack_at: Option<Instant>,
    /// Packets with DATA since the last SACK.
    unacked_packets: u32,
    /// Where the latest DATA came from: its SACK goes back there (RFC 9260 §6.4), which
    /// may not be the path our own data takes.
    sack_to: Option<SocketAddr>,
    paths: Paths,
    /// The path DATA last went to: a retransmission timeout counts against it.
    data_path: usize,
}

impl Association {
    /// Starts an association to `peer_port` at `peer` from `local_port`: INIT goes out at
    /// the next [`poll_transmit`](Self::poll_transmit). `tag` and `tsn` must be random (and
    /// `tag` not 0).
    pub fn connect(
        cfg: Config,
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
        tag: u32,
        tsn: u32,
        now: Instant,
    ) -> Self {
        let mut params = cfg.address_params();
        params.push(InitParam::SupportedAddressTypes(vec![5, 6]));
        let init = Chunk::Init(Init {
            initiate_tag: tag,
            a_rwnd: cfg.window.min(u32::MAX as usize) as u32,
            outbound_streams: cfg.outbound_streams,
            inbound_streams: cfg.max_inbound_streams,
            initial_tsn: tsn,
            params,
        });
        let ids = (local_port, peer_port, tag, 0, tsn);
        let mut a = Self::blank(cfg, peer, ids, State::CookieWait);
        a.control.push_back(init.clone());
        a.init_chunk = Some(init);
        a.t1 = Some((now + a.cfg.timing.rto_initial, 0));
        a
    }

    /// The listening side's association, from a cookie its endpoint opened and the address
    /// its COOKIE ECHO came from: established, COOKIE ACK to go out.
    pub fn accept(cfg: Config, c: &CookieState, from: SocketAddr, now: Instant) -> Self {
        let ids = (
            c.local_port,
            c.peer_port,
            c.local_tag,
            c.peer_tag,
            c.local_tsn,
        );
        let mut a = Self::blank(cfg, from, ids, State::Established);
        a.paths.add_listed(&c.peer_addrs, now);
        a.outbound_streams = c.outbound;
        a.start(c.peer_tsn, c.peer_rwnd, c.inbound, now);
        a.control.push_back(Chunk::CookieAck);
        a.events.push_back(Event::Connected);
        a
    }

    /// `ids`: local port, peer port, local tag, peer tag, local TSN.
    fn blank(cfg: Config, peer: SocketAddr, ids: (u16, u16, u32, u32, u32), state: State) -> Self {
        let (local_port, peer_port, local_tag, peer_tag, local_tsn) = ids;
        // Heartbeat nonces from the random tag and TSN: not guessable off the path.
        let nonce = (u64::from(local_tag) << 32) | u64::from(local_tsn);
        Self {
            outbound_streams: cfg.outbound_streams,
            paths: Paths::new(peer, cfg.paths, cfg.timing, nonce),
            data_path: 0,
            cfg,
            state,
            local_port,
            peer_port,
            local_tag,
            peer_tag,
            local_tsn,
            sender: None,
            receiver: None,
            early: Vec::new(),
            control: VecDeque::new(),
            directed: VecDeque::new(),
            replies: VecDeque::new(),
            events: VecDeque::new(),
            t1: None,
            t2: None,
            init_chunk: None,
            sack_now: false,
            sack_at: None,
            unacked_packets: 0,
            sack_to: None,
        }
    }

    /// Both halves, once the peer's initial TSN and window are known.
    fn start(&mut self, peer_tsn: u32, peer_rwnd: u32, inbound: u16, now: Instant) {
        let mut s = Sender::new(self.local_tsn, peer_rwnd, self.cfg.mtu, self.cfg.timing);
        for (stream, ppid, data, unordered) in self.early.drain(..) {
            s.send(stream, ppid, data, unordered);
        }
        self.sender = Some(s);
        self.receiver = Some(Receiver::new(peer_tsn, inbound, self.cfg.window));
        self.paths.start(now);
    }

    /// The peer's addresses, primary first.
    pub fn peer_addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.paths.addrs()
    }

    pub fn path_count(&self) -> usize {
        self.paths.len()
    }

    /// Where data goes now.
    pub fn current_path(&self) -> SocketAddr {
        self.paths.addr(self.paths.data_path())
    }

    /// A line on the sending side's state, for logs and failing tests.
    pub fn debug(&self) -> String {
        self.sender.as_ref().map_or_else(String::new, Sender::debug)
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// Payload bytes given to [`send`](Self::send) and not yet acknowledged by the peer.
    pub fn buffered(&self) -> usize {
        self.sender.as_ref().map_or(0, Sender::buffered)
            + self.early.iter().map(|e| e.2.len()).sum::<usize>()
    }

    /// The INIT ACK that answers a peer's INIT while our own INIT is out (an INIT collision,
    /// RFC 9260 §5.2.1): our Initiate Tag and initial TSN as in our INIT, and a state cookie
    /// for the stack to seal. `None` in any other state.
    pub fn collision_ack(&self, init: &Init, now_ms: u64) -> Option<(Init, CookieState)> {
        if !matches!(self.state, State::CookieWait | State::CookieEchoed) {
            return None;
        }
        let state = CookieState {
            local_tag: self.local_tag,
            local_tsn: self.local_tsn,
            peer_tag: init.initiate_tag,
            peer_tsn: init.initial_tsn,
            peer_rwnd: init.a_rwnd,
            outbound: self.cfg.outbound_streams.min(init.inbound_streams),
            inbound: init.outbound_streams.min(self.cfg.max_inbound_streams),
            local_port: self.local_port,
            peer_port: self.peer_port,
            created_ms: now_ms,
            peer_addrs: listed_addresses(&init.params),
        };
        let ack = Init {
            initiate_tag: self.local_tag,
            a_rwnd: self.cfg.window.min(u32::MAX as usize) as u32,
            outbound_streams: self.cfg.outbound_streams,
            inbound_streams: self.cfg.max_inbound_streams,
            initial_tsn: self.local_tsn,
            params: self.cfg.address_params(),
        };
        Some((ack, state))
    }

    /// A COOKIE ECHO from an INIT collision, its cookie opened and ours (its local tag is
    /// ours): RFC 9260 §5.2.4 case D — established, with the peer's tag and TSN from the
    /// cookie, and a COOKIE ACK to go out.
    pub fn collision_cookie(&mut self, c: &CookieState, now: Instant) {
        if c.local_tag != self.local_tag {
            return;
        }
        self.paths.add_listed(&c.peer_addrs, now);
        match self.state {
            State::CookieWait => {
                self.peer_tag = c.peer_tag;
                self.outbound_streams = c.outbound;
                self.start(c.peer_tsn, c.peer_rwnd, c.inbound, now);
            }
            State::CookieEchoed => {}
            _ => {
                if self.state == State::Established {
                    self.control.push_back(Chunk::CookieAck);
                }
                return;
            }
        }
        // Our own INIT or COOKIE ECHO is answered by this: no more retransmissions of it.
        self.control
            .retain(|c| !matches!(c, Chunk::Init(_) | Chunk::CookieEcho(_)));
        self.t1 = None;
        self.init_chunk = None;
        self.state = State::Established;
        self.control.push_back(Chunk::CookieAck);
        self.events.push_back(Event::Connected);
    }

    pub fn local_tag(&self) -> u32 {
        self.local_tag
    }

    /// Queues a message on `stream` with payload protocol identifier `ppid`.
    pub fn send(
        &mut self,
        stream: u16,
        ppid: u32,
        data: Bytes,
        unordered: bool,
    ) -> Result<(), SendError> {
        if stream >= self.outbound_streams {
            return Err(SendError::Stream(stream, self.outbound_streams));
        }
        match (self.state, self.sender.as_mut()) {
            (State::Established, Some(s)) => s.send(stream, ppid, data, unordered),
            (State::CookieWait | State::CookieEchoed, _) => {
                self.early.push((stream, ppid, data, unordered))
            }
            _ => return Err(SendError::Closed),
        }
        Ok(())
    }

    /// Shuts down once everything sent is acknowledged.
    pub fn shutdown(&mut self, now: Instant) {
        match self.state {
            State::Established => {
                self.state = State::ShutdownPending;
                self.try_shutdown(now);
            }
            State::CookieWait | State::CookieEchoed => self.close_with(Event::Closed),
            _ => {}
        }
    }

    /// Ends at once with an ABORT.
    pub fn abort(&mut self, why: &str) {
        if self.state == State::Closed {
            return;
        }
        self.control.clear();
        self.control.push_back(Chunk::Abort {
            reflected: false,
            causes: Bytes::new(),
        });
        self.close_with(Event::Aborted(why.to_string()));
    }

    fn close_with(&mut self, e: Event) {
        self.state = State::Closed;
        self.t1 = None;
        self.t2 = None;
        self.sack_at = None;
        self.directed.clear();
        self.events.push_back(e);
    }

    /// A packet from the peer, from `from` (its checksum already checked by decoding).
    pub fn handle(&mut self, p: Packet, from: SocketAddr, now: Instant) {
        if p.src_port != self.peer_port || p.dst_port != self.local_port {
            return;
        }
        let reflected_ok = |c: &Chunk| {
            matches!(
                c,
                Chunk::Abort {
                    reflected: true,
                    ..
                } | Chunk::ShutdownComplete { reflected: true }
            )
        };
        let tag_ok = p.tag == self.local_tag
            || (p.tag == self.peer_tag && p.chunks.first().is_some_and(reflected_ok))
            || (p.tag == 0 && matches!(p.chunks.first(), Some(Chunk::Init(_))));
        if !tag_ok {
            return;
        }
        if self.state == State::Closed {
            // Our SHUTDOWN COMPLETE was lost: answer as for an unknown association (§8.4).
            if matches!(p.chunks.first(), Some(Chunk::ShutdownAck)) {
                let reply = Packet::new(
                    self.local_port,
                    self.peer_port,
                    p.tag,
                    vec![Chunk::ShutdownComplete { reflected: true }],
                );
                self.replies.push_back((from, reply));
            }
            return;
        }
        let mut had_data = false;
        for c in p.chunks {
            if self.state == State::Closed {
                // A chunk before this one ended the association (an ABORT it had to send):
                // the rest of the packet is for an association that no longer exists.
                return;
            }
            match c {
                Chunk::InitAck(i) => self.on_init_ack(i, now),
                Chunk::CookieAck => {
                    if self.state == State::CookieEchoed {
                        self.state = State::Established;
                        self.t1 = None;
                        self.events.push_back(Event::Connected);
                    }
                }
                Chunk::Data(d) => {
                    had_data = true;
                    self.sack_to = Some(from);
                    self.on_data(d);
                }
                Chunk::Sack(s) => {
                    if let Some(snd) = self.sender.as_mut()
                        && snd.sack(&s, now).bytes > 0
                    {
                        self.paths.acknowledged(self.data_path);
                    }
                    self.try_shutdown(now);
                }
                Chunk::Heartbeat(info) => {
                    self.directed.push_back((from, Chunk::HeartbeatAck(info)));
                }
                Chunk::HeartbeatAck(info) => self.on_heartbeat_ack(&info, now),
                Chunk::Abort { .. } => {
                    self.close_with(Event::Aborted(PEER_ABORTED.into()));
                    return;
                }
                Chunk::Shutdown { cum_tsn } => self.on_shutdown(cum_tsn, now),
                Chunk::ShutdownAck => {
                    if matches!(self.state, State::ShutdownSent | State::ShutdownAckSent) {
                        self.control
                            .push_back(Chunk::ShutdownComplete { reflected: false });
                        self.close_with(Event::Closed);
                        return;
                    }
                }
                Chunk::ShutdownComplete { .. } => {
                    if self.state == State::ShutdownAckSent {
                        self.close_with(Event::Closed);
                        return;
                    }
                }
                Chunk::CookieEcho(_) => {
                    // Our COOKIE ACK was lost: the endpoint routed the echo here.
                    if self.state == State::Established {
                        self.control.push_back(Chunk::CookieAck);
                    }
                }
                Chunk::Init(_) | Chunk::Error { .. } => {}
                Chunk::Unknown { ty, .. } => {
                    let what = Unrecognized::of_chunk(ty);
                    if matches!(
                        what,
                        Unrecognized::StopAndReport | Unrecognized::SkipAndReport
                    ) {
                        self.report_unrecognized(ty);
                    }
                    if matches!(what, Unrecognized::Stop | Unrecognized::StopAndReport) {
                        break;
                    }
                }
            }
        }
        if had_data {
            self.unacked_packets += 1;
            let gaps = self.receiver.as_ref().is_some_and(Receiver::has_gaps);
            if gaps || self.unacked_packets >= 2 || self.state != State::Established {
                self.sack_now = true;
            } else if self.sack_at.is_none() {
                self.sack_at = Some(now + self.cfg.sack_delay);
            }
        }
    }

    fn report_unrecognized(&mut self, ty: u8) {
        let mut cause = BytesMut::new();
        cause.put_u16(CAUSE_UNRECOGNIZED_CHUNK);
        cause.put_u16(8);
        // The chunk's header, as much of it as a report needs.
        cause.put_slice(&[ty, 0, 0, 4]);
        self.control.push_back(Chunk::Error {
            causes: cause.freeze(),
        });
    }

    fn on_init_ack(&mut self, i: Init, now: Instant) {
        if self.state != State::CookieWait || i.initiate_tag == 0 {
            return;
        }
        let Some(cookie) = i.params.iter().find_map(|p| match p {
            InitParam::StateCookie(c) => Some(c.clone()),
            _ => None,
        }) else {
            self.abort("INIT ACK without a state cookie");
            return;
        };
        self.peer_tag = i.initiate_tag;
        self.paths.add_listed(&listed_addresses(&i.params), now);
        self.outbound_streams = self.outbound_streams.min(i.inbound_streams);
        let inbound = i.outbound_streams.min(self.cfg.max_inbound_streams);
        self.state = State::CookieEchoed;
        let echo = Chunk::CookieEcho(cookie);
        self.control.push_back(echo.clone());
        self.init_chunk = Some(echo);
        self.t1 = Some((now + self.cfg.timing.rto_initial, 0));
        self.start(i.initial_tsn, i.a_rwnd, inbound, now);
    }

    fn on_data(&mut self, d: crate::chunk::Data) {
        let Some(r) = self.receiver.as_mut() else {
            return;
        };
        if !matches!(
            self.state,
            State::Established | State::ShutdownPending | State::ShutdownSent
        ) {
            return;
        }
        if let Err(e) = r.data(d) {
            if matches!(e, crate::recv::RecvError::Stream(..)) {
                self.abort(&e.to_string());
                return;
            }
            self.sack_now = true;
        }
        while let Some(m) = r.poll() {
            self.events.push_back(Event::Message(m));
        }
    }

    fn on_heartbeat_ack(&mut self, info: &[u8], now: Instant) {
        let Some((i, rtt)) = self.paths.heartbeat_ack(info, now) else {
            return;
        };
        // An answer from any of the peer's addresses clears the association's errors
        // (RFC 9260 §8.1); the RTT is the data path's only when it was measured there.
        if let Some(s) = self.sender.as_mut() {
            s.errors = 0;
            if i == self.data_path {
                s.rtt_sample(rtt);
            }
        }
    }

    fn on_shutdown(&mut self, cum_tsn: u32, now: Instant) {
        if let Some(s) = self.sender.as_mut() {
            let ack = crate::chunk::Sack {
                cum_tsn,
                a_rwnd: self.cfg.window as u32,
                gaps: Vec::new(),
                dups: Vec::new(),
            };
            s.sack(&ack, now);
        }
        match self.state {
            State::Established | State::ShutdownPending | State::ShutdownSent => {
                self.state = State::ShutdownReceived;
            }
            // Our SHUTDOWN ACK was lost: again at once.
            State::ShutdownAckSent => self.control.push_back(Chunk::ShutdownAck),
            _ => {}
        }
        self.try_shutdown(now);
    }

    /// The next step of a shutdown once everything sent is acknowledged.
    fn try_shutdown(&mut self, now: Instant) {
        let idle = self.sender.as_ref().is_none_or(Sender::idle);
        if !idle {
            return;
        }
        match self.state {
            State::ShutdownPending => {
                self.state = State::ShutdownSent;
                self.send_shutdown(now, 0);
            }
            State::ShutdownReceived => {
                self.state = State::ShutdownAckSent;
                self.control.push_back(Chunk::ShutdownAck);
                self.t2 = Some((now + self.rto(), 0));
            }
            _ => {}
        }
    }

    fn send_shutdown(&mut self, now: Instant, tries: u32) {
        let cum_tsn = self.receiver.as_ref().map_or(0, Receiver::cum_tsn);
        self.control.push_back(Chunk::Shutdown { cum_tsn });
        self.t2 = Some((now + self.backoff(tries), tries));
    }

    /// T2 after `tries` retransmissions: the RTO doubled each time, as T3 (§9.2, §6.3.3).
    fn backoff(&self, tries: u32) -> Duration {
        (self.rto() * 2u32.saturating_pow(tries.min(16))).min(self.cfg.timing.rto_max)
    }

    fn rto(&self) -> Duration {
        self.sender
            .as_ref()
            .map_or(self.cfg.timing.rto_initial, Sender::rto)
    }

    /// The next packet to send, if any, and where.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<(SocketAddr, Packet)> {
        if let Some(p) = self.replies.pop_front() {
            return Some(p);
        }
        if let Some((to, c)) = self.directed.pop_front() {
            let p = Packet::new(self.local_port, self.peer_port, self.peer_tag, vec![c]);
            return Some((to, p));
        }
        let mut chunks = Vec::new();
        let mut room = self.cfg.mtu - crate::packet::HEADER;
        // INIT is sent with tag 0 and alone.
        if let Some(Chunk::Init(_)) = self.control.front() {
            let c = self.control.pop_front()?;
            let p = Packet::new(self.local_port, self.peer_port, 0, vec![c]);
            return Some((self.paths.primary(), p));
        }
        // Data follows the path in use; moving to another, the sender takes its RTO.
        let path = self.paths.data_path();
        if path != self.data_path {
            self.data_path = path;
            if let Some(s) = self.sender.as_mut() {
                s.set_rto(self.paths.rto(path));
            }
        }
        // A delayed SACK goes with DATA that leaves before it is due (RFC 9260 §6.2): an
        // answer carries the acknowledgement of its request, with no timer and no packet of
        // its own.
        let with_data = self.sack_at.is_some()
            && self.sender.as_ref().is_some_and(Sender::has_new)
            && matches!(
                self.state,
                State::Established | State::ShutdownPending | State::ShutdownReceived
            );
        let ready = self.sack_now || with_data || self.sack_at.is_some_and(|t| now >= t);
        let data_to = self.paths.addr(path);
        let sack_elsewhere = self.sack_to.filter(|a| *a != data_to);
        if ready
            && let Some(to) = sack_elsewhere
            && let Some(r) = self.receiver.as_mut()
        {
            let s = Chunk::Sack(r.sack());
            self.sack_now = false;
            self.sack_at = None;
            self.unacked_packets = 0;
            let p = Packet::new(self.local_port, self.peer_port, self.peer_tag, vec![s]);
            return Some((to, p));
        }
        if ready && let Some(r) = self.receiver.as_mut() {
            let s = Chunk::Sack(r.sack());
            room = room.saturating_sub(s.padded_len());
            chunks.push(s);
            self.sack_now = false;
            self.sack_at = None;
            self.unacked_packets = 0;
        }
        while let Some(c) = self.control.front() {
            if c.padded_len() > room && !chunks.is_empty() {
                break;
            }
            let Some(c) = self.control.pop_front() else {
                break;
            };
            room = room.saturating_sub(c.padded_len());
            let reflected = matches!(c, Chunk::Abort { .. } | Chunk::ShutdownComplete { .. })
                && self.peer_tag == 0;
            chunks.push(c);
            if reflected {
                break;
            }
        }
        let may_send_data = matches!(
            self.state,
            State::Established | State::ShutdownPending | State::ShutdownReceived
        );
        if may_send_data && let Some(s) = self.sender.as_mut() {
            chunks.extend(s.chunks(room, now).into_iter().map(Chunk::Data));
        }
        if chunks.is_empty() {
            return None;
        }
        let p = Packet::new(self.local_port, self.peer_port, self.peer_tag, chunks);
        Some((data_to, p))
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        for e in self.paths.take_events() {
            self.events.push_back(Event::Path(e));
        }
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Closed {
            return None;
        }
        [
            self.t1.map(|(t, _)| t),
            self.t2.map(|(t, _)| t),
            self.sack_at,
            self.paths
                .poll_timeout()
                .filter(|_| self.heartbeats_allowed()),
            self.sender.as_ref().and_then(Sender::timeout),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Closed {
            return;
        }
        if let Some((t, n)) = self.t1
            && now >= t
        {
            if n >= self.cfg.max_init_retransmits {
                self.close_with(Event::Aborted("no answer to INIT or COOKIE ECHO".into()));
                return;
            }
            if let Some(c) = self.init_chunk.clone() {
                self.control.push_front(c);
            }
            let backoff = self.cfg.timing.rto_initial * 2u32.saturating_pow(n + 1);
            self.t1 = Some((now + backoff.min(self.cfg.timing.rto_max), n + 1));
        }
        if let Some((t, n)) = self.t2
            && now >= t
        {
            if n >= self.cfg.max_retransmits {
                self.abort("no answer to SHUTDOWN");
                return;
            }
            match self.state {
                State::ShutdownSent => self.send_shutdown(now, n + 1),
                State::ShutdownAckSent => {
                    self.control.push_back(Chunk::ShutdownAck);
                    self.t2 = Some((now + self.backoff(n + 1), n + 1));
                }
                _ => self.t2 = None,
            }
        }
        if let Some(s) = self.sender.as_mut()
            && s.handle_timeout(now)
        {
            self.paths.data_timeout(self.data_path);
            if s.errors > self.cfg.max_retransmits {
                self.abort("the peer stopped acknowledging data");
                return;
            }
        }
        if self.heartbeats_allowed() {
            let mut beats = Vec::new();
            let missed = self.paths.handle_timeout(now, self.data_path, &mut beats);
            // One error count for the association (§8.1): timeouts of data and of
            // heartbeats on the data path, cleared by an acknowledgement of either.
            if missed > 0
                && let Some(s) = self.sender.as_mut()
            {
                s.errors += missed;
                s.back_off();
                if s.errors > self.cfg.max_retransmits {
                    self.abort("the peer stopped answering heartbeats");
                    return;
                }
            }
            for (to, info) in beats {
                self.directed.push_back((to, Chunk::Heartbeat(info)));
            }
        }
    }

    fn heartbeats_allowed(&self) -> bool {
        matches!(
            self.state,
            State::Established | State::ShutdownPending | State::ShutdownReceived
        )
    }
}
