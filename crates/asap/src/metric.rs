//! The credit metric's kernel half: the accept queue of a listening TCP socket.
//!
//! - Of a socket the process holds ([`listen_queue`]): `TCP_INFO`. On a socket in LISTEN
//!   state Linux reports the connections waiting to be accepted in `tcpi_unacked` and the
//!   queue's limit (the `listen` backlog) in `tcpi_sacked`.
//! - Of another process's socket, by port ([`port_load`], for the `serve` sidecar): one
//!   sock_diag netlink dump (`SOCK_DIAG_BY_FAMILY`) of the LISTEN and ESTABLISHED TCP sockets;
//!   for a listener `idiag_rqueue` is the accept queue and `idiag_wqueue` its limit.
//!
//! Either is one system call or round trip per sample, no text to parse: cheap enough to
//! sample every few milliseconds.

use std::io;
use std::net::SocketAddr;
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

/// A listening port's load as the kernel sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortLoad {
    /// Connections waiting in the accept queue(s) of the port's listener(s).
    pub backlog: u32,
    /// The accept queue's limit (of the largest listener).
    pub limit: u32,
    /// Established connections on the port.
    pub established: u32,
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const TCP_ESTABLISHED: u8 = 1;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_msg`: family, state, timer, retrans, the socket id (48 bytes), expires,
/// rqueue, wqueue, uid, inode.
const INET_DIAG_MSG: usize = 72;
const INET_DIAG_REQ_BYTECODE: u16 = 1;
const INET_DIAG_BC_S_EQ: u8 = 11;

/// The accept queue and established connections of the TCP port `addr.port()` in this network
/// namespace, IPv4 and IPv6 (a dual-stack listener serves both); `Ok(None)` when nothing
/// listens on it.
pub fn port_load(addr: SocketAddr) -> io::Result<Option<PortLoad>> {
    use rustix::net::{AddressFamily, SocketType, netlink};
    let sock = rustix::net::socket(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        Some(netlink::SOCK_DIAG),
    )?;
    let mut load = PortLoad::default();
    let mut listening = false;
    for family in [libc::AF_INET, libc::AF_INET6] {
        listening |= dump(&sock, family as u8, addr.port(), &mut load)?;
    }
    Ok(listening.then_some(load))
}

/// Adds the sockets of `family` on `port` to `load`; true if one of them listens.
fn dump(
    sock: &std::os::fd::OwnedFd,
    family: u8,
    port: u16,
    load: &mut PortLoad,
) -> io::Result<bool> {
    use rustix::net::{SendFlags, netlink};
    // nlmsghdr, inet_diag_req_v2 with an all-zero socket id, then an INET_DIAG_REQ_BYTECODE
    // attribute: a filter the kernel runs on every socket, "source port == port", so that only
    // the port's sockets are copied out (a busy host has thousands of others).
    let mut req = [0u8; NLMSG_HDR + 56 + 4 + 8];
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family;
    req[17] = libc::IPPROTO_TCP as u8;
    let states: u32 = (1 << TCP_LISTEN) | (1 << TCP_ESTABLISHED);
    req[20..24].copy_from_slice(&states.to_ne_bytes());
    let attr = NLMSG_HDR + 56;
    req[attr..attr + 2].copy_from_slice(&12u16.to_ne_bytes());
    req[attr + 2..attr + 4].copy_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
    // inet_diag_bc_op {code, yes, no}: on a match jump 8 (the end: accept), else 12 (past
    // it: reject); the next op-sized word carries the port.
    req[attr + 4] = INET_DIAG_BC_S_EQ;
    req[attr + 5] = 8;
    req[attr + 6..attr + 8].copy_from_slice(&12u16.to_ne_bytes());
    req[attr + 10..attr + 12].copy_from_slice(&port.to_ne_bytes());
    rustix::net::sendto(
        sock,
        &req,
        SendFlags::empty(),
        &netlink::SocketAddrNetlink::new(0, 0),
    )?;
    let mut listening = false;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let (n, _) = rustix::net::recv(sock, &mut buf[..], rustix::net::RecvFlags::empty())?;
        let mut msgs = &buf[..n];
        if msgs.is_empty() {
            return Err(io::Error::other("sock_diag: empty answer"));
        }
        while msgs.len() >= NLMSG_HDR {
            let word =
                |b: &[u8], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
            let len = word(msgs, 0) as usize;
            let ty = u16::from_ne_bytes([msgs[4], msgs[5]]);
            if len < NLMSG_HDR || len > msgs.len() {
                return Err(io::Error::other("sock_diag: truncated message"));
            }
            match ty {
                NLMSG_DONE => return Ok(listening),
                NLMSG_ERROR => {
                    let errno = msgs.get(16..20).map_or(0, |b| word(b, 0) as i32);
                    return Err(io::Error::from_raw_os_error(-errno));
                }
                SOCK_DIAG_BY_FAMILY if len >= NLMSG_HDR + INET_DIAG_MSG => {
                    let m = &msgs[NLMSG_HDR..len];
                    let state = m[1];
                    // idiag_sport, network byte order, first in the socket id.
                    let sport = u16::from_be_bytes([m[4], m[5]]);
                    if sport == port {
                        let (rqueue, wqueue) = (word(m, 56), word(m, 60));
                        if state == TCP_LISTEN {
                            listening = true;
                            load.backlog += rqueue;
                            load.limit = load.limit.max(wqueue);
                        } else if state == TCP_ESTABLISHED {
                            load.established += 1;
                        }
                    }
                }
                _ => {}
            }
            // Messages are 4-byte aligned.
            let step = (len + 3) & !3;
            msgs = msgs.get(step..).unwrap_or(&[]);
        }
    }
}

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

    #[test]
    fn sock_diag_finds_the_queue_and_the_connections_of_a_port() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let idle = port_load(addr).unwrap().expect("the port listens");
        assert_eq!(idle.backlog, 0);
        assert!(idle.limit > 0);
        let clients: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let (_a, _) = l.accept().unwrap();
        let busy = port_load(addr).unwrap().unwrap();
        assert_eq!(busy.backlog, 3, "{busy:?}");
        // Server ends of the handshaken connections, accepted or not.
        assert_eq!(busy.established, 4, "{busy:?}");
        drop(clients);
        drop(l);
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert_eq!(
            port_load(free).unwrap(),
            None,
            "nothing listens there any more"
        );
    }
}
