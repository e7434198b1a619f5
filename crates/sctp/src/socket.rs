//! The sockets under a stack, for both drivers (the registrar's mio loop and the tokio host):
//! a UDP socket for SCTP over UDP (RFC 6951), or a raw IP socket for protocol 132 driven
//! through the same datagram calls, for hosts whose kernel has no SCTP (root). IPv4 raw
//! sockets deliver the IP header with each datagram: [`payload`] skips it.

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io;
use std::net::{IpAddr, SocketAddr};

/// IP protocol number of SCTP.
const IPPROTO_SCTP: i32 = 132;

/// A non-blocking UDP socket on `at` for SCTP over UDP.
pub fn udp(at: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let s = std::net::UdpSocket::bind(at)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A non-blocking raw socket for SCTP on `ip` (the port of `at` is not used). Refused where
/// the kernel has SCTP: it would answer every association the raw socket sees with an ABORT
/// (`crate::kernel` is used there instead).
pub fn raw(at: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let domain = if at.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    if crate::kernel::available(at.is_ipv4()) {
        return Err(io::Error::other(
            "this host's kernel has SCTP: its sockets carry sctp://, not a raw one (docs/SCTP.md)",
        ));
    }
    let s = Socket::new(domain, Type::RAW, Some(Protocol::from(IPPROTO_SCTP))).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "a raw socket for SCTP needs root (CAP_NET_RAW): {e}; sctp+udp:// needs no \
                 privilege"
            ),
        )
    })?;
    s.bind(&SockAddr::from(SocketAddr::new(at.ip(), 0)))?;
    s.set_nonblocking(true)?;
    Ok(std::net::UdpSocket::from(std::os::fd::OwnedFd::from(s)))
}

/// The addresses to list in INIT and INIT ACK for a socket bound to `bound`: on the
/// wildcard address, every address of this host's interfaces of its family but loopback
/// and IPv6 link-local ones (at most eight) — the socket receives on all of them, and a peer
/// that knows them can fail over between them (multi-homing); on one address, none (the
/// peer takes the address packets come from).
pub fn local_addresses(bound: SocketAddr) -> Vec<IpAddr> {
    if !bound.ip().is_unspecified() {
        return Vec::new();
    }
    let Ok(ifs) = if_addrs::get_if_addrs() else {
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in ifs.iter().map(if_addrs::Interface::ip) {
        let link_local = matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local());
        if ip.is_ipv4() == bound.is_ipv4() && !ip.is_loopback() && !link_local && !out.contains(&ip)
        {
            out.push(ip);
        }
    }
    out.truncate(crate::cookie::MAX_PEER_ADDRESSES);
    out
}

/// The SCTP packet of a datagram of `n` bytes in `buf` as the socket delivered it, and its
/// source as the stack names peers (port 0 on raw IP).
pub fn payload(buf: &[u8], n: usize, from: SocketAddr, raw: bool) -> (&[u8], SocketAddr) {
    let n = n.min(buf.len());
    if !raw {
        return (&buf[..n], from);
    }
    // IPv4: skip the header, IHL words; IPv6 raw sockets deliver no header.
    let start = if from.is_ipv4() {
        buf.first().map_or(n, |b| usize::from(b & 0x0f) * 4).min(n)
    } else {
        0
    };
    (&buf[start..n], SocketAddr::new(from.ip(), 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_ipv4_datagram_loses_its_header_and_port() {
        let mut d = vec![0x45u8; 20];
        d.extend_from_slice(b"packet");
        let from: SocketAddr = "192.0.2.1:0".parse().unwrap();
        assert_eq!(payload(&d, d.len(), from, true), (&b"packet"[..], from));
        let udp: SocketAddr = "192.0.2.1:9899".parse().unwrap();
        assert_eq!(payload(b"packet", 6, udp, false), (&b"packet"[..], udp));
        // A header longer than the datagram: nothing, never a panic.
        assert_eq!(payload(&[0x4f, 1, 2], 3, from, true).0, &[] as &[u8]);
    }
}
