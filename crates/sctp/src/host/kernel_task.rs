//! Associations of a [`Host`](super::Host) on the kernel's SCTP: a one-to-one socket each,
//! run by a task that takes the handle's commands and hands its messages over, as the
//! stack's task does for the user-space stack. Not run by this project's tests: its
//! machines have no kernel SCTP (docs/SCTP.md).
//!
//! The sockets sit on tokio's reactor as a `TcpStream` and `TcpListener` would: a
//! one-to-one SCTP socket takes the same readiness, `accept`, `getpeername` and `shutdown`;
//! messages go through `sendmsg` and `recvmsg` on the same descriptor (`SockRef`).

use super::handle::{Association, Cmd};
use crate::kernel;
use crate::recv::Message;
use crate::stack::AssocId;
use bytes::Bytes;
use socket2::{SockRef, Socket};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// The largest message taken (ASAP and ENRP messages are far smaller).
const MAX_MESSAGE: usize = 1 << 20;

/// How long a closing association waits for the peer's end of the shutdown.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

/// Opens an association from `from` (port 0: any) to `to`, up within `limit`.
pub(super) async fn connect(
    from: SocketAddr,
    to: SocketAddr,
    limit: Duration,
) -> io::Result<Association> {
    let fd = register(kernel::connect(from, to)?)?;
    let up = async {
        loop {
            fd.writable().await?;
            match fd.take_error()? {
                Some(e) => return Err(e),
                None if fd.peer_addr().is_ok() => return Ok(()),
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    };
    match tokio::time::timeout(limit, up).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no SCTP association with {to} in {limit:?}"),
            ));
        }
    }
    Ok(spawn(fd, to))
}

/// Accepts associations at `at` into `accepted` until nobody takes them.
pub(super) fn listen(
    at: SocketAddr,
    accepted: mpsc::UnboundedSender<Association>,
) -> io::Result<()> {
    let l = TcpListener::from_std(std::net::TcpListener::from(kernel::listen(at)?))?;
    tokio::spawn(async move {
        loop {
            match l.accept().await {
                Ok((s, peer)) => {
                    let fd = s
                        .into_std()
                        .map(Socket::from)
                        .and_then(kernel::accepted)
                        .and_then(register);
                    if let Ok(fd) = fd
                        && accepted.send(spawn(fd, peer)).is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!("SCTP accept at {at}: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(())
}

/// A non-blocking socket on tokio's reactor.
fn register(s: Socket) -> io::Result<TcpStream> {
    TcpStream::from_std(std::net::TcpStream::from(s))
}

/// The handle of an association on `fd` with `peer` (its address and SCTP port), its task
/// started.
fn spawn(fd: TcpStream, peer: SocketAddr) -> Association {
    let local_port = fd.local_addr().map_or(0, |a| a.port());
    let (cmd, cmds) = mpsc::unbounded_channel();
    let ports = (local_port, peer.port());
    // Named as on raw IP: the address, port 0.
    let peer = SocketAddr::new(peer.ip(), 0);
    let (a, tx) = Association::new(AssocId(0), peer, ports, cmd);
    tokio::spawn(run(fd, cmds, tx));
    a
}

/// Carries one association until either end closes it.
async fn run(
    fd: TcpStream,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    tx: mpsc::UnboundedSender<Message>,
) {
    let mut out: VecDeque<(u16, u32, Bytes)> = VecDeque::new();
    // What has arrived of the next message; empty (no memory) between messages.
    let mut partial: Vec<u8> = Vec::new();
    let mut closing = false;
    loop {
        tokio::select! {
            r = fd.readable() => {
                if r.is_err() || !receive(&fd, &mut partial, &tx) {
                    return;
                }
            }
            c = cmds.recv(), if !closing => match c {
                Some(Cmd::Send { stream, ppid, data, .. }) => out.push_back((stream, ppid, data)),
                Some(Cmd::Abort(_)) => {
                    // Closed with a zero linger: the kernel sends an ABORT.
                    let _ = SockRef::from(&fd).set_linger(Some(Duration::ZERO));
                    return;
                }
                Some(Cmd::Shutdown(_)) | None => closing = true,
                Some(Cmd::Connect { .. } | Cmd::Listen { .. }) => {}
            },
            r = fd.writable(), if !out.is_empty() => {
                if r.is_err() {
                    return;
                }
                while let Some((stream, ppid, data)) = out.front() {
                    let sent = fd.try_io(tokio::io::Interest::WRITABLE, || {
                        kernel::send(&SockRef::from(&fd), *stream, *ppid, data)
                    });
                    match sent {
                        Ok(()) => {
                            out.pop_front();
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            tracing::debug!("SCTP: {e}");
                            return;
                        }
                    }
                }
            }
        }
        if closing && out.is_empty() {
            // SHUTDOWN once everything is sent; the peer's end is read until it closes.
            let _ = SockRef::from(&fd).shutdown(std::net::Shutdown::Write);
            let _ = tokio::time::timeout(SHUTDOWN_LIMIT, async {
                while fd.readable().await.is_ok() && receive(&fd, &mut partial, &tx) {}
            })
            .await;
            return;
        }
    }
}

/// Reads what `fd` has into `partial`, handing each whole message to `tx`; false once the
/// association has ended (or sent a message over [`MAX_MESSAGE`], then aborted).
fn receive(fd: &TcpStream, partial: &mut Vec<u8>, tx: &mpsc::UnboundedSender<Message>) -> bool {
    /// Read at a time: most ASAP and ENRP messages fit, larger ones take several reads.
    const PIECE: usize = 4096;
    loop {
        let at = partial.len();
        partial.resize(at + PIECE, 0);
        let got = fd.try_io(tokio::io::Interest::READABLE, || {
            kernel::recv(&SockRef::from(fd), &mut partial[at..])
        });
        partial.truncate(at + got.as_ref().map_or(0, |p| p.len));
        match got {
            Ok(p) if p.len == 0 => return false,
            Ok(p) => {
                if partial.len() > MAX_MESSAGE {
                    tracing::debug!("SCTP: a message over {MAX_MESSAGE} bytes");
                    let _ = SockRef::from(fd).set_linger(Some(Duration::ZERO));
                    return false;
                }
                if p.end {
                    let (stream, ppid) = p.info.unwrap_or_default();
                    let data = Bytes::from(std::mem::take(partial));
                    let _ = tx.send(Message {
                        stream,
                        ppid,
                        unordered: false,
                        data,
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if partial.is_empty() {
                    // No allocation kept between messages.
                    *partial = Vec::new();
                }
                return true;
            }
            Err(e) => {
                tracing::debug!("SCTP: {e}");
                return false;
            }
        }
    }
}
