//! Hand-over: from the proxy's two connected sockets of one connection to a kernel splice.
//!
//! Once the proxy has routed a connection (read the first request, connected to the PE and
//! forwarded what it had), the legs differ only in addresses, ports, initial sequence numbers
//! and window scales. When both sockets are quiet — nothing unread, nothing unacknowledged —
//! [`hand_over`] puts them into `TCP_REPAIR` mode (they stop sending, not even ACKs), reads
//! each one's next sequence numbers, installs the two flow entries and closes the sockets,
//! which in repair mode leaves the wire silent: no FIN, no RST. A packet that reaches a socket
//! between the read and the install is never acknowledged by it, so its sender sends it again,
//! through the splice.
//!
//! Not handled yet: TCP timestamps (both legs must agree; today the proxy's namespace runs
//! with `net.ipv4.tcp_timestamps = 0`) and MSS (the back leg should be clamped to the client's
//! before connecting).

use crate::{Datapath, Error, Splice};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// Why a hand-over did not happen; the sockets are then as they were.
#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    #[error("a socket is not quiet ({0} bytes unread or unacknowledged)")]
    NotQuiet(u32),
    #[error("only IPv4 connections are spliced")]
    NotIpv4,
    #[error("{0}: {1}")]
    Socket(&'static str, std::io::Error),
    #[error(transparent)]
    Datapath(#[from] Error),
}

#[allow(unsafe_code)]
fn ioctl_u32(fd: RawFd, req: libc::Ioctl) -> std::io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: `fd` is an open socket and `v` outlives the call.
    let r = unsafe { libc::ioctl(fd, req, &mut v) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v.max(0) as u32)
}

