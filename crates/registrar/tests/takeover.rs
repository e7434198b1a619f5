//! Takeovers by a registrar that may be cut off, in the sans-IO core. Found by the chaos soak
//! (`rserpool-bench chaos`, docs/RELIABILITY.md): a registrar cut off from the network took
//! over its silent peers' PEs, could not reach them, and removed them when their keep-alives
//! went unanswered; its connections to them were still being opened. Had the
//! ENDPOINT_KEEP_ALIVE with the H bit queued on such a connection gone out when the network
//! came back, each PE would have adopted a home that no longer had it and left the home that
//! did. Now a registrar that hears neither a peer nor a PE does not take over at all; one that
//! hears its PEs, or whose peer's host refuses connections (the peer was killed), does, and
//! nothing of an unanswered takeover is left to deliver later.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_registrar::{Action, Config, ConnId, Instant, Registrar};
use rserpool_wire::{
    EnrpBody, EnrpMessage, Message, Policy, PoolElement, PoolHandle, ServerInformation,
    TransportAddress, UpdateAction, UserTransport,
};
use std::net::SocketAddr;

const US: u32 = 0x0a00_0001;
const PEER: u32 = 0x0a00_0002;

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, last], port))
}

fn enrp(body: EnrpBody) -> Vec<u8> {
    EnrpMessage {
        sender: PEER,
        receiver: 0,
        body,
    }
    .to_bytes()
    .unwrap()
}

/// Every action until the queue is empty.
fn actions(r: &mut Registrar) -> Vec<Action> {
    std::iter::from_fn(|| r.poll_action()).collect()
}

/// A registrar with one peer, which announced one PE (takeover listener at 10.0.0.9:7000).
fn with_a_peer_and_its_pe() -> Registrar {
    let cfg = Config {
        peer_heartbeat_ms: 500,
        max_time_last_heard_ms: 1000,
        max_time_no_response_ms: 1000,
        mentor_discovery_ms: 200,
        takeover_expiry_ms: 1000,
        keep_alive_interval_ms: 1000,
        keep_alive_timeout_ms: 1000,
        ..Config::default()
    };
    let mut r = Registrar::new(cfg, US, at(0));
    r.enable_enrp(addr(1, 9901), at(0));
    // The peer announces itself and its PE, whose takeover listener is at 10.0.0.9:7000.
    let c = r.accept_enrp(addr(2, 40_000), at(0)).unwrap();
    r.handle_data(
        c,
        &enrp(EnrpBody::Presence {
            reply_required: false,
            checksum: None,
            server_info: Some(ServerInformation {
                server_id: PEER,
                transport: TransportAddress::tcp(addr(2, 9901)),
            }),
        }),
        at(10),
    );
    let pe = PoolElement {
        id: 0x77,
        home_registrar: PEER,
        registration_life: 60,
        user_transport: UserTransport::Address(TransportAddress::tcp(addr(9, 8000))),
        policy: Policy::RoundRobin,
        asap_transport: Some(TransportAddress::tcp(addr(9, 7000))),
    };
    r.handle_data(
        c,
        &enrp(EnrpBody::HandleUpdate {
            takeover_suggested: false,
            action: UpdateAction::AddPe,
            pool_handle: PoolHandle::from("P"),
            pool_element: pe,
        }),
        at(20),
    );
    assert_eq!(r.handlespace().len(), 1);
    r
}

/// A PE of this registrar's own registers at `t` ms over `conn` (a new association if
/// `None`), which it returns: the registrar is not cut off.
fn own_pe_registers(r: &mut Registrar, conn: Option<ConnId>, t: u64) -> ConnId {
    let a = conn.unwrap_or_else(|| r.accept(addr(8, 50_000), at(t)).unwrap());
    let reg = rserpool_wire::AsapMessage::Registration {
        pool_handle: PoolHandle::from("P"),
        pool_element: PoolElement {
            id: 0x88,
            home_registrar: 0,
            registration_life: 60,
            user_transport: UserTransport::Address(TransportAddress::tcp(addr(8, 8000))),
            policy: Policy::RoundRobin,
            asap_transport: None,
        },
    };
    r.handle_data(a, &reg.to_bytes().unwrap(), at(t));
    a
}

