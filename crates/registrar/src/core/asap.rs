//! ASAP (RFC 5352) in the registrar core: registration, deregistration, handle resolution,
//! keep-alive supervision of the PEs this registrar is home for, ENDPOINT_UNREACHABLE reports
//! and SERVER_ANNOUNCE. [`Asap`] owns the handlespace and what the registrar knows of each PE
//! beyond it (the association it registered over, when its registration life ends).
//!
//! Every PE is bound to the connection it registered over (RFC 5355 §3: only that association
//! may update or deregister it) and is removed when that connection closes. A change of a PE
//! this registrar is home for goes to the peers through [`Enrp::update`]; ENRP reaches the
//! handlespace only through [`HandlespaceView`], implemented here.

use super::Instant;
use super::conns::{Action, ConnId, Conns, Offence};
use super::enrp::{Enrp, HandlespaceView};
use super::limit::LogLimiter;
use super::probe::Probes;
use super::subscribe::Subscriptions;
use crate::config::Config;
use crate::status::{Counters, PeStatus, PoolStatus};
use bytes::Bytes;
use rserpool_handlespace::{
    Handlespace, PeRef, Registered, RegistrationError, SyncCursor, TimerKind,
};
use rserpool_wire::Message;
use rserpool_wire::{
    AsapMessage, CauseCode, DecodeError, ErrorCause, OperationError, PoolElement, PoolEntry,
    PoolHandle, Protocol, TransportAddress, UpdateAction,
};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// Why a PE left the handlespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
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

#[derive(Debug, Clone, Copy)]
struct PeMeta {
    /// The association the PE registered over; `None` for PEs learnt from peers (ENRP).
    conn: Option<ConnId>,
    /// When the registration life runs out; [`Instant::MAX`] = never.
    expiry: Instant,
    /// When the last ENDPOINT_KEEP_ALIVE went to the PE.
    keep_alive_sent: Instant,
    /// The registrar this one took the PE over from, until the PE registers over the new
    /// association (0: none); see [`Asap::handed_back`].
    taken_from: u32,
    /// The PE answered the takeover's ENDPOINT_KEEP_ALIVE: it is alive, and may still refuse
    /// the takeover if its home answers it.
    takeover_answered: bool,
    /// Its keep-alive timed out and the driver was asked whether the keep-alive is still on
    /// its way ([`Action::CheckDelivery`]); the answer, or the timer, decides.
    delivery_asked: bool,
}

/// How long the driver has to answer an [`Action::CheckDelivery`]: it answers at once, so
/// this only matters to one that does not.
const DELIVERY_ANSWER: Duration = Duration::from_millis(100);

const NO_META: PeMeta = PeMeta {
    conn: None,
    expiry: Instant::MAX,
    keep_alive_sent: Instant::from_millis(0),
    taken_from: 0,
    takeover_answered: false,
    delivery_asked: false,
};

/// The handlespace as this registrar serves it over ASAP.
pub(super) struct Asap {
    cfg: Arc<Config>,
    id: u32,
    hs: Handlespace,
    meta: Vec<PeMeta>,
    /// When the next SERVER_ANNOUNCE is due, and its bytes.
    announce: Option<(Instant, Bytes)>,
    counters: Counters,
    event_log: LogLimiter,
    scratch: Vec<PeRef>,
    expired: Vec<(PeRef, TimerKind)>,
    report: Vec<ErrorCause>,
    subs: Subscriptions,
    /// Services being checked after MAX-BAD-PE-REPORT reports.
    probes: Probes,
}

impl Asap {
    pub(super) fn new(cfg: Arc<Config>, id: u32, now: Instant) -> Self {
        let hs = Handlespace::new(rserpool_handlespace::Config {
            max_increment: cfg.max_increment,
            max_pools: cfg.max_pools,
            max_pes_per_pool: cfg.max_pes_per_pool,
            max_pool_handle_len: cfg.max_pool_handle_len,
            seed: u64::from(id) ^ now.as_millis().rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15,
        });
        Self {
            cfg,
            id,
            hs,
            meta: Vec::new(),
            announce: None,
            counters: Counters::default(),
            event_log: LogLimiter::default(),
            scratch: Vec::new(),
            expired: Vec::new(),
            report: Vec::new(),
            subs: Subscriptions::default(),
            probes: Probes::default(),
        }
    }

    pub(super) fn handlespace(&self) -> &Handlespace {
        &self.hs
    }

    /// The pools association `conn` subscribed to.
    pub(super) fn subscribed(&self, conn: ConnId) -> Vec<PoolHandle> {
        self.subs.of(conn)
    }

    pub(super) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Starts sending SERVER_ANNOUNCE every T6, naming `asap` as where to reach this registrar.
    pub(super) fn enable_announce(&mut self, asap: SocketAddr, now: Instant) {
        let msg = AsapMessage::ServerAnnounce {
            server_id: self.id,
            transports: vec![TransportAddress::tcp(asap)],
        };
        match msg.to_bytes() {
            Ok(b) => self.announce = Some((now, Bytes::from(b))),
            Err(e) => warn!("cannot encode SERVER_ANNOUNCE: {e}"),
        }
    }

