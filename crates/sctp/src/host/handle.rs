//! What a user of a [`Host`](super::Host) holds: an association handle, and the commands it
//! sends to the task that runs the association (the stack's task, or a kernel socket's).

use crate::recv::Message;
use crate::stack::AssocId;
use bytes::Bytes;
use std::io;
use std::net::SocketAddr;
use tokio::sync::{mpsc, oneshot};

pub(super) enum Cmd {
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

/// An association of a [`Host`]: messages out with [`send`](Self::send), in with
/// [`recv`](Self::recv). Dropping it shuts the association down.
pub struct Association {
    id: AssocId,
    peer: SocketAddr,
    local_port: u16,
    peer_port: u16,
    cmd: mpsc::UnboundedSender<Cmd>,
    rx: mpsc::UnboundedReceiver<Message>,
    ended: bool,
}

impl Association {
    /// A handle, and where the host sends its messages; `ports`: our SCTP port and the
    /// peer's.
    pub(super) fn new(
        id: AssocId,
        peer: SocketAddr,
        ports: (u16, u16),
        cmd: mpsc::UnboundedSender<Cmd>,
    ) -> (Self, mpsc::UnboundedSender<Message>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let a = Association {
            id,
            peer,
            local_port: ports.0,
            peer_port: ports.1,
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

    /// The peer's SCTP port.
    pub fn peer_port(&self) -> u16 {
        self.peer_port
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
