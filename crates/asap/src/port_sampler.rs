//! What a sidecar samples of the server it registers, every few milliseconds under policy
//! credits: the port's accept queue and its established connections.
//!
//! Why not one sock_diag dump per sample: a dump walks the host's whole established-socket
//! hash table whatever its filter (`crate::sock_diag`), and at one sample per 5 ms that cost
//! a sidecar more than half a core with no traffic (docs/PERFORMANCE.md). Here:
//! - the accept queue comes from an exact lookup of the port's listener, one hash lookup;
//!   when several listeners share the port (`SO_REUSEPORT`) their queues are summed from a
//!   dump, every sample, as before;
//! - the established connections come from a counter the kernel keeps per connection event
//!   ([`ConnectionCount`]; the `serve` command's is an eBPF program), corrected once a second
//!   by one dump for what it cannot see (connections from before it started); without one,
//!   from a dump at most every [`DUMP_EVERY`].

use crate::sock_diag::{PortLoad, SockDiag};
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::warn;

/// Without a counter, how old the established count may be.
pub const DUMP_EVERY: Duration = Duration::from_millis(100);
/// With one, how often a dump corrects it.
pub const RESYNC_EVERY: Duration = Duration::from_secs(1);

/// Connections established on the port less those that left the state, counted from some
/// moment on (the sampler learns the offset to the true count from a dump).
pub trait ConnectionCount: Send {
    fn established(&mut self) -> io::Result<i64>;
}

pub struct PortSampler {
    addr: SocketAddr,
    diag: Option<SockDiag>,
    counter: Option<Box<dyn ConnectionCount>>,
    /// True count less the counter's, at the last dump.
    offset: i64,
    dumped: Option<Instant>,
    /// What the last dump found.
    last: PortLoad,
    /// Whether the exact lookup finds the listener the dumps see (not when it is bound to a
    /// device, say); if not, every sample dumps.
    exact: bool,
}

impl PortSampler {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            diag: None,
            counter: None,
            offset: 0,
            dumped: None,
            last: PortLoad::default(),
            exact: true,
        }
    }

    /// Takes the established connections from `counter`, which counts from now on.
    pub fn with_counter(mut self, counter: Box<dyn ConnectionCount>) -> Self {
        self.counter = Some(counter);
        self
    }

    /// Whether a kernel counter gives the established connections.
    pub fn counted(&self) -> bool {
        self.counter.is_some()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port's load now; `Ok(None)` when nothing listens on it.
    pub fn sample(&mut self) -> io::Result<Option<PortLoad>> {
        let now = Instant::now();
        let every = if self.counter.is_some() {
            RESYNC_EVERY
        } else {
            DUMP_EVERY
        };
        let due = self.dumped.is_none_or(|t| now >= t + every);
        if due || !self.exact || self.last.listeners != 1 {
            return self.dump(now);
        }
        let addr = self.addr;
        let Some(listener) = self.diag()?.listener(addr)? else {
            // Gone, or not found this way: a dump says which.
            let load = self.dump(now)?;
            if load.is_some_and(|l| l.listeners == 1) {
                warn!(
                    "the listener on {addr} is not found by an exact lookup (bound to a device?): \
                     sampling it by sock_diag dumps, which cost more"
                );
                self.exact = false;
            }
            return Ok(load);
        };
        let established = match self.counted_established() {
            Some(n) => n,
            None => self.last.established,
        };
        Ok(Some(PortLoad {
            backlog: listener.backlog,
            limit: listener.limit,
            established,
            listeners: 1,
        }))
    }

    /// One dump: every figure, and the counter's offset.
    fn dump(&mut self, now: Instant) -> io::Result<Option<PortLoad>> {
        let before = self.raw_count();
        let addr = self.addr;
        let load = self.diag()?.port_load(addr)?;
        self.dumped = Some(now);
        self.last = load.unwrap_or_default();
        if let Some(c) = before {
            self.offset = i64::from(self.last.established) - c;
        }
        Ok(load)
    }

    fn counted_established(&mut self) -> Option<u32> {
        let c = self.raw_count()?;
        Some((c + self.offset).clamp(0, i64::from(u32::MAX)) as u32)
    }

    /// The counter's figure; a counter that fails is dropped (dumps from then on).
    fn raw_count(&mut self) -> Option<i64> {
        let c = self.counter.as_mut()?;
        match c.established() {
            Ok(n) => Some(n),
            Err(e) => {
                warn!(
                    "the kernel's connection count for {} failed ({e}): counting by sock_diag \
                     dumps from now on",
                    self.addr
                );
                self.counter = None;
                None
            }
        }
    }

    fn diag(&mut self) -> io::Result<&mut SockDiag> {
        if self.diag.is_none() {
            self.diag = Some(SockDiag::new()?);
        }
        // Set just above.
        self.diag
            .as_mut()
            .ok_or_else(|| io::Error::other("no sock_diag socket"))
    }
}

impl std::fmt::Debug for PortSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortSampler")
            .field("addr", &self.addr)
            .field("counted", &self.counted())
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicI64, Ordering};

    /// A counter the test moves by hand.
    struct Fake(Arc<AtomicI64>);
    impl ConnectionCount for Fake {
        fn established(&mut self) -> io::Result<i64> {
            Ok(self.0.load(Ordering::Relaxed))
        }
    }

    #[test]
    fn the_queue_is_looked_up_and_the_connections_counted_between_dumps() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let _before = TcpStream::connect(addr).unwrap();
        let count = Arc::new(AtomicI64::new(0));
        let mut s = PortSampler::new(addr).with_counter(Box::new(Fake(count.clone())));
        // The first sample dumps: one connection from before the counter, in the queue.
        let first = s.sample().unwrap().unwrap();
        assert_eq!((first.backlog, first.established), (1, 1));
        // Two more: the queue from the lookup, the connections from the counter (+ offset).
        let _more: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        count.store(2, Ordering::Relaxed);
        let next = s.sample().unwrap().unwrap();
        assert_eq!((next.backlog, next.established), (3, 3), "{next:?}");
        // The counter is believed until the next dump, wrong or not.
        count.store(10, Ordering::Relaxed);
        assert_eq!(s.sample().unwrap().unwrap().established, 11);
        s.dumped = Some(Instant::now() - RESYNC_EVERY);
        assert_eq!(s.sample().unwrap().unwrap().established, 3, "corrected");
        drop(l);
        assert_eq!(s.sample().unwrap(), None, "nothing listens");
    }

    #[test]
    fn without_a_counter_the_connections_come_from_dumps() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut s = PortSampler::new(addr);
        assert_eq!(s.sample().unwrap().unwrap().established, 0);
        let _c = TcpStream::connect(addr).unwrap();
        let between = s.sample().unwrap().unwrap();
        assert_eq!(
            (between.backlog, between.established),
            (1, 0),
            "{between:?}"
        );
        s.dumped = Some(Instant::now() - DUMP_EVERY);
        assert_eq!(s.sample().unwrap().unwrap().established, 1);
    }
}
