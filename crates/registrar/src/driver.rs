//! The event loop: sockets and the clock around the sans-IO [`Registrar`].
//!
//! One thread waits on one `mio::Poll` (epoll) for every connection, reads through one buffer
//! shared by all of them, feeds the core, and writes the core's answers at once. A registrar is
//! single-threaded by nature (one handlespace), and its load is tens of thousands of mostly idle
//! connections each sending a small message now and then. That is why this is mio rather than a
//! tokio task per connection: a task and its I/O registration cost about 640 bytes per
//! connection (both are cache-line aligned) and a task wake-up per message, which was a third of
//! the memory and a fifth of the CPU in `rserpool-bench registrar`. Here a connection is an
//! epoll token and a file descriptor.
//!
//! The status listener (HTTP `GET /status`, the handlespace as JSON: what `rserpool status`
//! reads) is a listener of its own in the same loop ([`status_listener`]).

mod csp;
mod delivery;
mod handover;
mod sctp;
mod status_listener;

pub use handover::Inherited;

use crate::config::Config;
use crate::core::{Action, ConnId, Instant, Registrar};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use rserpool_tls::rustls;
use status_listener::StatusListener;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::{info, warn};

/// A peer that takes none of our bytes for this long is disconnected (10 000 ms).
const WRITE_TIMEOUT: Duration = Duration::from_millis(10_000);
/// The read buffer shared by all connections.
const READ_BUF: usize = 64 * 1024;
/// Bytes a connection may have read per turn of the event loop before the others get theirs.
const READ_PER_TURN: usize = 16 * 1024;
/// The same for a TLS connection, in reads of the socket (rustls takes up to 4 KiB a read).
const TLS_READS_PER_TURN: usize = 4;
/// The loop wakes at least this often (for write and status deadlines).
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Time for an outgoing connection (to a peer registrar or a PE taken over) to be set up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Failed datagram sends are logged at most this often.
const SEND_LOG_INTERVAL: Duration = Duration::from_secs(60);

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);
const ENRP_LISTENER: Token = Token(usize::MAX - 3);
const ENRP_UDP: Token = Token(usize::MAX - 4);
const ENRP_MULTICAST: Token = Token(usize::MAX - 5);
const HANDOVER: Token = Token(usize::MAX - 6);

/// Longest a successor may take from taking the sockets to serving on them.
const HANDOVER_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A bound registrar, ready to [`run`](Server::run).
pub struct Server {
    poll: Poll,
    listener: TcpListener,
    /// ASAP over SCTP; bound in `run` instead when a predecessor still holds its sockets.
    sctp: Option<sctp::Sctp>,
    enrp: Option<Enrp>,
    status: Option<StatusListener>,
    tls: Option<rserpool_tls::Tls>,
    cfg: Config,
    id: u32,
    local: SocketAddr,
    stop: StopHandle,
    /// Associations taken over from a predecessor, adopted when the loop starts, and the
    /// predecessor to tell then.
    adopt: Vec<(crate::core::Adoptable, std::net::TcpStream)>,
    /// The PEs of other registrars it held.
    peer_pes: Vec<u8>,
    taken: Option<rserpool_handover::Taken>,
    /// Where a successor may take this registrar over.
    offer_at: Option<rserpool_handover::Address>,
    observer: Option<Observer>,
    xds: Option<XdsCounterSource>,
}

/// Told of the handlespace after each turn of the loop (the xDS server's snapshots), and
/// whether the registrar serves it yet (false while it synchronises from a mentor at start:
/// it may still lack pools).
pub type Observer = Box<dyn FnMut(&rserpool_handlespace::Handlespace, bool) + Send>;

/// The xDS server's counters, for the status document and `/metrics`.
pub type XdsCounterSource = Box<dyn Fn() -> crate::status::XdsCounters + Send>;

/// Stops a running [`Server`] from any thread.
#[derive(Clone)]
pub struct StopHandle {
    flag: Arc<AtomicBool>,
    waker: Arc<Waker>,
}

impl StopHandle {
    pub fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        if let Err(e) = self.waker.wake() {
            warn!("cannot wake the registrar to stop it: {e}");
        }
    }
}

fn random_server_id() -> u32 {
    use rand_core::{OsRng, TryRngCore};
    loop {
        let id = OsRng.try_next_u32().unwrap_or_else(|_| {
            // No OS randomness: fall back to the clock; IDs only need to differ between peers.
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
                .unwrap_or(1)
        });
        if id != 0 {
            return id;
        }
    }
}

/// Binds the ASAP listener. Right after a restart the old connections may still hold the port
/// for a moment (FIN-WAIT): retried briefly before the address is called taken.
fn bind_asap(cfg: &Config) -> io::Result<TcpListener> {
    let at = cfg
        .asap_tcp()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let start = std::time::Instant::now();
    loop {
        match TcpListener::bind(at) {
            Ok(l) => return Ok(l),
            Err(e)
                if e.kind() == io::ErrorKind::AddrInUse
                    && start.elapsed() < Duration::from_secs(1) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot listen for ASAP on {at}: {e}"),
                ));
            }
        }
    }
}

impl Server {
    /// Binds the ASAP listener.
    pub fn bind(cfg: Config) -> io::Result<Self> {
        Self::bind_with(cfg, None)
    }