/// The first connection to the peer's PE before `until`, if any. With `peer_killed`, every
/// connection to the peer is refused (its host answers); otherwise they stay pending, as
/// across a cut.
fn takeover_connect(
    r: &mut Registrar,
    t: &mut u64,
    until: u64,
    peer_killed: bool,
) -> Option<ConnId> {
    while *t < until {
        *t += 50;
        r.handle_timeout(at(*t));
        for a in actions(r) {
            match a {
                Action::Connect(id, to) if to == addr(9, 7000) => return Some(id),
                Action::Connect(id, to) if to == addr(2, 9901) && peer_killed => {
                    r.handle_closed_by_peer(id, at(*t));
                }
                _ => {}
            }
        }
    }
    None
}

#[test]
fn an_unanswered_takeover_leaves_nothing_to_deliver_later() {
    let mut r = with_a_peer_and_its_pe();
    // The peer is killed: its host refuses connections. It is taken over, with no one else to
    // ask.
    let mut t = 20;
    let taken_over = takeover_connect(&mut r, &mut t, 10_000, true);
    let pe_conn: ConnId = taken_over.expect("a connection to the PE's takeover listener");
    assert!(
        !r.output(pe_conn).is_empty(),
        "the keep-alive with the H bit waits for the connection"
    );
    // The connection never comes up (the PE is out of reach): the keep-alive goes unanswered.
    let mut closed = false;
    let end = t + 3000;
    while t < end {
        t += 50;
        r.handle_timeout(at(t));
        closed |= actions(&mut r).contains(&Action::Abort(pe_conn));
    }
    assert_eq!(r.handlespace().len(), 0, "the PE is removed");
    assert!(closed, "the connection to the PE is reset");
    assert!(
        r.output(pe_conn).is_empty(),
        "nothing is left to send should the connection come up now"
    );
}

/// The peer goes silent, and so does every PE: this registrar may be the one cut off. It holds
/// its takeover back (it would reach the PE when the link returns and take it from its live
/// home) until it hears a PE again, just before a probe and after it.
#[test]
fn a_registrar_that_hears_no_one_holds_its_takeover_back() {
    let mut r = with_a_peer_and_its_pe();
    let mut t = 20;
    assert_eq!(takeover_connect(&mut r, &mut t, 8_000, false), None);
    let c = r.enrp_counters().clone();
    assert_eq!(c.takeovers, 0);
    assert!(c.takeovers_deferred >= 2, "{c:?}");
    assert_eq!(r.handlespace().len(), 1, "the peer's PE stays");
    // A PE of its own speaks, every 300 ms: the registrar is reachable, and the takeover
    // goes ahead once the network was heard all through a probe.
    let (start, mut conn, mut taken) = (t, None, None);
    while taken.is_none() && t < start + 4_000 {
        conn = Some(own_pe_registers(&mut r, conn, t));
        let until = t + 300;
        taken = takeover_connect(&mut r, &mut t, until, false);
    }
    assert!(taken.is_some(), "taken over at last");
    assert_eq!(r.enrp_counters().takeovers, 1);
}

/// The home registrars of the PEs whose ID passes `which`.
fn homes(r: &Registrar, which: impl Fn(u32) -> bool) -> Vec<u32> {
    let hs = r.handlespace();
    hs.pools()
        .flat_map(|(h, _, _)| hs.members(h.as_bytes()).collect::<Vec<_>>())
        .map(|x| &hs.pe(x).element)
        .filter(|e| which(e.id))
        .map(|e| e.home_registrar)
        .collect()
}

/// ENRP messages this registrar sent on connection `c`, decoded.
fn enrp_out(r: &mut Registrar, c: ConnId) -> Vec<EnrpMessage> {
    let mut framer = rserpool_wire::Framer::new(65_536);
    framer.extend(r.output(c));
    let n = r.output(c).len();
    r.consume_output(c, n);
    std::iter::from_fn(|| framer.next_message().ok().flatten())
        .filter_map(|f| EnrpMessage::decode(&f).ok())
        .collect()
}

fn presence_of_peer() -> Vec<u8> {
    enrp(EnrpBody::Presence {
        reply_required: false,
        checksum: None,
        server_info: Some(ServerInformation {
            server_id: PEER,
            transport: TransportAddress::tcp(addr(2, 9901)),
        }),
    })
}

