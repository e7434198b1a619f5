//! The registrar's protocol state machine, sans-IO.
//!
//! Bytes, connection events and the time go in; [`Action`]s for the driver come out of one
//! queue ([`Registrar::poll_action`]), and [`Registrar::poll_timeout`] says when to call
//! [`Registrar::handle_timeout`] next. No sockets and no clock in here, so the same logic runs
//! under the socket driver and under a simulated network.
//!
//! [`Registrar`] is assembled from narrow parts, quinn-proto style:
//! - `conns`: the connections, their buffers and the outbox of actions;
//! - `asap`: ASAP handling, which owns the handlespace;
//! - `enrp`: ENRP, which owns the peers and reaches the handlespace through a narrow view.
//!
//! This file frames incoming bytes and dispatches each message to its part.

use crate::config::Config;
use crate::status::{Counters, EnrpCounters, MetricsView, PeerStatus, Status};
use bytes::Bytes;
use rserpool_handlespace::Handlespace;
use rserpool_wire::{CauseCode, ErrorCause};
use std::net::SocketAddr;
use std::sync::Arc;

mod asap;
mod conns;
mod enrp;
mod limit;
mod probe;
mod subscribe;

use asap::Asap;
use conns::Conns;
pub use conns::{Action, ConnId};
use enrp::Enrp;
pub use rserpool_wire::Instant;

/// An ASAP association as a successor takes it over (see [`Registrar::handover`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Adoptable {
    /// Its connection here (the driver hands the successor that socket).
    #[serde(skip, default = "no_conn")]
    pub id: ConnId,
    pub peer: SocketAddr,
    /// Its REGISTRATIONs, encoded.
    pub registrations: Vec<u8>,
    /// Its subscribing HANDLE_RESOLUTIONs, encoded (replayed once every pool is back).
    pub subscriptions: Vec<u8>,
    /// Bytes read but not yet a whole message.
    pub unread: Vec<u8>,
    /// Bytes queued for it and not yet written.
    pub unsent: Vec<u8>,
}

fn no_conn() -> ConnId {
    ConnId::from_index(usize::MAX >> 33)
}

/// A REGISTRATION of `element` in `handle`, appended to `out`.
fn encode_registration(
    handle: &rserpool_wire::PoolHandle,
    element: rserpool_wire::PoolElement,
    out: &mut Vec<u8>,
) {
    let msg = rserpool_wire::AsapMessage::Registration {
        pool_handle: handle.clone(),
        pool_element: element,
    };
    let _ = rserpool_wire::Message::encode(&msg, out);
}

/// The registrar's protocol state: handlespace, associations, PE supervision, ENRP peers.
pub struct Registrar {
    cfg: Arc<Config>,
    id: u32,
    started: Instant,
    conns: Conns,
    asap: Asap,
    enrp: Enrp,
}

