//! The registrar's ASAP state machine, sans-IO.
//!
//! Bytes, connection events and the time (ms, any monotonic origin) go in; bytes per connection,
//! close requests, announces and the next timer deadline come out. No sockets and no clock in
//! here, so the same logic runs under the socket driver and under a simulated network.
//!
//! A connection is an ASAP association. Every PE is bound to the connection it registered over
//! (RFC 5355 §3: only that association may update or deregister it) and is removed when that
//! connection closes.

use crate::config::Config;
use crate::status::{Counters, PeStatus, PoolStatus, Status};
use bytes::Bytes;
use rserpool_handlespace::{Handlespace, PeRef, Registered, TimerKind};
use rserpool_wire::{
    AsapMessage, CauseCode, DecodeError, EncodeError, ErrorCause, Framer, OperationError,
    PoolElement, PoolHandle, TransportAddress, UpdateAction,
};
use std::net::SocketAddr;
use tracing::{debug, info, warn};

mod enrp;

/// A connection (association) of the registrar, named by the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u32);

impl ConnId {
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The connection at `index` (drivers use the index as an event token).
    pub fn from_index(index: usize) -> Self {
        Self(index as u32)
    }
}

/// Why a PE left the handlespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    Deregistered,
    KeepAliveTimeout,
    ConnectionClosed,
    Unreachable,
    LifetimeExpired,
}

impl Removal {
    fn describe(self) -> &'static str {
        match self {
            Self::Deregistered => "deregistered",
            Self::KeepAliveTimeout => "no ENDPOINT_KEEP_ALIVE_ACK in time",
            Self::ConnectionClosed => "its connection closed",
            Self::Unreachable => "reported unreachable by pool users",
            Self::LifetimeExpired => "registration life expired",
        }
    }
}

/// Refills at `rate` tokens per second up to a burst of `rate`; 0 = unlimited.
#[derive(Debug, Clone, Copy)]
struct TokenBucket {
    milli_tokens: u64,
    last: u64,
}

impl TokenBucket {
    fn full(rate: u32, now: u64) -> Self {
        Self {
            milli_tokens: u64::from(rate) * 1000,
            last: now,
        }
    }

    fn take(&mut self, rate: u32, now: u64) -> bool {
        if rate == 0 {
            return true;
        }
        let cap = u64::from(rate) * 1000;
        let refill = now
            .saturating_sub(self.last)
            .saturating_mul(u64::from(rate));
        self.milli_tokens = self.milli_tokens.saturating_add(refill).min(cap);
        self.last = now;
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            true
        } else {
            false
        }
    }
}

/// At most [`LogLimiter::LINES`] lines per window, then one line saying how many were dropped:
/// a misbehaving peer must not flood the log.
#[derive(Debug, Default)]
struct LogLimiter {
    window_start: u64,
    lines: u32,
    suppressed: u64,
}

impl LogLimiter {
    const WINDOW_MS: u64 = 10_000;
    const LINES: u32 = 20;

