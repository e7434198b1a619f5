//! What goes wrong in a run, and the healing after it: this picks a fault at random and has
//! the model apply it (a process dies, members are cut apart, one is isolated, datagrams are
//! lost); the model knows what each means. Apart from the model so that the schedule of a
//! run and the faults it injects can change without touching what a member is.

use super::world::TierWorld;

fn count(w: &mut TierWorld, fault: &'static str) {
    *w.counts.faults.entry(fault).or_default() += 1;
}

/// One fault, chosen at random.
pub(super) fn fault(w: &mut TierWorld) {
    let n = w.members.len();
    let live: Vec<usize> = (0..n).filter(|&k| w.alive(k)).collect();
    let dead: Vec<usize> = (0..n).filter(|&k| !w.alive(k)).collect();
    let span = 1_000 + w.rng.below(3_000);
    match w.rng.below(6) {
        0 | 1 if live.len() > 1 => {
            if let Some(k) = w.rng.pick(&live) {
                let silent = w.rng.chance(500);
                count(w, if silent { "silent death" } else { "kill" });
                w.crash(k, silent);
            }
        }
        2 => {
            if let Some(k) = w.rng.pick(&dead) {
                count(w, "restart");
                w.start(k);
            }
        }
        3 => {
            let a = w.rng.below(n as u64) as usize;
            let b = (a + 1 + w.rng.below(n as u64 - 1) as usize) % n;
            count(w, "members cut");
            w.say(|| format!("members {a} and {b} cut for {span} ms"));
            w.cut(a, b, span);
        }
        4 if live.len() > 1 => {
            let k = w.rng.below(n as u64) as usize;
            count(w, "member isolated");
            w.say(|| format!("member {k} isolated for {span} ms"));
            w.isolate(k, span);
        }
        _ => {
            count(w, "datagram loss");
            w.say(|| format!("10 % of datagrams and segments lost for {span} ms"));
            w.lose(100, span);
        }
    }
}

/// Every member runs again; cuts end when their time is up.
pub(super) fn heal(w: &mut TierWorld) {
    for k in 0..w.members.len() {
        if !w.alive(k) {
            w.start(k);
        }
    }
}
