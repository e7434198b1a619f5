//! The receiving half of an association: which TSNs arrived (for SACK), and messages put
//! back together from their fragments, in stream order or unordered (RFC 9260 §6.2, §6.5,
//! §6.6, §6.9).

use crate::chunk::{Data, Sack};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Serial-number comparison of TSNs (RFC 1982 with 32 bits): `a` after `b`.
pub fn after(a: u32, b: u32) -> bool {
    a != b && a.wrapping_sub(b) < 1 << 31
}

/// A whole message received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub stream: u16,
    pub ppid: u32,
    pub unordered: bool,
    pub data: Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    #[error("DATA on stream {0}, beyond the {1} inbound streams")]
    Stream(u16, u16),
    #[error("the receive buffer is full ({0} bytes)")]
    Full(usize),
}

pub struct Receiver {
    /// Every TSN up to this one arrived.
    cum: u32,
    /// Those after `cum` that arrived.
    above: BTreeSet<u32>,
    /// Duplicates since the last SACK.
    dups: Vec<u32>,
    /// Fragments waiting for the rest of their message, by TSN.
    fragments: BTreeMap<u32, Data>,
    /// Per stream: the next SSN to deliver, and whole messages waiting for it.
    streams: HashMap<u16, Stream>,
    inbound_streams: u16,
    /// Bytes held (fragments and messages not delivered yet), against `window`.
    held: usize,
    window: usize,
    /// Messages ready for the application.
    ready: std::collections::VecDeque<Message>,
}

#[derive(Default)]
struct Stream {
    next: u16,
    waiting: BTreeMap<u16, Message>,
}

impl Receiver {
    /// The peer's first TSN will be `initial_tsn`.
    pub fn new(initial_tsn: u32, inbound_streams: u16, window: usize) -> Self {
        Self {
            cum: initial_tsn.wrapping_sub(1),
            above: BTreeSet::new(),
            dups: Vec::new(),
            fragments: BTreeMap::new(),
            streams: HashMap::new(),
            inbound_streams,
            held: 0,
            window,
            ready: Default::default(),
        }
    }

    /// Takes a DATA chunk; `Ok(false)` when it was a duplicate (or beyond what can be held:
    /// dropped, the sender retransmits).
    pub fn data(&mut self, d: Data) -> Result<bool, RecvError> {
        let tsn = d.tsn;
        if !after(tsn, self.cum) || self.above.contains(&tsn) {
            self.dups.push(tsn);
            return Ok(false);
        }
        if d.stream >= self.inbound_streams {
            return Err(RecvError::Stream(d.stream, self.inbound_streams));
        }
        if self.held + d.payload.len() > self.window && after(tsn, self.cum.wrapping_add(1)) {
            // Only the next expected TSN is taken beyond the window (RFC 9260 §6.2).
            return Err(RecvError::Full(self.window));
        }
        self.above.insert(tsn);
        while self.above.remove(&self.cum.wrapping_add(1)) {
            self.cum = self.cum.wrapping_add(1);
        }
        self.held += d.payload.len();
        self.fragments.insert(tsn, d);
        self.assemble(tsn);
        Ok(true)
    }

    /// Looks for a whole message around the fragment `tsn`.
    fn assemble(&mut self, tsn: u32) {
        // Back to its first fragment, forward to its last; every TSN between must be here.
        let mut first = tsn;
        loop {
            let Some(f) = self.fragments.get(&first) else {
                return;
            };
            if f.begin {
                break;
            }
            first = first.wrapping_sub(1);
        }
        let mut last = tsn;
        loop {
            let Some(f) = self.fragments.get(&last) else {
                return;
            };
            if f.end {
                break;
            }
            last = last.wrapping_add(1);
        }
        let mut data = BytesMut::new();
        let mut t = first;
        let mut head = None;
        loop {
            let Some(f) = self.fragments.remove(&t) else {
                return;
            };
            data.extend_from_slice(&f.payload);
            head.get_or_insert((f.stream, f.ssn, f.ppid, f.unordered));
            if t == last {
                break;
            }
            t = t.wrapping_add(1);
        }
        let Some((stream, ssn, ppid, unordered)) = head else {
            return;
        };
        let m = Message {
            stream,
            ppid,
            unordered,
            data: data.freeze(),
        };
        if unordered {
            self.held -= m.data.len();
            self.ready.push_back(m);
            return;
        }
        let s = self.streams.entry(stream).or_default();
        s.waiting.insert(ssn, m);
        while let Some(m) = s.waiting.remove(&s.next) {
            s.next = s.next.wrapping_add(1);
            self.held -= m.data.len();
            self.ready.push_back(m);
        }
    }

    /// The next message for the application.
    pub fn poll(&mut self) -> Option<Message> {
        self.ready.pop_front()
    }

    pub fn cum_tsn(&self) -> u32 {
        self.cum
    }

    /// Whether TSNs are missing below the highest received (a SACK should go at once).
    pub fn has_gaps(&self) -> bool {
        !self.above.is_empty()
    }

    /// The SACK for what arrived, and the duplicates since the last one.
    pub fn sack(&mut self) -> Sack {
        let mut gaps: Vec<(u16, u16)> = Vec::new();
        for &t in &self.above {
            let off = t.wrapping_sub(self.cum);
            if off > u32::from(u16::MAX) {
                break;
            }
            let off = off as u16;
            match gaps.last_mut() {
                Some((_, end)) if end.wrapping_add(1) == off => *end = off,
                _ => gaps.push((off, off)),
            }
        }
        Sack {
            cum_tsn: self.cum,
            a_rwnd: self.window.saturating_sub(self.held).min(u32::MAX as usize) as u32,
            gaps,
            dups: std::mem::take(&mut self.dups),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag(tsn: u32, ssn: u16, begin: bool, end: bool, text: &'static str) -> Data {
        Data {
            tsn,
            stream: 0,
            ssn,
            ppid: 11,
            unordered: false,
            begin,
            end,
            immediate: false,
            payload: Bytes::from_static(text.as_bytes()),
        }
    }

    #[test]
    fn serial_numbers_wrap() {
        assert!(after(1, 0));
        assert!(after(0, u32::MAX));
        assert!(!after(u32::MAX, 0));
        assert!(!after(5, 5));
    }

    #[test]
    fn fragments_out_of_order_make_messages_in_stream_order() {
        let mut r = Receiver::new(u32::MAX - 1, 1, 1 << 20);
        // Message 0 in three fragments (TSNs MAX-1, MAX, 0), message 1 whole (TSN 1).
        assert!(r.data(frag(1, 1, true, true, "second")).unwrap());
        assert_eq!(r.poll(), None, "waits for SSN 0");
        let s = r.sack();
        assert_eq!((s.cum_tsn, s.gaps.clone()), (u32::MAX - 2, vec![(4, 4)]));
        r.data(frag(0, 0, false, true, "!")).unwrap();
        r.data(frag(u32::MAX - 1, 0, true, false, "fir")).unwrap();
        assert_eq!(r.poll(), None);
        assert_eq!(r.sack().gaps, vec![(2, 3)]);
        r.data(frag(u32::MAX, 0, false, false, "st")).unwrap();
        assert_eq!(r.poll().unwrap().data, "first!");
        assert_eq!(r.poll().unwrap().data, "second");
        assert_eq!(r.cum_tsn(), 1);
        assert!(
            !r.data(frag(0, 0, false, true, "!")).unwrap(),
            "a duplicate"
        );
        let s = r.sack();
        assert_eq!((s.gaps.len(), s.dups.clone()), (0, vec![0]));
        assert_eq!(s.a_rwnd, 1 << 20, "everything delivered");
    }
}