    /// [`bind`](Self::bind), or with what a running registrar handed over: its listeners,
    /// Server Identifier and ASAP associations (docs/OPERATIONS.md).
    pub fn bind_with(mut cfg: Config, inherited: Option<Inherited>) -> io::Result<Self> {
        let (mut listener, inherited) = match inherited {
            Some(Inherited {
                server_id,
                asap,
                enrp,
                status,
                conns,
                peer_pes,
                taken,
            }) => {
                // The associations go on whatever the listener; a changed ASAP address is
                // bound anew (the handed listener closes).
                let configured = cfg.asap_tcp().ok();
                let listener = match asap.local_addr() {
                    Ok(a) if configured.is_some_and(|c| c != a && c.port() != 0) => {
                        info!("ASAP listener {a} handed over, another configured: moved");
                        bind_asap(&cfg)?
                    }
                    _ => TcpListener::from_std(asap),
                };
                (
                    listener,
                    Some((server_id, enrp, status, conns, peer_pes, taken)),
                )
            }
            None => (bind_asap(&cfg)?, None),
        };
        let local = listener.local_addr()?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let sctp = if inherited.is_none() {
            bind_sctp(&cfg, poll.registry())?
        } else {
            None
        };
        let tls = cfg
            .tls_files()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            .map(|f| rserpool_tls::Tls::load(&f))
            .transpose()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let (enrp, status, id, adopt, peer_pes, taken) = match inherited {
            Some((server_id, enrp, status, conns, peer_pes, taken)) => {
                let enrp = enrp
                    .map(|(tcp, udp)| {
                        let (tcp, udp) = (
                            TcpListener::from_std(tcp),
                            mio::net::UdpSocket::from_std(udp),
                        );
                        Enrp::serve_on(&cfg, &poll, tcp, udp)
                    })
                    .transpose()?;
                // A status address changed in the successor's settings is bound anew (the
                // handed listener closes): a hand-over does not keep an address against them.
                let status = match status {
                    Some(l)
                        if cfg.status.addr().is_some_and(|c| {
                            c.port() == 0 || l.local_addr().is_ok_and(|a| a == c)
                        }) =>
                    {
                        Some(StatusListener::serve_on(
                            TcpListener::from_std(l),
                            poll.registry(),
                        )?)
                    }
                    handed => {
                        if let Some(l) = handed {
                            info!(
                                "status listener {} handed over, {} configured: moved",
                                l.local_addr()
                                    .map_or_else(|_| "?".into(), |a| a.to_string()),
                                cfg.status
                                    .addr()
                                    .map_or_else(|| "none".into(), |a| a.to_string())
                            );
                        }
                        StatusListener::bind(&cfg, poll.registry())?
                    }
                };
                cfg.server_id = server_id;
                (enrp, status, server_id, conns, peer_pes, Some(taken))
            }
            None => {
                let enrp = Enrp::bind(&cfg, &poll)?;
                let status = StatusListener::bind(&cfg, poll.registry())?;
                let id = if cfg.server_id != 0 {
                    cfg.server_id
                } else {
                    random_server_id()
                };
                (enrp, status, id, Vec::new(), Vec::new(), None)
            }
        };
        Ok(Self {
            poll,
            listener,
            sctp,
            enrp,
            status,
            tls,
            cfg,
            id,
            local,
            stop: StopHandle {
                flag: Arc::new(AtomicBool::new(false)),
                waker,
            },
            adopt,
            peer_pes,
            taken,
            offer_at: None,
            observer: None,
            xds: None,
        })
    }

    /// Lets a successor take this registrar over at `addr` once it runs.
    pub fn offer_handover(&mut self, addr: rserpool_handover::Address) {
        self.offer_at = Some(addr);
    }

    /// Calls `observer` with the handlespace once the loop runs and after each turn of it;
    /// it should return at once when nothing changed ([`Handlespace::changes`]).
    ///
    /// [`Handlespace::changes`]: rserpool_handlespace::Handlespace::changes
    pub fn observe(&mut self, observer: Observer) {
        self.observer = Some(observer);
    }

