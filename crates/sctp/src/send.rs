//! The sending half of an association: messages cut into DATA chunks, chunks in flight until
//! a SACK covers them, the retransmission timer and its RTO (RFC 9260 §6.3), fast
//! retransmission after three miss indications (§7.2.4), and congestion control (§7.2).

use crate::chunk::{Data, Sack};
use crate::recv::after;
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Timer settings (RFC 9260 §16 defaults but RTO.Min, which is lower: RSerPool runs mostly
/// within a data centre, where a second's stall after one loss is long).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub rto_initial: Duration,
    pub rto_min: Duration,
    pub rto_max: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            rto_initial: Duration::from_secs(1),
            rto_min: Duration::from_millis(200),
            rto_max: Duration::from_secs(60),
        }
    }
}

/// A DATA chunk sent and not yet acknowledged.
struct InFlight {
    data: Data,
    sent: Option<Instant>,
    /// Times sent again.
    retransmits: u32,
    /// Covered by a gap block of the latest SACK.
    gap_acked: bool,
    /// Miss indications (§7.2.4).
    missing: u32,
    fast_retransmitted: bool,
    /// To go out again.
    again: bool,
}

/// What a SACK did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Acked {
    /// Bytes newly acknowledged (cumulatively or by gap blocks).
    pub bytes: usize,
    /// Whether the cumulative TSN moved.
    pub advanced: bool,
}

pub struct Sender {
    next_tsn: u32,
    ssn: HashMap<u16, u16>,
    /// Not yet sent.
    queue: VecDeque<Data>,
    flight: VecDeque<InFlight>,
    /// Highest TSN the peer acknowledged cumulatively.
    cum_acked: u32,
    /// Bytes in flight, not gap-acknowledged.
    outstanding: usize,
    peer_rwnd: usize,
    mtu: usize,
    cwnd: usize,
    ssthresh: usize,
    partial_bytes_acked: usize,
    /// In fast recovery until this TSN is acknowledged.
    recovery: Option<u32>,
    timing: Timing,
    srtt: Option<(Duration, Duration)>,
    rto: Duration,
    /// The retransmission timer.
    t3: Option<Instant>,
    /// Retransmission timeouts in a row (reset by a SACK that acknowledges something).
    pub errors: u32,
    /// Bytes that may be sent again now: one packet after a timeout or a fast
    /// retransmission, more as acknowledgements open the window (§6.3.3 E3, §7.2.4).
    rtx_budget: usize,
}

/// Bytes of a DATA chunk's header and the packet's common header.
const DATA_HEADER: usize = 16;
const COMMON_HEADER: usize = 12;

impl Sender {
    pub fn new(initial_tsn: u32, peer_rwnd: u32, mtu: usize, timing: Timing) -> Self {
        Self {
            next_tsn: initial_tsn,
            ssn: HashMap::new(),
            queue: VecDeque::new(),
            flight: VecDeque::new(),
            cum_acked: initial_tsn.wrapping_sub(1),
            outstanding: 0,
            peer_rwnd: peer_rwnd as usize,
            mtu,
            // RFC 9260 §7.2.1: min(4 MTU, max(2 MTU, 4380 bytes)).
            cwnd: (4 * mtu).min((2 * mtu).max(4380)),
            ssthresh: peer_rwnd as usize,
            partial_bytes_acked: 0,
            recovery: None,
            timing,
            srtt: None,
            rto: timing.rto_initial,
            t3: None,
            errors: 0,
            rtx_budget: 0,
        }
    }

    /// Queues a message, cut into chunks that fit one packet each.
    pub fn send(&mut self, stream: u16, ppid: u32, data: Bytes, unordered: bool) {
        let room = self.mtu - COMMON_HEADER - DATA_HEADER;
        let ssn = if unordered {
            0
        } else {
            let s = self.ssn.entry(stream).or_insert(0);
            let this = *s;
            *s = s.wrapping_add(1);
            this
        };
        let pieces = data.len().div_ceil(room).max(1);
        for i in 0..pieces {
            let payload = data.slice(i * room..((i + 1) * room).min(data.len()));
            self.queue.push_back(Data {
                tsn: self.next_tsn,
                stream,
                ssn,
                ppid,
                unordered,
                begin: i == 0,
                end: i + 1 == pieces,
                immediate: false,
                payload,
            });
            self.next_tsn = self.next_tsn.wrapping_add(1);
        }
    }

