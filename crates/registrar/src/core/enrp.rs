//! ENRP (RFC 5353) in the registrar core: the peer table, PRESENCE and liveness, HANDLE_UPDATE
//! for every change of a PE this registrar is home for, start-up synchronisation from a mentor,
//! audits by checksum, and takeover of a dead peer's PEs.
//!
//! [`Enrp`] owns the peers, the takeovers and the synchronisation state. It reaches the rest
//! of the registrar through two parameters only: the handlespace as a [`HandlespaceView`] (what
//! ENRP reads and changes of it, and "become home of these PEs", which is ASAP's to carry out)
//! and the connections ([`Conns`]), over which it sends and which it opens and closes.
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

use super::Instant;
use super::conns::{Action, ConnId, Conns};
use crate::config::Config;
use crate::status::{EnrpCounters, PeerStatus};
use bytes::Bytes;
use rserpool_handlespace::{RegistrationError, SyncCursor};
use rserpool_wire::Message;
use rserpool_wire::{
    EnrpBody, EnrpMessage, PoolElement, PoolEntry, PoolHandle, ServerInformation, TransportAddress,
    UpdateAction,
};
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// What ENRP needs of the handlespace, and of ASAP for a takeover.
pub(super) trait HandlespaceView {
    /// The ownership checksum over the PEs `owner` is home for (RFC 5353 §3.6).
    fn checksum(&self, owner: u32) -> u16;
    /// How many PEs `owner` is home for.
    fn owned_count(&self, owner: u32) -> usize;
    /// PEs in the handlespace.
    fn len(&self) -> usize;
    /// Every registrar some PE names as its home.
    fn homes(&self) -> Vec<u32>;
    /// The PEs `owner` is home for, by pool handle and PE ID (an audit starts from these).
    fn owned_pes(&self, owner: u32) -> BTreeSet<(PoolHandle, u32)>;
    /// A peer's HANDLE_UPDATE, or an entry of its HANDLE_TABLE_RESPONSE. A PE with an
    /// association here is left alone; only the PE's home removes it.
    fn apply_update(
        &mut self,
        sender: u32,
        action: UpdateAction,
        pool_handle: PoolHandle,
        pe: PoolElement,
        now: Instant,
    ) -> Result<(), RegistrationError>;
    /// A peer names this registrar home of PE `pe_id` of `pool_handle`: true when it has no
    /// association here, after removing any entry of it (it is not registered here).
    fn disown(&mut self, pool_handle: &PoolHandle, pe_id: u32) -> bool;
    /// Removes those of `marked` that are still `owner`'s and have no association here (an
    /// audit found that `owner` no longer has them); returns how many.
    fn remove_stale(&mut self, owner: u32, marked: BTreeSet<(PoolHandle, u32)>) -> usize;
    /// Starts a traversal of `owner`'s PEs, or of all PEs.
    fn sync_begin(&mut self, owner: Option<u32>) -> SyncCursor;
    fn sync_end(&mut self, cursor: SyncCursor);
    /// The traversal's next block of at most `max` PEs, by pool, for a
    /// HANDLE_TABLE_RESPONSE; true while more follow (the cursor ends with the last block).
    fn table_block(&mut self, cursor: SyncCursor, max: usize) -> (Vec<PoolEntry>, bool);
    /// Becomes home of `target`'s PEs and tells each over a new ASAP association
    /// (ENDPOINT_KEEP_ALIVE with the H bit); returns how many.
    fn take_over(&mut self, target: u32, out: &mut Conns, now: Instant) -> usize;
    /// Registrar `home` took over `target`: its PEs not associated here are `home`'s now;
    /// returns how many.
    fn hand_over(&mut self, target: u32, home: u32) -> usize;
}

/// What this registrar believes about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Liveness {
    Alive,
    /// A PRESENCE with the R bit is out; takeover at `deadline` without an answer.
    Probing {
        deadline: Instant,
    },
    /// Our takeover of this peer: waiting for the INIT_TAKEOVER_ACKs in `Peer::acks_pending`.
    TakingOver {
        deadline: Instant,
    },
    /// Another registrar is taking it over. Without its TAKEOVER_SERVER by `deadline` (its
    /// takeover was aborted, or it died too), the peer is probed again, so that a dead peer is
    /// always taken over by someone.
    Inactive {
        deadline: Instant,
    },
}

/// A HANDLE_TABLE_REQUEST of ours that awaits its response.
#[derive(Debug, Clone, Copy)]
struct Request {
    own_only: bool,
    deadline: Instant,
}

/// A peer registrar as this one knows it.
#[derive(Debug, Clone)]
struct Peer {
    /// 0 until the peer's first message names it.
    id: u32,
    addr: SocketAddr,
    /// The connection this registrar sends over.
    conn: Option<ConnId>,
    last_heard: Instant,
    /// When it was last asked for a PRESENCE (it was silent, or its connection failed), and
    /// whether the network had been heard lately then (see [`Enrp::start_probe`]).
    probed_at: Instant,
    probe_fresh: bool,
    /// The ownership checksum the peer last announced.
    checksum: Option<u16>,
    state: Liveness,
    acks_pending: Vec<u32>,
    /// Registrars taking this peer over whose INIT_TAKEOVER waits for our own probe of it:
    /// we heard it lately, and acknowledge only if it does not answer.
    acks_owed: Vec<u32>,
    request: Option<Request>,
    /// Our traversal answering the peer's HANDLE_TABLE_REQUESTs (and its W bit).
    serving: Option<(SyncCursor, bool)>,
    /// Audit in progress: the peer's PEs not yet confirmed by its HANDLE_TABLE_RESPONSEs.
    marked: Option<BTreeSet<(PoolHandle, u32)>>,
    /// A peer back after a takeover is not audited before this time; see [`Enrp::taken_over`].
    audit_after: Option<Instant>,
    /// A put-off takeover of it was logged (once until it is heard again).
    deferral_said: bool,
}

impl Peer {
    fn new(id: u32, addr: SocketAddr, now: Instant) -> Self {
        Self {
            id,
            addr,
            conn: None,
            last_heard: now,
            probed_at: now,
            probe_fresh: false,
            checksum: None,
            state: Liveness::Alive,
            acks_pending: Vec::new(),
            acks_owed: Vec::new(),
            request: None,
            serving: None,
            marked: None,
            audit_after: None,
            deferral_said: false,
        }
    }
}