impl Registrar {
    /// A registrar with ID `id` (the Server Identifier, also the home registrar of its PEs).
    pub fn new(cfg: Config, id: u32, now: Instant) -> Self {
        let cfg = Arc::new(cfg);
        Self {
            conns: Conns::new(cfg.clone(), id),
            asap: Asap::new(cfg.clone(), id, now),
            enrp: Enrp::new(cfg.clone(), id),
            cfg,
            id,
            started: now,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn handlespace(&self) -> &Handlespace {
        self.asap.handlespace()
    }

    /// Starts sending SERVER_ANNOUNCE every T6 ([`Action::Announce`]), naming `asap` as where
    /// to reach this registrar.
    pub fn enable_announce(&mut self, asap: SocketAddr, now: Instant) {
        self.asap.enable_announce(asap, now);
    }

    /// Starts ENRP: `local` is this registrar's ENRP address; configured peers are connected,
    /// and with any configured, the registrar looks for a mentor to synchronise from.
    pub fn enable_enrp(&mut self, local: SocketAddr, now: Instant) {
        self.enrp.enable(local, &self.asap, &mut self.conns, now);
    }

    /// True while the registrar synchronises at start (it serves meanwhile, but does not
    /// announce itself to PEs yet).
    pub fn is_starting(&self) -> bool {
        self.enrp.is_starting()
    }

    /// A new ASAP connection from `peer`; `None` when the connection limit is reached (close
    /// it).
    pub fn accept(&mut self, peer: SocketAddr, now: Instant) -> Option<ConnId> {
        self.conns.open(peer, false, now)
    }

    /// A new ENRP connection from another registrar; `None` over the connection limit, or
    /// from a host not among the configured peers with `enrp-peers-only` (close it).
    pub fn accept_enrp(&mut self, peer: SocketAddr, now: Instant) -> Option<ConnId> {
        let cfg = self.config();
        if cfg.enrp_peers_only && !cfg.peer_addrs().any(|p| p.ip() == peer.ip()) {
            self.conns.refuse_stranger(peer, now);
            return None;
        }
        self.conns.open(peer, true, now)
    }

    /// Connection `id` is an SCTP association: PRESENCE over it names the SCTP address.
    pub fn mark_sctp(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(id) {
            c.sctp = true;
        }
    }

    /// Whether connection `id` is (or is to be opened as) an SCTP association.
    pub fn is_sctp(&self, id: ConnId) -> bool {
        self.conns.is_sctp(id)
    }

    /// This registrar's ENRP address over SCTP, named to peers connected over SCTP.
    pub fn enable_enrp_sctp(&mut self, local: SocketAddr) {
        self.enrp.local_sctp = Some(local);
    }

    /// True for a connection to or from a peer registrar.
    pub fn is_enrp(&self, id: ConnId) -> bool {
        self.conns.is_enrp(id)
    }

    /// The connection's peer address.
    pub fn peer(&self, id: ConnId) -> Option<SocketAddr> {
        self.conns.peer(id)
    }

    /// Bytes read from a connection.
    pub fn handle_data(&mut self, id: ConnId, data: &[u8], now: Instant) {
        self.read(id, data, now);
        self.asap.push_subscriptions(&mut self.conns, now);
    }

    fn read(&mut self, id: ConnId, data: &[u8], now: Instant) {
        if self.asap.is_probe(id) {
            return; // A service's own bytes (a banner), not ASAP.
        }
        let mut input = data;
        loop {
            let Some(c) = self.conns.live_mut(id) else {
                return;
            };
            let enrp = c.enrp;
            match c.framer.next_from(&mut input) {
                Ok(Some(msg)) if enrp => {
                    self.enrp
                        .handle_message(id, &msg, &mut self.asap, &mut self.conns, now)
                }
                Ok(Some(msg)) => {
                    self.asap
                        .handle_message(id, &msg, &mut self.conns, &mut self.enrp, now)
                }
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
                    self.conns.protocol_error(id, &e, Some(cause), now);
                    self.conns.close(id);
                    return;
                }
            }
        }
    }

    /// The connection's peer presented a certificate from the CA (its TLS handshake is done):
    /// it may register PEs.
    pub fn authenticated(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(id) {
            c.authenticated = true;
        }
    }

    /// The connection's TLS handshake failed (`why`): counted and logged (rate-limited); the
    /// driver closes it.
    pub fn tls_refused(&mut self, id: ConnId, why: &str, now: Instant) {
        self.conns.tls_refused(id, why, now);
    }

    /// The driver can answer [`Action::CheckDelivery`]: a keep-alive that times out while TCP
    /// still carries it (a lossy path) waits for its answer, within
    /// [`Config::keep_alive_wait_limit`].
    pub fn enable_delivery_checks(&mut self) {
        self.conns.delivery_checks = true;
    }

    /// The answer to [`Action::CheckDelivery`]: `on_its_way` when what was written to `id` may
    /// not have arrived yet.
    pub fn handle_delivery(&mut self, id: ConnId, on_its_way: bool, now: Instant) {
        self.asap
            .delivery_checked(id, on_its_way, &mut self.conns, &mut self.enrp, now);
        self.asap.push_subscriptions(&mut self.conns, now);
    }

    /// An outgoing connection is up. Only a probe ([`Action::Probe`]) cares: the PE's
    /// service answers, so the reports about it were false.
    pub fn handle_connected(&mut self, id: ConnId, now: Instant) {
        self.asap.probe_answered(id, &mut self.conns, now);
    }

    /// The other end closed the connection (end of stream), reset it or refused it: its host
    /// answered, so the network reaches this registrar. Then as [`handle_close`](Self::handle_close).
    pub fn handle_closed_by_peer(&mut self, id: ConnId, now: Instant) {
        self.conns.heard_from_network(now);
        self.handle_close(id, now);
    }

    /// The connection closed: by the peer, an error, a failed [`Action::Connect`] or
    /// [`Action::Probe`], or after [`Action::Close`]. Its PEs leave the handlespace.
    pub fn handle_close(&mut self, id: ConnId, now: Instant) {
        let Some(c) = self.conns.remove(id) else {
            return;
        };
        if self
            .asap
            .probe_failed(id, &mut self.conns, &mut self.enrp, now)
        {
            self.asap.push_subscriptions(&mut self.conns, now);
            return;
        }
        if c.enrp {
            self.enrp.closed(id, &mut self.asap, &mut self.conns, now);
        }
        self.asap.unsubscribe(id);
        self.asap
            .connection_closed(c.pes, &mut self.conns, &mut self.enrp, now);
        self.asap.push_subscriptions(&mut self.conns, now);
    }

    /// A UDP datagram arrived on the ENRP port (a PRESENCE, to discover peers).
    pub fn handle_datagram(&mut self, data: &[u8], now: Instant) {
        self.enrp
            .handle_datagram(data, &self.asap, &mut self.conns, now);
    }

    /// The ASAP associations a successor can take over ([`adopt`](Self::adopt)): every live
    /// ASAP connection but probes — those PEs opened, and those this registrar opened to the
    /// PEs it took over — each with its registrations and subscriptions encoded again as the
    /// requests that made them (the PEs' ASAP transports included, so that a later takeover
    /// still finds them). ENRP connections are not among them: the peers connect again.
    pub fn handover(&self) -> Vec<Adoptable> {
        let hs = self.asap.handlespace();
        let mut v = Vec::new();
        for id in self.conns.ids() {
            let Some(c) = self.conns.get(id) else {
                continue;
            };
            if c.enrp || self.asap.is_probe(id) {
                continue;
            }
            let mut registrations = Vec::new();
            for &r in &c.pes {
                let element = hs.pe(r).element.clone();
                encode_registration(hs.pool_handle_of(r), element, &mut registrations);
            }
            let mut subscriptions = Vec::new();
            for handle in self.asap.subscribed(id) {
                let msg = rserpool_wire::AsapMessage::HandleResolution {
                    subscribe: true,
                    pool_handle: handle,
                    items: None,
                };
                let _ = rserpool_wire::Message::encode(&msg, &mut subscriptions);
            }
            v.push(Adoptable {
                id,
                peer: c.peer,
                registrations,
                subscriptions,
                unread: c.framer.buffered_bytes().to_vec(),
                unsent: self.conns.output(id).to_vec(),
            });
        }
        v
    }

    /// The PEs other registrars are home for, as REGISTRATIONs naming their homes, for a
    /// successor ([`adopt_peer_pes`](Self::adopt_peer_pes)): it answers with the whole
    /// handlespace at once, not only this registrar's own PEs until ENRP has synchronised it.
    pub fn peer_pes(&self) -> Vec<u8> {
        let hs = self.asap.handlespace();
        let mut out = Vec::new();
        for (handle, _, _) in hs.pools() {
            for r in hs.members(handle.as_bytes()) {
                let element = &hs.pe(r).element;
                if element.home_registrar != self.id {
                    encode_registration(hs.pool_handle_of(r), element.clone(), &mut out);
                }
            }
        }
        out
    }

    /// Takes in the PEs of other registrars a predecessor held ([`peer_pes`](Self::peer_pes)),
    /// as ENRP would; returns how many.
    pub fn adopt_peer_pes(&mut self, encoded: &[u8], now: Instant) -> usize {
        use enrp::HandlespaceView;
        let mut framer = rserpool_wire::Framer::new(self.cfg.max_message_size);
        let mut input = encoded;
        let mut n = 0;
        while let Ok(Some(frame)) = framer.next_from(&mut input) {
            if let Ok(rserpool_wire::AsapMessage::Registration {
                pool_handle,
                pool_element,
            }) = <rserpool_wire::AsapMessage as rserpool_wire::Message>::decode(&frame)
            {
                let home = pool_element.home_registrar;
                let added = self.asap.apply_update(
                    home,
                    rserpool_wire::UpdateAction::AddPe,
                    pool_handle,
                    pool_element,
                    now,
                );
                n += usize::from(added.is_ok());
            }
        }
        n
    }

    /// Takes over an association of a predecessor ([`handover`](Self::handover)): it is
    /// opened as accepted from `a.peer`, its registrations are replayed without answering them,
    /// then its unsent output is queued and its partial input read. Its subscriptions follow
    /// once every association is in ([`adopt_subscriptions`](Self::adopt_subscriptions)).
    /// `None` over the connection limit.
    pub fn adopt(&mut self, a: &Adoptable, now: Instant) -> Option<ConnId> {
        let id = self.conns.open(a.peer, false, now)?;
        self.read(id, &a.registrations, now);
        self.conns.truncate_output(id, 0);
        if !a.unsent.is_empty() {
            self.conns.send_bytes(id, &a.unsent, now);
        }
        self.handle_data(id, &a.unread, now);
        Some(id)
    }

    /// Replays the subscriptions of adopted association `id` without answering them: the pools
    /// are whole by now, so the next push is a real change.
    pub fn adopt_subscriptions(&mut self, id: ConnId, a: &Adoptable, now: Instant) {
        let before = self.conns.output(id).len();
        self.read(id, &a.subscriptions, now);
        self.conns.truncate_output(id, before);
    }

    /// The next thing for the driver to do, in the order the core decided them.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.conns.poll_action()
    }

