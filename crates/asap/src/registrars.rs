//! Where the registrars are: a configured list plus those heard in SERVER_ANNOUNCE.

use rserpool_wire::AsapMessage;
use rserpool_wire::Message;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::UdpSocket;
use tracing::{debug, warn};

/// An announced registrar is forgotten after this long without a SERVER_ANNOUNCE.
pub const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);

/// The registrars a PE or PU may use.
#[derive(Debug, Default)]
pub struct RegistrarSet {
    configured: Vec<SocketAddr>,
    announced: Mutex<HashMap<u32, (SocketAddr, Instant)>>,
}

impl RegistrarSet {
    pub fn new(configured: Vec<SocketAddr>) -> Arc<Self> {
        Arc::new(Self {
            configured,
            announced: Mutex::new(HashMap::new()),
        })
    }

    /// Candidates in order: configured ones, then recently announced ones not already listed.
    pub fn candidates(&self) -> Vec<SocketAddr> {
        let mut out = self.configured.clone();
        if let Ok(mut a) = self.announced.lock() {
            a.retain(|_, (_, at)| at.elapsed() < ANNOUNCE_TIMEOUT);
            let mut heard: Vec<_> = a.values().map(|(addr, _)| *addr).collect();
            heard.sort();
            for addr in heard {
                if !out.contains(&addr) {
                    out.push(addr);
                }
            }
        }
        out
    }

    /// Records a SERVER_ANNOUNCE datagram from `from`.
    pub fn heard_announce(&self, datagram: &[u8], from: SocketAddr) {
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
        if let Ok(mut a) = self.announced.lock()
            && a.insert(server_id, (addr, Instant::now())).is_none()
        {
            debug!("registrar {server_id:#010x} announced at {addr}");
        }
    }

    /// Listens for SERVER_ANNOUNCE on `addr` (joining the group if it is multicast) until the
    /// returned task is dropped or aborted.
    pub fn listen(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let sock = announce_socket(addr)?;
        let set = self.clone();
        Ok(tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            loop {
                match sock.recv_from(&mut buf).await {
                    Ok((n, from)) => set.heard_announce(&buf[..n], from),
                    Err(e) => {
                        warn!("announce listener on {addr}: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }))
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
