//! The proxy's listening sockets: bound here or handed over by the process before, put on the
//! reactor, and tuned so that what every accepted connection needs is set once, on the
//! listener, instead of once per connection.
//!
//! - `TCP_NODELAY` on a listener is copied by Linux into every socket it accepts: one
//!   `setsockopt` per listener instead of per connection.
//! - `TCP_DEFER_ACCEPT` (`defer-accept`, by default on HTTP listeners, where the client
//!   speaks first) makes the kernel hand a connection over only once its first bytes are
//!   there, so the first read finds the request: no read that would block, no registration
//!   with the reactor (an `epoll_ctl` to add and one to delete) and no wake-up for it. A
//!   client that connects and sends nothing is handed over after a second all the same (when
//!   it answers the kernel's retransmitted SYN-ACK; later if that is lost), and the proxy's
//!   timeouts run from then.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio::io::unix::AsyncFd;

/// How long the kernel holds a connection that has sent nothing before handing it over.
pub(crate) const DEFER_ACCEPT_SECS: libc::c_int = 1;

/// A listener on the reactor and what its accepted connections inherit.
pub(crate) struct Listening {
    pub(crate) sock: AsyncFd<TcpListener>,
    /// Accepted connections come with `TCP_NODELAY` set.
    pub(crate) nodelay: bool,
    /// Connections are handed over once their first bytes are there (`TCP_DEFER_ACCEPT`);
    /// a reload may change it.
    pub(crate) deferred: Arc<AtomicBool>,
}

/// Binds `addr`, or takes `taken` (a socket handed over), and tunes it.
pub(crate) fn open(
    addr: SocketAddr,
    taken: Option<TcpListener>,
    defer_accept: bool,
) -> std::io::Result<Listening> {
    let sock = match taken {
        Some(t) => t,
        None => bind(addr)?,
    };
    sock.set_nonblocking(true)?;
    // Failing either costs speed, not correctness: without the first, every connection sets
    // it; without the second, the first read may wait.
    let nodelay = socket2::SockRef::from(&sock).set_nodelay(true).is_ok();
    let deferred = Arc::new(AtomicBool::new(defer(&sock, addr, defer_accept)));
    Ok(Listening {
        sock: register(sock)?,
        nodelay,
        deferred,
    })
}

/// Turns `TCP_DEFER_ACCEPT` on or off on a listening socket (its own, or one shared with the
/// process it was handed over to); whether connections are now deferred.
pub(crate) fn defer(sock: &TcpListener, addr: SocketAddr, on: bool) -> bool {
    let secs = if on { DEFER_ACCEPT_SECS } else { 0 };
    match rserpool_ksplice::set_tcp_option(sock, libc::TCP_DEFER_ACCEPT, secs) {
        Ok(()) => on,
        Err(e) => {
            tracing::debug!("proxy: listener {addr}: TCP_DEFER_ACCEPT: {e}");
            false
        }
    }
}

/// A listening socket bound to `addr`, not yet on the reactor.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(4096)?;
    Ok(sock.into())
}