    /// The bytes queued for a connection (empty if none), for [`Action::Transmit`]. The driver
    /// writes them from here and then calls [`consume_output`](Self::consume_output) with what
    /// the socket took, so output is never copied and a peer that does not read is still
    /// counted against the pending limit.
    pub fn output(&self, id: ConnId) -> &[u8] {
        self.conns.output(id)
    }

    /// `n` bytes of [`output`](Self::output) were written.
    pub fn consume_output(&mut self, id: ConnId, n: usize) {
        self.conns.consume_output(id, n);
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout) has work; it may be
    /// early, never late.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let asap = self.asap.poll_timeout();
        let enrp = self.enrp.poll_timeout();
        asap.into_iter().chain(enrp).min()
    }

    /// Runs the timers due at `now`: ENRP's, keep-alives and their timeouts, lifetime expiry,
    /// announces.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.enrp
            .handle_timeout(&mut self.asap, &mut self.conns, now);
        self.asap
            .handle_timeout(&mut self.conns, &mut self.enrp, now);
        self.asap.push_subscriptions(&mut self.conns, now);
    }

    /// The peers as `rserpool status` shows them.
    pub fn peer_status(&self, now: Instant) -> Vec<PeerStatus> {
        self.enrp.peer_status(&self.asap, now)
    }

    pub fn enrp_counters(&self) -> &EnrpCounters {
        self.enrp.counters()
    }

    /// What `GET /metrics` shows: counters and sizes, nothing per PE.
    pub fn metrics(&self, now: Instant) -> MetricsView {
        let mut pool_sizes: Vec<(String, usize)> = self
            .handlespace()
            .pools()
            .map(|(handle, _, n)| (handle.to_string(), n))
            .collect();
        pool_sizes.sort();
        MetricsView {
            server_id: self.id,
            connections: self.conns.len(),
            pool_sizes,
            home_pes: enrp::HandlespaceView::owned_count(&self.asap, self.id),
            counters: self.counters(),
            enrp: self.enrp.counters().clone(),
            peers: self.peer_status(now),
            xds: None,
        }
    }

    fn counters(&self) -> Counters {
        let mut counters = self.asap.counters().clone();
        self.conns.add_counters(&mut counters);
        counters
    }

    /// The handlespace as `rserpool status` shows it.
    pub fn status(&self, now: Instant) -> Status {
        let counters = self.counters();
        Status {
            server_id: self.id,
            uptime_ms: now.as_millis().saturating_sub(self.started.as_millis()),
            connections: self.conns.len(),
            pool_elements: self.handlespace().len(),
            pools: self.asap.pool_status(now),
            counters,
            peers: self.peer_status(now),
            enrp: self.enrp.counters().clone(),
            xds: None,
        }
    }
}
