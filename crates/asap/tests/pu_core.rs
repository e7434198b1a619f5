//! The pool user's sans-IO core driven by hand: registrar failover, the stale-cache value and
//! ENDPOINT_UNREACHABLE, each step checked exactly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_asap::{Action, Answer, ConnId, Error, Instant, PoolUserConfig, PuCore, PuEvent};
use rserpool_wire::{
    AsapMessage, Message, Policy, PoolElement, PoolHandle, TransportAddress, UserTransport,
};
use std::net::SocketAddr;
use std::time::Duration;

const POOL: &str = "CachePool";

fn reg(last: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, last], 3863))
}

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn pu(stale_cache: Duration) -> PuCore {
    PuCore::new(PoolUserConfig {
        registrars: vec![reg(1), reg(2)],
        stale_cache,
        ..PoolUserConfig::default()
    })
}

fn actions(pu: &mut PuCore) -> Vec<Action<PuEvent>> {
    std::iter::from_fn(|| pu.poll_action()).collect()
}

fn connect(a: &[Action<PuEvent>]) -> (ConnId, SocketAddr) {
    a.iter()
        .find_map(|a| match a {
            Action::Connect(c, to) => Some((*c, *to)),
            _ => None,
        })
        .expect("a connect")
}

fn sent(a: &[Action<PuEvent>]) -> Vec<AsapMessage> {
    a.iter()
        .filter_map(|a| match a {
            Action::Transmit(_, b) => Some(AsapMessage::decode(b).unwrap()),
            _ => None,
        })
        .collect()
}

fn answer(a: Vec<Action<PuEvent>>) -> Result<Answer, Error> {
    a.into_iter()
        .find_map(|a| match a {
            Action::Event(PuEvent::Answered(_, r)) => Some(r),
            _ => None,
        })
        .expect("an answer")
}

fn pe(id: u32) -> PoolElement {
    PoolElement {
        id,
        home_registrar: 0x1001,
        registration_life: 30,
        user_transport: UserTransport::Address(TransportAddress::tcp(SocketAddr::from((
            [10, 1, 0, id as u8],
            80,
        )))),
        policy: Policy::RoundRobin,
        asap_transport: None,
    }
}

fn response(ids: &[u32]) -> Vec<u8> {
    AsapMessage::HandleResolutionResponse {
        accept: false,
        pool_handle: PoolHandle::from(POOL),
        policy: Some(Policy::RoundRobin),
        pool_elements: ids.iter().map(|&i| pe(i)).collect(),
        error: None,
    }
    .to_bytes()
    .unwrap()
}

/// With no answer among `a` yet, the question goes to `to` on a new association, opened at
/// `ms`, and the answer there (PEs `pes`) is the question's; returns that association.
fn asked_again(
    pu: &mut PuCore,
    a: &[Action<PuEvent>],
    to: SocketAddr,
    ms: u64,
    pes: &[u32],
) -> ConnId {
    assert!(
        !a.iter()
            .any(|a| matches!(a, Action::Event(PuEvent::Answered(..)))),
        "answered already: {a:?}"
    );
    let (c, addr) = connect(a);
    assert_eq!(addr, to);
    pu.handle_connected(c, at(ms));
    assert_eq!(sent(&actions(pu)).len(), 1);
    pu.handle_data(c, &response(pes), at(ms + 5));
    assert_eq!(ids(answer(actions(pu))), pes);
    c
}