/// A peer taken over lately; see [`Enrp::taken_over`].
struct TakenOver {
    target: u32,
    /// The registrar that took it over (this one, or a peer).
    by: u32,
    at: Instant,
    /// Taken over by us, and not yet told so: when it speaks again, it hears our
    /// TAKEOVER_SERVER, so that it hands over the PEs that moved instead of removing them.
    untold: bool,
}

/// ENRP's state: the peers, their takeovers, start-up synchronisation.
pub(super) struct Enrp {
    cfg: Arc<Config>,
    /// Our Server Identifier.
    id: u32,
    /// Our ENRP address, announced in Server Information; `None` until ENRP is enabled.
    local: Option<SocketAddr>,
    /// Our ENRP address over SCTP, announced instead to peers connected over SCTP (rsplib's
    /// registrar uses only an SCTP address it is given).
    pub(super) local_sctp: Option<SocketAddr>,
    peers: Vec<Peer>,
    /// Peers taken over lately (by us or another), and when. One that was only cut off comes
    /// back still claiming the PEs that moved to their new home, until its keep-alives to them
    /// fail; an audit meanwhile would take its claims for news and hand those PEs back to it.
    /// So it is audited only after [`Config::taken_over_window`].
    taken_over: Vec<TakenOver>,
    /// The registrar that told us it took us over (TAKEOVER_SERVER), and when.
    taken_over_by: Option<(u32, Instant)>,
    /// Homes of PEs that are neither this registrar nor a peer it knows, and since when: a
    /// registrar gone before this one heard of it, whose PEs still arrived in a peer's handle
    /// table. No peer's silence will ever take them over, so [`Self::adopt_orphans`] does.
    orphans: Vec<(u32, Instant)>,
    next_heartbeat: Instant,
    /// Start-up: looking for a mentor until this time, or synchronising from `mentor`.
    starting: Option<Instant>,
    mentor: Option<u32>,
    /// A takeover finished with no live peer left to acknowledge it: this registrar may be
    /// the one that was cut off, and its handlespace the one that is wrong. The next peer
    /// heard becomes the mentor of a new synchronisation, as at start.
    alone: bool,
    counters: EnrpCounters,
}

impl Enrp {
    pub(super) fn new(cfg: Arc<Config>, id: u32) -> Self {
        Self {
            cfg,
            id,
            local: None,
            local_sctp: None,
            peers: Vec::new(),
            taken_over: Vec::new(),
            taken_over_by: None,
            orphans: Vec::new(),
            next_heartbeat: Instant::default(),
            starting: None,
            mentor: None,
            alone: false,
            counters: EnrpCounters::default(),
        }
    }

    /// Starts ENRP: `local` is this registrar's ENRP address; configured peers are connected,
    /// and with any configured, the registrar looks for a mentor to synchronise from.
    pub(super) fn enable(
        &mut self,
        local: SocketAddr,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        self.local = Some(local);
        for addr in self.cfg.peer_addrs().collect::<Vec<_>>() {
            if addr != local && !self.peers.iter().any(|p| p.addr == addr) {
                self.add_peer(0, addr, hs, out, now);
            }
        }
        if !self.peers.is_empty() {
            self.starting = Some(now + ms(self.cfg.mentor_discovery_ms));
        }
        self.next_heartbeat = now;
    }

    /// True while the registrar synchronises at start.
    pub(super) fn is_starting(&self) -> bool {
        self.starting.is_some()
    }

    pub(super) fn counters(&self) -> &EnrpCounters {
        &self.counters
    }

    /// A UDP datagram on the ENRP port: only PRESENCE is accepted there, to discover peers
    /// (everything else travels over TCP).
    pub(super) fn handle_datagram(
        &mut self,
        data: &[u8],
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let Ok(msg) = EnrpMessage::decode(data) else {
            if out.peer_log.allow(now) {
                warn!("ignored a malformed ENRP datagram");
            }
            return;
        };
        if msg.sender == self.id || msg.sender == 0 {
            return;
        }
        out.heard_from_network(now);
        if matches!(msg.body, EnrpBody::Presence { .. }) {
            self.heard_peer(msg.sender, &msg.body, None, hs, out, now);
        }
    }

    /// The peers as `rserpool status` shows them.
    pub(super) fn peer_status(&self, hs: &impl HandlespaceView, now: Instant) -> Vec<PeerStatus> {
        self.peers
            .iter()
            .map(|p| PeerStatus {
                id: p.id,
                address: p.addr.to_string(),
                ms_since_heard: now.as_millis().saturating_sub(p.last_heard.as_millis()),
                state: match p.state {
                    // A connection (perhaps still being opened), and no PRESENCE over it yet.
                    Liveness::Alive if p.id == 0 && p.conn.is_some() => "not heard yet",
                    Liveness::Alive if p.id == 0 => "connecting",
                    Liveness::Alive => "alive",
                    Liveness::Probing { .. } => "probing",
                    Liveness::TakingOver { .. } => "taking over",
                    Liveness::Inactive { .. } => "inactive",
                }
                .to_string(),
                connected: p.conn.is_some(),
                checksum: p.checksum,
                checksum_agrees: p.checksum.map(|c| c == hs.checksum(p.id)),
                pes_owned: hs.owned_count(p.id),
            })
            .collect()
    }

    fn add_peer(
        &mut self,
        id: u32,
        addr: SocketAddr,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) -> usize {
        self.peers.push(Peer::new(id, addr, now));
        let i = self.peers.len() - 1;
        self.connect_peer(i, hs, out, now);
        i
    }

    /// Whether `id` is a peer we hear, not suspected.
    pub(super) fn is_alive(&self, id: u32) -> bool {
        self.peer_index(id)
            .is_some_and(|i| self.peers[i].state == Liveness::Alive)
    }

    fn peer_index(&self, id: u32) -> Option<usize> {
        self.peers.iter().position(|p| p.id == id && id != 0)
    }

    fn connect_peer(&mut self, i: usize, hs: &impl HandlespaceView, out: &mut Conns, now: Instant) {
        let addr = self.peers[i].addr;
        let Some(conn) = out.connect(addr, true, now) else {
            return;
        };
        self.peers[i].conn = Some(conn);
        // A peer configured with an SCTP address is reached over SCTP (the driver sees to it).
        let sctp = self
            .cfg
            .peer
            .iter()
            .any(|p| p.addr == addr && p.scheme.is_sctp());
        if let Some(c) = out.get_mut(conn).filter(|_| sctp) {
            c.sctp = true;
        }
        // Introduce ourselves; the peer answers with its own PRESENCE.
        let msg = self.presence(self.peers[i].id, true, hs, sctp);
        out.send_enrp(conn, &msg, now);
    }

