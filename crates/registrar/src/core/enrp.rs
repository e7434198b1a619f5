//! ENRP (RFC 5353) in the registrar core: the peer table, PRESENCE, and HANDLE_UPDATE for every
//! change of a PE this registrar is home for.
//!
//! Connections between registrars are one-way for sending: a registrar sends to a peer over the
//! connection it opened to that peer's ENRP address, and reads whatever arrives on any ENRP
//! connection. A pair of registrars therefore holds two connections, and neither side has to
//! agree with the other on which one to keep. Each message is encoded once and its bytes are
//! appended to every peer's connection (the seed paper's SCTP_SENDALL idea).
//!
//! Work in progress: start-up synchronisation, audit and takeover follow.

use super::{ConnId, NO_META, PeMeta, Registrar};
use rserpool_handlespace::TimerKind;
use rserpool_wire::{
    EnrpBody, EnrpMessage, PoolElement, PoolHandle, ServerInformation, TransportAddress,
    UpdateAction,
};
use std::net::SocketAddr;
use tracing::{debug, info, warn};

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
}

#[derive(Debug, Default)]
pub(crate) struct EnrpState {
    /// Our ENRP address, announced in Server Information.
    pub local: Option<SocketAddr>,
    pub peers: Vec<Peer>,
    /// Outgoing connections the driver should open.
    pub connects: Vec<(ConnId, SocketAddr)>,
    pub next_heartbeat: u64,
}

impl Registrar {
    /// Starts ENRP: `local` is this registrar's ENRP address; configured peers are connected.
    pub fn enable_enrp(&mut self, local: SocketAddr, now: u64) {
        self.enrp.local = Some(local);
        for addr in self.cfg.peer.clone() {
            if addr != local {
                self.add_peer(0, addr, now);
            }
        }
        self.enrp.next_heartbeat = now;
    }

    /// The next outgoing ENRP connection to open: report the outcome with
    /// [`handle_close`](Self::handle_close) if it fails; bytes queued on it are written once it
    /// is up.
    pub fn poll_connect(&mut self) -> Option<(ConnId, SocketAddr)> {
        self.enrp.connects.pop()
    }

    /// A new ENRP connection from another registrar.
    pub fn accept_enrp(&mut self, peer: SocketAddr, now: u64) -> Option<ConnId> {
        self.open_conn(peer, true, now)
    }

    fn add_peer(&mut self, id: u32, addr: SocketAddr, now: u64) -> usize {
        self.enrp.peers.push(Peer {
            id,
            addr,
            conn: None,
            last_heard: now,
            checksum: None,
        });
        let i = self.enrp.peers.len() - 1;
        self.connect_peer(i, now);
        i
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

    /// The heartbeat: PRESENCE to every peer, and a new connection to any peer that lost its.
    pub(super) fn enrp_timeout(&mut self, now: u64) {
        if self.enrp.local.is_none() || self.enrp.next_heartbeat > now {
            return;
        }
        self.enrp.next_heartbeat = now + self.cfg.peer_heartbeat_ms.max(1);
        for i in 0..self.enrp.peers.len() {
            if self.enrp.peers[i].conn.is_none() {
                self.connect_peer(i, now);
            }
        }
        let msg = self.presence(0, false);
        self.send_all(&msg, now);
    }

    pub(super) fn enrp_next_timeout(&self) -> Option<u64> {
        self.enrp.local.map(|_| self.enrp.next_heartbeat)
    }

    /// An ENRP connection closed: a peer sending over it needs a new one (next heartbeat).
    pub(super) fn enrp_closed(&mut self, id: ConnId) {
        for p in &mut self.enrp.peers {
            if p.conn == Some(id) {
                p.conn = None;
            }
        }
    }

    pub(super) fn handle_enrp(&mut self, id: ConnId, buf: &[u8], now: u64) {
        let msg = match EnrpMessage::decode(buf) {
            Ok(m) => m,
            Err(e) => {
                let cause = e.cause.clone();
                self.protocol_error(id, &e, cause, now);
                if e.loses_framing() {
                    self.close(id);
                }
                return;
            }
        };
        if msg.sender == self.id || msg.sender == 0 {
            return;
        }
        let i = self.heard_peer(msg.sender, &msg.body, now);
        match msg.body {
            EnrpBody::Presence {
                reply_required,
                checksum,
                ..
            } => {
                if let Some(i) = i {
                    self.enrp.peers[i].checksum = checksum;
                    if reply_required && let Some(conn) = self.enrp.peers[i].conn {
                        let reply = self.presence(msg.sender, false);
                        self.send_enrp(conn, &reply, now);
                    }
                }
            }
            EnrpBody::HandleUpdate {
                action,
                pool_handle,
                pool_element,
                ..
            } => self.apply_update(msg.sender, action, pool_handle, pool_element, now),
            other => debug!(
                "ENRP {} from {:#010x} not handled yet",
                other.name(),
                msg.sender
            ),
        }
    }

    /// Notes that `sender` spoke; learns a new peer from a PRESENCE with Server Information.
    fn heard_peer(&mut self, sender: u32, body: &EnrpBody, now: u64) -> Option<usize> {
        if let Some(i) = self.enrp.peers.iter().position(|p| p.id == sender) {
            self.enrp.peers[i].last_heard = now;
            return Some(i);
        }
        let EnrpBody::Presence {
            server_info: Some(si),
            ..
        } = body
        else {
            return None;
        };
        let addr = si.transport.socket_addrs().next()?;
        // A configured peer names itself with its first PRESENCE.
        if let Some(i) = self
            .enrp
            .peers
            .iter()
            .position(|p| p.id == 0 && p.addr == addr)
        {
            self.enrp.peers[i].id = sender;
            self.enrp.peers[i].last_heard = now;
            info!("ENRP peer {sender:#010x} at {addr}");
            return Some(i);
        }
        info!("ENRP peer {sender:#010x} at {addr} (announced itself)");
        let i = self.add_peer(sender, addr, now);
        Some(i)
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
            // Ours: only a takeover moves it (not yet handled).
            debug!(
                "HANDLE_UPDATE from {sender:#010x} for our PE {:#010x} ignored",
                pe.id
            );
            return;
        }
        match action {
            UpdateAction::AddPe => {
                let expiry = match u64::try_from(pe.registration_life) {
                    Ok(s) if s > 0 => now.saturating_add(s.saturating_mul(1000)),
                    _ => u64::MAX,
                };
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
                if let Some(r) = existing {
                    self.set_meta(r, NO_META);
                    self.hs.remove(r);
                }
            }
        }
    }
}
