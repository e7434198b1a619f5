//! Every RSerPool role under one simulated network and clock: registrar cores
//! (`rserpool-registrar`), pool element cores and pool user cores (`rserpool-asap`), exactly the
//! state machines the real processes run, driven by [`world`] over the network of [`net`]. A
//! seed decides everything, so a failure replays.
//!
//! One run ([`run_seed`]):
//! 1. registrars (3 or 4), pool elements and pool users start; a third of the PEs know only the
//!    first registrar (its death leaves them to find another), a third all of them, a third only hear SERVER_ANNOUNCE;
//! 2. faults at random: registrars and PEs crash and start again (a PE with a new identifier),
//!    PEs deregister and come back, loads change, messages are delayed and lost, registrars
//!    are cut from each other, isolated, or cut from single PEs, connections reset;
//! 3. healing: every cut ends, crashed processes start again; after a bounded settling time
//!    every live registrar must hold the same handlespace, with every live PE once, homed at a
//!    live registrar that the PE takes for its home, no dead PE, and agreeing checksums; and
//!    every pool user's resolution must give live PEs only ([`check`]);
//! 4. the first registrar is killed, and a PE or two: no live PE may leave any surviving
//!    registrar meanwhile (they are taken over, not lost), the dead PEs must be gone within
//!    their keep-alive bound, and the checks of 3 hold again.
//!
//! The proxy tier has a simulation of its own ([`tier`]): member and distributor cores
//! (`rserpool-tier`) with a model of each member's datapath and of the router, under
//! crashes, partitions and loss (`--tier`).
//!
//! `cargo test -p rserpool-sim` runs 500 seeds; `cargo run --release -p rserpool-sim --
//! --seeds 10000` many more, with the time taken; `-- --seed N` replays one with its log.

pub mod check;
pub mod net;
pub mod rng;
pub mod seeds;
pub mod tier;
pub mod world;

use net::{Ms, Node};
use rserpool_wire::Policy;
use world::{
    KEEP_ALIVE_MS, MAX_TIME_LAST_HEARD_MS, MAX_TIME_NO_RESPONSE_MS, POOLS, TAKEOVER_EXPIRY_MS,
    World,
};

/// Simulated time before the first fault.
const WARM_UP_MS: Ms = 3_000;
/// Simulated time of faults.
const FAULTS_MS: Ms = 30_000;
/// From healing to the checks. It covers a registration life (three reregistration
/// intervals), the backstop for an entry no live registrar supervises: a registrar restarted
/// while the network heals may learn a dead PE from a mentor that had not yet heard of its
/// removal, homed at a registrar that is gone (audits compare the checksums of live owners
/// only).
const SETTLE_MS: Ms = 20_000;
const _: () = assert!(SETTLE_MS >= 3 * world::REREGISTRATION_MS);
/// From the last kill to the checks.
const FINAL_MS: Ms = 12_000;
/// Longest a dead PE may stay once the network is whole: its home's keep-alive and its timeout,
/// or, when its home died too, the time to take the home's PEs over; and a second.
pub const DEAD_PE_BOUND_MS: Ms = 2 * KEEP_ALIVE_MS
    + MAX_TIME_LAST_HEARD_MS
    + MAX_TIME_NO_RESPONSE_MS
    + TAKEOVER_EXPIRY_MS
    + 1_000;

/// What a run looked like.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// From healing until the checks first held.
    pub converged_ms: Ms,
    pub counts: world::Counts,
}

/// The command that replays `seed` with its log.
pub fn replay_command(seed: u64) -> String {
    format!("cargo run --release -p rserpool-sim -- --seed {seed}")
}

/// Runs one seed (`log`: narrate it on stderr).
pub fn run_seed(seed: u64, log: bool) -> Result<Outcome, String> {
    let regs = 3 + (seed % 2) as usize;
    let mut w = World::new(seed, regs, 12, 3, log);
    let r = run(&mut w).map_err(|e| format!("at {} ms: {e}", w.now()));
    if r.is_err() {
        let now = rserpool_asap::Instant::from_millis(w.now());
        for i in w.live_registrars() {
            if let Some(reg) = w.regs[i].core.as_ref() {
                w.say(|| {
                    format!(
                        "registrar {i} ({:#x}) peers: {:?}",
                        reg.id(),
                        reg.peer_status(now)
                    )
                });
            }
        }
    }
    r
}

