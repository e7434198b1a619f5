//! The association and the stack against a hostile or broken peer: arbitrary packets — any
//! chunks, with the association's verification tag or another — never make them panic; every
//! packet they send encodes and decodes again; nothing is delivered after the association
//! ended; packets with a wrong tag change nothing (a message sent afterwards still arrives,
//! exactly once); and arbitrary datagrams, checksum right or wrong, never upset a stack.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod strategies;

use bytes::Bytes;
use proptest::prelude::*;
use rserpool_sctp::assoc::Config;
use rserpool_sctp::{Association, Endpoint, Event, Outcome, Packet, Stack};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use strategies::{bytes, chunk};

fn client_addr() -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 2], 9899))
}
fn server_addr() -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], 9899))
}

/// A client and a server association, established over a clean exchange.
fn established(now: Instant) -> (Association, Association) {
    let cfg = Config::default();
    let mut client =
        Association::connect(cfg.clone(), server_addr(), 5000, 3863, 0x1111_2222, 77, now);
    let mut endpoint = Endpoint::new(cfg, 3863, [7; 32], 9, now);
    let mut server = None;
    for _ in 0..10 {
        while let Some((_, p)) = client.poll_transmit(now) {
            let p = Packet::decode(&p.encode()).unwrap();
            match &mut server {
                Some(s) => Association::handle(s, p, client_addr(), now),
                None => match endpoint.handle(p, client_addr(), now) {
                    Outcome::Reply(r) => {
                        client.handle(Packet::decode(&r.encode()).unwrap(), server_addr(), now)
                    }
                    Outcome::Accept(a) => server = Some(*a),
                    _ => {}
                },
            }
        }
        if let Some(s) = server.as_mut() {
            while let Some((_, p)) = s.poll_transmit(now) {
                client.handle(Packet::decode(&p.encode()).unwrap(), server_addr(), now);
            }
        }
    }
    let mut server = server.expect("the handshake completes");
    while client.poll_event().is_some() {}
    while server.poll_event().is_some() {}
    (client, server)
}

/// Everything `a` sends now: each packet must encode and decode again.
fn drain(a: &mut Association, now: Instant) -> Vec<Packet> {
    let mut out = Vec::new();
    while let Some((_, p)) = a.poll_transmit(now) {
        let wire = p.encode();
        out.push(Packet::decode(&wire).expect("what we send decodes"));
        assert!(
            out.len() < 10_000,
            "an association that never stops sending"
        );
    }
    out
}

/// Events, checked: nothing after the end.
fn events(a: &mut Association, ended: &mut bool) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(e) = a.poll_event() {
        assert!(!*ended, "{e:?} after the association ended");
        *ended |= matches!(e, Event::Closed | Event::Aborted(_));
        out.push(e);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn an_association_survives_any_packets(
        packets in prop::collection::vec(
            (prop::collection::vec(chunk(), 1..4), any::<bool>(), any::<u32>(), 0u64..3000),
            0..25,
        ),
    ) {
        let t0 = Instant::now();
        let (_client, mut server) = established(t0);
        let tag = server.local_tag();
        let mut ended = false;
        let mut now = t0;
        for (chunks, right_tag, other, ms) in packets {
            now += Duration::from_millis(ms);
            let p = Packet::new(5000, 3863, if right_tag { tag } else { other }, chunks);
            // As a stack gets it: encoded and decoded.
            if let Ok(p) = Packet::decode(&p.encode()) {
                server.handle(p, client_addr(), now);
            }
            server.handle_timeout(now);
            drain(&mut server, now);
            events(&mut server, &mut ended);
        }
    }

    #[test]
    fn packets_with_a_wrong_tag_change_nothing(
        packets in prop::collection::vec(
            (prop::collection::vec(chunk(), 1..4), any::<u32>()),
            1..25,
        ),
    ) {
        let now = Instant::now();
        let (mut client, mut server) = established(now);
        let tag = server.local_tag();
        let mut ended = false;
        for (chunks, other) in packets {
            // An INIT with tag 0 is an association restart or collision, which a wrong tag
            // is not meant to test.
            let other = if other == tag || other == 0 { tag ^ 1 } else { other };
            if let Ok(p) = Packet::decode(&Packet::new(5000, 3863, other, chunks).encode()) {
                server.handle(p, client_addr(), now);
            }
            prop_assert!(drain(&mut server, now).is_empty(), "an answer to a packet with a wrong tag");
            prop_assert!(events(&mut server, &mut ended).is_empty());
        }
        client.send(0, 11, Bytes::from_static(b"still here"), false).unwrap();
        for p in drain(&mut client, now) {
            server.handle(p, client_addr(), now);
        }
        let got: Vec<Event> = events(&mut server, &mut ended);
        let messages: Vec<Bytes> = got
            .iter()
            .filter_map(|e| match e {
                Event::Message(m) => Some(m.data.clone()),
                _ => None,
            })
            .collect();
        prop_assert_eq!(messages, vec![Bytes::from_static(b"still here")]);
    }

    #[test]
    fn a_stack_survives_any_datagrams(
        datagrams in prop::collection::vec(
            prop_oneof![
                bytes(300).prop_map(|b| b.to_vec()),
                (any::<u16>(), any::<u32>(), prop::collection::vec(chunk(), 1..4))
                    .prop_map(|(src, tag, chunks)| Packet::new(src, 3863, tag, chunks).encode().to_vec()),
            ],
            0..40,
        ),
    ) {
        let now = Instant::now();
        let mut stack = Stack::new(Config::default(), [3; 32], 5, now);
        stack.listen(3863);
        let peer = "192.0.2.9:9899".parse().unwrap();
        for (i, d) in datagrams.iter().enumerate() {
            let at = now + Duration::from_millis(i as u64 * 50);
            stack.handle_datagram(peer, d, at);
            stack.handle_timeout(at);
            let mut sent = 0;
            while let Some((_, wire)) = stack.poll_transmit(at) {
                prop_assert!(Packet::decode(&wire).is_ok(), "what the stack sends decodes");
                sent += 1;
                prop_assert!(sent < 10_000);
            }
            while stack.poll_event().is_some() {}
        }
    }
}