    fn allow(&mut self, now: u64) -> bool {
        if now.saturating_sub(self.window_start) >= Self::WINDOW_MS {
            if self.suppressed > 0 {
                warn!(
                    "{} similar log lines suppressed in the last {} s",
                    self.suppressed,
                    Self::WINDOW_MS / 1000
                );
            }
            self.window_start = now;
            self.lines = 0;
            self.suppressed = 0;
        }
        if self.lines < Self::LINES {
            self.lines += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}

struct Conn {
    peer: SocketAddr,
    /// An ENRP connection (to or from another registrar), not ASAP.
    enrp: bool,
    framer: Framer,
    out: Vec<u8>,
    /// PEs registered over this connection.
    pes: Vec<PeRef>,
    hr_bucket: TokenBucket,
    eu_bucket: TokenBucket,
    closing: bool,
    dirty: bool,
}

#[derive(Debug, Clone, Copy)]
struct PeMeta {
    /// The association the PE registered over; `None` for PEs learnt from peers (ENRP).
    conn: Option<ConnId>,
    /// When the registration life runs out (ms); `u64::MAX` = never.
    expiry: u64,
}

const NO_META: PeMeta = PeMeta {
    conn: None,
    expiry: u64::MAX,
};

/// The registrar's protocol state: handlespace, associations, PE supervision.
pub struct Registrar {
    cfg: Config,
    id: u32,
    hs: Handlespace,
    conns: Vec<Option<Conn>>,
    free_conns: Vec<u32>,
    conn_count: usize,
    meta: Vec<PeMeta>,
    dirty: Vec<ConnId>,
    announce: Option<(u64, Bytes)>,
    announce_out: Option<Bytes>,
    started: u64,
    counters: Counters,
    peer_log: LogLimiter,
    event_log: LogLimiter,
    scratch: Vec<PeRef>,
    expired: Vec<(PeRef, TimerKind)>,
    report: Vec<ErrorCause>,
    enrp: enrp::EnrpState,
}

impl Registrar {
    /// A registrar with ID `id` (the Server Identifier, also the home registrar of its PEs).
    pub fn new(cfg: Config, id: u32, now: u64) -> Self {
        let hs = Handlespace::new(rserpool_handlespace::Config {
            max_increment: cfg.max_increment,
            max_pools: cfg.max_pools,
            max_pes_per_pool: cfg.max_pes_per_pool,
            max_pool_handle_len: cfg.max_pool_handle_len,
            seed: u64::from(id) ^ now.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15,
        });
        Self {
            cfg,
            id,
            hs,
            conns: Vec::new(),
            free_conns: Vec::new(),
            conn_count: 0,
            meta: Vec::new(),
            dirty: Vec::new(),
            announce: None,
            announce_out: None,
            started: now,
            counters: Counters::default(),
            peer_log: LogLimiter::default(),
            event_log: LogLimiter::default(),
            scratch: Vec::new(),
            enrp: enrp::EnrpState::default(),
            expired: Vec::new(),
            report: Vec::new(),
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn handlespace(&self) -> &Handlespace {
        &self.hs
    }

    /// Starts sending SERVER_ANNOUNCE every T6, naming `asap` as where to reach this registrar.
    pub fn enable_announce(&mut self, asap: SocketAddr, now: u64) {
        let msg = AsapMessage::ServerAnnounce {
            server_id: self.id,
            transports: vec![TransportAddress::tcp(asap)],
        };
        match msg.to_bytes() {
            Ok(b) => self.announce = Some((now, Bytes::from(b))),
            Err(e) => warn!("cannot encode SERVER_ANNOUNCE: {e}"),
        }
    }

    /// The next SERVER_ANNOUNCE to send, if one is due.
    pub fn poll_announce(&mut self) -> Option<Bytes> {
        self.announce_out.take()
    }

    /// A new connection from `peer`; `None` when the connection limit is reached (close it).
    pub fn accept(&mut self, peer: SocketAddr, now: u64) -> Option<ConnId> {
        self.open_conn(peer, false, now)
    }

    fn open_conn(&mut self, peer: SocketAddr, enrp: bool, now: u64) -> Option<ConnId> {
        if self.conn_count >= self.cfg.max_connections {
            self.counters.connections_refused += 1;
            if self.peer_log.allow(now) {
                warn!(
                    "connection from {peer} refused: limit of {} connections reached",
                    self.cfg.max_connections
                );
            }
            return None;
        }
        let conn = Conn {
            peer,
            enrp,
            framer: Framer::new(self.cfg.max_message_size),
            out: Vec::new(),
            pes: Vec::new(),
            hr_bucket: TokenBucket::full(self.cfg.max_hr_rate, now),
            eu_bucket: TokenBucket::full(self.cfg.max_eu_rate, now),
            closing: false,
            dirty: false,
        };
        let idx = match self.free_conns.pop() {
            Some(i) => {
                self.conns[i as usize] = Some(conn);
                i
            }
            None => {
                self.conns.push(Some(conn));
                (self.conns.len() - 1) as u32
            }
        };
        self.conn_count += 1;
        Some(ConnId(idx))
    }

    fn conn_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns.get_mut(id.index()).and_then(Option::as_mut)
    }

    fn conn(&self, id: ConnId) -> Option<&Conn> {
        self.conns.get(id.index()).and_then(Option::as_ref)
    }

    /// True for a connection to or from a peer registrar.
    pub fn is_enrp(&self, id: ConnId) -> bool {
        self.conn(id).is_some_and(|c| c.enrp)
    }

    /// The connection's peer address.
    pub fn peer(&self, id: ConnId) -> Option<SocketAddr> {
        self.conn(id).map(|c| c.peer)
    }

    /// Bytes read from a connection.
    pub fn handle_data(&mut self, id: ConnId, data: &[u8], now: u64) {
        let Some(c) = self.conn_mut(id) else { return };
        if c.closing {
            return;
        }
        let mut input = data;
        loop {
            let Some(c) = self.conn_mut(id) else { return };
            if c.closing {
                return;
            }
            let enrp = c.enrp;
            match c.framer.next_from(&mut input) {
                Ok(Some(msg)) if enrp => self.handle_enrp(id, &msg, now),
                Ok(Some(msg)) => self.handle_message(id, &msg, now),
                Ok(None) => {
                    c.framer.release_if_empty();
                    return;
                }
                Err(e) => {
                    // Framing is lost: tell the peer why, then close.
                    let header = c.framer.buffer_mut().get(..4).map(Bytes::copy_from_slice);
                    let cause = ErrorCause::with_info(
                        CauseCode::INVALID_VALUES,
                        header.unwrap_or_default(),
                    );
                    self.protocol_error(id, &e, Some(cause), now);
                    self.close(id);
                    return;
                }
            }
        }
    }

    /// The connection closed (by the peer, an error, or after [`wants_close`](Self::wants_close)).
    pub fn handle_close(&mut self, id: ConnId, now: u64) {
        let Some(c) = self.conns.get_mut(id.index()).and_then(Option::take) else {
            return;
        };
        self.conn_count -= 1;
        self.free_conns.push(id.0);
        if c.enrp {
            self.enrp_closed(id, now);
        }
        for r in c.pes {
            // Unbind first so remove_pe does not look for the connection.
            self.meta[r.index() as usize].conn = None;
            self.remove_pe(r, Removal::ConnectionClosed, now);
        }
    }

    /// True once the connection should be closed after its pending output is written.
    pub fn wants_close(&self, id: ConnId) -> bool {
        self.conn(id).is_none_or(|c| c.closing)
    }

    /// The bytes queued for a connection (empty if none). The driver writes them from here and
    /// then calls [`consume_output`](Self::consume_output) with what the socket took, so output
    /// is never copied and a peer that does not read is still counted against the pending limit.
    pub fn output(&self, id: ConnId) -> &[u8] {
        self.conn(id).map_or(&[], |c| &c.out)
    }

    /// `n` bytes of [`output`](Self::output) were written.
    pub fn consume_output(&mut self, id: ConnId, n: usize) {
        let Some(c) = self.conn_mut(id) else { return };
        if n >= c.out.len() {
            // Free the buffer: most connections are idle between messages.
            c.out = Vec::new();
            c.dirty = false;
        } else {
            c.out.drain(..n);
        }
    }

    /// Connections that got output since the last call (for the driver to wake their writers).
    pub fn take_dirty(&mut self, out: &mut Vec<ConnId>) {
        out.append(&mut self.dirty);
    }

    /// The earliest time (ms) at which [`handle_timeout`](Self::handle_timeout) has work; it may
    /// be early, never late.
    pub fn poll_timeout(&self) -> Option<u64> {
        [
            self.hs.next_timer(),
            self.announce.as_ref().map(|a| a.0),
            self.enrp_next_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs the timers due at `now`: keep-alives, their timeouts, lifetime expiry, announces.
    pub fn handle_timeout(&mut self, now: u64) {
        self.enrp_timeout(now);
        let mut expired = std::mem::take(&mut self.expired);
        self.hs.expire_timers(now, &mut expired);
        for (r, kind) in expired.drain(..) {
            match kind {
                TimerKind::KeepAliveTransmission => self.send_keep_alive(r, false, now),
                TimerKind::KeepAliveTimeout => self.remove_pe(r, Removal::KeepAliveTimeout, now),
                TimerKind::LifetimeExpiry => {
                    let m = self.meta[r.index() as usize];
                    if let Some(conn) = m.conn {
                        let e = &self.hs.pe(r).element;
                        let msg = AsapMessage::DeregistrationResponse {
                            pool_handle: self.hs.pool_handle_of(r).clone(),
                            pe_id: e.id,
                            error: None,
                        };
                        self.send(conn, &msg, now);
                    }
                    self.remove_pe(r, Removal::LifetimeExpired, now);
                }
            }
        }
        self.expired = expired;
        if let Some((next, data)) = &mut self.announce
            && *next <= now
            && self.enrp.starting.is_none()
        {
            self.announce_out = Some(data.clone());
            *next = now + self.cfg.announce_interval_ms.max(1);
        }
    }

    fn close(&mut self, id: ConnId) {
        if let Some(c) = self.conn_mut(id) {
            c.closing = true;
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(id);
            }
        }
    }

    fn send(&mut self, id: ConnId, msg: &AsapMessage, now: u64) {
        let Some(c) = self.conn_mut(id) else { return };
        if c.closing {
            return;
        }
        // Most answers are small: one allocation instead of a chain of doublings.
        c.out.reserve(64);
        if let Err(e) = msg.encode(&mut c.out) {
            warn!("cannot encode {}: {e}", msg.name());
            return;
        }
        self.mark_written(id, now);
    }

    /// Counts, logs (rate-limited) and answers a malformed message with the RFC cause: an ASAP
    /// ERROR, or on a connection between registrars an ENRP ERROR (an ASAP message there would
    /// itself be malformed, and the two registrars would answer each other forever).
    fn protocol_error(
        &mut self,
        id: ConnId,
        err: &DecodeError,
        cause: Option<ErrorCause>,
        now: u64,
    ) {
        self.counters.protocol_errors += 1;
        let enrp = self.is_enrp(id);
        let peer = self.peer(id);
        if self.peer_log.allow(now)
            && let Some(peer) = peer
        {
            let what = if enrp { "ENRP" } else { "ASAP" };
            warn!("{peer}: bad {what} message: {err}");
        }
        let Some(cause) = cause else { return };
        let error = OperationError::single(cause);
        if enrp {
            self.send_enrp_error(id, error, now);
        } else {
            self.send(id, &AsapMessage::Error { error }, now);
        }
    }

    /// A message that could not be decoded: answered, and the connection closed if the
    /// framing is lost.
    fn reject_malformed(&mut self, id: ConnId, err: &DecodeError, now: u64) {
        self.protocol_error(id, err, err.cause.clone(), now);
        if err.loses_framing() {
            self.close(id);
        }
    }

    fn handle_message(&mut self, id: ConnId, buf: &[u8], now: u64) {
        let mut report = std::mem::take(&mut self.report);
        report.clear();
        let decoded = AsapMessage::decode_with_report(buf, &mut report);
        if !report.is_empty() {
            let msg = AsapMessage::Error {
                error: OperationError {
                    causes: report.clone(),
                },
            };
            self.send(id, &msg, now);
        }
        self.report = report;
        let msg = match decoded {
            Ok(m) => m,
            Err(e) => return self.reject_malformed(id, &e, now),
        };
        match msg {
            AsapMessage::Registration {
                pool_handle,
                pool_element,
            } => self.on_registration(id, pool_handle, pool_element, now),
            AsapMessage::Deregistration { pool_handle, pe_id } => {
                self.on_deregistration(id, pool_handle, pe_id, now)
            }
            AsapMessage::HandleResolution {
                pool_handle, items, ..
            } => self.on_handle_resolution(id, pool_handle, items, now),
            AsapMessage::EndpointKeepAliveAck { pool_handle, pe_id } => {
                self.on_keep_alive_ack(id, &pool_handle, pe_id, now)
            }
            AsapMessage::EndpointUnreachable { pool_handle, pe_id } => {
                self.on_unreachable(id, &pool_handle, pe_id, now)
            }
            AsapMessage::Error { error } => {
                if self.peer_log.allow(now)
                    && let Some(peer) = self.peer(id)
                {
                    let causes: Vec<String> =
                        error.causes.iter().map(|c| c.code.to_string()).collect();
                    warn!("{peer} reports an error: {}", causes.join(", "));
                }
            }
            other => {
                // A message a registrar never receives over ASAP (e.g. a response).
                let cause = ErrorCause::with_info(
                    CauseCode::UNRECOGNIZED_MESSAGE,
                    Bytes::copy_from_slice(buf.get(..4).unwrap_or(buf)),
                );
                let err = DecodeError {
                    kind: rserpool_wire::DecodeErrorKind::UnknownMessage(other.msg_type()),
                    cause: None,
                };
                self.protocol_error(id, &err, Some(cause), now);
            }
        }
    }

    fn meta_of(&self, r: PeRef) -> PeMeta {
        self.meta
            .get(r.index() as usize)
            .copied()
            .unwrap_or(NO_META)
    }

    fn set_meta(&mut self, r: PeRef, m: PeMeta) {
        let i = r.index() as usize;
        if self.meta.len() <= i {
            self.meta.resize(i + 1, NO_META);
        }
        self.meta[i] = m;
    }

    fn reject_registration(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        pe_id: u32,
        cause: ErrorCause,
        why: &dyn std::fmt::Display,
        now: u64,
    ) {
        self.counters.registrations_rejected += 1;
        if self.peer_log.allow(now)
            && let Some(peer) = self.peer(id)
        {
            warn!("{peer}: registration of PE {pe_id:#010x} in pool {pool_handle} rejected: {why}");
        }
        let msg = AsapMessage::RegistrationResponse {
            reject: true,
            pool_handle,
            pe_id,
            error: Some(OperationError::single(cause)),
        };
        self.send(id, &msg, now);
    }

    fn on_registration(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        mut pe: PoolElement,
        now: u64,
    ) {
        let Some(c) = self.conn(id) else { return };
        let peer = c.peer;
        let pe_id = pe.id;
        let existing = self.hs.find(pool_handle.as_bytes(), pe_id);
        // Bound to this association already (a re-registration over it).
        let mut bound = false;
        if let Some(r) = existing
            && let Some(owner) = self.meta_of(r).conn
        {
            bound = owner == id;
            if !bound {
                // RFC 5355: only the registering association may change a PE. If that
                // association is dead, the probe removes the old entry and a retry succeeds.
                self.probe(r, now);
                let cause = ErrorCause::new(CauseCode::NON_UNIQUE_PE_IDENTIFIER);
                let why = "the PE identifier is registered over another association";
                self.reject_registration(id, pool_handle, pe_id, cause, &why, now);
                return;
            }
        }
        if !bound && c.pes.len() >= self.cfg.max_pes_per_connection {
            let cause = ErrorCause::new(CauseCode::LACK_OF_RESOURCES);
            let why = format!(
                "limit of {} PEs per connection reached",
                self.cfg.max_pes_per_connection
            );
            self.reject_registration(id, pool_handle, pe_id, cause, &why, now);
            return;
        }
        pe.home_registrar = self.id;
        pe.asap_transport = Some(TransportAddress::tcp(asap_transport(
            pe.asap_transport.as_ref(),
            peer,
        )));
        // RFC 5354: seconds; -1 (or any value below 1) means infinite.
        let expiry = enrp::lifetime_expiry(pe.registration_life, now);
        let result = match existing {
            Some(r) => self
                .hs
                .reregister(r, pe, now)
                .map(|()| Registered { pe: r, new: false }),
            None => self.hs.register(&pool_handle, pe, now),
        };
        match result {
            Ok(reg) => {
                let r = reg.pe;
                self.set_meta(
                    r,
                    PeMeta {
                        conn: Some(id),
                        expiry,
                    },
                );
                if !bound && let Some(c) = self.conn_mut(id) {
                    // New here, or known from a peer and now registered with us.
                    c.pes.push(r);
                }
                if reg.new {
                    self.counters.registrations += 1;
                    if self.event_log.allow(now) {
                        info!("PE {pe_id:#010x} registered in pool {pool_handle} from {peer}");
                    }
                } else {
                    self.counters.reregistrations += 1;
                    debug!("PE {pe_id:#010x} of pool {pool_handle} re-registered");
                }
                self.schedule_supervision(r, now);
                let element = self.hs.pe(r).element.clone();
                self.enrp_update(UpdateAction::AddPe, &pool_handle, &element, now);
                let msg = AsapMessage::RegistrationResponse {
                    reject: false,
                    pool_handle,
                    pe_id,
                    error: None,
                };
                self.send(id, &msg, now);
            }
            Err(e) => {
                let cause = e.cause();
                self.reject_registration(id, pool_handle, pe_id, cause, &e, now);
            }
        }
    }

    fn on_deregistration(&mut self, id: ConnId, pool_handle: PoolHandle, pe_id: u32, now: u64) {
        let mut error = None;
        if let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) {
            if self.meta_of(r).conn == Some(id) {
                self.remove_pe(r, Removal::Deregistered, now);
                self.counters.deregistrations += 1;
            } else {
                self.counters.deregistrations_rejected += 1;
                if self.peer_log.allow(now)
                    && let Some(peer) = self.peer(id)
                {
                    warn!(
                        "{peer}: deregistration of PE {pe_id:#010x} in pool {pool_handle} refused: registered over another association"
                    );
                }
                error = Some(OperationError::single(ErrorCause::new(
                    CauseCode::REJECTED_SECURITY,
                )));
            }
        }
        // Deregistering an unknown PE succeeds: the result the PE wants already holds.
        let msg = AsapMessage::DeregistrationResponse {
            pool_handle,
            pe_id,
            error,
        };
        self.send(id, &msg, now);
    }

    fn refuse_resolution(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        code: CauseCode,
        now: u64,
    ) {
        let msg = AsapMessage::HandleResolutionResponse {
            accept: false,
            pool_handle,
            policy: None,
            pool_elements: Vec::new(),
            error: Some(OperationError::single(ErrorCause::new(code))),
        };
        self.send(id, &msg, now);
    }

    fn on_handle_resolution(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        items: Option<u32>,
        now: u64,
    ) {
        let (max_hr_rate, default_items, max_items) = (
            self.cfg.max_hr_rate,
            self.cfg.max_hres_items,
            self.cfg.max_hres_items_requested,
        );
        let Some(c) = self.conn_mut(id) else { return };
        if !c.hr_bucket.take(max_hr_rate, now) {
            let peer = c.peer;
            self.counters.resolutions_rate_limited += 1;
            if self.peer_log.allow(now) {
                warn!(
                    "{peer}: handle resolution refused, more than {max_hr_rate}/s from this pool user"
                );
            }
            self.refuse_resolution(id, pool_handle, CauseCode::REJECTED_SECURITY, now);
            return;
        }
        self.counters.resolutions += 1;
        let mut n = items.unwrap_or(default_items).min(max_items) as usize;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let found = self.hs.resolve(pool_handle.as_bytes(), n, &mut scratch);
        if !found || scratch.is_empty() {
            self.scratch = scratch;
            self.counters.resolutions_unknown_pool += 1;
            self.refuse_resolution(id, pool_handle, CauseCode::UNKNOWN_POOL_HANDLE, now);
            return;
        }
        // Encoded straight from the handlespace. A large pool may not fit one message: halve
        // the list until it does.
        let Some(c) = self
            .conns
            .get_mut(id.index())
            .and_then(Option::as_mut)
            .filter(|c| !c.closing)
        else {
            self.scratch = scratch;
            return;
        };
        let hs = &self.hs;
        let policy = &hs.pe(scratch[0]).element.policy;
        let mark = c.out.len();
        c.out.reserve(64 + 96 * n.min(scratch.len()));
        loop {
            let pes = scratch[..n.min(scratch.len())]
                .iter()
                .map(|&r| &hs.pe(r).element);
            match AsapMessage::encode_resolution(&mut c.out, &pool_handle, Some(policy), pes) {
                Ok(()) => break,
                Err(EncodeError::TooLarge { .. }) if n > 1 => {
                    c.out.truncate(mark);
                    n = n.min(scratch.len()) / 2;
                }
                Err(e) => {
                    c.out.truncate(mark);
                    warn!("cannot encode HANDLE_RESOLUTION_RESPONSE: {e}");
                    self.scratch = scratch;
                    return;
                }
            }
        }
        self.scratch = scratch;
        self.mark_written(id, now);
    }

    /// Bookkeeping after output was queued: wake the writer, close a connection that does not read.
    fn mark_written(&mut self, id: ConnId, now: u64) {
        let max_pending = self.cfg.max_pending_bytes;
        let Some(c) = self.conn_mut(id) else { return };
        let over = c.out.len() > max_pending;
        let peer = c.peer;
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(id);
        }
        if over {
            self.counters.slow_connections_closed += 1;
            if self.peer_log.allow(now) {
                warn!("{peer}: closing, more than {max_pending} bytes queued and not read");
            }
            self.close(id);
        }
    }

    fn on_keep_alive_ack(&mut self, id: ConnId, pool_handle: &PoolHandle, pe_id: u32, now: u64) {
        let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) else {
            return;
        };
        if self.meta_of(r).conn != Some(id) {
            if self.peer_log.allow(now)
                && let Some(peer) = self.peer(id)
            {
                warn!(
                    "{peer}: ignored ENDPOINT_KEEP_ALIVE_ACK for PE {pe_id:#010x} of another association"
                );
            }
            return;
        }
        self.counters.keep_alive_acks += 1;
        self.hs.heard(r, now);
        if matches!(self.hs.timer(r), Some((TimerKind::KeepAliveTimeout, _))) {
            self.schedule_supervision(r, now);
        }
    }

    fn on_unreachable(&mut self, id: ConnId, pool_handle: &PoolHandle, pe_id: u32, now: u64) {
        let rate = self.cfg.max_eu_rate;
        let Some(c) = self.conn_mut(id) else { return };
        if !c.eu_bucket.take(rate, now) {
            let peer = c.peer;
            self.counters.unreachable_rate_limited += 1;
            if self.peer_log.allow(now) {
                warn!(
                    "{peer}: ENDPOINT_UNREACHABLE ignored, more than {rate}/s from this pool user"
                );
            }
            return;
        }
        self.counters.unreachable_reports += 1;
        let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) else {
            return;
        };
        let n = self.hs.report_unreachable(r);
        if n >= self.cfg.max_bad_pe_reports {
            self.remove_pe(r, Removal::Unreachable, now);
        } else {
            self.probe(r, now);
        }
    }