/// A registrar was cut off and taken over; back, it hears so from the new home. A PE of its
/// own that it loses then (it moved: its association here closes) stays in the handlespace as
/// the new home's, rather than leaving it and this registrar's subscribers with an emptying
/// pool. Without the news, the same close removes it.
#[test]
fn a_pe_lost_just_after_a_takeover_stays_as_the_new_homes() {
    for told in [false, true] {
        let mut r = with_a_peer_and_its_pe();
        let pe = own_pe_registers(&mut r, None, 100);
        assert_eq!(r.handlespace().len(), 2);
        if told {
            let c = r.accept_enrp(addr(2, 40_001), at(200)).unwrap();
            r.handle_data(c, &presence_of_peer(), at(200));
            let msg = EnrpMessage {
                sender: PEER,
                receiver: US,
                body: EnrpBody::TakeoverServer { target: US },
            };
            r.handle_data(c, &msg.to_bytes().unwrap(), at(210));
        }
        r.handle_closed_by_peer(pe, at(300));
        let homes = homes(&r, |id| id == 0x88);
        if told {
            assert_eq!(
                homes,
                [PEER],
                "the PE stays, homed at the registrar that took us over"
            );
            assert_eq!(r.status(at(300)).counters.kept_after_takeover, 1);
        } else {
            assert_eq!(
                homes,
                Vec::<u32>::new(),
                "without a takeover, a closed association removes its PE"
            );
        }
    }
}

/// The registrar that took a peer over tells it so when it speaks again (it was only cut off),
/// once, on the connection it spoke on.
#[test]
fn a_peer_taken_over_hears_so_when_it_is_back() {
    let mut r = with_a_peer_and_its_pe();
    let mut t = 20;
    takeover_connect(&mut r, &mut t, 10_000, true).expect("taken over");
    assert_eq!(r.enrp_counters().takeovers, 1);
    let c = r.accept_enrp(addr(2, 40_002), at(t)).unwrap();
    for _ in 0..2 {
        r.handle_data(c, &presence_of_peer(), at(t));
        actions(&mut r);
        t += 100;
    }
    let told: Vec<_> = enrp_out(&mut r, c)
        .into_iter()
        .filter(|m| matches!(m.body, EnrpBody::TakeoverServer { target: PEER }))
        .collect();
    assert_eq!(told.len(), 1, "told once: {told:?}");
    assert_eq!((told[0].sender, told[0].receiver), (US, PEER));
}

/// A takeover of a registrar that comes back before its PE moved: the PE refuses it (its home
/// answers) and closes the new association. The PE stays, as its home's again, here and at
/// the peers (a HANDLE_UPDATE naming the home), rather than being removed everywhere while it
/// is registered there.
#[test]
fn a_refused_takeover_gives_the_pe_back_to_its_home() {
    let mut r = with_a_peer_and_its_pe();
    let mut t = 20;
    let pe_conn = takeover_connect(&mut r, &mut t, 10_000, true).expect("taken over");
    r.handle_connected(pe_conn, at(t));
    // The peer is back, and the PE, asked by the new home, keeps it.
    let c = r.accept_enrp(addr(2, 40_003), at(t)).unwrap();
    r.handle_data(c, &presence_of_peer(), at(t));
    // Its entry gets a connection of ours to it again.
    let to_peer = actions(&mut r)
        .into_iter()
        .find_map(|a| match a {
            Action::Connect(id, to) if to == addr(2, 9901) => Some(id),
            _ => None,
        })
        .expect("a connection to the peer");
    r.handle_connected(to_peer, at(t));
    enrp_out(&mut r, to_peer);
    r.handle_closed_by_peer(pe_conn, at(t + 50));
    actions(&mut r);
    assert_eq!(
        homes(&r, |_| true),
        [PEER],
        "the PE stays, homed at the peer again"
    );
    let told: Vec<_> = enrp_out(&mut r, to_peer)
        .into_iter()
        .filter_map(|m| match m.body {
            EnrpBody::HandleUpdate {
                action: UpdateAction::AddPe,
                pool_element,
                ..
            } => Some(pool_element.home_registrar),
            _ => None,
        })
        .collect();
    assert_eq!(
        told,
        [PEER],
        "the peers hear that the PE is the peer's again"
    );
    assert_eq!(r.status(at(t + 50)).counters.takeovers_handed_back, 1);
}