    /// A PRESENCE for `receiver` (0: anyone), naming our address over SCTP when it travels
    /// over SCTP.
    fn presence(
        &self,
        receiver: u32,
        reply_required: bool,
        hs: &impl HandlespaceView,
        over_sctp: bool,
    ) -> EnrpMessage {
        EnrpMessage {
            sender: self.id,
            receiver,
            body: EnrpBody::Presence {
                reply_required,
                checksum: Some(hs.checksum(self.id)),
                server_info: self.local.map(|a| ServerInformation {
                    server_id: self.id,
                    transport: match self.local_sctp.filter(|_| over_sctp) {
                        Some(s) => TransportAddress {
                            protocol: rserpool_wire::Protocol::Sctp { transport_use: 0 },
                            ..TransportAddress::tcp(s)
                        },
                        None => TransportAddress::tcp(a),
                    },
                }),
            },
        }
    }

    /// Sends to the peer with ID `id` over our connection to it, if there is one.
    fn send_to_peer(&self, id: u32, body: EnrpBody, out: &mut Conns, now: Instant) {
        let Some(conn) = self.peer_index(id).and_then(|i| self.peers[i].conn) else {
            return;
        };
        let msg = EnrpMessage {
            sender: self.id,
            receiver: id,
            body,
        };
        out.send_enrp(conn, &msg, now);
    }

    /// Answers peer `to`'s request over `via`, the association it came on: the peer's own
    /// address (from its PRESENCE) may not be reachable from here, as with a tool that only
    /// looks at the handlespace (rsplib's hsdump) and lists its loopback addresses first.
    fn reply(&self, via: ConnId, to: u32, body: EnrpBody, out: &mut Conns, now: Instant) {
        let msg = EnrpMessage {
            sender: self.id,
            receiver: to,
            body,
        };
        out.send_enrp(via, &msg, now);
    }

    /// Sends `msg` to every peer, encoded once.
    /// A PRESENCE to every connected peer, each naming the address of its transport.
    fn send_presence_all(&self, hs: &impl HandlespaceView, out: &mut Conns, now: Instant) {
        for conn in self.peers.iter().filter_map(|p| p.conn) {
            let msg = self.presence(0, false, hs, out.is_sctp(conn));
            out.send_enrp(conn, &msg, now);
        }
    }

    fn send_all(&self, msg: &EnrpMessage, out: &mut Conns, now: Instant) {
        self.send_where(msg, |_| true, out, now);
    }

    /// Sends `msg` to the peers believed alive: named ones (heard since their connection
    /// opened) that are not suspected. A takeover's messages go only to them: a peer that is
    /// silent may be cut off with us, and a takeover decided meanwhile must not reach it when
    /// the link returns, seconds later, as if it were news (it would drop a live registrar and
    /// hand its PEs to one that may no longer have them). A connection still opening to a peer
    /// not yet heard is such a case: it may open only when the cut heals.
    fn send_alive(&self, msg: &EnrpMessage, out: &mut Conns, now: Instant) {
        self.send_where(msg, |p| p.id != 0 && p.state == Liveness::Alive, out, now);
    }

    /// Sends `msg`, encoded once, to the connected peers that `which` picks.
    fn send_where(
        &self,
        msg: &EnrpMessage,
        which: impl Fn(&Peer) -> bool,
        out: &mut Conns,
        now: Instant,
    ) {
        let mut to = self
            .peers
            .iter()
            .filter(|p| which(p))
            .filter_map(|p| p.conn);
        let Some(first) = to.next() else { return };
        let bytes = match msg.to_bytes() {
            Ok(b) => b,
            Err(e) => {
                warn!("cannot encode {}: {e}", msg.body.name());
                return;
            }
        };
        for conn in std::iter::once(first).chain(to) {
            if out.is_sctp(conn) {
                // Registration Life in milliseconds (rserpool_wire::sctp_life).
                out.send_enrp(conn, msg, now);
            } else {
                out.send_bytes(conn, &bytes, now);
            }
        }
    }

    /// Tells every peer about a change of a PE this registrar is home for.
    pub(super) fn update(
        &mut self,
        action: UpdateAction,
        pool_handle: &PoolHandle,
        pe: &PoolElement,
        out: &mut Conns,
        now: Instant,
    ) {
        if self.peers.is_empty() {
            return;
        }
        self.counters.updates_sent += 1;
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
        self.send_all(&msg, out, now);
    }

    /// Heartbeat, liveness, request and start-up timers.
    pub(super) fn handle_timeout(
        &mut self,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        if self.local.is_none() {
            return;
        }
        if let Some(deadline) = self.starting
            && self.mentor.is_none()
            && deadline <= now
        {
            info!("no mentor registrar answered: serving with the handlespace as it is");
            self.starting = None;
        }
        if self.next_heartbeat <= now {
            self.heartbeat(hs, out, now);
            self.adopt_orphans(hs, out, now);
        }
        for i in (0..self.peers.len()).rev() {
            let p = &self.peers[i];
            let (id, state, request) = (p.id, p.state, p.request);
            if let Some(r) = request
                && r.deadline <= now
            {
                self.request_failed(i, "no HANDLE_TABLE_RESPONSE in time", out, now);
            }
            if id == 0 {
                continue;
            }
            match state {
                Liveness::Alive => {
                    let silent = self.peers[i].last_heard + ms(self.cfg.max_time_last_heard_ms);
                    if silent <= now {
                        self.probe_peer(i, hs, out, now);
                    }
                }
                Liveness::Probing { deadline } if deadline <= now => {
                    if self.peers[i].acks_owed.is_empty() {
                        self.start_takeover(i, hs, out, now);
                    } else {
                        self.yield_takeover(i, out, now);
                    }
                }
                Liveness::Inactive { deadline } if deadline <= now => {
                    info!(
                        "the takeover of ENRP peer {id:#010x} by another registrar did not finish: asking it for PRESENCE"
                    );
                    self.probe_peer(i, hs, out, now);
                }
                Liveness::TakingOver { deadline } if deadline <= now => {
                    let missing = &self.peers[i].acks_pending;
                    warn!(
                        "takeover of {id:#010x} expired waiting for {} acknowledgement(s): trying again",
                        missing.len()
                    );
                    self.start_takeover(i, hs, out, now);
                }
                _ => {}
            }
        }
    }

