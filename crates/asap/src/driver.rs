//! What the tokio drivers of the pool element and pool user cores share: every connection a core
//! names runs in a task of its own that reports to one channel, the driver carries out the
//! core's [`Action`]s on them, SERVER_ANNOUNCEs are heard on a socket of their own, and the
//! core's time is the milliseconds since the driver began. With TLS, a connection's task runs
//! the handshake first (as the client towards a registrar, as the server for a registrar
//! taking over), and a failed one is a failed connection.

use crate::core::{Action, ConnId, Instant};
pub(crate) use crate::link::{ConnEvent, Out};
use crate::registrars::AnnounceListener;
use rserpool_tls::Tls;
use rserpool_wire::{Address, Scheme};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// The entry points both cores share, for [`Conns::feed`].
pub(crate) trait Core {
    fn handle_connected(&mut self, conn: ConnId, now: Instant);
    fn handle_data(&mut self, conn: ConnId, data: &[u8], now: Instant);
    fn handle_close(&mut self, conn: ConnId, now: Instant);
    fn handle_connect_error(&mut self, conn: ConnId, why: &str, now: Instant);
    fn handle_announce(&mut self, datagram: &[u8], from: SocketAddr, now: Instant);
}

macro_rules! core_entry_points {
    ($t:ty) => {
        impl Core for $t {
            fn handle_connected(&mut self, conn: ConnId, now: Instant) {
                <$t>::handle_connected(self, conn, now)
            }
            fn handle_data(&mut self, conn: ConnId, data: &[u8], now: Instant) {
                <$t>::handle_data(self, conn, data, now)
            }
            fn handle_close(&mut self, conn: ConnId, now: Instant) {
                <$t>::handle_close(self, conn, now)
            }
            fn handle_connect_error(&mut self, conn: ConnId, why: &str, now: Instant) {
                <$t>::handle_connect_error(self, conn, why, now)
            }
            fn handle_announce(&mut self, datagram: &[u8], from: SocketAddr, now: Instant) {
                <$t>::handle_announce(self, datagram, from, now)
            }
        }
    };
}

core_entry_points!(crate::core::pe::PeCore);
core_entry_points!(crate::core::pu::PuCore);

/// The connections of one core, its announce listener and its clock.
pub(crate) struct Conns {
    out: HashMap<ConnId, mpsc::UnboundedSender<Out>>,
    events_tx: mpsc::UnboundedSender<ConnEvent>,
    events: mpsc::UnboundedReceiver<ConnEvent>,
    announce: Option<AnnounceListener>,
    epoch: std::time::Instant,
    tls: Option<std::sync::Arc<Tls>>,
    /// Registrars reached over SCTP (the others over TCP).
    schemes: BTreeMap<SocketAddr, Scheme>,
    /// Where associations opened to our registrar associations' ports go (a PE's takeovers).
    sctp_takeovers: Option<mpsc::UnboundedSender<crate::sctp::Association>>,
}

impl Conns {
    /// Listens for SERVER_ANNOUNCE at `announce_listen`, if given; speaks TLS when `tls`.
    pub(crate) fn new(
        announce_listen: Option<SocketAddr>,
        tls: Option<std::sync::Arc<Tls>>,
        schemes: BTreeMap<SocketAddr, Scheme>,
    ) -> std::io::Result<Self> {
        let (events_tx, events) = mpsc::unbounded_channel();
        Ok(Self {
            out: HashMap::new(),
            events_tx,
            events,
            announce: announce_listen.map(AnnounceListener::start).transpose()?,
            epoch: std::time::Instant::now(),
            tls,
            schemes,
            sctp_takeovers: None,
        })
    }

    /// The time now, after handing `core` the SERVER_ANNOUNCEs heard meanwhile.
    pub(crate) fn now_for(&self, core: &mut impl Core) -> Instant {
        if let Some(a) = &self.announce {
            for (datagram, from, at) in a.drain(self.epoch) {
                core.handle_announce(&datagram, from, at);
            }
        }
        self.now()
    }

    /// Hands a connection's report to `core`.
    pub(crate) fn feed(&self, e: ConnEvent, core: &mut impl Core) {
        let now = self.now_for(core);
        match e {
            ConnEvent::Connected(c) => core.handle_connected(c, now),
            ConnEvent::Data(c, data) => core.handle_data(c, &data, now),
            ConnEvent::Closed(c) => core.handle_close(c, now),
            ConnEvent::ConnectFailed(c, e) => core.handle_connect_error(c, &e.to_string(), now),
        }
    }

