//! The registrar's status listener inside its event loop: HTTP on an address of its own
//! (`status`, apart from the ASAP port), answered from the core between two events, so a
//! status is always one consistent moment of the handlespace. The HTTP is `rserpool_status`'s;
//! this file only carries its bytes over mio.
//!
//! Status connections are few and short: at most [`MAX_CONNS`] at a time (more are closed at
//! once); each gets [`IO_TIMEOUT`] to send its request and for each part of the answer it takes,
//! then [`LINGER`] to close its side before this one does. The dashboard's event stream
//! (`/events`) stays open: every [`EVENT_INTERVAL`] the loop [`tick`](StatusListener::tick)s
//! and each stream gets the status, one serialisation for all; a stream that has not taken
//! the previous one within [`IO_TIMEOUT`] is closed.

use crate::config::Config;
use crate::core::Instant;
use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Registry, Token};
use rserpool_status::{EVENT_INTERVAL, IO_TIMEOUT, LINGER, MAX_CONNS, Parse, Reply};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use tracing::warn;

/// The paths served: the status document (JSON), the dashboard, its event stream and the
/// metrics (Prometheus).
const PATHS: &[&str] = &["/status", "/", "/events", "/metrics"];
/// The listener's token; its connections use the tokens just below it.
pub(super) const LISTENER: Token = Token(usize::MAX - 16);

pub(super) struct StatusListener {
    listener: TcpListener,
    local: SocketAddr,
    conns: Vec<Option<Conn>>,
}

struct Conn {
    stream: TcpStream,
    head: Vec<u8>,
    /// The answer, once the request is in.
    reply: Vec<u8>,
    written: usize,
    /// The answer is out and our side shut: reading what the client still sends until it closes.
    lingering: bool,
    /// An event stream: after its head, an event every [`EVENT_INTERVAL`] from [`StatusListener::tick`].
    events: Option<Instant>,
    /// Reading the request, each write's progress and the linger each have this long.
    deadline: Instant,
}