/// How long a proxy starting afresh waits for an address still held, before it gives up: a
/// proxy restarted at once finds its addresses held by the one stopping, which closes them
/// once it has left its tier (at most `TIER_LEAVE_LIMIT`, usually a fraction of a second).
pub(crate) const ADDRESS_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// `bind()`, tried again while `addr` is in use, for up to `patience`; says once that it waits.
pub(crate) async fn when_free<T>(
    addr: SocketAddr,
    patience: std::time::Duration,
    mut bind: impl FnMut() -> std::io::Result<T>,
) -> std::io::Result<T> {
    let start = tokio::time::Instant::now();
    let mut said = false;
    loop {
        match bind() {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && start.elapsed() < patience => {
                if !said {
                    tracing::warn!(
                        "proxy: {addr} is in use (by a proxy still stopping?); trying again for \
                         up to {patience:?}"
                    );
                    said = true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Ok(b) if said => {
                tracing::info!("proxy: {addr} free after {:?}", start.elapsed());
                return Ok(b);
            }
            r => return r,
        }
    }
}

/// A listening socket on the reactor.
fn register(sock: TcpListener) -> std::io::Result<AsyncFd<TcpListener>> {
    // tokio offers readiness for a plain fd only through `AsyncFd`, and registering one is
    // `unsafe` since tokio 1.53.
    #[allow(unsafe_code)]
    // SAFETY: the AsyncFd owns the listener, whose fd stays open and the same until the
    // AsyncFd is dropped.
    let fd = unsafe { AsyncFd::register_with_interest(sock, tokio::io::Interest::READABLE) };
    fd.map_err(std::io::Error::from)
}

/// Accepts a connection without registering it with the reactor (an HTTP client's stream
/// registers itself once it has to wait): one `accept4`, already non-blocking.
pub(crate) fn accept(l: &TcpListener) -> std::io::Result<(TcpStream, SocketAddr)> {
    use rustix::net::{SocketFlags, acceptfrom_with};
    let (fd, peer) = acceptfrom_with(l, SocketFlags::NONBLOCK | SocketFlags::CLOEXEC)?;
    let peer = peer
        .and_then(|p| SocketAddr::try_from(p).ok())
        .ok_or_else(|| std::io::Error::other("accepted a connection without a peer address"))?;
    Ok((fd.into(), peer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    fn accept_within(l: &TcpListener, d: Duration) -> Option<TcpStream> {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if let Ok((s, _)) = accept(l) {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    #[tokio::test]
    async fn accepted_connections_inherit_nodelay_and_wait_for_their_first_bytes() {
        let l = open("127.0.0.1:0".parse().unwrap(), None, true).unwrap();
        assert!(l.nodelay && l.deferred.load(std::sync::atomic::Ordering::Relaxed));
        let addr = l.sock.get_ref().local_addr().unwrap();
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        // Connected, nothing sent: not handed over yet.
        assert!(accept_within(l.sock.get_ref(), Duration::from_millis(300)).is_none());
        c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let s = accept_within(l.sock.get_ref(), Duration::from_secs(5)).expect("accepted");
        assert!(s.nodelay().unwrap(), "TCP_NODELAY comes from the listener");
        let mut buf = [0u8; 64];
        let n = (&s).read(&mut buf).expect("the request is there at once");
        assert_eq!(&buf[..n], b"GET / HTTP/1.1\r\n\r\n");
    }

    #[tokio::test]
    async fn a_bind_waits_for_an_address_held_a_while_and_no_longer() {
        let held = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = held.local_addr().unwrap();
        let refused = when_free(addr, Duration::ZERO, || bind(addr)).await;
        assert_eq!(
            refused.err().map(|e| e.kind()),
            Some(std::io::ErrorKind::AddrInUse)
        );
        let t = Instant::now();
        let patient = tokio::spawn(when_free(addr, Duration::from_secs(5), move || bind(addr)));
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(held);
        let bound = patient
            .await
            .unwrap()
            .expect("bound once the address was free");
        assert_eq!(bound.local_addr().unwrap(), addr);
        assert!(t.elapsed() >= Duration::from_millis(200));
        let t = Instant::now();
        let gave_up = when_free(addr, Duration::from_millis(300), || bind(addr)).await;
        assert!(gave_up.is_err() && t.elapsed() >= Duration::from_millis(300));
    }

    #[tokio::test]
    async fn a_silent_client_is_handed_over_after_the_deferral() {
        let l = open("127.0.0.1:0".parse().unwrap(), None, true).unwrap();
        let addr = l.sock.get_ref().local_addr().unwrap();
        let _c = std::net::TcpStream::connect(addr).unwrap();
        let t = Instant::now();
        let s = accept_within(l.sock.get_ref(), Duration::from_secs(10));
        assert!(s.is_some(), "a client that sends nothing is still accepted");
        assert!(
            t.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn without_deferral_a_connection_is_accepted_at_once() {
        let l = open("127.0.0.1:0".parse().unwrap(), None, false).unwrap();
        let addr = l.sock.get_ref().local_addr().unwrap();
        let _c = std::net::TcpStream::connect(addr).unwrap();
        assert!(accept_within(l.sock.get_ref(), Duration::from_secs(5)).is_some());
    }
}
