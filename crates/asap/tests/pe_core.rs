//! The pool element's sans-IO core driven by hand: bytes, connection events and the time in,
//! actions out. No sockets and no clock, so each step of the protocol is checked exactly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand_core::SeedableRng;
use rserpool_asap::{Action, ConnId, Instant, PeCore, PeEvent, PeState, PoolElementConfig};
use rserpool_wire::{AsapMessage, Message, Policy, PoolHandle};
use std::net::SocketAddr;
use std::time::Duration;

const POOL: &str = "CorePool";

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, last], port))
}

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn pe(registrars: Vec<SocketAddr>, seed: u64) -> PeCore {
    let mut cfg = PoolElementConfig::new(POOL, addr(9, 80), Policy::LeastUsed { load: 0 });
    cfg.registrars = registrars;
    cfg.reregistration_interval = Duration::from_secs(10);
    let rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    PeCore::new(cfg, Some(addr(9, 7000)), Box::new(rng), at(0))
}

fn actions(pe: &mut PeCore) -> Vec<Action<PeEvent>> {
    std::iter::from_fn(|| pe.poll_action()).collect()
}

/// The messages transmitted on `conn`.
fn sent(actions: &[Action<PeEvent>], conn: ConnId) -> Vec<AsapMessage> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Transmit(c, b) if *c == conn => Some(AsapMessage::decode(b).unwrap()),
            _ => None,
        })
        .collect()
}

fn connect(actions: &[Action<PeEvent>]) -> (ConnId, SocketAddr) {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Connect(c, to) => Some((*c, *to)),
            _ => None,
        })
        .expect("a connect")
}

fn bytes(m: &AsapMessage) -> Vec<u8> {
    m.to_bytes().unwrap()
}

fn accepted(id: u32) -> Vec<u8> {
    bytes(&AsapMessage::RegistrationResponse {
        reject: false,
        pool_handle: PoolHandle::from(POOL),
        pe_id: id,
        error: None,
    })
}

fn keep_alive(server_id: u32, home: bool, id: u32) -> Vec<u8> {
    bytes(&AsapMessage::EndpointKeepAlive {
        home,
        server_id,
        pool_handle: PoolHandle::from(POOL),
        pe_id: Some(id),
    })
}

fn is_registration(m: &AsapMessage) -> bool {
    matches!(m, AsapMessage::Registration { .. })
}

fn is_ack(m: &AsapMessage) -> bool {
    matches!(m, AsapMessage::EndpointKeepAliveAck { .. })
}

/// A PE registered at `reg` (the only registrar it knows); returns it and the association.
fn registered(reg: SocketAddr) -> (PeCore, ConnId) {
    let mut pe = pe(vec![reg], 1);
    let (c, to) = connect(&actions(&mut pe));
    assert_eq!(to, reg);
    pe.handle_connected(c, at(10));
    assert!(is_registration(&sent(&actions(&mut pe), c)[0]));
    pe.handle_data(c, &accepted(pe.id()), at(20));
    pe.handle_data(c, &keep_alive(0x1001, false, pe.id()), at(30));
    let a = actions(&mut pe);
    assert!(is_ack(&sent(&a, c)[0]));
    let home = PeState::Registered {
        registrar: reg,
        home: 0x1001,
    };
    assert!(a.contains(&Action::Event(PeEvent::State(home))), "{a:?}");
    (pe, c)
}

/// The PE took registrar `home` at `at` as its home (`a`: the actions that followed).
fn adopted(pe: &PeCore, a: &[Action<PeEvent>], at: SocketAddr, home: u32) {
    let event = Action::Event(PeEvent::TakenOver {
        registrar: at,
        home,
    });
    assert!(a.contains(&event), "{a:?}");
    assert_eq!(
        pe.state(),
        &PeState::Registered {
            registrar: at,
            home
        }
    );
}