/// The REGISTRATION of this registrar's own PE `0x100 + i` in pool P.
fn own_registration(i: u32) -> rserpool_wire::AsapMessage {
    rserpool_wire::AsapMessage::Registration {
        pool_handle: PoolHandle::from("P"),
        pool_element: PoolElement {
            id: 0x100 + i,
            home_registrar: 0,
            registration_life: 60,
            user_transport: UserTransport::Address(TransportAddress::tcp(addr(8, 8000))),
            policy: Policy::RoundRobin,
            asap_transport: None,
        },
    }
}

/// A registrar with many PEs (a talkative network) is cut off for longer than its peers take
/// to take it over; when the link returns, a PE that moved to its new home meanwhile closes
/// its association here, right after its last message arrives. The PE is kept (the new
/// home's TAKEOVER_SERVER is on its way), not removed. A registrar without peers, which no one
/// can take over, removes it at once.
#[test]
fn a_pe_that_closes_just_after_a_long_silence_is_kept() {
    for with_peer in [true, false] {
        a_pe_closes_after_a_long_silence(with_peer);
    }
}

fn a_pe_closes_after_a_long_silence(with_peer: bool) {
    let cfg = Config {
        keep_alive_interval_ms: 1000,
        keep_alive_timeout_ms: 1000,
        max_time_last_heard_ms: 1500,
        ..Config::default()
    };
    let mut r = Registrar::new(cfg, US, at(0));
    // A peer that speaks until the cut.
    let peer = with_peer.then(|| {
        r.enable_enrp(addr(1, 9901), at(0));
        r.accept_enrp(addr(2, 40_000), at(0)).unwrap()
    });
    let pe = own_registration;
    let conns: Vec<ConnId> = (0..40u32)
        .map(|i| {
            let c = r.accept(addr(8, 50_000 + i as u16), at(0)).unwrap();
            r.handle_data(c, &pe(i).to_bytes().unwrap(), at(i as u64 * 25));
            c
        })
        .collect();
    // Five seconds of keep-alives, each answered at once.
    let answer = |r: &mut Registrar, t: u64, reply: bool| {
        r.handle_timeout(at(t));
        actions(r);
        for (i, &c) in conns.iter().enumerate() {
            let n = r.output(c).len();
            let out = r.output(c).to_vec();
            r.consume_output(c, n);
            let mut f = rserpool_wire::Framer::new(65_536);
            f.extend(&out);
            while let Ok(Some(m)) = f.next_message() {
                if reply
                    && let Ok(rserpool_wire::AsapMessage::EndpointKeepAlive { .. }) =
                        rserpool_wire::AsapMessage::decode(&m)
                {
                    let ack = rserpool_wire::AsapMessage::EndpointKeepAliveAck {
                        pool_handle: PoolHandle::from("P"),
                        pe_id: 0x100 + i as u32,
                    };
                    r.handle_data(c, &ack.to_bytes().unwrap(), at(t));
                }
            }
        }
    };
    let mut t = 1_000;
    while t < 6_000 {
        if let Some(c) = peer
            && t % 200 == 0
        {
            r.handle_data(c, &presence_of_peer(), at(t));
        }
        answer(&mut r, t, true);
        t += 10;
    }
    // Cut off for 3.8 s: nothing arrives; no PE is removed meanwhile.
    while t < 9_800 {
        answer(&mut r, t, false);
        t += 10;
    }
    assert_eq!(r.handlespace().len(), 40, "no PE removed while cut off");
    // Back: PE 0's last registration arrives, then its association closes.
    r.handle_data(conns[0], &pe(0).to_bytes().unwrap(), at(t));
    r.handle_closed_by_peer(conns[0], at(t));
    if with_peer {
        assert_eq!(r.handlespace().len(), 40, "PE 0 kept");
        assert_eq!(r.status(at(t)).counters.kept_after_takeover, 1);
    } else {
        assert_eq!(
            r.handlespace().len(),
            39,
            "PE 0 removed: no peer could take it"
        );
        assert_eq!(r.status(at(t)).counters.kept_after_takeover, 0);
    }
}

