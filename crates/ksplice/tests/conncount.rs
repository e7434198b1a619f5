//! The sock_ops connection counter (`bpf/conncount.c`) against real connections on loopback:
//! established ones counted whether accepted or not, closed and reset ones leave the count,
//! other ports' connections and those from before the port was watched are not in it.
//!
//! Needs root and a build with clang; without them the test is skipped, except under `CI`,
//! where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_ksplice::conncount::ConnCounter;
use rserpool_ksplice::testbed::datapath_test;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Waits (at most 5 s) until the port's count is `want`; returns the last count read.
fn count_becomes(c: &mut ConnCounter, addr: SocketAddr, want: i64) -> i64 {
    let t = Instant::now();
    loop {
        let n = c.read(addr).unwrap().established;
        if n == want || t.elapsed() > Duration::from_secs(5) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn connections_are_counted_as_they_come_and_go() {
    if datapath_test("the conncount test needs root (loading eBPF)").is_none() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let before = TcpStream::connect(addr).unwrap();
    let mut c = ConnCounter::attach().unwrap();
    c.watch(addr).unwrap();
    assert_eq!(c.read(addr).unwrap().established, 0, "from zero");

    let mut clients: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let _elsewhere: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(other.local_addr().unwrap()).unwrap())
        .collect();
    // Not accepted yet: in the accept queue, established all the same.
    assert_eq!(count_becomes(&mut c, addr, 5), 5);
    let mut accepted: Vec<TcpStream> = (0..5).map(|_| l.accept().unwrap().0).collect();
    // The connection from before the watch is accepted too: still 5.
    assert_eq!(c.read(addr).unwrap().established, 5);

    // A client closes: its server side leaves ESTABLISHED (CLOSE_WAIT).
    drop(clients.pop());
    assert_eq!(count_becomes(&mut c, addr, 4), 4);
    // The server closes one: FIN_WAIT1.
    drop(accepted.pop());
    assert_eq!(count_becomes(&mut c, addr, 3), 3);
    // A reset (linger 0) ends one too.
    let s = accepted.pop().unwrap();
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    assert_eq!(count_becomes(&mut c, addr, 2), 2);
    drop(before);
    let n = c.read(addr).unwrap();
    assert_eq!(
        n.established, 2,
        "the connection from before is not counted"
    );
    assert!(n.changes >= 8, "{} events", n.changes);
    drop(c);
}
