//! The proxy tier's simulation, as `cargo test` runs it: `SIM_TIER_SEEDS` seeds (200 unless
//! set) from `SIM_TIER_FROM` (0), each with the checks of `rserpool_sim::tier`. A failing
//! seed prints the command that replays it with its log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_sim::tier::{self, Break};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn the_tier_keeps_its_connections_under_random_faults() {
    let summary = tier::run_seeds(
        env("SIM_TIER_FROM", 0),
        env("SIM_TIER_SEEDS", 200),
        threads(),
        Break::None,
    );
    eprint!("{}", summary.report(threads()));
    assert!(
        summary.failures.is_empty(),
        "{} seed(s) failed; replay each with the command above",
        summary.failures.len()
    );
    // The faults happened, and the tier did its work through them.
    let c = &summary.counts;
    for kind in [
        "kill",
        "silent death",
        "restart",
        "members cut",
        "member isolated",
    ] {
        assert!(c.faults.get(kind).copied().unwrap_or(0) > 0, "no {kind}");
    }
    assert!(c.forwarded > 0 && c.group_changes > 0 && c.connections > 0);
}

/// The checks can fail: a member core that sends no table to a member that links to it
/// (a), or touches entries that carried nothing (b), and a group that keeps dead members (c)
/// are caught.
#[test]
fn a_broken_core_fails_seeds() {
    for sabotage in [
        Break::NoTableOnJoin,
        Break::TouchAll,
        Break::GroupNeverShrinks,
    ] {
        let s = tier::run_seeds(0, 20, threads(), sabotage);
        assert!(!s.failures.is_empty(), "{sabotage:?}: no seed of 20 failed");
        eprintln!(
            "{sabotage:?}: {} of 20 seeds failed, e.g. seed {}: {}",
            s.failures.len(),
            s.failures[0].0,
            s.failures[0].1
        );
    }
}

/// The same seed gives the same run, so a failure replays.
#[test]
fn a_tier_seed_replays_exactly() {
    let a = tier::run_seed(3, false).unwrap().counts;
    let b = tier::run_seed(3, false).unwrap().counts;
    assert_eq!(a.faults, b.faults);
    assert_eq!(
        (a.packets, a.messages, a.revived),
        (b.packets, b.messages, b.revived)
    );
}
