//! The registrar state machine without sockets: bytes and simulated time in, bytes out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_registrar::{Action, Config, ConnId, Instant, Registrar};
use rserpool_wire::Message;
use rserpool_wire::{
    AsapMessage, CauseCode, Framer, Policy, PoolElement, PoolHandle, TransportAddress,
    UserTransport,
};
use std::net::SocketAddr;

const ID: u32 = 0x0101_0101;

fn cfg() -> Config {
    Config {
        keep_alive_interval_ms: 5000,
        keep_alive_timeout_ms: 5000,
        ..Config::default()
    }
}

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn peer(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn registration(id: u32, life: i32) -> Vec<u8> {
    registration_with(id, life, Policy::RoundRobin)
}

/// A REGISTRATION of PE `id` in pool P (its service at port 9000) with `policy`.
fn registration_with(id: u32, life: i32, policy: Policy) -> Vec<u8> {
    AsapMessage::Registration {
        pool_handle: PoolHandle::from("P"),
        pool_element: PoolElement {
            id,
            home_registrar: 0,
            registration_life: life,
            user_transport: UserTransport::Address(TransportAddress::tcp(peer(9000))),
            policy,
            asap_transport: None,
        },
    }
    .to_bytes()
    .unwrap()
}

fn output(r: &mut Registrar, c: ConnId) -> Vec<AsapMessage> {
    let mut f = Framer::new(65535);
    f.extend(r.output(c));
    let n = r.output(c).len();
    r.consume_output(c, n);
    let mut v = Vec::new();
    while let Ok(Some(m)) = f.next_message() {
        v.push(AsapMessage::decode(&m).unwrap());
    }
    v
}

/// A registrar with PE 7 registered over a connection from port 1, its answer read.
fn registered_pe_7() -> (Registrar, ConnId) {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let c = r.accept(peer(1), at(0)).unwrap();
    r.handle_data(c, &registration(7, -1), at(0));
    output(&mut r, c);
    (r, c)
}

/// True once the core asked the driver to close (or reset) `c`.
fn asked_to_close(r: &mut Registrar, c: ConnId) -> bool {
    std::iter::from_fn(|| r.poll_action()).any(|a| a == Action::Close(c) || a == Action::Abort(c))
}

/// Runs the timers from `from` to `to` in 100 ms steps.
fn run_until(r: &mut Registrar, from: u64, to: u64) {
    let mut t = from;
    while t <= to {
        r.handle_timeout(at(t));
        t += 100;
    }
}

#[test]
fn keep_alive_without_ack_removes_the_pe() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let c = r.accept(peer(1), at(0)).unwrap();
    r.handle_data(c, &registration(7, -1), at(0));
    let out = output(&mut r, c);
    assert!(matches!(
        out[..],
        [AsapMessage::RegistrationResponse {
            reject: false,
            pe_id: 7,
            ..
        }]
    ));
    assert_eq!(r.handlespace().len(), 1);
    run_until(&mut r, 0, 4900);
    assert!(
        output(&mut r, c).is_empty(),
        "no keep-alive before the interval"
    );
    run_until(&mut r, 5000, 5100);
    let out = output(&mut r, c);
    assert!(
        matches!(
            &out[..],
            [AsapMessage::EndpointKeepAlive {
                home: false,
                server_id: ID,
                pe_id: Some(7),
                ..
            }]
        ),
        "{out:?}"
    );
    run_until(&mut r, 5200, 9900);
    assert_eq!(r.handlespace().len(), 1, "still within the timeout");
    run_until(&mut r, 10_000, 10_200);
    assert_eq!(r.handlespace().len(), 0, "removed after interval + timeout");
    assert_eq!(r.status(at(10_200)).counters.removed_keep_alive_timeout, 1);
}

#[test]
fn keep_alive_ack_keeps_the_pe() {
    let (mut r, c) = registered_pe_7();
    for round in 1..=4u64 {
        let t = round * 5000 + (round - 1) * 300;
        run_until(&mut r, t - 100, t + 200);
        assert_eq!(output(&mut r, c).len(), 1, "keep-alive {round}");
        let ack = AsapMessage::EndpointKeepAliveAck {
            pool_handle: PoolHandle::from("P"),
            pe_id: 7,
        };
        r.handle_data(c, &ack.to_bytes().unwrap(), at(t + 300));
    }
    assert_eq!(r.handlespace().len(), 1);
}

