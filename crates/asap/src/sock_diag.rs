//! Another process's TCP sockets, by port, through sock_diag netlink (`SOCK_DIAG_BY_FAMILY`):
//! how the `serve` sidecar sees the load of the server it registers.
//!
//! Two requests, of very different cost:
//! - a **dump** of the LISTEN and ESTABLISHED sockets of a port ([`SockDiag::port_load`]):
//!   the kernel filters by port (a bytecode filter) but to find the ESTABLISHED ones still
//!   walks every bucket of the host's established-socket hash table, 262,144 of them on a
//!   24 GiB machine, busy or not: 0.2 ms of kernel time per dump on an idle machine, about a
//!   millisecond on a busy one. The walk is made once per address family asked for, so the
//!   listeners are dumped first (their own small table) and the established sockets only for
//!   the families the port has a listener in: one walk for a server on `0.0.0.0` or on a
//!   dual-stack `[::]` (its IPv4 clients' sockets are IPv6 ones), not two;
//! - an **exact lookup** of the port's listener ([`SockDiag::listener`]): one hash lookup, as
//!   for an arriving SYN; it finds one listener (of several sharing the port with
//!   `SO_REUSEPORT`, the one a SYN would go to).
//!
//! For a listener `idiag_rqueue` is its accept queue and `idiag_wqueue` the queue's limit.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;

/// A listening port's load as the kernel sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortLoad {
    /// Connections waiting in the accept queue(s) of the port's listener(s).
    pub backlog: u32,
    /// The accept queue's limit (of the largest listener).
    pub limit: u32,
    /// Established connections on the port.
    pub established: u32,
    /// Listening sockets on the port.
    pub listeners: u32,
}

/// One listener's accept queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Listener {
    pub backlog: u32,
    pub limit: u32,
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const TCP_ESTABLISHED: u8 = 1;
const TCP_LISTEN: u8 = 10;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, the socket id (48 bytes).
const INET_DIAG_REQ: usize = 56;
/// `struct inet_diag_msg`: family, state, timer, retrans, the socket id (48 bytes), expires,
/// rqueue, wqueue, uid, inode.
const INET_DIAG_MSG: usize = 72;
const INET_DIAG_REQ_BYTECODE: u16 = 1;
const INET_DIAG_BC_S_EQ: u8 = 11;
const INET_DIAG_NOCOOKIE: u32 = !0;

/// A sock_diag netlink socket, kept for many requests.
pub struct SockDiag {
    sock: OwnedFd,
    buf: Vec<u8>,
}

impl SockDiag {
    pub fn new() -> io::Result<Self> {
        use rustix::net::{AddressFamily, SocketType, netlink};
        let sock = rustix::net::socket(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            Some(netlink::SOCK_DIAG),
        )?;
        Ok(Self {
            sock,
            buf: vec![0u8; 32 * 1024],
        })
    }

    /// The accept queue and established connections of the TCP port `addr.port()` in this
    /// network namespace, IPv4 and IPv6 (a dual-stack listener serves both); `Ok(None)` when
    /// nothing listens on it. A dump of the listeners per family, then one of the established
    /// sockets per family that has one: see the module's note on their cost.
    pub fn port_load(&mut self, addr: SocketAddr) -> io::Result<Option<PortLoad>> {
        let mut load = PortLoad::default();
        let mut listening = [false; 2];
        for (i, family) in [libc::AF_INET, libc::AF_INET6].into_iter().enumerate() {
            let before = load.listeners;
            self.dump_port(family, TCP_LISTEN, addr.port(), &mut load)?;
            listening[i] = load.listeners > before;
        }
        for (i, family) in [libc::AF_INET, libc::AF_INET6].into_iter().enumerate() {
            if listening[i] {
                self.dump_port(family, TCP_ESTABLISHED, addr.port(), &mut load)?;
            }
        }
        Ok((load.listeners > 0).then_some(load))
    }

    /// One dump of the family's sockets on `port` in `state`, added to `load`.
    fn dump_port(
        &mut self,
        family: i32,
        state: u8,
        port: u16,
        load: &mut PortLoad,
    ) -> io::Result<()> {
        let mut req = request(family as u8, true, 1 << state);
        // An INET_DIAG_REQ_BYTECODE attribute: a filter the kernel runs on every socket,
        // "source port == port", so that only the port's sockets are copied out.
        let mut attr = [0u8; 12];
        attr[0..2].copy_from_slice(&12u16.to_ne_bytes());
        attr[2..4].copy_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
        // inet_diag_bc_op {code, yes, no}: on a match jump 8 (the end: accept), else 12
        // (past it: reject); the next op-sized word carries the port.
        attr[4] = INET_DIAG_BC_S_EQ;
        attr[5] = 8;
        attr[6..8].copy_from_slice(&12u16.to_ne_bytes());
        attr[10..12].copy_from_slice(&port.to_ne_bytes());
        req.extend_from_slice(&attr);
        self.ask(&mut req, |state, sport, rqueue, wqueue| {
            if sport != port {
                return;
            }
            if state == TCP_LISTEN {
                load.listeners += 1;
                load.backlog += rqueue;
                load.limit = load.limit.max(wqueue);
            } else if state == TCP_ESTABLISHED {
                load.established += 1;
            }
        })
    }

