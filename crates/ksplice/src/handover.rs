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
//! TCP timestamps: each leg has its own clocks, so the datapath adds an offset to every TSval
//! and takes the other direction's off every echo (TSecr). The offset maps a peer's latest
//! TSval to the proxy's current one on the other leg, so that the receiver's PAWS check (a
//! TSval never goes back) holds. No socket option tells a peer's latest TSval: the datapath
//! records it while the connection is watched ([`Datapath::watch`], installed before the
//! proxy connects to the PE), and for the client the SYN the listener saved
//! ([`save_syn`]) gives an older one, which is as good (the translated clock then jumps
//! ahead, which PAWS allows). Legs of which one uses timestamps and one does not are not
//! spliced.
//!
//! MSS: the proxy connects to the PE with its MSS clamped to the client's ([`clamp_mss`]),
//! so the PE sends nothing larger than the client takes; a PE that takes less than the
//! proxy told the client is not spliced.

use crate::{Datapath, Error, Splice};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};

/// How long a hand-over waits, once the connection's packets are held, for those that passed
/// the program just before to reach their socket (the receive path runs in a softirq and
/// takes microseconds).
const IN_FLIGHT_GRACE: std::time::Duration = std::time::Duration::from_micros(20);

/// Why a hand-over did not happen; the sockets are then as they were.
#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    #[error("a socket is not quiet ({0} bytes unread or unacknowledged)")]
    NotQuiet(u32),
    #[error("only IPv4 connections are spliced")]
    NotIpv4,
    #[error("a side has closed its half of the connection")]
    Closing,
    #[error("the legs differ: {0}")]
    Mismatch(&'static str),
    #[error("no TCP timestamp seen from the {0} yet")]
    NoTimestamp(&'static str),
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
    let fd = s.as_raw_fd();
    Ok(ioctl_u32(fd, libc::FIONREAD)? + ioctl_u32(fd, libc::TIOCOUTQ)?)
}

/// What a hand-over needs of a socket's `struct tcp_info`.
#[derive(Debug, Clone, Copy)]
struct Info {
    /// The TCP state (1: established).
    state: u8,
    /// Window scale shifts: (ours, the peer's), 0 without window scaling.
    wscales: (u8, u8),
    timestamps: bool,
    /// The largest segment this socket sends (the peer's MSS less options).
    snd_mss: u32,
    /// The MSS this socket advertised.
    advmss: u32,
}

fn info(fd: RawFd) -> std::io::Result<Info> {
    // The kernel's struct tcp_info: eight one-byte fields, then u32s; the getsockopt copies
    // as much as the buffer holds.
    let raw: [u32; 22] = get_tcp(fd, libc::TCP_INFO)?;
    let state = raw[0].to_ne_bytes()[0];
    let [_backoff, options, ws, _] = raw[1].to_ne_bytes();
    const TCPI_OPT_TIMESTAMPS: u8 = 1;
    const TCPI_OPT_WSCALE: u8 = 4;
    Ok(Info {
        state,
        // The seventh byte holds the two 4-bit shifts: snd (the peer's) low, rcv (ours) high.
        wscales: if options & TCPI_OPT_WSCALE == 0 {
            (0, 0)
        } else {
            (ws >> 4, ws & 0x0f)
        },
        timestamps: options & TCPI_OPT_TIMESTAMPS != 0,
        snd_mss: raw[4],
        advmss: raw[21],
    })
}

/// Sets a TCP option whose value is an int on `s`: for the options the socket crates do not
/// offer (`TCP_SAVE_SYN` here, `TCP_DEFER_ACCEPT` on the proxy's listeners).
pub fn set_tcp_option(s: &impl AsRawFd, opt: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
    set_tcp(s.as_raw_fd(), opt, v)
}

/// Has `listener` keep each connection's SYN, whose timestamp a hand-over may need
/// (`TCP_SAVE_SYN`; a connection's copy is freed when it is read or the socket closes).
pub fn save_syn(listener: &impl AsRawFd) -> std::io::Result<()> {
    set_tcp_option(listener, libc::TCP_SAVE_SYN, 1)
}

/// Clamps the MSS a socket not yet connected advertises to that of `client` (an accepted
/// connection): the PE then sends no segment larger than the client takes.
pub fn clamp_mss(socket: &impl AsRawFd, client: &impl AsRawFd) -> std::io::Result<()> {
    let mss: u32 = get_tcp(client.as_raw_fd(), libc::TCP_MAXSEG)?;
    set_tcp(
        socket.as_raw_fd(),
        libc::TCP_MAXSEG,
        mss.clamp(536, 65_535) as libc::c_int,
    )
}

/// The TSval of the SYN that opened `s`, if its listener saved it ([`save_syn`]) and the
/// SYN had one. Reading it frees the saved copy.
fn saved_syn_tsval(s: &impl AsRawFd) -> Option<u32> {
    let syn: [u8; 120] = get_tcp_bytes(s.as_raw_fd(), libc::TCP_SAVED_SYN)?;
    tsval_of_syn(&syn)
}

/// The TSval in an IPv4 SYN's headers.
fn tsval_of_syn(h: &[u8]) -> Option<u32> {
    let ihl = usize::from(h.first()? & 0x0f) * 4;
    if h.first()? >> 4 != 4 || ihl < 20 {
        return None;
    }
    let tcp = h.get(ihl..)?;
    let doff = usize::from(tcp.get(12)? >> 4) * 4;
    let mut opts = tcp.get(20..doff)?;
    while let Some(&kind) = opts.first() {
        match kind {
            0 => break,
            1 => opts = &opts[1..],
            _ => {
                let len = usize::from(*opts.get(1)?);
                if len < 2 || len > opts.len() {
                    return None;
                }
                if kind == 8 && len == 10 {
                    return Some(u32::from_be_bytes(opts[2..6].try_into().ok()?));
                }
                opts = &opts[len..];
            }
        }
    }
    None
}

#[allow(unsafe_code)]
fn get_tcp_bytes<const N: usize>(fd: RawFd, opt: libc::c_int) -> Option<[u8; N]> {
    let mut v = [0u8; N];
    let mut len = N as libc::socklen_t;
    // SAFETY: `v` is a buffer of `len` bytes.
    let r =
        unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, opt, v.as_mut_ptr().cast(), &mut len) };
    (r == 0 && len > 0).then_some(v)
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

