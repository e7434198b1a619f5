//! Each RFC 5356 policy's selection order and distribution through the handlespace, plus the
//! registration rules, the ownership checksum, the sync traversal and the timer schedule.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use proptest::prelude::*;
use rserpool_handlespace::{Config, Handlespace, PeRef, RegistrationError, TimerKind};
use rserpool_wire::checksum::{PeChecksum, pe_block_sum};
use rserpool_wire::policy::load_from_fraction;
use rserpool_wire::{Policy, PoolElement, PoolHandle, Protocol, TransportAddress, UserTransport};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};

const OWN: u32 = 0xAAAA_0001;

fn tcp(port: u16) -> UserTransport {
    UserTransport::Address(TransportAddress {
        protocol: Protocol::TCP,
        port,
        addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
    })
}

fn pe(id: u32, policy: Policy) -> PoolElement {
    PoolElement {
        id,
        home_registrar: OWN,
        registration_life: -1,
        user_transport: tcp(id as u16),
        policy,
        asap_transport: None,
    }
}

fn hs() -> Handlespace {
    Handlespace::new(Config::default())
}

fn ph() -> PoolHandle {
    PoolHandle::from("pool")
}

fn setup(policies: &[Policy]) -> Handlespace {
    let mut h = hs();
    for (i, p) in policies.iter().enumerate() {
        h.register(&ph(), pe(i as u32 + 1, p.clone()), 0).unwrap();
    }
    h
}

fn ids(h: &Handlespace, v: &[PeRef]) -> Vec<u32> {
    v.iter().map(|&r| h.pe(r).element.id).collect()
}

fn resolve(h: &mut Handlespace, items: usize) -> Vec<u32> {
    let mut out = Vec::new();
    assert!(h.resolve(b"pool", items, &mut out));
    ids(h, &out)
}

/// Counts which PE comes first over `n` single-item resolutions.
fn first_counts(h: &mut Handlespace, n: usize) -> HashMap<u32, usize> {
    let mut c = HashMap::new();
    for _ in 0..n {
        *c.entry(resolve(h, 1)[0]).or_default() += 1;
    }
    c
}

#[test]
fn round_robin_order_and_max_increment() {
    let mut h = setup(&[Policy::RoundRobin, Policy::RoundRobin, Policy::RoundRobin]);
    let seq: Vec<u32> = (0..6).map(|_| resolve(&mut h, 1)[0]).collect();
    assert_eq!(seq, [1, 2, 3, 1, 2, 3]);
    // Three items, but the head advances by one (MaxIncrement default 1).
    assert_eq!(resolve(&mut h, 3), [1, 2, 3]);
    assert_eq!(resolve(&mut h, 3), [2, 3, 1]);
    // A new PE joins at the end of the round (before the head, which is now 3).
    h.register(&ph(), pe(4, Policy::RoundRobin), 0).unwrap();
    assert_eq!(resolve(&mut h, 4), [3, 1, 2, 4]);
    // Re-registration keeps the position; deregistration of the head moves it on.
    h.register(&ph(), pe(1, Policy::RoundRobin), 1).unwrap();
    assert_eq!(resolve(&mut h, 4), [1, 2, 4, 3]);
    h.deregister(b"pool", 2);
    assert_eq!(resolve(&mut h, 4), [4, 3, 1]);

    let mut h = Handlespace::new(Config {
        max_increment: 3,
        ..Config::default()
    });
    for i in 1..=4 {
        h.register(&ph(), pe(i, Policy::RoundRobin), 0).unwrap();
    }
    assert_eq!(resolve(&mut h, 3), [1, 2, 3]);
    assert_eq!(resolve(&mut h, 3), [4, 1, 2]);
}

