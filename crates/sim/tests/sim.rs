//! The simulation of every role, as `cargo test` runs it: `SIM_SEEDS` seeds (500 unless set)
//! from `SIM_FROM` (0), each a run of faults, healing and a registrar's death with the checks of
//! the library's docs. A failing seed prints the command that replays it with its log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn every_role_keeps_its_guarantees_under_random_faults() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let summary = rserpool_sim::run_seeds(env("SIM_FROM", 0), env("SIM_SEEDS", 500), threads);
    eprint!("{}", summary.report(threads));
    assert!(
        summary.failures.is_empty(),
        "{} seed(s) failed; replay each with the command above",
        summary.failures.len()
    );
    // The faults happened: the checks above are not about a quiet network.
    let faults = &summary.counts.faults;
    for kind in [
        "registrar crash",
        "registrar isolated",
        "registrar-PE cut",
        "PE crash",
    ] {
        assert!(faults.get(kind).copied().unwrap_or(0) > 0, "no {kind}");
    }
    assert!(summary.counts.takeovers_adopted > 0);
}

/// The same seed gives the same run, so a failure replays.
#[test]
fn a_seed_replays_exactly() {
    let a = rserpool_sim::run_seed(7, false).unwrap();
    let b = rserpool_sim::run_seed(7, false).unwrap();
    assert_eq!(a.converged_ms, b.converged_ms);
    assert_eq!(a.counts.faults, b.counts.faults);
    assert_eq!(a.counts.resolutions, b.counts.resolutions);
    assert_eq!(a.counts.takeovers_adopted, b.counts.takeovers_adopted);
}
