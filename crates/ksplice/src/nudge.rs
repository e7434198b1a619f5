//! The nudge after a member of a proxy tier died (docs/TIER.md, "The nudge").
//!
//! Why: when a proxy dies silently, the packets the router still sends it are lost until the
//! distributor notices (2–3 heartbeats). By then the TCP senders behind those packets have
//! timed out once or twice and doubled their retransmission timeout (200, 400, 800 ms), so
//! their flows stay stalled long after the tier has recovered. TCP has a standard way out:
//! an ICMP "host unreachable" that quotes the sender's oldest unacknowledged segment makes it
//! undo one backoff step, and retransmit at once if the shorter timeout has already passed
//! (RFC 6069; Linux `tcp_ld_RTO_revert`).
//!
//! The quote must carry that sequence number exactly. The survivors learn it by asking each
//! end: a SYN on an established connection is never accepted, whatever its sequence number,
//! and is answered with a challenge ACK (RFC 5961 §4) carrying the end's receive point. That
//! ACK comes back through a survivor's splice, which records its number as it leaves
//! ([`crate::Datapath::arm_probes`]): it is what the other end has acknowledged if nothing
//! newer is in flight. A number that is not the sender's SND.UNA changes nothing at the
//! sender, so a wrong guess is harmless.

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

/// The ICMP error that makes the TCP sender `from` → `to` retransmit `seq` now if it is
/// backing off on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Revert {
    pub from: SocketAddrV4,
    pub to: SocketAddrV4,
    pub seq: u32,
}

/// Sends raw IPv4 packets (root, or CAP_NET_RAW).
pub struct RawSender {
    socket: Socket,
}

impl RawSender {
    pub fn new() -> std::io::Result<Self> {
        // IPPROTO_RAW: the packets carry their own IP header.
        let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(255)))?;
        // Blocking: a burst of probes waits for room in the socket's buffer (the nudge runs
        // on a thread of its own), but not for ever.
        socket.set_write_timeout(Some(std::time::Duration::from_millis(100)))?;
        Ok(Self { socket })
    }

    /// A SYN from `from` to `to`, which the receiver of an established connection answers
    /// with a challenge ACK. Its sequence number does not matter: such a SYN is never
    /// accepted.
    pub fn probe(&self, from: SocketAddrV4, to: SocketAddrV4) -> std::io::Result<()> {
        self.send(&syn_probe(from, to, 0), *to.ip())
    }

    /// The ICMP host unreachable of `r`, to its sender.
    pub fn revert(&self, r: &Revert) -> std::io::Result<()> {
        self.send(&host_unreachable(r), *r.from.ip())
    }

    fn send(&self, packet: &[u8], to: Ipv4Addr) -> std::io::Result<()> {
        let dst = SockAddr::from(SocketAddr::V4(SocketAddrV4::new(to, 0)));
        self.socket.send_to(packet, &dst).map(|_| ())
    }
}

/// The Internet checksum of `parts`, one after the other (each of even length but the last).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        let mut words = part.chunks(2);
        for w in &mut words {
            let hi = u32::from(w[0]) << 8;
            sum += hi | w.get(1).map_or(0, |b| u32::from(*b));
        }
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 header of 20 bytes. A source of 0.0.0.0 is filled in by the kernel.
fn ip_header(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, payload: usize) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    let total = (20 + payload) as u16;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[8] = 64;
    h[9] = protocol;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&[&h]);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

fn syn_probe(from: SocketAddrV4, to: SocketAddrV4, seq: u32) -> Vec<u8> {
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&from.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&to.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&1024u16.to_be_bytes());
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&from.ip().octets());
    pseudo[4..8].copy_from_slice(&to.ip().octets());
    pseudo[9] = 6;
    pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
    let c = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut p = ip_header(*from.ip(), *to.ip(), 6, tcp.len()).to_vec();
    p.extend_from_slice(&tcp);
    p
}

fn host_unreachable(r: &Revert) -> Vec<u8> {
    // The quoted datagram: the sender's IP header and the first 8 bytes of its TCP header.
    let quoted_ip = ip_header(*r.from.ip(), *r.to.ip(), 6, 20);
    let mut icmp = vec![3u8, 1, 0, 0, 0, 0, 0, 0]; // destination unreachable, host
    icmp.extend_from_slice(&quoted_ip);
    icmp.extend_from_slice(&r.from.port().to_be_bytes());
    icmp.extend_from_slice(&r.to.port().to_be_bytes());
    icmp.extend_from_slice(&r.seq.to_be_bytes());
    let c = checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut p = ip_header(Ipv4Addr::UNSPECIFIED, *r.from.ip(), 1, icmp.len()).to_vec();
    p.extend_from_slice(&icmp);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify() {
        let a = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 4000);
        let b = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 80);
        let syn = syn_probe(a, b, 0x1234_5678);
        assert_eq!(checksum(&[&syn[..20]]), 0, "IP header");
        let mut pseudo = [0u8; 12];
        pseudo[0..4].copy_from_slice(&a.ip().octets());
        pseudo[4..8].copy_from_slice(&b.ip().octets());
        pseudo[9] = 6;
        pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
        assert_eq!(checksum(&[&pseudo, &syn[20..]]), 0, "TCP");
        assert_eq!(syn[33], 0x02, "SYN only");

        let icmp = host_unreachable(&Revert {
            from: a,
            to: b,
            seq: 7,
        });
        assert_eq!(icmp.len(), 20 + 8 + 28);
        assert_eq!(checksum(&[&icmp[20..]]), 0, "ICMP");
        assert_eq!(
            &icmp[48..50],
            &4000u16.to_be_bytes(),
            "the sender's port quoted"
        );
        assert_eq!(
            &icmp[52..56],
            &7u32.to_be_bytes(),
            "its sequence number quoted"
        );
    }
}
