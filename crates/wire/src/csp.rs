//! The Component Status Protocol (CSP) of rsplib: a UDP datagram each component sends to a
//! monitor (rsplib's `cspmonitor`, UDP port 2960) every few seconds, saying who it is, where,
//! how it is doing and whom it is associated with. It is not an RFC, but every rsplib
//! component speaks it and Wireshark decodes it (`componentstatusprotocol`), so an rsplib
//! operator's monitoring sees rserpool's registrars, pool elements and proxies beside
//! rsplib's own.
//!
//! The layout (all integers big-endian, no padding): type (1 = report), flags (1 = final),
//! length, version 0x0200, the sender's component ID, its uptime in µs, then the report
//! interval in µs, the location and the status (128 bytes each, NUL-padded), the workload
//! (0xffff: unknown; else the share of 0xfffe) and the associations (24 bytes each: the peer's
//! component ID, the association's age in µs, flags, IP protocol and SCTP PPID).
//! `cspmonitor` drops a datagram whose size is not exactly 288 + 24 × associations, and takes
//! any non-zero flags as the final report.

/// The monitor's UDP port.
pub const CSP_PORT: u16 = 2960;
const VERSION: u32 = 0x0200;
const REPORT: u8 = 0x01;
const FINAL: u8 = 0x01;
const TEXT: usize = 128;
const HEAD: usize = 288;
const ASSOCIATION: usize = 24;
/// Associations in one report at most (its length field is 16 bits).
pub const MAX_ASSOCIATIONS: usize = (u16::MAX as usize - HEAD) / ASSOCIATION;

/// What a component is, as the top byte of its component ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Registrar = 1,
    PoolElement = 2,
    PoolUser = 3,
}

impl Component {
    /// The component ID of this kind of component with `object` (its identifier; the
    /// registrar's or PE's 32-bit one, a pool user's random 56 bits). rsplib sends nothing for
    /// object 0.
    pub fn id(self, object: u64) -> u64 {
        ((self as u64) << 56) | (object & 0x00ff_ffff_ffff_ffff)
    }
}

/// The IP protocol of an association (the association array's field).
pub const PROTOCOL_TCP: u16 = 6;
pub const PROTOCOL_SCTP: u16 = 132;
/// SCTP payload protocol identifiers of ASAP and ENRP (RFC 5352, 5353).
pub const PPID_ASAP: u32 = 11;
pub const PPID_ENRP: u32 = 12;

/// One association of the reporting component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Association {
    /// The peer's component ID ([`Component::id`]).
    pub peer: u64,
    /// How long it has been up, µs (`None`: unknown).
    pub duration_us: Option<u64>,
    pub protocol: u16,
    pub ppid: u32,
}

/// A status report.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The sender's component ID ([`Component::id`]).
    pub sender: u64,
    /// Since the sender's first report, µs.
    pub uptime_us: u64,
    /// How often it reports, µs: the monitor forgets it after ten intervals without one.
    pub interval_us: u32,
    /// Where it is: rsplib writes "host: address:port".
    pub location: String,
    /// How it is doing, in a few words.
    pub status: String,
    /// Its load, 0 to 1 (`None`: unknown).
    pub workload: Option<f64>,
    pub associations: Vec<Association>,
    /// The last report (the component stops): the monitor drops it at once.
    pub last: bool,
}

/// Why a datagram is not a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CspError {
    #[error("shorter than a report")]
    Short,
    #[error("not a CSP report of version 0x0200")]
    NotReport,
    #[error("the length does not match the associations")]
    Length,
}

impl Report {
    /// The last report of a component that stops (as rsplib sends it: no location, status or
    /// associations): the monitor drops the component at once.
    pub fn last(sender: u64, uptime_us: u64, interval_us: u32) -> Report {
        Report {
            sender,
            uptime_us,
            interval_us,
            location: String::new(),
            status: String::new(),
            workload: Some(0.0),
            associations: Vec::new(),
            last: true,
        }
    }

    /// The datagram. Texts longer than 127 bytes are cut (at a character boundary), and
    /// associations beyond [`MAX_ASSOCIATIONS`] left out.
    pub fn encode(&self) -> Vec<u8> {
        let associations = &self.associations[..self.associations.len().min(MAX_ASSOCIATIONS)];
        let len = HEAD + associations.len() * ASSOCIATION;
        let mut out = Vec::with_capacity(len);
        out.push(REPORT);
        out.push(if self.last { FINAL } else { 0 });
        out.extend_from_slice(&(len as u16).to_be_bytes());
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(&self.sender.to_be_bytes());
        out.extend_from_slice(&self.uptime_us.to_be_bytes());
        out.extend_from_slice(&self.interval_us.to_be_bytes());
        put_text(&mut out, &self.location);
        put_text(&mut out, &self.status);
        let workload = match self.workload {
            Some(w) => (w.clamp(0.0, 1.0) * f64::from(0xfffe_u16)).round() as u16,
            None => 0xffff,
        };
        out.extend_from_slice(&workload.to_be_bytes());
        out.extend_from_slice(&(associations.len() as u16).to_be_bytes());
        for a in associations {
            out.extend_from_slice(&a.peer.to_be_bytes());
            out.extend_from_slice(&a.duration_us.unwrap_or(u64::MAX).to_be_bytes());
            out.extend_from_slice(&0u16.to_be_bytes());
            out.extend_from_slice(&a.protocol.to_be_bytes());
            out.extend_from_slice(&a.ppid.to_be_bytes());
        }
        out
    }

