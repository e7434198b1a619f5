//! The pool element's takeover races against scripted registrars (plain sockets speaking ASAP):
//! a takeover that arrives while the PE registers elsewhere, a second takeover while the first
//! new home is up, and a new home that dies too. After each, the PE must serve the last new home like a home association.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_asap::{AsapConnection, PeState, PoolElement, PoolElementConfig};
use rserpool_wire::{AsapMessage, Policy, PoolHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

const POOL: &str = "RacePool";
const WAIT: Duration = Duration::from_secs(5);

/// A registrar played by the test: it accepts ASAP connections from the PE.
struct Fake {
    listener: TcpListener,
}

impl Fake {
    async fn new() -> Self {
        Self {
            listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        }
    }

    fn addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }

    async fn accept(&self) -> AsapConnection {
        let (s, peer) = tokio::time::timeout(WAIT, self.listener.accept())
            .await
            .expect("the PE connects")
            .unwrap();
        AsapConnection::from_stream(s, peer)
    }
}

async fn recv(conn: &mut AsapConnection) -> AsapMessage {
    tokio::time::timeout(WAIT, conn.recv())
        .await
        .expect("a message in time")
        .expect("a message")
}

/// Reads a REGISTRATION; returns the PE's policy and takeover address.
async fn registration(conn: &mut AsapConnection) -> (Policy, SocketAddr) {
    match recv(conn).await {
        AsapMessage::Registration { pool_element, .. } => {
            let t = pool_element.asap_transport.expect("a takeover address");
            (pool_element.policy, t.socket_addrs().next().unwrap())
        }
        other => panic!("expected REGISTRATION, got {}", other.name()),
    }
}

async fn accept_registration(conn: &mut AsapConnection, id: u32) {
    let msg = AsapMessage::RegistrationResponse {
        reject: false,
        pool_handle: PoolHandle::from(POOL),
        pe_id: id,
        error: None,
    };
    conn.send(&msg).await.unwrap();
}

fn keep_alive(server_id: u32, home: bool, id: u32) -> AsapMessage {
    AsapMessage::EndpointKeepAlive {
        home,
        server_id,
        pool_handle: PoolHandle::from(POOL),
        pe_id: Some(id),
    }
}

async fn expect_ack(conn: &mut AsapConnection, id: u32) {
    match recv(conn).await {
        AsapMessage::EndpointKeepAliveAck { pe_id, .. } => assert_eq!(pe_id, id),
        other => panic!("expected ENDPOINT_KEEP_ALIVE_ACK, got {}", other.name()),
    }
}

/// Registrar `server_id` takes the PE over at `at`, as after a takeover (RFC 5353 §3.5).
async fn take_over(at: SocketAddr, server_id: u32, id: u32) -> AsapConnection {
    let mut conn = AsapConnection::connect(at, WAIT).await.unwrap();
    conn.send(&keep_alive(server_id, true, id)).await.unwrap();
    expect_ack(&mut conn, id).await;
    conn
}

/// The PE answers a keep-alive over `conn` with nothing sent before the answer.
async fn answers_keep_alive(conn: &mut AsapConnection, server_id: u32, id: u32) {
    conn.send(&keep_alive(server_id, false, id)).await.unwrap();
    expect_ack(conn, id).await;
}

