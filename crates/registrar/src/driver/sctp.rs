//! ASAP over SCTP in the registrar's event loop, as RFC 5352 runs it (PPID 11): one socket per
//! `sctp+udp://` address (SCTP in UDP, RFC 6951) or `sctp://` address (IP protocol 132 on a
//! raw socket, for hosts whose kernel has no SCTP; needs root), each with the user-space SCTP
//! stack of `rserpool-sctp` behind it.
//!
//! To the core an association is a connection like a TCP one. SCTP keeps message boundaries,
//! so each message read is whole, and the core's output (messages back to back) is cut at the
//! lengths in their headers into one SCTP message each. What the core queues beyond
//! [`SEND_AHEAD`] unacknowledged bytes stays in the core, where its pending-output limit holds
//! for SCTP as for TCP.

use crate::core::{ConnId, Registrar};
use bytes::Bytes;
use mio::{Interest, Registry, Token};
use rserpool_sctp::stack::AssocId;
use rserpool_sctp::{Stack, StackEvent};
use rserpool_wire::{ASAP_PPID, Address, Scheme};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
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

/// IP protocol number of SCTP.
const IPPROTO_SCTP: i32 = 132;

/// The socket under a stack: UDP, or a raw IP socket for protocol 132 driven through the
/// same datagram calls (its peers' "ports" are 0; IPv4 datagrams arrive with their IP header).
struct Io {
    socket: mio::net::UdpSocket,
    raw_v4: bool,
}

impl Io {
    /// A datagram into `buf`: where its SCTP packet starts and ends, and its source.
    fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, usize, SocketAddr)> {
        let (n, from) = self.socket.recv_from(buf)?;
        // Skip the IPv4 header: IHL words.
        let start = if self.raw_v4 {
            buf.first().map_or(n, |b| usize::from(b & 0x0f) * 4)
        } else {
            0
        };
        Ok((start.min(n), n, from))
    }

    fn send_to(&self, data: &[u8], to: SocketAddr) -> io::Result<usize> {
        self.socket.send_to(data, to)
    }
}

struct SctpSocket {
    io: Io,
    stack: Stack,
    local: Address,
}

/// The registrar's SCTP sockets and the associations on them.
pub(super) struct Sctp {
    sockets: Vec<SctpSocket>,
    by_conn: HashMap<ConnId, (usize, AssocId)>,
    by_assoc: HashMap<(usize, AssocId), ConnId>,
    /// Connections whose output waits for room in their association.
    waiting: Vec<ConnId>,
    buf: Box<[u8]>,
    log_at: Option<Instant>,
}

fn bind(a: &Address) -> io::Result<Io> {
    match a.scheme {
        Scheme::Tcp => Err(io::Error::other("not an SCTP address")),
        Scheme::SctpUdp { udp_port } => {
            let at = SocketAddr::new(a.addr.ip(), udp_port);
            let s = std::net::UdpSocket::bind(at).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot listen for ASAP on {a}: UDP {at}: {e}"),
                )
            })?;
            s.set_nonblocking(true)?;
            Ok(Io {
                socket: mio::net::UdpSocket::from_std(s),
                raw_v4: false,
            })
        }
        Scheme::Sctp => {
            let v4 = a.addr.is_ipv4();
            let domain = if v4 { Domain::IPV4 } else { Domain::IPV6 };
            if Socket::new(domain, Type::STREAM, Some(Protocol::from(IPPROTO_SCTP))).is_ok() {
                // The kernel would answer every association our raw socket sees with an ABORT.
                return Err(io::Error::other(format!(
                    "cannot listen for ASAP on {a}: this host's kernel has SCTP, which rserpool \
                     does not use yet; listen on sctp+udp:// instead (docs/SCTP.md)"
                )));
            }
            let socket = Socket::new(domain, Type::RAW, Some(Protocol::from(IPPROTO_SCTP)))
                .map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "cannot listen for ASAP on {a}: a raw socket for SCTP needs root \
                             (CAP_NET_RAW): {e}; sctp+udp:// needs no privilege"
                        ),
                    )
                })?;
            socket.bind(&SockAddr::from(SocketAddr::new(a.addr.ip(), 0)))?;
            socket.set_nonblocking(true)?;
            let socket = std::net::UdpSocket::from(std::os::fd::OwnedFd::from(socket));
            Ok(Io {
                socket: mio::net::UdpSocket::from_std(socket),
                raw_v4: v4,
            })
        }
    }
}