    /// A datagram as `cspmonitor` reads it.
    pub fn decode(b: &[u8]) -> Result<Report, CspError> {
        if b.len() < HEAD {
            return Err(CspError::Short);
        }
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) << 32 | u64::from(u32_at(i + 4));
        if b[0] != REPORT || u32_at(4) != VERSION {
            return Err(CspError::NotReport);
        }
        let n = usize::from(u16_at(286));
        if b.len() != HEAD + n * ASSOCIATION {
            return Err(CspError::Length);
        }
        let text = |i: usize| {
            let t = &b[i..i + TEXT];
            let end = t.iter().position(|&c| c == 0).unwrap_or(TEXT);
            String::from_utf8_lossy(&t[..end]).into_owned()
        };
        let workload = u16_at(284);
        Ok(Report {
            sender: u64_at(8),
            uptime_us: u64_at(16),
            interval_us: u32_at(24),
            location: text(28),
            status: text(156),
            workload: (workload != 0xffff).then(|| f64::from(workload) / f64::from(0xfffe_u16)),
            associations: (0..n)
                .map(|k| {
                    let a = HEAD + k * ASSOCIATION;
                    let duration = u64_at(a + 8);
                    Association {
                        peer: u64_at(a),
                        duration_us: (duration != u64::MAX).then_some(duration),
                        protocol: u16_at(a + 18),
                        ppid: u32_at(a + 20),
                    }
                })
                .collect(),
            last: b[1] != 0,
        })
    }
}

/// `text` NUL-padded to 128 bytes, cut to 127 at a character boundary.
fn put_text(out: &mut Vec<u8>, text: &str) {
    let mut end = text.len().min(TEXT - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&text.as_bytes()[..end]);
    out.resize(out.len() + TEXT - end, 0);
}

/// The local address to send reports to `monitor` from: any, of its family.
pub fn local_for(monitor: std::net::SocketAddr) -> std::net::SocketAddr {
    if monitor.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    }
}

/// This host's name, which rsplib's location text starts with (Linux's, else "localhost").
/// The one thing here that reads the system.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// rsplib's location text: the host name, then the addresses (the first with its port).
pub fn location(host: &str, addrs: &[std::net::SocketAddr]) -> String {
    let mut out = host.to_owned();
    for (i, a) in addrs.iter().enumerate() {
        out.push_str(if i == 0 { ": " } else { ", " });
        if i == 0 {
            out.push_str(&a.to_string());
        } else {
            out.push_str(&a.ip().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            sender: Component::PoolElement.id(0x1234_abcd),
            uptime_us: 5_000_000,
            interval_us: 1_000_000,
            location: "host: 10.0.0.1:7000".into(),
            status: "Registered with registrar $5a5a0001".into(),
            workload: Some(0.5),
            associations: vec![Association {
                peer: Component::Registrar.id(0x5a5a_0001),
                duration_us: None,
                protocol: PROTOCOL_TCP,
                ppid: PPID_ASAP,
            }],
            last: false,
        }
    }

    /// The bytes rsplib's own sender writes (componentstatuspackets.h): a PE's report.
    #[test]
    fn a_report_is_laid_out_as_rsplib_lays_it_out() {
        let b = report().encode();
        assert_eq!(b.len(), 288 + 24);
        assert_eq!(b[..4], [0x01, 0x00, 0x01, 0x38]);
        assert_eq!(b[4..8], [0, 0, 2, 0]);
        assert_eq!(b[8..16], [2, 0, 0, 0, 0x12, 0x34, 0xab, 0xcd]);
        assert_eq!(b[24..28], 1_000_000u32.to_be_bytes());
        assert_eq!(&b[28..47], b"host: 10.0.0.1:7000");
        assert!(b[47..156].iter().all(|&c| c == 0));
        assert_eq!(b[284..286], [0x7f, 0xff]);
        assert_eq!(b[286..288], [0, 1]);
        assert_eq!(b[288..296], [1, 0, 0, 0, 0x5a, 0x5a, 0, 1]);
        assert_eq!(b[296..304], [0xff; 8]);
        assert_eq!(b[306..308], [0, 6]);
        assert_eq!(b[308..312], [0, 0, 0, 11]);
        let back = Report::decode(&b).unwrap();
        assert_eq!(back.sender, report().sender);
        assert_eq!(back.associations, report().associations);
        assert!((back.workload.unwrap() - 0.5).abs() < 1e-4);
    }

    #[test]
    fn texts_are_cut_and_unknowns_marked() {
        let mut r = report();
        r.status = "é".repeat(100);
        r.workload = None;
        r.associations.clear();
        r.last = true;
        let b = r.encode();
        assert_eq!(b.len(), 288);
        assert_eq!(b[1], 1);
        assert_eq!(b[284..286], [0xff, 0xff]);
        let back = Report::decode(&b).unwrap();
        assert_eq!(back.status, "é".repeat(63));
        assert_eq!(back.workload, None);
        assert!(back.last);
        assert_eq!(Report::decode(&b[..287]), Err(CspError::Short));
        let end = Report::last(r.sender, 7, 1_000_000).encode();
        assert_eq!(
            (end.len(), end[1], &end[284..288]),
            (288, 1, &[0u8, 0, 0, 0][..])
        );
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(Report::decode(&longer), Err(CspError::Length));
    }

    #[test]
    fn the_location_names_the_host_and_addresses() {
        let a = [
            "10.0.0.1:3863".parse().unwrap(),
            "10.0.0.2:3863".parse().unwrap(),
        ];
        assert_eq!(location("pr1", &a), "pr1: 10.0.0.1:3863, 10.0.0.2");
        assert_eq!(location("pr1", &[]), "pr1");
    }
}