#[test]
fn weighted_round_robin_shares_and_spread() {
    let mut h = setup(&[
        Policy::WeightedRoundRobin { weight: 3 },
        Policy::WeightedRoundRobin { weight: 1 },
        Policy::WeightedRoundRobin { weight: 0 },
    ]);
    let seq: Vec<u32> = (0..400).map(|_| resolve(&mut h, 1)[0]).collect();
    let c1 = seq.iter().filter(|&&x| x == 1).count();
    assert_eq!(c1, 300, "weight 3 of 4");
    assert!(!seq.contains(&3), "weight 0 never serves");
    // Spread evenly: PE 2 appears exactly once in every window of four.
    for w in seq.chunks(4) {
        assert_eq!(w.iter().filter(|&&x| x == 2).count(), 1, "{w:?}");
    }
    // Weight-0 PE is not returned even when more items are asked for than can serve.
    assert_eq!(resolve(&mut h, 3).len(), 2);
}

#[test]
fn random_is_uniform_distinct_and_reproducible() {
    let policies = vec![Policy::Random; 4];
    let mut h = setup(&policies);
    let c = first_counts(&mut h, 40_000);
    for id in 1..=4 {
        let share = c[&id] as f64 / 40_000.0;
        assert!((share - 0.25).abs() < 0.015, "PE {id}: {share}");
    }
    for _ in 0..200 {
        let v = resolve(&mut h, 3);
        assert_eq!(v.iter().collect::<HashSet<_>>().len(), 3, "{v:?}");
    }
    let mut all = resolve(&mut h, 10);
    all.sort();
    assert_eq!(all, [1, 2, 3, 4]);
    // Same seed, same operations: same selections.
    let a: Vec<Vec<u32>> = {
        let mut h = setup(&policies);
        (0..50).map(|_| resolve(&mut h, 2)).collect()
    };
    let b: Vec<Vec<u32>> = {
        let mut h = setup(&policies);
        (0..50).map(|_| resolve(&mut h, 2)).collect()
    };
    assert_eq!(a, b);
}

#[test]
fn weighted_random_follows_weights() {
    let mut h = setup(&[
        Policy::WeightedRandom { weight: 1 },
        Policy::WeightedRandom { weight: 2 },
        Policy::WeightedRandom { weight: 7 },
        Policy::WeightedRandom { weight: 0 },
    ]);
    let n = 50_000;
    let c = first_counts(&mut h, n);
    for (id, want) in [(1, 0.1), (2, 0.2), (3, 0.7)] {
        let share = c[&id] as f64 / n as f64;
        assert!((share - want).abs() < 0.015, "PE {id}: {share} vs {want}");
    }
    assert!(!c.contains_key(&4));
    // Without replacement: three distinct, and never the weight-0 PE.
    for _ in 0..100 {
        let mut v = resolve(&mut h, 4);
        v.sort();
        assert_eq!(v, [1, 2, 3]);
    }
}

#[test]
fn priority_highest_first_round_robin_on_ties() {
    let mut h = setup(&[
        Policy::Priority { priority: 1 },
        Policy::Priority { priority: 5 },
        Policy::Priority { priority: 5 },
        Policy::Priority { priority: 3 },
    ]);
    let v = resolve(&mut h, 4);
    assert_eq!(&v[2..], [4, 1]);
    assert!(v[..2].contains(&2) && v[..2].contains(&3));
    let seq: Vec<u32> = (0..6).map(|_| resolve(&mut h, 1)[0]).collect();
    assert!(seq.iter().all(|&x| x == 2 || x == 3));
    assert!(
        seq.windows(2).all(|w| w[0] != w[1]),
        "ties alternate: {seq:?}"
    );
}

#[test]
fn least_used_sorted_round_robin_on_equal_loads() {
    let lu = |f: f64| Policy::LeastUsed {
        load: load_from_fraction(f),
    };
    let mut h = setup(&[lu(0.3), lu(0.1), lu(0.2), lu(0.1)]);
    let v = resolve(&mut h, 4);
    assert_eq!(&v[2..], [3, 1]);
    let seq: Vec<u32> = (0..4).map(|_| resolve(&mut h, 1)[0]).collect();
    assert!(seq.iter().all(|&x| x == 2 || x == 4));
    assert!(seq.windows(2).all(|w| w[0] != w[1]), "{seq:?}");
    // A load report moves the PE.
    let r = h.find(b"pool", 1).unwrap();
    h.update_policy(r, lu(0.0), 5).unwrap();
    assert_eq!(resolve(&mut h, 1), [1]);
    // A PE reporting high load receives nothing while others are lighter.
    h.update_policy(r, lu(0.99), 6).unwrap();
    let c = first_counts(&mut h, 100);
    assert!(!c.contains_key(&1));
}

