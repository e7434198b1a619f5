//! ENRP (RFC 5353) in the registrar core: the peer table, PRESENCE and liveness, HANDLE_UPDATE
//! for every change of a PE this registrar is home for, start-up synchronisation from a mentor,
//! audits by checksum, and takeover of a dead peer's PEs.
//!
//! Connections between registrars are one-way for sending: a registrar sends to a peer over the
//! connection it opened to that peer's ENRP address, and reads whatever arrives on any ENRP
//! connection. A pair of registrars therefore holds two connections, and neither side has to
//! agree with the other on which one to keep. Each message to all peers is encoded once and its
//! bytes are appended to every peer's connection (the seed paper's SCTP_SENDALL idea); the driver
//! writes each connection's queue in one `write`, which batches updates under load.
//!
//! A peer whose connection fails, or that stays silent for MAX-TIME-LAST-HEARD, is asked for a
//! PRESENCE with the R bit; with no answer within MAX-TIME-NO-RESPONSE (or a second connection
//! failure) this registrar starts a takeover (RFC 5353 §3.5). The new home opens an ASAP
//! connection to each PE's ASAP transport address and sends ENDPOINT_KEEP_ALIVE with the H bit,
//! over which the PE then carries on, without registering again.

use super::{ConnId, NO_META, PeMeta, Registrar};
use crate::status::{EnrpCounters, PeerStatus};
use rserpool_handlespace::{PeRef, SyncCursor, TimerKind};
use rserpool_wire::{
    EnrpBody, EnrpMessage, OperationError, PoolElement, PoolEntry, PoolHandle, ServerInformation,
    TransportAddress, UpdateAction,
};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use tracing::{debug, info, warn};

/// What this registrar believes about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Liveness {
    Alive,
    /// A PRESENCE with the R bit is out; takeover at `deadline` without an answer.
    Probing {
        deadline: u64,
    },
    /// Our takeover of this peer: waiting for the INIT_TAKEOVER_ACKs in `Peer::acks_pending`.
    TakingOver {
        deadline: u64,
    },
    /// Another registrar is taking it over.
    Inactive,
}

/// A HANDLE_TABLE_REQUEST of ours that awaits its response.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    own_only: bool,
    deadline: u64,
}

/// A peer registrar as this one knows it.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// 0 until the peer's first message names it.
    pub id: u32,
    pub addr: SocketAddr,
    /// The connection this registrar sends over.
    pub conn: Option<ConnId>,
    pub last_heard: u64,
    /// The ownership checksum the peer last announced.
    pub checksum: Option<u16>,
    state: Liveness,
    acks_pending: Vec<u32>,
    request: Option<Request>,
    /// Our traversal answering the peer's HANDLE_TABLE_REQUESTs (and its W bit).
    serving: Option<(SyncCursor, bool)>,
    /// Audit in progress: the peer's PEs not yet confirmed by its HANDLE_TABLE_RESPONSEs.
    marked: Option<BTreeSet<(PoolHandle, u32)>>,
}