    /// The connection closed: the PEs registered over it leave, unless
    /// [`kept_after_takeover`](Self::kept_after_takeover).
    pub(super) fn connection_closed(
        &mut self,
        pes: Vec<PeRef>,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        for r in pes {
            // Unbind first so remove_pe does not look for the connection.
            let m = self.meta_of(r);
            self.set_meta(r, PeMeta { conn: None, ..m });
            if !self.handed_back(r, out, enrp, now) && !self.kept_after_takeover(r, out, enrp, now)
            {
                self.remove_pe(r, Removal::ConnectionClosed, out, enrp, now);
            }
        }
    }

    /// A PE this registrar is home for was lost (its association closed, or its keep-alive
    /// went unanswered) soon after this registrar was taken over, or after a silence long
    /// enough for that: the PE most likely moved to its new home, which closed the
    /// association here. Removing it would push an emptying pool to this registrar's
    /// subscribers and tell the peers to remove it. It stays, as the new home's when the
    /// TAKEOVER_SERVER came ([`Enrp::new_home`]); otherwise unsupervised until that message
    /// hands it over ([`HandlespaceView::hand_over`]) or, if none comes within
    /// [`Config::taken_over_window`], it leaves then. A PE this registrar took over itself
    /// and that answered, from a registrar it has not heard again yet, waits
    /// MAX-TIME-LAST-HEARD for that one ([`Self::handed_back`]). Returns whether it stays.
    fn kept_after_takeover(
        &mut self,
        r: PeRef,
        out: &mut Conns,
        enrp: &Enrp,
        now: Instant,
    ) -> bool {
        if self.hs.pe(r).element.home_registrar != self.id {
            return false;
        }
        let m = self.meta_of(r);
        let id = self.hs.pe(r).element.id;
        let (at, why) = match enrp.new_home(now) {
            Some(home) => {
                self.hs.set_home(r, home);
                (
                    m.expiry,
                    format!(
                        "just after {home:#010x} took this registrar over: kept, as {home:#010x}'s"
                    ),
                )
            }
            // Expiring before its registration life means: removed for its closed association.
            None if enrp.takeover_may_be_news(out, now) => {
                let at = m.expiry.min(now + self.cfg.taken_over_window());
                (
                    at,
                    format!(
                        "after a silence of the network long enough for a peer to have taken this \
                     registrar over: kept for up to {} s, for the new home's word",
                        at.saturating_duration_since(now).as_secs()
                    ),
                )
            }
            // Taken over here from a registrar not heard again yet; the PE answered, so it did
            // not die, and closing now it refused because it heard its home: wait a little
            // for that one ([`Self::handed_back`]).
            None if m.taken_from != 0 && m.takeover_answered => {
                let wait = Duration::from_millis(self.cfg.max_time_last_heard_ms);
                (
                    m.expiry.min(now + wait),
                    format!(
                        "after this registrar took it over from {:#010x}: kept for up to {} s, in \
                     case that registrar is back and the PE stayed with it",
                        m.taken_from,
                        wait.as_secs()
                    ),
                )
            }
            None => return false,
        };
        self.counters.kept_after_takeover += 1;
        self.schedule(r, TimerKind::LifetimeExpiry, at);
        if self.event_log.allow(now) {
            info!("PE {id:#010x} lost {why}");
        }
        true
    }

    /// PE `r`, taken over from a registrar that is alive again (it was only cut off), did not
    /// move here: its new association closed (the PE refused the takeover because its home
    /// answers, or could not be reached) or its keep-alive went unanswered. It goes back to
    /// its home, here and at the peers (a HANDLE_UPDATE naming that home), instead of being
    /// removed everywhere while it is registered there. Returns whether it went back.
    fn handed_back(&mut self, r: PeRef, out: &mut Conns, enrp: &mut Enrp, now: Instant) -> bool {
        let m = self.meta_of(r);
        if m.taken_from == 0
            || self.hs.pe(r).element.home_registrar != self.id
            || !enrp.is_alive(m.taken_from)
        {
            return false;
        }
        self.hs.set_home(r, m.taken_from);
        self.set_meta(r, PeMeta { taken_from: 0, ..m });
        self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
        self.counters.takeovers_handed_back += 1;
        let handle = self.hs.pool_handle_of(r).clone();
        let element = self.hs.pe(r).element.clone();
        if self.event_log.allow(now) {
            info!(
                "PE {:#010x} of pool {handle} stays with its home {:#010x}, which is back",
                element.id, m.taken_from
            );
        }
        enrp.update(UpdateAction::AddPe, &handle, &element, out, now);
        true
    }

