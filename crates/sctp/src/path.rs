//! The peer's addresses as paths of one association (multi-homing, RFC 9260 §5.4, §8.2,
//! §8.3, and the potentially-failed state of RFC 7829).
//!
//! Why: a multi-homed peer lists its addresses in INIT or INIT ACK; when the path to one
//! fails, the association carries on over another instead of ending. Each path has its own
//! RTO, error count and heartbeats. A listed address is first *unconfirmed*: it gets a
//! heartbeat with a nonce and no data until the nonce comes back from it (§5.4), so a peer
//! cannot point our traffic at a third party. Data goes to the primary path (the address we
//! connected to, or that the peer's COOKIE ECHO came from) while it is active, else to
//! another active path. A data or heartbeat timeout makes a path *potentially failed*
//! (RFC 7829, at once with the default PFMR of 0): data moves to an alternate path while
//! heartbeats probe it every RTO; more timeouts than `Path.Max.Retrans` make it *inactive*;
//! an answer makes it active again.
//!
//! Addresses are kept as the socket addresses datagrams travel to: with SCTP over UDP, a
//! listed IP address takes the UDP port of the packet that listed it (RFC 6951 §5.3).

use crate::cookie::MAX_PEER_ADDRESSES;
use crate::send::Timing;
use bytes::Bytes;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// How paths are watched.
#[derive(Debug, Clone, Copy)]
pub struct PathConfig {
    /// Timeouts in a row (data or heartbeats) after which a path is inactive
    /// (`Path.Max.Retrans`, RFC 9260 §16: 5).
    pub max_retransmits: u32,
    /// Timeouts in a row after which a path is potentially failed and data avoids it
    /// (`PFMR`, RFC 7829 §5: 0, so the first timeout moves data away).
    pub pf_max_retransmits: u32,
    /// Heartbeats on an active path, plus its RTO (`HB.interval`).
    pub heartbeat_interval: Duration,
}

impl Default for PathConfig {
    fn default() -> Self {
        Self {
            max_retransmits: 5,
            pf_max_retransmits: 0,
            heartbeat_interval: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    Active,
    /// Timed out more than `pf_max_retransmits` times: data avoids it where it can.
    PotentiallyFailed,
    /// Timed out more than `max_retransmits` times: only heartbeats go there.
    Inactive,
}

/// A path that came up or went down, for the driver's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathEvent {
    /// Confirmed, or answering again after it was inactive.
    Up(SocketAddr),
    /// Inactive.
    Down(SocketAddr),
}

struct Path {
    addr: SocketAddr,
    confirmed: bool,
    state: PathState,
    errors: u32,
    srtt: Option<(Duration, Duration)>,
    rto: Duration,
    /// When the next heartbeat goes (none while one is outstanding).
    heartbeat_at: Option<Instant>,
    /// The heartbeat outstanding: its nonce, and when it went.
    outstanding: Option<(u64, Instant)>,
}

impl Path {
    fn new(addr: SocketAddr, confirmed: bool, timing: &Timing) -> Self {
        Self {
            addr,
            confirmed,
            state: PathState::Active,
            errors: 0,
            srtt: None,
            rto: timing.rto_initial,
            heartbeat_at: None,
            outstanding: None,
        }
    }
}

impl std::fmt::Display for PathEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathEvent::Up(a) => write!(f, "path to {a} is up"),
            PathEvent::Down(a) => write!(f, "path to {a} is down"),
        }
    }
}

/// Every path of an association; index 0 is the primary.
pub struct Paths {
    list: Vec<Path>,
    cfg: PathConfig,
    timing: Timing,
    nonce: u64,
    events: Vec<PathEvent>,
}

impl Paths {
    /// One path, confirmed: the address the association was opened with. `nonce` starts the
    /// heartbeat nonces (random: an off-path attacker must not guess one).
    pub fn new(primary: SocketAddr, cfg: PathConfig, timing: Timing, nonce: u64) -> Self {
        Self {
            list: vec![Path::new(primary, true, &timing)],
            cfg,
            timing,
            nonce,
            events: Vec::new(),
        }
    }

    pub fn primary(&self) -> SocketAddr {
        self.list[0].addr
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn addr(&self, i: usize) -> SocketAddr {
        self.list.get(i).map_or(self.list[0].addr, |p| p.addr)
    }

    /// Every address, primary first.
    pub fn addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.list.iter().map(|p| p.addr)
    }

    pub fn state(&self, i: usize) -> Option<(PathState, bool)> {
        self.list.get(i).map(|p| (p.state, p.confirmed))
    }

