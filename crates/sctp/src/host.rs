//! The stack on a tokio socket: SCTP over UDP (RFC 6951) or on a raw IP socket, shared by every
//! association of a process that goes through that socket.
//!
//! Why shared: SCTP over UDP puts every association of a host behind one UDP port (9899), and
//! rsplib's stack answers to that port only; a pool element's association with its registrar
//! and its pool users' associations with it all travel through the same socket. One task owns
//! the socket and the [`Stack`]; associations are handles that talk to it over channels.
//! [`Host::shared`] gives the process's host for a local address, starting it on first use.

use crate::assoc::Config;
use crate::recv::Message;
use crate::stack::{AssocId, Stack, StackEvent};
use bytes::Bytes;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};

/// How long [`Host::connect`] waits for the handshake at most (the stack gives up sooner when
/// its INIT retransmissions run out).
const CONNECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What the socket carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Carrier {
    /// SCTP over UDP.
    Udp,
    /// SCTP as IP protocol 132 on a raw socket (root).
    RawIp,
}

enum Cmd {
    Connect {
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
        done: oneshot::Sender<io::Result<Association>>,
    },
    Listen {
        port: u16,
        accepted: mpsc::UnboundedSender<Association>,
    },
    Send {
        id: AssocId,
        stream: u16,
        ppid: u32,
        data: Bytes,
    },
    Shutdown(AssocId),
    Abort(AssocId),
}

/// One socket with its stack, run by a task.
pub struct Host {
    cmd: mpsc::UnboundedSender<Cmd>,
    local: SocketAddr,
    /// The next ephemeral SCTP port to try (49152–65535, from a random start).
    next_port: AtomicU16,
}

/// An association of a [`Host`]: messages out with [`send`](Self::send), in with
/// [`recv`](Self::recv). Dropping it shuts the association down.
pub struct Association {
    id: AssocId,
    peer: SocketAddr,
    local_port: u16,
    cmd: mpsc::UnboundedSender<Cmd>,
    rx: mpsc::UnboundedReceiver<Message>,
    ended: bool,
}

impl Association {
    /// A handle, and where the host sends its messages.
    fn new(
        id: AssocId,
        peer: SocketAddr,
        local_port: u16,
        cmd: mpsc::UnboundedSender<Cmd>,
    ) -> (Self, mpsc::UnboundedSender<Message>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let a = Association {
            id,
            peer,
            local_port,
            cmd,
            rx,
            ended: false,
        };
        (a, tx)
    }

    /// The peer's address (with its UDP port, or 0 on raw IP).
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Our SCTP port of the association.
    pub fn local_port(&self) -> u16 {
        self.local_port
    }

    /// Queues a message; an error once the association has ended.
    pub fn send(&self, stream: u16, ppid: u32, data: Bytes) -> io::Result<()> {
        self.cmd
            .send(Cmd::Send {
                id: self.id,
                stream,
                ppid,
                data,
            })
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the SCTP host stopped"))
    }

    /// The next message; `None` once the association has ended.
    pub async fn recv(&mut self) -> Option<Message> {
        let m = self.rx.recv().await;
        self.ended |= m.is_none();
        m
    }

    /// Ends the association at once with an ABORT.
    pub fn abort(mut self) {
        let _ = self.cmd.send(Cmd::Abort(self.id));
        self.ended = true;
    }
}

impl Drop for Association {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.cmd.send(Cmd::Shutdown(self.id));
        }
    }
}

/// Hosts live as long as the process: an association may outlast every user of its host, and
/// a new host could not bind the socket the old one's task still holds.
type Registry = Mutex<HashMap<(Carrier, SocketAddr), Arc<Host>>>;

fn registry() -> &'static Registry {
    static HOSTS: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    HOSTS.get_or_init(Default::default)
}

impl Host {
    /// The process's host on `local` (a UDP address for [`Carrier::Udp`], an IP address with
    /// port 0 for [`Carrier::RawIp`]), started now if there is none.
    pub fn shared(carrier: Carrier, local: SocketAddr) -> io::Result<Arc<Host>> {
        let mut hosts = registry().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = hosts.get(&(carrier, local)) {
            return Ok(h.clone());
        }
        let h = Arc::new(Self::start(carrier, local)?);
        hosts.insert((carrier, local), h.clone());
        Ok(h)
    }