#[test]
fn least_used_with_degradation() {
    let lud = |l: f64| Policy::LeastUsedDegradation {
        load: load_from_fraction(l),
        degradation: load_from_fraction(0.15),
    };
    let mut h = setup(&[lud(0.0), lud(0.1)]);
    // A: 0 → 0.15 after selection; B: 0.1 → 0.25; A: 0.15 → 0.30; B: 0.25 → 0.40; A ...
    let seq: Vec<u32> = (0..5).map(|_| resolve(&mut h, 1)[0]).collect();
    assert_eq!(seq, [1, 2, 1, 2, 1]);
    // Re-registration resets A's degradation (RFC 5356): it is least used again.
    for _ in 0..5 {
        resolve(&mut h, 1);
    }
    h.register(&ph(), pe(1, lud(0.0)), 9).unwrap();
    assert_eq!(resolve(&mut h, 1), [1]);
    // Only the first returned PE (MaxIncrement 1) degrades.
    let mut h = setup(&[lud(0.0), lud(0.1)]);
    assert_eq!(resolve(&mut h, 2), [1, 2]);
    assert_eq!(resolve(&mut h, 2), [2, 1]);
}

#[test]
fn priority_least_used_adds_degradation() {
    let plu = |l: f64, d: f64| Policy::PriorityLeastUsed {
        load: load_from_fraction(l),
        degradation: load_from_fraction(d),
    };
    let mut h = setup(&[plu(0.1, 0.5), plu(0.3, 0.1), plu(0.2, 0.1)]);
    assert_eq!(resolve(&mut h, 3), [3, 2, 1]);
}

#[test]
fn randomized_least_used_prefers_free_capacity() {
    let rlu = |f: f64| Policy::RandomizedLeastUsed {
        load: load_from_fraction(f),
    };
    let mut h = setup(&[rlu(0.0), rlu(0.5), rlu(1.0)]);
    let n = 60_000;
    let c = first_counts(&mut h, n);
    let s1 = c[&1] as f64 / n as f64;
    let s2 = c[&2] as f64 / n as f64;
    assert!((s1 - 2.0 / 3.0).abs() < 0.015, "{s1}");
    assert!((s2 - 1.0 / 3.0).abs() < 0.015, "{s2}");
    assert!(
        c.get(&3).copied().unwrap_or(0) < 5,
        "a full PE is (almost) never chosen"
    );
    // ... but a pool of full PEs still answers.
    let mut h = setup(&[rlu(1.0), rlu(1.0)]);
    assert_eq!(resolve(&mut h, 2).len(), 2);
}