    /// Adds the addresses a peer listed (its INIT, INIT ACK or our cookie of its INIT),
    /// unconfirmed, their first heartbeat due now. Skipped: the ones already known, another
    /// address family than the primary's (one socket carries one), loopback addresses from a
    /// peer that is not on loopback (they would reach ourselves, RFC 9260 §5.1.2), and
    /// addresses no datagram can go to.
    pub fn add_listed(&mut self, ips: &[IpAddr], now: Instant) {
        let primary = self.list[0].addr;
        for &ip in ips {
            if self.list.len() >= MAX_PEER_ADDRESSES {
                break;
            }
            let usable = ip.is_ipv4() == primary.is_ipv4()
                && !ip.is_unspecified()
                && !ip.is_multicast()
                && (!ip.is_loopback() || primary.ip().is_loopback())
                && !matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
            let addr = SocketAddr::new(ip, primary.port());
            if !usable || self.list.iter().any(|p| p.addr == addr) {
                continue;
            }
            let mut p = Path::new(addr, false, &self.timing);
            p.heartbeat_at = Some(now);
            self.list.push(p);
        }
    }

    /// Heartbeats start on the primary once the association is established.
    pub fn start(&mut self, now: Instant) {
        let first = now + self.cfg.heartbeat_interval;
        for p in &mut self.list {
            p.heartbeat_at.get_or_insert(first);
        }
    }

    /// The path data goes to: the primary while it is active, else the first active
    /// confirmed path, else the confirmed one with the fewest errors.
    pub fn data_path(&self) -> usize {
        let usable = |p: &&Path| p.confirmed && p.state == PathState::Active;
        if usable(&&self.list[0]) {
            return 0;
        }
        if let Some(i) = self.list.iter().position(|p| usable(&p)) {
            return i;
        }
        self.list
            .iter()
            .enumerate()
            .filter(|(_, p)| p.confirmed)
            .min_by_key(|(_, p)| p.errors)
            .map_or(0, |(i, _)| i)
    }

    pub fn rto(&self, i: usize) -> Duration {
        self.list.get(i).map_or(self.timing.rto_initial, |p| p.rto)
    }

    /// An RTT measured on path `i` (RFC 9260 §6.3.1, per destination).
    pub fn rtt_sample(&mut self, i: usize, r: Duration) {
        let Some(p) = self.list.get_mut(i) else {
            return;
        };
        let (srtt, rttvar) = match p.srtt {
            None => (r, r / 2),
            Some((s, v)) => (s * 7 / 8 + r / 8, v * 3 / 4 + s.abs_diff(r) / 4),
        };
        p.srtt = Some((srtt, rttvar));
        p.rto = (srtt + 4 * rttvar).clamp(self.timing.rto_min, self.timing.rto_max);
    }

    /// The data sent on path `i` timed out (T3): one more error there, its RTO doubled.
    pub fn data_timeout(&mut self, i: usize) {
        self.error(i);
    }

    /// Something sent on path `i` was acknowledged: it is active again.
    pub fn acknowledged(&mut self, i: usize) {
        let Some(p) = self.list.get_mut(i) else {
            return;
        };
        p.errors = 0;
        if p.state == PathState::Inactive {
            self.events.push(PathEvent::Up(p.addr));
        }
        p.state = PathState::Active;
    }

    fn error(&mut self, i: usize) {
        let cfg = self.cfg;
        let max = self.timing.rto_max;
        let Some(p) = self.list.get_mut(i) else {
            return;
        };
        p.errors = p.errors.saturating_add(1);
        p.rto = (p.rto * 2).min(max);
        if p.errors > cfg.max_retransmits {
            if p.state != PathState::Inactive && p.confirmed {
                self.events.push(PathEvent::Down(p.addr));
            }
            p.state = PathState::Inactive;
        } else if p.errors > cfg.pf_max_retransmits && p.state == PathState::Active {
            p.state = PathState::PotentiallyFailed;
        }
    }

    /// A HEARTBEAT ACK: the path whose nonce it carries is confirmed and active, with an
    /// RTT sample. Its index and the RTT, if the nonce was one of ours.
    pub fn heartbeat_ack(&mut self, info: &[u8], now: Instant) -> Option<(usize, Duration)> {
        let nonce = u64::from_be_bytes(info.try_into().ok()?);
        let i = self
            .list
            .iter()
            .position(|p| p.outstanding.is_some_and(|(n, _)| n == nonce))?;
        let (_, sent) = self.list[i].outstanding.take()?;
        let interval = self.cfg.heartbeat_interval;
        let p = &mut self.list[i];
        if !p.confirmed {
            p.confirmed = true;
            self.events.push(PathEvent::Up(p.addr));
        }
        let rtt = now.saturating_duration_since(sent);
        self.rtt_sample(i, rtt);
        self.acknowledged(i);
        let p = &mut self.list[i];
        p.heartbeat_at = Some(now + interval + p.rto);
        Some((i, rtt))
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.list
            .iter()
            .filter_map(|p| match p.outstanding {
                Some((_, sent)) => Some(sent + p.rto),
                None => p.heartbeat_at,
            })
            .min()
    }

