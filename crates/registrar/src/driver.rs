//! The tokio driver: sockets and the clock around the sans-IO [`Registrar`].
//!
//! One thread runs everything (a `LocalSet`): the core sits in a `RefCell`, each connection task
//! feeds its reads to the core and writes what the core queued for it, and one timer task runs
//! keep-alives and announces. A registrar is single-threaded by nature (one handlespace), and
//! this keeps the cost per message to a read, a core call and a write.
//!
//! The ASAP port also answers an HTTP `GET /status` with the handlespace as JSON (first bytes
//! `GET `, which no ASAP message can start with): that is what `rserpool status` reads.

use crate::config::Config;
use crate::core::{ConnId, Registrar};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Notify;
use tracing::{info, warn};

/// A peer that does not take our bytes within this time is disconnected.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time allowed for a status request to arrive in full.
const STATUS_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The read buffer shared by all connections.
const READ_BUF: usize = 64 * 1024;

/// A bound registrar, ready to [`run`](Server::run).
pub struct Server {
    listener: TcpListener,
    cfg: Config,
    id: u32,
    local: SocketAddr,
}

fn random_server_id() -> u32 {
    use rand_core::{OsRng, TryRngCore};
    loop {
        let id = OsRng.try_next_u32().unwrap_or_else(|_| {
            // No OS randomness: fall back to the clock; IDs only need to differ between peers.
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
                .unwrap_or(1)
        });
        if id != 0 {
            return id;
        }
    }
}

