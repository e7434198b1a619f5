//! Credits (salbnet, seed `salbnet-credit-based-slb.txt`; docs/CREDITS.md): a pool element
//! says how many more connections or requests it can take *now*, computed from an
//! application-independent metric, and reports it when it changes, so that the dispatcher only
//! sends work where credit is left.
//!
//! The metric is the accept queue `q` of the service's listening socket (connections the
//! kernel completed that the service has not accepted yet) and the work in flight `w`. With
//! capacity `C`, the credits are `C − w` while `q = 0`, and 0 while `q > 0`: a server with a
//! backlog takes nothing new until it drains (the *pressure relief*).
//!
//! Two reporting algorithms decide when a new value goes out:
//! - **DPR** (Dynamic Pressure Relieve) reports every change;
//! - **DPR-Q** (DPR-Quantize) reports only when the credits cross a multiple of a quantum, or
//!   reach 0 or `C`, which cuts the messages under a steady load.
//!
//! Both send at most one report per minimum interval; a change held back by it goes out when
//! the interval ends (the latest value). This module is sans-IO: samples and time in, the
//! value to report out.

use crate::core::Instant;
use std::time::Duration;

/// What a pool element measured of itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Metric {
    /// Connections waiting in the listening socket's accept queue.
    pub accept_queue: u32,
    /// Connections or requests being served.
    pub in_flight: u32,
}

/// When a new credit value is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reporting {
    /// Every change (DPR).
    Dpr,
    /// Only when a multiple of `quantum` is crossed, or 0 or the capacity is reached (DPR-Q).
    DprQ { quantum: u32 },
}

impl Reporting {
    /// DPR-Q with the default quantum, an eighth of the capacity (at least 1).
    pub fn dpr_q(capacity: u32) -> Self {
        Self::DprQ {
            quantum: (capacity / 8).max(1),
        }
    }

