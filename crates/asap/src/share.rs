//! Proportional share over client levels with priority domains (sans-IO).
//!
//! Why: under overload someone has to wait, and a front end that serves levels by strict
//! priority (HAProxy's `set-priority-class`) starves the lowest level. The seed
//! (`differentiated-services-clusters`, §3–4) instead gives each client level a *priority
//! domain* `[lower, upper]` and shares the resource by lottery scheduling: a level's priority
//! (its tickets) starts at `upper` and sinks toward `lower` as the level consumes, never below
//! it, and every level holding tickets is served in proportion to them — no starvation.
//!
//! This module is that scheduler, free of I/O and clocks (time comes in as `now`), so the
//! proxy's admission queue and a pool element's own worker queue use the same code:
//!
//! - [`Share::set_waiting`] says whether a level has work queued;
//! - [`Share::peek`] names the level to serve next (lottery: a draw weighted by tickets;
//!   stride: the smallest pass among the eligible levels, a deterministic proportional
//!   share);
//! - [`Share::served`] says the level's next piece of work was served (stride advances it);
//! - [`Share::consumed`] adds the resource time a finished request of the level used.
//!
//! **Tickets.** Each level's recent consumption `used` (seconds of service time) decays with
//! a half-life; its share `u = used / Σ used` of all levels' recent consumption moves its
//! tickets linearly inside the domain: `tickets = upper − (upper − lower) · u`. A level that
//! consumes everything sits at `lower`; one that has been idle while others worked recovers
//! to `upper`. Tickets are recomputed on a tick (every [`TICK`]), not per request.
//!
//! **Cost.** `peek`, `served` and `set_waiting` are O(log levels): a Fenwick tree of the
//! waiting levels' tickets for the lottery, two ordered sets (start and finish passes) for
//! stride; a tick
//! (O(levels · log levels)) happens at most once per [`TICK`].

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// How often tickets are recomputed from the decayed consumption.
pub const TICK: Duration = Duration::from_millis(10);

/// Stride scheduling's large constant: a level's stride is `STRIDE1 / tickets`.
const STRIDE1: u64 = 1 << 32;

/// A level's priority domain, in tickets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Domain {
    pub lower: u32,
    pub upper: u32,
}

impl Domain {
    /// The default domain of level `level` (1-based): `[100·level, 100·level + 99]`, so the
    /// domains do not overlap — a higher level always holds more tickets than a lower one,
    /// as in the seed — and a level's tickets can sink by up to half (level 1) or a tenth
    /// (level 9) as it consumes.
    pub fn default_for(level: usize) -> Self {
        let l = level as u32;
        Self {
            lower: 100 * l,
            upper: 100 * l + 99,
        }
    }
}

/// Which proportional-share discipline serves the levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Discipline {
    /// Lottery scheduling (Waldspurger & Weihl 1994), the seed's: a random draw weighted by
    /// tickets. Shares hold on average; short runs can stray.
    #[default]
    Lottery,
    /// Stride scheduling (Waldspurger & Weihl 1995): each level advances a pass by
    /// `1 / tickets` per service and the smallest pass goes next. Plain stride can run a
    /// level more than one service ahead of its share when many levels wait; here a level
    /// is only eligible once its previous pass is reached by the pool's virtual time (the
    /// WF²Q rule of Bennett & Zhang), which keeps every level within one service of its
    /// share at any time.
    Stride,
}

#[derive(Debug, Clone)]
struct Level {
    domain: Domain,
    /// Recent consumption, seconds, decayed.
    used: f64,
    tickets: u32,
    waiting: bool,
    /// Stride: the virtual start and finish (= start + stride) of its next service.
    start: u64,
    pass: u64,
}

impl Level {
    fn stride(&self) -> u64 {
        STRIDE1 / u64::from(self.tickets.max(1))
    }
}

/// The scheduler over levels `0 .. n` (callers number them from 1 and subtract one).
#[derive(Debug, Clone)]
pub struct Share {
    levels: Vec<Level>,
    discipline: Discipline,
    half_life: Duration,
    last_tick: Option<Instant>,
    /// Lottery: Fenwick tree of the waiting levels' tickets (1-based inside).
    tree: Vec<u64>,
    /// Stride: waiting levels whose start is after the virtual time, by start; and the
    /// eligible ones, by pass.
    later: BTreeSet<(u64, usize)>,
    eligible: BTreeSet<(u64, usize)>,
    /// Stride: the virtual time, advanced by `STRIDE1 / Σ tickets waiting` per service; a
    /// level that starts waiting again starts no earlier, so idling earns no turns.
    virtual_time: u64,
    /// Stride: the tickets of the waiting levels.
    waiting_tickets: u64,
    rng: u64,
}

