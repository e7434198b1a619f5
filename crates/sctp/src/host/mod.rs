//! The stack on a tokio socket: SCTP over UDP (RFC 6951) or on a raw IP socket, shared by every
//! association of a process that goes through that socket.
//!
//! Why shared: SCTP over UDP puts every association of a host behind one UDP port (9899), and
//! rsplib's stack answers to that port only; a pool element's association with its registrar
//! and its pool users' associations with it all travel through the same socket. One task owns
//! the socket and the stack (`stack_task.rs`); associations are handles that talk to it over
//! channels (`handle.rs`). [`Host::shared`] gives the process's host for a local address,
//! starting it on first use.
//!
//! On a host whose kernel has SCTP, [`Carrier::Kernel`] gives the same handles over the
//! kernel's one-to-one sockets instead (`kernel_task.rs`), a task per association;
//! [`Carrier::ip`] picks it for `sctp://` where the kernel has SCTP and the raw socket where
//! it has none. [`Bridge`] runs a host on a thread of its own for an event loop that is not
//! tokio's (the registrar's, for the kernel's SCTP).

mod bridge;
mod handle;
mod kernel_task;
mod stack_task;

use crate::assoc::Config;
pub use bridge::Bridge;
pub use handle::Association;
use handle::Cmd;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
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
    /// SCTP as IP protocol 132 on a raw socket (root), where the kernel has no SCTP.
    RawIp,
    /// The kernel's SCTP, one-to-one sockets.
    Kernel,
}

impl Carrier {
    /// SCTP as IP protocol 132 for `family`: the kernel's where it has SCTP, else ours on a
    /// raw socket (said once in the log).
    pub fn ip(ipv4: bool) -> Carrier {
        if crate::kernel::available(ipv4) {
            return Carrier::Kernel;
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::info!(
                "this kernel has no SCTP: sctp:// runs on rserpool's own SCTP over a raw IP \
                 socket (root)"
            );
        });
        Carrier::RawIp
    }
}

/// One socket with its stack, run by a task; or the kernel's SCTP.
pub struct Host {
    /// To the stack's task (none with the kernel's SCTP).
    cmd: Option<mpsc::UnboundedSender<Cmd>>,
    local: SocketAddr,
    /// The next ephemeral SCTP port to try (49152–65535, from a random start).
    next_port: AtomicU16,
    /// Associations the stack holds, closing ones too (kept by its task).
    live: Arc<std::sync::atomic::AtomicUsize>,
}

/// Waits until the associations of every host of the process have ended, at most `limit`:
/// for a process about to exit, whose dropped associations are still shutting down (their
/// SHUTDOWN, SHUTDOWN ACK and SHUTDOWN COMPLETE take a round trip or two). Exiting first
/// leaves the peer to find out by retransmitting into silence, for many seconds.
pub async fn settle(limit: std::time::Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let live: usize = registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|h| h.live.load(Ordering::Relaxed))
            .sum();
        if live == 0 || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
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
            Carrier::Kernel => {
                return Ok(Host {
                    cmd: None,
                    local,
                    next_port: AtomicU16::new(0),
                    live: Arc::default(),
                });
            }
        };
        let local = socket.local_addr().unwrap_or(local);
        let socket = UdpSocket::from_std(socket)?;
        let (cmd, rx) = mpsc::unbounded_channel();
        let cfg = Config {
            local_addresses: crate::socket::local_addresses(local),
            ..Config::default()
        };
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        tokio::spawn(stack_task::run(
            socket,
            carrier,
            cfg,
            rx,
            cmd.downgrade(),
            live.clone(),
        ));
        let start = {
            use rand_core::{OsRng, TryRngCore};
            OsRng.try_next_u32().unwrap_or(std::process::id()) as u16
        };
        Ok(Host {
            cmd: Some(cmd),
            local,
            next_port: AtomicU16::new(start),
            live,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Opens an association from SCTP port `local_port` to `peer_port` at `peer` (a UDP
    /// address, or an IP address with port 0 on raw IP and the kernel's SCTP).
    pub async fn connect(
        &self,
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
    ) -> io::Result<Association> {
        let Some(cmd) = &self.cmd else {
            let from = SocketAddr::new(self.local.ip(), local_port);
            let to = SocketAddr::new(peer.ip(), peer_port);
            return kernel_task::connect(from, to, CONNECT_LIMIT).await;
        };
        let (done, rx) = oneshot::channel();
        cmd.send(Cmd::Connect {
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
                format!("no SCTP association with port {peer_port} at {peer} in {CONNECT_LIMIT:?}"),
            )),
        }
    }

    /// [`connect`](Self::connect) from an ephemeral SCTP port.
    pub async fn connect_ephemeral(
        &self,
        peer: SocketAddr,
        peer_port: u16,
    ) -> io::Result<Association> {
        if self.cmd.is_none() {
            // The kernel picks it.
            return self.connect(peer, 0, peer_port).await;
        }
        let n = self.next_port.fetch_add(1, Ordering::Relaxed);
        self.connect(peer, 49152 + n % 16384, peer_port).await
    }

    /// Accepts associations to SCTP port `port`; they arrive on the returned channel.
    pub fn listen(&self, port: u16) -> io::Result<mpsc::UnboundedReceiver<Association>> {
        let (accepted, rx) = mpsc::unbounded_channel();
        let Some(cmd) = &self.cmd else {
            kernel_task::listen(SocketAddr::new(self.local.ip(), port), accepted)?;
            return Ok(rx);
        };
        cmd.send(Cmd::Listen { port, accepted })
            .map_err(|_| io::Error::other("the SCTP host stopped"))?;
        Ok(rx)
    }
}