#[allow(unsafe_code)]
fn set_tcp(fd: RawFd, opt: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a c_int option value of the right size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[allow(unsafe_code)]
fn get_tcp<T: Copy + Default>(fd: RawFd, opt: libc::c_int) -> std::io::Result<T> {
    let mut v = T::default();
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is a plain value of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            opt,
            (&mut v as *mut T).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// Bytes unread plus bytes sent and not yet acknowledged on `s`.
pub fn pending(s: &impl AsRawFd) -> std::io::Result<u32> {
    Ok(unread(s)? + ioctl_u32(s.as_raw_fd(), libc::TIOCOUTQ)?)
}

/// Bytes received on `s` and not read yet.
pub fn unread(s: &impl AsRawFd) -> std::io::Result<u32> {
    ioctl_u32(s.as_raw_fd(), libc::FIONREAD)
}

/// The window scale shifts of a connection: (ours, the peer's), 0 without window scaling.
fn wscales(fd: RawFd) -> std::io::Result<(u8, u8)> {
    // The kernel's struct tcp_info starts with eight one-byte fields; the seventh holds the
    // two 4-bit shifts (snd in the low bits: the peer's; rcv in the high bits: ours).
    let head: [u8; 8] = get_tcp(fd, libc::TCP_INFO)?;
    const TCPI_OPT_WSCALE: u8 = 4;
    if head[5] & TCPI_OPT_WSCALE == 0 {
        return Ok((0, 0));
    }
    Ok((head[6] >> 4, head[6] & 0x0f))
}

/// The next sequence numbers of a socket in repair mode: (to send, to receive).
fn seqs(fd: RawFd) -> std::io::Result<(u32, u32)> {
    const TCP_RECV_QUEUE: libc::c_int = 1;
    const TCP_SEND_QUEUE: libc::c_int = 2;
    set_tcp(fd, libc::TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)?;
    let snd: u32 = get_tcp(fd, libc::TCP_QUEUE_SEQ)?;
    set_tcp(fd, libc::TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)?;
    let rcv: u32 = get_tcp(fd, libc::TCP_QUEUE_SEQ)?;
    Ok((snd, rcv))
}

fn v4(a: std::io::Result<SocketAddr>, what: &'static str) -> Result<SocketAddrV4, HandOverError> {
    match a.map_err(|e| HandOverError::Socket(what, e))? {
        SocketAddr::V4(a) => Ok(a),
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(ip) => Ok(SocketAddrV4::new(ip, a.port())),
            None => Err(HandOverError::NotIpv4),
        },
    }
}

/// Splices the connection of `front` (the client's, accepted by the proxy) and `back` (the
/// proxy's to the PE): both must be quiet. `client_if` and `server_if` are the interfaces
/// towards the client and the PE. On success the sockets are gone without a trace on the
/// wire and the connection lives in `dp`; on failure they are handed back unchanged.
pub fn hand_over(
    dp: &mut Datapath,
    front: TcpStream,
    back: TcpStream,
    client_if: u32,
    server_if: u32,
) -> Result<Splice, (HandOverError, TcpStream, TcpStream)> {
    let addrs = match addresses(&front, &back, client_if, server_if) {
        Ok(a) => a,
        Err(e) => return Err((e, front, back)),
    };
    // From here until the entries are complete the connection's packets are dropped, so
    // none reaches (and is acknowledged by) a socket about to be closed.
    if let Err(e) = dp.hold(&addrs) {
        return Err((e.into(), front, back));
    }
    let undo = |dp: &mut Datapath, front: &TcpStream, back: &TcpStream| {
        let _ = set_tcp(front.as_raw_fd(), libc::TCP_REPAIR, 0);
        let _ = set_tcp(back.as_raw_fd(), libc::TCP_REPAIR, 0);
        let _ = dp.unsplice(&addrs);
    };
    // A packet may have reached a socket between the first look and the hold: look again,
    // now that nothing more can arrive.
    let again = pending(&front).and_then(|f| Ok(f + pending(&back)?));
    if !matches!(again, Ok(0)) {
        let _ = dp.unsplice(&addrs);
        let e = match again {
            Ok(n) => HandOverError::NotQuiet(n),
            Err(e) => HandOverError::Socket("queue sizes", e),
        };
        return Err((e, front, back));
    }
    match prepare(&front, &back, addrs) {
        Err(e) => {
            undo(dp, &front, &back);
            Err((e, front, back))
        }
        Ok(splice) => match dp.splice(&splice) {
            Ok(()) => {
                // Closed in repair mode: the kernel drops them silently.
                drop((front, back));
                Ok(splice)
            }
            Err(e) => {
                undo(dp, &front, &back);
                Err((e.into(), front, back))
            }
        },
    }
}

/// The connection's addresses and window scales, once both sockets are quiet.
fn addresses(
    front: &TcpStream,
    back: &TcpStream,
    client_if: u32,
    server_if: u32,
) -> Result<Splice, HandOverError> {
    for s in [front, back] {
        let n = pending(s).map_err(|e| HandOverError::Socket("queue sizes", e))?;
        if n != 0 {
            return Err(HandOverError::NotQuiet(n));
        }
    }
    let (front_ws, client_ws) =
        wscales(front.as_raw_fd()).map_err(|e| HandOverError::Socket("TCP_INFO", e))?;
    let (back_ws, server_ws) =
        wscales(back.as_raw_fd()).map_err(|e| HandOverError::Socket("TCP_INFO", e))?;
    Ok(Splice {
        client: v4(front.peer_addr(), "client address")?,
        front: v4(front.local_addr(), "front address")?,
        back: v4(back.local_addr(), "back address")?,
        server: v4(back.peer_addr(), "server address")?,
        client_seq_delta: 0,
        server_seq_delta: 0,
        client_if,
        server_if,
        client_wscale: client_ws,
        front_wscale: front_ws,
        server_wscale: server_ws,
        back_wscale: back_ws,
    })
}

/// Puts both sockets into repair mode and reads their sequence numbers into `s`.
fn prepare(front: &TcpStream, back: &TcpStream, s: Splice) -> Result<Splice, HandOverError> {
    let (ffd, bfd) = (front.as_raw_fd(), back.as_raw_fd());
    set_tcp(ffd, libc::TCP_REPAIR, 1).map_err(|e| HandOverError::Socket("TCP_REPAIR", e))?;
    set_tcp(bfd, libc::TCP_REPAIR, 1).map_err(|e| HandOverError::Socket("TCP_REPAIR", e))?;
    let (front_snd, front_rcv) =
        seqs(ffd).map_err(|e| HandOverError::Socket("TCP_QUEUE_SEQ", e))?;
    let (back_snd, back_rcv) = seqs(bfd).map_err(|e| HandOverError::Socket("TCP_QUEUE_SEQ", e))?;
    Ok(Splice {
        // The client's next byte (front_rcv) is the server's next from us (back_snd).
        client_seq_delta: back_snd.wrapping_sub(front_rcv),
        server_seq_delta: front_snd.wrapping_sub(back_rcv),
        ..s
    })
}

/// The interface index the kernel would send packets to `peer` through (in the calling
/// thread's network namespace): the route's source address, found by connecting a UDP
/// socket (which sends nothing), and the interface that holds it.
pub fn interface_towards(peer: std::net::Ipv4Addr) -> std::io::Result<u32> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0")?;
    probe.connect((peer, 9))?;
    let local = match probe.local_addr()? {
        SocketAddr::V4(a) => *a.ip(),
        SocketAddr::V6(_) => return Err(std::io::Error::other("no IPv4 route")),
    };
    interface_with(local)?.ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no interface holds {local}"),
        )
    })
}

/// The index of the interface that holds `addr`.
#[allow(unsafe_code)]
fn interface_with(addr: std::net::Ipv4Addr) -> std::io::Result<Option<u32>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null()
            // SAFETY: ifa_addr points at a sockaddr of at least its family's size.
            && i32::from(unsafe { (*ifa.ifa_addr).sa_family }) == libc::AF_INET
        {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            if u32::from_be(sin.sin_addr.s_addr) == u32::from(addr) {
                // SAFETY: ifa_name is a NUL-terminated interface name.
                let i = unsafe { libc::if_nametoindex(ifa.ifa_name) };
                if i != 0 {
                    found = Some(i);
                    break;
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
}