    /// A host of its own on `local` (needs a tokio runtime).
    pub fn start(carrier: Carrier, local: SocketAddr) -> io::Result<Host> {
        let socket = match carrier {
            Carrier::Udp => crate::socket::udp(local)?,
            Carrier::RawIp => crate::socket::raw(local)?,
        };
        let local = socket.local_addr().unwrap_or(local);
        let socket = UdpSocket::from_std(socket)?;
        let (cmd, rx) = mpsc::unbounded_channel();
        let cfg = Config {
            local_addresses: crate::socket::local_addresses(local),
            ..Config::default()
        };
        tokio::spawn(run(socket, carrier, cfg, rx, cmd.downgrade()));
        let start = {
            use rand_core::{OsRng, TryRngCore};
            OsRng.try_next_u32().unwrap_or(std::process::id()) as u16
        };
        Ok(Host {
            cmd,
            local,
            next_port: AtomicU16::new(start),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Opens an association from SCTP port `local_port` to `peer_port` at `peer` (a UDP
    /// address, or an IP address with port 0 on raw IP).
    pub async fn connect(
        &self,
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
    ) -> io::Result<Association> {
        let (done, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Connect {
                peer,
                local_port,
                peer_port,
                done,
            })
            .map_err(|_| io::Error::other("the SCTP host stopped"))?;
        match tokio::time::timeout(CONNECT_LIMIT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(io::Error::other("the SCTP host stopped")),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no SCTP association with {peer} (port {peer_port}) in {CONNECT_LIMIT:?}"),
            )),
        }
    }

    /// [`connect`](Self::connect) from an ephemeral SCTP port.
    pub async fn connect_ephemeral(
        &self,
        peer: SocketAddr,
        peer_port: u16,
    ) -> io::Result<Association> {
        let n = self.next_port.fetch_add(1, Ordering::Relaxed);
        self.connect(peer, 49152 + n % 16384, peer_port).await
    }

    /// Accepts associations to SCTP port `port`; they arrive on the returned channel.
    pub fn listen(&self, port: u16) -> io::Result<mpsc::UnboundedReceiver<Association>> {
        let (accepted, rx) = mpsc::unbounded_channel();
        self.cmd
            .send(Cmd::Listen { port, accepted })
            .map_err(|_| io::Error::other("the SCTP host stopped"))?;
        Ok(rx)
    }
}

/// The task that owns the socket and the stack; it ends once the host and every association
/// handle are gone (it holds only a weak sender to its own commands, for the handles it makes).
async fn run(
    socket: UdpSocket,
    carrier: Carrier,
    cfg: Config,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    handles: mpsc::WeakUnboundedSender<Cmd>,
) {
    let mut stack = Stack::with_os_randomness(cfg, Instant::now());
    let mut conns: HashMap<AssocId, (SocketAddr, mpsc::UnboundedSender<Message>)> = HashMap::new();
    let mut connecting: HashMap<AssocId, Connecting> = HashMap::new();
    let mut listeners: HashMap<u16, mpsc::UnboundedSender<Association>> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let timeout = stack.poll_timeout();
        let sleep = async {
            match timeout {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = socket.recv_from(&mut buf) => match r {
                Ok((n, from)) => {
                    let raw = carrier == Carrier::RawIp;
                    let (packet, from) = crate::socket::payload(&buf, n, from, raw);
                    stack.handle_datagram(from, packet, Instant::now());
                }
                Err(e) => tracing::debug!("SCTP host: {e}"),
            },
            c = cmds.recv() => match c {
                Some(c) => command(c, &mut stack, &mut connecting, &mut listeners),
                // Every handle and the host are gone.
                None => break,
            },
            () = sleep => stack.handle_timeout(Instant::now()),
        }
        while let Some(ev) = stack.poll_event() {
            match ev {
                StackEvent::Accepted {
                    id,
                    peer,
                    local_port,
                    ..
                } => {
                    let Some(cmd) = handles.upgrade() else { break };
                    let (a, tx) = Association::new(id, peer, local_port, cmd);
                    // Nobody accepting any more drops the handle: the association shuts down.
                    if let Some(Ok(())) = listeners.get(&local_port).map(|l| l.send(a)) {
                        conns.insert(id, (peer, tx));
                    }
                }
                StackEvent::Connected(id) => {
                    if let Some((peer, local_port, done)) = connecting.remove(&id)
                        && let Some(cmd) = handles.upgrade()
                    {
                        let (a, tx) = Association::new(id, peer, local_port, cmd);
                        if done.send(Ok(a)).is_ok() {
                            conns.insert(id, (peer, tx));
                        }
                    }
                }
                StackEvent::Message(id, m) => {
                    // A handle being dropped misses it; its shutdown is on its way.
                    if let Some((_, tx)) = conns.get(&id) {
                        let _ = tx.send(m);
                    }
                }
                StackEvent::Path(id, e) => tracing::info!("SCTP association {}: {e}", id.0),
                StackEvent::Closed(id, why) => {
                    conns.remove(&id);
                    if let Some((peer, _, done)) = connecting.remove(&id) {
                        let why = why.unwrap_or_else(|| "closed".into());
                        let _ = done.send(Err(io::Error::new(
                            io::ErrorKind::ConnectionRefused,
                            format!("no SCTP association with {peer}: {why}"),
                        )));
                    }
                }
            }
        }
        let now = Instant::now();
        while let Some((to, data)) = stack.poll_transmit(now) {
            // A datagram the socket refuses is lost like one on the path: SCTP sends it again.
            if let Err(e) = socket.try_send_to(&data, to)
                && e.kind() != io::ErrorKind::WouldBlock
            {
                tracing::debug!("SCTP to {to}: {e}");
            }
        }
    }
}

/// An association opening: the peer, our port, and who waits for it.
type Connecting = (SocketAddr, u16, oneshot::Sender<io::Result<Association>>);

fn command(
    c: Cmd,
    stack: &mut Stack,
    connecting: &mut HashMap<AssocId, Connecting>,
    listeners: &mut HashMap<u16, mpsc::UnboundedSender<Association>>,
) {
    match c {
        Cmd::Connect {
            peer,
            local_port,
            peer_port,
            done,
        } => {
            let id = stack.connect(peer, local_port, peer_port, Instant::now());
            connecting.insert(id, (peer, local_port, done));
        }
        Cmd::Listen { port, accepted } => {
            stack.listen(port);
            listeners.insert(port, accepted);
        }
        Cmd::Send {
            id,
            stream,
            ppid,
            data,
        } => {
            let _ = stack.send(id, stream, ppid, data);
        }
        Cmd::Shutdown(id) => stack.shutdown(id, Instant::now()),
        Cmd::Abort(id) => stack.abort(id, "aborted by this end"),
    }
}
