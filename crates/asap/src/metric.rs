//! The credit metric's kernel half: the accept queue of a listening TCP socket.
//!
//! - Of a socket the process holds ([`listen_queue`]): `TCP_INFO`. On a socket in LISTEN
//!   state Linux reports the connections waiting to be accepted in `tcpi_unacked` and the
//!   queue's limit (the `listen` backlog) in `tcpi_sacked`.
//! - Of another process's socket, by port ([`port_load`], for the `serve` sidecar): sock_diag
//!   netlink (`crate::sock_diag`); what a sidecar samples every few milliseconds is in
//!   `crate::port_sampler`.

use std::io;
use std::os::fd::BorrowedFd;

/// A listening socket's accept queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenQueue {
    /// Connections completed by the kernel, not yet accepted.
    pub waiting: u32,
    /// The queue's limit.
    pub limit: u32,
}

const TCP_LISTEN: u8 = 10;

/// The accept queue of the listening TCP socket `fd`.
pub fn listen_queue(fd: BorrowedFd<'_>) -> io::Result<ListenQueue> {
    // tcpi_unacked and tcpi_sacked lie well inside the oldest tcp_info.
    let info = rserpool_tcpinfo::tcp_info(&fd, 32)?;
    if info.tcpi_state != TCP_LISTEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a listening TCP socket",
        ));
    }
    Ok(ListenQueue {
        waiting: info.tcpi_unacked,
        limit: info.tcpi_sacked,
    })
}

pub use crate::sock_diag::{PortLoad, port_load};

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    #[test]
    fn connections_not_accepted_are_counted() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let q = listen_queue(l.as_fd()).unwrap();
        assert_eq!(q.waiting, 0);
        assert!(q.limit > 0);
        let clients: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        // The handshakes complete in the kernel before connect returns on loopback.
        assert_eq!(listen_queue(l.as_fd()).unwrap().waiting, 3);
        let (_a, _) = l.accept().unwrap();
        assert_eq!(listen_queue(l.as_fd()).unwrap().waiting, 2);
        drop(clients);
        let c = TcpStream::connect(addr).unwrap();
        assert!(
            listen_queue(c.as_fd()).is_err(),
            "a connected socket is refused"
        );
    }
}