impl Splice {
    /// The addresses of the connection of `front` (the client's socket, accepted by the
    /// proxy) and `back` (the proxy's to the PE), nothing translated yet: what
    /// [`Datapath::hold`] needs.
    pub fn of(front: &impl AsFd, back: &impl AsFd) -> Result<Splice, HandOverError> {
        let (front, back) = (socket2::SockRef::from(front), socket2::SockRef::from(back));
        Ok(Splice::between(
            v4(front.peer_addr(), "client address")?,
            v4(front.local_addr(), "front address")?,
            v4(back.local_addr(), "back address")?,
            v4(back.peer_addr(), "server address")?,
        ))
    }
}

fn v4(
    a: std::io::Result<socket2::SockAddr>,
    what: &'static str,
) -> Result<SocketAddrV4, HandOverError> {
    let a = a.map_err(|e| HandOverError::Socket(what, e))?;
    match a.as_socket() {
        Some(SocketAddr::V4(a)) => Ok(a),
        Some(SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
            Some(ip) => Ok(SocketAddrV4::new(ip, a.port())),
            None => Err(HandOverError::NotIpv4),
        },
        None => Err(HandOverError::NotIpv4),
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
    let (addrs, ts) = match addresses(dp, &front, &back, client_if, server_if) {
        Ok(a) => a,
        Err(e) => return Err((e, front, back)),
    };
    // From here until the entries are complete the connection's packets are dropped, so
    // none reaches (and is acknowledged by) a socket about to be closed.
    if let Err(e) = dp.hold(&addrs, ts) {
        return Err((e.into(), front, back));
    }
    // Back to watching (the timestamps seen so far kept) or, on failure, to nothing.
    let undo = |dp: &mut Datapath, front: &TcpStream, back: &TcpStream, watch: bool| {
        let _ = set_tcp(front.as_raw_fd(), libc::TCP_REPAIR, 0);
        let _ = set_tcp(back.as_raw_fd(), libc::TCP_REPAIR, 0);
        if watch {
            let _ = dp.release(&addrs);
        } else {
            let _ = dp.unsplice(&addrs);
        }
    };
    // A packet that passed the program just before the hold may still be on its way up the
    // stack (in a softirq on another CPU): give it a moment, then look again.
    let t0 = std::time::Instant::now();
    while t0.elapsed() < IN_FLIGHT_GRACE {
        std::hint::spin_loop();
    }
    let quiet_both = || quiet(&front).and_then(|()| quiet(&back));
    if let Err(e) = quiet_both() {
        undo(dp, &front, &back, matches!(e, HandOverError::NotQuiet(_)));
        return Err((e, front, back));
    }
    let prepared = prepare(&front, &back, addrs, ts).and_then(|s| {
        // Once more now that the sequence numbers are read: a byte that reached a socket
        // since would be lost with it.
        quiet_both().map(|()| s)
    });
    match prepared {
        Err(e) => {
            undo(dp, &front, &back, matches!(e, HandOverError::NotQuiet(_)));
            Err((e, front, back))
        }
        Ok(splice) => match dp.splice(&splice) {
            Ok(()) => {
                // Closed in repair mode: the kernel drops them silently.
                drop((front, back));
                Ok(splice)
            }
            Err(e) => {
                undo(dp, &front, &back, false);
                Err((e.into(), front, back))
            }
        },
    }
}

/// Nothing unread, nothing unacknowledged, and no FIN received or sent: a FIN the socket took
/// would never reach the other end (and its sequence number is in the socket's).
fn quiet(s: &TcpStream) -> Result<(), HandOverError> {
    let n = pending(s).map_err(|e| HandOverError::Socket("queue sizes", e))?;
    if n != 0 {
        return Err(HandOverError::NotQuiet(n));
    }
    let i = info(s.as_raw_fd()).map_err(|e| HandOverError::Socket("TCP_INFO", e))?;
    const TCP_ESTABLISHED: u8 = 1;
    if i.state != TCP_ESTABLISHED {
        return Err(HandOverError::Closing);
    }
    Ok(())
}

/// The connection's addresses, window scales and the peers' latest timestamps (client's,
/// server's) when the legs use them, once both sockets are quiet.
fn addresses(
    dp: &Datapath,
    front: &TcpStream,
    back: &TcpStream,
    client_if: u32,
    server_if: u32,
) -> Result<(Splice, Option<(u32, u32)>), HandOverError> {
    quiet(front)?;
    quiet(back)?;
    let fi = info(front.as_raw_fd()).map_err(|e| HandOverError::Socket("TCP_INFO", e))?;
    let bi = info(back.as_raw_fd()).map_err(|e| HandOverError::Socket("TCP_INFO", e))?;
    let s = Splice {
        client_if,
        server_if,
        client_wscale: fi.wscales.1,
        front_wscale: fi.wscales.0,
        server_wscale: bi.wscales.1,
        back_wscale: bi.wscales.0,
        ..Splice::of(front, back)?
    };
    // The client may send segments as large as the proxy advertised; the PE must take them.
    let options = if bi.timestamps { 12 } else { 0 };
    if bi.snd_mss + options < fi.advmss {
        return Err(HandOverError::Mismatch(
            "the PE's MSS is below the client leg's",
        ));
    }
    let ts = match (fi.timestamps, bi.timestamps) {
        (false, false) => None,
        (true, true) => {
            let client = dp
                .seen_tsval(s.client, s.front)
                .or_else(|| saved_syn_tsval(front))
                .ok_or(HandOverError::NoTimestamp("client"))?;
            let server = dp
                .seen_tsval(s.server, s.back)
                .ok_or(HandOverError::NoTimestamp("server"))?;
            Some((client, server))
        }
        _ => return Err(HandOverError::Mismatch("TCP timestamps on one leg only")),
    };
    Ok((s, ts))
}

/// Puts both sockets into repair mode and reads their sequence numbers and timestamp clocks
/// into `s`. `ts` holds the peers' latest TSvals (client's, server's).
fn prepare(
    front: &TcpStream,
    back: &TcpStream,
    s: Splice,
    ts: Option<(u32, u32)>,
) -> Result<Splice, HandOverError> {
    let (ffd, bfd) = (front.as_raw_fd(), back.as_raw_fd());
    set_tcp(ffd, libc::TCP_REPAIR, 1).map_err(|e| HandOverError::Socket("TCP_REPAIR", e))?;
    set_tcp(bfd, libc::TCP_REPAIR, 1).map_err(|e| HandOverError::Socket("TCP_REPAIR", e))?;
    let (front_snd, front_rcv) =
        seqs(ffd).map_err(|e| HandOverError::Socket("TCP_QUEUE_SEQ", e))?;
    let (back_snd, back_rcv) = seqs(bfd).map_err(|e| HandOverError::Socket("TCP_QUEUE_SEQ", e))?;
    let timestamps = match ts {
        None => None,
        Some((client, server)) => {
            // The proxy's current TSval on each leg: what the peer there last saw, or more.
            let clock = |fd| -> Result<u32, HandOverError> {
                get_tcp::<u32>(fd, libc::TCP_TIMESTAMP)
                    .map_err(|e| HandOverError::Socket("TCP_TIMESTAMP", e))
            };
            let (front_now, back_now) = (clock(ffd)?, clock(bfd)?);
            Some((
                back_now.wrapping_add(1).wrapping_sub(client),
                front_now.wrapping_add(1).wrapping_sub(server),
            ))
        }
    };
    Ok(Splice {
        // The client's next byte (front_rcv) is the server's next from us (back_snd).
        client_seq_delta: back_snd.wrapping_sub(front_rcv),
        server_seq_delta: front_snd.wrapping_sub(back_rcv),
        timestamps,
        ..s
    })
}

/// The source address and the interface index the kernel would use towards `peer` (in the
/// calling thread's network namespace): the route's source address, found by connecting a
/// UDP socket (which sends nothing), and the interface that holds it.
pub fn route_towards(peer: std::net::Ipv4Addr) -> std::io::Result<(std::net::Ipv4Addr, u32)> {
    let local = source_towards(peer)?;
    let i = interface_with(local)?.ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no interface holds {local}"),
        )
    })?;
    Ok((local, i))
}