    /// Next supervision step of a home PE: a keep-alive after the interval, or the end of its
    /// registration life if that comes first.
    fn schedule_supervision(&mut self, r: PeRef, now: u64) {
        let m = self.meta_of(r);
        let next = now.saturating_add(self.cfg.keep_alive_interval_ms);
        if m.conn.is_none() || m.expiry <= next {
            self.hs
                .schedule_timer(r, TimerKind::LifetimeExpiry, m.expiry);
        } else {
            self.hs
                .schedule_timer(r, TimerKind::KeepAliveTransmission, next);
        }
    }

    /// Sends an ENDPOINT_KEEP_ALIVE now unless one is already outstanding.
    fn probe(&mut self, r: PeRef, now: u64) {
        if !matches!(self.hs.timer(r), Some((TimerKind::KeepAliveTimeout, _))) {
            self.send_keep_alive(r, false, now);
        }
    }

    /// `home`: the H bit, telling the PE that this registrar is its home now (takeover).
    fn send_keep_alive(&mut self, r: PeRef, home: bool, now: u64) {
        let m = self.meta_of(r);
        let Some(conn) = m.conn else {
            self.hs
                .schedule_timer(r, TimerKind::LifetimeExpiry, m.expiry);
            return;
        };
        let msg = AsapMessage::EndpointKeepAlive {
            home,
            server_id: self.id,
            pool_handle: self.hs.pool_handle_of(r).clone(),
            pe_id: Some(self.hs.pe(r).element.id),
        };
        self.counters.keep_alives_sent += 1;
        self.send(conn, &msg, now);
        let timeout = now.saturating_add(self.cfg.keep_alive_timeout_ms);
        if m.expiry <= timeout {
            self.hs
                .schedule_timer(r, TimerKind::LifetimeExpiry, m.expiry);
        } else {
            self.hs
                .schedule_timer(r, TimerKind::KeepAliveTimeout, timeout);
        }
    }

