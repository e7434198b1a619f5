//! A pool element's own worker queue, served by level: the back end of the seed's
//! differentiated services (`differentiated-services-clusters`, §4).
//!
//! The proxy shares the pool among service levels ([`crate::share`]); a PE that gets more
//! requests than it has workers should share its workers the same way, so that a request of a
//! high level does not queue behind a crowd of low ones inside the PE. [`LevelGate`] has a
//! fixed number of slots (the workers); [`LevelGate::enter`] waits for one in its level's
//! queue; when a slot frees, the level served next is drawn by lottery (or stride) over the
//! levels' tickets, and the time the request held the slot is charged to its level.
//!
//! ```no_run
//! # async fn f(level: usize) {
//! use rserpool_asap::level_gate::LevelGate;
//! use rserpool_asap::share::{Discipline, Domain};
//! let domains: Vec<Domain> = (1..=9).map(Domain::default_for).collect();
//! let gate = LevelGate::new(4, &domains, Discipline::Lottery, std::time::Duration::from_secs(1));
//! let _slot = gate.enter(level).await; // the level from the proxy's header
//! // ... serve the request; dropping the slot hands it on
//! # }
//! ```

use crate::share::{Discipline, Domain, Share};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Worker slots shared among levels in proportion to their tickets.
#[derive(Clone)]
pub struct LevelGate {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    share: Share,
    free: usize,
    queues: Vec<VecDeque<oneshot::Sender<()>>>,
    waiting: usize,
}

/// A held slot; dropping it frees the slot and charges the time held to its level.
pub struct Slot {
    gate: LevelGate,
    level: usize,
    since: Instant,
}

impl LevelGate {
    /// `slots` workers shared among one level per domain (level 1 is `domains[0]`).
    pub fn new(
        slots: usize,
        domains: &[Domain],
        discipline: Discipline,
        half_life: Duration,
    ) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let n = domains.len().max(1);
        Self {
            inner: Arc::new(Mutex::new(Inner {
                share: Share::new(domains, discipline, half_life, seed),
                free: slots.max(1),
                queues: (0..n).map(|_| VecDeque::new()).collect(),
                waiting: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a slot as a request of `level` (1-based; clamped to the levels there are).
    pub async fn enter(&self, level: usize) -> Slot {
        let rx = {
            let mut g = self.lock();
            let level = level.clamp(1, g.queues.len()) - 1;
            if g.waiting == 0 && g.free > 0 {
                g.free -= 1;
                return self.slot(level);
            }
            let (tx, rx) = oneshot::channel();
            g.queues[level].push_back(tx);
            g.waiting += 1;
            g.share.set_waiting(level, true);
            // A slot may be free while others wait (one of them went away).
            g.hand_on();
            (level, rx)
        };
        let (level, rx) = rx;
        let mut waiter = Waiting {
            gate: self,
            rx: Some(rx),
        };
        if let Some(rx) = waiter.rx.as_mut() {
            let _ = rx.await;
        }
        waiter.rx = None;
        self.slot(level)
    }

    fn slot(&self, level: usize) -> Slot {
        Slot {
            gate: self.clone(),
            level,
            since: Instant::now(),
        }
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// A level's current tickets (1-based level).
    pub fn tickets(&self, level: usize) -> u32 {
        self.lock().share.tickets(level.saturating_sub(1))
    }
}

/// A waiter that went away before its turn gives a slot handed to it back.
struct Waiting<'a> {
    gate: &'a LevelGate,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                let mut g = self.gate.lock();
                g.free += 1;
                g.hand_on();
            }
        }
    }
}

impl Inner {
    /// Gives free slots to waiting requests, levels drawn by the share.
    fn hand_on(&mut self) {
        let now = Instant::now();
        while self.free > 0 && self.waiting > 0 {
            let Some(level) = self.share.peek(now) else {
                break;
            };
            let Some(tx) = self.queues[level].pop_front() else {
                self.share.set_waiting(level, false);
                continue;
            };
            self.waiting -= 1;
            if self.queues[level].is_empty() {
                self.share.set_waiting(level, false);
            }
            if tx.send(()).is_ok() {
                self.free -= 1;
                self.share.served(level);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = self.gate.lock();
        let now = Instant::now();
        g.share
            .consumed(self.level, now.saturating_duration_since(self.since), now);
        g.free += 1;
        g.hand_on();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_slot_goes_to_levels_by_tickets_and_every_level_gets_its_turn() {
        let domains = vec![Domain { lower: 1, upper: 1 }, Domain { lower: 3, upper: 3 }];
        let gate = LevelGate::new(1, &domains, Discipline::Stride, Duration::from_secs(1));
        let first = gate.enter(1).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let level = if i % 2 == 0 { 1 } else { 2 };
            let (gate, order) = (gate.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _s = gate.enter(level).await;
                order.lock().unwrap().push(level);
                tokio::task::yield_now().await;
            }));
            tokio::task::yield_now().await;
        }
        while gate.waiting() < 8 {
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        // Stride 3:1: the first four turns hold three of level 2 and one of level 1.
        let first_four = &order[..4];
        assert_eq!(
            first_four.iter().filter(|&&l| l == 2).count(),
            3,
            "{order:?}"
        );
        assert_eq!(order.len(), 8);
        assert_eq!(gate.waiting(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_leaves_gives_no_slot_away() {
        let domains = vec![Domain::default_for(1)];
        let gate = LevelGate::new(1, &domains, Discipline::Lottery, Duration::from_secs(1));
        let held = gate.enter(1).await;
        let g2 = gate.clone();
        let gone = tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(10), g2.enter(1)).await;
        });
        gone.await.unwrap();
        drop(held);
        // The slot is free again: entering does not wait.
        let ok = tokio::time::timeout(Duration::from_millis(100), gate.enter(1)).await;
        assert!(ok.is_ok());
    }
}