    /// `dpr` or `dpr-q` (the quantum an eighth of `capacity`).
    pub fn from_name(name: &str, capacity: u32) -> Option<Self> {
        match name {
            "dpr" => Some(Self::Dpr),
            "dpr-q" | "dprq" => Some(Self::dpr_q(capacity)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreditConfig {
    /// `C`: what the PE can take at once.
    pub capacity: u32,
    pub reporting: Reporting,
    /// At most one report per this interval.
    pub min_interval: Duration,
}

/// The credits for a metric: `C − w` without a backlog, 0 with one.
pub fn credits(capacity: u32, m: Metric) -> u32 {
    if m.accept_queue > 0 {
        0
    } else {
        capacity.saturating_sub(m.in_flight)
    }
}

/// Decides which samples become reports.
#[derive(Debug, Clone)]
pub struct CreditReporter {
    cfg: CreditConfig,
    /// The last value reported, `None` before the first.
    reported: Option<u32>,
    last_sent: Option<Instant>,
    /// The latest value, waiting for the minimum interval to end.
    held: Option<u32>,
    reports: u64,
}

impl CreditReporter {
    pub fn new(cfg: CreditConfig) -> Self {
        Self {
            cfg,
            reported: None,
            last_sent: None,
            held: None,
            reports: 0,
        }
    }

    pub fn config(&self) -> &CreditConfig {
        &self.cfg
    }

    /// The last value reported.
    pub fn reported(&self) -> Option<u32> {
        self.reported
    }

    /// Reports made so far.
    pub fn reports(&self) -> u64 {
        self.reports
    }

    /// A new sample; the credits to report now, if any.
    pub fn sample(&mut self, m: Metric, now: Instant) -> Option<u32> {
        let c = credits(self.cfg.capacity, m);
        if !self.worth_reporting(c) {
            self.held = None;
            return None;
        }
        if self
            .last_sent
            .is_some_and(|t| now < t + self.cfg.min_interval)
        {
            self.held = Some(c);
            return None;
        }
        Some(self.send(c, now))
    }

    /// When a held-back report is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.held?;
        self.last_sent.map(|t| t + self.cfg.min_interval)
    }

    /// The held-back report, once its time has come.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<u32> {
        let due = self.poll_timeout()?;
        if now < due {
            return None;
        }
        let c = self.held.take()?;
        Some(self.send(c, now))
    }

    fn send(&mut self, c: u32, now: Instant) -> u32 {
        self.reported = Some(c);
        self.last_sent = Some(now);
        self.held = None;
        self.reports += 1;
        c
    }

    fn worth_reporting(&self, c: u32) -> bool {
        let Some(last) = self.reported else {
            return true;
        };
        match self.cfg.reporting {
            Reporting::Dpr => c != last,
            Reporting::DprQ { quantum } => self.level(c, quantum) != self.level(last, quantum),
        }
    }

    /// DPR-Q's band of a value: 0 alone, the capacity (or more) alone, and between them one
    /// band per quantum.
    fn level(&self, c: u32, quantum: u32) -> u32 {
        let cap = self.cfg.capacity;
        if c == 0 {
            0
        } else if c >= cap {
            u32::MAX
        } else {
            1 + c / quantum.max(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn m(q: u32, w: u32) -> Metric {
        Metric {
            accept_queue: q,
            in_flight: w,
        }
    }

    fn reporter(reporting: Reporting, min_ms: u64) -> CreditReporter {
        CreditReporter::new(CreditConfig {
            capacity: 16,
            reporting,
            min_interval: Duration::from_millis(min_ms),
        })
    }

    #[test]
    fn a_backlog_takes_every_credit() {
        assert_eq!(credits(16, m(0, 0)), 16);
        assert_eq!(credits(16, m(0, 5)), 11);
        assert_eq!(credits(16, m(1, 5)), 0);
        assert_eq!(credits(16, m(0, 40)), 0);
    }

    #[test]
    fn dpr_reports_every_change_and_nothing_else() {
        let mut r = reporter(Reporting::Dpr, 0);
        assert_eq!(r.sample(m(0, 0), at(0)), Some(16));
        assert_eq!(r.sample(m(0, 0), at(1)), None);
        assert_eq!(r.sample(m(0, 1), at(2)), Some(15));
        assert_eq!(r.sample(m(0, 2), at(3)), Some(14));
        assert_eq!(r.sample(m(3, 2), at(4)), Some(0));
        assert_eq!(r.sample(m(0, 2), at(5)), Some(14));
        assert_eq!(r.reports(), 5);
    }

    #[test]
    fn dpr_q_reports_only_across_a_quantum_or_at_the_ends() {
        // Capacity 16, quantum 2: bands 0 | 1 | 2-3 | 4-5 | … | 14-15 | 16.
        let mut r = reporter(Reporting::dpr_q(16), 0);
        assert_eq!(r.sample(m(0, 0), at(0)), Some(16));
        assert_eq!(r.sample(m(0, 1), at(1)), Some(15), "left the top");
        assert_eq!(r.sample(m(0, 2), at(2)), None, "14 is in 15's band");
        assert_eq!(r.sample(m(0, 3), at(3)), Some(13));
        assert_eq!(r.sample(m(0, 4), at(4)), None);
        assert_eq!(
            r.sample(m(1, 4), at(5)),
            Some(0),
            "a backlog always goes out"
        );
        assert_eq!(r.sample(m(0, 0), at(6)), Some(16), "so does full credit");
        let mut dpr = reporter(Reporting::Dpr, 0);
        let mut q = reporter(Reporting::dpr_q(16), 0);
        for (i, w) in [0, 1, 2, 1, 2, 3, 2, 3, 4, 3, 2, 1, 2]
            .into_iter()
            .enumerate()
        {
            dpr.sample(m(0, w), at(i as u64));
            q.sample(m(0, w), at(i as u64));
        }
        assert!(
            q.reports() < dpr.reports(),
            "{} vs {}",
            q.reports(),
            dpr.reports()
        );
    }

    #[test]
    fn the_minimum_interval_holds_back_the_latest_value() {
        let mut r = reporter(Reporting::Dpr, 10);
        assert_eq!(r.sample(m(0, 0), at(0)), Some(16));
        assert_eq!(r.sample(m(0, 1), at(2)), None);
        assert_eq!(r.sample(m(0, 3), at(4)), None);
        assert_eq!(r.poll_timeout(), Some(at(10)));
        assert_eq!(r.handle_timeout(at(9)), None);
        assert_eq!(
            r.handle_timeout(at(10)),
            Some(13),
            "the latest, not the first"
        );
        assert_eq!(r.poll_timeout(), None);
        // A change that is undone before the interval ends is never sent.
        assert_eq!(r.sample(m(0, 4), at(12)), None);
        assert_eq!(r.sample(m(0, 3), at(14)), None);
        assert_eq!(r.poll_timeout(), None);
        assert_eq!(r.reports(), 2);
    }
}