impl Share {
    /// A scheduler over one level per domain; `half_life` is the decay of consumption;
    /// `seed` seeds the lottery.
    pub fn new(domains: &[Domain], discipline: Discipline, half_life: Duration, seed: u64) -> Self {
        let levels = domains
            .iter()
            .map(|&d| {
                let domain = Domain {
                    lower: d.lower.max(1),
                    upper: d.upper.max(d.lower.max(1)),
                };
                Level {
                    domain,
                    used: 0.0,
                    tickets: domain.upper,
                    waiting: false,
                    start: 0,
                    pass: 0,
                }
            })
            .collect::<Vec<_>>();
        Self {
            tree: vec![0; levels.len() + 1],
            levels,
            discipline,
            half_life: half_life.max(Duration::from_millis(1)),
            last_tick: None,
            later: BTreeSet::new(),
            eligible: BTreeSet::new(),
            virtual_time: 0,
            waiting_tickets: 0,
            rng: seed | 1,
        }
    }

    pub fn len(&self) -> usize {
        self.levels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.levels.is_empty()
    }

    pub fn discipline(&self) -> Discipline {
        self.discipline
    }

    /// The level's current tickets.
    pub fn tickets(&self, level: usize) -> u32 {
        self.levels.get(level).map_or(0, |l| l.tickets)
    }

    /// The level's decayed recent consumption, seconds.
    pub fn used(&self, level: usize) -> f64 {
        self.levels.get(level).map_or(0.0, |l| l.used)
    }

    /// Whether the level has work waiting; only waiting levels are drawn.
    pub fn set_waiting(&mut self, level: usize, waiting: bool) {
        let Some(l) = self.levels.get_mut(level) else {
            return;
        };
        if l.waiting == waiting {
            return;
        }
        l.waiting = waiting;
        let tickets = u64::from(l.tickets);
        match self.discipline {
            Discipline::Lottery => {
                if waiting {
                    self.tree_add(level, tickets as i64);
                } else {
                    self.tree_add(level, -(tickets as i64));
                }
            }
            Discipline::Stride => {
                if waiting {
                    l.start = l.pass.max(self.virtual_time);
                    l.pass = l.start.saturating_add(l.stride());
                    self.waiting_tickets += tickets;
                    let key = (l.start, level);
                    self.later.insert(key);
                } else {
                    self.waiting_tickets -= tickets;
                    let (start, pass) = (l.start, l.pass);
                    self.later.remove(&(start, level));
                    self.eligible.remove(&(pass, level));
                }
            }
        }
    }

    /// The level to serve next among the waiting ones, or `None` when none waits. Lottery
    /// draws anew on every call; stride names the smallest pass until [`served`](Self::served).
    pub fn peek(&mut self, now: Instant) -> Option<usize> {
        self.tick(now);
        match self.discipline {
            Discipline::Lottery => {
                let total = self.tree_prefix(self.levels.len());
                if total == 0 {
                    return None;
                }
                let draw = self.random() % total;
                Some(self.tree_find(draw))
            }
            Discipline::Stride => {
                // Nothing eligible yet (all waiting levels start later): time jumps ahead.
                if self.eligible.is_empty()
                    && let Some(&(start, _)) = self.later.first()
                {
                    self.virtual_time = self.virtual_time.max(start);
                }
                while let Some(&(start, level)) = self.later.first() {
                    if start > self.virtual_time {
                        break;
                    }
                    self.later.pop_first();
                    self.eligible.insert((self.levels[level].pass, level));
                }
                self.eligible.first().map(|&(_, l)| l)
            }
        }
    }

    /// The level's next piece of work was served.
    pub fn served(&mut self, level: usize) {
        if self.discipline != Discipline::Stride {
            return;
        }
        let Some(l) = self.levels.get_mut(level) else {
            return;
        };
        let (start, pass) = (l.start, l.pass);
        l.start = pass;
        l.pass = pass.saturating_add(l.stride());
        let (new_start, waiting) = (l.start, l.waiting);
        if waiting {
            self.later.remove(&(start, level));
            self.eligible.remove(&(pass, level));
            self.later.insert((new_start, level));
        }
        self.virtual_time = self
            .virtual_time
            .saturating_add(STRIDE1 / self.waiting_tickets.max(1));
    }

    /// A request of the level finished after using `service` of the resource.
    pub fn consumed(&mut self, level: usize, service: Duration, now: Instant) {
        self.tick(now);
        if let Some(l) = self.levels.get_mut(level) {
            l.used += service.as_secs_f64();
        }
    }