    /// The listener a SYN to `addr` would find (bound to that address or to the wildcard
    /// one, a dual-stack one for IPv4 too): one hash lookup. `Ok(None)` when there is none.
    pub fn listener(&mut self, addr: SocketAddr) -> io::Result<Option<Listener>> {
        let (family, src) = match addr.ip() {
            IpAddr::V4(ip) => (libc::AF_INET, ip.octets().to_vec()),
            IpAddr::V6(ip) => (libc::AF_INET6, ip.octets().to_vec()),
        };
        let mut req = request(family as u8, false, 1 << TCP_LISTEN);
        // The socket id: source port (this one), destination port 0, source address, no
        // destination, any interface, no cookie.
        let id = NLMSG_HDR + 8;
        req[id..id + 2].copy_from_slice(&addr.port().to_be_bytes());
        req[id + 4..id + 4 + src.len()].copy_from_slice(&src);
        req[id + 40..id + 44].copy_from_slice(&INET_DIAG_NOCOOKIE.to_ne_bytes());
        req[id + 44..id + 48].copy_from_slice(&INET_DIAG_NOCOOKIE.to_ne_bytes());
        let mut found = None;
        match self.ask(&mut req, |state, _, rqueue, wqueue| {
            if state == TCP_LISTEN {
                found = Some(Listener {
                    backlog: rqueue,
                    limit: wqueue,
                });
            }
        }) {
            Ok(()) => Ok(found),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sends `req` (its length set here) and hands each answer's state, source port, rqueue
    /// and wqueue to `each`, until the dump's end or, for a lookup, its one answer.
    fn ask(&mut self, req: &mut [u8], mut each: impl FnMut(u8, u16, u32, u32)) -> io::Result<()> {
        use rustix::net::{RecvFlags, SendFlags, netlink};
        let len = req.len() as u32;
        req[0..4].copy_from_slice(&len.to_ne_bytes());
        let dump = u16::from_ne_bytes([req[6], req[7]]) & NLM_F_DUMP != 0;
        rustix::net::sendto(
            &self.sock,
            req,
            SendFlags::empty(),
            &netlink::SocketAddrNetlink::new(0, 0),
        )?;
        loop {
            let (n, _) = rustix::net::recv(&self.sock, &mut self.buf[..], RecvFlags::empty())?;
            let mut msgs = &self.buf[..n];
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
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let errno = msgs.get(16..20).map_or(0, |b| word(b, 0) as i32);
                        return if errno == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-errno))
                        };
                    }
                    SOCK_DIAG_BY_FAMILY if len >= NLMSG_HDR + INET_DIAG_MSG => {
                        let m = &msgs[NLMSG_HDR..len];
                        // idiag_sport, network byte order, first in the socket id.
                        let sport = u16::from_be_bytes([m[4], m[5]]);
                        each(m[1], sport, word(m, 56), word(m, 60));
                    }
                    _ => {}
                }
                // Messages are 4-byte aligned.
                let step = (len + 3) & !3;
                msgs = msgs.get(step..).unwrap_or(&[]);
            }
            if !dump {
                return Ok(());
            }
        }
    }
}

/// A request's header and `inet_diag_req_v2` (length and socket id left to the caller): TCP
/// sockets in `states` (a bit per state).
fn request(family: u8, dump: bool, states: u32) -> Vec<u8> {
    let mut req = vec![0u8; NLMSG_HDR + INET_DIAG_REQ];
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = if dump {
        NLM_F_REQUEST | NLM_F_DUMP
    } else {
        NLM_F_REQUEST
    };
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family;
    req[17] = libc::IPPROTO_TCP as u8;
    req[20..24].copy_from_slice(&states.to_ne_bytes());
    req
}

/// [`SockDiag::port_load`] on a socket of its own.
pub fn port_load(addr: SocketAddr) -> io::Result<Option<PortLoad>> {
    SockDiag::new()?.port_load(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn sock_diag_finds_the_queue_and_the_connections_of_a_port() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let idle = port_load(addr).unwrap().expect("the port listens");
        assert_eq!(idle.backlog, 0);
        assert!(idle.limit > 0);
        assert_eq!(idle.listeners, 1);
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

    /// A dual-stack listener's IPv4 clients are IPv6 sockets: the dump of the family that
    /// listens finds them, and a port with one family's listener is walked for that one.
    #[test]
    fn a_dual_stack_listener_counts_its_ipv4_clients() {
        let l = TcpListener::bind("[::]:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let v4 = SocketAddr::from(([127, 0, 0, 1], port));
        let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
        let _clients: Vec<TcpStream> = [v4, v4, v6]
            .iter()
            .map(|a| TcpStream::connect(a).unwrap())
            .collect();
        let load = port_load(v4).unwrap().expect("the port listens");
        assert_eq!((load.listeners, load.established), (1, 3), "{load:?}");
        // An IPv4-only server: counted from its own family.
        let l4 = TcpListener::bind("127.0.0.1:0").unwrap();
        let a4 = l4.local_addr().unwrap();
        let _c4 = TcpStream::connect(a4).unwrap();
        let load = port_load(a4).unwrap().unwrap();
        assert_eq!((load.listeners, load.established), (1, 1), "{load:?}");
    }

    #[test]
    fn the_exact_lookup_finds_the_listener_and_its_queue() {
        let mut d = SockDiag::new().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let idle = d.listener(addr).unwrap().expect("the port listens");
        assert_eq!(idle.backlog, 0);
        assert!(idle.limit > 0);
        let _clients: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        assert_eq!(d.listener(addr).unwrap().unwrap().backlog, 3);
        let (_a, _) = l.accept().unwrap();
        assert_eq!(d.listener(addr).unwrap().unwrap().backlog, 2);
        // A wildcard listener is found by a loopback address, as a SYN would find it.
        let any = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = any.local_addr().unwrap().port();
        let by_loopback = SocketAddr::from(([127, 0, 0, 1], port));
        assert!(d.listener(by_loopback).unwrap().is_some());
        drop(l);
        assert_eq!(d.listener(addr).unwrap(), None, "nothing listens there now");
    }
}
