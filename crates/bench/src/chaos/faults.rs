//! Which faults the soak injects, and when: a seeded plan of episodes, so that a run can be
//! described (and, timing aside, repeated) by its seed. An episode is one fault, sometimes
//! two at once on different targets; every fault of an episode heals by itself after its
//! duration, and the soak then measures how long the system takes to converge again.

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` registrar `r` (0..3), started again after `down`.
    KillRegistrar { r: usize, down: Duration },
    /// `kill -9` these pool elements (indices into the PEs), started again after `down`.
    KillPes { pes: Vec<usize>, down: Duration },
    /// Host `host`'s link down (`ip link set … down`) for `down`.
    CutLink { host: usize, down: Duration },
    /// `percent` % of host `host`'s packets dropped for `hold`.
    Loss {
        host: usize,
        percent: u32,
        hold: Duration,
    },
    /// A second process started with the same flags takes `who` over (hand-over, docs/
    /// OPERATIONS.md); the first drains and exits. Nothing heals: `settle` is the wait after.
    Upgrade { who: Upgraded, settle: Duration },
    /// Proxy `p` of the proxy tier dies with its host (`kill -9` and its link cut), and comes
    /// back after `down`.
    KillTierProxy { p: usize, down: Duration },
}

/// What an upgrade replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upgraded {
    Proxy,
    Registrar(usize),
    TierProxy(usize),
}

/// The kinds, in the order the summary lists them.
pub const KINDS: [&str; 6] = [
    "registrar kill -9",
    "PE kill -9",
    "link cut",
    "packet loss",
    "upgrade",
    "proxy-tier host death",
];

impl Fault {
    pub fn kind(&self) -> usize {
        match self {
            Fault::KillRegistrar { .. } => 0,
            Fault::KillPes { .. } => 1,
            Fault::CutLink { .. } => 2,
            Fault::Loss { .. } => 3,
            Fault::Upgrade { .. } => 4,
            Fault::KillTierProxy { .. } => 5,
        }
    }

    pub fn duration(&self) -> Duration {
        match self {
            Fault::KillRegistrar { down, .. }
            | Fault::KillPes { down, .. }
            | Fault::CutLink { down, .. }
            | Fault::KillTierProxy { down, .. } => *down,
            Fault::Loss { hold, .. } => *hold,
            Fault::Upgrade { settle, .. } => *settle,
        }
    }

    /// The hosts whose processes or link it touches (registrar `r` runs on host `r`). The proxy
    /// tier counts as one host beyond the others: one fault of it at a time, so that one proxy
    /// always carries the connections.
    fn hosts(&self, pe_host: impl Fn(usize) -> usize) -> Vec<usize> {
        match self {
            Fault::KillRegistrar { r, .. } => vec![*r],
            Fault::KillPes { pes, .. } => pes.iter().map(|&k| pe_host(k)).collect(),
            Fault::CutLink { host, .. } | Fault::Loss { host, .. } => vec![*host],
            Fault::Upgrade {
                who: Upgraded::Registrar(r),
                ..
            } => vec![*r],
            Fault::Upgrade {
                who: Upgraded::TierProxy(_),
                ..
            }
            | Fault::KillTierProxy { .. } => vec![usize::MAX],
            // The proxy's host is none of the hosts faults pick.
            Fault::Upgrade { .. } => Vec::new(),
        }
    }
}

/// What the plan is made for: the hosts (registrars on 0..3, then the PE hosts) and where each
/// PE runs.
pub struct Layout {
    pub pe_hosts: Vec<usize>,
    /// Hosts whose link may be cut or made lossy: the registrars' (the first three) and the
    /// PEs'.
    pub hosts: usize,
    /// The longest cut of a registrar's link.
    pub registrar_cut_max: Duration,
    /// Proxies of the proxy tier (0: no tier).
    pub tier_proxies: usize,
    /// Whether their hosts die (else they are only upgraded).
    pub tier_deaths: bool,
    /// Only the tier's faults.
    pub only_tier: bool,
}

pub struct Planner {
    rng: Xoshiro256PlusPlus,
    layout: Layout,
    /// Episodes planned so far.
    planned: u64,
}

impl Planner {
    pub fn new(seed: u64, layout: Layout) -> Planner {
        Planner {
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            layout,
            planned: 0,
        }
    }

    /// A number in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.rng.next_u64() % (hi - lo + 1)
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }

    /// The next episode: its faults (they start together) and the pause after it has converged.
    /// The first is an upgrade of the proxy, then (with a tier) an upgrade of a tier proxy and
    /// the death of the other's host, so that even a short run has each.
    pub fn episode(&mut self) -> (Vec<Fault>, Duration) {
        self.planned += 1;
        let first = match (self.planned, self.layout.tier_proxies) {
            (1, _) => Some(Fault::Upgrade {
                who: Upgraded::Proxy,
                settle: self.ms(500, 2000),
            }),
            (2, n) if n > 0 => Some(Fault::Upgrade {
                who: Upgraded::TierProxy(0),
                settle: self.ms(500, 2000),
            }),
            (3, n) if n > 1 && self.layout.tier_deaths => Some(Fault::KillTierProxy {
                p: 1,
                down: self.ms(2000, 5000),
            }),
            (3, n) if n > 1 => Some(Fault::Upgrade {
                who: Upgraded::TierProxy(1),
                settle: self.ms(500, 2000),
            }),
            _ => None,
        };
        if let Some(f) = first {
            return (vec![f], self.ms(0, 2000));
        }
        let mut faults = vec![self.fault()];
        // Now and then a second fault at once, on hosts the first does not touch.
        if self.between(0, 3) == 0 {
            for _ in 0..10 {
                let f = self.fault();
                let pe_host = |k: usize| self.layout.pe_hosts[k];
                let taken = faults[0].hosts(pe_host);
                if f.hosts(pe_host).iter().all(|h| !taken.contains(h)) {
                    faults.push(f);
                    break;
                }
            }
        }
        let pause = self.ms(0, 2000);
        (faults, pause)
    }

    fn fault(&mut self) -> Fault {
        let tier = self.layout.tier_proxies as u64;
        if self.layout.only_tier && tier > 0 {
            let p = self.between(0, tier - 1) as usize;
            return match self.between(0, 3) {
                0 => Fault::Upgrade {
                    who: Upgraded::TierProxy(p),
                    settle: self.ms(500, 2000),
                },
                _ if self.layout.tier_deaths => Fault::KillTierProxy {
                    p,
                    down: self.ms(1000, 8000),
                },
                _ => Fault::Upgrade {
                    who: Upgraded::TierProxy(p),
                    settle: self.ms(500, 2000),
                },
            };
        }
        let pes = self.layout.pe_hosts.len();
        match self.between(0, 99) {
            0..25 => Fault::KillRegistrar {
                r: self.between(0, 2) as usize,
                down: self.ms(500, 6000),
            },
            25..48 => {
                let n = self.between(1, 3) as usize;
                let mut v: Vec<usize> = Vec::new();
                while v.len() < n.min(pes) {
                    let k = self.between(0, pes as u64 - 1) as usize;
                    if !v.contains(&k) {
                        v.push(k);
                    }
                }
                v.sort_unstable();
                Fault::KillPes {
                    pes: v,
                    down: self.ms(200, 5000),
                }
            }
            48..55 => {
                let tier = self.layout.tier_proxies as u64;
                let who = match self.between(0, 2 + tier.min(1)) {
                    0 => Upgraded::Proxy,
                    1 | 2 => Upgraded::Registrar(self.between(0, 2) as usize),
                    _ => Upgraded::TierProxy(self.between(0, tier - 1) as usize),
                };
                Fault::Upgrade {
                    who,
                    settle: self.ms(500, 2000),
                }
            }
            55..80 => {
                let host = self.between(0, self.layout.hosts as u64 - 1) as usize;
                let max = if host < 3 {
                    self.layout.registrar_cut_max.as_millis() as u64
                } else {
                    8000
                };
                Fault::CutLink {
                    host,
                    down: self.ms(500, max.clamp(500, 8000)),
                }
            }
            95.. if self.layout.tier_proxies > 0 && self.layout.tier_deaths => {
                Fault::KillTierProxy {
                    p: self.between(0, self.layout.tier_proxies as u64 - 1) as usize,
                    down: self.ms(1000, 8000),
                }
            }
            _ => Fault::Loss {
                host: self.between(0, self.layout.hosts as u64 - 1) as usize,
                percent: self.between(5, 40) as u32,
                hold: self.ms(1000, 10_000),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            pe_hosts: (0..50).map(|k| 3 + k % 5).collect(),
            hosts: 8,
            registrar_cut_max: Duration::from_millis(8000),
            tier_proxies: 2,
            tier_deaths: true,
            only_tier: false,
        }
    }

    #[test]
    fn a_seed_gives_the_same_plan_and_every_kind_comes_up() {
        let plan = |seed| {
            let mut p = Planner::new(seed, layout());
            (0..400).map(|_| p.episode()).collect::<Vec<_>>()
        };
        assert_eq!(plan(7), plan(7));
        assert_ne!(plan(7), plan(8));
        let mut kinds = [0; KINDS.len()];
        for (faults, _) in plan(7) {
            for f in &faults {
                kinds[f.kind()] += 1;
            }
        }
        assert!(kinds.iter().all(|&n| n > 10), "{kinds:?}");
    }

    #[test]
    fn faults_of_one_episode_touch_different_hosts_and_stay_in_range() {
        let mut p = Planner::new(1, layout());
        let mut doubles = 0;
        for _ in 0..500 {
            let (faults, pause) = p.episode();
            assert!(pause <= Duration::from_secs(2));
            for f in &faults {
                assert!(f.duration() >= Duration::from_millis(200));
                assert!(f.duration() <= Duration::from_secs(10));
                match f {
                    Fault::KillRegistrar { r, .. } => assert!(*r < 3),
                    Fault::KillPes { pes, .. } => {
                        assert!(!pes.is_empty() && pes.iter().all(|&k| k < 50))
                    }
                    Fault::CutLink { host, .. } => assert!(*host < 8),
                    Fault::Loss { host, percent, .. } => {
                        assert!(*host < 8 && (5..=40).contains(percent))
                    }
                    Fault::Upgrade { who, .. } => assert!(!matches!(
                        who,
                        Upgraded::Registrar(3..) | Upgraded::TierProxy(2..)
                    )),
                    Fault::KillTierProxy { p, .. } => assert!(*p < 2),
                }
            }
            if let [a, b] = &faults[..] {
                doubles += 1;
                let pe_host = |k: usize| 3 + k % 5;
                let ha = a.hosts(pe_host);
                assert!(b.hosts(pe_host).iter().all(|h| !ha.contains(h)));
            }
            assert!(faults.len() <= 2);
        }
        assert!(doubles > 50, "{doubles}");
    }
}