impl Server {
    /// Binds the ASAP listener.
    pub async fn bind(cfg: Config) -> io::Result<Self> {
        // Right after a restart the old connections may still hold the port for a moment
        // (FIN-WAIT): retry briefly before calling the address taken.
        let start = Instant::now();
        let listener = loop {
            match TcpListener::bind(cfg.asap).await {
                Ok(l) => break l,
                Err(e)
                    if e.kind() == io::ErrorKind::AddrInUse
                        && start.elapsed() < Duration::from_secs(1) =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("cannot listen for ASAP on {}: {e}", cfg.asap),
                    ));
                }
            }
        };
        let local = listener.local_addr()?;
        let id = if cfg.server_id != 0 {
            cfg.server_id
        } else {
            random_server_id()
        };
        Ok(Self {
            listener,
            cfg,
            id,
            local,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn server_id(&self) -> u32 {
        self.id
    }

    /// Serves until `shutdown` completes, then closes every connection.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> io::Result<()> {
        tokio::task::LocalSet::new()
            .run_until(self.serve(shutdown))
            .await
    }

    async fn serve(self, shutdown: impl Future<Output = ()>) -> io::Result<()> {
        let epoch = Instant::now();
        let mut core = Registrar::new(self.cfg.clone(), self.id, 0);
        let mut targets = self.cfg.announce.clone();
        if self.cfg.announce_multicast {
            targets.push(self.cfg.multicast_group);
        }
        let udp = if targets.is_empty() {
            None
        } else {
            let bind: SocketAddr = if self.local.is_ipv6() {
                "[::]:0".parse().map_err(io::Error::other)?
            } else {
                "0.0.0.0:0".parse().map_err(io::Error::other)?
            };
            let sock = UdpSocket::bind(bind).await?;
            if self.cfg.announce_multicast {
                sock.set_multicast_loop_v4(true).ok();
                sock.set_multicast_ttl_v4(8).ok();
            }
            core.enable_announce(self.local, 0);
            Some(sock)
        };
        let shared = Rc::new(Shared {
            core: RefCell::new(core),
            epoch,
            peers: RefCell::new(Vec::new()),
            timer_wake: Notify::new(),
            timer_deadline: Cell::new(0),
            dirty: RefCell::new(Vec::new()),
            read_buf: RefCell::new(vec![0; READ_BUF]),
        });
        info!(
            "registrar {:#010x} listening for ASAP on {} (status: GET http://{}/status)",
            self.id, self.local, self.local
        );
        if !targets.is_empty() {
            info!(
                "announcing every {} ms to {:?}",
                self.cfg.announce_interval_ms, targets
            );
        }
        let timer = tokio::task::spawn_local(timer_task(shared.clone(), udp, targets));
        tokio::pin!(shutdown);
        let mut accept_log_at: Option<Instant> = None;
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                r = self.listener.accept() => match r {
                    Ok((stream, peer)) => {
                        let now = shared.now();
                        let id = shared.core.borrow_mut().accept(peer, now);
                        if let Some(id) = id {
                            stream.set_nodelay(true).ok();
                            let peer = Rc::new(Peer { io: stream, writing: Cell::new(false) });
                            let mut peers = shared.peers.borrow_mut();
                            if peers.len() <= id.index() {
                                peers.resize(id.index() + 1, None);
                            }
                            peers[id.index()] = Some(peer.clone());
                            drop(peers);
                            tokio::task::spawn_local(conn_task(shared.clone(), id, peer));
                        }
                    }
                    Err(e) => {
                        // E.g. out of file descriptors: log once a second, retry shortly.
                        if accept_log_at.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                            warn!("accept failed: {e}");
                            accept_log_at = Some(Instant::now());
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
        info!("registrar {:#010x} shutting down", self.id);
        timer.abort();
        Ok(())
    }
}

struct Shared {
    core: RefCell<Registrar>,
    epoch: Instant,
    /// The open connections, indexed by [`ConnId::index`].
    peers: RefCell<Vec<Option<Rc<Peer>>>>,
    timer_wake: Notify,
    timer_deadline: Cell<u64>,
    dirty: RefCell<Vec<ConnId>>,
    read_buf: RefCell<Vec<u8>>,
}

/// One connection's socket. Output is written by whoever produced it (the connection's own
/// reads, the timer, another connection's message): no task wake-up per message. Only when the
/// socket will not take everything does a writer task wait for it.
struct Peer {
    io: TcpStream,
    /// A writer task is waiting for the socket to drain; it writes what the core queues.
    writing: Cell<bool>,
}

impl Peer {
    /// Stops both directions: the connection task then reads end-of-stream and cleans up.
    fn shut(&self) {
        let _ = socket2::SockRef::from(&self.io).shutdown(std::net::Shutdown::Both);
    }
}

impl Shared {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn peer(&self, id: ConnId) -> Option<Rc<Peer>> {
        self.peers.borrow().get(id.index()).cloned().flatten()
    }

    /// After a core call: write out what it queued, and wake the timer task if the next
    /// deadline moved earlier.
    fn after_core(self: &Rc<Self>) {
        let mut dirty = std::mem::take(&mut *self.dirty.borrow_mut());
        let next = {
            let mut core = self.core.borrow_mut();
            core.take_dirty(&mut dirty);
            core.poll_timeout()
        };
        for id in dirty.drain(..) {
            self.flush(id);
        }
        *self.dirty.borrow_mut() = dirty;
        if let Some(t) = next
            && t < self.timer_deadline.get()
        {
            self.timer_wake.notify_one();
        }
    }

    /// Writes a connection's queued output now, as far as the socket takes it.
    fn flush(self: &Rc<Self>, id: ConnId) {
        let Some(peer) = self.peer(id) else { return };
        if peer.writing.get() {
            return;
        }
        match self.write_some(id, &peer) {
            Ok(true) => {
                if self.core.borrow().wants_close(id) {
                    peer.shut();
                }
            }
            Ok(false) => {
                peer.writing.set(true);
                tokio::task::spawn_local(writer_task(self.clone(), id, peer));
            }
            Err(_) => peer.shut(),
        }
    }

    /// Writes the core's output for `id` until it is empty (`true`) or the socket is full.
    fn write_some(&self, id: ConnId, peer: &Peer) -> io::Result<bool> {
        let mut core = self.core.borrow_mut();
        loop {
            let data = core.output(id);
            if data.is_empty() {
                return Ok(true);
            }
            match peer.io.try_write(data) {
                Ok(n) => core.consume_output(id, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    }
}

async fn timer_task(shared: Rc<Shared>, udp: Option<UdpSocket>, targets: Vec<SocketAddr>) {
    let mut send_log_at: Option<Instant> = None;
    loop {
        let now = shared.now();
        let next = shared.core.borrow().poll_timeout();
        let deadline = next.unwrap_or(now + 3_600_000).max(now);
        shared.timer_deadline.set(deadline);
        if deadline > now {
            let at = tokio::time::Instant::from_std(shared.epoch + Duration::from_millis(deadline));
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = shared.timer_wake.notified() => continue,
            }
        }
        let now = shared.now();
        shared.core.borrow_mut().handle_timeout(now);
        shared.after_core();
        let announce = shared.core.borrow_mut().poll_announce();
        if let (Some(data), Some(sock)) = (announce, &udp) {
            for t in &targets {
                if let Err(e) = sock.send_to(&data, t).await
                    && send_log_at.is_none_or(|t| t.elapsed() > Duration::from_secs(60))
                {
                    warn!("SERVER_ANNOUNCE to {t} failed: {e}");
                    send_log_at = Some(Instant::now());
                }
            }
        }
    }
}

/// Reads on readiness through one buffer shared by all connections (an idle connection costs
/// no buffer memory) and feeds the core; the core's answers are written by [`Shared::flush`].
async fn conn_task(shared: Rc<Shared>, id: ConnId, peer: Rc<Peer>) {
    let mut first = true;
    'conn: loop {
        if peer.io.readable().await.is_err() {
            break;
        }
        loop {
            let mut buf = shared.read_buf.borrow_mut();
            let (n, drained) = match read_some(&peer.io, &mut buf[..]) {
                Ok(Some((0, _))) => break 'conn,
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(_) => break 'conn,
            };
            let head = &buf[..n];
            if std::mem::take(&mut first)
                && (head.starts_with(b"GET ") || (n < 4 && b"GET ".starts_with(head)))
            {
                let req = head.to_vec();
                drop(buf);
                Box::pin(serve_status(&shared, &peer.io, req)).await;
                break 'conn;
            }
            shared.core.borrow_mut().handle_data(id, head, shared.now());
            drop(buf);
            shared.after_core();
            if drained {
                break;
            }
        }
    }
    if let Some(slot) = shared.peers.borrow_mut().get_mut(id.index()) {
        *slot = None;
    }
    shared.core.borrow_mut().handle_close(id, shared.now());
    shared.after_core();
}

/// Waits for a full socket to drain and writes what the core has queued meanwhile. A peer that
/// takes nothing for [`WRITE_TIMEOUT`] is disconnected; one that lets more than the pending
/// limit pile up is closed by the core.
async fn writer_task(shared: Rc<Shared>, id: ConnId, peer: Rc<Peer>) {
    loop {
        if !matches!(
            tokio::time::timeout(WRITE_TIMEOUT, peer.io.writable()).await,
            Ok(Ok(()))
        ) {
            peer.shut();
            return;
        }
        match shared.write_some(id, &peer) {
            Ok(true) => break,
            Ok(false) => {}
            Err(_) => {
                peer.shut();
                return;
            }
        }
    }
    peer.writing.set(false);
    if shared.core.borrow().wants_close(id) {
        peer.shut();
    }
}

/// Writes everything, waiting for the peer at most [`WRITE_TIMEOUT`] at a time.
async fn write_all(io: &TcpStream, mut data: &[u8]) -> bool {
    while !data.is_empty() {
        match io.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(WRITE_TIMEOUT, io.writable()).await {
                    Ok(Ok(())) => {}
                    _ => return false,
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// One read: `Ok(None)` when there is nothing to read, else the byte count and whether the
/// read emptied the socket. A short read does, so readiness is cleared then: the task waits for
/// the next edge instead of paying a second read that only says "would block".
fn read_some(io: &TcpStream, buf: &mut [u8]) -> io::Result<Option<(usize, bool)>> {
    let mut got = 0;
    let r = io.try_io(Interest::READABLE, || {
        let n = io.try_read(buf)?;
        got = n;
        if n > 0 && n < buf.len() {
            // Not an error: tells tokio to clear readiness (safely against a newer event).
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match r {
        Ok(n) => Ok(Some((n, false))),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok((got > 0).then_some((got, true))),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(None),
        Err(e) => Err(e),
    }
}

async fn serve_status(shared: &Shared, io: &TcpStream, mut req: Vec<u8>) {
    let read_head = async {
        let mut buf = [0u8; 1024];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
            if io.readable().await.is_err() {
                return false;
            }
            match io.try_read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => req.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return false,
            }
        }
        true
    };
    if !matches!(
        tokio::time::timeout(STATUS_READ_TIMEOUT, read_head).await,
        Ok(true)
    ) {
        return;
    }
    let path = req
        .split(|&b| b == b' ')
        .nth(1)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let (code, body) = if path == "/status" || path == "/" {
        let status = {
            let now = shared.now();
            shared.core.borrow().status(now)
        };
        match serde_json::to_vec_pretty(&status) {
            Ok(b) => ("200 OK", b),
            Err(e) => ("500 Internal Server Error", e.to_string().into_bytes()),
        }
    } else {
        ("404 Not Found", b"try GET /status\n".to_vec())
    };
    let mut reply = format!(
        "HTTP/1.0 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    reply.extend_from_slice(&body);
    write_all(io, &reply).await;
}

/// A registrar running on its own thread (for `rserpool up`, tests and embedding).
pub struct RegistrarThread {
    addr: SocketAddr,
    id: u32,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RegistrarThread {
    /// Binds and starts a registrar on a new thread; returns once it listens.
    pub fn start(cfg: Config) -> io::Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("registrar".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let server = match Server::bind(cfg).await {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok((server.local_addr(), server.server_id())));
                    let stop = async {
                        let _ = stop_rx.await;
                    };
                    if let Err(e) = server.run(stop).await {
                        warn!("registrar stopped: {e}");
                    }
                });
            })?;
        let (addr, id) = ready_rx
            .recv()
            .map_err(|_| io::Error::other("registrar thread ended before it listened"))??;
        Ok(Self {
            addr,
            id,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn asap_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn server_id(&self) -> u32 {
        self.id
    }

    /// Stops the registrar and waits for its thread; its connections close.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RegistrarThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}