    fn heartbeat(&mut self, hs: &impl HandlespaceView, out: &mut Conns, now: Instant) {
        self.next_heartbeat = now + ms(self.cfg.peer_heartbeat_ms.max(1));
        for i in 0..self.peers.len() {
            if self.peers[i].conn.is_none() {
                self.connect_peer(i, hs, out, now);
            }
        }
        let msg = self.presence(0, false, hs, false);
        if self.local_sctp.is_some() {
            self.send_presence_all(hs, out, now);
        } else {
            // Encoded once for all.
            self.send_all(&msg, out, now);
        }
        if self.cfg.enrp_multicast
            && let Ok(bytes) = msg.to_bytes()
        {
            out.push(Action::Presence(Bytes::from(bytes)));
        }
    }

    /// Takes over the PEs of a home no peer knows, once it has stayed unknown as long as a
    /// silent peer takes to be taken over, times one more for each live peer with a lower ID:
    /// the lowest goes first, so that two do not race for the PEs, and the next ones step in
    /// when it does not hold them. It tells the others with a TAKEOVER_SERVER, after which
    /// they hold the PEs as its own.
    fn adopt_orphans(&mut self, hs: &mut impl HandlespaceView, out: &mut Conns, now: Instant) {
        if self.starting.is_some() {
            return;
        }
        let homes: Vec<u32> = hs
            .homes()
            .into_iter()
            .filter(|&h| h != 0 && h != self.id && self.peer_index(h).is_none())
            .filter(|&h| !self.taken_over.iter().any(|t| t.target == h))
            .collect();
        self.orphans.retain(|(h, _)| homes.contains(h));
        for h in homes {
            if !self.orphans.iter().any(|o| o.0 == h) {
                self.orphans.push((h, now));
            }
        }
        let grace = ms(self.cfg.max_time_last_heard_ms
            + self.cfg.max_time_no_response_ms
            + self.cfg.takeover_expiry_ms);
        let rank = self
            .peers
            .iter()
            .filter(|p| p.id != 0 && p.id < self.id && p.state == Liveness::Alive)
            .count();
        let wait = grace * (1 + rank as u32);
        let due: Vec<u32> = self
            .orphans
            .iter()
            .filter(|o| o.1 + wait <= now)
            .map(|o| o.0)
            .collect();
        for target in due {
            self.orphans.retain(|o| o.0 != target);
            let msg = EnrpMessage {
                sender: self.id,
                receiver: 0,
                body: EnrpBody::TakeoverServer { target },
            };
            self.send_alive(&msg, out, now);
            self.note_taken_over(target, self.id, now);
            let taken = hs.take_over(target, out, now);
            self.counters.takeovers += 1;
            self.counters.pes_taken_over += taken as u64;
            warn!(
                "{taken} PE(s) homed at {target:#010x}, a registrar no peer knows, for {} s: taken over",
                wait.as_secs()
            );
        }
    }

    /// Asks a silent peer for a PRESENCE (R bit); takeover follows without an answer.
    fn probe_peer(&mut self, i: usize, hs: &impl HandlespaceView, out: &mut Conns, now: Instant) {
        self.start_probe(i, out, now);
        let p = &self.peers[i];
        let (id, conn) = (p.id, p.conn);
        debug!("ENRP peer {id:#010x} silent or disconnected: asking for PRESENCE");
        match conn {
            None => self.connect_peer(i, hs, out, now),
            Some(conn) => {
                let msg = self.presence(id, true, hs, out.is_sctp(conn));
                out.send_enrp(conn, &msg, now);
            }
        }
    }

    /// Starts the wait for a probed peer's answer, after which it is taken over. Notes whether
    /// the network was heard within the wait's length before: a probe sent while this registrar
    /// was cut off proves nothing, for the answer may still be on its way when the link is
    /// back (TCP's retransmission back-off delays it by seconds).
    fn start_probe(&mut self, i: usize, out: &Conns, now: Instant) {
        let wait = ms(self.cfg.max_time_no_response_ms);
        let p = &mut self.peers[i];
        p.state = Liveness::Probing {
            deadline: now + wait,
        };
        p.probed_at = now;
        p.probe_fresh = out.network_last_heard().is_some_and(|t| t + wait >= now);
    }