#[test]
fn registration_life_expires() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let c = r.accept(peer(1), at(0)).unwrap();
    r.handle_data(c, &registration(7, 2), at(0));
    output(&mut r, c);
    run_until(&mut r, 0, 1900);
    assert_eq!(r.handlespace().len(), 1);
    run_until(&mut r, 2000, 2100);
    assert_eq!(r.handlespace().len(), 0);
    assert!(matches!(
        output(&mut r, c)[..],
        [AsapMessage::DeregistrationResponse { pe_id: 7, .. }]
    ));
    // A re-registration before expiry extends the life.
    r.handle_data(c, &registration(8, 2), at(3000));
    r.handle_data(c, &registration(8, 2), at(4500));
    run_until(&mut r, 4600, 6400);
    assert_eq!(r.handlespace().len(), 1);
}

#[test]
fn closing_the_association_removes_its_pes_only() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let a = r.accept(peer(1), at(0)).unwrap();
    let b = r.accept(peer(2), at(0)).unwrap();
    r.handle_data(
        a,
        &[registration(1, -1), registration(2, -1)].concat(),
        at(0),
    );
    r.handle_data(b, &registration(3, -1), at(0));
    assert_eq!(r.handlespace().len(), 3);
    r.handle_close(a, at(10));
    assert_eq!(r.handlespace().len(), 1);
    assert!(r.handlespace().find(b"P", 3).is_some());
}

#[test]
fn limits_answer_lack_of_resources_or_refuse() {
    let mut r = Registrar::new(
        Config {
            max_connections: 1,
            max_pes_per_connection: 1,
            ..cfg()
        },
        ID,
        at(0),
    );
    let a = r.accept(peer(1), at(0)).unwrap();
    assert!(r.accept(peer(2), at(0)).is_none(), "connection limit");
    r.handle_data(
        a,
        &[registration(1, -1), registration(2, -1)].concat(),
        at(0),
    );
    let out = output(&mut r, a);
    match &out[1] {
        AsapMessage::RegistrationResponse {
            reject: true,
            error: Some(e),
            ..
        } => {
            assert_eq!(e.causes[0].code, CauseCode::LACK_OF_RESOURCES)
        }
        m => panic!("{m:?}"),
    }
    // The whole handlespace has a limit too, whatever the associations.
    let mut r = Registrar::new(
        Config {
            max_pes: 2,
            ..cfg()
        },
        ID,
        at(0),
    );
    for (n, port) in [(1u32, 1u16), (2, 2), (3, 3)] {
        let c = r.accept(peer(port), at(0)).unwrap();
        r.handle_data(c, &registration(n, -1), at(0));
        let out = output(&mut r, c);
        let refused = matches!(&out[..], [AsapMessage::RegistrationResponse { reject: true, error: Some(e), .. }] if e.causes[0].code == CauseCode::LACK_OF_RESOURCES);
        assert_eq!(refused, n == 3, "{out:?}");
    }
    assert_eq!(r.handlespace().len(), 2);
}

#[test]
fn lost_framing_gets_an_error_then_close() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let c = r.accept(peer(1), at(0)).unwrap();
    r.handle_data(c, &[0x05, 0, 0xff, 0xff, 1, 2, 3, 4], at(0));
    let out = output(&mut r, c);
    assert!(matches!(&out[..], [AsapMessage::Error { .. }]), "{out:?}");
    assert!(asked_to_close(&mut r, c));
}

#[test]
fn a_peer_that_does_not_read_is_dropped() {
    let mut r = Registrar::new(
        Config {
            max_pending_bytes: 1000,
            ..cfg()
        },
        ID,
        at(0),
    );
    let c = r.accept(peer(1), at(0)).unwrap();
    let hr = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::from("none"),
        items: None,
    }
    .to_bytes()
    .unwrap();
    for _ in 0..100 {
        r.handle_data(c, &hr, at(0));
    }
    assert!(asked_to_close(&mut r, c));
    assert_eq!(r.status(at(0)).counters.slow_connections_closed, 1);
}

