//! The trace benchmark's Markdown: one run's full tables, or, over several seeds and burst
//! amplitudes, a matrix of errors and tail latencies; the targets against HAProxy with each
//! one marked met or not; and how many keys the hashing selections move when a PE leaves.

use super::args::TraceArgs;
use super::results::{Row, Run};
use crate::trace::scheme::Scheme;
use crate::{plot, report};
use anyhow::{Result, anyhow};
use std::fmt::Write as _;
use std::path::Path;

/// The scenario line: what was replayed and against what.
fn scenario(args: &TraceArgs, mean_cost_ms: Option<f64>) -> String {
    let source = match &args.trace {
        Some(p) => format!("trace file `{}`", p.display()),
        None => format!(
            "synthetic wikibench trace ({} requests/s at factor 1)",
            args.rate
        ),
    };
    let workers: Vec<String> = args.workers.iter().map(|w| w.to_string()).collect();
    let cost = mean_cost_ms.map_or(String::new(), |c| {
        format!("; mean service time {c:.1} ms at the largest factor")
    });
    format!(
        "{} s of the {source} per factor and scheme, open loop; back ends with {} workers (accept queue {}){cost}; a request is an error when it is not answered 200 in full within {} s. HAProxy runs with `retries 3` and `option redispatch`; the PEs of WRR, least connections, P2C and Prequal-style register their capacities as weights (as HAProxy's weighted schemes are given them); hashing selections key on the page (`X-Page`).\n\n",
        args.duration_s,
        workers.join(" / "),
        args.backlog,
        args.timeout_s
    )
}

/// One seed and burst amplitude: every figure of every scheme.
pub fn single(args: &TraceArgs, factors: &[(String, f64)], run: &Run) -> String {
    let mut s = scenario(args, Some(run.mean_cost_ms));
    let _ = writeln!(s, "Seed {}, burst ±{}.\n", run.seed, run.burst);
    for (i, (name, _)) in factors.iter().enumerate() {
        let (rate, util) = run.offered[i];
        let _ = writeln!(
            s,
            "**Factor {name}**: {rate:.1} requests/s, {:.0} % of the pool's capacity offered.\n",
            util * 100.0
        );
        let _ = writeln!(
            s,
            "| scheme | requests | errors | first response mean / p50 / p99 / max, ms | normalised | p_ISP | retries | ejections | reports/s | PE CPU % |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
        for (scheme, rows) in &run.results {
            let r = &rows[i];
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} / {:.1} / {:.1} / {:.0} | {:.2} | {:.2e} | {:.0} | {:.0} | {:.1} | {:.1} |",
                scheme.name(),
                r.requests,
                r.errors,
                r.mean_ms,
                r.p50_ms,
                r.p99_ms,
                r.max_ms,
                r.normalised,
                r.penalty,
                r.retries,
                r.ejections,
                r.reports_per_s,
                r.pe_cpu
            );
        }
        let late = run
            .results
            .iter()
            .map(|(_, rows)| rows[i].late_ms)
            .fold(0.0, f64::max);
        let _ = writeln!(s, "\nLatest send behind its trace time: {late:.1} ms.\n");
    }
    s
}