    /// Shows the xDS server's counters in the status document and `/metrics`.
    pub fn xds_counters(&mut self, source: XdsCounterSource) {
        self.xds = Some(source);
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The status listener's address, if it runs.
    pub fn status_addr(&self) -> Option<SocketAddr> {
        self.status.as_ref().map(StatusListener::local_addr)
    }

    /// The ENRP address, if ENRP runs.
    pub fn enrp_addr(&self) -> Option<SocketAddr> {
        self.enrp.as_ref().map(|e| e.local)
    }

    pub fn server_id(&self) -> u32 {
        self.id
    }

    /// What stops [`run`](Self::run).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Serves on this thread until [`StopHandle::stop`], then closes every connection.
    pub fn run(self) -> io::Result<()> {
        let epoch = std::time::Instant::now();
        let start = elapsed(epoch);
        let mut core = Registrar::new(self.cfg.clone(), self.id, start);
        core.enable_delivery_checks();
        let mut targets = self.cfg.announce.clone();
        if self.cfg.announce_multicast {
            targets.push(self.cfg.multicast_group);
        }
        let udp = if targets.is_empty() {
            None
        } else {
            let bind: SocketAddr = if self.local.is_ipv6() {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            } else {
                (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
            };
            let sock = UdpSocket::bind(bind)?;
            sock.set_nonblocking(true)?;
            if self.cfg.announce_multicast {
                sock.set_multicast_loop_v4(true).ok();
                sock.set_multicast_ttl_v4(8).ok();
            }
            core.enable_announce(self.local, start);
            info!(
                "announcing every {} ms to {:?}",
                self.cfg.announce_interval_ms, targets
            );
            Some(sock)
        };
        info!(
            "registrar {:#010x} listening for ASAP{} on {}{}",
            self.id,
            if self.tls.is_some() {
                " and ENRP over TLS (client certificates from the CA)"
            } else {
                ""
            },
            self.local,
            match self.status_addr() {
                Some(a) => format!(", status on http://{a}/status"),
                None => String::new(),
            }
        );
        if let Some(e) = &self.enrp {
            if let Some(a) = self.cfg.enrp.sctp().next() {
                core.enable_enrp_sctp(a.addr);
            }
            core.enable_enrp(e.local, start);
            let peers: Vec<String> = self.cfg.peer.iter().map(ToString::to_string).collect();
            info!(
                "ENRP on {} (TCP and UDP), peers: {}{}",
                e.local,
                if peers.is_empty() {
                    "none configured".to_owned()
                } else {
                    peers.join(", ")
                },
                if e.multicast.is_some() {
                    format!(", PRESENCE to {}", self.cfg.enrp_multicast_group)
                } else {
                    String::new()
                }
            );
        }
        let mut ev = EventLoop {
            poll: self.poll,
            listener: self.listener,
            sctp: self.sctp,
            enrp: self.enrp,
            status: self.status,
            tls: self.tls,
            core,
            epoch,
            socks: Vec::new(),
            read_buf: vec![0; READ_BUF].into_boxed_slice(),
            deferred: Vec::new(),
            unread: Vec::new(),
            sctp_unread: Vec::new(),
            last_flush: Instant::default(),
            watched: Vec::new(),
            udp,
            targets,
            accept_retry_at: None,
            accept_log_at: None,
            send_log_at: None,
            stall_log_at: None,
            offer: None,
            handed: None,
            csp: None,
            observer: self.observer,
            xds: self.xds,
        };
        if let Some(monitor) = self.cfg.csp {
            let interval = Duration::from_millis(self.cfg.csp_interval_ms);
            match csp::CspReporter::new(monitor, interval, self.local, start) {
                Ok(c) => ev.csp = Some(c),
                Err(e) => warn!("registrar: no component status reports to {monitor}: {e}"),
            }
        }
        if self.taken.is_some() {
            // Other registrars' PEs, then the associations with their PEs, then the
            // subscriptions: a pool user's next push is a change, never a pool half rebuilt.
            let peers = ev.core.adopt_peer_pes(&self.peer_pes, ev.now());
            let mut adopted = Vec::with_capacity(self.adopt.len());
            for (a, stream) in self.adopt {
                let now = ev.now();
                if let Some(id) = ev.core.adopt(&a, now) {
                    ev.add_sock(id, TcpStream::from_std(stream), None, false);
                    adopted.push((id, a));
                }
            }
            for (id, a) in &adopted {
                let now = ev.now();
                ev.core.adopt_subscriptions(*id, a, now);
            }
            info!(
                "took over {} associations and {} PEs ({peers} of other registrars)",
                adopted.len(),
                ev.core.handlespace().len()
            );
        }
        ev.after_core();
        if let Some(t) = self.taken {
            let pid = t.pid;
            match t.ready(Duration::from_secs(10)) {
                Ok(()) => info!("process {pid} stopped serving; this one serves"),
                Err(e) => warn!("process {pid}: {e}"),
            }
            // Its SCTP sockets (and associations) are not handed over: bound once it lets go.
            ev.bind_sctp_after_predecessor();
        }
        if let Some(at) = &self.offer_at {
            ev.offer(at);
        }
        let result = ev.run(&self.stop.flag);
        match ev.handed.take() {
            Some((giving, adopted)) => {
                // Theirs now: closed here without a word (the successor holds the sockets).
                for id in adopted {
                    if let Some(mut s) = ev.socks.get_mut(id.index()).and_then(Option::take) {
                        let _ = ev.poll.registry().deregister(&mut s.stream);
                    }
                }
                ev.offer = None;
                ev.close_all();
                if let Err(e) = giving.done() {
                    warn!("{e}");
                }
                info!("registrar {:#010x} handed over", self.id);
            }
            None => {
                info!("registrar {:#010x} shutting down", self.id);
                ev.close_all();
            }
        }
        result
    }
}

/// One accepted connection.
struct Sock {
    stream: TcpStream,
    /// TLS over the stream, when the registrar runs with TLS.
    tls: Option<Box<rustls::Connection>>,
    /// Its peer's certificate was reported to the core.
    authenticated: bool,
    /// When a stalled write or a connection attempt is given up.
    deadline: Option<Instant>,
    /// An outgoing connection still being set up.
    connecting: bool,
    /// A probe of a PE's service: its completion goes to the core, nothing is written.
    probe: bool,
    /// The core asked to close it once its output is written ([`Action::Close`]).
    closing: bool,
    /// What the core asks of its TCP state ([`Action::CheckDelivery`]).
    delivery: delivery::Delivery,
}

/// ENRP's sockets: the TCP listener for peer registrars, and UDP for PRESENCE datagrams.
struct Enrp {
    local: SocketAddr,
    listener: TcpListener,
    udp: mio::net::UdpSocket,
    multicast: Option<mio::net::UdpSocket>,
}

impl Enrp {
    /// ENRP on `listener` and `udp` (bound here, or handed over by a predecessor).
    fn serve_on(
        cfg: &Config,
        poll: &Poll,
        mut listener: TcpListener,
        mut udp: mio::net::UdpSocket,
    ) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let mut multicast = if cfg.enrp_multicast {
            Some(multicast_socket(cfg.enrp_multicast_group)?)
        } else {
            None
        };
        let r = poll.registry();
        r.register(&mut listener, ENRP_LISTENER, Interest::READABLE)?;
        r.register(&mut udp, ENRP_UDP, Interest::READABLE)?;
        if let Some(m) = multicast.as_mut() {
            r.register(m, ENRP_MULTICAST, Interest::READABLE)?;
        }
        Ok(Self {
            local,
            listener,
            udp,
            multicast,
        })
    }

    /// Binds ENRP's sockets. With no peer and no multicast configured, a taken address is
    /// not an error: the registrar then runs alone (several on one host, as in tests).
    fn bind(cfg: &Config, poll: &Poll) -> io::Result<Option<Self>> {
        let configured = !cfg.peer.is_empty() || cfg.enrp_multicast;
        let at = cfg
            .enrp_tcp()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let listener = match TcpListener::bind(at) {
            Ok(l) => l,
            Err(e) if !configured && e.kind() == io::ErrorKind::AddrInUse => {
                info!("ENRP address {at} in use: running without ENRP");
                return Ok(None);
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot listen for ENRP on {at}: {e}"),
                ));
            }
        };
        let local = listener.local_addr()?;
        let udp = mio::net::UdpSocket::bind(local).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot bind ENRP UDP on {local}: {e}"))
        })?;
        Self::serve_on(cfg, poll, listener, udp).map(Some)
    }
}

/// The socket as rustls reads it, noting a read shorter than asked (the socket is empty).
struct Drained<'a> {
    stream: &'a mut TcpStream,
    short: bool,
}

impl Read for Drained<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.stream.read(buf)?;
        self.short = n < buf.len();
        Ok(n)
    }
}

/// Writes a TLS connection: the records rustls holds, then the core's output through it.
fn flush_tls(
    tls: &mut rustls::Connection,
    stream: &mut TcpStream,
    core: &mut Registrar,
    id: ConnId,
    progress: &mut bool,
) -> Flush {
    loop {
        while tls.wants_write() {
            match tls.write_tls(stream) {
                Ok(n) => *progress |= n > 0,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Flush::Blocked,
                Err(_) => return Flush::Failed,
            }
        }
        let data = core.output(id);
        if data.is_empty() {
            return Flush::Done;
        }
        // rustls takes plaintext up to its buffer limit (during the handshake it holds it).
        match tls.writer().write(data) {
            Ok(0) => return Flush::Blocked,
            Ok(n) => core.consume_output(id, n),
            Err(_) => return Flush::Failed,
        }
    }
}

