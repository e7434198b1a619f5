//! The tokio host (`rserpool_sctp::host::Host`) over SCTP in UDP on loopback: an association
//! opened by a host whose socket is new comes up at once.
#![cfg(feature = "tokio")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_sctp::host::{Carrier, Host};
use std::time::{Duration, Instant};

/// The first INIT of a fresh host goes out at once. It was dropped while the socket was new to
/// the reactor (no write readiness yet) and went out with the retransmission timer, after 1 s
/// (RTO.Initial): every first registration over SCTP took a second.
#[tokio::test]
async fn a_fresh_host_associates_without_waiting_for_a_retransmission() {
    let server = Host::start(Carrier::Udp, "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut accepted = server.listen(3863).unwrap();
    let client = Host::start(Carrier::Udp, "127.0.0.1:0".parse().unwrap()).unwrap();
    let t0 = Instant::now();
    let a = client
        .connect_ephemeral(server.local_addr(), 3863)
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(900),
        "the association took {took:?}: its first INIT waited for the retransmission timer"
    );
    let b = accepted.recv().await.unwrap();
    drop((a, b));
}
