//! ASAP and ENRP over SCTP in the registrar's event loop, as RFC 5352 and RFC 5353 run them
//! (PPIDs 11 and 12): a socket per local carrier — a UDP address for `sctp+udp://` (SCTP in
//! UDP, RFC 6951), an IP address for `sctp://` (IP protocol 132 on a raw socket, for hosts
//! whose kernel has no SCTP; needs root) — each with the user-space SCTP stack of
//! `rserpool-sctp` behind it, listening on the ASAP and ENRP ports given for it. Where the
//! kernel has SCTP, `sctp://` runs on it instead: its one-to-one sockets on a thread of their
//! own (`rserpool_sctp::host::Bridge`), whose events wake this loop. SCTP over UDP
//! puts a host's associations behind one UDP port, so ASAP and ENRP on the same address share
//! one socket. Associations to peer registrars configured with an SCTP address are opened here
//! too, from our ENRP port.
//!
//! To the core an association is a connection like a TCP one. SCTP keeps message boundaries,
//! so each message read is whole, and the core's output (messages back to back) is cut at the
//! lengths in their headers into one SCTP message each. What the core queues beyond
//! [`SEND_AHEAD`] unacknowledged bytes stays in the core, where its pending-output limit holds
//! for SCTP as for TCP.

use crate::core::{ConnId, Registrar};
use bytes::Bytes;
use mio::{Interest, Registry, Token};
use rserpool_sctp::host::{Bridge, Carrier};
use rserpool_sctp::stack::AssocId;
use rserpool_sctp::{Stack, StackEvent};
use rserpool_wire::{ASAP_PPID, Address, ENRP_PPID, Scheme};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Tokens of the SCTP sockets: below the registrar's own, above the status listener's.
const FIRST_TOKEN: usize = usize::MAX - 8;
/// SCTP addresses a registrar listens on at most.
pub(super) const MAX_SOCKETS: usize = 8;
/// Unacknowledged bytes an association may hold before the rest waits in the core.
const SEND_AHEAD: usize = 64 * 1024;
/// Datagrams read from one socket per turn of the loop before the others get theirs.
const READS_PER_TURN: usize = 256;
/// Largest datagram (an SCTP packet, or with raw IPv4 its IP header too).
const DATAGRAM: usize = 65_536;
/// Messages with a PPID other than ASAP's are logged at most this often.
const LOG_INTERVAL: Duration = Duration::from_secs(60);

/// The socket under a stack; `raw` for a raw IP socket (`rserpool_sctp::socket`).
struct Io {
    socket: mio::net::UdpSocket,
    raw: bool,
}

/// What runs a carrier's associations: our stack on a socket this loop reads, or the
/// kernel's SCTP behind a bridge that wakes it.
// At most `MAX_SOCKETS` of them: the stack inline costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Engine {
    User { io: Io, stack: Stack },
    Kernel(Bridge),
}

struct SctpSocket {
    engine: Engine,
    /// The carrier: the scheme, and the local UDP address (or IP address with port 0).
    scheme: Scheme,
    at: SocketAddr,
    /// Listening SCTP ports and whether each is ENRP's.
    ports: Vec<(u16, bool)>,
}

/// Where an address's SCTP travels: its scheme and the local socket address to bind for it.
fn carrier(a: &Address) -> (Scheme, SocketAddr) {
    match a.scheme {
        Scheme::SctpUdp { udp_port } => (a.scheme, SocketAddr::new(a.addr.ip(), udp_port)),
        _ => (a.scheme, SocketAddr::new(a.addr.ip(), 0)),
    }
}

/// The registrar's SCTP sockets and the associations on them.
pub(super) struct Sctp {
    sockets: Vec<SctpSocket>,
    by_conn: HashMap<ConnId, (usize, AssocId)>,
    by_assoc: HashMap<(usize, AssocId), ConnId>,
    /// Connections whose output waits for room in their association.
    waiting: Vec<ConnId>,
    /// Associations we opened, until they are up.
    connecting: HashMap<(usize, AssocId), ConnId>,
    /// Configured peer registrars reached over SCTP.
    peers: HashMap<SocketAddr, Scheme>,
    /// Connections the core opened to a peer that had already opened the association
    /// between our ENRP ports (SCTP has one per pair of endpoints): they share it with the
    /// accepted connection, which receives.
    aliases: HashMap<(usize, AssocId), Vec<ConnId>>,
    buf: Box<[u8]>,
    log_at: Option<Instant>,
}

