//! Where the registrars are: a configured list plus those heard in SERVER_ANNOUNCE.
//!
//! [`RegistrarSet`] is the sans-IO list the cores consult; [`AnnounceListener`] is the drivers'
//! UDP socket that hears the announces and hands them to a core.

use rserpool_wire::Message;
use rserpool_wire::{AsapMessage, Instant};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::UdpSocket;
use tracing::{debug, warn};

/// An announced registrar is forgotten after this long without a SERVER_ANNOUNCE.
pub const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);

/// The registrars a PE or PU may use.
#[derive(Debug, Default, Clone)]
pub struct RegistrarSet {
    configured: Vec<SocketAddr>,
    /// Server Identifier → where it was announced, and when last.
    announced: BTreeMap<u32, (SocketAddr, Instant)>,
}

impl RegistrarSet {
    pub fn new(configured: Vec<SocketAddr>) -> Self {
        Self {
            configured,
            announced: BTreeMap::new(),
        }
    }

    /// Candidates in order: configured ones, then those announced within [`ANNOUNCE_TIMEOUT`]
    /// of `now` and not already listed.
    pub fn candidates(&mut self, now: Instant) -> Vec<SocketAddr> {
        let mut out = self.configured.clone();
        self.announced
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ANNOUNCE_TIMEOUT);
        let mut heard: Vec<_> = self.announced.values().map(|(addr, _)| *addr).collect();
        heard.sort();
        for addr in heard {
            if !out.contains(&addr) {
                out.push(addr);
            }
        }
        out
    }

    /// Records a SERVER_ANNOUNCE datagram from `from`, received at `now`.
    pub fn heard_announce(&mut self, datagram: &[u8], from: SocketAddr, now: Instant) {
        let Ok(AsapMessage::ServerAnnounce {
            server_id,
            transports,
        }) = AsapMessage::decode(datagram)
        else {
            return;
        };
        let Some(mut addr) = transports.iter().find_map(|t| {
            matches!(t.protocol, rserpool_wire::Protocol::Tcp { .. })
                .then(|| t.socket_addrs().next())
                .flatten()
        }) else {
            return;
        };
        if addr.ip().is_unspecified() {
            // The registrar listens on all addresses: reach it where the announce came from.
            addr.set_ip(from.ip());
        }
        if self.announced.insert(server_id, (addr, now)).is_none() {
            debug!("registrar {server_id:#010x} announced at {addr}");
        }
    }
}

/// The newest datagram from each sender and when it arrived.
type Heard = BTreeMap<SocketAddr, (Vec<u8>, std::time::Instant)>;

/// Listens for SERVER_ANNOUNCE on a UDP address (joining the group if it is multicast) until
/// dropped; a driver passes what it heard to its core ([`drain`](Self::drain)).
pub struct AnnounceListener {
    heard: Arc<Mutex<Heard>>,
    task: tokio::task::JoinHandle<()>,
}

impl AnnounceListener {
    /// Starts listening (needs a tokio runtime).
    pub fn start(addr: SocketAddr) -> std::io::Result<Self> {
        let sock = announce_socket(addr)?;
        let heard = Arc::new(Mutex::new(Heard::new()));
        let keep = heard.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            loop {
                match sock.recv_from(&mut buf).await {
                    Ok((n, from)) => {
                        if let Ok(mut h) = keep.lock() {
                            h.insert(from, (buf[..n].to_vec(), std::time::Instant::now()));
                        }
                    }
                    Err(e) => {
                        warn!("announce listener on {addr}: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        Ok(Self { heard, task })
    }

    /// Every datagram heard since the last call: the datagram, its sender, and when it arrived
    /// on the clock whose origin is `epoch`.
    pub fn drain(&self, epoch: std::time::Instant) -> Vec<(Vec<u8>, SocketAddr, Instant)> {
        let heard = match self.heard.lock() {
            Ok(mut h) => std::mem::take(&mut *h),
            Err(_) => return Vec::new(),
        };
        heard
            .into_iter()
            .map(|(from, (datagram, at))| (datagram, from, Instant::since(epoch, at)))
            .collect()
    }
}

impl Drop for AnnounceListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A UDP socket for announces; several listeners may share the port (SO_REUSEADDR).
fn announce_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    match addr {
        SocketAddr::V4(v4) if v4.ip().is_multicast() => {
            sock.bind(&SocketAddr::from(([0, 0, 0, 0], v4.port())).into())?;
            sock.join_multicast_v4(v4.ip(), &std::net::Ipv4Addr::UNSPECIFIED)?;
        }
        SocketAddr::V6(v6) if v6.ip().is_multicast() => {
            sock.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, v6.port())).into())?;
            sock.join_multicast_v6(v6.ip(), 0)?;
        }
        _ => sock.bind(&addr.into())?,
    }
    UdpSocket::from_std(sock.into())
}

/// Registrar addresses as the cores keep them, and which of them are reached over SCTP.
pub fn split(
    registrars: &[rserpool_wire::Address],
) -> (
    Vec<SocketAddr>,
    std::collections::BTreeMap<SocketAddr, rserpool_wire::Scheme>,
) {
    let addrs = registrars.iter().map(|a| a.addr).collect();
    let schemes = registrars
        .iter()
        .filter(|a| a.scheme.is_sctp())
        .map(|a| (a.addr, a.scheme))
        .collect();
    (addrs, schemes)
}