    /// Decays consumption and recomputes tickets, at most once per [`TICK`].
    fn tick(&mut self, now: Instant) {
        let Some(last) = self.last_tick else {
            self.last_tick = Some(now);
            return;
        };
        let dt = now.saturating_duration_since(last);
        if dt < TICK {
            return;
        }
        self.last_tick = Some(now);
        let keep = 0.5f64.powf(dt.as_secs_f64() / self.half_life.as_secs_f64());
        let mut total = 0.0;
        for l in &mut self.levels {
            l.used *= keep;
            if l.used < 1e-9 {
                l.used = 0.0;
            }
            total += l.used;
        }
        for i in 0..self.levels.len() {
            let l = &self.levels[i];
            let u = if total > 0.0 { l.used / total } else { 0.0 };
            let span = f64::from(l.domain.upper - l.domain.lower);
            let tickets = (f64::from(l.domain.upper) - span * u).round() as u32;
            let tickets = tickets.clamp(l.domain.lower, l.domain.upper);
            self.set_tickets(i, tickets);
        }
    }

    fn set_tickets(&mut self, level: usize, tickets: u32) {
        let l = &mut self.levels[level];
        if l.tickets == tickets {
            return;
        }
        let delta = i64::from(tickets) - i64::from(l.tickets);
        l.tickets = tickets;
        if !l.waiting {
            return;
        }
        match self.discipline {
            Discipline::Lottery => self.tree_add(level, delta),
            Discipline::Stride => {
                // The next service keeps its start; its finish follows the new stride.
                self.waiting_tickets = self.waiting_tickets.wrapping_add_signed(delta);
                let (start, pass) = (l.start, l.pass);
                l.pass = start.saturating_add(l.stride());
                if self.eligible.remove(&(pass, level)) {
                    self.eligible.insert((self.levels[level].pass, level));
                }
            }
        }
    }