/// The engine for `a`'s carrier, watched under `token`.
fn bind(a: &Address, registry: &Registry, token: Token) -> io::Result<Engine> {
    let (_, at) = carrier(a);
    let named = |e: io::Error| io::Error::new(e.kind(), format!("cannot listen on {a}: {e}"));
    let (socket, raw) = match a.scheme {
        Scheme::Tcp => return Err(io::Error::other("not an SCTP address")),
        Scheme::SctpUdp { .. } => (rserpool_sctp::socket::udp(at), false),
        Scheme::Sctp if Carrier::ip(at.is_ipv4()) == Carrier::Kernel => {
            let waker = std::sync::Arc::new(mio::Waker::new(registry, token)?);
            let bridge = Bridge::start(Carrier::Kernel, at, move || {
                let _ = waker.wake();
            })
            .map_err(named)?;
            info!("SCTP on {a} is the kernel's");
            return Ok(Engine::Kernel(bridge));
        }
        Scheme::Sctp => (rserpool_sctp::socket::raw(at), true),
    };
    let mut socket = mio::net::UdpSocket::from_std(socket.map_err(named)?);
    registry.register(&mut socket, token, Interest::READABLE)?;
    // Bound to the wildcard address, every interface address goes into INIT and INIT ACK:
    // peers fail over between them (multi-homing).
    let local = socket.local_addr().unwrap_or(at);
    let cfg = rserpool_sctp::Config {
        local_addresses: rserpool_sctp::socket::local_addresses(local),
        ..rserpool_sctp::Config::default()
    };
    Ok(Engine::User {
        io: Io { socket, raw },
        stack: Stack::with_os_randomness(cfg, Instant::now()),
    })
}

impl SctpSocket {
    fn listen(&mut self, port: u16) {
        match &mut self.engine {
            Engine::User { stack, .. } => stack.listen(port),
            Engine::Kernel(b) => b.listen(port),
        }
    }

    /// The association with `peer` between these ports, where the stack keeps one per pair
    /// (the kernel settles that itself).
    fn find(&self, peer: SocketAddr, local_port: u16, peer_port: u16) -> Option<AssocId> {
        match &self.engine {
            Engine::User { stack, .. } => stack.find(peer, local_port, peer_port),
            Engine::Kernel(_) => None,
        }
    }

    fn connect(&mut self, peer: SocketAddr, local_port: u16, peer_port: u16) -> AssocId {
        match &mut self.engine {
            Engine::User { stack, .. } => {
                stack.connect(peer, local_port, peer_port, Instant::now())
            }
            Engine::Kernel(b) => b.connect(peer, local_port, peer_port),
        }
    }

    fn poll_event(&mut self) -> Option<StackEvent> {
        match &mut self.engine {
            Engine::User { stack, .. } => stack.poll_event(),
            Engine::Kernel(b) => b.poll_event(),
        }
    }

    fn send(&mut self, id: AssocId, ppid: u32, msg: Bytes) -> bool {
        match &mut self.engine {
            Engine::User { stack, .. } => stack.send(id, 0, ppid, msg).is_ok(),
            Engine::Kernel(b) => {
                b.send(id, 0, ppid, msg);
                true
            }
        }
    }

    /// Bytes not yet acknowledged (the kernel's socket buffer holds its own).
    fn buffered(&self, id: AssocId) -> usize {
        match &self.engine {
            Engine::User { stack, .. } => stack.buffered(id),
            Engine::Kernel(_) => 0,
        }
    }

    fn abort(&mut self, id: AssocId, why: &str) {
        match &mut self.engine {
            Engine::User { stack, .. } => stack.abort(id, why),
            Engine::Kernel(b) => b.abort(id),
        }
    }

    fn shutdown(&mut self, id: AssocId) {
        match &mut self.engine {
            Engine::User { stack, .. } => stack.shutdown(id, Instant::now()),
            Engine::Kernel(b) => b.shutdown(id),
        }
    }
}

