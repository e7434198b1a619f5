//! The exchange between two ends over a real Unix socket: sockets and state arrive, the old
//! end learns when to stop, and a new end that gives up leaves the old one serving.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] functions

use rserpool_handover::{Address, Offer, borrow, take, tcp_listener};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

fn unique(tag: &str) -> Address {
    format!("@rserpool-handover-test-{tag}-{}", std::process::id())
        .parse()
        .unwrap()
}

/// Waits for an asker on a non-blocking offer.
fn asker(offer: &Offer) -> rserpool_handover::Asker {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(a) = offer.accept().unwrap() {
            return a;
        }
        assert!(Instant::now() < deadline, "nobody asked");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn nobody_offers() {
    assert!(take(&unique("none")).unwrap().is_none());
    let dir = std::env::temp_dir().join(format!("handover-none-{}", std::process::id()));
    assert!(take(&Address::Path(dir)).unwrap().is_none());
}

#[test]
fn listeners_and_state_reach_the_new_process_and_keep_their_queue() {
    let addr = unique("give");
    let offer = Offer::bind(&addr).unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l2 = TcpListener::bind("127.0.0.1:0").unwrap();
    let (a1, a2) = (l1.local_addr().unwrap(), l2.local_addr().unwrap());
    // A client queued on the old socket before the hand-over is served by the new process.
    let mut queued = TcpStream::connect(a1).unwrap();
    queued.write_all(b"hello").unwrap();
    let old = std::thread::spawn(move || {
        let giving = asker(&offer)
            .give(b"the state", &borrow(&[&l1, &l2]))
            .unwrap();
        giving.wait_ready(Duration::from_secs(10)).unwrap();
        drop((l1, l2));
        giving.done().unwrap();
    });
    let mut taken = take(&addr).unwrap().expect("an offer");
    assert_eq!(taken.state, b"the state");
    assert_eq!(taken.pid, std::process::id());
    let mut fds = std::mem::take(&mut taken.fds).into_iter();
    let n1 = tcp_listener(fds.next().unwrap(), "one").unwrap();
    let n2 = tcp_listener(fds.next().unwrap(), "two").unwrap();
    assert_eq!(
        (n1.local_addr().unwrap(), n2.local_addr().unwrap()),
        (a1, a2)
    );
    let (mut s, _) = n1.accept().unwrap();
    let mut got = [0u8; 5];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");
    drop(queued);
    taken.ready(Duration::from_secs(10)).unwrap();
    old.join().unwrap();
}

#[test]
fn a_new_process_that_gives_up_leaves_the_old_one_serving() {
    let addr = unique("quit");
    let offer = Offer::bind(&addr).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let old = std::thread::spawn(move || {
        let giving = asker(&offer).give(b"", &borrow(&[&l])).unwrap();
        let r = giving.wait_ready(Duration::from_secs(10));
        (r.is_err(), l, offer)
    });
    let taken = take(&addr).unwrap().expect("an offer");
    drop(taken);
    let (failed, l, offer) = old.join().unwrap();
    assert!(failed, "the old process must learn that nobody took over");
    // It still listens, and offers again.
    TcpStream::connect(l.local_addr().unwrap()).unwrap();
    assert!(offer.accept().unwrap().is_none());
}

#[test]
fn a_path_offer_is_private_and_replaces_a_stale_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("handover-path-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("proxy.sock");
    let addr = Address::Path(path.clone());
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists(), "a stale socket file is left behind");
    let offer = Offer::bind(&addr).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A second live offer on the same name is refused.
    assert!(Offer::bind(&addr).is_err());
    drop(offer);
    assert!(!path.exists());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn not_a_listener_is_refused() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    assert!(tcp_listener(OwnedFd::from(c), "a stream").is_err());
}

#[test]
fn more_sockets_than_one_message_carries() {
    let addr = unique("many");
    let offer = Offer::bind(&addr).unwrap();
    let ls: Vec<TcpListener> = (0..600)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let want: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let old = std::thread::spawn(move || {
        let giving = asker(&offer).give(b"x", &borrow(&ls)).unwrap();
        giving.wait_ready(Duration::from_secs(10)).unwrap();
        giving.done().unwrap();
    });
    let mut taken = take(&addr).unwrap().expect("an offer");
    let got: Vec<_> = std::mem::take(&mut taken.fds)
        .into_iter()
        .map(|fd| tcp_listener(fd, "l").unwrap().local_addr().unwrap())
        .collect();
    assert_eq!(got, want);
    taken.ready(Duration::from_secs(10)).unwrap();
    old.join().unwrap();
}
