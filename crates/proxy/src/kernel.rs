//! TCP mode's hand-over to the kernel splice (`splice = "kernel"`, crate `rserpool-ksplice`).
//!
//! Once a client's connection is connected to its PE, whatever either side sent first is
//! relayed here until both sockets are quiet (nothing unread, nothing unacknowledged); then
//! the connection goes to the eBPF datapath and the proxy's sockets close without a trace on
//! the wire. From then on the proxy can stop, crash or restart: the connection does not
//! notice. If the sockets do not go quiet within a second, or the hand-over fails, the
//! connection stays on the user-space path.

use rserpool_ksplice::{Datapath, HandOverError, hand_over, interface_towards, pending, unread};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::debug;

/// Longest relaying before a connection is handed over.
const QUIET_WITHIN: Duration = Duration::from_secs(1);

pub(crate) enum Handed {
    /// The kernel carries the connection now.
    Kernel,
    /// It stays here: the sockets, unchanged.
    Back(TcpStream, TcpStream),
}

pub(crate) async fn try_hand_over(
    mut client: TcpStream,
    mut backend: TcpStream,
    dp: &Arc<Mutex<Datapath>>,
) -> Handed {
    let towards = |a: std::io::Result<SocketAddr>| match a.map(|a| a.ip().to_canonical()) {
        Ok(IpAddr::V4(ip)) => interface_towards(ip).ok(),
        _ => None,
    };
    let (Some(client_if), Some(server_if)) =
        (towards(client.peer_addr()), towards(backend.peer_addr()))
    else {
        debug!("kernel splice: no IPv4 interface towards both ends; relaying in user space");
        return Handed::Back(client, backend);
    };
    let deadline = tokio::time::Instant::now() + QUIET_WITHIN;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let busy = pending(&client).unwrap_or(1) + pending(&backend).unwrap_or(1);
        if busy == 0 {
            let (Ok(a), Ok(b)) = (client.into_std(), backend.into_std()) else {
                // into_std only fails to deregister from the reactor: both are gone.
                return Handed::Kernel;
            };
            let handed = {
                let mut dp = dp.lock().unwrap_or_else(|p| p.into_inner());
                hand_over(&mut dp, a, b, client_if, server_if)
            };
            let (e, a, b) = match handed {
                Ok(s) => {
                    debug!("kernel splice: {} ↔ {} handed over", s.client, s.server);
                    return Handed::Kernel;
                }
                Err(v) => v,
            };
            match (TcpStream::from_std(a), TcpStream::from_std(b)) {
                (Ok(a), Ok(b)) => (client, backend) = (a, b),
                _ => return Handed::Kernel,
            }
            // Bytes arrived between the look and the hand-over: relay them and look again.
            if !matches!(e, HandOverError::NotQuiet(_)) {
                debug!("kernel splice: {e}; relaying in user space");
                return Handed::Back(client, backend);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            debug!("kernel splice: the sockets did not go quiet; relaying in user space");
            return Handed::Back(client, backend);
        }
        if !relay_unread(&client, &mut backend, &mut buf).await
            || !relay_unread(&backend, &mut client, &mut buf).await
        {
            return Handed::Back(client, backend);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Relays what `from` has received and not read to `to`; false when a side has closed or
/// failed (the connection then stays in user space, which sees it).
async fn relay_unread(from: &TcpStream, to: &mut TcpStream, buf: &mut [u8]) -> bool {
    if unread(from).unwrap_or(0) == 0 {
        return true;
    }
    match from.try_read(buf) {
        Ok(0) => false,
        Ok(n) => to.write_all(&buf[..n]).await.is_ok(),
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    }
}