/// The core's time: milliseconds since the event loop started.
fn elapsed(epoch: std::time::Instant) -> Instant {
    Instant::since(epoch, std::time::Instant::now())
}

/// A UDP socket that receives the multicast group's datagrams (shared with other registrars
/// on the host).
fn multicast_socket(group: SocketAddr) -> io::Result<mio::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let SocketAddr::V4(g) = group else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("ENRP multicast group {group}: only IPv4 groups are supported"),
        ));
    };
    let sock = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    sock.set_reuse_address(true)?;
    sock.bind(&SocketAddr::from(([0, 0, 0, 0], g.port())).into())?;
    sock.join_multicast_v4(g.ip(), &std::net::Ipv4Addr::UNSPECIFIED)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot join {group}: {e}")))?;
    sock.set_multicast_loop_v4(true)?;
    sock.set_nonblocking(true)?;
    Ok(mio::net::UdpSocket::from_std(sock.into()))
}

struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    sctp: Option<sctp::Sctp>,
    enrp: Option<Enrp>,
    status: Option<StatusListener>,
    tls: Option<rserpool_tls::Tls>,
    core: Registrar,
    epoch: std::time::Instant,
    /// The open connections, indexed by [`ConnId::index`] (also their epoll token).
    socks: Vec<Option<Sock>>,
    read_buf: Box<[u8]>,
    /// Peer registrar connections with output, written once per loop iteration: the updates
    /// of every message handled in one wake-up go out in one write per peer.
    deferred: Vec<ConnId>,
    /// Connections that had more to read when their turn ended: read again in the next round,
    /// after everyone else's events, so that one peer that never stops sending (a flood)
    /// cannot starve the others.
    unread: Vec<usize>,
    /// The same for the SCTP sockets.
    sctp_unread: Vec<usize>,
    /// When the deferred connections were last written. Peers get at most one write per
    /// `enrp_batch_ms`: an update after a quiet spell goes out at once, under load the updates
    /// of a whole interval share one write per peer (on loopback a write also costs the
    /// receiver's TCP input and a wake-up, so the number of writes is what a peer costs).
    last_flush: Instant,
    /// Connections with a deadline set.
    watched: Vec<ConnId>,
    udp: Option<UdpSocket>,
    targets: Vec<SocketAddr>,
    /// Accepting failed (e.g. out of file descriptors): when to try again.
    accept_retry_at: Option<Instant>,
    accept_log_at: Option<Instant>,
    send_log_at: Option<Instant>,
    stall_log_at: Option<Instant>,
    /// Where a successor asks to take over.
    offer: Option<(rserpool_handover::Offer, mio::net::UnixListener)>,
    /// Handed over: what tells the successor this one stopped, and the associations it took.
    handed: Option<(rserpool_handover::Giving, Vec<ConnId>)>,
    /// Component status reports to an rsplib monitor (`csp`).
    csp: Option<csp::CspReporter>,
    observer: Option<Observer>,
    xds: Option<XdsCounterSource>,
}

/// The SCTP side of the configuration, bound.
fn bind_sctp(cfg: &Config, registry: &mio::Registry) -> io::Result<Option<sctp::Sctp>> {
    let asap: Vec<_> = cfg.asap.sctp().collect();
    let enrp: Vec<_> = cfg.enrp.sctp().collect();
    sctp::Sctp::bind(&asap, &enrp, &cfg.peer, registry)
}

/// The connection an action is about.
fn action_conn(a: &Action) -> Option<ConnId> {
    Some(match a {
        Action::Transmit(id)
        | Action::Connect(id, _)
        | Action::Probe(id, _)
        | Action::Close(id)
        | Action::Abort(id)
        | Action::CheckDelivery(id) => *id,
        Action::Announce(_) | Action::Presence(_) => return None,
    })
}

enum Flush {
    Done,
    Blocked,
    Failed,
}