/// Several seeds and burst amplitudes: per factor, each scheme's errors in every run, the
/// median p99, and retries and ejections summed.
pub fn matrix(args: &TraceArgs, factors: &[(String, f64)], runs: &[Run]) -> String {
    let mut s = scenario(args, None);
    let heads: Vec<String> = runs
        .iter()
        .map(|r| format!("±{} s{}", r.burst, r.seed))
        .collect();
    let _ = writeln!(
        s,
        "Errors per run are given as burst amplitude and seed (`±0.25 s1`: burst ±0.25, seed 1).\n"
    );
    let schemes: Vec<Scheme> = runs[0].results.iter().map(|(s, _)| *s).collect();
    for (i, (name, _)) in factors.iter().enumerate() {
        let (lo, hi) = runs
            .iter()
            .map(|r| r.offered[i].1)
            .fold((f64::MAX, 0.0f64), |(a, b), u| (a.min(u), b.max(u)));
        let _ = writeln!(
            s,
            "**Factor {name}**: {:.0}–{:.0} % of the pool's capacity offered.\n",
            lo * 100.0,
            hi * 100.0
        );
        let _ = writeln!(
            s,
            "| scheme | errors: {} | errors in all | p99 first response, ms (median; max) | retries | ejections |",
            heads.join(" / ")
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for (k, scheme) in schemes.iter().enumerate() {
            let rows: Vec<&Row> = runs.iter().map(|r| &r.results[k].1[i]).collect();
            let errors: Vec<String> = rows.iter().map(|r| r.errors.to_string()).collect();
            let total: usize = rows.iter().map(|r| r.errors).sum();
            let requests: usize = rows.iter().map(|r| r.requests).sum();
            let p99: Vec<f64> = rows.iter().map(|r| r.p99_ms).collect();
            let max = p99.iter().copied().fold(0.0, f64::max);
            let _ = writeln!(
                s,
                "| {} | {} | {total} of {requests} | {:.0}; {max:.0} | {:.0} | {:.0} |",
                scheme.name(),
                errors.join(" / "),
                report::median(p99).unwrap_or(f64::NAN),
                rows.iter().map(|r| r.retries).sum::<f64>(),
                rows.iter().map(|r| r.ejections).sum::<f64>(),
            );
        }
        s.push('\n');
    }
    s
}

/// The targets: every rserpool scheme fails no more requests than the HAProxy scheme of its
/// kind in every run; least connections, P2C and Prequal-style have a p99 at most 0.8× that
/// of HAProxy leastconn; credits fail nothing.
pub fn targets(factors: &[(String, f64)], runs: &[Run]) -> String {
    let schemes: Vec<Scheme> = runs[0].results.iter().map(|(s, _)| *s).collect();
    let find = |run: &Run, s: Scheme| run.results.iter().position(|(x, _)| *x == s);
    let mut lines = Vec::new();
    for (k, &scheme) in schemes.iter().enumerate() {
        let rival = scheme.rival().filter(|r| schemes.contains(r));
        if rival.is_none() && !scheme.credits() {
            continue;
        }
        let (mut runs_ok, mut all, mut ratios, mut worst) = (0, 0, Vec::new(), String::new());
        for run in runs {
            for (i, (f, _)) in factors.iter().enumerate() {
                all += 1;
                let ours = &run.results[k].1[i];
                let theirs = rival
                    .and_then(|r| find(run, r))
                    .map(|j| &run.results[j].1[i]);
                let ok = match theirs {
                    Some(t) => ours.errors <= t.errors,
                    None => ours.errors == 0,
                };
                if ok {
                    runs_ok += 1;
                } else if worst.is_empty() {
                    worst = format!(
                        "{f} ±{} s{}: {} against {}",
                        run.burst,
                        run.seed,
                        ours.errors,
                        theirs.map_or(0, |t| t.errors)
                    );
                }
                if let Some(t) = theirs
                    && t.p99_ms > 0.0
                {
                    ratios.push(ours.p99_ms / t.p99_ms);
                }
            }
        }
        let ratio = report::median(ratios.clone());
        let p99_met = !scheme.p99_target() || ratios.iter().all(|&r| r <= 0.8);
        let met = runs_ok == all && p99_met;
        lines.push(format!(
            "| {} | {} | {runs_ok} of {all}{} | {} | {} |",
            scheme.name(),
            rival.map_or("no error at all".into(), |r| r.name().to_string()),
            if worst.is_empty() {
                String::new()
            } else {
                format!(" (first miss: {worst})")
            },
            match (ratio, scheme.p99_target()) {
                (Some(r), true) => format!(
                    "{r:.2}× (max {:.2}×; target ≤ 0.8×)",
                    ratios.iter().copied().fold(0.0, f64::max)
                ),
                (Some(r), false) => format!("{r:.2}×"),
                (None, _) => "–".into(),
            },
            if met { "met" } else { "**not met**" }
        ));
    }
    if lines.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "**Targets.** Errors no more than the HAProxy scheme of the same kind at every factor, seed and burst amplitude (credits: none at all); p99 first response at most 0.8× HAProxy leastconn's for least connections, P2C and Prequal-style (the median ratio and the largest).\n\n\
         | scheme | held against | runs with no more errors | p99 ratio (median) | target |\n|---|---|---|---|---|\n",
    );
    for l in lines {
        s.push_str(&l);
        s.push('\n');
    }
    s.push('\n');
    s
}

/// Keys moved when one of N PEs leaves, for the hashing schemes among `schemes`.
pub fn disruption(schemes: &[Scheme]) -> String {
    let hashing: Vec<(Scheme, rserpool_proxy::Select)> = schemes
        .iter()
        .filter_map(|&s| {
            let sel = match s {
                Scheme::Maglev => rserpool_proxy::Select::Maglev,
                Scheme::RingHash => rserpool_proxy::Select::RingHash,
                _ => return None,
            };
            Some((s, sel))
        })
        .collect();
    if hashing.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "**Disruption.** Share of 100,000 keys whose PE changes when one of N PEs leaves (mean over which PE leaves; largest), against the ideal 1/N; target for Maglev: at most 1/N + 2 %.\n\n\
         | scheme | N | 1/N | moved (mean) | moved (largest) | target |\n|---|---|---|---|---|---|\n",
    );
    for (scheme, sel) in hashing {
        for n in [3u32, 5, 10, 20] {
            let Some((mean, max)) = rserpool_proxy::balance::hashing::key_movement(sel, n, 100_000)
            else {
                continue;
            };
            let ideal = 1.0 / f64::from(n);
            let target = if scheme == Scheme::Maglev {
                if max <= ideal + 0.02 {
                    "met"
                } else {
                    "**not met**"
                }
            } else {
                "–"
            };
            let _ = writeln!(
                s,
                "| {} | {n} | {:.1} % | {:.1} % | {:.1} % | {target} |",
                scheme.name(),
                ideal * 100.0,
                mean * 100.0,
                max * 100.0
            );
        }
    }
    s.push('\n');
    s
}

pub fn plots(dir: &Path, factors: &[(String, f64)], results: &[(Scheme, Vec<Row>)]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let groups: Vec<String> = factors.iter().map(|f| format!("factor {}", f.0)).collect();
    let series = |pick: &dyn Fn(&Row) -> f64| -> Vec<(String, Vec<f64>)> {
        results
            .iter()
            .map(|(s, rows)| (s.name().to_string(), rows.iter().map(pick).collect()))
            .collect()
    };
    let path = |name: &str| -> Result<String> {
        dir.join(name)
            .to_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("plot path is not UTF-8"))
    };
    plot::bars(
        &path("bench-trace-p99.png")?,
        "First response time p99 by scheme (lower is better)",
        "ms",
        &groups,
        &series(&|r| r.p99_ms),
    )?;
    plot::bars(
        &path("bench-trace-errors.png")?,
        "Request errors by scheme (lower is better)",
        "% of requests",
        &groups,
        &series(&|r| 100.0 * r.errors as f64 / r.requests.max(1) as f64),
    )?;
    plot::bars(
        &path("bench-trace-normalised.png")?,
        "Normalised first response time (response / service time)",
        "×",
        &groups,
        &series(&|r| r.normalised),
    )?;
    Ok(())
}