#[test]
fn registration_rules() {
    let mut h = setup(&[Policy::LeastUsed { load: 0 }]);
    let e = h.register(&ph(), pe(2, Policy::RoundRobin), 0).unwrap_err();
    assert!(matches!(
        e,
        RegistrationError::InconsistentPolicy(Policy::LeastUsed { .. })
    ));
    assert_eq!(
        e.cause().code,
        rserpool_wire::CauseCode::INCONSISTENT_POOLING_POLICY
    );
    let mut udp = pe(2, Policy::LeastUsed { load: 0 });
    udp.user_transport = UserTransport::Address(TransportAddress {
        protocol: Protocol::Udp { reserved: 0 },
        port: 1,
        addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
    });
    let e = h.register(&ph(), udp, 0).unwrap_err();
    assert_eq!(
        e.cause().code,
        rserpool_wire::CauseCode::INCONSISTENT_TRANSPORT_TYPE
    );
    // SCTP pools also fix the data/control configuration.
    let sctp = |id, u| {
        let mut p = pe(id, Policy::RoundRobin);
        p.user_transport = UserTransport::Address(TransportAddress {
            protocol: Protocol::Sctp { transport_use: u },
            port: 1,
            addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
        });
        p
    };
    let sp = PoolHandle::from("sctp");
    h.register(&sp, sctp(1, 1), 0).unwrap();
    assert_eq!(
        h.register(&sp, sctp(2, 0), 0).unwrap_err(),
        RegistrationError::InconsistentDataControl
    );
    // Unsupported (private) policy types are refused with Invalid Values.
    let e = h
        .register(
            &PoolHandle::from("x"),
            pe(
                1,
                Policy::LeastUsedDpf {
                    load: 0,
                    load_dpf: 0,
                    distance: 0,
                },
            ),
            0,
        )
        .unwrap_err();
    assert_eq!(e.cause().code, rserpool_wire::CauseCode::INVALID_VALUES);
    assert_eq!(
        h.register(&PoolHandle::from(""), pe(1, Policy::RoundRobin), 0)
            .unwrap_err(),
        RegistrationError::InvalidPoolHandle
    );
    // Limits.
    let mut h = Handlespace::new(Config {
        max_pools: 1,
        max_pes_per_pool: 2,
        ..Config::default()
    });
    h.register(&ph(), pe(1, Policy::RoundRobin), 0).unwrap();
    h.register(&ph(), pe(2, Policy::RoundRobin), 0).unwrap();
    assert!(matches!(
        h.register(&ph(), pe(3, Policy::RoundRobin), 0),
        Err(RegistrationError::LackOfResources(_))
    ));
    // A re-registration at the limit is still an update.
    assert!(!h.register(&ph(), pe(2, Policy::RoundRobin), 0).unwrap().new);
    assert!(matches!(
        h.register(&PoolHandle::from("other"), pe(1, Policy::RoundRobin), 0),
        Err(RegistrationError::LackOfResources(_))
    ));
    // The last deregistration removes the pool.
    h.deregister(b"pool", 1).unwrap();
    assert!(h.deregister(b"pool", 1).is_none());
    h.deregister(b"pool", 2).unwrap();
    assert_eq!(h.pool_count(), 0);
    assert!(!h.resolve(b"pool", 1, &mut Vec::new()));
}

#[test]
fn timers_one_per_pe() {
    let mut h = setup(&[Policy::RoundRobin, Policy::RoundRobin]);
    let a = h.find(b"pool", 1).unwrap();
    let b = h.find(b"pool", 2).unwrap();
    h.schedule_timer(a, TimerKind::KeepAliveTransmission, 5_000);
    h.schedule_timer(b, TimerKind::LifetimeExpiry, 7_000);
    // Replacing a timer: the PE still has exactly one.
    h.schedule_timer(a, TimerKind::KeepAliveTimeout, 6_000);
    assert_eq!(h.timer(a), Some((TimerKind::KeepAliveTimeout, 6_000)));
    assert!(h.next_timer().unwrap() <= 6_000);
    let mut fired = Vec::new();
    h.expire_timers(5_999, &mut fired);
    assert!(fired.is_empty());
    h.expire_timers(6_500, &mut fired);
    assert_eq!(fired, vec![(a, TimerKind::KeepAliveTimeout)]);
    // Removing a PE cancels its timer.
    h.remove(b);
    fired.clear();
    h.expire_timers(100_000, &mut fired);
    assert!(fired.is_empty());
    assert_eq!(h.next_timer(), None);
}

fn checksum_model(h: &Handlespace, owner: u32) -> u16 {
    let mut c = PeChecksum::new();
    for (handle, _, _) in h.pools() {
        for r in h.members(handle.as_bytes()) {
            let e = h.pe(r);
            if e.element.home_registrar == owner {
                c.add(pe_block_sum(handle.as_bytes(), e.element.id));
            }
        }
    }
    c.value()
}