#[test]
fn a_resolution_larger_than_a_message_is_halved_until_it_fits() {
    let config = Config {
        max_hres_items_requested: 2000,
        ..cfg()
    };
    let mut r = Registrar::new(config, ID, at(0));
    // 1,500 PEs over two connections (1,000 per connection at most).
    for (port, ids) in [(1, 1..=750u32), (2, 751..=1500)] {
        let c = r.accept(peer(port), at(0)).unwrap();
        for id in ids {
            r.handle_data(c, &registration(id, -1), at(0));
        }
        output(&mut r, c);
    }
    assert_eq!(r.handlespace().len(), 1500);
    let pu = r.accept(peer(3), at(0)).unwrap();
    let ask = |items| AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::from("P"),
        items: Some(items),
    };
    for (items, expect) in [(10, 10..=10), (1500, 375..=1499)] {
        r.handle_data(pu, &ask(items).to_bytes().unwrap(), at(1));
        let bytes = r.output(pu).len();
        let out = output(&mut r, pu);
        assert!(bytes <= 65_536, "{bytes} bytes");
        match &out[..] {
            [
                AsapMessage::HandleResolutionResponse {
                    pool_elements,
                    policy: Some(Policy::RoundRobin),
                    error: None,
                    ..
                },
            ] => assert!(
                expect.contains(&pool_elements.len()),
                "{items} asked, {} answered",
                pool_elements.len()
            ),
            other => panic!("{other:?}"),
        }
    }
}

/// While a registrar synchronises its handlespace from a mentor, a pool it does not have may
/// exist at the others: the pool user is sent elsewhere with LACK_OF_RESOURCES. Once it serves
/// on its own (no mentor answered), the same question gets UNKNOWN_POOL_HANDLE.
#[test]
fn a_synchronising_registrar_does_not_deny_a_pool() {
    let mut r = Registrar::new(
        Config {
            peer: vec![peer(29_999).into()],
            mentor_discovery_ms: 1000,
            ..cfg()
        },
        ID,
        at(0),
    );
    r.enable_enrp(peer(29_998), at(0));
    assert!(r.is_starting());
    let resolve = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::from("Elsewhere"),
        items: None,
    }
    .to_bytes()
    .unwrap();
    let cause = |r: &mut Registrar, c: ConnId| match output(r, c).pop() {
        Some(AsapMessage::HandleResolutionResponse { error: Some(e), .. }) => e.causes[0].code,
        other => panic!("{other:?}"),
    };
    let c = r.accept(peer(40_000), at(1)).unwrap();
    r.handle_data(c, &resolve, at(2));
    assert_eq!(cause(&mut r, c), CauseCode::LACK_OF_RESOURCES);
    r.handle_timeout(at(1_001));
    assert!(!r.is_starting(), "no mentor answered: serving as it is");
    r.handle_data(c, &resolve, at(1_002));
    assert_eq!(cause(&mut r, c), CauseCode::UNKNOWN_POOL_HANDLE);
}

