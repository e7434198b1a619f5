//! Admission: which waiting request gets the next free place at a pool's PEs.
//!
//! Why: a pool has a limit when its PEs push credits (policy `credits`) or when `max-conn`
//! caps the requests in flight per PE. Beyond it requests wait here, one queue per service
//! level (`levels`), first come first served within a level; when a place frees (a
//! request finished, a PE reported credit, a new PE came), the level to serve is drawn by the
//! proportional-share scheduler ([`rserpool_asap::share`]: lottery or stride over the levels'
//! tickets, which sink with what the level consumed). No level with tickets starves. When the
//! pool's queue is full the newest request of the lowest waiting level below the newcomer's
//! is shed for it; a level's own limit or timeout refuses its own requests.
//!
//! A request arriving while others wait queues behind them even if a place is free at that
//! instant, so nobody overtakes; with nobody waiting it goes straight through (one lock, no
//! allocation). This is the sans-IO part: the tokio side (waiting with a deadline) is
//! `Pool::admit` (in `pools`).

use crate::balance::backend::Backend;
use rserpool_asap::share::{Discipline, Domain, Share};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Why no PE was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// No PE (left to try) in the pool.
    NoPe,
    /// Every PE was at its limit (out of credit, or `max-conn`) for the whole queue timeout.
    QueueTimeout,
    /// The queue was full, or a higher service level pushed the request out of it.
    QueueFull,
    /// The pool's circuit breaker: `max-requests` under way already.
    CircuitOpen,
}

impl NoPick {
    /// The text of the 503 for a client.
    pub fn text(self) -> &'static str {
        match self {
            Self::NoPe => "no pool element available",
            Self::QueueTimeout => "no pool element had room within the queue timeout",
            Self::QueueFull => "too many requests waiting",
            Self::CircuitOpen => "too many requests under way at the pool",
        }
    }
}

/// What a waiting request is told: its PE (picked and reserved), or why none.
pub(crate) type Outcome = Result<Arc<Backend>, NoPick>;

/// Settings for one pool's admission.
#[derive(Debug, Clone)]
pub(crate) struct AdmissionConfig {
    pub domains: Vec<Domain>,
    pub discipline: Discipline,
    pub half_life: Duration,
    /// Most requests waiting at the pool, all levels.
    pub queue: usize,
    /// Per level (0-based): most waiting, and longest wait.
    pub level_queue: Vec<usize>,
    pub level_timeout: Vec<Duration>,
}

impl AdmissionConfig {
    /// One level: a plain first-come-first-served queue.
    pub fn single(queue: usize, timeout: Duration) -> Self {
        Self {
            domains: vec![Domain::default_for(1)],
            discipline: Discipline::Lottery,
            half_life: Duration::from_secs(1),
            queue,
            level_queue: vec![queue],
            level_timeout: vec![timeout],
        }
    }
}

pub(crate) struct Waiter {
    id: u64,
    tx: oneshot::Sender<Outcome>,
    pub tried: Vec<u32>,
    since: Instant,
}

/// Per-level counters, as the stats endpoint shows them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LevelStats {
    pub level: usize,
    /// Requests given a PE: at once or after waiting.
    pub admitted: u64,
    /// Of those, the ones that waited.
    pub queued: u64,
    /// Refused with a full queue, or pushed out of it by a higher level.
    pub shed: u64,
    /// Waited their level's queue timeout and were refused.
    pub timed_out: u64,
    pub waiting: usize,
    pub wait_us_total: u64,
    pub wait_us_max: u64,
    /// Requests finished at a PE, and their service time (request sent to done).
    pub finished: u64,
    pub service_us_total: u64,
    pub tickets: u32,
}

pub(crate) struct Admission {
    cfg: AdmissionConfig,
    share: Share,
    queues: Vec<VecDeque<Waiter>>,
    /// Requests waiting, shared with the pool so that a finishing request can see without
    /// the lock whether anyone waits. Changed only under the pool's lock, before any
    /// dispatch that must see it.
    queued: Arc<AtomicUsize>,
    next_id: u64,
    stats: Vec<LevelStats>,
}

/// The first-in-line waiter for [`Admission::front`]: taken or failed by the caller.
pub(crate) struct Front {
    pub level: usize,
}

impl Admission {
    pub fn new(cfg: AdmissionConfig, seed: u64, queued: Arc<AtomicUsize>) -> Self {
        queued.store(0, Ordering::SeqCst);
        let n = cfg.domains.len().max(1);
        let share = Share::new(&cfg.domains, cfg.discipline, cfg.half_life, seed);
        Self {
            queues: (0..n).map(|_| VecDeque::new()).collect(),
            stats: (1..=n)
                .map(|level| LevelStats {
                    level,
                    ..Default::default()
                })
                .collect(),
            share,
            cfg,
            queued,
            next_id: 0,
        }
    }

