//! What one run of the trace benchmark measured: per scheme and factor a [`Row`], per seed and
//! burst amplitude a [`Run`].

use super::replay;
use super::scheme::Scheme;
use std::time::Duration;

/// The figures of one run (a scheme at a factor).
pub struct Row {
    pub requests: usize,
    pub errors: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub normalised: f64,
    pub penalty: f64,
    pub reports_per_s: f64,
    /// CPU of the back ends (and sidecars), % of one core.
    pub pe_cpu: f64,
    pub late_ms: f64,
    /// Attempts at a PE after one failed or was busy (rserpool: failovers and busy
    /// connects; HAProxy: retries and redispatches).
    pub retries: f64,
    /// PEs ejected by passive health or outlier detection (HAProxy has none here).
    pub ejections: f64,
}

/// Every scheme with one synthetic trace (a seed and a burst amplitude).
pub struct Run {
    pub burst: f64,
    pub seed: u64,
    /// Per factor: requests/s and share of the pool's capacity offered.
    pub offered: Vec<(f64, f64)>,
    pub mean_cost_ms: f64,
    pub results: Vec<(Scheme, Vec<Row>)>,
}

pub fn summarise(outcomes: &[replay::Outcome], reports: f64, pe_cpu: f64, late: Duration) -> Row {
    let mut ok: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.first.map(|d| d.as_secs_f64() * 1000.0))
        .collect();
    ok.sort_by(f64::total_cmp);
    let errors = outcomes.len() - ok.len();
    let q = |p: f64| {
        ok.get(((ok.len() as f64 - 1.0) * p).round().max(0.0) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let mean = ok.iter().sum::<f64>() / ok.len().max(1) as f64;
    let max = ok.last().copied().unwrap_or(f64::NAN);
    let norm: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| Some(o.first?.as_secs_f64() * 1e6 / o.cost_us.max(1) as f64))
        .collect();
    let normalised = norm.iter().sum::<f64>() / norm.len().max(1) as f64;
    Row {
        requests: outcomes.len(),
        errors,
        mean_ms: mean,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: max,
        normalised,
        penalty: if max > 0.0 {
            mean / max * errors as f64 / outcomes.len().max(1) as f64
        } else {
            0.0
        },
        reports_per_s: reports,
        pe_cpu,
        late_ms: late.as_secs_f64() * 1000.0,
        retries: 0.0,
        ejections: 0.0,
    }
}