impl Peer {
    fn new(id: u32, addr: SocketAddr, now: u64) -> Self {
        Self {
            id,
            addr,
            conn: None,
            last_heard: now,
            checksum: None,
            state: Liveness::Alive,
            acks_pending: Vec::new(),
            request: None,
            serving: None,
            marked: None,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct EnrpState {
    /// Our ENRP address, announced in Server Information.
    pub local: Option<SocketAddr>,
    pub peers: Vec<Peer>,
    /// Outgoing connections the driver should open (ENRP to peers, ASAP to PEs taken over).
    pub connects: Vec<(ConnId, SocketAddr)>,
    pub next_heartbeat: u64,
    /// Start-up: looking for a mentor until this time, or synchronising from `mentor`.
    pub starting: Option<u64>,
    pub mentor: Option<u32>,
    /// A PRESENCE for the driver to send as a UDP datagram (multicast).
    pub datagram: Option<Vec<u8>>,
    pub counters: EnrpCounters,
}

impl Registrar {
    /// Starts ENRP: `local` is this registrar's ENRP address; configured peers are connected,
    /// and with any configured, the registrar looks for a mentor to synchronise from.
    pub fn enable_enrp(&mut self, local: SocketAddr, now: u64) {
        self.enrp.local = Some(local);
        for addr in self.cfg.peer.clone() {
            if addr != local && !self.enrp.peers.iter().any(|p| p.addr == addr) {
                self.add_peer(0, addr, now);
            }
        }
        if !self.enrp.peers.is_empty() {
            self.enrp.starting = Some(now.saturating_add(self.cfg.mentor_discovery_ms));
        }
        self.enrp.next_heartbeat = now;
    }

    /// True while the registrar synchronises at start (it serves meanwhile, but does not
    /// announce itself to PEs yet).
    pub fn is_starting(&self) -> bool {
        self.enrp.starting.is_some()
    }

    /// The next outgoing connection to open: report the outcome with
    /// [`handle_close`](Self::handle_close) if it fails; bytes queued on it are written once it
    /// is up.
    pub fn poll_connect(&mut self) -> Option<(ConnId, SocketAddr)> {
        self.enrp.connects.pop()
    }

    /// A new ENRP connection from another registrar.
    pub fn accept_enrp(&mut self, peer: SocketAddr, now: u64) -> Option<ConnId> {
        self.open_conn(peer, true, now)
    }

    /// A PRESENCE to send as a UDP datagram to the multicast group, if one is due.
    pub fn poll_datagram(&mut self) -> Option<Vec<u8>> {
        self.enrp.datagram.take()
    }

    /// A UDP datagram arrived on the ENRP port: only PRESENCE is accepted there, to discover
    /// peers (everything else travels over TCP).
    pub fn handle_datagram(&mut self, data: &[u8], now: u64) {
        let Ok(msg) = EnrpMessage::decode(data) else {
            if self.peer_log.allow(now) {
                warn!("ignored a malformed ENRP datagram");
            }
            return;
        };
        if msg.sender == self.id || msg.sender == 0 {
            return;
        }
        if matches!(msg.body, EnrpBody::Presence { .. }) {
            self.heard_peer(msg.sender, &msg.body, now);
        }
    }

    /// The peers as `rserpool status` shows them.
    pub fn peer_status(&self, now: u64) -> Vec<PeerStatus> {
        self.enrp
            .peers
            .iter()
            .map(|p| PeerStatus {
                id: p.id,
                address: p.addr.to_string(),
                ms_since_heard: now.saturating_sub(p.last_heard),
                state: match p.state {
                    Liveness::Alive if p.id == 0 => "connecting",
                    Liveness::Alive => "alive",
                    Liveness::Probing { .. } => "probing",
                    Liveness::TakingOver { .. } => "taking over",
                    Liveness::Inactive => "inactive",
                }
                .to_string(),
                connected: p.conn.is_some(),
                checksum: p.checksum,
                checksum_agrees: p.checksum.map(|c| c == self.hs.checksum(p.id)),
                pes_owned: self.hs.owned_count(p.id),
            })
            .collect()
    }

    pub fn enrp_counters(&self) -> &EnrpCounters {
        &self.enrp.counters
    }

    fn add_peer(&mut self, id: u32, addr: SocketAddr, now: u64) -> usize {
        self.enrp.peers.push(Peer::new(id, addr, now));
        let i = self.enrp.peers.len() - 1;
        self.connect_peer(i, now);
        i
    }

    fn peer_index(&self, id: u32) -> Option<usize> {
        self.enrp.peers.iter().position(|p| p.id == id && id != 0)
    }

    fn connect_peer(&mut self, i: usize, now: u64) {
        let addr = self.enrp.peers[i].addr;
        let Some(conn) = self.open_conn(addr, true, now) else {
            return;
        };
        self.enrp.peers[i].conn = Some(conn);
        self.enrp.connects.push((conn, addr));
        // Introduce ourselves; the peer answers with its own PRESENCE.
        let msg = self.presence(self.enrp.peers[i].id, true);
        self.send_enrp(conn, &msg, now);
    }

    fn presence(&self, receiver: u32, reply_required: bool) -> EnrpMessage {
        EnrpMessage {
            sender: self.id,
            receiver,
            body: EnrpBody::Presence {
                reply_required,
                checksum: Some(self.hs.checksum(self.id)),
                server_info: self.enrp.local.map(|a| ServerInformation {
                    server_id: self.id,
                    transport: TransportAddress::tcp(a),
                }),
            },
        }
    }

    fn send_enrp(&mut self, conn: ConnId, msg: &EnrpMessage, now: u64) {
        let Some(c) = self.conn_mut(conn) else { return };
        if c.closing {
            return;
        }
        if let Err(e) = msg.encode(&mut c.out) {
            warn!("cannot encode {}: {e}", msg.body.name());
            return;
        }
        self.mark_written(conn, now);
    }

    /// An ENRP ERROR on `conn`. The connection may be one we only read from; the peer reads
    /// every ENRP connection, so it still arrives.
    pub(super) fn send_enrp_error(&mut self, conn: ConnId, error: OperationError, now: u64) {
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::Error { error },
        };
        self.send_enrp(conn, &msg, now);
    }

    /// Sends to the peer with ID `id` over our connection to it, if there is one.
    fn send_to_peer(&mut self, id: u32, body: EnrpBody, now: u64) {
        let Some(conn) = self.peer_index(id).and_then(|i| self.enrp.peers[i].conn) else {
            return;
        };
        let msg = EnrpMessage {
            sender: self.id,
            receiver: id,
            body,
        };
        self.send_enrp(conn, &msg, now);
    }

    /// Sends `msg` to every peer, encoded once.
    fn send_all(&mut self, msg: &EnrpMessage, now: u64) {
        let conns: Vec<ConnId> = self.enrp.peers.iter().filter_map(|p| p.conn).collect();
        if conns.is_empty() {
            return;
        }
        let bytes = match msg.to_bytes() {
            Ok(b) => b,
            Err(e) => {
                warn!("cannot encode {}: {e}", msg.body.name());
                return;
            }
        };
        for conn in conns {
            if let Some(c) = self.conn_mut(conn)
                && !c.closing
            {
                c.out.extend_from_slice(&bytes);
                self.mark_written(conn, now);
            }
        }
    }

    /// Tells every peer about a change of a PE this registrar is home for.
    pub(super) fn enrp_update(
        &mut self,
        action: UpdateAction,
        pool_handle: &PoolHandle,
        pe: &PoolElement,
        now: u64,
    ) {
        if self.enrp.peers.is_empty() {
            return;
        }
        self.enrp.counters.updates_sent += 1;
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::HandleUpdate {
                takeover_suggested: false,
                action,
                pool_handle: pool_handle.clone(),
                pool_element: pe.clone(),
            },
        };
        self.send_all(&msg, now);
    }

    /// Heartbeat, liveness, request and start-up timers.
    pub(super) fn enrp_timeout(&mut self, now: u64) {
        if self.enrp.local.is_none() {
            return;
        }
        if let Some(deadline) = self.enrp.starting
            && self.enrp.mentor.is_none()
            && deadline <= now
        {
            info!("no mentor registrar answered: serving with the handlespace as it is");
            self.enrp.starting = None;
        }
        if self.enrp.next_heartbeat <= now {
            self.heartbeat(now);
        }
        for i in (0..self.enrp.peers.len()).rev() {
            let p = &self.enrp.peers[i];
            let (id, state, request) = (p.id, p.state, p.request);
            if let Some(r) = request
                && r.deadline <= now
            {
                self.request_failed(i, "no HANDLE_TABLE_RESPONSE in time", now);
            }
            if id == 0 {
                continue;
            }
            match state {
                Liveness::Alive => {
                    let silent = self.enrp.peers[i]
                        .last_heard
                        .saturating_add(self.cfg.max_time_last_heard_ms);
                    if silent <= now {
                        self.probe_peer(i, now);
                    }
                }
                Liveness::Probing { deadline } if deadline <= now => {
                    warn!("ENRP peer {id:#010x} did not answer: taking over its PEs");
                    self.start_takeover(i, now);
                }
                Liveness::TakingOver { deadline } if deadline <= now => {
                    let missing = &self.enrp.peers[i].acks_pending;
                    warn!(
                        "takeover of {id:#010x} expired waiting for {} acknowledgement(s): trying again",
                        missing.len()
                    );
                    self.start_takeover(i, now);
                }
                _ => {}
            }
        }
    }

    fn heartbeat(&mut self, now: u64) {
        self.enrp.next_heartbeat = now + self.cfg.peer_heartbeat_ms.max(1);
        for i in 0..self.enrp.peers.len() {
            if self.enrp.peers[i].conn.is_none() {
                self.connect_peer(i, now);
            }
        }
        let msg = self.presence(0, false);
        self.send_all(&msg, now);
        if self.cfg.enrp_multicast {
            self.enrp.datagram = msg.to_bytes().ok();
        }
    }

    /// Asks a silent peer for a PRESENCE (R bit); takeover follows without an answer.
    fn probe_peer(&mut self, i: usize, now: u64) {
        let p = &mut self.enrp.peers[i];
        p.state = Liveness::Probing {
            deadline: now.saturating_add(self.cfg.max_time_no_response_ms),
        };
        let (id, conn) = (p.id, p.conn);
        debug!("ENRP peer {id:#010x} silent or disconnected: asking for PRESENCE");
        match conn {
            None => self.connect_peer(i, now),
            Some(conn) => {
                let msg = self.presence(id, true);
                self.send_enrp(conn, &msg, now);
            }
        }
    }

    pub(super) fn enrp_next_timeout(&self) -> Option<u64> {
        self.enrp.local?;
        let mut t = self.enrp.next_heartbeat;
        if let (Some(s), None) = (self.enrp.starting, self.enrp.mentor) {
            t = t.min(s);
        }
        for p in &self.enrp.peers {
            if let Some(r) = p.request {
                t = t.min(r.deadline);
            }
            if p.id == 0 {
                continue;
            }
            t = t.min(match p.state {
                Liveness::Alive => p.last_heard.saturating_add(self.cfg.max_time_last_heard_ms),
                Liveness::Probing { deadline } | Liveness::TakingOver { deadline } => deadline,
                Liveness::Inactive => u64::MAX,
            });
        }
        Some(t)
    }

    /// An ENRP connection closed. A peer we send over it counts as failing: it is asked for a
    /// PRESENCE over a new connection, and taken over if that fails too.
    pub(super) fn enrp_closed(&mut self, id: ConnId, now: u64) {
        let Some(i) = self.enrp.peers.iter().position(|p| p.conn == Some(id)) else {
            return;
        };
        self.enrp.peers[i].conn = None;
        let p = &self.enrp.peers[i];
        if self.enrp.local.is_none() || p.id == 0 {
            return;
        }
        match p.state {
            Liveness::Alive => self.probe_peer(i, now),
            Liveness::Probing { .. } => {
                warn!("ENRP peer {:#010x} unreachable: taking over its PEs", p.id);
                self.start_takeover(i, now);
            }
            Liveness::TakingOver { .. } | Liveness::Inactive => {}
        }
    }

    pub(super) fn handle_enrp(&mut self, id: ConnId, buf: &[u8], now: u64) {
        let msg = match EnrpMessage::decode(buf) {
            Ok(m) => m,
            Err(e) => return self.reject_malformed(id, &e, now),
        };
        if msg.sender == self.id || msg.sender == 0 {
            return;
        }
        if msg.receiver != 0 && msg.receiver != self.id {
            debug!(
                "ENRP {} from {:#010x} for {:#010x} ignored",
                msg.body.name(),
                msg.sender,
                msg.receiver
            );
            return;
        }
        let Some(i) = self.heard_peer(msg.sender, &msg.body, now) else {
            debug!(
                "ENRP {} from unknown {:#010x} ignored",
                msg.body.name(),
                msg.sender
            );
            return;
        };
        let sender = msg.sender;
        match msg.body {
            EnrpBody::Presence {
                reply_required,
                checksum,
                ..
            } => {
                self.enrp.peers[i].checksum = checksum;
                if reply_required {
                    let reply = self.presence(sender, false);
                    if let Some(conn) = self.enrp.peers[i].conn {
                        self.send_enrp(conn, &reply, now);
                    }
                }
                self.choose_mentor(i, now);
                if let Some(c) = checksum {
                    self.check_audit(i, c, now);
                }
            }
            EnrpBody::HandleUpdate {
                action,
                pool_handle,
                pool_element,
                ..
            } => {
                self.enrp.counters.updates_received += 1;
                if action == UpdateAction::AddPe
                    && let Some(marked) = &mut self.enrp.peers[i].marked
                {
                    marked.remove(&(pool_handle.clone(), pool_element.id));
                }
                self.apply_update(sender, action, pool_handle, pool_element, now);
            }
            EnrpBody::HandleTableRequest { own_children_only } => {
                self.serve_handle_table(i, own_children_only, now);
            }
            EnrpBody::HandleTableResponse {
                reject,
                more,
                pools,
            } => self.on_handle_table(i, reject, more, pools, now),
            EnrpBody::ListRequest => {
                let mut servers: Vec<ServerInformation> = self
                    .enrp
                    .peers
                    .iter()
                    .filter(|p| p.id != 0 && p.id != sender && p.state == Liveness::Alive)
                    .map(|p| ServerInformation {
                        server_id: p.id,
                        transport: TransportAddress::tcp(p.addr),
                    })
                    .collect();
                if let Some(a) = self.enrp.local {
                    servers.push(ServerInformation {
                        server_id: self.id,
                        transport: TransportAddress::tcp(a),
                    });
                }
                let body = EnrpBody::ListResponse {
                    reject: false,
                    servers,
                };
                self.send_to_peer(sender, body, now);
            }
            EnrpBody::ListResponse { reject, servers } => {
                if !reject {
                    for s in servers {
                        self.learn_peer(s, now);
                    }
                }
            }
            EnrpBody::InitTakeover { target } => self.on_init_takeover(sender, target, now),
            EnrpBody::InitTakeoverAck { target } => {
                if let Some(t) = self.peer_index(target)
                    && matches!(self.enrp.peers[t].state, Liveness::TakingOver { .. })
                {
                    self.enrp.peers[t].acks_pending.retain(|&a| a != sender);
                    if self.enrp.peers[t].acks_pending.is_empty() {
                        self.finish_takeover(t, now);
                    }
                }
            }
            EnrpBody::TakeoverServer { target } => self.on_takeover_server(sender, target, now),
            EnrpBody::Error { error } => {
                if self.peer_log.allow(now) {
                    let causes: Vec<String> =
                        error.causes.iter().map(|c| c.code.to_string()).collect();
                    warn!(
                        "ENRP peer {sender:#010x} reports an error: {}",
                        causes.join(", ")
                    );
                }
            }
        }
    }

    /// Notes that `sender` spoke; learns a new peer from a PRESENCE with Server Information.
    fn heard_peer(&mut self, sender: u32, body: &EnrpBody, now: u64) -> Option<usize> {
        if let Some(i) = self.peer_index(sender) {
            self.revive(i, now);
            return Some(i);
        }
        let EnrpBody::Presence {
            server_info: Some(si),
            ..
        } = body
        else {
            return None;
        };
        self.learn_peer(si.clone(), now)
    }

    /// Any message from a peer: it is alive, and a takeover of it is off.
    fn revive(&mut self, i: usize, now: u64) {
        let p = &mut self.enrp.peers[i];
        p.last_heard = now;
        match p.state {
            Liveness::Alive => {}
            Liveness::TakingOver { .. } => {
                info!("ENRP peer {:#010x} is alive: takeover aborted", p.id);
                p.acks_pending.clear();
                p.state = Liveness::Alive;
                self.enrp.counters.takeovers_aborted += 1;
            }
            Liveness::Probing { .. } | Liveness::Inactive => {
                debug!("ENRP peer {:#010x} is alive", p.id);
                p.state = Liveness::Alive;
            }
        }
    }

    fn learn_peer(&mut self, si: ServerInformation, now: u64) -> Option<usize> {
        let id = si.server_id;
        if id == 0 || id == self.id {
            return None;
        }
        if let Some(i) = self.peer_index(id) {
            return Some(i);
        }
        let addr = si.transport.socket_addrs().next()?;
        // A configured peer names itself with its first PRESENCE.
        if let Some(i) = self
            .enrp
            .peers
            .iter()
            .position(|p| p.id == 0 && p.addr == addr)
        {
            self.enrp.peers[i].id = id;
            self.enrp.peers[i].last_heard = now;
            info!("ENRP peer {id:#010x} at {addr}");
            return Some(i);
        }
        info!("ENRP peer {id:#010x} at {addr} (announced itself)");
        Some(self.add_peer(id, addr, now))
    }

    /// Start-up: the first peer heard becomes the mentor; ask it for its peers and handlespace.
    fn choose_mentor(&mut self, i: usize, now: u64) {
        if self.enrp.starting.is_none() || self.enrp.mentor.is_some() {
            return;
        }
        let id = self.enrp.peers[i].id;
        info!("synchronising the handlespace from mentor registrar {id:#010x}");
        self.enrp.mentor = Some(id);
        self.send_to_peer(id, EnrpBody::ListRequest, now);
        self.request_handle_table(i, false, now);
    }

    fn request_handle_table(&mut self, i: usize, own_only: bool, now: u64) {
        let p = &mut self.enrp.peers[i];
        p.request = Some(Request {
            own_only,
            deadline: now.saturating_add(self.cfg.max_time_no_response_ms),
        });
        let id = p.id;
        self.send_to_peer(
            id,
            EnrpBody::HandleTableRequest {
                own_children_only: own_only,
            },
            now,
        );
    }

    fn request_failed(&mut self, i: usize, why: &str, now: u64) {
        let p = &mut self.enrp.peers[i];
        p.request = None;
        p.marked = None;
        let id = p.id;
        if self.peer_log.allow(now) {
            warn!("handle table from {id:#010x}: {why}");
        }
        if self.enrp.mentor == Some(id) {
            // Another peer that speaks becomes the mentor; the discovery deadline still holds.
            self.enrp.mentor = None;
            let retry = now.saturating_add(self.cfg.mentor_discovery_ms);
            self.enrp.starting = Some(retry);
        }
    }

    /// Audit (RFC 5353 §3.6): a peer announcing a checksum for its own PEs other than ours for
    /// them sends us its PEs again; those it no longer has are then removed.
    fn check_audit(&mut self, i: usize, checksum: u16, now: u64) {
        let p = &self.enrp.peers[i];
        if p.request.is_some() || self.enrp.starting.is_some() || p.state != Liveness::Alive {
            return;
        }
        let id = p.id;
        if self.hs.checksum(id) == checksum {
            return;
        }
        debug!(
            "checksum of {id:#010x}: announced {checksum:#06x}, ours {:#06x}: audit",
            self.hs.checksum(id)
        );
        self.enrp.counters.audits += 1;
        let marked: BTreeSet<(PoolHandle, u32)> = self
            .hs
            .owned(id)
            .map(|r| (self.hs.pool_handle_of(r).clone(), self.hs.pe(r).element.id))
            .collect();
        self.enrp.peers[i].marked = Some(marked);
        self.request_handle_table(i, true, now);
    }

    fn serve_handle_table(&mut self, i: usize, own_only: bool, now: u64) {
        let cursor = match self.enrp.peers[i].serving {
            Some((c, w)) if w == own_only => c,
            old => {
                if let Some((c, _)) = old {
                    self.hs.sync_end(c);
                }
                self.hs.sync_begin(own_only.then_some(self.id))
            }
        };
        let mut refs: Vec<PeRef> = Vec::new();
        let max = self.cfg.max_elements_per_ht_request.max(1);
        let more = self.hs.sync_next(cursor, max, &mut refs);
        self.enrp.peers[i].serving = more.then_some((cursor, own_only));
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
        self.enrp.counters.handle_table_blocks_sent += 1;
        let id = self.enrp.peers[i].id;
        let body = EnrpBody::HandleTableResponse {
            reject: false,
            more,
            pools,
        };
        self.send_to_peer(id, body, now);
    }

    fn on_handle_table(
        &mut self,
        i: usize,
        reject: bool,
        more: bool,
        pools: Vec<PoolEntry>,
        now: u64,
    ) {
        let Some(req) = self.enrp.peers[i].request else {
            return;
        };
        if reject {
            self.request_failed(i, "request rejected", now);
            return;
        }
        let sender = self.enrp.peers[i].id;
        for entry in pools {
            for pe in entry.pool_elements {
                self.enrp.counters.handle_table_entries_received += 1;
                if let Some(marked) = &mut self.enrp.peers[i].marked {
                    marked.remove(&(entry.pool_handle.clone(), pe.id));
                }
                if pe.home_registrar == self.id {
                    continue;
                }
                self.apply_update(
                    sender,
                    UpdateAction::AddPe,
                    entry.pool_handle.clone(),
                    pe,
                    now,
                );
            }
        }
        if more {
            self.request_handle_table(i, req.own_only, now);
            return;
        }
        self.enrp.peers[i].request = None;
        if let Some(marked) = self.enrp.peers[i].marked.take() {
            let mut swept = 0;
            for (handle, pe_id) in marked {
                if let Some(r) = self.hs.find(handle.as_bytes(), pe_id)
                    && self.hs.pe(r).element.home_registrar == sender
                    && self.meta_of(r).conn.is_none()
                {
                    self.set_meta(r, NO_META);
                    self.hs.remove(r);
                    swept += 1;
                }
            }
            if swept > 0 {
                info!("audit of {sender:#010x}: {swept} PE(s) it no longer has removed");
            }
        }
        if self.enrp.mentor == Some(sender) && self.enrp.starting.is_some() {
            self.enrp.starting = None;
            info!(
                "synchronised from mentor {sender:#010x}: {} PEs in the handlespace",
                self.hs.len()
            );
        }
    }

    fn apply_update(
        &mut self,
        sender: u32,
        action: UpdateAction,
        pool_handle: PoolHandle,
        pe: PoolElement,
        now: u64,
    ) {
        let existing = self.hs.find(pool_handle.as_bytes(), pe.id);
        if let Some(r) = existing
            && self.meta_of(r).conn.is_some()
        {
            // Ours, with a live association: that association decides.
            debug!(
                "HANDLE_UPDATE from {sender:#010x} for our PE {:#010x} ignored",
                pe.id
            );
            return;
        }
        match action {
            UpdateAction::AddPe => {
                let expiry = lifetime_expiry(pe.registration_life, now);
                let result = match existing {
                    Some(r) => self.hs.reregister(r, pe, now).map(|()| r),
                    None => self.hs.register(&pool_handle, pe, now).map(|reg| reg.pe),
                };
                match result {
                    Ok(r) => {
                        self.set_meta(r, PeMeta { conn: None, expiry });
                        self.hs.schedule_timer(r, TimerKind::LifetimeExpiry, expiry);
                    }
                    Err(e) => {
                        if self.peer_log.allow(now) {
                            warn!("HANDLE_UPDATE from {sender:#010x} refused: {e}");
                        }
                    }
                }
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
    }

    /// RFC 5353 §3.5: INIT_TAKEOVER to all, then wait for an ACK from every live peer but the
    /// target.
    fn start_takeover(&mut self, i: usize, now: u64) {
        let target = self.enrp.peers[i].id;
        let acks: Vec<u32> = self
            .enrp
            .peers
            .iter()
            .filter(|p| p.id != 0 && p.id != target && p.state == Liveness::Alive)
            .map(|p| p.id)
            .collect();
        let p = &mut self.enrp.peers[i];
        p.state = Liveness::TakingOver {
            deadline: now.saturating_add(self.cfg.takeover_expiry_ms),
        };
        p.acks_pending = acks;
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::InitTakeover { target },
        };
        self.send_all(&msg, now);
        if self.enrp.peers[i].acks_pending.is_empty() {
            self.finish_takeover(i, now);
        }
    }

    fn on_init_takeover(&mut self, sender: u32, target: u32, now: u64) {
        if target == self.id {
            info!("registrar {sender:#010x} believes this one dead: announcing PRESENCE");
            let msg = self.presence(0, false);
            self.send_all(&msg, now);
            return;
        }
        if let Some(t) = self.peer_index(target) {
            let p = &mut self.enrp.peers[t];
            if matches!(p.state, Liveness::TakingOver { .. }) {
                if self.id > sender {
                    // Ours wins the tie-break: the other registrar yields.
                    return;
                }
                info!("registrar {sender:#010x} takes over {target:#010x}: ours aborted");
                p.acks_pending.clear();
            }
            p.state = Liveness::Inactive;
        }
        self.send_to_peer(sender, EnrpBody::InitTakeoverAck { target }, now);
    }

    /// Every ACK is in: announce the takeover, become home of the target's PEs and tell each
    /// of them with an ENDPOINT_KEEP_ALIVE carrying the H bit.
    fn finish_takeover(&mut self, i: usize, now: u64) {
        let target = self.enrp.peers[i].id;
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::TakeoverServer { target },
        };
        self.send_all(&msg, now);
        self.remove_peer(i, now);
        let refs: Vec<PeRef> = self.hs.owned(target).collect();
        let mut conns: HashMap<SocketAddr, ConnId> = HashMap::new();
        for &r in &refs {
            self.hs.set_home(r, self.id);
            let addr = self
                .hs
                .pe(r)
                .element
                .asap_transport
                .as_ref()
                .and_then(|t| t.socket_addrs().next());
            let conn = match addr {
                Some(a) => match conns.get(&a) {
                    Some(&c) => Some(c),
                    None => {
                        let c = self.open_conn(a, false, now);
                        if let Some(c) = c {
                            conns.insert(a, c);
                            self.enrp.connects.push((c, a));
                        }
                        c
                    }
                },
                None => None,
            };
            let expiry = self.meta_of(r).expiry;
            self.set_meta(r, PeMeta { conn, expiry });
            match conn {
                Some(c) => {
                    if let Some(cc) = self.conn_mut(c) {
                        cc.pes.push(r);
                    }
                    self.send_keep_alive(r, true, now);
                }
                None => self.hs.schedule_timer(r, TimerKind::LifetimeExpiry, expiry),
            }
        }
        self.enrp.counters.takeovers += 1;
        self.enrp.counters.pes_taken_over += refs.len() as u64;
        warn!(
            "took over registrar {target:#010x}: home of its {} PE(s) now",
            refs.len()
        );
    }

    fn on_takeover_server(&mut self, sender: u32, target: u32, now: u64) {
        if target == self.id {
            // Cut off for a while and declared dead. The PEs still associated here stay; the
            // ones the new home reached moved already. Audits reconcile the rest.
            warn!("registrar {sender:#010x} took over this registrar: announcing PRESENCE");
            let msg = self.presence(0, false);
            self.send_all(&msg, now);
            return;
        }
        let refs: Vec<PeRef> = self.hs.owned(target).collect();
        info!(
            "registrar {sender:#010x} took over {target:#010x} ({} PE(s))",
            refs.len()
        );
        if let Some(t) = self.peer_index(target) {
            self.remove_peer(t, now);
        }
        for r in refs {
            if self.meta_of(r).conn.is_none() {
                self.hs.set_home(r, sender);
            }
        }
    }

    /// Forgets a peer (taken over). A configured address stays in the table, unnamed, so that
    /// a registrar restarted there is found again.
    fn remove_peer(&mut self, i: usize, now: u64) {
        let p = self.enrp.peers.swap_remove(i);
        if let Some((c, _)) = p.serving {
            self.hs.sync_end(c);
        }
        if let Some(conn) = p.conn {
            self.close(conn);
        }
        if self.enrp.mentor == Some(p.id) {
            self.enrp.mentor = None;
        }
        if self.cfg.peer.contains(&p.addr) && !self.enrp.peers.iter().any(|q| q.addr == p.addr) {
            self.enrp.peers.push(Peer::new(0, p.addr, now));
        }
    }
}

/// When a registration life (seconds; below 1 = infinite) that starts at `now` runs out.
pub(super) fn lifetime_expiry(life: i32, now: u64) -> u64 {
    match u64::try_from(life) {
        Ok(s) if s > 0 => now.saturating_add(s.saturating_mul(1000)),
        _ => u64::MAX,
    }
}
