//! A registrar association over SCTP for the pool element and pool user drivers (RFC 5352:
//! ASAP over SCTP, PPID 11), where the registrar's address says `sctp+udp://` or `sctp://`.
//!
//! The cores speak in bytes as over TCP: each SCTP message read is handed over whole, and what
//! a core transmits (messages back to back) is cut into one SCTP message each. The association
//! runs on the process's SCTP host (`rserpool_sctp::host`): over UDP it binds port 9899 (rsplib's
//! stack answers to that port only), or an ephemeral port when another process has 9899; on IP
//! (`sctp://`) it is the kernel's SCTP where the kernel has it, else ours on a raw socket.

use crate::core::ConnId;
use crate::link::{ConnEvent, Out};
use bytes::Bytes;
pub use rserpool_sctp::host::{Association, Carrier, Host, settle};
use rserpool_wire::{ASAP_PPID, Address, Scheme};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The process's SCTP host for reaching `to`.
pub fn host_for(to: &Address) -> io::Result<(Arc<Host>, SocketAddr)> {
    let any: IpAddr = if to.addr.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    match to.scheme {
        Scheme::SctpUdp { udp_port } => {
            let peer = SocketAddr::new(to.addr.ip(), udp_port);
            let host = match Host::shared(Carrier::Udp, SocketAddr::new(any, udp_port)) {
                Ok(h) => h,
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                    // Asked for at every association: said once.
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(
                            "UDP port {udp_port} is taken on this host: SCTP over UDP from an \
                             ephemeral port (rsplib's peers answer to port {udp_port} only)"
                        )
                    });
                    Host::shared(Carrier::Udp, SocketAddr::new(any, 0))?
                }
                Err(e) => return Err(e),
            };
            Ok((host, peer))
        }
        // The kernel's SCTP where it has it, else ours on a raw socket.
        Scheme::Sctp => Ok((
            Host::shared(Carrier::ip(to.addr.is_ipv4()), SocketAddr::new(any, 0))?,
            SocketAddr::new(to.addr.ip(), 0),
        )),
        Scheme::Tcp => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{to} is not an SCTP address"),
        )),
    }
}

/// Opens an association with the ASAP or ENRP speaker at `to`.
pub async fn connect(to: &Address) -> io::Result<Association> {
    let (host, peer) = host_for(to)?;
    host.connect_ephemeral(peer, to.addr.port()).await
}

/// One registrar association: connects, then carries messages both ways until either end
/// closes. Like the TCP connections' task in `driver.rs`, it reports to `events`. With
/// `takeovers`, associations that a registrar taking over opens to the port of this one (where
/// registrars reach a PE that registered over SCTP) are handed there.
pub(crate) async fn serve(
    id: ConnId,
    to: Address,
    mut rx: mpsc::UnboundedReceiver<Out>,
    events: mpsc::UnboundedSender<ConnEvent>,
    takeovers: Option<mpsc::UnboundedSender<Association>>,
) {
    let r = tokio::select! {
        r = connect(&to) => r,
        // Closed by the core (or it ended) before the association was up.
        _ = rx.recv() => return,
    };
    let assoc = match r {
        Ok(a) => a,
        Err(e) => {
            let _ = events.send(ConnEvent::ConnectFailed(id, e));
            return;
        }
    };
    if let Some(t) = takeovers {
        listen_for_takeovers(&to, assoc.local_port(), t);
    }
    let _ = events.send(ConnEvent::Connected(id));
    relay(id, assoc, rx, events).await;
}

/// Hands associations opened to our port `port` (on the host that reaches `to`) to `takeovers`.
fn listen_for_takeovers(to: &Address, port: u16, takeovers: mpsc::UnboundedSender<Association>) {
    let accepted = host_for(to).and_then(|(host, _)| host.listen(port));
    match accepted {
        Ok(mut accepted) => {
            tokio::spawn(async move {
                while let Some(a) = accepted.recv().await {
                    if takeovers.send(a).is_err() {
                        return;
                    }
                }
            });
        }
        Err(e) => tracing::warn!("no takeovers over SCTP at port {port}: {e}"),
    }
}

/// Carries ASAP messages both ways over `assoc` until either end closes.
pub(crate) async fn relay(
    id: ConnId,
    mut assoc: Association,
    mut rx: mpsc::UnboundedReceiver<Out>,
    events: mpsc::UnboundedSender<ConnEvent>,
) {
    let peer = assoc.peer();
    let mut unsent: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            m = assoc.recv() => match m {
                Some(m) if m.ppid == ASAP_PPID => {
                    let _ = events.send(ConnEvent::Data(id, m.data.to_vec()));
                }
                Some(m) => tracing::debug!("{peer}: ignored a message with PPID {}", m.ppid),
                None => {
                    let _ = events.send(ConnEvent::Closed(id));
                    return;
                }
            },
            o = rx.recv() => match o {
                Some(Out::Bytes(b)) => {
                    unsent.extend_from_slice(&b);
                    while let Some(n) = rserpool_wire::framer::first_message_len(&unsent) {
                        let msg = for_sctp(&unsent[..n]);
                        unsent.drain(..n);
                        if assoc.send(0, ASAP_PPID, msg).is_err() {
                            let _ = events.send(ConnEvent::Closed(id));
                            return;
                        }
                    }
                }
                // An SCTP association cannot move to another process: not released (the
                // requester gets nothing back), served on.
                Some(Out::Release(_)) => {}
                // Dropping the association shuts it down gracefully.
                Some(Out::Close) | None => return,
            },
        }
    }
}

/// A message as it goes over SCTP: a REGISTRATION's Registration Life in milliseconds
/// (`rserpool_wire::sctp_life`), anything else as it is.
pub(crate) fn for_sctp(msg: &[u8]) -> Bytes {
    use rserpool_wire::{AsapMessage, Message};
    // Only a REGISTRATION carries a lifetime: anything else goes as it is, undecoded.
    if msg.first() != Some(&rserpool_wire::asap::msg_type::REGISTRATION) {
        return Bytes::copy_from_slice(msg);
    }
    if let Ok(AsapMessage::Registration {
        pool_handle,
        mut pool_element,
    }) = AsapMessage::decode(msg)
    {
        pool_element.registration_life =
            rserpool_wire::sctp_life::to_sctp(pool_element.registration_life);
        let m = AsapMessage::Registration {
            pool_handle,
            pool_element,
        };
        if let Ok(b) = m.to_bytes() {
            return Bytes::from(b);
        }
    }
    Bytes::copy_from_slice(msg)
}
