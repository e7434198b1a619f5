//! The registrar benchmark's report: Markdown tables (one for single registrars, one for
//! clusters) and the plots in the style of the seed paper's Figures 7 and 8.

use super::Sample;
use crate::plot;
use crate::report::provenance;
use anyhow::Result;

/// The registrar's CPU, with the range over the runs when there were several.
fn cpu_cell(x: &Sample) -> String {
    spread(
        format!("{:.1}%", x.registrar_cpu * 100.0),
        x.runs > 1,
        format!(
            "{:.1}–{:.1}",
            x.registrar_cpu_min * 100.0,
            x.registrar_cpu_max * 100.0
        ),
    )
}

/// `value`, followed by `(range)` when there were several runs.
fn spread(value: String, several: bool, range: String) -> String {
    if several {
        format!("{value} ({range})")
    } else {
        value
    }
}

/// A results section's title, command, machine, date and, with repeated runs, how to read them.
fn section_head(title: &str, samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "### {title}\n");
    s += &provenance();
    let runs = samples.first().map_or(1, |x| x.runs);
    if runs > 1 {
        let _ = writeln!(
            s,
            "Each row is the median of {runs} runs; CPU shows the range over the runs in brackets, p99 the highest run.\n"
        );
    }
    s
}

pub(super) fn markdown(samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = section_head("Registrar (`rserpool-bench registrar`)", samples);
    let _ = writeln!(
        s,
        "| PEs | PUs | re-reg every (ms) | resolve every (ms) | registrar CPU (1 core = 100%) | RSS (MB) | p50 (µs) | p99 (µs) | offered/s | answered/s | errors | load generator CPU |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for x in samples {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.0} | {:.0} | {} | {:.0}% |",
            x.pes,
            x.pus,
            if x.pes > 0 {
                x.rereg_ms.to_string()
            } else {
                "-".into()
            },
            if x.pus > 0 {
                x.resolve_ms.to_string()
            } else {
                "-".into()
            },
            cpu_cell(x),
            x.rss_bytes as f64 / 1e6,
            x.p50_us,
            spread(x.p99_us.to_string(), x.runs > 1, x.p99_us_max.to_string()),
            x.offered_per_s,
            x.answered_per_s,
            x.errors,
            x.loadgen_cpu * 100.0
        );
    }
    s.push('\n');
    s
}

/// `--tls`: every point in plain TCP and over TLS, side by side, and the CPU ratio.
pub(super) fn tls_markdown(samples: &[Sample]) -> String {
    side_by_side(
        samples,
        "Registrar with TLS (`rserpool-bench registrar --tls`)",
        "Each point twice in one run, back to back: ASAP in plain TCP, then over TLS 1.3 with \
         mutual authentication (ECDSA P-256 certificates of a test CA, one handshake per \
         connection at setup). Target: registrar CPU with TLS at most 1.5× plain \
         for 1,000 PEs re-registering every 250 ms.",
        ("plain", "TLS"),
        |x| x.tls,
    )
}

/// `--sctp`: every point over TCP and over SCTP in UDP, side by side, and the CPU ratio.
pub(super) fn sctp_markdown(samples: &[Sample]) -> String {
    side_by_side(
        samples,
        "Registrar over SCTP (`rserpool-bench registrar --sctp`)",
        "Each point twice in one run, back to back: ASAP over TCP, then over SCTP in UDP \
         (RFC 6951; rserpool's user-space SCTP in the registrar and in the load generator, \
         all of whose associations share one UDP socket). Target: registrar CPU per message \
         over SCTP at most 1.5× TCP's.",
        ("TCP", "SCTP"),
        |x| x.sctp,
    )
}

/// Each point in two modes side by side (`is_b` picks the second's samples).
fn side_by_side(
    samples: &[Sample],
    title: &str,
    intro: &str,
    (a, b): (&str, &str),
    is_b: fn(&Sample) -> bool,
) -> String {
    use std::fmt::Write;
    let mut s = section_head(title, samples);
    let _ = writeln!(s, "{intro}\n");
    let _ = writeln!(
        s,
        "| PEs | PUs | re-reg every (ms) | CPU {a} | CPU {b} | {b} / {a} | RSS {a} (MB) | RSS {b} (MB) | p99 {a} (µs) | p99 {b} (µs) | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for t in samples.iter().filter(|x| is_b(x)) {
        let Some(p) = samples
            .iter()
            .find(|x| !is_b(x) && x.pes == t.pes && x.pus == t.pus && x.rereg_ms == t.rereg_ms)
        else {
            continue;
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.2}× | {:.1} | {:.1} | {} | {} | {} |",
            t.pes,
            t.pus,
            t.rereg_ms,
            cpu_cell(p),
            cpu_cell(t),
            t.registrar_cpu / p.registrar_cpu.max(1e-9),
            p.rss_bytes as f64 / 1e6,
            t.rss_bytes as f64 / 1e6,
            p.p99_us,
            t.p99_us,
            p.errors + t.errors
        );
    }
    s.push('\n');
    s
}