impl Sctp {
    /// Binds every SCTP address of `addrs` and watches its socket; `None` without any.
    pub(super) fn bind(addrs: &[Address], registry: &Registry) -> io::Result<Option<Self>> {
        if addrs.is_empty() {
            return Ok(None);
        }
        if addrs.len() > MAX_SOCKETS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("at most {MAX_SOCKETS} SCTP addresses to listen on"),
            ));
        }
        let mut sockets = Vec::with_capacity(addrs.len());
        for (k, a) in addrs.iter().enumerate() {
            let mut io = bind(a)?;
            let token = Token(FIRST_TOKEN - k);
            registry.register(&mut io.socket, token, Interest::READABLE)?;
            let mut stack =
                Stack::with_os_randomness(rserpool_sctp::Config::default(), Instant::now());
            stack.listen(a.addr.port());
            sockets.push(SctpSocket {
                io,
                stack,
                local: *a,
            });
        }
        Ok(Some(Self {
            sockets,
            by_conn: HashMap::new(),
            by_assoc: HashMap::new(),
            waiting: Vec::new(),
            buf: vec![0; DATAGRAM].into_boxed_slice(),
            log_at: None,
        }))
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
        let mut more = true;
        for _ in 0..READS_PER_TURN {
            match s.io.recv_from(&mut self.buf) {
                Ok((start, end, from)) => {
                    s.stack
                        .handle_datagram(from, &self.buf[start..end], Instant::now())
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    more = false;
                    break;
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
        while let Some(ev) = s.stack.poll_event() {
            match ev {
                StackEvent::Accepted { id, peer, .. } => match core.accept(peer, now) {
                    Some(c) => {
                        self.by_conn.insert(c, (k, id));
                        self.by_assoc.insert((k, id), c);
                    }
                    // Over the connection limit; the core logged it.
                    None => s.stack.abort(id, "over the connection limit"),
                },
                StackEvent::Connected(_) => {}
                StackEvent::Message(id, m) => {
                    let Some(&c) = self.by_assoc.get(&(k, id)) else {
                        continue;
                    };
                    if m.ppid == ASAP_PPID {
                        core.handle_data(c, &m.data, now);
                    } else if self.log_at.is_none_or(|t| t.elapsed() >= LOG_INTERVAL) {
                        self.log_at = Some(Instant::now());
                        warn!(
                            "{}: ignored a message with PPID {} on the ASAP port (ASAP is 11)",
                            core.peer(c).map(|p| p.to_string()).unwrap_or_default(),
                            m.ppid
                        );
                    }
                }
                StackEvent::Closed(id, why) => {
                    let Some(c) = self.by_assoc.remove(&(k, id)) else {
                        continue;
                    };
                    self.by_conn.remove(&c);
                    let by_peer = why.as_deref().is_none_or(|w| w == "the peer aborted");
                    if by_peer {
                        core.handle_closed_by_peer(c, now);
                    } else {
                        tracing::debug!("association closed: {why:?}");
                        core.handle_close(c, now);
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
            if s.stack.buffered(assoc) >= SEND_AHEAD {
                self.waiting.push(id);
                return;
            }
            let out = core.output(id);
            let Some(len) = rserpool_wire::framer::first_message_len(out) else {
                return;
            };
            let msg = Bytes::copy_from_slice(&out[..len]);
            if s.stack.send(assoc, 0, ASAP_PPID, msg).is_err() {
                return; // Closing: its Closed event tells the core.
            }
            core.consume_output(id, len);
        }
    }

    /// Whether what was sent on `id` is not all acknowledged yet.
    pub(super) fn in_flight(&self, id: ConnId) -> bool {
        self.by_conn
            .get(&id)
            .and_then(|(k, a)| self.sockets.get(*k).map(|s| s.stack.buffered(*a) > 0))
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
        self.by_assoc.remove(&(k, assoc));
        if let Some(s) = self.sockets.get_mut(k) {
            if abort {
                s.stack.abort(assoc, "closed by the registrar");
            } else {
                s.stack.shutdown(assoc, Instant::now());
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
            while let Some((to, data)) = s.stack.poll_transmit(now) {
                // A datagram the socket refuses is lost like one on the path: SCTP sends it
                // again.
                if let Err(e) = s.io.send_to(&data, to)
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
            .filter_map(|s| s.stack.poll_timeout())
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    pub(super) fn handle_timeout(&mut self, core: &mut Registrar, now: crate::core::Instant) {
        let at = Instant::now();
        for k in 0..self.sockets.len() {
            if let Some(s) = self.sockets.get_mut(k)
                && s.stack.poll_timeout().is_some_and(|t| t <= at)
            {
                s.stack.handle_timeout(at);
                self.events(k, core, now);
            }
        }
    }

    /// Aborts every association (the registrar stops): their PEs register elsewhere at once.
    pub(super) fn abort_all(&mut self) {
        for (&(k, assoc), _) in self.by_assoc.iter() {
            if let Some(s) = self.sockets.get_mut(k) {
                s.stack.abort(assoc, "the registrar stops");
            }
        }
        self.by_assoc.clear();
        self.by_conn.clear();
        self.transmit();
    }

    pub(super) fn log_listening(&self) {
        for s in &self.sockets {
            info!("ASAP over SCTP on {}", s.local);
        }
    }
}