/// As above, but the PE refuses before this registrar hears the peer again: the PE answered
/// the takeover (it is alive), so it is kept until the peer speaks, then given back. A PE
/// that never answered (its connection refused: it died) is removed at once.
#[test]
fn a_pe_that_refuses_before_its_home_is_heard_waits_for_it() {
    for answered in [true, false] {
        let mut r = with_a_peer_and_its_pe();
        let mut t = 20;
        let pe_conn = takeover_connect(&mut r, &mut t, 10_000, true).expect("taken over");
        if answered {
            r.handle_connected(pe_conn, at(t));
            let ack = rserpool_wire::AsapMessage::EndpointKeepAliveAck {
                pool_handle: PoolHandle::from("P"),
                pe_id: 0x77,
            };
            r.handle_data(pe_conn, &ack.to_bytes().unwrap(), at(t));
        }
        r.handle_closed_by_peer(pe_conn, at(t + 10));
        if !answered {
            assert_eq!(
                r.handlespace().len(),
                0,
                "a PE that never answered is removed"
            );
            continue;
        }
        assert_eq!(r.handlespace().len(), 1, "kept while the peer is not heard");
        // The peer speaks again, then the wait ends: the PE is the peer's.
        let c = r.accept_enrp(addr(2, 40_004), at(t + 300)).unwrap();
        r.handle_data(c, &presence_of_peer(), at(t + 300));
        for step in 1..=30 {
            r.handle_timeout(at(t + 300 + step * 50));
            actions(&mut r);
        }
        assert_eq!(
            homes(&r, |_| true),
            [PEER],
            "given back once the peer is heard"
        );
    }
}

/// A small network — one peer heartbeating at the default 2.4 s, three PEs at the default 5 s
/// keep-alive interval — brings something about once a second, with gaps of one and two
/// seconds between; quieter still once the peer dies. No silence of that kind says this
/// registrar was cut off. A PE that stops answering is removed one keep-alive timeout after
/// the keep-alive it left unanswered, as RFC 5352 says; a PE whose association closes is
/// removed at once; the dead peer is taken over without delay.
#[test]
fn a_small_network_removes_a_dead_pe_on_time() {
    let mut r = Registrar::new(Config::default(), US, at(0));
    r.enable_enrp(addr(1, 9901), at(0));
    let peer = r.accept_enrp(addr(2, 40_000), at(0)).unwrap();
    let pe = own_registration;
    let conns: Vec<ConnId> = (0..3u32)
        .map(|i| {
            let c = r.accept(addr(8, 50_000 + i as u16), at(0)).unwrap();
            r.handle_data(c, &pe(i).to_bytes().unwrap(), at(u64::from(i) * 1_700));
            c
        })
        .collect();
    // PEs answer their keep-alives at once, but PE 0 not after `dead` (its host hangs) and
    // PE 1's association closes at `closed`.
    let (dead, closed) = (40_000, 47_000);
    let mut unanswered_since = None;
    let mut taken_over = None;
    let mut next_presence = 0;
    let mut t = 0;
    while t < 70_000 {
        if t >= next_presence && t < dead {
            r.handle_data(peer, &presence_of_peer(), at(t));
            next_presence += 2_444;
        }
        if taken_over.is_none() && r.status(at(t)).enrp.takeovers > 0 {
            taken_over = Some(t);
        }
        r.handle_timeout(at(t));
        actions(&mut r);
        for (i, &c) in conns.iter().enumerate() {
            if i == 1 && t >= closed {
                continue;
            }
            let out = r.output(c).to_vec();
            r.consume_output(c, out.len());
            let mut f = rserpool_wire::Framer::new(65_536);
            f.extend(&out);
            while let Ok(Some(m)) = f.next_message() {
                if let Ok(rserpool_wire::AsapMessage::EndpointKeepAlive { .. }) =
                    rserpool_wire::AsapMessage::decode(&m)
                {
                    if i == 0 && t >= dead {
                        unanswered_since.get_or_insert(t);
                        continue;
                    }
                    let ack = rserpool_wire::AsapMessage::EndpointKeepAliveAck {
                        pool_handle: PoolHandle::from("P"),
                        pe_id: 0x100 + i as u32,
                    };
                    r.handle_data(c, &ack.to_bytes().unwrap(), at(t));
                }
            }
        }
        if t == closed {
            r.handle_closed_by_peer(conns[1], at(t));
            assert!(
                homes(&r, |id| id == 0x101).is_empty(),
                "PE 1 removed when its association closed"
            );
        }
        if let Some(since) = unanswered_since
            && t == since + 5_000 + 100
        {
            assert!(
                homes(&r, |id| id == 0x100).is_empty(),
                "PE 0 still there 5.1 s after the keep-alive it left unanswered"
            );
        }
        t += 50;
    }
    assert!(
        unanswered_since.is_some(),
        "PE 0 was sent a keep-alive after it hung"
    );
    assert_eq!(r.status(at(t)).counters.kept_after_takeover, 0);
    // The peer, silent since `dead`: asked for a PRESENCE after MAX-TIME-LAST-HEARD (5 s),
    // taken over MAX-TIME-NO-RESPONSE later, within a heartbeat or two; the quieter network
    // its death leaves is no reason to wait.
    let e = r.status(at(t)).enrp;
    assert_eq!(
        e.takeovers_deferred, 0,
        "the takeover of the dead peer was put off"
    );
    assert!(
        taken_over.is_some_and(|at| at <= dead + 12_000),
        "the dead peer taken over at {taken_over:?} ms, it died at {dead} ms"
    );
}