#[test]
fn registers_reregisters_on_time_and_on_news_and_deregisters_on_stop() {
    let (mut pe, c) = registered(addr(1, 3863));
    // At the reregistration interval.
    let t = pe.poll_timeout().unwrap();
    assert_eq!(t, at(10_010));
    pe.handle_timeout(t);
    assert!(is_registration(&sent(&actions(&mut pe), c)[0]));
    pe.handle_data(c, &accepted(pe.id()), t);
    // A new load goes out at once.
    pe.update_policy(Policy::LeastUsed { load: 7 }, at(10_100));
    match &sent(&actions(&mut pe), c)[0] {
        AsapMessage::Registration { pool_element, .. } => {
            assert_eq!(pool_element.policy, Policy::LeastUsed { load: 7 });
        }
        other => panic!("{other:?}"),
    }
    pe.handle_data(c, &accepted(pe.id()), at(10_110));
    pe.stop(at(10_200));
    let a = actions(&mut pe);
    assert!(matches!(sent(&a, c)[0], AsapMessage::Deregistration { .. }));
    let answer = AsapMessage::DeregistrationResponse {
        pool_handle: PoolHandle::from(POOL),
        pe_id: pe.id(),
        error: None,
    };
    pe.handle_data(c, &bytes(&answer), at(10_210));
    let a = actions(&mut pe);
    assert!(a.contains(&Action::Close(c)));
    assert!(a.contains(&Action::Event(PeEvent::State(PeState::Stopped))));
    assert!(pe.is_stopped());
}

/// A PE that knows one registrar (docs/RELIABILITY.md), which dies, is taken over by another and serves it
/// as its home, without registering anywhere.
#[test]
fn a_pe_knowing_one_registrar_adopts_a_takeover() {
    let reg = addr(1, 3863);
    let (mut pe, c) = registered(reg);
    pe.handle_close(c, at(1_000));
    let a = actions(&mut pe);
    assert!(a.contains(&Action::Event(PeEvent::LostHome { registrar: reg })));
    // Backing off; the next attempt goes to the dead registrar again.
    let t = pe.poll_timeout().unwrap();
    pe.handle_timeout(t);
    let (c2, to) = connect(&actions(&mut pe));
    assert_eq!(to, reg);
    pe.handle_connect_error(c2, "refused", t);
    // Another registrar takes over.
    let new_home = addr(2, 40_000);
    let t = pe.accept(new_home, t);
    pe.handle_data(t, &keep_alive(0x2002, true, pe.id()), at(1_500));
    let a = actions(&mut pe);
    let out = sent(&a, t);
    assert_eq!(out.len(), 1, "only the answer: {out:?}");
    assert!(is_ack(&out[0]));
    adopted(&pe, &a, new_home, 0x2002);
    // Its keep-alives are answered, its re-registrations go there.
    pe.handle_data(t, &keep_alive(0x2002, false, pe.id()), at(3_000));
    assert!(is_ack(&sent(&actions(&mut pe), t)[0]));
    pe.handle_timeout(at(11_500));
    let a = actions(&mut pe);
    assert!(is_registration(&sent(&a, t)[0]));
    assert!(!a.iter().any(|a| matches!(a, Action::Connect(..))));
}

/// Anyone who reaches the takeover address may claim to be a registrar (RFC 5355 §3.1): while
/// the home answers, the PE stays with it.
#[test]
fn a_takeover_claimed_while_the_home_answers_is_refused() {
    let reg = addr(1, 3863);
    let (mut pe, c) = registered(reg);
    let forged = pe.accept(addr(9, 4444), at(100));
    pe.handle_data(forged, &keep_alive(0xdead_beef, true, pe.id()), at(110));
    let a = actions(&mut pe);
    // The claimant's keep-alive is answered; the home is asked with a registration.
    assert!(is_ack(&sent(&a, forged)[0]), "{a:?}");
    assert!(is_registration(&sent(&a, c)[0]), "{a:?}");
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::Event(PeEvent::TakenOver { .. })))
    );
    assert!(!a.contains(&Action::Close(c)));
    // The home answers: the claim is refused, the PE stays.
    pe.handle_data(c, &accepted(pe.id()), at(120));
    let a = actions(&mut pe);
    assert!(a.contains(&Action::Close(forged)), "{a:?}");
    assert!(!a.contains(&Action::Close(c)));
    assert_eq!(
        pe.state(),
        &PeState::Registered {
            registrar: reg,
            home: 0x1001
        }
    );
}