proptest! {
    /// Under random registrations, re-homings and deregistrations across pools, each owner's
    /// incremental checksum equals one computed from scratch.
    #[test]
    fn ownership_checksums_stay_exact(ops in prop::collection::vec((0u8..3, 0u32..30, 0u32..3, 0u8..3), 1..200)) {
        let mut h = hs();
        let owners = [OWN, 2, 3];
        for (op, id, owner, pool) in ops {
            let handle = PoolHandle::from(["a", "bb", "ccc"][pool as usize]);
            match op {
                0 => { let mut p = pe(id, Policy::RoundRobin); p.home_registrar = owners[owner as usize]; h.register(&handle, p, 0).unwrap(); }
                1 => { if let Some(r) = h.find(handle.as_bytes(), id) { h.set_home(r, owners[owner as usize]); } }
                _ => { h.deregister(handle.as_bytes(), id); }
            }
            for o in owners { prop_assert_eq!(h.checksum(o), checksum_model(&h, o)); }
        }
    }

    /// A traversal in blocks interleaved with changes returns every PE present throughout
    /// exactly once, and nothing that was removed before the traversal started.
    #[test]
    fn sync_traversal_is_exact_under_changes(
        initial in 1u32..300,
        block in 1usize..40,
        changes in prop::collection::vec((0u8..2, 0u32..400), 0..100),
        scope_all in any::<bool>(),
    ) {
        let mut h = hs();
        for id in 0..initial {
            let mut p = pe(id, Policy::RoundRobin);
            p.home_registrar = if id % 3 == 0 { 7 } else { OWN };
            h.register(&ph(), p, 0).unwrap();
        }
        let in_scope = |h: &Handlespace, id: u32| scope_all || h.find(b"pool", id).is_some_and(|r| h.pe(r).element.home_registrar == OWN);
        let before: HashSet<u32> = (0..initial).filter(|&id| in_scope(&h, id)).collect();
        let mut removed = HashSet::new();
        let cursor = h.sync_begin(if scope_all { None } else { Some(OWN) });
        let mut seen: Vec<u32> = Vec::new();
        let mut changes = changes.into_iter();
        loop {
            let mut out = Vec::new();
            let more = h.sync_next(cursor, block, &mut out);
            prop_assert!(out.len() <= block);
            seen.extend(ids(&h, &out));
            if !more { break; }
            for (op, id) in changes.by_ref().take(3) {
                if op == 0 { if h.deregister(b"pool", id).is_some() { removed.insert(id); } }
                else { let mut p = pe(id + 1000, Policy::RoundRobin); p.home_registrar = OWN; h.register(&ph(), p, 0).unwrap(); }
            }
        }
        let seen_set: HashSet<u32> = seen.iter().copied().collect();
        prop_assert_eq!(seen_set.len(), seen.len(), "duplicates");
        for id in &before {
            if !removed.contains(id) { prop_assert!(seen_set.contains(id), "missed {}", id); }
        }
        for id in &seen_set { prop_assert!(*id >= 1000 || before.contains(id)); }
    }
}

#[test]
fn credits_most_first_and_a_pool_version_that_follows_what_users_see() {
    let c = |credits| Policy::Credits {
        credits,
        capacity: 8,
    };
    let mut h = setup(&[c(2), c(8), c(0), c(5)]);
    assert_eq!(resolve(&mut h, 4), [2, 4, 1, 3]);
    let v0 = h.pool_version(b"pool").unwrap();
    // Resolving, and re-registering unchanged, leave the version alone.
    resolve(&mut h, 2);
    h.register(&ph(), pe(1, c(2)), 1).unwrap();
    assert_eq!(h.pool_version(b"pool"), Some(v0));
    // New credits move it, and the order.
    h.register(&ph(), pe(3, c(7)), 2).unwrap();
    let v1 = h.pool_version(b"pool").unwrap();
    assert_ne!(v1, v0);
    assert_eq!(resolve(&mut h, 2), [2, 3]);
    // A PE leaving moves it; the pool gone has none, and created anew a fresh one.
    let r = h.find(b"pool", 3).unwrap();
    h.remove(r);
    let v2 = h.pool_version(b"pool").unwrap();
    assert_ne!(v2, v1);
    for id in [1, 2, 4] {
        let r = h.find(b"pool", id).unwrap();
        h.remove(r);
    }
    assert_eq!(h.pool_version(b"pool"), None);
    h.register(&ph(), pe(9, c(1)), 3).unwrap();
    let v3 = h.pool_version(b"pool").unwrap();
    assert!(![v0, v1, v2].contains(&v3));
}
