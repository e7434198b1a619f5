//! The host on a thread of its own (`rserpool_sctp::host::Bridge`), as an event loop that is
//! not tokio's drives it: two bridges over SCTP in UDP on loopback, an association accepted
//! and one opened, messages both ways (one sent before the association is up), a graceful
//! shutdown and an abort, each end reported once. The registrar runs the kernel's SCTP
//! through this; here it carries the user-space stack, which every machine has.
#![cfg(feature = "tokio")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use rserpool_sctp::StackEvent;
use rserpool_sctp::host::{Bridge, Carrier};
use std::sync::mpsc;
use std::time::Duration;

fn bridge() -> (Bridge, mpsc::Receiver<()>) {
    let (tx, rx) = mpsc::channel();
    let b = Bridge::start(Carrier::Udp, "127.0.0.1:0".parse().unwrap(), move || {
        let _ = tx.send(());
    })
    .unwrap();
    (b, rx)
}

/// The next event of `b`, waiting for its wake-ups.
fn next(b: &Bridge, woken: &mpsc::Receiver<()>) -> StackEvent {
    loop {
        if let Some(e) = b.poll_event() {
            return e;
        }
        woken
            .recv_timeout(Duration::from_secs(10))
            .expect("an event in time");
    }
}

#[test]
fn a_bridge_carries_associations_both_ways_and_reports_their_ends() {
    let (a, a_woken) = bridge();
    let (b, b_woken) = bridge();
    a.listen(5000);
    // The listener is set up on a's thread a moment later: an INIT before it is answered
    // with an ABORT, and the attempt is made again.
    let mut tries = 0;
    let id = loop {
        tries += 1;
        let id = b.connect(a.local_addr(), 6000, 5000);
        b.send(id, 0, 11, Bytes::from_static(b"before it is up"));
        match next(&b, &b_woken) {
            StackEvent::Connected(i) if i == id => break id,
            StackEvent::Closed(i, Some(_)) if i == id && tries < 50 => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => panic!("{other:?}"),
        }
    };
    let StackEvent::Accepted {
        id: aid,
        local_port,
        peer_port,
        ..
    } = next(&a, &a_woken)
    else {
        panic!("not accepted first");
    };
    assert_eq!((local_port, peer_port), (5000, 6000));
    match next(&a, &a_woken) {
        StackEvent::Message(i, m) => {
            assert_eq!(i, aid);
            assert_eq!((m.stream, m.ppid), (0, 11));
            assert_eq!(m.data, Bytes::from_static(b"before it is up"));
        }
        other => panic!("{other:?}"),
    }
    a.send(aid, 1, 12, Bytes::from_static(b"back"));
    match next(&b, &b_woken) {
        StackEvent::Message(i, m) => {
            assert_eq!(i, id);
            assert_eq!((m.stream, m.ppid), (1, 12));
            assert_eq!(m.data, Bytes::from_static(b"back"));
        }
        other => panic!("{other:?}"),
    }
    b.shutdown(id);
    assert_eq!(next(&a, &a_woken), StackEvent::Closed(aid, None));
    assert_eq!(next(&b, &b_woken), StackEvent::Closed(id, None));

    // An abort from the listening side ends the other's too.
    let id2 = b.connect(a.local_addr(), 6001, 5000);
    let StackEvent::Accepted { id: aid2, .. } = next(&a, &a_woken) else {
        panic!("not accepted");
    };
    assert_eq!(next(&b, &b_woken), StackEvent::Connected(id2));
    a.abort(aid2);
    assert!(matches!(next(&a, &a_woken), StackEvent::Closed(i, Some(_)) if i == aid2));
    assert!(matches!(next(&b, &b_woken), StackEvent::Closed(i, None) if i == id2));

    // Nobody at the port: the attempt ends, reported.
    let id3 = b.connect(a.local_addr(), 6002, 5999);
    assert!(matches!(next(&b, &b_woken), StackEvent::Closed(i, Some(_)) if i == id3));
    assert!(a.poll_event().is_none());
}