    /// A line on the sending side's state, for logs and failing tests.
    pub fn debug(&self) -> String {
        format!(
            "queue {} flight {} (gap-acked {}, again {}) outstanding {} cwnd {} ssthresh {} rwnd {} t3 {:?} cum {} recovery {:?}",
            self.queue.len(),
            self.flight.len(),
            self.flight.iter().filter(|f| f.gap_acked).count(),
            self.flight.iter().filter(|f| f.again).count(),
            self.outstanding,
            self.cwnd,
            self.ssthresh,
            self.peer_rwnd,
            self.t3.is_some(),
            self.cum_acked,
            self.recovery
        )
    }

    /// New data queued, not sent yet.
    pub fn has_new(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Nothing queued or in flight.
    pub fn idle(&self) -> bool {
        self.queue.is_empty() && self.flight.is_empty()
    }

    /// Payload bytes not yet acknowledged: queued and in flight.
    pub fn buffered(&self) -> usize {
        self.queue.iter().map(|d| d.payload.len()).sum::<usize>()
            + self
                .flight
                .iter()
                .map(|f| f.data.payload.len())
                .sum::<usize>()
    }

    pub fn cum_acked(&self) -> u32 {
        self.cum_acked
    }

    pub fn rto(&self) -> Duration {
        self.rto
    }

    pub fn timeout(&self) -> Option<Instant> {
        self.t3
    }

    /// An RTT measured elsewhere (a HEARTBEAT ACK) or here (§6.3.1).
    pub fn rtt_sample(&mut self, r: Duration) {
        let (srtt, rttvar) = match self.srtt {
            None => (r, r / 2),
            Some((s, v)) => {
                let diff = s.abs_diff(r);
                let v = v * 3 / 4 + diff / 4;
                (s * 7 / 8 + r / 8, v)
            }
        };
        self.srtt = Some((srtt, rttvar));
        self.rto = (srtt + 4 * rttvar).clamp(self.timing.rto_min, self.timing.rto_max);
    }

    /// Data moves to another path: its RTO, and RTT samples from scratch (§6.3.1: RTO per
    /// destination).
    pub fn set_rto(&mut self, rto: Duration) {
        self.rto = rto;
        self.srtt = None;
    }

    /// A heartbeat went unanswered: the RTO doubles, as after a retransmission timeout.
    pub fn back_off(&mut self) {
        self.rto = (self.rto * 2).min(self.timing.rto_max);
    }

    /// Takes a SACK.
    pub fn sack(&mut self, s: &Sack, now: Instant) -> Acked {
        let mut out = Acked::default();
        if after(self.cum_acked, s.cum_tsn) {
            return out; // An old SACK, overtaken.
        }
        let advanced = after(s.cum_tsn, self.cum_acked);
        self.cum_acked = s.cum_tsn;
        let mut sample = None;
        while let Some(f) = self.flight.front() {
            if after(f.data.tsn, s.cum_tsn) {
                break;
            }
            let Some(f) = self.flight.pop_front() else {
                break;
            };
            if !f.gap_acked {
                self.outstanding -= f.data.payload.len();
                out.bytes += f.data.payload.len();
            }
            if f.retransmits == 0 {
                sample = f.sent.map(|t| now.saturating_duration_since(t));
            }
        }
        // Gap blocks: what is acknowledged above the cumulative TSN.
        let mut highest_new = None;
        for f in self.flight.iter_mut() {
            let off = f.data.tsn.wrapping_sub(s.cum_tsn);
            let in_gap = s
                .gaps
                .iter()
                .any(|&(a, b)| off >= u32::from(a) && off <= u32::from(b));
            if in_gap && !f.gap_acked {
                f.gap_acked = true;
                f.again = false;
                self.outstanding -= f.data.payload.len();
                out.bytes += f.data.payload.len();
                highest_new = Some(f.data.tsn);
            } else if !in_gap && f.gap_acked {
                // Reneged (§6.2.1): outstanding again.
                f.gap_acked = false;
                self.outstanding += f.data.payload.len();
            }
        }
        // Miss indications for what lies below the highest newly acknowledged TSN.
        let mut fast = false;
        if let Some(h) = highest_new {
            for f in self.flight.iter_mut() {
                if !after(h, f.data.tsn) {
                    break;
                }
                if !f.gap_acked && f.sent.is_some() {
                    f.missing += 1;
                    if f.missing == 3 && !f.fast_retransmitted {
                        f.fast_retransmitted = true;
                        f.again = true;
                        fast = true;
                    }
                }
            }
        }
        if fast {
            self.rtx_budget = self.rtx_budget.max(self.mtu);
        }
        if fast && self.recovery.is_none() {
            self.ssthresh = (self.cwnd / 2).max(4 * self.mtu);
            self.cwnd = self.ssthresh;
            self.partial_bytes_acked = 0;
            self.recovery = self.flight.back().map(|f| f.data.tsn);
        }
        if let Some(r) = self.recovery
            && !after(r, s.cum_tsn)
        {
            self.recovery = None;
        }
        if let Some(r) = sample {
            self.rtt_sample(r);
        }
        if out.bytes > 0 {
            self.errors = 0;
            if self.flight.iter().any(|f| f.again) {
                self.rtx_budget += out.bytes;
            }
        }
        if advanced && self.recovery.is_none() {
            self.grow(out.bytes);
        }
        self.peer_rwnd = (s.a_rwnd as usize).saturating_sub(self.outstanding);
        out.advanced = advanced;
        self.t3 = if self.flight.iter().all(|f| f.gap_acked) {
            None
        } else if advanced || self.t3.is_none() {
            Some(now + self.rto)
        } else {
            self.t3
        };
        out
    }

    /// Congestion window growth on a cumulative acknowledgement (§7.2.1, §7.2.2).
    fn grow(&mut self, acked: usize) {
        if self.cwnd <= self.ssthresh {
            self.cwnd += acked.min(self.mtu);
        } else {
            self.partial_bytes_acked += acked;
            if self.partial_bytes_acked >= self.cwnd {
                self.partial_bytes_acked -= self.cwnd;
                self.cwnd += self.mtu;
            }
        }
    }

    /// The retransmission timer fired: everything outstanding goes again, the window shrinks
    /// to one MTU, the RTO doubles (§6.3.3, §7.2.3). True if the timer had expired.
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        if self.t3.is_none_or(|t| now < t) {
            return false;
        }
        self.errors += 1;
        self.ssthresh = (self.cwnd / 2).max(4 * self.mtu);
        self.cwnd = self.mtu;
        self.partial_bytes_acked = 0;
        self.recovery = None;
        self.rto = (self.rto * 2).min(self.timing.rto_max);
        for f in self.flight.iter_mut().filter(|f| !f.gap_acked) {
            f.again = true;
        }
        self.rtx_budget = self.mtu;
        self.t3 = Some(now + self.rto);
        true
    }

