//! The guarantees the simulation checks, each an `Err` that says what is wrong.

use crate::net::Ms;
use crate::world::{POOLS, Purpose, World};
use rserpool_asap::PeState;
use rserpool_wire::PoolHandle;
use std::collections::{BTreeMap, BTreeSet};

/// A registrar's handlespace as (pool, PE identifier, home registrar).
pub type View = BTreeSet<(String, u32, u32)>;

pub fn view(w: &World, i: usize) -> View {
    let Some(r) = w.regs[i].core.as_ref() else {
        return View::new();
    };
    let hs = r.handlespace();
    let mut v = View::new();
    for (handle, _, _) in hs.pools() {
        for p in hs.members(handle.as_bytes()) {
            let e = &hs.pe(p).element;
            v.insert((handle.to_string(), e.id, e.home_registrar));
        }
    }
    v
}

/// After healing: every live registrar holds the same handlespace; every live PE is in it once,
/// homed at a live registrar, which the PE itself takes for its home; no other PE is; the
/// checksums of every owner agree.
pub fn converged(w: &World) -> Result<(), String> {
    let live = w.live_registrars();
    let Some(&first) = live.first() else {
        return Err("no registrar alive".into());
    };
    let v = view(w, first);
    for &i in &live[1..] {
        let other = view(w, i);
        if other != v {
            let diff: Vec<_> = v.symmetric_difference(&other).collect();
            return Err(format!("registrars {first} and {i} differ: {diff:x?}"));
        }
    }
    let ids: BTreeMap<u32, usize> = live
        .iter()
        .filter_map(|&i| w.regs[i].core.as_ref().map(|r| (r.id(), i)))
        .collect();
    let mut expected = BTreeSet::new();
    for (k, pe) in w.pes.iter().enumerate() {
        let Some(core) = pe.core.as_ref() else {
            continue;
        };
        let id = core.id();
        expected.insert(id);
        let entries: Vec<_> = v.iter().filter(|e| e.1 == id).collect();
        let [(_, _, home)] = entries[..] else {
            return Err(format!(
                "PE {k} ({id:#x}, {:?}) is in the handlespace {} times",
                core.state(),
                entries.len()
            ));
        };
        if !ids.contains_key(home) {
            return Err(format!("PE {k} ({id:#x}) is homed at {home:#x}, not alive"));
        }
        match core.state() {
            PeState::Registered { home: h, .. } if h == home => {}
            s => return Err(format!("PE {k} ({id:#x}) is homed at {home:#x}, but {s:?}")),
        }
    }
    if let Some(e) = v.iter().find(|e| !expected.contains(&e.1)) {
        return Err(format!(
            "PE {:#x} of pool {} is not alive but present",
            e.1, e.0
        ));
    }
    let owners: BTreeSet<u32> = v.iter().map(|e| e.2).chain(ids.keys().copied()).collect();
    for owner in owners {
        let sums: Vec<u16> = live
            .iter()
            .filter_map(|&i| w.regs[i].core.as_ref())
            .map(|r| r.handlespace().checksum(owner))
            .collect();
        if sums.windows(2).any(|p| p[0] != p[1]) {
            return Err(format!("checksums of owner {owner:#x} differ: {sums:x?}"));
        }
    }
    Ok(())
}

/// Every live registrar still holds every PE of `kept`.
pub fn none_lost(w: &World, kept: &BTreeSet<u32>) -> Result<(), String> {
    for i in w.live_registrars() {
        let here: BTreeSet<u32> = view(w, i).iter().map(|e| e.1).collect();
        if let Some(id) = kept.difference(&here).next() {
            return Err(format!("PE {id:#x} lost from registrar {i}"));
        }
    }
    Ok(())
}

/// No PE that died more than `bound` ms ago (counted from `since` at the earliest) is in a live
/// registrar's handlespace.
pub fn dead_gone(w: &World, since: Ms, bound: Ms) -> Result<(), String> {
    let now = w.now();
    let late: BTreeMap<u32, Ms> = w
        .pes
        .iter()
        .flat_map(|p| p.dead.iter())
        .filter(|(_, died)| (*died).max(since) + bound < now)
        .map(|&(id, died)| (id, died))
        .collect();
    for i in w.live_registrars() {
        if let Some(e) = view(w, i).iter().find(|e| late.contains_key(&e.1)) {
            return Err(format!(
                "PE {:#x} died at {} ms and is still at registrar {i}, homed at {:#x} (bound {bound} ms)",
                e.1, late[&e.1], e.2
            ));
        }
    }
    Ok(())
}

/// Every pool user resolves every pool: each answer is some live PEs, and only live ones.
pub fn resolutions(w: &mut World) -> Result<(), String> {
    for pool in POOLS {
        let handle = PoolHandle::from(pool);
        // Earlier questions first.
        answered(w)?;
        for u in 0..w.pus.len() {
            w.pus[u].answers.clear();
            w.resolve(u, handle.clone());
        }
        answered(w)?;
        let live = w.live_pes();
        for (u, p) in w.pus.iter().enumerate() {
            let Some((_, h, r)) = p.answers.last() else {
                return Err(format!("pool user {u} got no answer for pool {pool}"));
            };
            match r {
                Ok(ids) if h == &handle && !ids.is_empty() => {
                    if let Some(id) = ids.iter().find(|id| !live.contains(id)) {
                        return Err(format!(
                            "pool user {u} was given PE {id:#x} of pool {pool}, which is not alive"
                        ));
                    }
                }
                other => {
                    return Err(format!(
                        "pool user {u}, pool {pool} (asked {h}): {other:x?}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Runs until every pool user's resolution is answered (10 s at most).
fn answered(w: &mut World) -> Result<(), String> {
    let give_up = w.now() + 10_000;
    let waiting = |w: &World| {
        w.pus.iter().any(|p| {
            p.outstanding
                .values()
                .any(|q| matches!(q, Purpose::Resolve(_)))
        })
    };
    while waiting(w) {
        if w.now() >= give_up {
            let stuck: Vec<String> = w
                .pus
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.outstanding.is_empty())
                .map(|(u, p)| {
                    let next = p.core.poll_timeout().map(|t| t.as_millis());
                    format!(
                        "pool user {u} waits for {:?}, next timer {next:?}",
                        p.outstanding
                    )
                })
                .collect();
            return Err(format!(
                "a resolution got no answer within 10 s: {}",
                stuck.join("; ")
            ));
        }
        let t = w.now() + 50;
        w.run_until(t);
    }
    Ok(())
}