/// The connection is closed by the PE.
async fn closed(conn: &mut AsapConnection) {
    let r = tokio::time::timeout(WAIT, async {
        loop {
            if conn.recv().await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(r.is_ok(), "the PE closes the connection");
}

async fn home_is(pe: &PoolElement, home: u32) {
    let mut st = pe.watch_state();
    let r = tokio::time::timeout(
        WAIT,
        st.wait_for(|s| matches!(s, PeState::Registered { home: h, .. } if *h == home)),
    )
    .await;
    assert!(r.is_ok(), "home {home:#x}, but the PE is {:?}", pe.state());
}

/// A PE that knows only `registrar`, registered there; returns it, that association and the
/// PE's takeover address.
async fn registered_pe(registrar: &Fake) -> (PoolElement, AsapConnection, SocketAddr) {
    let mut cfg = PoolElementConfig::new(
        POOL,
        SocketAddr::from(([127, 0, 0, 1], 9)),
        Policy::LeastUsed { load: 0 },
    );
    cfg.registrars = vec![registrar.addr()];
    cfg.takeover_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.backoff_min = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(100);
    cfg.response_timeout = Duration::from_secs(10);
    let pe = PoolElement::start(cfg).unwrap();
    let mut conn = registrar.accept().await;
    let (_, at) = registration(&mut conn).await;
    accept_registration(&mut conn, pe.id()).await;
    pe.wait_registered(WAIT).await.unwrap();
    (pe, conn, at)
}

#[tokio::test]
async fn a_takeover_during_a_registration_elsewhere_wins_and_is_registered_over() {
    let x = Fake::new().await;
    let (pe, first, at) = registered_pe(&x).await;
    let id = pe.id();
    // The home dies; the PE registers again (the only registrar it knows is back).
    drop(first);
    let mut again = x.accept().await;
    registration(&mut again).await;
    // Before an answer, another registrar takes over the old home's PEs.
    let mut t = take_over(at, 0x7001, id).await;
    home_is(&pe, 0x7001).await;
    // The registration in flight is abandoned; the new home gets one, since the registrar
    // registered with might have told its peers that it is home.
    closed(&mut again).await;
    let (policy, _) = registration(&mut t).await;
    assert_eq!(policy, Policy::LeastUsed { load: 0 });
    accept_registration(&mut t, id).await;
    answers_keep_alive(&mut t, 0x7001, id).await;
    // Load updates and the deregistration go to the new home.
    pe.update_load(0.5);
    let (policy, _) = registration(&mut t).await;
    assert_ne!(policy, Policy::LeastUsed { load: 0 });
    accept_registration(&mut t, id).await;
    let stop = tokio::spawn(pe.stop());
    match recv(&mut t).await {
        AsapMessage::Deregistration { pe_id, .. } => assert_eq!(pe_id, id),
        other => panic!("expected DEREGISTRATION, got {}", other.name()),
    }
    let msg = AsapMessage::DeregistrationResponse {
        pool_handle: PoolHandle::from(POOL),
        pe_id: id,
        error: None,
    };
    t.send(&msg).await.unwrap();
    tokio::time::timeout(WAIT, stop).await.unwrap().unwrap();
}

/// A PE whose home (`registrar`) died and that registrar 0x7001 took over; returns it, the new
/// home's association and the PE's takeover address.
async fn taken_over_pe(registrar: &Fake) -> (PoolElement, AsapConnection, SocketAddr) {
    let (pe, first, at) = registered_pe(registrar).await;
    drop(first);
    let mut t1 = take_over(at, 0x7001, pe.id()).await;
    home_is(&pe, 0x7001).await;
    answers_keep_alive(&mut t1, 0x7001, pe.id()).await;
    (pe, t1, at)
}

/// A second takeover while the first new home is up is a claim the PE checks with that home
/// (docs/SECURITY.md): refused while the home answers, adopted once the home is gone.
#[tokio::test]
async fn a_second_takeover_wins_only_when_the_first_new_home_is_gone() {
    let x = Fake::new().await;
    let (pe, mut t1, at) = taken_over_pe(&x).await;
    let id = pe.id();
    let mut t2 = AsapConnection::connect(at, WAIT).await.unwrap();
    t2.send(&keep_alive(0x7002, true, id)).await.unwrap();
    expect_ack(&mut t2, id).await;
    // The home is asked, answers, and keeps the PE.
    registration(&mut t1).await;
    accept_registration(&mut t1, id).await;
    closed(&mut t2).await;
    home_is(&pe, 0x7001).await;
    answers_keep_alive(&mut t1, 0x7001, id).await;
    // Another claim; this time the home dies while it is asked.
    let mut t3 = take_over(at, 0x7003, id).await;
    registration(&mut t1).await;
    drop(t1);
    home_is(&pe, 0x7003).await;
    answers_keep_alive(&mut t3, 0x7003, id).await;
}

#[tokio::test]
async fn a_new_home_that_dies_is_followed_by_the_next_takeover() {
    let x = Fake::new().await;
    let (pe, t1, at) = taken_over_pe(&x).await;
    let id = pe.id();
    // The new home dies too, and so is the registrar the PE knows: it hunts until the next
    // takeover.
    drop(t1);
    drop(x);
    let mut t2 = take_over(at, 0x7002, id).await;
    home_is(&pe, 0x7002).await;
    answers_keep_alive(&mut t2, 0x7002, id).await;
}