    /// The earliest supervision timer or announce.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let timer = self.hs.next_timer().map(Instant::from_millis);
        let announce = self.announce.as_ref().map(|a| a.0);
        timer.into_iter().chain(announce).min()
    }

    /// Keep-alives, their timeouts, lifetime expiry, announces (none while ENRP synchronises
    /// at start).
    pub(super) fn handle_timeout(&mut self, out: &mut Conns, enrp: &mut Enrp, now: Instant) {
        let mut expired = std::mem::take(&mut self.expired);
        self.hs.expire_timers(now.as_millis(), &mut expired);
        for (r, kind) in expired.drain(..) {
            match kind {
                TimerKind::KeepAliveTransmission => self.send_keep_alive(r, false, out, now),
                TimerKind::KeepAliveTimeout => self.keep_alive_timed_out(r, out, enrp, now),
                TimerKind::LifetimeExpiry => {
                    let m = self.meta[r.index() as usize];
                    if let Some(conn) = m.conn {
                        let e = &self.hs.pe(r).element;
                        let msg = AsapMessage::DeregistrationResponse {
                            pool_handle: self.hs.pool_handle_of(r).clone(),
                            pe_id: e.id,
                            error: None,
                        };
                        out.send_asap(conn, &msg, now);
                    }
                    // Expiring before its registration life: a PE kept after a takeover.
                    let held = m.expiry > now;
                    if held && self.handed_back(r, out, enrp, now) {
                        continue;
                    }
                    if held && enrp.takeover_may_be_news(out, now) {
                        // Still cut off, or just back and the new home's word may be on its
                        // way: nothing to decide yet.
                        let again = now + out.dark_spell();
                        self.schedule(r, TimerKind::LifetimeExpiry, m.expiry.min(again));
                        continue;
                    }
                    let why = if held {
                        Removal::ConnectionClosed
                    } else {
                        Removal::LifetimeExpired
                    };
                    self.remove_pe(r, why, out, enrp, now);
                }
            }
        }
        self.expired = expired;
        if let Some((next, data)) = &mut self.announce
            && *next <= now
            && !enrp.is_starting()
        {
            out.push(Action::Announce(data.clone()));
            *next = now + Duration::from_millis(self.cfg.announce_interval_ms.max(1));
        }
    }

    /// No ENDPOINT_KEEP_ALIVE_ACK within the keep-alive timeout. The PE is taken for gone if
    /// the network worked meanwhile. If this registrar may be cut off instead (nothing heard
    /// since, or a dark spell the answer may still lag behind, see [`Conns::answer_may_lag`]),
    /// it waits: a registrar cut off for less than its peers take to take it over keeps its
    /// PEs. So it does when the keep-alive itself may still be on its way (a lossy path: TCP
    /// retransmits it), which it asks the driver ([`Self::delivery_checked`]). A PE lost after
    /// a takeover is not removed either ([`Self::handed_back`], [`Self::kept_after_takeover`]).
    fn keep_alive_timed_out(&mut self, r: PeRef, out: &mut Conns, enrp: &mut Enrp, now: Instant) {
        let m = self.meta_of(r);
        let limit = self.cfg.keep_alive_wait_limit();
        if let Some(due) = out.answer_may_lag(m.keep_alive_sent, limit, now) {
            self.counters.keep_alive_timeouts_held += 1;
            self.hold_keep_alive(r, due);
            return;
        }
        if out.delivery_checks
            && !m.delivery_asked
            && let Some(conn) = m.conn
            && now < m.keep_alive_sent + limit
        {
            // The driver answers at once; without an answer, this timer decides.
            self.set_meta(
                r,
                PeMeta {
                    delivery_asked: true,
                    ..m
                },
            );
            out.check_delivery(conn);
            self.schedule(r, TimerKind::KeepAliveTimeout, now + DELIVERY_ANSWER);
            return;
        }
        self.keep_alive_unanswered(r, out, enrp, now);
    }

    /// Waits for PE `r`'s keep-alive answer until `due` (or its registration life).
    fn hold_keep_alive(&mut self, r: PeRef, due: Instant) {
        let m = self.meta_of(r);
        if m.expiry <= due {
            self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
        } else {
            self.schedule(r, TimerKind::KeepAliveTimeout, due);
        }
    }

    /// PE `r`'s keep-alive went unanswered: it leaves, unless lost after a takeover.
    fn keep_alive_unanswered(&mut self, r: PeRef, out: &mut Conns, enrp: &mut Enrp, now: Instant) {
        if self.handed_back(r, out, enrp, now) || self.kept_after_takeover(r, out, enrp, now) {
            self.detach(r, true, out);
        } else {
            self.remove_pe(r, Removal::KeepAliveTimeout, out, enrp, now);
        }
    }

    /// The driver's answer to [`Action::CheckDelivery`] for connection `id`: `on_its_way` when
    /// what was written to it may not have arrived yet. The PEs over it whose keep-alive
    /// timed out then wait another keep-alive timeout, up to
    /// [`Config::keep_alive_wait_limit`] after the keep-alive; the others are unanswered.
    /// A PE that hangs over a path that lost packets lately so leaves that much later.
    pub(super) fn delivery_checked(
        &mut self,
        id: ConnId,
        on_its_way: bool,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        let Some(pes) = out.delivery_answered(id) else {
            return;
        };
        for r in pes {
            let m = self.meta_of(r);
            if !m.delivery_asked || m.conn != Some(id) {
                continue;
            }
            let waiting = matches!(self.hs.timer(r), Some((TimerKind::KeepAliveTimeout, _)));
            self.set_meta(
                r,
                PeMeta {
                    delivery_asked: false,
                    ..m
                },
            );
            let limit = m.keep_alive_sent + self.cfg.keep_alive_wait_limit();
            if !waiting {
                // Answered meanwhile.
            } else if on_its_way && now < limit {
                self.counters.keep_alive_timeouts_held_on_lossy_path += 1;
                let due = (now + Duration::from_millis(self.cfg.keep_alive_timeout_ms)).min(limit);
                self.hold_keep_alive(r, due);
            } else {
                self.keep_alive_unanswered(r, out, enrp, now);
            }
        }
    }

    /// Unbinds PE `r` from its association. With `unanswered` (its keep-alive went
    /// unanswered), an association left without PEs is reset: what is still queued on it must
    /// not arrive later (an ENDPOINT_KEEP_ALIVE with the H bit would make the PE adopt a home
    /// that no longer has it and leave the home that does), and a PE that was only out of
    /// reach learns from the reset that it must register again, instead of at its next
    /// re-registration.
    fn detach(&mut self, r: PeRef, unanswered: bool, out: &mut Conns) {
        let m = self.meta_of(r);
        if let Some(conn) = m.conn
            && let Some(c) = out.get_mut(conn)
            && let Some(pos) = c.pes.iter().position(|&x| x == r)
        {
            c.pes.swap_remove(pos);
            if unanswered && c.pes.is_empty() {
                out.abort(conn);
            }
        }
        self.set_meta(r, PeMeta { conn: None, ..m });
    }

    /// An ASAP message on connection `id`.
    pub(super) fn handle_message(
        &mut self,
        id: ConnId,
        buf: &[u8],
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        let mut report = std::mem::take(&mut self.report);
        report.clear();
        let decoded = AsapMessage::decode_with_report(buf, &mut report);
        if !report.is_empty() {
            let msg = AsapMessage::Error {
                error: OperationError {
                    causes: report.clone(),
                },
            };
            out.send_asap(id, &msg, now);
        }
        self.report = report;
        let msg = match decoded {
            Ok(m) => m,
            Err(e) => return out.reject_malformed(id, &e, now),
        };
        if matches!(
            msg,
            AsapMessage::Registration { .. } | AsapMessage::EndpointKeepAliveAck { .. }
        ) {
            out.heard_from_network(now);
        }
        match msg {
            AsapMessage::Registration {
                pool_handle,
                pool_element,
            } => self.on_registration(id, pool_handle, pool_element, out, enrp, now),
            AsapMessage::Deregistration { pool_handle, pe_id } => {
                self.on_deregistration(id, pool_handle, pe_id, out, enrp, now)
            }
            AsapMessage::HandleResolution {
                subscribe,
                pool_handle,
                items,
            } => {
                let synchronising = enrp.is_starting();
                self.on_handle_resolution(
                    id,
                    pool_handle,
                    items,
                    subscribe,
                    synchronising,
                    out,
                    now,
                )
            }
            AsapMessage::EndpointKeepAliveAck { pool_handle, pe_id } => {
                self.on_keep_alive_ack(id, &pool_handle, pe_id, out, now)
            }
            AsapMessage::EndpointUnreachable { pool_handle, pe_id } => {
                self.on_unreachable(id, &pool_handle, pe_id, out, enrp, now)
            }
            AsapMessage::Error { error } => {
                if out.peer_log.allow(now)
                    && let Some(peer) = out.peer(id)
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
                out.protocol_error(id, &err, Some(cause), now);
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

    #[allow(clippy::too_many_arguments)]
    fn reject_registration(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        pe_id: u32,
        cause: ErrorCause,
        why: &dyn std::fmt::Display,
        out: &mut Conns,
        now: Instant,
    ) {
        self.counters.registrations_rejected += 1;
        if let Some(peer) = out.peer(id)
            && out.limit_log(id, Offence::Registration, now)
        {
            warn!(
                "{peer}: registration of PE {pe_id:#010x} in pool {pool_handle} rejected: {why} \
                 (logged once a minute per source address and offence)"
            );
        }
        let msg = AsapMessage::RegistrationResponse {
            reject: true,
            pool_handle,
            pe_id,
            error: Some(OperationError::single(cause)),
        };
        out.send_asap(id, &msg, now);
    }

    /// The positive REGISTRATION_RESPONSE.
    fn accept_registration(
        id: ConnId,
        pool_handle: PoolHandle,
        pe_id: u32,
        out: &mut Conns,
        now: Instant,
    ) {
        let msg = AsapMessage::RegistrationResponse {
            reject: false,
            pool_handle,
            pe_id,
            error: None,
        };
        out.send_asap(id, &msg, now);
    }

    fn on_registration(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        mut pe: PoolElement,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        let Some(c) = out.get(id) else { return };
        let (peer, over_sctp) = (c.peer, c.sctp);
        let pes_here = c.pes.len();
        let pe_id = pe.id;
        if self.cfg.tls_cert.is_some() && !c.authenticated {
            let cause = ErrorCause::new(CauseCode::REJECTED_SECURITY);
            let why = "no client certificate (with TLS on, a PE needs one from the CA)";
            self.reject_registration(id, pool_handle, pe_id, cause, &why, out, now);
            return;
        }
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
                self.probe(r, out, now);
                let cause = ErrorCause::new(CauseCode::NON_UNIQUE_PE_IDENTIFIER);
                let why = "the PE identifier is registered over another association";
                self.reject_registration(id, pool_handle, pe_id, cause, &why, out, now);
                return;
            }
        }
        // A PE that moves its home here keeps its transport; the same identifier with another
        // transport, while a registrar (a peer, or this one holding it after a takeover) has
        // it, is another PE: an impostor, or one restarted elsewhere with a fixed identifier
        // before its old entry is gone (its home removes that one, then a retry succeeds).
        if let Some(r) = existing
            && !bound
            && self.hs.pe(r).element.user_transport != pe.user_transport
        {
            let known = &self.hs.pe(r).element;
            let cause = ErrorCause::new(CauseCode::NON_UNIQUE_PE_IDENTIFIER);
            let why = format!(
                "the PE identifier is registered (home registrar {:#010x}) with another \
                 transport address ({}, this one {})",
                known.home_registrar, known.user_transport, pe.user_transport
            );
            self.reject_registration(id, pool_handle, pe_id, cause, &why, out, now);
            return;
        }
        let full = if existing.is_none() && self.hs.len() >= self.cfg.max_pes {
            Some((self.cfg.max_pes, "in the handlespace"))
        } else if !bound && pes_here >= self.cfg.max_pes_per_connection {
            Some((self.cfg.max_pes_per_connection, "per connection"))
        } else {
            None
        };
        if let Some((limit, of)) = full {
            let cause = ErrorCause::new(CauseCode::LACK_OF_RESOURCES);
            let why = format!("limit of {limit} PEs {of} reached");
            self.reject_registration(id, pool_handle, pe_id, cause, &why, out, now);
            return;
        }
        // RFC 5355 §3.5: a credit report beyond the capacity the PE declares is a lie (or a
        // bug); what the pool users see is held to the capacity.
        if let rserpool_wire::Policy::Credits { credits, capacity } = &mut pe.policy
            && *credits > *capacity
        {
            *credits = *capacity;
        }
        pe.home_registrar = self.id;
        // Over SCTP, a new home reaches the PE at its association's address and port (as
        // rsplib's PEs and rserpool's listen there); over TCP, at what it announced.
        let mut asap = if over_sctp {
            TransportAddress::tcp(peer)
        } else {
            TransportAddress::tcp(asap_transport(pe.asap_transport.as_ref(), peer))
        };
        if over_sctp {
            asap.protocol = Protocol::Sctp { transport_use: 0 };
            // Milliseconds over SCTP (rserpool_wire::sctp_life).
            pe.registration_life = rserpool_wire::sctp_life::from_sctp(pe.registration_life);
        }
        pe.asap_transport = Some(asap);
        // RFC 5354: seconds; -1 (or any value below 1) means infinite.
        let expiry = lifetime_expiry(pe.registration_life, now);
        // RFC 5355 §3.5: a PE that changes its policy faster than `max-rereg-rate` would make
        // every peer pay for each change. Its lifetime is renewed; the rest waits for the next
        // re-registration within the rate (reports are whole values, so none is lost for long).
        if let Some(r) = existing
            && bound
            && let Some(c) = out.get_mut(id)
            && !c.rereg_bucket.take(self.cfg.max_rereg_rate, now)
        {
            self.counters.reregistrations_limited += 1;
            if out.limit_log(id, Offence::Reregistration, now) {
                warn!(
                    "{peer}: re-registrations beyond {}/s from this association: the PE's entry \
                     is kept as it was until the rate allows (logged once a minute per source \
                     address and offence)",
                    self.cfg.max_rereg_rate
                );
            }
            self.set_meta(
                r,
                PeMeta {
                    conn: Some(id),
                    expiry,
                    ..NO_META
                },
            );
            self.schedule_supervision(r, now);
            Self::accept_registration(id, pool_handle, pe_id, out, now);
            return;
        }
        let result = match existing {
            Some(r) => self
                .hs
                .reregister(r, pe, now.as_millis())
                .map(|()| Registered { pe: r, new: false }),
            None => self.hs.register(&pool_handle, pe, now.as_millis()),
        };
        match result {
            Ok(reg) => {
                let r = reg.pe;
                self.set_meta(
                    r,
                    PeMeta {
                        conn: Some(id),
                        expiry,
                        ..NO_META
                    },
                );
                if !bound && let Some(c) = out.get_mut(id) {
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
                let element = &self.hs.pe(r).element;
                enrp.update(UpdateAction::AddPe, &pool_handle, element, out, now);
                Self::accept_registration(id, pool_handle, pe_id, out, now);
            }
            Err(e) => {
                let cause = e.cause();
                self.reject_registration(id, pool_handle, pe_id, cause, &e, out, now);
            }
        }
    }

    fn on_deregistration(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        pe_id: u32,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        let mut error = None;
        if let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) {
            if self.meta_of(r).conn == Some(id) {
                self.remove_pe(r, Removal::Deregistered, out, enrp, now);
                self.counters.deregistrations += 1;
            } else {
                self.counters.deregistrations_rejected += 1;
                if out.peer_log.allow(now)
                    && let Some(peer) = out.peer(id)
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
        out.send_asap(id, &msg, now);
    }

    fn refuse_resolution(
        id: ConnId,
        accept: bool,
        pool_handle: PoolHandle,
        code: CauseCode,
        out: &mut Conns,
        now: Instant,
    ) {
        let msg = AsapMessage::HandleResolutionResponse {
            accept,
            pool_handle,
            policy: None,
            pool_elements: Vec::new(),
            error: Some(OperationError::single(ErrorCause::new(code))),
        };
        out.send_asap(id, &msg, now);
    }

    /// `synchronising`: ENRP is still filling the handlespace from a mentor, so a pool missing
    /// here may exist elsewhere; the pool user is sent to another registrar (LACK_OF_RESOURCES)
    /// rather than told that the pool does not exist. `subscribe`: the S bit; the pool user
    /// is then sent the pool again whenever it changes ([`Subscriptions`]).
    #[allow(clippy::too_many_arguments)]
    fn on_handle_resolution(
        &mut self,
        id: ConnId,
        pool_handle: PoolHandle,
        items: Option<u32>,
        subscribe: bool,
        synchronising: bool,
        out: &mut Conns,
        now: Instant,
    ) {
        let (max_hr_rate, default_items, max_items) = (
            self.cfg.max_hr_rate,
            self.cfg.max_hres_items,
            self.cfg.max_hres_items_requested,
        );
        let Some(c) = out.get_mut(id) else { return };
        if !c.hr_bucket.take(max_hr_rate, now) {
            let peer = c.peer;
            c.refused_in_a_row = c.refused_in_a_row.saturating_add(1);
            self.counters.resolutions_rate_limited += 1;
            if out.limit_log(id, Offence::Resolution, now) {
                warn!(
                    "{peer}: handle resolutions refused, more than {max_hr_rate}/s from this pool \
                     user; one that has a second's worth (at least 1,000) refused in a row is closed (logged once \
                     a minute per source address and offence)"
                );
            }
            if out.flooding(id, max_hr_rate) {
                // A second's worth refused in a row: a flood, not a burst.
                self.counters.flooders_closed += 1;
                out.close(id);
                return;
            }
            let code = CauseCode::REJECTED_SECURITY;
            Self::refuse_resolution(id, false, pool_handle, code, out, now);
            return;
        }
        c.refused_in_a_row = 0;
        self.counters.resolutions += 1;
        let n = items.unwrap_or(default_items).min(max_items) as usize;
        let scratch = &mut self.scratch;
        scratch.clear();
        let found = self.hs.resolve(pool_handle.as_bytes(), n, scratch);
        let accept = subscribe
            && !synchronising
            && self.subs.add(
                id,
                &pool_handle,
                self.hs.pool_version(pool_handle.as_bytes()),
            );
        if !found || scratch.is_empty() {
            let cause = if synchronising {
                CauseCode::LACK_OF_RESOURCES
            } else {
                self.counters.resolutions_unknown_pool += 1;
                CauseCode::UNKNOWN_POOL_HANDLE
            };
            Self::refuse_resolution(id, accept, pool_handle, cause, out, now);
            return;
        }
        out.write_resolution(id, accept, &pool_handle, &self.hs, scratch, now);
    }

    /// Sends every subscribed pool that changed since its last push (after each input).
    pub(super) fn push_subscriptions(&mut self, out: &mut Conns, now: Instant) {
        let max = self.cfg.max_hres_items_requested as usize;
        self.subs.push(&self.hs, max, &mut self.scratch, out, now);
        self.counters.subscription_pushes = self.subs.pushes();
        self.counters.subscriptions = self.subs.len() as u64;
    }

    /// An association ended: its subscriptions too.
    pub(super) fn unsubscribe(&mut self, id: ConnId) {
        self.subs.closed(id);
    }

    fn on_keep_alive_ack(
        &mut self,
        id: ConnId,
        pool_handle: &PoolHandle,
        pe_id: u32,
        out: &mut Conns,
        now: Instant,
    ) {
        let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) else {
            return;
        };
        if self.meta_of(r).conn != Some(id) {
            if out.peer_log.allow(now)
                && let Some(peer) = out.peer(id)
            {
                warn!(
                    "{peer}: ignored ENDPOINT_KEEP_ALIVE_ACK for PE {pe_id:#010x} of another association"
                );
            }
            return;
        }
        self.counters.keep_alive_acks += 1;
        self.hs.heard(r, now.as_millis());
        let m = self.meta_of(r);
        if m.taken_from != 0 {
            self.set_meta(
                r,
                PeMeta {
                    takeover_answered: true,
                    ..m
                },
            );
        }
        if matches!(self.hs.timer(r), Some((TimerKind::KeepAliveTimeout, _))) {
            self.schedule_supervision(r, now);
        }
    }

    fn on_unreachable(
        &mut self,
        id: ConnId,
        pool_handle: &PoolHandle,
        pe_id: u32,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        let rate = self.cfg.max_eu_rate;
        let Some(c) = out.get_mut(id) else { return };
        if !c.eu_bucket.take(rate, now) {
            let peer = c.peer;
            c.refused_in_a_row = c.refused_in_a_row.saturating_add(1);
            self.counters.unreachable_rate_limited += 1;
            if out.limit_log(id, Offence::Unreachable, now) {
                warn!(
                    "{peer}: ENDPOINT_UNREACHABLE ignored, more than {rate}/s from this pool user; \
                     one that has a second's worth (at least 1,000) ignored in a row is closed (logged once a \
                     minute per source address and offence)"
                );
            }
            if out.flooding(id, rate) {
                self.counters.flooders_closed += 1;
                out.close(id);
            }
            return;
        }
        c.refused_in_a_row = 0;
        self.counters.unreachable_reports += 1;
        let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) else {
            return;
        };
        let n = self.hs.report_unreachable(r);
        if n < self.cfg.max_bad_pe_reports {
            self.probe(r, out, now);
            return;
        }
        // Reports are cheap to forge: the PE's service is checked before the PE goes.
        let pe = self.hs.pe(r).element.clone();
        if !self.probes.start(pool_handle, &pe, out, now) {
            self.remove_pe(r, Removal::Unreachable, out, enrp, now);
        }
    }

    /// Whether `id` is a probe of a PE's service.
    pub(super) fn is_probe(&self, id: ConnId) -> bool {
        self.probes.is_probe(id)
    }

    /// A probe's connection is up: the PE's service answers and stays; its reports are
    /// forgotten.
    pub(super) fn probe_answered(&mut self, id: ConnId, out: &mut Conns, now: Instant) {
        let Some(p) = self.probes.end(id) else {
            return;
        };
        out.close(id);
        let Some(r) = self.hs.find(p.pool.as_bytes(), p.pe_id) else {
            return;
        };
        self.hs.touch(r, now.as_millis());
        self.counters.unreachable_refuted += 1;
        if self.event_log.allow(now) {
            warn!(
                "PE {:#010x} of pool {} reported unreachable {} times, but its service answers: kept",
                p.pe_id, p.pool, self.cfg.max_bad_pe_reports
            );
        }
    }

    /// A probe's connection failed (`id` was a probe): the PE's service does not answer, and
    /// the PE is removed. Returns whether `id` was a probe.
    pub(super) fn probe_failed(
        &mut self,
        id: ConnId,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) -> bool {
        let Some(p) = self.probes.end(id) else {
            return false;
        };
        if let Some(r) = self.hs.find(p.pool.as_bytes(), p.pe_id) {
            self.remove_pe(r, Removal::Unreachable, out, enrp, now);
        }
        true
    }

    /// Next supervision step of a home PE: a keep-alive after the interval, or the end of its
    /// registration life if that comes first.
    fn schedule_supervision(&mut self, r: PeRef, now: Instant) {
        let m = self.meta_of(r);
        let next = now + Duration::from_millis(self.cfg.keep_alive_interval_ms);
        if m.conn.is_none() || m.expiry <= next {
            self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
        } else {
            self.schedule(r, TimerKind::KeepAliveTransmission, next);
        }
    }

    fn schedule(&mut self, r: PeRef, kind: TimerKind, at: Instant) {
        self.hs.schedule_timer(r, kind, at.as_millis());
    }

    /// Sends an ENDPOINT_KEEP_ALIVE now unless one is already outstanding.
    fn probe(&mut self, r: PeRef, out: &mut Conns, now: Instant) {
        if !matches!(self.hs.timer(r), Some((TimerKind::KeepAliveTimeout, _))) {
            self.send_keep_alive(r, false, out, now);
        }
    }

    /// `home`: the H bit, telling the PE that this registrar is its home now (takeover).
    fn send_keep_alive(&mut self, r: PeRef, home: bool, out: &mut Conns, now: Instant) {
        let m = self.meta_of(r);
        let Some(conn) = m.conn else {
            self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
            return;
        };
        let msg = AsapMessage::EndpointKeepAlive {
            home,
            server_id: self.id,
            pool_handle: self.hs.pool_handle_of(r).clone(),
            pe_id: Some(self.hs.pe(r).element.id),
        };
        self.counters.keep_alives_sent += 1;
        out.send_asap(conn, &msg, now);
        self.set_meta(
            r,
            PeMeta {
                keep_alive_sent: now,
                delivery_asked: false,
                ..m
            },
        );
        let timeout = now + Duration::from_millis(self.cfg.keep_alive_timeout_ms);
        if m.expiry <= timeout {
            self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
        } else {
            self.schedule(r, TimerKind::KeepAliveTimeout, timeout);
        }
    }

    fn remove_pe(
        &mut self,
        r: PeRef,
        why: Removal,
        out: &mut Conns,
        enrp: &mut Enrp,
        now: Instant,
    ) {
        self.detach(r, why == Removal::KeepAliveTimeout, out);
        self.set_meta(r, NO_META);
        let handle = self.hs.pool_handle_of(r).clone();
        let pe = self.hs.remove(r);
        if pe.home_registrar == self.id {
            enrp.update(UpdateAction::DelPe, &handle, &pe, out, now);
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

    /// The pools as `rserpool status` shows them.
    pub(super) fn pool_status(&self, now: Instant) -> Vec<PoolStatus> {
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
                            ms_since_heard: now.as_millis().saturating_sub(e.last_heard),
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
        pools
    }
}

impl HandlespaceView for Asap {
    fn checksum(&self, owner: u32) -> u16 {
        self.hs.checksum(owner)
    }

    fn owned_count(&self, owner: u32) -> usize {
        self.hs.owned_count(owner)
    }

    fn len(&self) -> usize {
        self.hs.len()
    }

    fn homes(&self) -> Vec<u32> {
        self.hs.owners().collect()
    }

    fn owned_pes(&self, owner: u32) -> BTreeSet<(PoolHandle, u32)> {
        self.hs
            .owned(owner)
            .map(|r| (self.hs.pool_handle_of(r).clone(), self.hs.pe(r).element.id))
            .collect()
    }

    fn apply_update(
        &mut self,
        sender: u32,
        action: UpdateAction,
        pool_handle: PoolHandle,
        pe: PoolElement,
        now: Instant,
    ) -> Result<(), RegistrationError> {
        let existing = self.hs.find(pool_handle.as_bytes(), pe.id);
        if let Some(r) = existing
            && self.meta_of(r).conn.is_some()
        {
            // Ours, with a live association: that association decides.
            debug!(
                "HANDLE_UPDATE from {sender:#010x} for our PE {:#010x} ignored",
                pe.id
            );
            return Ok(());
        }
        match action {
            UpdateAction::AddPe => {
                let expiry = lifetime_expiry(pe.registration_life, now);
                let r = match existing {
                    Some(r) => self.hs.reregister(r, pe, now.as_millis()).map(|()| r),
                    None => self
                        .hs
                        .register(&pool_handle, pe, now.as_millis())
                        .map(|reg| reg.pe),
                }?;
                self.set_meta(
                    r,
                    PeMeta {
                        conn: None,
                        expiry,
                        ..NO_META
                    },
                );
                self.schedule(r, TimerKind::LifetimeExpiry, expiry);
            }
            UpdateAction::DelPe => {
                // Only the PE's home removes it: a late DEL_PE from a former home must not
                // remove a PE that has moved on.
                if let Some(r) = existing
                    && self.hs.pe(r).element.home_registrar == sender
                {
                    self.set_meta(r, NO_META);
                    self.hs.remove(r);
                }
            }
        }
        Ok(())
    }

    fn disown(&mut self, pool_handle: &PoolHandle, pe_id: u32) -> bool {
        let Some(r) = self.hs.find(pool_handle.as_bytes(), pe_id) else {
            return true;
        };
        if self.meta_of(r).conn.is_some() {
            return false;
        }
        self.set_meta(r, NO_META);
        self.hs.remove(r);
        true
    }

    fn remove_stale(&mut self, owner: u32, marked: BTreeSet<(PoolHandle, u32)>) -> usize {
        let mut removed = 0;
        for (handle, pe_id) in marked {
            if let Some(r) = self.hs.find(handle.as_bytes(), pe_id)
                && self.hs.pe(r).element.home_registrar == owner
                && self.meta_of(r).conn.is_none()
            {
                self.set_meta(r, NO_META);
                self.hs.remove(r);
                removed += 1;
            }
        }
        removed
    }

    fn sync_begin(&mut self, owner: Option<u32>) -> SyncCursor {
        self.hs.sync_begin(owner)
    }

    fn sync_end(&mut self, cursor: SyncCursor) {
        self.hs.sync_end(cursor);
    }

    fn table_block(&mut self, cursor: SyncCursor, max: usize) -> (Vec<PoolEntry>, bool) {
        let mut refs: Vec<PeRef> = Vec::new();
        let more = self.hs.sync_next(cursor, max, &mut refs);
        let mut pools: Vec<PoolEntry> = Vec::new();
        let mut by_pool: HashMap<PoolHandle, usize> = HashMap::new();
        for r in refs {
            let handle = self.hs.pool_handle_of(r);
            let at = *by_pool.entry(handle.clone()).or_insert_with(|| {
                pools.push(PoolEntry {
                    pool_handle: handle.clone(),
                    pool_elements: Vec::new(),
                });
                pools.len() - 1
            });
            pools[at].pool_elements.push(self.hs.pe(r).element.clone());
        }
        (pools, more)
    }

    fn take_over(&mut self, target: u32, out: &mut Conns, now: Instant) -> usize {
        let refs: Vec<PeRef> = self.hs.owned(target).collect();
        // One association per PE address, however many PEs share it.
        let mut conns: HashMap<SocketAddr, ConnId> = HashMap::new();
        for &r in &refs {
            self.hs.set_home(r, self.id);
            let transport = self.hs.pe(r).element.asap_transport.as_ref();
            let addr = transport.and_then(|t| t.socket_addrs().next());
            // A PE that registered over SCTP (at us or at the peer) is reached over SCTP.
            let sctp = transport.is_some_and(|t| matches!(t.protocol, Protocol::Sctp { .. }));
            let conn = match addr {
                Some(a) => match conns.get(&a) {
                    Some(&c) => Some(c),
                    None => {
                        let c = out.connect(a, false, now);
                        if let Some(c) = c {
                            if let Some(cc) = out.get_mut(c) {
                                cc.sctp = sctp;
                            }
                            conns.insert(a, c);
                        }
                        c
                    }
                },
                None => None,
            };
            let m = self.meta_of(r);
            self.set_meta(
                r,
                PeMeta {
                    conn,
                    taken_from: target,
                    ..m
                },
            );
            match conn {
                Some(c) => {
                    if let Some(cc) = out.get_mut(c) {
                        cc.pes.push(r);
                    }
                    self.send_keep_alive(r, true, out, now);
                }
                None => self.schedule(r, TimerKind::LifetimeExpiry, m.expiry),
            }
        }
        refs.len()
    }

    fn hand_over(&mut self, target: u32, home: u32) -> usize {
        let refs: Vec<PeRef> = self.hs.owned(target).collect();
        let mut moved = 0;
        for r in refs {
            let m = self.meta_of(r);
            if m.conn.is_none() {
                self.hs.set_home(r, home);
                // A PE held after its association closed lives on as the new home's.
                self.schedule(r, TimerKind::LifetimeExpiry, m.expiry);
                moved += 1;
            }
        }
        moved
    }
}

/// When a registration life (seconds; below 1 = infinite) that starts at `now` runs out.
fn lifetime_expiry(life: i32, now: Instant) -> Instant {
    match u64::try_from(life) {
        Ok(s) if s > 0 => now + Duration::from_secs(s),
        _ => Instant::MAX,
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
