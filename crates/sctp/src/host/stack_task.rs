//! The task that runs a [`Stack`] on a tokio UDP or raw socket for a host: datagrams in and
//! out, the handles' commands, the stack's timers and events.

use super::Carrier;
use super::handle::{Association, Cmd};
use crate::assoc::Config;
use crate::recv::Message;
use crate::stack::{AssocId, Stack, StackEvent};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::time::Instant;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};

/// The task that owns the socket and the stack; it ends once the host and every association
/// handle are gone (it holds only a weak sender to its own commands, for the handles it makes).
pub(super) async fn run(
    socket: UdpSocket,
    carrier: Carrier,
    cfg: Config,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    handles: mpsc::WeakUnboundedSender<Cmd>,
    live: std::sync::Arc<std::sync::atomic::AtomicUsize>,
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
                    peer_port,
                } => {
                    let Some(cmd) = handles.upgrade() else { break };
                    let (a, tx) = Association::new(id, peer, (local_port, peer_port), cmd);
                    // Nobody accepting any more drops the handle: the association shuts down.
                    if let Some(Ok(())) = listeners.get(&local_port).map(|l| l.send(a)) {
                        conns.insert(id, (peer, tx));
                    }
                }
                StackEvent::Connected(id) => {
                    if let Some((peer, ports, done)) = connecting.remove(&id)
                        && let Some(cmd) = handles.upgrade()
                    {
                        let (a, tx) = Association::new(id, peer, ports, cmd);
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
                    if let Some((peer, (_, peer_port), done)) = connecting.remove(&id) {
                        let why = why.unwrap_or_else(|| "closed".into());
                        // `peer` is where the datagrams go (over UDP, the encapsulation port).
                        let _ = done.send(Err(io::Error::new(
                            io::ErrorKind::ConnectionRefused,
                            format!("no SCTP association with port {peer_port} at {peer}: {why}"),
                        )));
                    }
                }
            }
        }
        let now = Instant::now();
        while let Some((to, data)) = stack.poll_transmit(now) {
            // A datagram the socket refuses (an error) is lost like one on the path: SCTP sends
            // it again. One that meets no write readiness waits for it: a socket new to the
            // reactor has none yet, and its first INIT, dropped so, waited out the 1 s
            // retransmission timer; a full send buffer holds the task until there is room.
            let sent = match socket.try_send_to(&data, to) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    socket.send_to(&data, to).await.map(|_| ())
                }
                r => r.map(|_| ()),
            };
            if let Err(e) = sent {
                tracing::debug!("SCTP to {to}: {e}");
            }
        }
        live.store(stack.len(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// An association opening: the peer, our SCTP port and its, and who waits for it.
type Connecting = (
    SocketAddr,
    (u16, u16),
    oneshot::Sender<io::Result<Association>>,
);

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
            connecting.insert(id, (peer, (local_port, peer_port), done));
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