    fn remove_pe(&mut self, r: PeRef, why: Removal, now: u64) {
        let m = self.meta_of(r);
        if let Some(conn) = m.conn
            && let Some(c) = self.conn_mut(conn)
            && let Some(pos) = c.pes.iter().position(|&x| x == r)
        {
            c.pes.swap_remove(pos);
        }
        self.set_meta(r, NO_META);
        let handle = self.hs.pool_handle_of(r).clone();
        let pe = self.hs.remove(r);
        if pe.home_registrar == self.id {
            self.enrp_update(UpdateAction::DelPe, &handle, &pe, now);
        }
        match why {
            Removal::Deregistered => {}
            Removal::KeepAliveTimeout => self.counters.removed_keep_alive_timeout += 1,
            Removal::ConnectionClosed => self.counters.removed_connection_closed += 1,
            Removal::Unreachable => self.counters.removed_unreachable += 1,
            Removal::LifetimeExpired => self.counters.removed_lifetime_expired += 1,
        }
        if self.event_log.allow(now) {
            info!(
                "PE {:#010x} removed from pool {handle}: {}",
                pe.id,
                why.describe()
            );
        }
    }

    /// The handlespace as `rserpool status` shows it.
    pub fn status(&self, now: u64) -> Status {
        let mut pools: Vec<PoolStatus> = self
            .hs
            .pools()
            .map(|(handle, _, _)| {
                let mut pes: Vec<PeStatus> = self
                    .hs
                    .members(handle.as_bytes())
                    .map(|r| {
                        let e = self.hs.pe(r);
                        PeStatus {
                            id: e.element.id,
                            transport: e.element.user_transport.to_string(),
                            policy: e.element.policy.to_string(),
                            home_registrar: e.element.home_registrar,
                            registration_life: e.element.registration_life,
                            ms_since_heard: now.saturating_sub(e.last_heard),
                            unreachable_reports: e.unreachable_reports,
                            asap_transport: e
                                .element
                                .asap_transport
                                .as_ref()
                                .map(|t| t.to_string()),
                        }
                    })
                    .collect();
                pes.sort_by_key(|p| p.id);
                let policy = pes
                    .first()
                    .and_then(|p| p.policy.split(' ').next())
                    .unwrap_or("")
                    .to_string();
                PoolStatus {
                    handle: handle.to_string(),
                    policy,
                    pes,
                }
            })
            .collect();
        pools.sort_by(|a, b| a.handle.cmp(&b.handle));
        Status {
            server_id: self.id,
            uptime_ms: now.saturating_sub(self.started),
            connections: self.conn_count,
            pool_elements: self.hs.len(),
            pools,
            counters: self.counters.clone(),
            peers: self.peer_status(now),
            enrp: self.enrp.counters.clone(),
        }
    }
}

/// Where a new home reaches a PE after a takeover: the ASAP transport the PE announced (its
/// takeover listener; a wildcard address means the one it connects from), else the address of
/// its association, which only serves while that association lives.
fn asap_transport(announced: Option<&TransportAddress>, peer: SocketAddr) -> SocketAddr {
    match announced.and_then(|t| t.socket_addrs().next()) {
        Some(a) if a.port() != 0 && a.ip().is_unspecified() => SocketAddr::new(peer.ip(), a.port()),
        Some(a) if a.port() != 0 => a,
        _ => peer,
    }
}