    /// Keeps the waiting requests (they stay in their levels, as far as those exist) and the
    /// counters when the settings change.
    pub fn reconfigure(&mut self, cfg: AdmissionConfig, seed: u64) {
        let mut next = Self::new(cfg, seed, self.queued.clone());
        let top = next.queues.len() - 1;
        for (l, q) in self.queues.drain(..).enumerate() {
            for w in q {
                next.queues[l.min(top)].push_back(w);
                next.queued.fetch_add(1, Ordering::SeqCst);
            }
        }
        for l in 0..next.queues.len() {
            let waiting = !next.queues[l].is_empty();
            next.share.set_waiting(l, waiting);
        }
        for (l, s) in self.stats.drain(..).enumerate().take(next.stats.len()) {
            next.stats[l] = s;
        }
        next.next_id = self.next_id;
        *self = next;
    }

    pub fn levels(&self) -> usize {
        self.queues.len()
    }

    /// The 0-based level of a 1-based one, clamped to the levels that exist.
    pub fn index(&self, level: usize) -> usize {
        level.clamp(1, self.levels()) - 1
    }

    pub fn is_waiting(&self) -> bool {
        self.queued.load(Ordering::SeqCst) > 0
    }

    pub fn timeout(&self, level: usize) -> Duration {
        self.cfg.level_timeout[level]
    }

    pub fn admitted(&mut self, level: usize) {
        self.stats[level].admitted += 1;
    }

    /// Queues a request of `level`, shedding a lower level's newest if the pool's queue is
    /// full. `Err` refuses it.
    pub fn enqueue(
        &mut self,
        level: usize,
        tried: &[u32],
        now: Instant,
    ) -> Result<(u64, oneshot::Receiver<Outcome>), NoPick> {
        if self.queues[level].len() >= self.cfg.level_queue[level] {
            self.stats[level].shed += 1;
            return Err(NoPick::QueueFull);
        }
        if self.queued.load(Ordering::SeqCst) >= self.cfg.queue {
            let Some(lowest) = (0..level).find(|&l| !self.queues[l].is_empty()) else {
                self.stats[level].shed += 1;
                return Err(NoPick::QueueFull);
            };
            if let Some(w) = self.queues[lowest].pop_back() {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.stats[lowest].shed += 1;
                let _ = w.tx.send(Err(NoPick::QueueFull));
            }
            if self.queues[lowest].is_empty() {
                self.share.set_waiting(lowest, false);
            }
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.queues[level].push_back(Waiter {
            id,
            tx,
            tried: tried.to_vec(),
            since: now,
        });
        self.queued.fetch_add(1, Ordering::SeqCst);
        self.share.set_waiting(level, true);
        Ok((id, rx))
    }

    /// Takes a waiter out (it timed out or went away); false if it was not waiting any more.
    pub fn remove(&mut self, level: usize, id: u64, timed_out: bool) -> bool {
        let q = &mut self.queues[level];
        let Some(i) = q.iter().position(|w| w.id == id) else {
            return false;
        };
        q.remove(i);
        self.queued.fetch_sub(1, Ordering::SeqCst);
        if q.is_empty() {
            self.share.set_waiting(level, false);
        }
        if timed_out {
            self.stats[level].timed_out += 1;
        }
        true
    }

    /// The level to serve next and its first waiter's tried PEs, or `None` when nobody waits.
    pub fn front(&mut self, now: Instant) -> Option<(Front, &[u32])> {
        let level = self.share.peek(now)?;
        let w = self.queues[level].front()?;
        Some((Front { level }, &w.tried))
    }

    /// Hands the first waiter of `f.level` its outcome. A waiter that went away meanwhile
    /// gives its PE back (`Err` returns it, for the caller to release).
    pub fn take(&mut self, f: Front, outcome: Outcome, now: Instant) -> Result<(), Arc<Backend>> {
        let level = f.level;
        let Some(w) = self.queues[level].pop_front() else {
            return match outcome {
                Ok(b) => Err(b),
                Err(_) => Ok(()),
            };
        };
        self.queued.fetch_sub(1, Ordering::SeqCst);
        if self.queues[level].is_empty() {
            self.share.set_waiting(level, false);
        }
        if outcome.is_ok() {
            self.share.served(level);
            let waited = now.saturating_duration_since(w.since).as_micros() as u64;
            let s = &mut self.stats[level];
            s.admitted += 1;
            s.queued += 1;
            s.wait_us_total += waited;
            s.wait_us_max = s.wait_us_max.max(waited);
        }
        match w.tx.send(outcome) {
            Ok(()) => Ok(()),
            Err(Ok(b)) => Err(b),
            Err(Err(_)) => Ok(()),
        }
    }

    /// A request of `level` finished after `service` at its PE.
    pub fn finished(&mut self, level: usize, service: Duration, now: Instant) {
        let level = level.min(self.levels() - 1);
        self.share.consumed(level, service, now);
        let s = &mut self.stats[level];
        s.finished += 1;
        s.service_us_total += service.as_micros() as u64;
    }

    pub fn stats(&self) -> Vec<LevelStats> {
        self.stats
            .iter()
            .enumerate()
            .map(|(l, s)| LevelStats {
                waiting: self.queues[l].len(),
                tickets: self.share.tickets(l),
                ..s.clone()
            })
            .collect()
    }
}