fn run(w: &mut World) -> Result<Outcome, String> {
    advance(w, WARM_UP_MS);
    let end = w.now() + FAULTS_MS;
    while w.now() < end {
        advance(w, 100);
        if w.rng.chance(60) {
            fault(w);
        }
    }

    w.say(|| "healing: cuts end, loss ends, crashed processes start again".into());
    w.net.heal();
    w.net.loss = 0;
    w.net.max_delay = 20;
    for i in 0..w.regs.len() {
        if w.regs[i].core.is_none() {
            w.start_registrar(i);
        }
    }
    for k in 0..w.pes.len() {
        match w.pes[k].core.as_mut() {
            None => w.start_pe(k),
            Some(p) => {
                let now = rserpool_asap::Instant::from_millis(w.net.now);
                p.set_active(true, now);
                w.flush(Node::Pe(k));
            }
        }
    }
    let healed = w.now();
    let mut converged = None;
    while w.now() < healed + SETTLE_MS {
        advance(w, 250);
        if converged.is_none() && check::converged(w).is_ok() {
            converged = Some(w.now() - healed);
        }
    }
    check::converged(w).map_err(|e| format!("{SETTLE_MS} ms after healing: {e}"))?;
    check::resolutions(w).map_err(|e| format!("after healing: {e}"))?;

    // The first registrar dies within the whole, and PEs with it.
    w.say(|| "registrar 0 and some PEs are killed".into());
    w.count("final kill");
    w.crash(Node::Reg(0));
    for _ in 0..2 {
        if let Some(k) = w.rng.pick(&(0..w.pes.len()).collect::<Vec<_>>()) {
            w.crash(Node::Pe(k));
        }
    }
    let killed = w.now();
    let kept = w.live_pes();
    while w.now() < killed + FINAL_MS {
        advance(w, 250);
        let after = w.now() - killed;
        check::none_lost(w, &kept).map_err(|e| format!("{after} ms after the kill: {e}"))?;
        check::dead_gone(w, killed, DEAD_PE_BOUND_MS)?;
    }
    check::converged(w).map_err(|e| format!("{FINAL_MS} ms after the kill: {e}"))?;
    check::resolutions(w).map_err(|e| format!("after the kill: {e}"))?;
    Ok(Outcome {
        converged_ms: converged.unwrap_or(SETTLE_MS),
        counts: w.counts.clone(),
    })
}

/// Runs `ms` of simulated time, the pool users resolving now and then.
fn advance(w: &mut World, ms: Ms) {
    let end = w.now() + ms;
    while w.now() < end {
        let t = (w.now() + 250).min(end);
        w.run_until(t);
        for u in 0..w.pus.len() {
            if w.rng.chance(200) {
                let pool = POOLS[w.rng.below(POOLS.len() as u64) as usize];
                w.resolve(u, pool.into());
            }
        }
    }
}