/// An ENRP speaker that only looks at the handlespace (rsplib's hsdump) announces itself with
/// its loopback addresses first, then asks for the registrar list and the handle table. It is
/// answered over the association it asked on (before, the answers went to a connection of the
/// registrar's own towards ::1, and hsdump printed nothing), and it is known by the address it
/// spoke from, not by ::1 (which the registrar then could not reach, and took it over).
#[test]
fn a_request_is_answered_where_it_came_from() {
    const LOOKER: u32 = 0x0a00_0044;
    let mut r = with_a_peer_and_its_pe();
    let c = r.accept_enrp(addr(4, 50_123), at(100)).unwrap();
    let from_looker = |body: EnrpBody| {
        EnrpMessage {
            sender: LOOKER,
            receiver: 0,
            body,
        }
        .to_bytes()
        .unwrap()
    };
    let listed = [
        std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        std::net::IpAddr::from([127, 0, 0, 1]),
        std::net::IpAddr::from([10, 0, 0, 4]),
    ];
    let presence = EnrpBody::Presence {
        reply_required: false,
        checksum: None,
        server_info: Some(ServerInformation {
            server_id: LOOKER,
            transport: TransportAddress {
                protocol: rserpool_wire::Protocol::TCP,
                port: 50_123,
                addresses: listed.into_iter().collect(),
            },
        }),
    };
    r.handle_data(c, &from_looker(presence), at(110));
    r.handle_data(c, &from_looker(EnrpBody::ListRequest), at(120));
    r.handle_data(
        c,
        &from_looker(EnrpBody::HandleTableRequest {
            own_children_only: false,
        }),
        at(130),
    );
    let answers = enrp_out(&mut r, c);
    assert!(
        answers
            .iter()
            .any(|m| matches!(m.body, EnrpBody::ListResponse { reject: false, .. })),
        "no LIST_RESPONSE on the association asked: {answers:?}"
    );
    assert!(
        answers.iter().any(|m| matches!(
            &m.body,
            EnrpBody::HandleTableResponse { reject: false, pools, .. } if !pools.is_empty()
        )),
        "no HANDLE_TABLE_RESPONSE with the pool on the association asked: {answers:?}"
    );
    let looker = r
        .status(at(140))
        .peers
        .into_iter()
        .find(|p| p.id == LOOKER)
        .expect("the looker is known");
    assert_eq!(looker.address, "10.0.0.4:50123");
}

/// ASAP messages this registrar sent on connection `c`, decoded.
fn asap_out(r: &mut Registrar, c: ConnId) -> Vec<rserpool_wire::AsapMessage> {
    let mut framer = rserpool_wire::Framer::new(65_536);
    framer.extend(r.output(c));
    let n = r.output(c).len();
    r.consume_output(c, n);
    std::iter::from_fn(|| framer.next_message().ok().flatten())
        .filter_map(|f| rserpool_wire::AsapMessage::decode(&f).ok())
        .collect()
}