    /// The core's time now.
    pub(crate) fn now(&self) -> Instant {
        Instant::since(self.epoch, std::time::Instant::now())
    }

    /// A core deadline on tokio's clock (`None`: none, or too far away to matter).
    pub(crate) fn deadline(&self, t: Option<Instant>) -> Option<tokio::time::Instant> {
        t.and_then(|t| t.to_std(self.epoch))
            .map(tokio::time::Instant::from_std)
    }

    /// Carries out an action; returns the core's event, if it was one.
    pub(crate) fn carry_out<E>(&mut self, a: Action<E>) -> Option<E> {
        match a {
            Action::Connect(id, addr) => match self.schemes.get(&addr) {
                Some(&scheme) => {
                    let (tx, rx) = mpsc::unbounded_channel();
                    self.out.insert(id, tx);
                    tokio::spawn(crate::sctp::serve(
                        id,
                        Address { scheme, addr },
                        rx,
                        self.events_tx.clone(),
                        self.sctp_takeovers.clone(),
                    ));
                }
                None => self.spawn(id, Target::Connect(addr)),
            },
            Action::Transmit(id, bytes) => {
                if let Some(tx) = self.out.get(&id) {
                    let _ = tx.send(Out::Bytes(bytes));
                }
            }
            Action::Close(id) => {
                if let Some(tx) = self.out.remove(&id) {
                    let _ = tx.send(Out::Close);
                }
            }
            Action::Event(e) => return Some(e),
        }
        None
    }

    /// From now on, associations a registrar opens to the port of one of our SCTP registrar
    /// associations (to take this PE over) arrive on the returned channel.
    pub(crate) fn take_sctp_takeovers(
        &mut self,
    ) -> mpsc::UnboundedReceiver<crate::sctp::Association> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.sctp_takeovers = Some(tx);
        rx
    }

    /// Serves an SCTP association accepted for the core as `id`.
    pub(crate) fn adopt_sctp(&mut self, id: ConnId, assoc: crate::sctp::Association) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.out.insert(id, tx);
        tokio::spawn(crate::sctp::relay(id, assoc, rx, self.events_tx.clone()));
    }

    /// Serves a connection accepted for the core as `id`.
    pub(crate) fn adopt(&mut self, id: ConnId, stream: TcpStream) {
        stream.set_nodelay(true).ok();
        self.spawn(id, Target::Stream(stream));
    }

    /// Takes connection `id` back from its task once the bytes sent before are written, with
    /// what was read from it and not yet handed to the core (`Data` reports still queued).
    /// `None` with TLS (a TLS session cannot move to another process) or when the connection
    /// has ended.
    pub(crate) async fn release(&mut self, id: ConnId) -> Option<(TcpStream, Vec<u8>)> {
        if self.tls.is_some() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.out.get(&id)?.send(Out::Release(tx)).ok()?;
        let stream = rx.await.ok()?;
        self.out.remove(&id);
        // The task has ended: all it read is queued. Other connections' reports are dropped:
        // the core stops with the hand-over.
        let mut unread = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            if let ConnEvent::Data(c, data) = e
                && c == id
            {
                unread.extend_from_slice(&data);
            }
        }
        Some((stream, unread))
    }

    /// The next report of a connection (cancel-safe).
    pub(crate) async fn next(&mut self) -> ConnEvent {
        loop {
            // Never `None`: `self` holds a sender.
            if let Some(e) = self.events.recv().await {
                let ended = match &e {
                    ConnEvent::Closed(id) | ConnEvent::ConnectFailed(id, _) => Some(*id),
                    _ => None,
                };
                if let Some(id) = ended
                    && !self.forget(id)
                {
                    // Closed by the core already.
                    continue;
                }
                return e;
            }
        }
    }

    /// Forgets a connection that ended; false if the core had closed it already.
    fn forget(&mut self, id: ConnId) -> bool {
        self.out.remove(&id).is_some()
    }

    fn spawn(&mut self, id: ConnId, target: Target) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.out.insert(id, tx);
        tokio::spawn(serve(
            id,
            target,
            rx,
            self.events_tx.clone(),
            self.tls.clone(),
        ));
    }
}

enum Target {
    Connect(SocketAddr),
    Stream(TcpStream),
}

/// A takeover connection whose certificate is not a registrar's was closed: said once a
/// minute (a forged takeover may come every few seconds).
fn takeover_refused(peer: Option<std::net::SocketAddr>) {
    static SAID: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
    if said.is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(60)) {
        return;
    }
    *said = Some(std::time::Instant::now());
    tracing::warn!(
        "takeover from {} refused: its certificate is not a registrar's (no {} among its \
         subject alternative names: `rserpool cert --registrar NAME`, or add it with your own \
         CA); said once a minute",
        peer.map_or_else(|| "a peer".into(), |p| p.to_string()),
        rserpool_tls::REGISTRAR_URI
    );
}