/// One fault, chosen at random.
fn fault(w: &mut World) {
    let n = w.regs.len();
    let pes: Vec<usize> = (0..w.pes.len()).collect();
    let now = rserpool_asap::Instant::from_millis(w.now());
    match w.rng.below(12) {
        0 => {
            let live = w.live_registrars();
            if live.len() > 1
                && let Some(i) = w.rng.pick(&live)
            {
                w.count("registrar crash");
                w.crash(Node::Reg(i));
            }
        }
        1 => {
            if let Some(i) = (0..n).find(|&i| w.regs[i].core.is_none()) {
                w.count("registrar restart");
                w.start_registrar(i);
            }
        }
        2 => {
            if let Some(k) = w.rng.pick(&pes)
                && w.pes[k].core.is_some()
            {
                w.count("PE crash");
                w.crash(Node::Pe(k));
            }
        }
        3 => {
            if let Some(k) = (0..w.pes.len()).find(|&k| w.pes[k].core.is_none()) {
                w.count("PE restart");
                w.start_pe(k);
            }
        }
        4 => {
            let a = w.rng.below(n as u64) as usize;
            let b = (a + 1 + w.rng.below(n as u64 - 1) as usize) % n;
            w.count("registrar cut");
            w.say(|| format!("registrars {a} and {b} cut"));
            w.net.cut(Node::Reg(a), Node::Reg(b));
        }
        5 => {
            let i = w.rng.below(n as u64) as usize;
            w.count("registrar isolated");
            w.say(|| format!("registrar {i} isolated"));
            w.net.isolate(Node::Reg(i));
        }
        6 => {
            let i = w.rng.below(n as u64) as usize;
            if let Some(k) = w.rng.pick(&pes) {
                w.count("registrar-PE cut");
                w.say(|| format!("registrar {i} and PE {k} cut"));
                w.net.cut(Node::Reg(i), Node::Pe(k));
            }
        }
        7 => {
            if w.net.is_cut() {
                w.count("heal");
                w.say(|| "cuts heal".into());
                w.net.heal();
            }
        }
        8 => {
            let (loss, delay) = [(0, 20), (20, 30), (100, 60), (0, 300)][w.rng.below(4) as usize];
            w.count("loss and delay");
            w.say(|| format!("loss {loss}‰, delay up to {delay} ms"));
            w.net.loss = loss;
            w.net.max_delay = delay;
        }
        9 => {
            if let Some(k) = w.rng.pick(&pes)
                && let Some(p) = w.pes[k].core.as_mut()
            {
                let active = !matches!(p.state(), rserpool_asap::PeState::Inactive);
                p.set_active(!active, now);
                w.count(if active { "PE deregisters" } else { "PE back" });
                w.flush(Node::Pe(k));
            }
        }
        10 => {
            let load = w.rng.below(u64::from(u32::MAX)) as u32;
            let odd: Vec<usize> = pes.iter().copied().filter(|k| k % 2 == 1).collect();
            if let Some(k) = w.rng.pick(&odd)
                && let Some(p) = w.pes[k].core.as_mut()
            {
                p.update_policy(Policy::LeastUsed { load }, now);
                w.count("load change");
                w.flush(Node::Pe(k));
            }
        }
        _ => {
            let open = w.open_connections();
            if let Some(id) = w.rng.pick(&open) {
                w.count("connection reset");
                w.say(|| format!("connection {id} reset"));
                w.reset(id);
            }
        }
    }
}

/// What many seeds gave.
#[derive(Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    /// Failed seeds and why.
    pub failures: Vec<(u64, String)>,
    /// Time from healing to convergence, per passed seed.
    pub converged_ms: Vec<Ms>,
    pub counts: world::Counts,
    pub elapsed: std::time::Duration,
}

impl Summary {
    /// A line per failure (with its replay command), then the totals.
    pub fn report(&self, threads: usize) -> String {
        let mut out = String::new();
        for (seed, why) in &self.failures {
            out.push_str(&format!(
                "seed {seed} failed: {why}\n  replay: {}\n",
                replay_command(seed.to_owned())
            ));
        }
        let secs = self.elapsed.as_secs_f64();
        let mut conv = self.converged_ms.clone();
        conv.sort_unstable();
        let pick = |q: f64| conv.get(((conv.len() as f64 - 1.0) * q) as usize).copied();
        out.push_str(&format!(
            "{} seeds in {secs:.1} s ({:.0} seeds/s, {threads} thread(s)): {} failed\n",
            self.seeds,
            self.seeds as f64 / secs.max(1e-9),
            self.failures.len()
        ));
        out.push_str(&format!(
            "converged after healing: median {} ms, 99th percentile {} ms, max {} ms\n",
            pick(0.5).unwrap_or(0),
            pick(0.99).unwrap_or(0),
            pick(1.0).unwrap_or(0)
        ));
        let c = &self.counts;
        let faults: Vec<String> = c.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
        out.push_str(&format!(
            "injected: {}\ntakeovers adopted by PEs {}, resolutions {}, unreachable reports {}\n",
            faults.join(", "),
            c.takeovers_adopted,
            c.resolutions,
            c.unreachable_reports
        ));
        out
    }
}

/// Runs seeds `from..from + count` on `threads` threads.
pub fn run_seeds(from: u64, count: u64, threads: usize) -> Summary {
    let started = std::time::Instant::now();
    let parts = seeds::on_threads(
        from,
        count,
        threads,
        |seed, part: &mut Summary| {
            part.seeds += 1;
            match run_seed(seed, false) {
                Ok(o) => {
                    part.converged_ms.push(o.converged_ms);
                    part.counts.add(&o.counts);
                }
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
        all.converged_ms.extend(p.converged_ms);
        all.counts.add(&p.counts);
    }
    all.failures.sort();
    all.elapsed = started.elapsed();
    all
}