    /// Chunks for one packet with `room` bytes for chunks: retransmissions first, then new
    /// data as far as the congestion and receive windows allow.
    pub fn chunks(&mut self, room: usize, now: Instant) -> Vec<Data> {
        let mut out = Vec::new();
        let mut left = room;
        let mut waiting = false;
        for f in self.flight.iter_mut().filter(|f| f.again) {
            let size = DATA_HEADER + f.data.payload.len().next_multiple_of(4);
            if size > left || f.data.payload.len() > self.rtx_budget {
                waiting = true;
                break;
            }
            left -= size;
            self.rtx_budget -= f.data.payload.len();
            f.again = false;
            f.retransmits += 1;
            f.sent = Some(now);
            out.push(f.data.clone());
        }
        // Retransmissions before new data.
        while let Some(d) = self.queue.front().filter(|_| !waiting) {
            let size = DATA_HEADER + d.payload.len().next_multiple_of(4);
            let window_full = self.outstanding >= self.cwnd
                || (d.payload.len() > self.peer_rwnd && !self.flight.is_empty());
            if size > left || window_full {
                break;
            }
            let Some(d) = self.queue.pop_front() else {
                break;
            };
            left -= size;
            self.outstanding += d.payload.len();
            self.peer_rwnd = self.peer_rwnd.saturating_sub(d.payload.len());
            out.push(d.clone());
            self.flight.push_back(InFlight {
                data: d,
                sent: Some(now),
                retransmits: 0,
                gap_acked: false,
                missing: 0,
                fast_retransmitted: false,
                again: false,
            });
        }
        if !out.is_empty() && self.t3.is_none() {
            self.t3 = Some(now + self.rto);
        }
        out
    }
}