impl Sctp {
    /// Binds a socket per carrier of the SCTP addresses of `asap` and `enrp` and watches it;
    /// `peers` are the peer registrars to reach over SCTP. `None` without any SCTP address.
    pub(super) fn bind(
        asap: &[Address],
        enrp: &[Address],
        peers: &[Address],
        registry: &Registry,
    ) -> io::Result<Option<Self>> {
        if asap.is_empty() && enrp.is_empty() {
            return Ok(None);
        }
        let mut sockets: Vec<SctpSocket> = Vec::new();
        let roles = asap.iter().map(|a| (a, false));
        for (a, is_enrp) in roles.chain(enrp.iter().map(|a| (a, true))) {
            let (scheme, at) = carrier(a);
            let k = match sockets
                .iter()
                .position(|s| s.scheme == scheme && s.at == at)
            {
                Some(k) => k,
                None => {
                    if sockets.len() == MAX_SOCKETS {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!("at most {MAX_SOCKETS} SCTP carriers to listen on"),
                        ));
                    }
                    let token = Token(FIRST_TOKEN - sockets.len());
                    let engine = bind(a, registry, token)?;
                    sockets.push(SctpSocket {
                        engine,
                        scheme,
                        at,
                        ports: Vec::new(),
                    });
                    sockets.len() - 1
                }
            };
            let s = &mut sockets[k];
            if s.ports.iter().any(|(p, _)| *p == a.addr.port()) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{a}: ASAP and ENRP need SCTP ports of their own"),
                ));
            }
            s.listen(a.addr.port());
            s.ports.push((a.addr.port(), is_enrp));
            info!("{} over SCTP on {a}", if is_enrp { "ENRP" } else { "ASAP" });
        }
        Ok(Some(Self {
            sockets,
            by_conn: HashMap::new(),
            by_assoc: HashMap::new(),
            waiting: Vec::new(),
            connecting: HashMap::new(),
            aliases: HashMap::new(),
            peers: peers
                .iter()
                .filter(|p| p.scheme.is_sctp())
                .map(|p| (p.addr, p.scheme))
                .collect(),
            buf: vec![0; DATAGRAM].into_boxed_slice(),
            log_at: None,
        }))
    }

    /// Opens the association the core asked for as `id` (a connection it marked SCTP) — to the
    /// peer registrar at `addr`, or to a PE taken over that registered over SCTP — and tells the core as of a TCP connection
    /// (connected, or closed). It goes from our ENRP or ASAP port, as from a kernel SCTP socket
    /// bound to it: rsplib's registrar takes a peer's PRESENCE only over an association from
    /// the address the PRESENCE names.
    pub(super) fn connect(
        &mut self,
        id: ConnId,
        addr: SocketAddr,
        core: &mut Registrar,
        now: crate::core::Instant,
    ) {
        let enrp = core.is_enrp(id);
        let configured = self.peers.get(&addr).copied();
        // A socket of the peer's carrier (a PE's: any), of its address family, with a port
        // for the protocol.
        let Some(k) = self.sockets.iter().position(|s| {
            configured
                .is_none_or(|c| std::mem::discriminant(&s.scheme) == std::mem::discriminant(&c))
                && s.at.is_ipv4() == addr.is_ipv4()
                && s.ports.iter().any(|(_, e)| *e == enrp)
        }) else {
            warn!(
                "no SCTP socket with an {} port to reach {addr} from",
                if enrp { "ENRP" } else { "ASAP" }
            );
            return core.handle_close(id, now);
        };
        let s = &mut self.sockets[k];
        let scheme = configured.unwrap_or(s.scheme);
        let peer = match scheme {
            Scheme::SctpUdp { udp_port } => SocketAddr::new(addr.ip(), udp_port),
            _ => SocketAddr::new(addr.ip(), 0),
        };
        let local_port = s
            .ports
            .iter()
            .find(|(_, e)| *e == enrp)
            .map_or(0, |(p, _)| *p);
        if let Some(existing) = s.find(peer, local_port, addr.port()) {
            self.by_conn.insert(id, (k, existing));
            self.aliases.entry((k, existing)).or_default().push(id);
            if !self.connecting.contains_key(&(k, existing)) {
                core.handle_connected(id, now);
            }
            return;
        }
        let assoc = s.connect(peer, local_port, addr.port());
        self.connecting.insert((k, assoc), id);
        self.by_conn.insert(id, (k, assoc));
        self.by_assoc.insert((k, assoc), id);
    }

    /// The socket a token stands for.
    pub(super) fn socket_of(token: Token) -> Option<usize> {
        let k = FIRST_TOKEN.checked_sub(token.0)?;
        (token.0 <= FIRST_TOKEN && k < MAX_SOCKETS).then_some(k)
    }

    pub(super) fn owns(&self, id: ConnId) -> bool {
        self.by_conn.contains_key(&id)
    }

    /// Reads socket `k` (up to a turn's worth) and gives the core what arrived; `true` when
    /// more may be waiting.
    pub(super) fn on_readable(
        &mut self,
        k: usize,
        core: &mut Registrar,
        now: crate::core::Instant,
    ) -> bool {
        let Some(s) = self.sockets.get_mut(k) else {
            return false;
        };
        // The kernel's associations: their events are waiting.
        let mut more = matches!(s.engine, Engine::User { .. });
        if let Engine::User { io, stack } = &mut s.engine {
            for _ in 0..READS_PER_TURN {
                match io.socket.recv_from(&mut self.buf) {
                    Ok((n, from)) => {
                        let (packet, from) =
                            rserpool_sctp::socket::payload(&self.buf, n, from, io.raw);
                        stack.handle_datagram(from, packet, Instant::now())
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        more = false;
                        break;
                    }
                }
            }
        }
        self.events(k, core, now);
        more
    }

    /// The stack's events to the core.
    fn events(&mut self, k: usize, core: &mut Registrar, now: crate::core::Instant) {
        let Some(s) = self.sockets.get_mut(k) else {
            return;
        };
        while let Some(ev) = s.poll_event() {
            match ev {
                StackEvent::Accepted {
                    id,
                    peer,
                    local_port,
                    peer_port,
                } => {
                    // To the core, an association's peer is its address and SCTP port.
                    let peer = SocketAddr::new(peer.ip(), peer_port);
                    let enrp = s.ports.iter().any(|&(p, e)| p == local_port && e);
                    let accepted = if enrp {
                        core.accept_enrp(peer, now)
                    } else {
                        core.accept(peer, now)
                    };
                    match accepted {
                        Some(c) => {
                            core.mark_sctp(c);
                            self.by_conn.insert(c, (k, id));
                            self.by_assoc.insert((k, id), c);
                        }
                        // Over the connection limit or a stranger; the core logged it.
                        None => s.abort(id, "refused"),
                    }
                }
                StackEvent::Connected(id) => {
                    if let Some(c) = self.connecting.remove(&(k, id)) {
                        core.handle_connected(c, now);
                    }
                }
                StackEvent::Message(id, m) => {
                    let Some(&c) = self.by_assoc.get(&(k, id)) else {
                        continue;
                    };
                    let want = if core.is_enrp(c) {
                        ENRP_PPID
                    } else {
                        ASAP_PPID
                    };
                    if m.ppid == want {
                        core.handle_data(c, &m.data, now);
                    } else if self.log_at.is_none_or(|t| t.elapsed() >= LOG_INTERVAL) {
                        self.log_at = Some(Instant::now());
                        warn!(
                            "{}: ignored a message with PPID {} (expected {want})",
                            core.peer(c).map(|p| p.to_string()).unwrap_or_default(),
                            m.ppid
                        );
                    }
                }
                StackEvent::Path(id, e) => {
                    match self.by_assoc.get(&(k, id)).and_then(|c| core.peer(*c)) {
                        Some(peer) => tracing::info!("SCTP association {} with {peer}: {e}", id.0),
                        None => tracing::info!("SCTP association {}: {e}", id.0),
                    }
                }
                StackEvent::Closed(id, why) => {
                    self.connecting.remove(&(k, id));
                    let aliases = self.aliases.remove(&(k, id)).unwrap_or_default();
                    let primary = self.by_assoc.remove(&(k, id));
                    let by_peer = why
                        .as_deref()
                        .is_none_or(|w| w == rserpool_sctp::assoc::PEER_ABORTED);
                    if !by_peer {
                        tracing::debug!("association closed: {why:?}");
                    }
                    for c in primary.into_iter().chain(aliases) {
                        self.by_conn.remove(&c);
                        if by_peer {
                            core.handle_closed_by_peer(c, now);
                        } else {
                            core.handle_close(c, now);
                        }
                    }
                }
            }
        }
    }

    /// Moves the core's output for `id` into its association, message by message.
    pub(super) fn flush(&mut self, id: ConnId, core: &mut Registrar) {
        let Some(&(k, assoc)) = self.by_conn.get(&id) else {
            return;
        };
        let Some(s) = self.sockets.get_mut(k) else {
            return;
        };
        loop {
            if s.buffered(assoc) >= SEND_AHEAD {
                self.waiting.push(id);
                return;
            }
            let out = core.output(id);
            let Some(len) = rserpool_wire::framer::first_message_len(out) else {
                return;
            };
            let msg = Bytes::copy_from_slice(&out[..len]);
            let ppid = if core.is_enrp(id) {
                ENRP_PPID
            } else {
                ASAP_PPID
            };
            if !s.send(assoc, ppid, msg) {
                return; // Closing: its Closed event tells the core.
            }
            core.consume_output(id, len);
        }
    }

    /// Whether what was sent on `id` is not all acknowledged yet.
    pub(super) fn in_flight(&self, id: ConnId) -> bool {
        self.by_conn
            .get(&id)
            .and_then(|(k, a)| self.sockets.get(*k).map(|s| s.buffered(*a) > 0))
            .unwrap_or(false)
    }

    /// Ends `id`'s association: gracefully once what is queued is sent, or with an ABORT.
    /// The core is told by the caller.
    pub(super) fn close(&mut self, id: ConnId, core: &mut Registrar, abort: bool) {
        if !abort {
            self.flush(id, core);
        }
        let Some((k, assoc)) = self.by_conn.remove(&id) else {
            return;
        };
        if let Some(a) = self.aliases.get_mut(&(k, assoc))
            && let Some(i) = a.iter().position(|c| *c == id)
        {
            // The association lives on for the connection that shares it.
            a.swap_remove(i);
            return;
        }
        self.by_assoc.remove(&(k, assoc));
        self.connecting.remove(&(k, assoc));
        // Connections sharing it end with it (its Closed event finds them).
        if let Some(s) = self.sockets.get_mut(k) {
            if abort {
                s.abort(assoc, "closed by the registrar");
            } else {
                s.shutdown(assoc);
            }
        }
    }

    /// Connections waiting for room, given another try (after acknowledgements arrived).
    pub(super) fn retry_waiting(&mut self, core: &mut Registrar) {
        if self.waiting.is_empty() {
            return;
        }
        let mut ids = std::mem::take(&mut self.waiting);
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            self.flush(id, core);
        }
    }

    /// Sends what the stacks have to send.
    pub(super) fn transmit(&mut self) {
        let now = Instant::now();
        for s in &mut self.sockets {
            let Engine::User { io, stack } = &mut s.engine else {
                continue;
            };
            while let Some((to, data)) = stack.poll_transmit(now) {
                // A datagram the socket refuses is lost like one on the path: SCTP sends it
                // again.
                if let Err(e) = io.socket.send_to(&data, to)
                    && e.kind() != io::ErrorKind::WouldBlock
                {
                    tracing::debug!("SCTP to {to}: {e}");
                }
            }
        }
    }

    /// When a stack's timer is due next, as time from now.
    pub(super) fn poll_timeout(&self) -> Option<Duration> {
        let now = Instant::now();
        self.sockets
            .iter()
            .filter_map(|s| match &s.engine {
                Engine::User { stack, .. } => stack.poll_timeout(),
                Engine::Kernel(_) => None,
            })
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    pub(super) fn handle_timeout(&mut self, core: &mut Registrar, now: crate::core::Instant) {
        let at = Instant::now();
        for k in 0..self.sockets.len() {
            if let Some(SctpSocket {
                engine: Engine::User { stack, .. },
                ..
            }) = self.sockets.get_mut(k)
                && stack.poll_timeout().is_some_and(|t| t <= at)
            {
                stack.handle_timeout(at);
                self.events(k, core, now);
            }
        }
    }

    /// Aborts every association (the registrar stops): their PEs register elsewhere at once.
    pub(super) fn abort_all(&mut self) {
        for (&(k, assoc), _) in self.by_assoc.iter() {
            if let Some(s) = self.sockets.get_mut(k) {
                s.abort(assoc, "the registrar stops");
            }
        }
        self.by_assoc.clear();
        self.by_conn.clear();
        self.connecting.clear();
        self.aliases.clear();
        self.transmit();
    }
}