fn ids(r: Result<Answer, Error>) -> Vec<u32> {
    match r {
        Ok(Answer::Resolution(r)) => r.pool_elements.iter().map(|p| p.id).collect(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_silent_registrar_is_left_for_the_next_one() {
    let mut pu = pu(Duration::ZERO);
    let h = PoolHandle::from(POOL);
    pu.resolve(&h, at(0));
    let (c1, to) = connect(&actions(&mut pu));
    assert_eq!(to, reg(1));
    pu.handle_connected(c1, at(5));
    assert!(matches!(
        sent(&actions(&mut pu))[0],
        AsapMessage::HandleResolution { .. }
    ));
    // No answer within the request timeout: the next registrar gets the question.
    let t = pu.poll_timeout().unwrap();
    assert_eq!(t, at(3_005));
    pu.handle_timeout(t);
    let a = actions(&mut pu);
    assert!(a.iter().any(|a| matches!(a, Action::Close(c) if *c == c1)));
    let (c2, to) = connect(&a);
    assert_eq!(to, reg(2));
    pu.handle_connected(c2, t);
    assert_eq!(sent(&actions(&mut pu)).len(), 1);
    pu.handle_data(c2, &response(&[7]), at(3_100));
    assert_eq!(ids(answer(actions(&mut pu))), vec![7]);
    // The association stays for the next question.
    pu.resolve(&h, at(4_000));
    let a = actions(&mut pu);
    assert!(!a.iter().any(|a| matches!(a, Action::Connect(..))));
    assert_eq!(sent(&a).len(), 1);
}

/// One registrar that restarted between two queries: the association kept from the first is
/// found closed when the second goes out, and the second is asked again on a new association
/// to the same registrar instead of failing (it has no other registrar to go to).
#[test]
fn a_stale_association_is_replaced_not_counted_as_the_registrar_failing() {
    let mut pu = PuCore::new(PoolUserConfig {
        registrars: vec![reg(1)],
        ..PoolUserConfig::default()
    });
    let h = PoolHandle::from(POOL);
    pu.resolve(&h, at(0));
    let (c1, _) = connect(&actions(&mut pu));
    pu.handle_connected(c1, at(1));
    assert_eq!(sent(&actions(&mut pu)).len(), 1);
    pu.handle_data(c1, &response(&[7]), at(2));
    assert_eq!(ids(answer(actions(&mut pu))), vec![7]);
    // The registrar restarts; the next question goes out on the kept association, which the
    // driver then finds closed.
    pu.resolve(&h, at(10_000));
    assert_eq!(sent(&actions(&mut pu)).len(), 1);
    pu.handle_close(c1, at(10_001));
    let a = actions(&mut pu);
    let c2 = asked_again(&mut pu, &a, reg(1), 10_002, &[8]);
    // A new association that closes before any answer is the registrar failing: no third try.
    pu.resolve(&h, at(20_000));
    actions(&mut pu);
    pu.handle_close(c2, at(20_001));
    let (c3, _) = connect(&actions(&mut pu));
    pu.handle_connected(c3, at(20_002));
    actions(&mut pu);
    pu.handle_close(c3, at(20_003));
    assert!(matches!(answer(actions(&mut pu)), Err(Error::Closed)));
}

/// A registrar running TLS, asked in plaintext, sends a few bytes of an alert and closes:
/// no answer, so the registrar failed, and the question fails after its tries. Before, the
/// bytes counted as an answer, the close as a kept association gone stale, and the pool
/// user asked again at once, without end (10,000 connections a second, found by an operator).
#[test]
fn bytes_that_are_no_message_before_a_close_are_no_answer() {
    let mut pu = PuCore::new(PoolUserConfig {
        registrars: vec![reg(1)],
        ..PoolUserConfig::default()
    });
    pu.resolve(&PoolHandle::from(POOL), at(0));
    let mut a = actions(&mut pu);
    let mut connects = 0;
    loop {
        if a.iter()
            .any(|x| matches!(x, Action::Event(PuEvent::Answered(..))))
        {
            break;
        }
        let (c, _) = connect(&a);
        connects += 1;
        assert!(connects <= 10, "connecting again and again");
        pu.handle_connected(c, at(connects));
        actions(&mut pu);
        // A TLS alert: record type 21, version 3.3, length 2, fatal, unexpected_message.
        pu.handle_data(c, &[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x0a], at(connects));
        pu.handle_close(c, at(connects));
        a = actions(&mut pu);
    }
    assert!(answer(a).is_err());
}

#[test]
fn no_registrar_reachable_names_each_one_tried() {
    let mut pu = pu(Duration::ZERO);
    pu.resolve(&PoolHandle::from(POOL), at(0));
    let (c1, _) = connect(&actions(&mut pu));
    pu.handle_connect_error(c1, "refused", at(1));
    let (c2, _) = connect(&actions(&mut pu));
    pu.handle_timeout(at(2_001));
    let a = actions(&mut pu);
    assert!(a.iter().any(|a| matches!(a, Action::Close(c) if *c == c2)));
    match answer(a) {
        Err(Error::NoRegistrar(why)) => {
            assert_eq!(why, "10.0.0.1:3863: refused; 10.0.0.2:3863: timed out");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_cache_serves_until_stale_and_forgets_unreachable_pes() {
    let mut pu = pu(Duration::from_secs(1));
    let h = PoolHandle::from(POOL);
    pu.resolve(&h, at(0));
    let (c, _) = connect(&actions(&mut pu));
    pu.handle_connected(c, at(1));
    match &sent(&actions(&mut pu))[0] {
        AsapMessage::HandleResolution { items, .. } => assert_eq!(*items, Some(u32::MAX)),
        other => panic!("{other:?}"),
    }
    pu.handle_data(c, &response(&[1, 2]), at(2));
    assert_eq!(ids(answer(actions(&mut pu))).len(), 2);
    // From the cache: answered at once, nothing sent.
    pu.resolve(&h, at(500));
    let a = actions(&mut pu);
    assert!(sent(&a).is_empty());
    assert_eq!(ids(answer(a)).len(), 2);
    // An unreachable PE is reported and no longer served.
    pu.report_unreachable(&h, 1, at(600));
    let a = actions(&mut pu);
    assert!(matches!(
        sent(&a)[0],
        AsapMessage::EndpointUnreachable { pe_id: 1, .. }
    ));
    assert!(matches!(answer(a), Ok(Answer::Reported)));
    pu.resolve(&h, at(700));
    assert_eq!(ids(answer(actions(&mut pu))), vec![2]);
    // Stale: asked again.
    pu.resolve(&h, at(1_002));
    assert_eq!(sent(&actions(&mut pu)).len(), 1);
}

/// A registrar still synchronising its handlespace (just started, or back after being cut
/// off) does not know the pool yet and says so with LACK_OF_RESOURCES: the pool user asks the
/// next registrar instead of concluding that the pool does not exist.
#[test]
fn a_synchronising_registrar_sends_the_question_to_the_next_one() {
    use rserpool_wire::{CauseCode, ErrorCause, OperationError};
    let mut pu = pu(Duration::ZERO);
    let h = PoolHandle::from(POOL);
    pu.resolve(&h, at(0));
    let (c1, _) = connect(&actions(&mut pu));
    pu.handle_connected(c1, at(5));
    assert_eq!(sent(&actions(&mut pu)).len(), 1);
    let busy = AsapMessage::HandleResolutionResponse {
        accept: false,
        pool_handle: h.clone(),
        policy: None,
        pool_elements: Vec::new(),
        error: Some(OperationError {
            causes: vec![ErrorCause::new(CauseCode::LACK_OF_RESOURCES)],
        }),
    };
    pu.handle_data(c1, &busy.to_bytes().unwrap(), at(10));
    let a = actions(&mut pu);
    asked_again(&mut pu, &a, reg(2), 15, &[3, 4]);
}