/// RFC 5352's S bit: a subscribed pool user is sent the pool again whenever it changes in a
/// way it can see — not for a re-registration with nothing new — and an empty answer when
/// the pool is gone.
#[test]
fn a_subscriber_is_pushed_each_visible_change_of_its_pool() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let pu = r.accept(peer(40_001), at(0)).unwrap();
    let subscribe = AsapMessage::HandleResolution {
        subscribe: true,
        pool_handle: PoolHandle::from("P"),
        items: None,
    }
    .to_bytes()
    .unwrap();
    r.handle_data(pu, &subscribe, at(1));
    match output(&mut r, pu).pop() {
        Some(AsapMessage::HandleResolutionResponse {
            accept: true,
            error: Some(e),
            ..
        }) => assert_eq!(e.causes[0].code, CauseCode::UNKNOWN_POOL_HANDLE),
        other => panic!("subscription accepted, pool unknown yet: {other:?}"),
    }
    let credits = |c: u32| {
        let mut m = AsapMessage::decode(&registration(7, 60)).unwrap();
        if let AsapMessage::Registration { pool_element, .. } = &mut m {
            pool_element.policy = Policy::Credits {
                credits: c,
                capacity: 8,
            };
        }
        m.to_bytes().unwrap()
    };
    let pe = r.accept(peer(40_002), at(2)).unwrap();
    let pushed = |r: &mut Registrar| -> Vec<Option<u32>> {
        output(r, pu)
            .into_iter()
            .map(|m| match m {
                AsapMessage::HandleResolutionResponse {
                    accept: true,
                    pool_elements,
                    ..
                } => pool_elements.first().map(|p| match p.policy {
                    Policy::Credits { credits, .. } => credits,
                    _ => u32::MAX,
                }),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    r.handle_data(pe, &credits(8), at(3));
    assert_eq!(pushed(&mut r), [Some(8)], "the pool appeared");
    r.handle_data(pe, &credits(8), at(4));
    assert_eq!(pushed(&mut r), [], "nothing new");
    // Two reports in one read: one push, of the latest.
    let mut two = credits(5);
    two.extend(credits(3));
    r.handle_data(pe, &two, at(5));
    assert_eq!(pushed(&mut r), [Some(3)]);
    r.handle_close(pe, at(6));
    assert_eq!(pushed(&mut r), [None], "the pool is gone");
    // The subscriber leaves: later changes go nowhere.
    r.handle_close(pu, at(7));
    let pe = r.accept(peer(40_003), at(8)).unwrap();
    r.handle_data(pe, &credits(1), at(9));
    assert_eq!(r.handlespace().len(), 1);
}

/// RFC 5355 §3.1 and §3.7: only the association a PE registered over may change or remove it;
/// a registration or deregistration of its identifier over another one (impersonation, or a
/// replayed deregistration) is refused with the RFC cause and changes nothing.
#[test]
fn another_association_can_neither_take_over_nor_deregister_a_pe() {
    let (mut r, owner) = registered_pe_7();
    let intruder = r.accept(peer(2), at(10)).unwrap();
    r.handle_data(intruder, &registration(7, -1), at(10));
    match &output(&mut r, intruder)[..] {
        [
            AsapMessage::RegistrationResponse {
                reject: true,
                error: Some(e),
                ..
            },
        ] => {
            assert_eq!(e.causes[0].code, CauseCode::NON_UNIQUE_PE_IDENTIFIER);
        }
        other => panic!("{other:?}"),
    }
    let dereg = AsapMessage::Deregistration {
        pool_handle: PoolHandle::from("P"),
        pe_id: 7,
    }
    .to_bytes()
    .unwrap();
    r.handle_data(intruder, &dereg, at(20));
    match &output(&mut r, intruder)[..] {
        [AsapMessage::DeregistrationResponse { error: Some(e), .. }] => {
            assert_eq!(e.causes[0].code, CauseCode::REJECTED_SECURITY);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.handlespace().len(), 1, "the PE stays");
    // Its own association may.
    r.handle_data(owner, &dereg, at(30));
    assert_eq!(r.handlespace().len(), 0);
}

/// RFC 5355 §3.6: at MAX-BAD-PE-REPORT reports the registrar probes the PE's service itself;
/// a service that accepts keeps the PE, one that does not removes it.
#[test]
fn unreachable_reports_are_checked_against_the_service() {
    let report = AsapMessage::EndpointUnreachable {
        pool_handle: PoolHandle::from("P"),
        pe_id: 7,
    }
    .to_bytes()
    .unwrap();
    for service_answers in [true, false] {
        let mut r = Registrar::new(cfg(), ID, at(0));
        let pe = r.accept(peer(1), at(0)).unwrap();
        r.handle_data(pe, &registration(7, -1), at(0));
        output(&mut r, pe);
        let pu = r.accept(peer(2), at(10)).unwrap();
        for i in 0..3 {
            r.handle_data(pu, &report, at(20 + i));
        }
        let probe = std::iter::from_fn(|| r.poll_action())
            .find_map(|a| match a {
                Action::Probe(c, to) => Some((c, to)),
                _ => None,
            })
            .expect("a probe of the service at the third report");
        assert_eq!(probe.1, peer(9000));
        assert_eq!(r.handlespace().len(), 1, "not removed on reports alone");
        if service_answers {
            r.handle_connected(probe.0, at(40));
            assert!(asked_to_close(&mut r, probe.0));
            r.handle_close(probe.0, at(41));
            assert_eq!(r.handlespace().len(), 1);
            assert_eq!(r.status(at(50)).counters.unreachable_refuted, 1);
            // The refuted reports are forgotten: one more report does not probe again.
            r.handle_data(pu, &report, at(60));
            assert!(
                !std::iter::from_fn(|| r.poll_action()).any(|a| matches!(a, Action::Probe(..))),
                "a report after a refutation starts counting again"
            );
        } else {
            r.handle_close(probe.0, at(40));
            assert_eq!(r.handlespace().len(), 0);
            assert_eq!(r.status(at(50)).counters.removed_unreachable, 1);
        }
    }
}

/// RFC 5355 §3.5: credits beyond the capacity a PE declares reach no pool user.
#[test]
fn credits_above_the_declared_capacity_are_held_to_it() {
    let mut r = Registrar::new(cfg(), ID, at(0));
    let c = r.accept(peer(1), at(0)).unwrap();
    let msg = registration_with(
        7,
        -1,
        Policy::Credits {
            credits: 1_000_000,
            capacity: 8,
        },
    );
    r.handle_data(c, &msg, at(0));
    let pe = &r.status(at(1)).pools[0].pes[0];
    assert!(pe.policy.contains("8/8"), "{}", pe.policy);
}

/// RFC 5355 §3.2 without TLS: with `enrp-peers-only`, ENRP is taken only from the hosts of
/// the configured peers.
#[test]
fn enrp_peers_only_refuses_strangers() {
    let mut r = Registrar::new(
        Config {
            peer: vec!["10.0.0.2:9901".parse().unwrap()],
            enrp_peers_only: true,
            ..cfg()
        },
        ID,
        at(0),
    );
    assert!(
        r.accept_enrp("10.0.0.9:40000".parse().unwrap(), at(0))
            .is_none()
    );
    assert!(
        r.accept_enrp("10.0.0.2:40001".parse().unwrap(), at(0))
            .is_some()
    );
    // Off by default: a registrar found by its PRESENCE may connect.
    let mut open = Registrar::new(cfg(), ID, at(0));
    assert!(
        open.accept_enrp("10.0.0.9:40000".parse().unwrap(), at(0))
            .is_some()
    );
}

/// RFC 5355 §3.5: a PE changing its policy faster than `max-rereg-rate` is answered, but its
/// entry changes only within the rate.
#[test]
fn policy_changes_beyond_the_rate_wait() {
    let mut r = Registrar::new(
        Config {
            max_rereg_rate: 2,
            ..cfg()
        },
        ID,
        at(0),
    );
    let c = r.accept(peer(1), at(0)).unwrap();
    let with_load = |weight| registration_with(7, -1, Policy::WeightedRoundRobin { weight });
    r.handle_data(c, &with_load(0), at(0));
    for load in 1..=5 {
        r.handle_data(c, &with_load(load), at(10));
    }
    let answers = output(&mut r, c);
    assert_eq!(answers.len(), 6);
    assert!(
        answers
            .iter()
            .all(|m| matches!(m, AsapMessage::RegistrationResponse { reject: false, .. })),
        "{answers:?}"
    );
    let policy = |r: &Registrar| r.status(at(20)).pools[0].pes[0].policy.clone();
    assert!(
        policy(&r).contains("load=2") || policy(&r).contains("2"),
        "{}",
        policy(&r)
    );
    assert_eq!(r.status(at(20)).counters.reregistrations_limited, 3);
    // A second later the rate allows it again.
    r.handle_data(c, &with_load(9), at(1100));
    output(&mut r, c);
    assert_eq!(policy(&r), "wrr weight=9");
}
