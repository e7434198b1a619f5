//! The proxy tier under the simulated clock: member cores and a distributor core
//! (`rserpool-tier`, the code the proxies and `rserpool distributor` run) with a model of each
//! member's datapath (its flow table, expiry and forwarding by port) and of the router (the
//! distributor's group; a flow stays on its member until that member leaves the group). A
//! seed decides everything, so a failure replays.
//!
//! One run ([`run_seed`]): 3 or 4 members start; spliced connections are made at members
//! over time, carry packets through whichever member the router picks, and end by FINs or an
//! RST. Rounds of faults (members crash, silently or not, and start again as new processes;
//! pairs of members are cut from each other; a member is isolated from everyone; datagrams
//! are lost) alternate with calm. The invariants (a), (b), (c) of docs/TIER.md are checked
//! all along.
//!
//! Split by job, each file using only those below it:
//! - this file: a run (its schedule, the loop of model steps and checks) and many runs'
//!   summary;
//! - `faults.rs`: the faults and the healing;
//! - `check.rs`: the invariants, judged after each step;
//! - `world.rs`: the model (members, links, datagrams, the distributor, the router, the
//!   connections), which records what the checks must judge and never calls them;
//! - `datapath.rs`: one member's flow table, expired by the tier core's rule.

mod check;
mod datapath;
mod faults;
mod world;

pub use check::{ENTRY_BOUND_MS, JOIN_BOUND_MS, SETTLE_MS};
pub use datapath::{CLOSING_MS, IDLE_MS};
pub use world::{Break, Counts, HEARTBEAT_MS};

use crate::net::Ms;
use check::Checks;
use std::time::Duration;
use world::TierWorld;

const WARM_UP_MS: Ms = 3_000;
const ROUNDS: usize = 4;
const FAULTS_MS: Ms = 6_000;
const CALM_MS: Ms = 8_000;
const FINAL_MS: Ms = ENTRY_BOUND_MS + 2_000;

/// What a run gave.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub counts: Counts,
}

/// The command that replays `seed` with its log.
pub fn replay_command(seed: u64) -> String {
    format!("cargo run --release -p rserpool-sim -- --tier --seed {seed}")
}

/// Runs one seed (`log`: narrate it on stderr).
pub fn run_seed(seed: u64, log: bool) -> Result<Outcome, String> {
    run_seed_with(seed, Break::None, log)
}

/// The model and its checks, stepped together.
struct Run {
    w: TierWorld,
    checks: Checks,
}

impl Run {
    fn run_for(&mut self, ms: Ms) -> Result<(), String> {
        let end = self.w.now + ms;
        while self.w.now < end {
            self.w.step();
            self.checks.after_step(&mut self.w)?;
        }
        Ok(())
    }
}

/// Runs one seed with a sabotaged core (to see that the checks fail).
pub fn run_seed_with(seed: u64, sabotage: Break, log: bool) -> Result<Outcome, String> {
    let members = 3 + (seed % 2) as usize;
    let mut r = Run {
        w: TierWorld::new(seed, members, sabotage, log),
        checks: Checks::default(),
    };
    r.run_for(WARM_UP_MS)?;
    for _ in 0..ROUNDS {
        let end = r.w.now + FAULTS_MS;
        while r.w.now < end {
            r.run_for(100)?;
            if r.w.rng.chance(60) {
                faults::fault(&mut r.w);
            }
        }
        r.w.say(|| "calm".into());
        faults::heal(&mut r.w);
        r.run_for(CALM_MS)?;
    }
    // Every open connection ends now: once none is open, no entry may be left.
    r.w.say(|| "last connections end".into());
    r.w.end_connections();
    r.run_for(FINAL_MS)?;
    check::at_end(&r.w, FINAL_MS)?;
    Ok(Outcome { counts: r.w.counts })
}

/// What many seeds gave.
#[derive(Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    pub failures: Vec<(u64, String)>,
    pub counts: Counts,
    pub elapsed: Duration,
}

impl Summary {
    pub fn report(&self, threads: usize) -> String {
        let mut out = String::new();
        for (seed, why) in &self.failures {
            out.push_str(&format!(
                "tier seed {seed} failed: {why}\n  replay: {}\n",
                replay_command(*seed)
            ));
        }
        let secs = self.elapsed.as_secs_f64();
        out.push_str(&format!(
            "{} tier seeds in {secs:.1} s ({:.0} seeds/s, {threads} thread(s)): {} failed\n",
            self.seeds,
            self.seeds as f64 / secs.max(1e-9),
            self.failures.len()
        ));
        let c = &self.counts;
        let faults: Vec<String> = c.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
        out.push_str(&format!(
            "injected: {}\nconnections {}, packets {} ({} forwarded by port, {} lost to dead or \
             cut-off members), group changes {}, messages {}; connections broken outside calm \
             {}, lost with every member that held them {}; entries revived after their end {}\n",
            faults.join(", "),
            c.connections,
            c.packets,
            c.forwarded,
            c.lost_packets,
            c.group_changes,
            c.messages,
            c.broken_unsettled,
            c.lost_connections,
            c.revived
        ));
        out
    }
}

/// Runs seeds `from..from + count` on `threads` threads.
pub fn run_seeds(from: u64, count: u64, threads: usize, sabotage: Break) -> Summary {
    let started = std::time::Instant::now();
    let parts = crate::seeds::on_threads(
        from,
        count,
        threads,
        |seed, part: &mut Summary| {
            part.seeds += 1;
            match run_seed_with(seed, sabotage, false) {
                Ok(o) => part.counts.add(&o.counts),
                Err(e) => part.failures.push((seed, e)),
            }
        },
        || Summary {
            failures: vec![(u64::MAX, "a simulation thread panicked".into())],
            ..Summary::default()
        },
    );
    let mut all = Summary::default();
    for p in parts {
        all.seeds += p.seeds;
        all.failures.extend(p.failures);
        all.counts.add(&p.counts);
    }
    all.failures.sort();
    all.elapsed = started.elapsed();
    all
}