/// A claim arrives while `pe` is registered over `c`: whether the PE asked its home first
/// (a registration over `c`, and no takeover) rather than adopting the claimant at once.
fn asks_home_first(pe: &mut PeCore, c: ConnId, t: u64) -> bool {
    let forged = pe.accept(addr(9, 4444), at(t));
    pe.handle_data(forged, &keep_alive(0xdead_beef, true, pe.id()), at(t));
    let a = actions(pe);
    let asked = sent(&a, c).iter().any(is_registration)
        && !a
            .iter()
            .any(|x| matches!(x, Action::Event(PeEvent::TakenOver { .. })));
    if asked {
        pe.handle_data(c, &accepted(pe.id()), at(t + 10));
        assert!(actions(pe).contains(&Action::Close(forged)));
    }
    asked
}

/// A PE that lost its home and registered again is not open to forged takeovers from then
/// on: back with the same registrar at once, with another one once a takeover of the old
/// home can no longer race its registration (`TAKEOVER_RACE`). Before, one lost association
/// (a PE stopped for a while) left it obeying any claim for the rest of its life.
#[test]
fn a_pe_that_registered_again_after_losing_its_home_asks_its_home_about_a_claim() {
    let reg = addr(1, 3863);
    // Back with the registrar it lost.
    let (mut pe, c) = registered(reg);
    pe.handle_close(c, at(1_000));
    actions(&mut pe);
    let t = pe.poll_timeout().unwrap();
    pe.handle_timeout(t);
    let (c2, to) = connect(&actions(&mut pe));
    assert_eq!(to, reg);
    pe.handle_connected(c2, t);
    actions(&mut pe);
    pe.handle_data(c2, &accepted(pe.id()), t);
    actions(&mut pe);
    let t = t.as_millis() + 100;
    assert!(
        asks_home_first(&mut pe, c2, t),
        "a claim was obeyed unasked"
    );

    // Registered with another registrar: a takeover of the old home may race it for a while.
    let (other, spare) = (addr(2, 3863), addr(1, 3863));
    let mut pe = self::pe(vec![spare, other], 3);
    let (c, to) = connect(&actions(&mut pe));
    assert_eq!(to, spare);
    pe.handle_connected(c, at(10));
    pe.handle_data(c, &accepted(pe.id()), at(20));
    actions(&mut pe);
    pe.handle_close(c, at(1_000));
    let mut now = 1_000;
    let c2 = loop {
        now = pe.poll_timeout().unwrap().as_millis().max(now);
        pe.handle_timeout(at(now));
        if let Some((c2, to)) = actions(&mut pe).iter().find_map(|a| match a {
            Action::Connect(c, to) => Some((*c, *to)),
            _ => None,
        }) {
            if to == other {
                break c2;
            }
            pe.handle_connect_error(c2, "refused", at(now));
        }
        assert!(now < 60_000, "never tried the other registrar");
    };
    pe.handle_connected(c2, at(now));
    actions(&mut pe);
    pe.handle_data(c2, &accepted(pe.id()), at(now));
    actions(&mut pe);
    let race = rserpool_asap::core::pe::TAKEOVER_RACE.as_millis() as u64;
    let mut late = now + race + 1;
    // Keep-alives and re-registrations meanwhile.
    while now < late {
        now = pe.poll_timeout().unwrap().as_millis().max(now + 1);
        if now >= late {
            break;
        }
        pe.handle_timeout(at(now));
        for m in sent(&actions(&mut pe), c2) {
            if is_registration(&m) {
                pe.handle_data(c2, &accepted(pe.id()), at(now));
            }
        }
        actions(&mut pe);
    }
    late = late.max(now);
    assert!(
        asks_home_first(&mut pe, c2, late),
        "a claim was obeyed unasked"
    );
}

/// A takeover that arrives before the PE noticed its home is gone (a hung registrar): the
/// home does not answer the check, so the takeover is adopted after the response timeout.
#[test]
fn a_takeover_claimed_while_the_home_hangs_is_adopted_when_it_does_not_answer() {
    let reg = addr(1, 3863);
    let (mut pe, c) = registered(reg);
    let new_home = addr(2, 40_000);
    let t = pe.accept(new_home, at(100));
    pe.handle_data(t, &keep_alive(0x2002, true, pe.id()), at(110));
    let a = actions(&mut pe);
    assert!(is_registration(&sent(&a, c)[0]));
    // Its keep-alives are answered meanwhile.
    pe.handle_data(t, &keep_alive(0x2002, false, pe.id()), at(500));
    assert!(is_ack(&sent(&actions(&mut pe), t)[0]));
    let deadline = pe.poll_timeout().unwrap();
    pe.handle_timeout(deadline);
    let a = actions(&mut pe);
    assert!(a.contains(&Action::Close(c)), "{a:?}");
    adopted(&pe, &a, new_home, 0x2002);
}

