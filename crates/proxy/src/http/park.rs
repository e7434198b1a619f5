//! Kept-alive client connections parked without a task while they stay idle.
//!
//! An idle connection waiting in its own task costs the task (its future and tokio's
//! bookkeeping around it, under 1 KB) and its registration with tokio's reactor (256 bytes):
//! about 1.1 KiB each, against a few hundred bytes in the event loops of HAProxy and nginx.
//! A connection that stays idle for a while (the HTTP/1.1 front decides when) is handed here:
//! its socket leaves tokio's reactor for one epoll set of the parker's, and what it needs to go
//! on (its socket, address, context and place among the connections, boxed) waits in a slab.
//! When the client sends its next request (or closes), the connection gets a task again, which
//! reads at once; at its idle timeout the parker closes it, and when the proxy drains, after
//! the drain's grace, as a connection waiting in its task would be.
//!
//! Busy connections never come here: only those that idle longer than the front's threshold
//! pay the moves (two `epoll_ctl` calls each way and a task).

use rustix::event::epoll;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::warn;

/// A parked connection: its socket, for the epoll set, and how it goes on.
pub(crate) trait Parkable: AsFd + Send + 'static {
    /// The client sent something or closed: serve it in a task of its own.
    fn resume(self: Box<Self>);
}

type Entry = (Box<dyn Parkable>, Instant);

/// Where connections are parked (one per proxy), held by every listener's context.
#[derive(Clone)]
pub(crate) struct Parker {
    tx: mpsc::UnboundedSender<Entry>,
    parked: Arc<AtomicUsize>,
}

impl Parker {
    /// Starts the parker's task (on the current runtime); `grace`: how long a parked
    /// connection may still bring a request once `draining` is set.
    pub(crate) fn start(draining: watch::Receiver<bool>, grace: Duration) -> io::Result<Self> {
        let set = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        // `unsafe` since tokio 1.53.
        #[allow(unsafe_code)]
        // SAFETY: the AsyncFd owns the epoll set, whose fd stays open and the same until the
        // AsyncFd is dropped.
        let set = unsafe { AsyncFd::register_with_interest(set, tokio::io::Interest::READABLE) };
        let set = set.map_err(io::Error::from)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let parked = Arc::new(AtomicUsize::new(0));
        let lot = Lot::new(set, parked.clone(), grace);
        tokio::spawn(lot.run(rx, draining));
        Ok(Self { tx, parked })
    }

    /// Parks `c` until the client sends something, or until `until` (its idle timeout) when it
    /// does not. `Err` gives it back when the parker is gone.
    pub(crate) fn park(
        &self,
        c: Box<dyn Parkable>,
        until: Instant,
    ) -> Result<(), Box<dyn Parkable>> {
        self.tx.send((c, until)).map_err(|e| e.0.0)
    }

    /// Connections parked now.
    pub(crate) fn parked(&self) -> usize {
        self.parked.load(Ordering::Relaxed)
    }
}

/// The parker's state, owned by its task.
struct Lot {
    set: AsyncFd<OwnedFd>,
    /// Parked connections by token (their index), with their deadlines and a generation
    /// that tells a slot's occupants apart.
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// (deadline, slot, generation), earliest first; entries made stale by a resume or an
    /// earlier deadline are skipped when met.
    deadlines: BinaryHeap<Reverse<(Instant, usize, u64)>>,
    parked: Arc<AtomicUsize>,
    grace: Duration,
}

#[derive(Default)]
struct Slot {
    conn: Option<Box<dyn Parkable>>,
    until: Option<Instant>,
    generation: u64,
}

/// Events taken from the epoll set per call.
const EVENTS: usize = 256;