    fn tree_add(&mut self, level: usize, delta: i64) {
        let mut i = level + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of the first `n` levels' weights.
    fn tree_prefix(&self, n: usize) -> u64 {
        let mut i = n.min(self.tree.len() - 1);
        let mut sum = 0;
        while i > 0 {
            sum += self.tree[i];
            i -= i & i.wrapping_neg();
        }
        sum
    }

    /// The level whose weight interval holds `draw` (< total).
    fn tree_find(&self, mut draw: u64) -> usize {
        let n = self.tree.len() - 1;
        let mut pos = 0;
        let mut step = n.next_power_of_two();
        while step > 0 {
            let next = pos + step;
            if next <= n && self.tree[next] <= draw {
                draw -= self.tree[next];
                pos = next;
            }
            step >>= 1;
        }
        pos.min(n.saturating_sub(1))
    }

    fn random(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domains(n: usize) -> Vec<Domain> {
        (1..=n).map(Domain::default_for).collect()
    }

    /// Every level backlogged, `n` dispatches, no consumption (tickets stay at upper):
    /// each level's count of dispatches.
    fn dispatch_all_waiting(d: Discipline, n: usize) -> (Vec<u64>, Vec<u32>) {
        let mut s = Share::new(&domains(9), d, Duration::from_secs(1), 7);
        for l in 0..9 {
            s.set_waiting(l, true);
        }
        let now = Instant::now();
        let mut counts = vec![0u64; 9];
        for _ in 0..n {
            let l = s.peek(now).unwrap();
            counts[l] += 1;
            s.served(l);
        }
        let tickets = (0..9).map(|l| s.tickets(l)).collect();
        (counts, tickets)
    }

    #[test]
    fn lottery_shares_follow_tickets_within_five_percent() {
        let n = 20_000;
        let (counts, tickets) = dispatch_all_waiting(Discipline::Lottery, n);
        let total: u32 = tickets.iter().sum();
        for l in 0..9 {
            let want = n as f64 * f64::from(tickets[l]) / f64::from(total);
            let got = counts[l] as f64;
            assert!(
                (got - want).abs() <= 0.05 * want,
                "level {}: {got} dispatches, ticket share {want:.0}",
                l + 1
            );
            assert!(counts[l] > 0, "level {} starved", l + 1);
        }
    }

    #[test]
    fn stride_shares_follow_tickets_within_one_quantum_at_every_point() {
        let mut s = Share::new(&domains(9), Discipline::Stride, Duration::from_secs(1), 7);
        for l in 0..9 {
            s.set_waiting(l, true);
        }
        let now = Instant::now();
        let total: u32 = (0..9).map(|l| s.tickets(l)).sum();
        let mut counts = [0u64; 9];
        for k in 1..=10_000u64 {
            let l = s.peek(now).unwrap();
            counts[l] += 1;
            s.served(l);
            for (i, &c) in counts.iter().enumerate() {
                let want = k as f64 * f64::from(s.tickets(i)) / f64::from(total);
                assert!(
                    (c as f64 - want).abs() <= 1.0 + 1e-9,
                    "after {k}: level {} has {c}, share {want:.2}",
                    i + 1
                );
            }
        }
    }

    #[test]
    fn only_waiting_levels_are_drawn() {
        for d in [Discipline::Lottery, Discipline::Stride] {
            let mut s = Share::new(&domains(9), d, Duration::from_secs(1), 3);
            let now = Instant::now();
            assert_eq!(s.peek(now), None);
            s.set_waiting(0, true);
            s.set_waiting(8, true);
            s.set_waiting(8, false);
            for _ in 0..100 {
                assert_eq!(s.peek(now), Some(0));
                s.served(0);
            }
            s.set_waiting(0, false);
            assert_eq!(s.peek(now), None);
        }
    }

    #[test]
    fn a_level_that_idled_under_stride_gets_no_backlog_of_turns() {
        let mut s = Share::new(&domains(2), Discipline::Stride, Duration::from_secs(1), 3);
        let now = Instant::now();
        s.set_waiting(0, true);
        for _ in 0..1000 {
            let l = s.peek(now).unwrap();
            s.served(l);
        }
        // Level 2 joins late: it gets its share from now on, not 1000 turns in a row.
        s.set_waiting(1, true);
        let mut run = 0;
        for _ in 0..10 {
            if s.peek(now) == Some(1) {
                run += 1;
            }
            let l = s.peek(now).unwrap();
            s.served(l);
        }
        assert!(run < 10, "level 2 took every turn after joining");
    }

    #[test]
    fn tickets_decay_with_consumption_within_the_domain_and_recover_when_idle() {
        let d = domains(2);
        let mut s = Share::new(&d, Discipline::Lottery, Duration::from_millis(500), 1);
        let mut now = Instant::now();
        s.peek(now);
        assert_eq!(s.tickets(0), d[0].upper);
        // Only level 1 consumes: it sinks to its lower limit and no further.
        for _ in 0..500 {
            now += Duration::from_millis(10);
            s.consumed(0, Duration::from_millis(10), now);
        }
        assert_eq!(s.tickets(0), d[0].lower);
        assert_eq!(s.tickets(1), d[1].upper);
        // Both consume equally: each sits halfway once the history decays.
        for _ in 0..1000 {
            now += Duration::from_millis(10);
            s.consumed(0, Duration::from_millis(5), now);
            s.consumed(1, Duration::from_millis(5), now);
        }
        for (l, dom) in d.iter().enumerate() {
            let mid = (dom.lower + dom.upper) / 2;
            assert!(s.tickets(l).abs_diff(mid) <= 1, "{}", s.tickets(l));
        }
        // Level 1 idles while level 2 works: level 1 recovers to upper, level 2 sinks.
        for _ in 0..1000 {
            now += Duration::from_millis(10);
            s.consumed(1, Duration::from_millis(10), now);
        }
        assert_eq!(s.tickets(0), d[0].upper);
        assert_eq!(s.tickets(1), d[1].lower);
        for (l, dom) in d.iter().enumerate() {
            assert!((dom.lower..=dom.upper).contains(&s.tickets(l)));
        }
    }

    #[test]
    fn lowest_level_is_never_starved_while_consuming_less() {
        // Level 9 and level 1 backlogged, each served request costs 1 ms: level 1 keeps a
        // share at or above its lower bound's share.
        for disc in [Discipline::Lottery, Discipline::Stride] {
            let d = vec![Domain::default_for(1), Domain::default_for(9)];
            let mut s = Share::new(&d, disc, Duration::from_millis(200), 11);
            s.set_waiting(0, true);
            s.set_waiting(1, true);
            let mut now = Instant::now();
            let mut counts = [0u64; 2];
            for _ in 0..20_000 {
                now += Duration::from_millis(1);
                let l = s.peek(now).unwrap();
                counts[l] += 1;
                s.served(l);
                s.consumed(l, Duration::from_millis(1), now);
            }
            let floor = f64::from(d[0].lower) / f64::from(d[0].lower + d[1].upper);
            let share = counts[0] as f64 / 20_000.0;
            assert!(
                share >= floor * 0.95,
                "{disc:?}: level 1 got {share:.3} < {floor:.3}"
            );
            assert!(counts[1] > counts[0] * 3, "{disc:?}: {counts:?}");
        }
    }
}