/// One connection: connects if asked to (with TLS: and shakes hands), then reads and writes
/// until either end closes.
async fn serve(
    id: ConnId,
    target: Target,
    mut rx: mpsc::UnboundedReceiver<Out>,
    events: mpsc::UnboundedSender<ConnEvent>,
    tls: Option<std::sync::Arc<Tls>>,
) {
    let stream = match target {
        Target::Stream(s) => {
            let Some(tls) = tls else {
                if let Some((s, back)) = relay(id, s, rx, events).await {
                    let _ = back.send(s);
                }
                return;
            };
            // A registrar taking over: it must present a certificate from the CA.
            let peer = s.peer_addr().ok();
            let handshake = tls.accept_stream(true, s);
            let r = tokio::select! {
                r = handshake => r,
                _ = rx.recv() => return,
            };
            match r {
                Ok(s) => {
                    // Only a registrar takes a PE over: any certificate of the CA (a PE's, a
                    // pool user's) could claim to be one otherwise.
                    let registrar = s
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(<[_]>::first)
                        .is_some_and(|c| rserpool_tls::is_registrar(c));
                    if !registrar {
                        takeover_refused(peer);
                        let _ = events.send(ConnEvent::Closed(id));
                        return;
                    }
                    // Never released (TLS): dropping the stream closes it.
                    relay(id, s, rx, events).await;
                    return;
                }
                Err(e) => {
                    tracing::warn!(
                        "TLS handshake with {} refused: {e}",
                        peer.map_or_else(|| "a registrar".into(), |p| p.to_string())
                    );
                    let _ = events.send(ConnEvent::Closed(id));
                    return;
                }
            }
        }
        Target::Connect(addr) => {
            let connect = async {
                let s = crate::connection::connect_stream(addr).await?;
                match &tls {
                    Some(tls) => tls
                        .connect_stream(addr.ip(), s)
                        .await
                        .map(|s| Stream::Tls(Box::new(s))),
                    None => Ok(Stream::Plain(s)),
                }
            };
            tokio::pin!(connect);
            // The core sends nothing before it is told the connection is up; a close (or the
            // core's end) abandons the attempt.
            let r = tokio::select! {
                r = &mut connect => r,
                _ = rx.recv() => return,
            };
            match r {
                Ok(s) => {
                    let _ = events.send(ConnEvent::Connected(id));
                    s
                }
                Err(e) => {
                    let _ = events.send(ConnEvent::ConnectFailed(id, e));
                    return;
                }
            }
        }
    };
    match stream {
        Stream::Plain(s) => {
            if let Some((s, back)) = relay(id, s, rx, events).await {
                let _ = back.send(s);
            }
        }
        Stream::Tls(s) => {
            relay(id, *s, rx, events).await;
        }
    }
}

enum Stream {
    Plain(TcpStream),
    Tls(Box<rserpool_tls::tokio_rustls::client::TlsStream<TcpStream>>),
}

/// Reads and writes a connection until either end closes, or until it is to be released:
/// then it returns the stream and where to send it.
async fn relay<S: AsyncRead + AsyncWrite + Unpin>(
    id: ConnId,
    stream: S,
    mut rx: mpsc::UnboundedReceiver<Out>,
    events: mpsc::UnboundedSender<ConnEvent>,
) -> Option<(S, oneshot::Sender<TcpStream>)> {
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut buf = vec![0u8; 8192];
    loop {
        tokio::select! {
            r = rd.read(&mut buf) => match r {
                Ok(n) if n > 0 => {
                    let _ = events.send(ConnEvent::Data(id, buf[..n].to_vec()));
                }
                _ => {
                    let _ = events.send(ConnEvent::Closed(id));
                    return None;
                }
            },
            m = rx.recv() => match m {
                Some(Out::Bytes(b)) => {
                    if wr.write_all(&b).await.is_err() {
                        let _ = events.send(ConnEvent::Closed(id));
                        return None;
                    }
                }
                Some(Out::Release(back)) => {
                    if wr.flush().await.is_err() {
                        let _ = events.send(ConnEvent::Closed(id));
                        return None;
                    }
                    return Some((rd.unsplit(wr), back));
                }
                Some(Out::Close) | None => {
                    let _ = wr.shutdown().await;
                    return None;
                }
            },
        }
    }
}

/// Sleeps until `t`, or forever.
pub(crate) async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