impl Lot {
    fn new(set: AsyncFd<OwnedFd>, parked: Arc<AtomicUsize>, grace: Duration) -> Self {
        Self {
            set,
            slots: Vec::new(),
            free: Vec::new(),
            deadlines: BinaryHeap::new(),
            parked,
            grace,
        }
    }

    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Entry>,
        mut draining: watch::Receiver<bool>,
    ) {
        let mut open = true;
        let mut drained = false;
        loop {
            if !open && self.parked.load(Ordering::Relaxed) == 0 {
                return;
            }
            let next = self.deadlines.peek().map(|Reverse((at, _, _))| *at);
            tokio::select! {
                e = rx.recv(), if open => match e {
                    Some((c, until)) => {
                        let until = if drained { until.min(Instant::now() + self.grace) } else { until };
                        self.add(c, until);
                    }
                    None => open = false,
                },
                ready = self.set.readable() => match ready {
                    Ok(mut guard) => {
                        // Cleared first: an event after the last `wait` below sets it again.
                        guard.clear_ready();
                        self.ready();
                    }
                    Err(e) => {
                        warn!("proxy: parked connections' epoll set failed: {e}; they are closed");
                        return;
                    }
                },
                () = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    self.expire();
                }
                _ = draining.wait_for(|d| *d), if !drained => {
                    drained = true;
                    self.drain();
                }
            }
        }
    }

    fn add(&mut self, c: Box<dyn Parkable>, until: Instant) {
        let i = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            self.slots.len() - 1
        });
        let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        if let Err(e) = epoll::add(
            self.set.get_ref(),
            c.as_fd(),
            epoll::EventData::new_u64(i as u64),
            flags,
        ) {
            // Served in a task again rather than lost.
            warn!("proxy: cannot park a connection: {e}");
            self.free.push(i);
            c.resume();
            return;
        }
        let slot = &mut self.slots[i];
        slot.generation += 1;
        slot.conn = Some(c);
        slot.until = Some(until);
        self.deadlines.push(Reverse((until, i, slot.generation)));
        self.parked.fetch_add(1, Ordering::Relaxed);
        self.prune();
    }

    /// Rebuilds the deadlines from the parked connections when most of them are stale (a
    /// connection that comes back leaves its deadline behind until it passes): clients that
    /// pause just long enough to be parked, again and again, would grow them with no bound.
    fn prune(&mut self) {
        let live = self.parked.load(Ordering::Relaxed);
        if self.deadlines.len() <= 2 * live + 1024 {
            return;
        }
        self.deadlines = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.conn.is_some())
            .filter_map(|(i, s)| Some(Reverse((s.until?, i, s.generation))))
            .collect();
    }

    /// Takes slot `i`'s connection out (and its socket out of the set).
    fn take(&mut self, i: usize) -> Option<Box<dyn Parkable>> {
        let slot = self.slots.get_mut(i)?;
        let c = slot.conn.take()?;
        slot.until = None;
        self.free.push(i);
        self.parked.fetch_sub(1, Ordering::Relaxed);
        let _ = epoll::delete(self.set.get_ref(), c.as_fd());
        Some(c)
    }

    /// Resumes every connection whose client sent something or closed.
    fn ready(&mut self) {
        let mut events = Vec::with_capacity(EVENTS);
        loop {
            events.clear();
            let n = match epoll::wait(
                self.set.get_ref(),
                rustix::buffer::spare_capacity(&mut events),
                Some(&rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                }),
            ) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return,
            };
            for e in events.iter() {
                let data = e.data;
                if let Some(c) = self.take(data.u64() as usize) {
                    c.resume();
                }
            }
            if n < EVENTS {
                return;
            }
        }
    }

    /// Closes the connections whose deadline passed.
    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(&Reverse((at, i, generation))) = self.deadlines.peek() {
            if at > now {
                return;
            }
            self.deadlines.pop();
            let current = self
                .slots
                .get(i)
                .is_some_and(|s| s.generation == generation && s.until == Some(at));
            if current {
                // Dropped: the socket closes (the client sent nothing, so nothing is lost).
                drop(self.take(i));
            }
        }
    }

    /// The proxy drains: every parked connection may still bring a request within the grace.
    fn drain(&mut self) {
        let by = Instant::now() + self.grace;
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.conn.is_some() && s.until.is_some_and(|u| u > by) {
                s.until = Some(by);
                self.deadlines.push(Reverse((by, i, s.generation)));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// A parked connection that counts its resumptions.
    struct Conn(TcpStream, Arc<AtomicUsize>);
    impl AsFd for Conn {
        fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
            self.0.as_fd()
        }
    }
    impl Parkable for Conn {
        fn resume(self: Box<Self>) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn lot() -> Lot {
        let set = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        #[allow(unsafe_code)]
        // SAFETY: as in `Parker::start`.
        let set = unsafe { AsyncFd::register_with_interest(set, tokio::io::Interest::READABLE) };
        Lot::new(set.unwrap(), Arc::default(), Duration::from_secs(1))
    }

    /// `n` connected pairs: (the client's end, the proxy's end).
    fn pairs(n: usize) -> Vec<(TcpStream, TcpStream)> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        (0..n)
            .map(|_| {
                let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                let (s, _) = l.accept().unwrap();
                s.set_nonblocking(true).unwrap();
                (c, s)
            })
            .collect()
    }

    #[tokio::test]
    async fn connections_that_come_back_again_and_again_leave_no_pile_of_deadlines() {
        let mut lot = lot();
        let resumed = Arc::new(AtomicUsize::new(0));
        let mut conns = pairs(100);
        let far = Instant::now() + Duration::from_secs(3600);
        for round in 1..=50 {
            for (_, s) in conns.iter_mut() {
                let c = Conn(s.try_clone().unwrap(), resumed.clone());
                lot.add(Box::new(c), far);
            }
            assert_eq!(lot.parked.load(Ordering::Relaxed), 100);
            // Every client sends a byte: every connection resumes.
            for (c, _) in conns.iter_mut() {
                c.write_all(b"x").unwrap();
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while resumed.load(Ordering::Relaxed) < round * 100 {
                assert!(std::time::Instant::now() < deadline, "not all resumed");
                lot.ready();
            }
            for (_, s) in conns.iter_mut() {
                let mut b = [0u8; 8];
                let _ = s.read(&mut b);
            }
            assert_eq!(lot.parked.load(Ordering::Relaxed), 0);
            assert!(
                lot.deadlines.len() <= 2 * 100 + 1024,
                "{} deadlines kept",
                lot.deadlines.len()
            );
        }
    }

    #[tokio::test]
    async fn a_parked_connection_is_closed_at_its_deadline_and_sooner_in_a_drain() {
        let mut lot = lot();
        let resumed = Arc::new(AtomicUsize::new(0));
        let mut conns = pairs(2);
        let now = Instant::now();
        for (i, (_, s)) in conns.iter().enumerate() {
            let until = now + Duration::from_secs(if i == 0 { 0 } else { 3600 });
            lot.add(
                Box::new(Conn(s.try_clone().unwrap(), resumed.clone())),
                until,
            );
        }
        // The proxy's ends are duplicates: closing the parked ones leaves these open.
        let ends: Vec<TcpStream> = conns
            .drain(..)
            .map(|(c, s)| {
                drop(s);
                c
            })
            .collect();
        lot.expire();
        assert_eq!(
            lot.parked.load(Ordering::Relaxed),
            1,
            "the first is past its deadline"
        );
        lot.drain();
        tokio::time::sleep(Duration::from_millis(1100)).await;
        lot.expire();
        assert_eq!(
            lot.parked.load(Ordering::Relaxed),
            0,
            "the drain's grace is over"
        );
        assert_eq!(resumed.load(Ordering::Relaxed), 0);
        for mut c in ends {
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut b = [0u8; 1];
            assert_eq!(
                c.read(&mut b).unwrap(),
                0,
                "the client sees its connection closed"
            );
        }
    }
}