    /// Heartbeats due and timed out at `now`: the heartbeats to send (address and info), and
    /// how many heartbeats to `data_path` went unanswered (errors of the association too,
    /// RFC 9260 §8.1).
    pub fn handle_timeout(
        &mut self,
        now: Instant,
        data_path: usize,
        out: &mut Vec<(SocketAddr, Bytes)>,
    ) -> u32 {
        let mut assoc_errors = 0;
        for i in 0..self.list.len() {
            if let Some((_, sent)) = self.list[i].outstanding
                && now >= sent + self.list[i].rto
            {
                self.list[i].outstanding = None;
                self.error(i);
                if i == data_path && self.list[i].confirmed {
                    assoc_errors += 1;
                }
                // Probed again at once when in doubt, later when given up on.
                let p = &mut self.list[i];
                p.heartbeat_at = Some(match (p.confirmed, p.state) {
                    (true, PathState::Inactive) => now + self.cfg.heartbeat_interval,
                    _ => now,
                });
            }
            let p = &mut self.list[i];
            if p.outstanding.is_none() && p.heartbeat_at.is_some_and(|t| now >= t) {
                self.nonce = self.nonce.wrapping_add(1);
                p.outstanding = Some((self.nonce, now));
                p.heartbeat_at = None;
                out.push((p.addr, Bytes::copy_from_slice(&self.nonce.to_be_bytes())));
            }
        }
        assoc_errors
    }

    /// Path changes since the last call.
    pub fn take_events(&mut self) -> Vec<PathEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn listed_addresses_are_filtered_and_take_the_primarys_port() {
        let now = Instant::now();
        let mut p = Paths::new(
            addr("192.0.2.1:9899"),
            PathConfig::default(),
            Timing::default(),
            1,
        );
        p.add_listed(
            &[
                "192.0.2.1".parse().unwrap(),
                "198.51.100.1".parse().unwrap(),
                "127.0.0.1".parse().unwrap(),
                "2001:db8::1".parse().unwrap(),
                "0.0.0.0".parse().unwrap(),
                "255.255.255.255".parse().unwrap(),
            ],
            now,
        );
        let all: Vec<_> = p.addrs().collect();
        assert_eq!(all, [addr("192.0.2.1:9899"), addr("198.51.100.1:9899")]);
        // Unconfirmed: no data there, a heartbeat at once.
        assert_eq!(p.data_path(), 0);
        let mut out = Vec::new();
        p.handle_timeout(now, 0, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, addr("198.51.100.1:9899"));
    }

    /// Paths to 192.0.2.1 (primary) and 198.51.100.1, listed at `t0`.
    fn two(t0: Instant) -> Paths {
        let mut p = Paths::new(
            addr("192.0.2.1:0"),
            PathConfig::default(),
            Timing::default(),
            1,
        );
        p.add_listed(&["198.51.100.1".parse().unwrap()], t0);
        p
    }

    #[test]
    fn a_failing_primary_hands_data_to_a_confirmed_path_and_takes_it_back() {
        let t0 = Instant::now();
        let mut p = two(t0);
        p.start(t0);
        let mut out = Vec::new();
        p.handle_timeout(t0, 0, &mut out);
        let rtt = Duration::from_millis(5);
        assert_eq!(p.heartbeat_ack(&out[0].1, t0 + rtt), Some((1, rtt)));
        assert_eq!(p.take_events(), [PathEvent::Up(addr("198.51.100.1:0"))]);
        assert_eq!(p.data_path(), 0);
        // One T3 on the primary: potentially failed, data moves.
        p.data_timeout(0);
        assert_eq!(p.state(0), Some((PathState::PotentiallyFailed, true)));
        assert_eq!(p.data_path(), 1);
        for _ in 0..5 {
            p.data_timeout(0);
        }
        assert_eq!(p.state(0), Some((PathState::Inactive, true)));
        assert_eq!(p.take_events(), [PathEvent::Down(addr("192.0.2.1:0"))]);
        // It answers again: back to the primary.
        p.acknowledged(0);
        assert_eq!(p.data_path(), 0);
        assert_eq!(p.take_events(), [PathEvent::Up(addr("192.0.2.1:0"))]);
    }

    #[test]
    fn a_nonce_that_is_not_outstanding_confirms_nothing() {
        let t0 = Instant::now();
        let mut p = two(t0);
        let mut out = Vec::new();
        p.handle_timeout(t0, 0, &mut out);
        assert_eq!(p.heartbeat_ack(&99u64.to_be_bytes(), t0), None);
        assert_eq!(p.heartbeat_ack(b"short", t0), None);
        assert_eq!(p.state(1), Some((PathState::Active, false)));
        assert_eq!(p.data_path(), 0);
    }
}