/// Figure 7 style (CPU against PEs, one line per re-registration interval) and Figure 8 style
/// (CPU against PUs, one line per resolution interval).
pub(super) fn plot(samples: &[Sample], prefix: &str) -> Result<()> {
    let mut by_a: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
    let mut by_b: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
    for s in samples {
        if s.pus == 0 {
            by_a.entry(s.rereg_ms)
                .or_default()
                .push((s.pes as f64, s.registrar_cpu * 100.0));
        } else if s.pes == 1000 {
            by_b.entry(s.resolve_ms)
                .or_default()
                .push((s.pus as f64, s.registrar_cpu * 100.0));
        }
    }
    let series = |m: std::collections::BTreeMap<u64, Vec<(f64, f64)>>, what: &str| {
        m.into_iter()
            .map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                (format!("{what} = {k} ms"), v)
            })
            .collect::<Vec<_>>()
    };
    let a = series(by_a, "re-registration a");
    if !a.is_empty() {
        plot::lines(
            &format!("{prefix}-pes.png"),
            "Registrar CPU against pool elements (seed Fig. 7 left)",
            "pool elements (log scale)",
            "registrar CPU, % of one core",
            &a,
            true,
        )?;
    }
    let b = series(by_b, "resolution b");
    if !b.is_empty() {
        plot::lines(
            &format!("{prefix}-pus.png"),
            "Registrar CPU against pool users, 1,000 PEs (seed Fig. 8 left)",
            "pool users",
            "registrar CPU, % of one core",
            &b,
            false,
        )?;
    }
    Ok(())
}

/// Figure 7 right: the home registrar's and a synchronising registrar's CPU against K.
pub(super) fn cluster_markdown(samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut s = section_head(
        "Registrar cluster (`rserpool-bench registrar --figure 7r`)",
        samples,
    );
    let _ = writeln!(
        s,
        "K registrars in one ENRP cluster on this host, all PEs registered at the first (home), which sends every change to the K - 1 others. All K registrars and the load generator share the 2 cores.\n"
    );
    let _ = writeln!(
        s,
        "| K | PEs | re-reg every (ms) | home registrar CPU | home CPU / K = 1 | synchronising registrar CPU | p99 (µs) | answered/s | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for x in samples {
        let base = samples
            .iter()
            .find(|b| b.registrars == 1 && b.rereg_ms == x.rereg_ms && b.pes == x.pes)
            .map(|b| b.registrar_cpu);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {} |",
            x.registrars,
            x.pes,
            x.rereg_ms,
            cpu_cell(x),
            base.map_or("-".into(), |b| format!("{:.2}×", x.registrar_cpu / b)),
            x.sync_cpu
                .map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
            x.p99_us,
            x.answered_per_s,
            x.errors
        );
    }
    s.push('\n');
    s
}

pub(super) fn cluster_plot(samples: &[Sample], prefix: &str) -> Result<()> {
    let mut series: std::collections::BTreeMap<(u64, u8), Vec<(f64, f64)>> = Default::default();
    for s in samples {
        let k = f64::from(s.registrars);
        series
            .entry((s.rereg_ms, 0))
            .or_default()
            .push((k, s.registrar_cpu * 100.0));
        if let Some(c) = s.sync_cpu {
            series
                .entry((s.rereg_ms, 1))
                .or_default()
                .push((k, c * 100.0));
        }
    }
    let lines: Vec<(String, Vec<(f64, f64)>)> = series
        .into_iter()
        .map(|((a, kind), mut v)| {
            v.sort_by(|x, y| x.0.total_cmp(&y.0));
            let who = if kind == 0 { "home" } else { "synchronising" };
            (format!("{who}, a = {a} ms"), v)
        })
        .collect();
    plot::lines(
        &format!("{prefix}-cluster.png"),
        "Registrar CPU against registrars in the cluster, 1,000 PEs (seed Fig. 7 right)",
        "registrars K",
        "registrar CPU, % of one core",
        &lines,
        false,
    )
}