#[test]
fn a_connection_that_is_not_a_takeover_is_closed() {
    let (mut pe, _) = registered(addr(1, 3863));
    let t = pe.accept(addr(3, 1234), at(100));
    pe.handle_data(t, &keep_alive(0x3003, false, pe.id()), at(110));
    assert_eq!(actions(&mut pe), vec![Action::Close(t)]);
    // Silent ones too, after a while.
    let s = pe.accept(addr(3, 1235), at(200));
    pe.handle_timeout(at(5_200));
    assert!(actions(&mut pe).contains(&Action::Close(s)));
}

/// The seed decides the PE identifier and the back-off: a replay gives the same run.
#[test]
fn backoff_doubles_with_jitter_and_replays_from_its_seed() {
    let run = |seed| {
        let mut pe = pe(vec![addr(1, 3863)], seed);
        let mut now = at(0);
        let mut waits = Vec::new();
        for _ in 0..8 {
            let (c, _) = connect(&actions(&mut pe));
            pe.handle_connect_error(c, "refused", now);
            let next = pe.poll_timeout().unwrap();
            waits.push(next.saturating_duration_since(now));
            now = next;
            pe.handle_timeout(now);
        }
        (pe.id(), waits)
    };
    let (id, waits) = run(5);
    assert_eq!(run(5), (id, waits.clone()));
    assert_ne!(run(6).0, id);
    // 200 ms doubling up to 10 s, each scaled by [0.5, 1.5).
    let mut base = Duration::from_millis(200);
    for w in waits {
        assert!(w >= base / 2 && w < base * 3 / 2, "{w:?} for {base:?}");
        base = (base * 2).min(Duration::from_secs(10));
    }
}

/// Hand-over (an upgrade): the old core gives its association away without deregistering or
/// closing it, with the half message it read; the new core carries on over it, registers
/// again at once and reads the rest of that message.
#[test]
fn a_handed_over_association_carries_on_in_the_next_core() {
    let reg = addr(1, 3863);
    let (mut old, c) = registered(reg);
    let ka = keep_alive(0x1001, false, old.id());
    old.handle_data(c, &ka[..5], at(40));
    assert!(actions(&mut old).is_empty());
    let (given, h) = old.hand_over().expect("registered: handed over");
    assert_eq!(given, c);
    assert_eq!((h.id, h.registrar, h.home), (old.id(), reg, 0x1001));
    assert_eq!(h.unread, ka[..5]);
    let a = actions(&mut old);
    assert!(
        !a.iter().any(|a| matches!(a, Action::Close(x) if *x == c)),
        "the association is not closed: {a:?}"
    );
    assert!(sent(&a, c).is_empty(), "no deregistration: {a:?}");
    assert!(old.is_stopped());
    assert!(old.hand_over().is_none(), "given away once");

    let cfg = PoolElementConfig::new(POOL, addr(9, 80), Policy::LeastUsed { load: 0 });
    let rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
    let (mut new, nc) = PeCore::from_hand_over(cfg, Some(addr(9, 7001)), Box::new(rng), &h, at(50));
    assert_eq!(new.id(), h.id);
    assert_eq!(
        new.state(),
        &PeState::Registered {
            registrar: reg,
            home: 0x1001
        }
    );
    new.handle_data(nc, &h.unread, at(50));
    new.handle_data(nc, &ka[5..], at(51));
    let sent_new = sent(&actions(&mut new), nc);
    assert!(is_registration(&sent_new[0]), "{sent_new:?}");
    assert!(sent_new[1..].iter().any(is_ack), "{sent_new:?}");
    // Its stop deregisters as usual.
    new.handle_data(nc, &accepted(h.id), at(60));
    new.stop(at(70));
    assert!(
        sent(&actions(&mut new), nc)
            .iter()
            .any(|m| matches!(m, AsapMessage::Deregistration { .. }))
    );
}

#[test]
fn only_a_registered_pe_hands_over() {
    let mut p = pe(vec![addr(1, 3863)], 3);
    let (c, _) = connect(&actions(&mut p));
    p.handle_connected(c, at(10));
    assert!(p.hand_over().is_none(), "registering, not registered");
    assert!(!p.is_stopped());
}