/// What reading a TLS connection's socket brought.
/// An error only the other end's host sends: it is reachable (and the registrar is not cut off).
fn by_peer(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

enum TlsRead {
    Records,
    /// Records, and the socket is empty now.
    Last,
    Empty,
    /// The connection ended; `by_peer` when its other end closed or reset it.
    Closed {
        by_peer: bool,
    },
    Refused(rustls::Error),
}

impl EventLoop {
    fn now(&self) -> Instant {
        elapsed(self.epoch)
    }

    fn enrp_batch(&self) -> Duration {
        Duration::from_millis(self.core.config().enrp_batch_ms)
    }

    fn run(&mut self, stop: &AtomicBool) -> io::Result<()> {
        let mut events = Events::with_capacity(1024);
        while !stop.load(Ordering::Acquire) && self.handed.is_none() {
            let now = self.now();
            let mut next = now + MAX_WAIT;
            if let Some(t) = self.core.poll_timeout() {
                next = next.min(t);
            }
            if let Some(t) = self.accept_retry_at {
                next = next.min(t);
            }
            if let Some(t) = self.status.as_ref().and_then(StatusListener::next_event) {
                next = next.min(t);
            }
            if !self.deferred.is_empty() {
                next = next.min(self.last_flush + self.enrp_batch());
            }
            if let Some(c) = &self.csp {
                next = next.min(c.next());
            }
            if let Some(d) = self.sctp.as_ref().and_then(sctp::Sctp::poll_timeout) {
                next = next.min(now + d);
            }
            let wait = if self.unread.is_empty() && self.sctp_unread.is_empty() {
                next.saturating_duration_since(now)
            } else {
                Duration::ZERO
            };
            match self.poll.poll(&mut events, Some(wait)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept(),
                    ENRP_LISTENER => self.accept_enrp(),
                    ENRP_UDP | ENRP_MULTICAST => self.receive_datagrams(event.token()),
                    WAKER => {}
                    HANDOVER => self.on_handover(),
                    status_listener::LISTENER => {
                        let now = self.now();
                        if let Some(s) = self.status.as_mut() {
                            s.accept(self.poll.registry(), now);
                        }
                    }
                    t if StatusListener::slot(t).is_some() => self.on_status(t),
                    t if sctp::Sctp::socket_of(t).is_some() => {
                        if let Some(k) = sctp::Sctp::socket_of(t) {
                            self.on_sctp(k);
                        }
                    }
                    Token(i) => {
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.on_readable(i);
                        }
                        if event.is_writable() {
                            self.on_writable(i);
                        }
                    }
                }
            }
            for i in std::mem::take(&mut self.unread) {
                self.on_readable(i);
            }
            for k in std::mem::take(&mut self.sctp_unread) {
                self.on_sctp(k);
            }
            let now = self.now();
            if self.accept_retry_at.is_some_and(|t| t <= now) {
                self.accept_retry_at = None;
                self.accept();
            }
            if self.core.poll_timeout().is_some_and(|t| t <= now) {
                self.core.handle_timeout(now);
                self.after_core();
            }
            if !self.watched.is_empty() {
                self.check_deadlines(now);
            }
            if let Some(s) = self.status.as_mut().filter(|s| s.has_conns()) {
                s.expire(now, self.poll.registry());
                let (core, xds) = (&self.core, &self.xds);
                s.tick(self.poll.registry(), now, || {
                    serde_json::to_vec(&status_document(core, xds, now)).unwrap_or_default()
                });
            }
            let now = self.now();
            if !self.deferred.is_empty() && self.last_flush + self.enrp_batch() <= now {
                self.last_flush = now;
                self.flush_deferred();
            }
            if let Some(s) = self.sctp.as_mut() {
                s.handle_timeout(&mut self.core, now);
                s.retry_waiting(&mut self.core);
                self.after_core();
                if let Some(s) = self.sctp.as_mut() {
                    s.transmit();
                }
            }
            self.report_status(now, false);
            if let Some(observe) = self.observer.as_mut() {
                observe(self.core.handlespace(), !self.core.is_starting());
            }
        }
        // The monitor drops a registrar that says it stops; one handed over lives on in its
        // successor, which reports under the same identifier.
        if self.handed.is_none() {
            let now = self.now();
            self.report_status(now, true);
        }
        Ok(())
    }

    /// A component status report, when one is due (`last`: at once, the final one).
    fn report_status(&mut self, now: Instant, last: bool) {
        if let Some(c) = self.csp.as_mut().filter(|c| last || c.next() <= now) {
            c.report(&self.core.metrics(now), now, last);
        }
    }

    fn accept(&mut self) {
        self.accept_from(false);
    }

    /// Offers this registrar to a successor at `at`; its predecessor, if any, has just closed
    /// its offer there, so a taken name is tried again for a moment.
    fn offer(&mut self, at: &rserpool_handover::Address) {
        let start = std::time::Instant::now();
        let offer = loop {
            match rserpool_handover::Offer::bind(at) {
                Ok(o) => break o,
                Err(e) if start.elapsed() >= Duration::from_secs(5) => {
                    return warn!("no hand-over to a successor: {e}");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        // Watched through a second descriptor; the offer keeps (and finally removes) its name.
        let watched = offer
            .listener()
            .try_clone()
            .map(mio::net::UnixListener::from_std)
            .and_then(|mut l| {
                self.poll
                    .registry()
                    .register(&mut l, HANDOVER, Interest::READABLE)
                    .map(|()| l)
            });
        match watched {
            Ok(l) => {
                info!("a successor takes over at {at}");
                self.offer = Some((offer, l));
            }
            Err(e) => warn!("no hand-over to a successor: {e}"),
        }
    }

    /// A successor asks to take over: it gets the listeners and every plain-TCP ASAP
    /// association with its state; this loop waits (reading nothing, so the state it gave
    /// stays true) until the successor serves, then stops. If the successor fails first,
    /// this one goes on.
    fn on_handover(&mut self) {
        let Some((offer, _)) = &self.offer else {
            return;
        };
        let asker = match offer.accept() {
            Ok(Some(a)) => a,
            Ok(None) => return,
            Err(e) => return warn!("hand-over: {e}"),
        };
        let pid = asker.pid;
        let given = self.handover_state();
        let (state, fds, ids) = match given {
            Ok(g) => g,
            Err(e) => return warn!("hand-over to process {pid}: {e}"),
        };
        let n = ids.len();
        let giving = asker
            .give(&state, &rserpool_handover::borrow(&fds))
            .and_then(|g| g.wait_ready(HANDOVER_READY_TIMEOUT).map(|()| g));
        match giving {
            Ok(g) => {
                info!("process {pid} took over the listeners and {n} associations");
                self.handed = Some((g, ids));
            }
            Err(e) => warn!("a hand-over did not complete, serving on: {e}"),
        }
    }

    /// The state and descriptors for a successor, and the associations it gets.
    #[allow(clippy::type_complexity)]
    fn handover_state(&self) -> io::Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>, Vec<ConnId>)> {
        use std::os::fd::AsFd;
        let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned();
        let mut listeners = vec![dup(self.listener.as_fd())?];
        if let Some(e) = &self.enrp {
            listeners.push(dup(e.listener.as_fd())?);
            listeners.push(dup(e.udp.as_fd())?);
        }
        if let Some(s) = &self.status {
            listeners.push(dup(s.listener_fd())?);
        }
        let mut conns = Vec::new();
        let mut ids = Vec::new();
        for a in self.core.handover() {
            let Some(s) = self.socks.get(a.id.index()).and_then(Option::as_ref) else {
                continue;
            };
            if s.tls.is_some() || s.probe || s.connecting || s.closing {
                continue;
            }
            ids.push(a.id);
            conns.push((a, dup(s.stream.as_fd())?));
        }
        let (state, fds) = handover::state(
            self.core.id(),
            listeners,
            self.enrp.is_some(),
            self.status.is_some(),
            conns,
            self.core.peer_pes(),
        )?;
        Ok((state, fds, ids))
    }

    fn accept_enrp(&mut self) {
        self.accept_from(true);
    }

    fn accept_from(&mut self, enrp: bool) {
        loop {
            let accepted = match (&self.enrp, enrp) {
                (Some(e), true) => e.listener.accept(),
                (None, true) => return,
                (_, false) => self.listener.accept(),
            };
            let (stream, peer) = match accepted {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // E.g. out of file descriptors: the waiting connections stay queued; log
                    // once a second and try again shortly.
                    let now = self.now();
                    if self
                        .accept_log_at
                        .is_none_or(|t| now >= t + Duration::from_secs(1))
                    {
                        warn!("accept failed: {e}");
                        self.accept_log_at = Some(now);
                    }
                    self.accept_retry_at = Some(now + Duration::from_millis(50));
                    return;
                }
            };
            let now = self.now();
            let id = if enrp {
                self.core.accept_enrp(peer, now)
            } else {
                self.core.accept(peer, now)
            };
            let Some(id) = id else {
                continue; // Over the connection limit; the core logged it. Dropping closes.
            };
            // ENRP peers must present a certificate; on ASAP, pool users may come without.
            let tls = match self.tls.as_ref().map(|t| t.accept(enrp)) {
                None => None,
                Some(Ok(c)) => Some(Box::new(rustls::Connection::Server(c))),
                Some(Err(e)) => {
                    warn!("cannot start TLS with {peer}: {e}");
                    let now = self.now();
                    self.core.handle_close(id, now);
                    continue;
                }
            };
            self.add_sock(id, stream, tls, false);
        }
    }

    /// Watches a connection the core knows as `id`.
    fn add_sock(
        &mut self,
        id: ConnId,
        mut stream: TcpStream,
        tls: Option<Box<rustls::Connection>>,
        connecting: bool,
    ) {
        stream.set_nodelay(true).ok();
        let registered = self.poll.registry().register(
            &mut stream,
            Token(id.index()),
            Interest::READABLE | Interest::WRITABLE,
        );
        if let Err(e) = registered {
            warn!("cannot watch a connection: {e}");
            let now = self.now();
            self.core.handle_close(id, now);
            return;
        }
        if self.socks.len() <= id.index() {
            self.socks.resize_with(id.index() + 1, || None);
        }
        self.socks[id.index()] = Some(Sock {
            stream,
            tls,
            authenticated: false,
            deadline: None,
            connecting,
            probe: false,
            closing: false,
            delivery: delivery::Delivery::default(),
        });
        if connecting {
            let deadline = self.now() + CONNECT_TIMEOUT;
            self.watch(id, deadline);
        }
    }

    /// Opens a probe of a PE's service the core asked for: plain TCP, whatever the registrar's
    /// TLS.
    fn probe(&mut self, id: ConnId, addr: SocketAddr) {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                self.add_sock(id, stream, None, true);
                if let Some(sock) = self.sock(id.index()) {
                    sock.probe = true;
                }
            }
            Err(e) => {
                tracing::debug!("probe of {addr}: {e}");
                let now = self.now();
                self.core.handle_close(id, now);
            }
        }
    }

    /// Opens an outgoing connection the core asked for (a peer registrar, a PE taken over).
    fn connect(&mut self, id: ConnId, addr: SocketAddr) {
        let tls = match self.tls.as_ref().map(|t| t.connect(addr.ip())) {
            None => None,
            Some(Ok(c)) => Some(Box::new(rustls::Connection::Client(c))),
            Some(Err(e)) => {
                warn!("cannot start TLS towards {addr}: {e}");
                let now = self.now();
                self.core.handle_close(id, now);
                return;
            }
        };
        match TcpStream::connect(addr) {
            Ok(stream) => self.add_sock(id, stream, tls, true),
            Err(e) => {
                tracing::debug!("connect to {addr}: {e}");
                let now = self.now();
                self.core.handle_close(id, now);
            }
        }
    }

    fn receive_datagrams(&mut self, token: Token) {
        let Some(e) = &self.enrp else { return };
        let sock = match token {
            ENRP_MULTICAST => e.multicast.as_ref(),
            _ => Some(&e.udp),
        };
        let Some(sock) = sock else { return };
        loop {
            match sock.recv_from(&mut self.read_buf) {
                Ok((n, _)) => {
                    let now = elapsed(self.epoch);
                    self.core.handle_datagram(&self.read_buf[..n], now);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.after_core();
    }

    /// Sends a PRESENCE to the ENRP multicast group.
    fn send_presence(&mut self, data: &[u8]) {
        let (Some(e), group) = (&self.enrp, self.core.config().enrp_multicast_group) else {
            return;
        };
        let now = elapsed(self.epoch);
        if let Err(err) = e.udp.send_to(data, group)
            && self
                .send_log_at
                .is_none_or(|at| now >= at + SEND_LOG_INTERVAL)
        {
            warn!("PRESENCE to {group} failed: {err}");
            self.send_log_at = Some(now);
        }
    }

    fn sock(&mut self, i: usize) -> Option<&mut Sock> {
        self.socks.get_mut(i).and_then(Option::as_mut)
    }

    fn on_readable(&mut self, i: usize) {
        if self.sock(i).is_some_and(|s| s.tls.is_some()) {
            return self.on_readable_tls(i);
        }
        let id = ConnId::from_index(i);
        let mut turn = 0;
        while turn < READ_PER_TURN {
            let Some(sock) = self.socks.get_mut(i).and_then(Option::as_mut) else {
                return;
            };
            let want = self.read_buf.len().min(READ_PER_TURN - turn);
            let n = match sock.stream.read(&mut self.read_buf[..want]) {
                Ok(0) => return self.close_by_peer(id),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if by_peer(&e) => return self.close_by_peer(id),
                Err(_) => return self.close(id),
            };
            turn += n;
            let now = self.now();
            self.core.handle_data(id, &self.read_buf[..n], now);
            self.after_core();
            if n < want {
                // A short read emptied the socket; epoll reports the next arrival.
                return;
            }
        }
        // Its turn is over with bytes left: edge-triggered epoll will not say so again.
        if !self.unread.contains(&i) {
            self.unread.push(i);
        }
    }

    /// Reads a TLS connection: records into rustls, the handshake's answers out, the
    /// plaintext to the core.
    fn on_readable_tls(&mut self, i: usize) {
        let id = ConnId::from_index(i);
        for _ in 0..TLS_READS_PER_TURN {
            let read = {
                let Some(sock) = self.socks.get_mut(i).and_then(Option::as_mut) else {
                    return;
                };
                let Some(tls) = sock.tls.as_deref_mut() else {
                    return;
                };
                let mut reader = Drained {
                    stream: &mut sock.stream,
                    short: false,
                };
                match tls.read_tls(&mut reader) {
                    Ok(0) => TlsRead::Closed { by_peer: true },
                    Ok(_) => match tls.process_new_packets() {
                        // A short read emptied the socket: no read that finds nothing next.
                        Ok(_) if reader.short => TlsRead::Last,
                        Ok(_) => TlsRead::Records,
                        Err(e) => {
                            // The alert saying why, as far as the socket takes it.
                            let _ = tls.write_tls(&mut sock.stream);
                            TlsRead::Refused(e)
                        }
                    },
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => TlsRead::Empty,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => TlsRead::Closed {
                        by_peer: by_peer(&e),
                    },
                }
            };
            match read {
                TlsRead::Refused(e) => {
                    let now = self.now();
                    self.core.tls_refused(id, &rserpool_tls::describe(&e), now);
                    return self.close(id);
                }
                TlsRead::Closed { by_peer } => {
                    if !self.tls_plaintext(id) {
                        return;
                    }
                    return self.close_with(id, by_peer);
                }
                TlsRead::Empty | TlsRead::Last => {
                    if self.tls_plaintext(id) {
                        self.flush(id);
                    }
                    return;
                }
                TlsRead::Records => {
                    if !self.tls_plaintext(id) {
                        return;
                    }
                }
            }
        }
        // Its turn is over with records left, as in `on_readable`.
        if !self.unread.contains(&i) {
            self.unread.push(i);
        }
    }

    /// Hands the core what rustls decrypted (and, once, that the peer has a certificate);
    /// false when the connection is gone.
    fn tls_plaintext(&mut self, id: ConnId) -> bool {
        loop {
            let Some(sock) = self.socks.get_mut(id.index()).and_then(Option::as_mut) else {
                return false;
            };
            let Some(tls) = sock.tls.as_deref_mut() else {
                return false;
            };
            let certified = !sock.authenticated
                && !tls.is_handshaking()
                && tls.peer_certificates().is_some_and(|c| !c.is_empty());
            sock.authenticated |= certified;
            let n = match tls.reader().read(&mut self.read_buf) {
                Ok(0) => {
                    self.close_by_peer(id); // close_notify
                    return false;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(_) => {
                    self.close(id);
                    return false;
                }
            };
            if certified {
                self.core.authenticated(id);
            }
            if n == 0 {
                return true;
            }
            let now = self.now();
            self.core.handle_data(id, &self.read_buf[..n], now);
            self.after_core();
        }
    }

    fn on_writable(&mut self, i: usize) {
        let id = ConnId::from_index(i);
        let Some(sock) = self.sock(i) else { return };
        if sock.connecting {
            // Connected, or failed: an error, or no peer address, says which.
            match sock.stream.take_error() {
                Ok(Some(e)) if by_peer(&e) => return self.close_by_peer(id),
                Ok(Some(_)) | Err(_) => return self.close(id),
                Ok(None) => {}
            }
            if sock.stream.peer_addr().is_err() {
                return self.close(id);
            }
            sock.connecting = false;
            sock.deadline = None;
            if sock.probe {
                let now = self.now();
                self.core.handle_connected(id, now);
                return self.after_core();
            }
            return self.flush(id);
        }
        if sock.deadline.is_some() {
            self.flush(id);
        }
    }

    /// Carries out what the core asked for: writes, connections to open and to close,
    /// datagrams.
    fn after_core(&mut self) {
        while let Some(action) = self.core.poll_action() {
            if let Some(s) = self
                .sctp
                .as_mut()
                .filter(|s| action_conn(&action).is_some_and(|id| s.owns(id)))
            {
                match action {
                    Action::Transmit(id) => s.flush(id, &mut self.core),
                    Action::Close(id) | Action::Abort(id) => {
                        s.close(id, &mut self.core, matches!(action, Action::Abort(_)));
                        let now = elapsed(self.epoch);
                        self.core.handle_close(id, now);
                    }
                    Action::CheckDelivery(id) => {
                        let on_its_way = s.in_flight(id);
                        let now = elapsed(self.epoch);
                        self.core.handle_delivery(id, on_its_way, now);
                    }
                    _ => {}
                }
                continue;
            }
            match action {
                Action::Transmit(id) if self.core.is_enrp(id) => self.deferred.push(id),
                Action::Transmit(id) => self.flush(id),
                Action::Connect(id, addr) => match self.sctp.as_mut() {
                    Some(s) if self.core.is_sctp(id) => {
                        let now = elapsed(self.epoch);
                        s.connect(id, addr, &mut self.core, now);
                    }
                    _ => self.connect(id, addr),
                },
                Action::Probe(id, addr) => self.probe(id, addr),
                Action::Close(id) => {
                    if let Some(sock) = self.sock(id.index()) {
                        sock.closing = true;
                    }
                    self.flush(id);
                }
                Action::Abort(id) => {
                    if let Some(sock) = self.sock(id.index()) {
                        // A reset discards what the kernel still holds for the peer.
                        let _ =
                            socket2::SockRef::from(&sock.stream).set_linger(Some(Duration::ZERO));
                    }
                    self.close(id);
                }
                Action::Announce(data) => self.announce(&data),
                Action::Presence(data) => self.send_presence(&data),
                Action::CheckDelivery(id) => {
                    let on_its_way = self
                        .sock(id.index())
                        .is_some_and(|s| s.delivery.on_its_way(&s.stream));
                    let now = self.now();
                    self.core.handle_delivery(id, on_its_way, now);
                }
            }
        }
    }

    /// Reads SCTP socket `k` and carries out what the core makes of it.
    fn on_sctp(&mut self, k: usize) {
        let now = self.now();
        let Some(s) = self.sctp.as_mut() else { return };
        if s.on_readable(k, &mut self.core, now) {
            self.sctp_unread.push(k);
        }
        s.retry_waiting(&mut self.core);
        self.after_core();
        if let Some(s) = self.sctp.as_mut() {
            s.transmit();
        }
    }

    /// Binds the SCTP sockets a predecessor held until now (retried for a moment while it
    /// lets go of them).
    fn bind_sctp_after_predecessor(&mut self) {
        let start = std::time::Instant::now();
        loop {
            match bind_sctp(self.core.config(), self.poll.registry()) {
                Ok(s) => {
                    self.sctp = s;
                    return;
                }
                Err(e)
                    if e.kind() == io::ErrorKind::AddrInUse
                        && start.elapsed() < Duration::from_secs(5) =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    warn!("no ASAP over SCTP: {e}");
                    return;
                }
            }
        }
    }

    fn flush_deferred(&mut self) {
        while !self.deferred.is_empty() {
            let mut ids = std::mem::take(&mut self.deferred);
            ids.sort_unstable();
            ids.dedup();
            for id in ids {
                self.flush(id);
            }
        }
    }

    /// Writes a connection's queued output as far as the socket takes it.
    fn flush(&mut self, id: ConnId) {
        let Some(sock) = self.socks.get_mut(id.index()).and_then(Option::as_mut) else {
            return;
        };
        if sock.connecting {
            return; // Written once connected.
        }
        let mut progress = false;
        let outcome = loop {
            if let Some(tls) = sock.tls.as_deref_mut() {
                break flush_tls(tls, &mut sock.stream, &mut self.core, id, &mut progress);
            }
            let data = self.core.output(id);
            if data.is_empty() {
                break Flush::Done;
            }
            match sock.stream.write(data) {
                Ok(n) => {
                    progress |= n > 0;
                    self.core.consume_output(id, n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Flush::Blocked,
                Err(_) => break Flush::Failed,
            }
        };
        match outcome {
            Flush::Done => {
                sock.deadline = None;
                if sock.closing {
                    self.close(id);
                }
            }
            Flush::Blocked => {
                // The peer is slow: it has WRITE_TIMEOUT from its last progress. The
                // core's pending-output limit catches one that never reads sooner.
                if progress || sock.deadline.is_none() {
                    let deadline = self.now() + WRITE_TIMEOUT;
                    self.watch(id, deadline);
                }
            }
            Flush::Failed => self.close(id),
        }
    }

    fn watch(&mut self, id: ConnId, deadline: Instant) {
        let Some(sock) = self.socks.get_mut(id.index()).and_then(Option::as_mut) else {
            return;
        };
        if sock.deadline.replace(deadline).is_none() {
            self.watched.push(id);
        }
    }

    fn check_deadlines(&mut self, now: Instant) {
        let watched = std::mem::take(&mut self.watched);
        let mut keep = Vec::with_capacity(watched.len());
        for id in watched {
            match self.sock(id.index()).and_then(|s| s.deadline) {
                Some(t) if t <= now => {
                    // One line a second at most, however many peers stall together.
                    if let Some(peer) = self.core.peer(id)
                        && self
                            .stall_log_at
                            .is_none_or(|at| now >= at + Duration::from_secs(1))
                    {
                        warn!("{peer}: closing, no progress for a while (a slow reader)");
                        self.stall_log_at = Some(now);
                    }
                    self.close(id);
                }
                Some(_) => keep.push(id),
                None => {}
            }
        }
        keep.append(&mut self.watched);
        // A connection that unblocked and blocked again is listed twice.
        keep.sort_unstable();
        keep.dedup();
        self.watched = keep;
    }

    /// Closes a connection now; the core forgets it and its PEs.
    fn close(&mut self, id: ConnId) {
        self.close_with(id, false);
    }

    /// Closes a connection that its other end closed, reset or refused.
    fn close_by_peer(&mut self, id: ConnId) {
        self.close_with(id, true);
    }

    fn close_with(&mut self, id: ConnId, by_peer: bool) {
        let Some(mut sock) = self.socks.get_mut(id.index()).and_then(Option::take) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut sock.stream);
        drop(sock);
        let now = self.now();
        if by_peer {
            self.core.handle_closed_by_peer(id, now);
        } else {
            self.core.handle_close(id, now);
        }
        self.after_core();
    }

    fn close_all(&mut self) {
        if let Some(s) = self.sctp.as_mut() {
            s.abort_all();
        }
        for i in 0..self.socks.len() {
            // Last answers first (e.g. deregistration responses), as far as sockets take them.
            let id = ConnId::from_index(i);
            if self.sock(i).is_some() && !self.core.output(id).is_empty() {
                self.flush(id);
            }
        }
        self.socks.clear();
    }

    /// Sends a SERVER_ANNOUNCE to every announce target.
    fn announce(&mut self, data: &[u8]) {
        let now = self.now();
        let Some(sock) = &self.udp else { return };
        for t in &self.targets {
            if let Err(e) = sock.send_to(data, t)
                && self
                    .send_log_at
                    .is_none_or(|at| now >= at + SEND_LOG_INTERVAL)
            {
                warn!("SERVER_ANNOUNCE to {t} failed: {e}");
                self.send_log_at = Some(now);
            }
        }
    }

    /// Reads and answers a status request between two events.
    fn on_status(&mut self, token: Token) {
        let (Some(slot), Some(status)) = (StatusListener::slot(token), self.status.as_mut()) else {
            return;
        };
        let now = elapsed(self.epoch);
        let (core, xds) = (&self.core, &self.xds);
        status.on_event(
            slot,
            self.poll.registry(),
            &mut self.read_buf,
            now,
            |path| match path {
                "/metrics" => {
                    let mut m = core.metrics(now);
                    m.xds = xds.as_ref().map(|f| f());
                    rserpool_status::Reply::metrics(m.metrics())
                }
                _ => rserpool_status::Reply::json(&status_document(core, xds, now)),
            },
        );
    }
}

/// The status document, with the xDS server's counters when it runs.
fn status_document(
    core: &Registrar,
    xds: &Option<XdsCounterSource>,
    now: Instant,
) -> crate::Status {
    let mut s = core.status(now);
    s.xds = xds.as_ref().map(|f| f());
    s
}

/// A registrar running on its own thread (for `rserpool up`, tests and embedding).
pub struct RegistrarThread {
    addr: SocketAddr,
    status: Option<SocketAddr>,
    enrp: Option<SocketAddr>,
    id: u32,
    stop: StopHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RegistrarThread {
    /// Binds and starts a registrar on a new thread; returns once it listens.
    pub fn start(cfg: Config) -> io::Result<Self> {
        let server = Server::bind(cfg)?;
        let (addr, status, enrp, id, stop) = (
            server.local_addr(),
            server.status_addr(),
            server.enrp_addr(),
            server.server_id(),
            server.stop_handle(),
        );
        let thread = std::thread::Builder::new()
            .name("registrar".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    warn!("registrar stopped: {e}");
                }
            })?;
        Ok(Self {
            addr,
            status,
            enrp,
            id,
            stop,
            thread: Some(thread),
        })
    }

    pub fn asap_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The ENRP address, if ENRP runs.
    pub fn enrp_addr(&self) -> Option<SocketAddr> {
        self.enrp
    }

    /// The status listener's address, if it runs.
    pub fn status_addr(&self) -> Option<SocketAddr> {
        self.status
    }

    pub fn server_id(&self) -> u32 {
        self.id
    }

    /// Stops the registrar and waits for its thread; its connections close.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RegistrarThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}
