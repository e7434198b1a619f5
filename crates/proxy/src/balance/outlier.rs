//! Outlier detection by answers, beside passive health's failures in a row: why a PE was
//! ejected, and the success-rate rule (Envoy's outlier detection, `success_rate_*`).
//!
//! The success-rate rule looks at a pool every interval: of the PEs that answered at least
//! `min_requests` requests in it, when there are at least `min_hosts`, a PE whose share of
//! good answers is below the mean less `stdev_factor` standard deviations is an outlier.
//! It finds the PE that fails one request in five while the others fail none, which neither
//! failures in a row nor 5xx in a row ever see. A 503 (busy) counts for neither side: an
//! overloaded PE is not an outlier.

use std::sync::atomic::{AtomicU64, Ordering};

/// Why a PE was ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EjectCause {
    /// `max-fails` failures in a row (connect refused or reset, closed before answering,
    /// no answer in time).
    Failures,
    /// `consecutive-5xx` 5xx answers in a row.
    Consecutive5xx,
    /// Its success rate lay below the pool's by the success-rate rule.
    SuccessRate,
}

impl EjectCause {
    pub const ALL: [EjectCause; 3] = [Self::Failures, Self::Consecutive5xx, Self::SuccessRate];

    /// The name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Failures => "failures",
            Self::Consecutive5xx => "5xx",
            Self::SuccessRate => "success-rate",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// A PE's answers in the current interval of the success-rate rule.
#[derive(Debug, Default)]
pub(crate) struct AnswerWindow {
    good: AtomicU64,
    all: AtomicU64,
}

impl AnswerWindow {
    /// An answer with status `code`, or (`None`) a request the PE failed without one.
    pub(crate) fn note(&self, code: Option<u16>) {
        match code {
            Some(503) => return,
            Some(c) if c < 500 => {
                self.good.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        self.all.fetch_add(1, Ordering::Relaxed);
    }

    /// The interval's (good, all), and a new interval begins.
    pub(crate) fn take(&self) -> (u64, u64) {
        let all = self.all.swap(0, Ordering::Relaxed);
        let good = self.good.swap(0, Ordering::Relaxed).min(all);
        (good, all)
    }
}

/// The success-rate rule's settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SuccessRateRule {
    pub(crate) min_hosts: usize,
    pub(crate) min_requests: u64,
    pub(crate) stdev_factor: f64,
}

/// The outliers among `(PE id, good answers, all answers)` of one interval.
pub(crate) fn success_rate_outliers(
    rule: SuccessRateRule,
    samples: &[(u32, u64, u64)],
) -> Vec<u32> {
    let rated: Vec<(u32, f64)> = samples
        .iter()
        .filter(|&&(_, _, all)| all >= rule.min_requests.max(1))
        .map(|&(id, good, all)| (id, good as f64 / all as f64))
        .collect();
    if rated.len() < rule.min_hosts.max(2) {
        return Vec::new();
    }
    let n = rated.len() as f64;
    let mean = rated.iter().map(|r| r.1).sum::<f64>() / n;
    let var = rated.iter().map(|r| (r.1 - mean).powi(2)).sum::<f64>() / n;
    let floor = mean - rule.stdev_factor * var.sqrt();
    rated
        .into_iter()
        .filter(|&(_, rate)| rate < floor)
        .map(|(id, _)| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: SuccessRateRule = SuccessRateRule {
        min_hosts: 5,
        min_requests: 100,
        stdev_factor: 1.9,
    };

    #[test]
    fn the_pe_that_fails_often_is_the_outlier() {
        let mut s: Vec<_> = (1..=9).map(|id| (id, 199, 200)).collect();
        s.push((10, 160, 200));
        assert_eq!(success_rate_outliers(RULE, &s), vec![10]);
    }

    #[test]
    fn an_even_pool_has_none_and_too_few_requests_or_pes_say_nothing() {
        let even: Vec<_> = (1..=6).map(|id| (id, 150 + id as u64, 200)).collect();
        assert!(success_rate_outliers(RULE, &even).is_empty());
        let mut few: Vec<_> = (1..=9).map(|id| (id, 99, 99)).collect();
        few.push((10, 0, 99));
        assert!(success_rate_outliers(RULE, &few).is_empty());
        let small = [(1, 200, 200), (2, 200, 200), (3, 200, 200), (4, 0, 200)];
        assert!(success_rate_outliers(RULE, &small).is_empty());
    }

    #[test]
    fn a_busy_answer_counts_for_neither_side() {
        let w = AnswerWindow::default();
        w.note(Some(200));
        w.note(Some(503));
        w.note(Some(500));
        w.note(None);
        assert_eq!(w.take(), (1, 3));
        assert_eq!(w.take(), (0, 0));
    }
}