/// The source address the kernel would use towards `peer`.
fn source_towards(peer: std::net::Ipv4Addr) -> std::io::Result<std::net::Ipv4Addr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0")?;
    probe.connect((peer, 9))?;
    match probe.local_addr()? {
        SocketAddr::V4(a) => Ok(*a.ip()),
        SocketAddr::V6(_) => Err(std::io::Error::other("no IPv4 route")),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timestamp_of_a_saved_syn() {
        // IPv4 (20 bytes), TCP with MSS, SACK-permitted, timestamps, NOP, window scale.
        let mut h = vec![0x45u8];
        h.resize(20, 0);
        let mut tcp = vec![0u8; 20];
        tcp[12] = 10 << 4;
        h.extend_from_slice(&tcp);
        h.extend_from_slice(&[2, 4, 0x05, 0xb4, 4, 2, 8, 10]);
        h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
        h.extend_from_slice(&[0, 0, 0, 0, 1, 3, 3, 7]);
        assert_eq!(tsval_of_syn(&h), Some(0x1234_5678));
        // Without the option, or cut short: nothing, and no panic.
        assert_eq!(tsval_of_syn(&h[..44]), None);
        assert_eq!(tsval_of_syn(&[]), None);
        assert_eq!(tsval_of_syn(&[0x60; 60]), None);
    }
}