impl StatusListener {
    /// Binds the configured address. When the default address is taken (another registrar on
    /// this host has it), the registrar runs without a status listener; a configured one must
    /// bind.
    pub(super) fn bind(cfg: &Config, registry: &Registry) -> io::Result<Option<Self>> {
        let Some(addr) = cfg.status.addr() else {
            return Ok(None);
        };
        let listener = match TcpListener::bind(addr) {
            Ok(l) => l,
            Err(e) if cfg.status.is_default() && e.kind() == io::ErrorKind::AddrInUse => {
                warn!(
                    "status address {addr} in use (another registrar?): running without a \
                     status listener; give this one --status ADDR"
                );
                return Ok(None);
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot listen for status on {addr}: {e}"),
                ));
            }
        };
        Self::serve_on(listener, registry).map(Some)
    }

    /// Serves on a listener already bound (handed over by a predecessor).
    pub(super) fn serve_on(mut listener: TcpListener, registry: &Registry) -> io::Result<Self> {
        let local = listener.local_addr()?;
        registry.register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(Self {
            listener,
            local,
            conns: Vec::new(),
        })
    }

    /// The listening socket, for a hand-over.
    pub(super) fn listener_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.listener)
    }

    pub(super) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The token of one of this listener's connections, by its slot.
    fn token(slot: usize) -> Token {
        Token(LISTENER.0 - 1 - slot)
    }

    /// The slot of a token that belongs to this listener's connections.
    pub(super) fn slot(token: Token) -> Option<usize> {
        let slot = LISTENER.0.checked_sub(token.0)?.checked_sub(1)?;
        (slot < MAX_CONNS).then_some(slot)
    }

    pub(super) fn accept(&mut self, registry: &Registry, now: Instant) {
        loop {
            let mut stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // WouldBlock, or out of descriptors: the ASAP side logs that.
                Err(_) => return,
            };
            let slot = match self.free_slot() {
                Some(slot) => Some(slot),
                None => {
                    self.expire(now, registry);
                    self.free_slot()
                }
            };
            let Some(slot) = slot else {
                continue; // Too many at once: dropping closes it.
            };
            let interest = Interest::READABLE | Interest::WRITABLE;
            if registry
                .register(&mut stream, Self::token(slot), interest)
                .is_err()
            {
                continue;
            }
            self.conns[slot] = Some(Conn {
                stream,
                head: Vec::new(),
                reply: Vec::new(),
                written: 0,
                lingering: false,
                events: None,
                deadline: now + IO_TIMEOUT,
            });
        }
    }

    fn free_slot(&mut self) -> Option<usize> {
        if let Some(i) = self.conns.iter().position(Option::is_none) {
            return Some(i);
        }
        (self.conns.len() < MAX_CONNS).then(|| {
            self.conns.push(None);
            self.conns.len() - 1
        })
    }

    /// Reads and answers on a connection; `status` makes the reply for a path served.
    pub(super) fn on_event(
        &mut self,
        slot: usize,
        registry: &Registry,
        buf: &mut [u8],
        now: Instant,
        status: impl FnOnce(&str) -> Reply,
    ) {
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if conn.lingering || conn.events.is_some() {
            // A stream's client sends nothing more; reading finds its close.
            self.linger(slot, registry, buf);
            self.flush(slot, registry, now);
            return;
        }
        while conn.reply.is_empty() {
            let n = match conn.stream.read(buf) {
                Ok(0) => return self.close(slot, registry),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return self.close(slot, registry),
            };
            conn.head.extend_from_slice(&buf[..n]);
            conn.reply = match rserpool_status::parse_request(&conn.head) {
                Parse::Incomplete => continue,
                Parse::Complete(req) if rserpool_status::is_event_stream(&req, PATHS) => {
                    conn.events = Some(now);
                    rserpool_status::event_stream_head()
                }
                Parse::Complete(req) => rserpool_status::respond(&req, PATHS, status),
                Parse::Invalid(reply) => reply,
            };
            conn.head = Vec::new();
            conn.deadline = now + IO_TIMEOUT;
            break;
        }
        if !self.flush(slot, registry, now) {
            return;
        }
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if conn.events.is_some() {
            return;
        }
        // Answered: shut our side and read off whatever the client still sends, so that the
        // close does not reset the connection under the answer.
        let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        conn.reply = Vec::new();
        conn.lingering = true;
        conn.deadline = now + LINGER;
        self.linger(slot, registry, buf);
    }

    /// Writes what is pending on a connection: true when all of it is out.
    fn flush(&mut self, slot: usize, registry: &Registry, now: Instant) -> bool {
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        while conn.written < conn.reply.len() {
            match conn.stream.write(&conn.reply[conn.written..]) {
                Ok(n) => {
                    conn.written += n;
                    conn.deadline = now + IO_TIMEOUT;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => {
                    self.close(slot, registry);
                    return false;
                }
            }
        }
        if conn.events.is_some() {
            conn.reply.clear();
            conn.written = 0;
        }
        true
    }

    /// When the next event is due on a stream, if any stream is open.
    pub(super) fn next_event(&self) -> Option<Instant> {
        self.conns.iter().flatten().filter_map(|c| c.events).min()
    }

    /// Sends the streams whose event is due the status `make` gives (made once, if at all).
    pub(super) fn tick(
        &mut self,
        registry: &Registry,
        now: Instant,
        make: impl FnOnce() -> Vec<u8>,
    ) {
        let mut event: Option<Vec<u8>> = None;
        let mut make = Some(make);
        for slot in 0..self.conns.len() {
            let Some(conn) = self.conns[slot].as_mut() else {
                continue;
            };
            // A stream still writing the previous event skips this one (and is closed by
            // `expire` when it makes no progress).
            if conn.events.is_none_or(|at| at > now) || !conn.reply.is_empty() {
                continue;
            }
            let ev = event.get_or_insert_with(|| {
                rserpool_status::event(&make.take().map(|m| m()).unwrap_or_default())
            });
            conn.reply.extend_from_slice(ev);
            conn.written = 0;
            conn.events = Some(now + EVENT_INTERVAL);
            conn.deadline = now + IO_TIMEOUT;
            self.flush(slot, registry, now);
        }
    }

    /// Reads and drops what a lingering connection sends; closes it at its end.
    fn linger(&mut self, slot: usize, registry: &Registry, buf: &mut [u8]) {
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        loop {
            match conn.stream.read(buf) {
                Ok(0) => return self.close(slot, registry),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return self.close(slot, registry),
            }
        }
    }

    /// Closes the connections whose time is up (a stream's only while it has bytes pending).
    pub(super) fn expire(&mut self, now: Instant, registry: &Registry) {
        for slot in 0..self.conns.len() {
            let due =
                |c: &Conn| c.deadline <= now && (c.events.is_none() || c.written < c.reply.len());
            if self.conns[slot].as_ref().is_some_and(due) {
                self.close(slot, registry);
            }
        }
    }

    pub(super) fn has_conns(&self) -> bool {
        self.conns.iter().any(Option::is_some)
    }

    fn close(&mut self, slot: usize, registry: &Registry) {
        if let Some(mut conn) = self.conns.get_mut(slot).and_then(Option::take) {
            let _ = registry.deregister(&mut conn.stream);
        }
    }
}