/// RFC 5355 §3.1: a registration of the identifier of a PE a peer is home for, with another
/// transport address, is another PE's, and is refused (cause 0x4). Found by an operator: any
/// host could register a PE's identifier at a registrar that is not its home, and took its
/// place in every registrar's handlespace. The PE itself, moving its home here, keeps its
/// transport and is taken.
#[test]
fn a_peers_pe_identifier_with_another_transport_is_refused() {
    let mut r = with_a_peer_and_its_pe();
    let registration = |at_addr: SocketAddr| {
        rserpool_wire::AsapMessage::Registration {
            pool_handle: PoolHandle::from("P"),
            pool_element: PoolElement {
                id: 0x77,
                home_registrar: 0,
                registration_life: 60,
                user_transport: UserTransport::Address(TransportAddress::tcp(at_addr)),
                policy: Policy::RoundRobin,
                asap_transport: None,
            },
        }
        .to_bytes()
        .unwrap()
    };
    let impostor = r.accept(addr(66, 50_000), at(100)).unwrap();
    r.handle_data(impostor, &registration(addr(66, 8000)), at(100));
    match &asap_out(&mut r, impostor)[..] {
        [
            rserpool_wire::AsapMessage::RegistrationResponse {
                reject: true,
                error: Some(e),
                ..
            },
        ] => assert_eq!(
            e.causes[0].code,
            rserpool_wire::CauseCode::NON_UNIQUE_PE_IDENTIFIER
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(homes(&r, |_| true), [PEER], "the peer's PE is untouched");
    let pe = r.accept(addr(9, 50_001), at(200)).unwrap();
    r.handle_data(pe, &registration(addr(9, 8000)), at(200));
    assert!(
        matches!(
            &asap_out(&mut r, pe)[..],
            [rserpool_wire::AsapMessage::RegistrationResponse { reject: false, .. }]
        ),
        "the PE moving its home here is taken"
    );
    assert_eq!(homes(&r, |_| true), [US]);
}

/// Registrars started together: the configured peer was not listening yet and refused this
/// registrar's connection; its PRESENCE then comes over its own connection to us. It is
/// answered over that connection, and the handle table is asked at once, over a new
/// connection of ours. Before, the request went
/// nowhere (no connection of ours to the peer) and the start waited for its timeout and the
/// next heartbeat (three registrars started at once took 7.5 s to synchronise, found by an
/// operator).
#[test]
fn a_mentor_that_was_not_listening_yet_is_asked_at_once_when_it_speaks() {
    let cfg = Config {
        peer: vec![addr(2, 9901).into()],
        mentor_discovery_ms: 5_000,
        ..Config::default()
    };
    let mut r = Registrar::new(cfg, US, at(0));
    r.enable_enrp(addr(1, 9901), at(0));
    // The connection to the configured peer is refused: it is not listening yet.
    for a in actions(&mut r) {
        if let Action::Connect(id, to) = a
            && to == addr(2, 9901)
        {
            r.handle_closed_by_peer(id, at(5));
        }
    }
    // It starts and speaks: its PRESENCE, asking for ours, over its own connection. Ours
    // goes back over that one at once (we have none to it).
    let theirs = r.accept_enrp(addr(2, 40_000), at(100)).unwrap();
    let asking = enrp(EnrpBody::Presence {
        reply_required: true,
        checksum: None,
        server_info: Some(ServerInformation {
            server_id: PEER,
            transport: TransportAddress::tcp(addr(2, 9901)),
        }),
    });
    r.handle_data(theirs, &asking, at(100));
    let answered = enrp_out(&mut r, theirs)
        .into_iter()
        .any(|m| matches!(m.body, EnrpBody::Presence { .. }));
    assert!(answered, "no PRESENCE back to a peer that started after us");
    let ours = actions(&mut r)
        .into_iter()
        .find_map(|a| match a {
            Action::Connect(id, to) if to == addr(2, 9901) => Some(id),
            _ => None,
        })
        .expect("a connection to the mentor at once");
    r.handle_connected(ours, at(101));
    let asked = enrp_out(&mut r, ours)
        .into_iter()
        .any(|m| matches!(m.body, EnrpBody::HandleTableRequest { .. }));
    assert!(asked, "the handle table is asked over it");
}