    /// The earliest ENRP timer.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.local?;
        let mut t = self.next_heartbeat;
        if let (Some(s), None) = (self.starting, self.mentor) {
            t = t.min(s);
        }
        for p in &self.peers {
            if let Some(r) = p.request {
                t = t.min(r.deadline);
            }
            if p.id == 0 {
                continue;
            }
            t = t.min(match p.state {
                Liveness::Alive => p.last_heard + ms(self.cfg.max_time_last_heard_ms),
                Liveness::Probing { deadline }
                | Liveness::TakingOver { deadline }
                | Liveness::Inactive { deadline } => deadline,
            });
        }
        Some(t)
    }

    /// An ENRP connection closed. A peer we send over it counts as failing: it is asked for a
    /// PRESENCE over a new connection, and taken over if that fails too.
    pub(super) fn closed(
        &mut self,
        id: ConnId,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let Some(i) = self.peers.iter().position(|p| p.conn == Some(id)) else {
            return;
        };
        self.peers[i].conn = None;
        let p = &self.peers[i];
        if self.local.is_none() || p.id == 0 {
            return;
        }
        match p.state {
            Liveness::Alive => self.probe_peer(i, hs, out, now),
            Liveness::Probing { .. } if !p.acks_owed.is_empty() => {
                self.yield_takeover(i, out, now);
            }
            // start_takeover says what it does.
            Liveness::Probing { .. } => self.start_takeover(i, hs, out, now),
            Liveness::TakingOver { .. } | Liveness::Inactive { .. } => {}
        }
    }

    /// An ENRP message on connection `id`.
    pub(super) fn handle_message(
        &mut self,
        id: ConnId,
        buf: &[u8],
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let mut msg = match EnrpMessage::decode(buf) {
            Ok(m) => m,
            Err(e) => return out.reject_malformed(id, &e, now),
        };
        if out.is_sctp(id) {
            rserpool_wire::sctp_life::convert_enrp(&mut msg, rserpool_wire::sctp_life::from_sctp);
        }
        if msg.sender == self.id || msg.sender == 0 {
            return;
        }
        out.heard_from_network(now);
        if msg.receiver != 0 && msg.receiver != self.id {
            debug!(
                "ENRP {} from {:#010x} for {:#010x} ignored",
                msg.body.name(),
                msg.sender,
                msg.receiver
            );
            return;
        }
        let from = out.peer(id).map(|a| a.ip());
        let Some(i) = self.heard_peer(msg.sender, &msg.body, from, hs, out, now) else {
            debug!(
                "ENRP {} from unknown {:#010x} ignored",
                msg.body.name(),
                msg.sender
            );
            return;
        };
        let sender = msg.sender;
        self.tell_taken_over(sender, id, out, now);
        match msg.body {
            EnrpBody::Presence {
                reply_required,
                checksum,
                ..
            } => {
                self.peers[i].checksum = checksum;
                if reply_required {
                    // Over our connection to it, or (ours failed: it started after us and was
                    // not listening yet) over the one it came on, so that it need not wait a
                    // heartbeat for us.
                    let conn = self.peers[i].conn.unwrap_or(id);
                    let reply = self.presence(sender, false, hs, out.is_sctp(conn));
                    out.send_enrp(conn, &reply, now);
                }
                self.choose_mentor(i, hs, out, now);
                if let Some(c) = checksum {
                    self.check_audit(i, c, hs, out, now);
                }
            }
            EnrpBody::HandleUpdate {
                action,
                pool_handle,
                pool_element,
                ..
            } => {
                self.counters.updates_received += 1;
                if action == UpdateAction::AddPe
                    && let Some(marked) = &mut self.peers[i].marked
                {
                    marked.remove(&(pool_handle.clone(), pool_element.id));
                }
                if action == UpdateAction::AddPe
                    && pool_element.home_registrar == self.id
                    && hs.disown(&pool_handle, pool_element.id)
                {
                    // Named home of a PE not registered here (a peer handed back a takeover
                    // the PE had accepted, and the PE left since): only the home removes a
                    // PE, so this one does, everywhere.
                    if out.peer_log.allow(now) {
                        info!(
                            "{sender:#010x} names this registrar home of PE {:#010x} of pool {pool_handle}, not registered here: removing it",
                            pool_element.id
                        );
                    }
                    self.counters.disowned += 1;
                    self.update(UpdateAction::DelPe, &pool_handle, &pool_element, out, now);
                    return;
                }
                let home = pool_element.home_registrar;
                apply_update(hs, sender, action, pool_handle, pool_element, out, now);
                if self.taken_over.iter().any(|t| t.target == home) {
                    self.rehome_taken_over(hs, out, now);
                }
            }
            EnrpBody::HandleTableRequest { own_children_only } => {
                self.serve_handle_table(i, own_children_only, id, hs, out, now);
            }
            EnrpBody::HandleTableResponse {
                reject,
                more,
                pools,
            } => self.on_handle_table(i, reject, more, pools, hs, out, now),
            EnrpBody::ListRequest => {
                let mut servers: Vec<ServerInformation> = self
                    .peers
                    .iter()
                    .filter(|p| p.id != 0 && p.id != sender && p.state == Liveness::Alive)
                    .map(|p| ServerInformation {
                        server_id: p.id,
                        transport: TransportAddress::tcp(p.addr),
                    })
                    .collect();
                if let Some(a) = self.local {
                    servers.push(ServerInformation {
                        server_id: self.id,
                        transport: TransportAddress::tcp(a),
                    });
                }
                let body = EnrpBody::ListResponse {
                    reject: false,
                    servers,
                };
                self.reply(id, sender, body, out, now);
            }
            EnrpBody::ListResponse { reject, servers } => {
                if !reject {
                    for s in servers {
                        self.learn_peer(s, None, hs, out, now);
                    }
                }
            }
            EnrpBody::InitTakeover { target } => {
                self.on_init_takeover(sender, target, hs, out, now)
            }
            EnrpBody::InitTakeoverAck { target } => {
                if let Some(t) = self.peer_index(target)
                    && matches!(self.peers[t].state, Liveness::TakingOver { .. })
                {
                    self.peers[t].acks_pending.retain(|&a| a != sender);
                    if self.peers[t].acks_pending.is_empty() {
                        self.finish_takeover(t, hs, out, now);
                    }
                }
            }
            EnrpBody::TakeoverServer { target } => {
                self.on_takeover_server(sender, target, hs, out, now)
            }
            EnrpBody::Error { error } => {
                if out.peer_log.allow(now) {
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
    fn heard_peer(
        &mut self,
        sender: u32,
        body: &EnrpBody,
        from: Option<IpAddr>,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) -> Option<usize> {
        let i = match self.peer_index(sender) {
            Some(i) => {
                self.revive(i, now);
                i
            }
            None => {
                let EnrpBody::Presence {
                    server_info: Some(si),
                    ..
                } = body
                else {
                    return None;
                };
                self.learn_peer(si.clone(), from, hs, out, now)?
            }
        };
        if std::mem::take(&mut self.alone) {
            info!(
                "ENRP peer {sender:#010x} heard after taking over alone: synchronising the handlespace again"
            );
            self.starting = Some(now + ms(self.cfg.mentor_discovery_ms));
            self.mentor = None;
        }
        Some(i)
    }

    /// Any message from a peer: it is alive, and a takeover of it is off.
    fn revive(&mut self, i: usize, now: Instant) {
        let p = &mut self.peers[i];
        p.last_heard = now;
        p.deferral_said = false;
        if !p.acks_owed.is_empty() {
            // It answered: the takeovers waiting for our acknowledgement expire unanswered.
            info!(
                "ENRP peer {:#010x} answered: not acknowledging its takeover by {:#010x?}",
                p.id, p.acks_owed
            );
            p.acks_owed.clear();
        }
        match p.state {
            Liveness::Alive => {}
            Liveness::TakingOver { .. } => {
                info!("ENRP peer {:#010x} is alive: takeover aborted", p.id);
                p.acks_pending.clear();
                p.state = Liveness::Alive;
                self.counters.takeovers_aborted += 1;
            }
            Liveness::Probing { .. } | Liveness::Inactive { .. } => {
                debug!("ENRP peer {:#010x} is alive", p.id);
                p.state = Liveness::Alive;
            }
        }
    }

    /// `from`: the address its message came from, if known.
    fn learn_peer(
        &mut self,
        si: ServerInformation,
        from: Option<IpAddr>,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) -> Option<usize> {
        let id = si.server_id;
        if id == 0 || id == self.id {
            return None;
        }
        if let Some(i) = self.peer_index(id) {
            return Some(i);
        }
        let addr = peer_address(&si.transport, from)?;
        // A configured peer names itself with its first PRESENCE.
        let i = match self.peers.iter().position(|p| p.id == 0 && p.addr == addr) {
            Some(i) => {
                self.peers[i].id = id;
                self.peers[i].last_heard = now;
                info!("ENRP peer {id:#010x} at {addr}");
                i
            }
            None => {
                info!("ENRP peer {id:#010x} at {addr} (announced itself)");
                self.add_peer(id, addr, hs, out, now)
            }
        };
        let window = self.cfg.taken_over_window();
        self.forget_old_takeovers(now);
        if self.taken_over.iter().any(|t| t.target == id) {
            info!(
                "ENRP peer {id:#010x} is back after a takeover: not audited before its keep-alives have told it which PEs moved"
            );
            self.peers[i].audit_after = Some(now + window);
        }
        Some(i)
    }

    /// Start-up: the first peer heard becomes the mentor; ask it for its peers and handlespace.
    fn choose_mentor(
        &mut self,
        i: usize,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        if self.starting.is_none() || self.mentor.is_some() {
            return;
        }
        let id = self.peers[i].id;
        info!("synchronising the handlespace from mentor registrar {id:#010x}");
        self.mentor = Some(id);
        if self.peers[i].conn.is_none() {
            // Registrars started together: our connection to it failed (it was not
            // listening yet) and is made again only at a later heartbeat. Without one the
            // requests below went nowhere, and the start waited for their timeout (7.5 s for
            // three registrars started at once, in a walkthrough).
            self.connect_peer(i, hs, out, now);
        }
        self.send_to_peer(id, EnrpBody::ListRequest, out, now);
        self.request_handle_table(i, false, out, now);
    }

    fn request_handle_table(&mut self, i: usize, own_only: bool, out: &mut Conns, now: Instant) {
        let p = &mut self.peers[i];
        p.request = Some(Request {
            own_only,
            deadline: now + ms(self.cfg.max_time_no_response_ms),
        });
        let id = p.id;
        self.send_to_peer(
            id,
            EnrpBody::HandleTableRequest {
                own_children_only: own_only,
            },
            out,
            now,
        );
    }

    fn request_failed(&mut self, i: usize, why: &str, out: &mut Conns, now: Instant) {
        let p = &mut self.peers[i];
        p.request = None;
        p.marked = None;
        let id = p.id;
        if out.peer_log.allow(now) {
            warn!("handle table from {id:#010x}: {why}");
        }
        if self.mentor == Some(id) {
            // Another peer that speaks becomes the mentor; the discovery deadline still holds.
            self.mentor = None;
            self.starting = Some(now + ms(self.cfg.mentor_discovery_ms));
        }
    }

    /// Audit (RFC 5353 §3.6): a peer announcing a checksum for its own PEs other than ours for
    /// them sends us its PEs again; those it no longer has are then removed.
    fn check_audit(
        &mut self,
        i: usize,
        checksum: u16,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let p = &self.peers[i];
        if p.request.is_some() || self.starting.is_some() || p.state != Liveness::Alive {
            return;
        }
        if p.audit_after.is_some_and(|t| now < t) {
            return;
        }
        let id = p.id;
        if hs.checksum(id) == checksum {
            return;
        }
        debug!(
            "checksum of {id:#010x}: announced {checksum:#06x}, ours {:#06x}: audit",
            hs.checksum(id)
        );
        self.counters.audits += 1;
        self.peers[i].marked = Some(hs.owned_pes(id));
        self.request_handle_table(i, true, out, now);
    }

    /// Answers a HANDLE_TABLE_REQUEST from peer `i` that came over `via`.
    fn serve_handle_table(
        &mut self,
        i: usize,
        own_only: bool,
        via: ConnId,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let cursor = match self.peers[i].serving {
            Some((c, w)) if w == own_only => c,
            old => {
                if let Some((c, _)) = old {
                    hs.sync_end(c);
                }
                hs.sync_begin(own_only.then_some(self.id))
            }
        };
        let max = self.cfg.max_elements_per_ht_request.max(1);
        let (pools, more) = hs.table_block(cursor, max);
        self.peers[i].serving = more.then_some((cursor, own_only));
        self.counters.handle_table_blocks_sent += 1;
        let id = self.peers[i].id;
        let body = EnrpBody::HandleTableResponse {
            reject: false,
            more,
            pools,
        };
        self.reply(via, id, body, out, now);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_handle_table(
        &mut self,
        i: usize,
        reject: bool,
        more: bool,
        pools: Vec<PoolEntry>,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let Some(req) = self.peers[i].request else {
            return;
        };
        if reject {
            self.request_failed(i, "request rejected", out, now);
            return;
        }
        let sender = self.peers[i].id;
        for entry in pools {
            for pe in entry.pool_elements {
                self.counters.handle_table_entries_received += 1;
                if let Some(marked) = &mut self.peers[i].marked {
                    marked.remove(&(entry.pool_handle.clone(), pe.id));
                }
                if pe.home_registrar == self.id {
                    continue;
                }
                let handle = entry.pool_handle.clone();
                apply_update(hs, sender, UpdateAction::AddPe, handle, pe, out, now);
            }
        }
        if more {
            self.request_handle_table(i, req.own_only, out, now);
            return;
        }
        self.peers[i].request = None;
        self.rehome_taken_over(hs, out, now);
        if let Some(marked) = self.peers[i].marked.take() {
            let swept = hs.remove_stale(sender, marked);
            if swept > 0 {
                info!("audit of {sender:#010x}: {swept} PE(s) it no longer has removed");
            }
        }
        if self.mentor == Some(sender) && self.starting.is_some() {
            self.starting = None;
            info!(
                "synchronised from mentor {sender:#010x}: {} PEs in the handlespace",
                hs.len()
            );
        }
    }

    /// RFC 5353 §3.5: INIT_TAKEOVER to every peer believed alive, then wait for an ACK from
    /// each. Unlike the RFC, the target is not sent one: it would protest with a PRESENCE,
    /// which any message from it stands in for, and the one bound for a dead connection could
    /// only arrive late.
    fn start_takeover(
        &mut self,
        i: usize,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let target = self.peers[i].id;
        // Whatever is still queued for the target was meant for a live peer; reset, so that
        // none of it arrives if the target is only cut off. A new connection is tried at the
        // next heartbeat, and any message from the target aborts the takeover.
        if let Some(conn) = self.peers[i].conn.take() {
            out.abort(conn);
        }
        if out.takeover_may_be_news(now) {
            // The peers it could not hear may well be alive and may have taken this registrar
            // over meanwhile: its old connections come back reset, its view of who is alive is
            // stale, and a peer may acknowledge before it has heard the target again. The
            // peers that were not cut off take over one that really died.
            return self.defer_takeover(
                i,
                "this registrar is in a silence of the network or just back from one",
                out,
                now,
            );
        }
        let acks: Vec<u32> = self
            .peers
            .iter()
            .filter(|p| p.id != 0 && p.id != target && p.state == Liveness::Alive)
            .map(|p| p.id)
            .collect();
        let p = &self.peers[i];
        let network_all_along = p.probe_fresh && out.network_last_heard() >= Some(p.probed_at);
        if acks.is_empty() && !network_all_along {
            // No peer to agree, and the network (a PE, a connection closed by its other end)
            // was not heard both just before the target was asked for a PRESENCE and since:
            // this registrar may be the one cut off, or just back. A takeover now would reach
            // the PEs when the link returns, seconds later, and take them from their live
            // home.
            return self.defer_takeover(
                i,
                "no other peer, and the network was not heard all through its probe",
                out,
                now,
            );
        }
        match hs.owned_count(target) {
            // A registrar with no PE, or an ENRP speaker that only looked (rsplib's hsdump).
            0 => info!("ENRP peer {target:#010x}, home of no PE, did not answer: taking it over"),
            n => warn!("ENRP peer {target:#010x} did not answer: taking over its {n} PE(s)"),
        }
        let p = &mut self.peers[i];
        p.state = Liveness::TakingOver {
            deadline: now + ms(self.cfg.takeover_expiry_ms),
        };
        p.acks_pending = acks;
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::InitTakeover { target },
        };
        self.send_alive(&msg, out, now);
        if self.peers[i].acks_pending.is_empty() {
            self.finish_takeover(i, hs, out, now);
        }
    }

    /// Puts off the takeover of peer `i`, since this registrar may be the one cut off (`why`):
    /// the peer is asked again, and any message from it revives it (the heartbeat reconnects).
    fn defer_takeover(&mut self, i: usize, why: &str, out: &mut Conns, now: Instant) {
        let p = &mut self.peers[i];
        // Said once while the peer stays silent (the put-off repeats every probe); counted.
        if !std::mem::replace(&mut p.deferral_said, true) && out.peer_log.allow(now) {
            warn!(
                "ENRP peer {:#010x} silent, but {why}: this registrar may be the one cut off, so \
                 it does not take over yet (said once until the peer is heard; counted in \
                 rserpool_enrp_takeovers_deferred_total)",
                p.id
            );
        } else {
            debug!(
                "ENRP peer {:#010x} silent, takeover put off again: {why}",
                p.id
            );
        }
        self.counters.takeovers_deferred += 1;
        self.start_probe(i, out, now);
    }

    fn on_init_takeover(
        &mut self,
        sender: u32,
        target: u32,
        hs: &impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        if target == self.id {
            info!("registrar {sender:#010x} believes this one dead: announcing PRESENCE");
            self.send_presence_all(hs, out, now);
            return;
        }
        if let Some(t) = self.peer_index(target) {
            let p = &mut self.peers[t];
            let lately = p.last_heard + ms(self.cfg.max_time_last_heard_ms);
            if (p.state == Liveness::Alive && now < lately) || !p.acks_owed.is_empty() {
                // We heard it lately: the other registrar may be the one that was cut off (and
                // is just back, its peers' messages still held by TCP's back-off). Ask the
                // target first; acknowledge only if it does not answer.
                if !p.acks_owed.contains(&sender) {
                    p.acks_owed.push(sender);
                }
                if p.state == Liveness::Alive {
                    info!(
                        "registrar {sender:#010x} takes over {target:#010x}, which this one heard \
                         lately: asking it first"
                    );
                    self.probe_peer(t, hs, out, now);
                }
                return;
            }
            let p = &mut self.peers[t];
            if matches!(p.state, Liveness::TakingOver { .. }) {
                if self.id > sender {
                    // Ours wins the tie-break: the other registrar yields.
                    return;
                }
                info!("registrar {sender:#010x} takes over {target:#010x}: ours aborted");
                p.acks_pending.clear();
            }
            // The other registrar's wait for acknowledgements, and time to tell us.
            let wait = self.cfg.takeover_expiry_ms + self.cfg.max_time_no_response_ms;
            p.state = Liveness::Inactive {
                deadline: now + ms(wait),
            };
        }
        self.send_to_peer(sender, EnrpBody::InitTakeoverAck { target }, out, now);
    }

    /// Our probe of a peer that other registrars take over went unanswered: acknowledge their
    /// takeover and wait for its TAKEOVER_SERVER, as on an INIT_TAKEOVER for a silent peer.
    fn yield_takeover(&mut self, i: usize, out: &mut Conns, now: Instant) {
        let wait = self.cfg.takeover_expiry_ms + self.cfg.max_time_no_response_ms;
        let p = &mut self.peers[i];
        let target = p.id;
        let owed = std::mem::take(&mut p.acks_owed);
        p.state = Liveness::Inactive {
            deadline: now + ms(wait),
        };
        info!(
            "ENRP peer {target:#010x} did not answer: acknowledging its takeover by {owed:#010x?}"
        );
        for sender in owed {
            self.send_to_peer(sender, EnrpBody::InitTakeoverAck { target }, out, now);
        }
    }

    /// Every ACK is in: announce the takeover and become home of the target's PEs, which ASAP
    /// tells with an ENDPOINT_KEEP_ALIVE carrying the H bit.
    fn finish_takeover(
        &mut self,
        i: usize,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let target = self.peers[i].id;
        let msg = EnrpMessage {
            sender: self.id,
            receiver: 0,
            body: EnrpBody::TakeoverServer { target },
        };
        self.send_alive(&msg, out, now);
        self.remove_peer(i, hs, out, now);
        self.note_taken_over(target, self.id, now);
        self.alone |= !self
            .peers
            .iter()
            .any(|p| p.id != 0 && p.state == Liveness::Alive);
        let taken = hs.take_over(target, out, now);
        self.counters.takeovers += 1;
        self.counters.pes_taken_over += taken as u64;
        if taken == 0 {
            // A registrar with no PE, or an ENRP speaker that only looked (rsplib's hsdump).
            info!("took over registrar {target:#010x}, home of no PE");
        } else {
            warn!("took over registrar {target:#010x}: home of its {taken} PE(s) now");
        }
    }

    fn on_takeover_server(
        &mut self,
        sender: u32,
        target: u32,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        if target == self.id {
            // Cut off for a while and declared dead. The PEs still associated here stay; the
            // ones the new home reached moved, and those whose associations closed since are
            // the new home's (see `Asap::connection_closed`). Audits reconcile the rest.
            self.taken_over_by = Some((sender, now));
            let moved = hs.hand_over(self.id, sender);
            warn!(
                "registrar {sender:#010x} took over this registrar: {moved} PE(s) whose associations closed are its now; announcing PRESENCE"
            );
            self.send_presence_all(hs, out, now);
            return;
        }
        info!(
            "registrar {sender:#010x} took over {target:#010x} ({} PE(s))",
            hs.owned_count(target)
        );
        if let Some(t) = self.peer_index(target) {
            self.remove_peer(t, hs, out, now);
        }
        self.note_taken_over(target, sender, now);
        hs.hand_over(target, sender);
    }

    /// Whether a silence of the network may hide a takeover of this registrar
    /// ([`Conns::takeover_may_be_news`]); never for a registrar without peers, which nobody
    /// can take over.
    pub(super) fn takeover_may_be_news(&self, out: &Conns, now: Instant) -> bool {
        !self.peers.is_empty() && out.takeover_may_be_news(now)
    }

    /// The registrar that took this one over within [`Config::taken_over_window`]: the
    /// PEs lost here meanwhile most likely moved to it. Not one taken over since itself: a
    /// PE homed there would have nobody left to supervise or take it over.
    pub(super) fn new_home(&self, now: Instant) -> Option<u32> {
        let window = self.cfg.taken_over_window();
        self.taken_over_by
            .filter(|&(_, at)| at + window > now)
            .map(|(home, _)| home)
            .filter(|&home| !self.taken_over.iter().any(|t| t.target == home))
    }

    /// Remembers that `target` was taken over, for [`Self::taken_over`]'s while.
    fn note_taken_over(&mut self, target: u32, by: u32, now: Instant) {
        self.forget_old_takeovers(now);
        self.taken_over.push(TakenOver {
            target,
            by,
            at: now,
            untold: by == self.id,
        });
    }

    /// PEs that arrived after a takeover (in a handle table composed before it, or a late
    /// update) homed at the registrar taken over, which is still gone: they go to the one that
    /// took it over, as its other PEs did; to this one over a new association, as in the
    /// takeover itself. Otherwise nobody would supervise them until their registration life
    /// ran out.
    fn rehome_taken_over(&mut self, hs: &mut impl HandlespaceView, out: &mut Conns, now: Instant) {
        for i in 0..self.taken_over.len() {
            let TakenOver { target, by, .. } = self.taken_over[i];
            if self.is_alive(target) || hs.owned_count(target) == 0 {
                continue;
            }
            let moved = if by == self.id {
                let n = hs.take_over(target, out, now);
                self.counters.pes_taken_over += n as u64;
                n
            } else {
                hs.hand_over(target, by)
            };
            if out.peer_log.allow(now) {
                info!(
                    "{moved} PE(s) heard of after {by:#010x} took over {target:#010x}: {by:#010x}'s now"
                );
            }
        }
    }

    /// A peer we took over speaks again (it was only cut off): tells it, once, over the
    /// connection it spoke on.
    fn tell_taken_over(&mut self, sender: u32, conn: ConnId, out: &mut Conns, now: Instant) {
        let Some(t) = self
            .taken_over
            .iter_mut()
            .find(|t| t.target == sender && t.untold)
        else {
            return;
        };
        t.untold = false;
        info!("ENRP peer {sender:#010x} is back: telling it that this registrar took it over");
        let msg = EnrpMessage {
            sender: self.id,
            receiver: sender,
            body: EnrpBody::TakeoverServer { target: sender },
        };
        out.send_enrp(conn, &msg, now);
    }

    /// Takeovers older than twice [`Config::taken_over_window`]: a peer back after that long has
    /// no PE left that it could wrongly claim.
    fn forget_old_takeovers(&mut self, now: Instant) {
        let window = self.cfg.taken_over_window();
        self.taken_over.retain(|t| t.at + window * 2 > now);
    }

    /// Forgets a peer (taken over). A configured address stays in the table, unnamed, so that
    /// a registrar restarted there is found again.
    fn remove_peer(
        &mut self,
        i: usize,
        hs: &mut impl HandlespaceView,
        out: &mut Conns,
        now: Instant,
    ) {
        let p = self.peers.swap_remove(i);
        if let Some((c, _)) = p.serving {
            hs.sync_end(c);
        }
        if let Some(conn) = p.conn {
            out.abort(conn);
        }
        if self.mentor == Some(p.id) {
            self.mentor = None;
        }
        if self.cfg.peer_addrs().any(|a| a == p.addr)
            && !self.peers.iter().any(|q| q.addr == p.addr)
        {
            self.peers.push(Peer::new(0, p.addr, now));
        }
    }
}

/// Applies a peer's update, logging (rate-limited) one the handlespace refuses.
fn apply_update(
    hs: &mut impl HandlespaceView,
    sender: u32,
    action: UpdateAction,
    pool_handle: PoolHandle,
    pe: PoolElement,
    out: &mut Conns,
    now: Instant,
) {
    if let Err(e) = hs.apply_update(sender, action, pool_handle, pe, now)
        && out.peer_log.allow(now)
    {
        warn!("HANDLE_UPDATE from {sender:#010x} refused: {e}");
    }
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Where to reach a peer that announced `transport`: the listed address its message came
/// from, else the first that is not loopback (a peer lists all of its addresses, loopback ones
/// too, and only it can reach those), else the first.
fn peer_address(transport: &TransportAddress, from: Option<IpAddr>) -> Option<SocketAddr> {
    let all: Vec<SocketAddr> = transport.socket_addrs().collect();
    let from_loopback = from.is_some_and(|f| f.is_loopback());
    all.iter()
        .find(|a| Some(a.ip()) == from)
        .or_else(|| all.iter().find(|a| from_loopback || !a.ip().is_loopback()))
        .or_else(|| all.first())
        .copied()
}
