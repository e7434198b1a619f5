//! The registrar's connections and the outbox: everything the driver must do, as [`Action`]s.
//!
//! A connection carries either ASAP (an association with a pool element or pool user) or ENRP
//! (to or from a peer registrar). Each has an input framer and an output buffer. Messages are
//! encoded straight into the output buffer and the driver writes from there
//! ([`Registrar::output`](super::Registrar::output), then
//! [`consume_output`](super::Registrar::consume_output) with what the socket took), so a message
//! is never copied between encoding and the socket; [`Action::Transmit`] only says that a buffer
//! has bytes. Opening, closing and datagrams travel in the same queue, in the order the core
//! decided them (quinn-proto's `poll_transmit`/`poll` in one).

use super::Instant;
use super::limit::{LogLimiter, TokenBucket};
use crate::config::Config;
use crate::status::Counters;
use bytes::Bytes;
use rserpool_handlespace::{Handlespace, PeRef};
use rserpool_wire::Message;
use rserpool_wire::{
    AsapMessage, DecodeError, EncodeError, EnrpBody, EnrpMessage, ErrorCause, Framer,
    OperationError, PoolHandle,
};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

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

/// What the core asks of its driver, in order; see [`Registrar::poll_action`](super::Registrar::poll_action).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The connection's output buffer has bytes: write [`Registrar::output`](super::Registrar::output)
    /// and report what the socket took with [`consume_output`](super::Registrar::consume_output).
    /// Given once until the buffer is empty again; a socket that blocks is the driver's to
    /// retry when it becomes writable.
    Transmit(ConnId),
    /// Open a TCP connection to the address for this connection (ENRP to a peer registrar,
    /// ASAP to a PE taken over). Report a failure with
    /// [`handle_close`](super::Registrar::handle_close); bytes queued meanwhile are written
    /// once it is up.
    Connect(ConnId, SocketAddr),
    /// Close the connection once its pending output is written, then report
    /// [`handle_close`](super::Registrar::handle_close).
    Close(ConnId),
    /// Close the connection at once and reset it (SO_LINGER 0), so that nothing still queued
    /// for it, in the core or in the kernel, reaches the other end later; then report
    /// [`handle_close`](super::Registrar::handle_close). For bytes that stopped being true
    /// while the other end was out of reach (a takeover, a peer declared dead).
    Abort(ConnId),
    /// Open a plain TCP connection to a PE's service for this connection (no TLS, nothing
    /// written: a check of ENDPOINT_UNREACHABLE reports) and report
    /// [`handle_connected`](super::Registrar::handle_connected) once it is up, or
    /// [`handle_close`](super::Registrar::handle_close) if it cannot be opened in time.
    Probe(ConnId, SocketAddr),
    /// A SERVER_ANNOUNCE to send over UDP to every announce target.
    Announce(Bytes),
    /// A PRESENCE to send over UDP to the ENRP multicast group.
    Presence(Bytes),
    /// Tell [`handle_delivery`](super::Registrar::handle_delivery) whether what was written to
    /// this connection is still on its way: the other end's TCP has not acknowledged all of
    /// it, or this end retransmitted since the last check (`TCP_INFO`). Only given after
    /// [`enable_delivery_checks`](super::Registrar::enable_delivery_checks).
    CheckDelivery(ConnId),
}

pub(super) struct Conn {
    pub(super) peer: SocketAddr,
    /// An ENRP connection (to or from another registrar), not ASAP.
    pub(super) enrp: bool,
    pub(super) framer: Framer,
    out: Vec<u8>,
    /// PEs registered over this connection.
    pub(super) pes: Vec<PeRef>,
    /// Opened by this registrar (to a peer, or to a PE it took over), not accepted.
    pub(super) outgoing: bool,
    pub(super) hr_bucket: TokenBucket,
    pub(super) eu_bucket: TokenBucket,
    pub(super) rereg_bucket: TokenBucket,
    closing: bool,
    /// An [`Action::Transmit`] is out and the buffer has not been emptied since.
    dirty: bool,
    /// The peer presented a certificate from the CA (TLS).
    pub(super) authenticated: bool,
    /// Requests refused by a rate limit since the last one let through.
    pub(super) refused_in_a_row: u32,
    /// An [`Action::CheckDelivery`] is out, not answered yet.
    delivery_asked: bool,
    /// An SCTP association (the driver says so), not a TCP connection.
    pub(super) sctp: bool,
}

/// The connection table and the outbox.
pub(super) struct Conns {
    cfg: Arc<Config>,
    /// Our Server Identifier, the sender of ENRP ERRORs.
    server_id: u32,
    slots: Vec<Option<Conn>>,
    free: Vec<u32>,
    count: usize,
    actions: VecDeque<Action>,
    /// Log lines caused by peers (bad input, limits), rate-limited together.
    pub(super) peer_log: LogLimiter,
    /// When a rate-limit line was last logged for each source address.
    limit_logged: std::collections::HashMap<(std::net::IpAddr, Offence), Instant>,
    refused: u64,
    slow_closed: u64,
    protocol_errors: u64,
    tls_refused: u64,
    /// Error causes sent (in ERRORs and refusing responses), by code.
    errors_sent: BTreeMap<u16, u64>,
    /// When the network last showed that it reaches this registrar; see
    /// [`heard_from_network`](Self::heard_from_network).
    network_heard: Option<Instant>,
    /// The usual time between two pieces of that evidence (a moving average over about the
    /// last eight), and how many gaps it has seen: short when the network is talkative (many
    /// PEs, peers), long when it is sparse (one PE, no peer).
    network_gap: (Duration, u32),
    /// The latest dark spell: a silence longer than a quarter of the keep-alive timeout after
    /// the network had been talkative; the evidence before it and the evidence that ended it.
    network_dark: Option<(Instant, Instant)>,
    /// The driver answers [`Action::CheckDelivery`].
    pub(super) delivery_checks: bool,
}

/// A silence counts as a dark spell only when it is at least this many usual gaps long.
const DARK_GAPS: u32 = 8;

impl Conns {
    pub(super) fn new(cfg: Arc<Config>, server_id: u32) -> Self {
        Self {
            cfg,
            server_id,
            slots: Vec::new(),
            free: Vec::new(),
            count: 0,
            actions: VecDeque::new(),
            peer_log: LogLimiter::default(),
            limit_logged: std::collections::HashMap::new(),
            refused: 0,
            slow_closed: 0,
            protocol_errors: 0,
            tls_refused: 0,
            errors_sent: BTreeMap::new(),
            network_heard: None,
            network_gap: (Duration::ZERO, 0),
            network_dark: None,
            delivery_checks: false,
        }
    }

    /// Something arrived that only a reachable network brings: a PE's registration or
    /// keep-alive answer, a peer registrar's message, or a connection closed, reset or refused
    /// by its other end. A registrar that hears nothing of the kind may be the one cut off.
    pub(super) fn heard_from_network(&mut self, now: Instant) {
        if let Some(last) = self.network_heard {
            let gap = now.saturating_duration_since(last);
            if self.talkative() && gap > self.dark_threshold() {
                self.network_dark = Some((last, now));
            }
            // A dark spell counts as twice the threshold: it does not make the network sparse.
            let (avg, n) = self.network_gap;
            let gap = gap.min(self.dark_spell() * 2);
            let avg = if n == 0 { gap } else { avg - avg / 8 + gap / 8 };
            self.network_gap = (avg, n.saturating_add(1));
        }
        self.network_heard = Some(now);
    }

    /// Whether the network brought evidence often lately: only then does a silence say
    /// that this registrar may be cut off.
    fn talkative(&self) -> bool {
        let (avg, n) = self.network_gap;
        n >= 8 && avg <= self.dark_spell()
    }

    /// A silence this long counts as a dark spell (the registrar may have been cut off), in a
    /// network whose usual gaps are short enough (see [`dark_threshold`](Self::dark_threshold)).
    pub(super) fn dark_spell(&self) -> Duration {
        Duration::from_millis(self.cfg.keep_alive_timeout_ms / 4)
    }

    /// The shortest silence that says this registrar may be cut off: a dark spell, and at
    /// least [`DARK_GAPS`] usual gaps. Gaps between arrivals vary: in a network with a few
    /// PEs and a peer, a gap of twice or thrice the usual one comes every few seconds and says
    /// nothing; one of eight times it (for arrivals at random, one gap in about 3,000) does.
    fn dark_threshold(&self) -> Duration {
        self.dark_spell().max(self.network_gap.0 * DARK_GAPS)
    }

    /// Whether a dark spell of at least `len` ended within `within` before `now`: long enough
    /// for the peers to take this registrar over, and recent enough for that to be news still.
    pub(super) fn back_from_dark(&self, len: Duration, within: Duration, now: Instant) -> bool {
        self.network_dark.is_some_and(|(before, back)| {
            back.saturating_duration_since(before) >= len && back + within > now
        })
    }

    /// Whether the network, talkative before, has shown nothing for at least `len`: this
    /// registrar is most likely cut off right now.
    pub(super) fn dark_now(&self, len: Duration, now: Instant) -> bool {
        let len = len.max(self.dark_threshold());
        self.talkative()
            && self
                .network_heard
                .is_some_and(|t| now.saturating_duration_since(t) >= len)
    }

    /// Whether the peers may have taken this registrar over without its knowing yet: it is
    /// in a silence long enough for that (half MAX-TIME-LAST-HEARD), or came back from one
    /// within [`Config::taken_over_window`].
    pub(super) fn takeover_may_be_news(&self, now: Instant) -> bool {
        let len = Duration::from_millis(self.cfg.max_time_last_heard_ms / 2);
        self.dark_now(len, now) || self.back_from_dark(len, self.cfg.taken_over_window(), now)
    }

    /// An answer to what was sent at `sent` has not come by `now`: until when it may still be
    /// on its way, or `None` if it would have come. While a talkative network shows nothing
    /// (a dark spell now), this registrar may be the one cut off, and decides nothing yet (a
    /// sparse network, as with a single PE, proves nothing by its silence). After a dark
    /// spell that ended since `sent`, what was sent in it waits for TCP's next retransmission,
    /// whose timer doubled through the spell: it arrives up to the spell's length (at most
    /// `longest`) and one more retransmission timeout after the spell ends.
    pub(super) fn answer_may_lag(
        &self,
        sent: Instant,
        longest: Duration,
        now: Instant,
    ) -> Option<Instant> {
        if self.dark_now(self.dark_spell(), now) {
            return Some(now + self.dark_spell());
        }
        let (before, back) = self.network_dark?;
        let spell = back.saturating_duration_since(before).min(longest);
        let due = back + spell + self.dark_spell();
        (back > sent && due > now).then_some(due)
    }

    pub(super) fn network_last_heard(&self) -> Option<Instant> {
        self.network_heard
    }

    /// A new connection with `peer`; `None` when the connection limit is reached.
    pub(super) fn open(&mut self, peer: SocketAddr, enrp: bool, now: Instant) -> Option<ConnId> {
        if self.count >= self.cfg.max_connections {
            self.refused += 1;
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
            outgoing: false,
            hr_bucket: TokenBucket::full(self.cfg.max_hr_rate, now),
            eu_bucket: TokenBucket::full(self.cfg.max_eu_rate, now),
            rereg_bucket: TokenBucket::full(self.cfg.max_rereg_rate, now),
            closing: false,
            dirty: false,
            authenticated: false,
            refused_in_a_row: 0,
            delivery_asked: false,
            sctp: false,
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(conn);
                i
            }
            None => {
                self.slots.push(Some(conn));
                (self.slots.len() - 1) as u32
            }
        };
        self.count += 1;
        Some(ConnId(idx))
    }

    /// An outgoing connection to `addr`, for the driver to open.
    pub(super) fn connect(&mut self, addr: SocketAddr, enrp: bool, now: Instant) -> Option<ConnId> {
        let id = self.open(addr, enrp, now)?;
        if let Some(c) = self.get_mut(id) {
            c.outgoing = true;
        }
        self.actions.push_back(Action::Connect(id, addr));
        Some(id)
    }

    /// A probe of a PE's service at `addr`, for the driver to open.
    pub(super) fn probe(&mut self, addr: SocketAddr, now: Instant) -> Option<ConnId> {
        let id = self.open(addr, false, now)?;
        if let Some(c) = self.get_mut(id) {
            c.outgoing = true;
        }
        self.actions.push_back(Action::Probe(id, addr));
        Some(id)
    }

    /// Whether to log that association `id` committed `offence` (hit a rate limit, was
    /// refused or closed for it): once a minute per source address and offence, however many
    /// associations it opens (another offence of the same source is said too), and within the
    /// log limit of all peers together.
    pub(super) fn limit_log(&mut self, id: ConnId, offence: Offence, now: Instant) -> bool {
        let Some(ip) = self.get(id).map(|c| c.peer.ip()) else {
            return false;
        };
        self.once_a_minute(ip, offence, now)
    }

    /// Whether a line about `ip`'s `offence` may be logged: its first this minute, within the
    /// log limit of all peers together.
    fn once_a_minute(&mut self, ip: std::net::IpAddr, offence: Offence, now: Instant) -> bool {
        let minute_ago = now.as_millis().saturating_sub(60_000);
        let key = (ip, offence);
        if self
            .limit_logged
            .get(&key)
            .is_some_and(|t| t.as_millis() > minute_ago)
        {
            return false;
        }
        // Bounded: a spread of sources forgets the oldest minute at once.
        if self.limit_logged.len() >= 4096 {
            self.limit_logged.retain(|_, t| t.as_millis() > minute_ago);
            if self.limit_logged.len() >= 4096 {
                self.limit_logged.clear();
            }
        }
        self.limit_logged.insert(key, now);
        self.peer_log.allow(now)
    }

    /// An ENRP connection from a host that is not a configured peer (`enrp-peers-only`): not
    /// taken, counted, logged once a minute per source address.
    pub(super) fn refuse_stranger(&mut self, peer: SocketAddr, now: Instant) {
        self.refused += 1;
        if self.once_a_minute(peer.ip(), Offence::Stranger, now) {
            warn!("ENRP connection from {peer} refused: not a configured peer (enrp-peers-only)");
        }
    }

    /// Whether association `id` had more than a second's worth (`rate`, at least 1,000) of
    /// requests refused by a rate limit in a row: it floods, a burst would have stopped.
    pub(super) fn flooding(&self, id: ConnId, rate: u32) -> bool {
        rate > 0
            && self
                .get(id)
                .is_some_and(|c| c.refused_in_a_row > rate.max(1000))
    }

    /// Forgets a connection the driver closed.
    pub(super) fn remove(&mut self, id: ConnId) -> Option<Conn> {
        let c = self.slots.get_mut(id.index()).and_then(Option::take)?;
        self.count -= 1;
        self.free.push(id.0);
        Some(c)
    }

    pub(super) fn get(&self, id: ConnId) -> Option<&Conn> {
        self.slots.get(id.index()).and_then(Option::as_ref)
    }

    pub(super) fn get_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.slots.get_mut(id.index()).and_then(Option::as_mut)
    }

    /// The connection, unless it is closing (then it neither reads nor sends any more).
    pub(super) fn live_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.get_mut(id).filter(|c| !c.closing)
    }

    pub(super) fn len(&self) -> usize {
        self.count
    }

    pub(super) fn is_sctp(&self, id: ConnId) -> bool {
        self.get(id).is_some_and(|c| c.sctp)
    }

    pub(super) fn is_enrp(&self, id: ConnId) -> bool {
        self.get(id).is_some_and(|c| c.enrp)
    }

    pub(super) fn peer(&self, id: ConnId) -> Option<SocketAddr> {
        self.get(id).map(|c| c.peer)
    }

    /// Asks the driver to close the connection after its pending output.
    pub(super) fn close(&mut self, id: ConnId) {
        if let Some(c) = self.get_mut(id)
            && !c.closing
        {
            c.closing = true;
            self.actions.push_back(Action::Close(id));
        }
    }

    /// Drops what is queued for the connection and closes it: what it would carry is no
    /// longer true (it may not even be connected yet).
    pub(super) fn abort(&mut self, id: ConnId) {
        if let Some(c) = self.get_mut(id) {
            c.out = Vec::new();
            // Also after a Close: what the kernel holds must go too.
            c.closing = true;
            self.actions.push_back(Action::Abort(id));
        }
    }

    /// The output buffer of a live connection, to encode into; call
    /// [`written`](Self::written) after.
    pub(super) fn buffer(&mut self, id: ConnId) -> Option<&mut Vec<u8>> {
        self.live_mut(id).map(|c| &mut c.out)
    }

    /// Bookkeeping after output was queued: tell the driver, close a connection that does not
    /// read.
    pub(super) fn written(&mut self, id: ConnId, now: Instant) {
        let max_pending = self.cfg.max_pending_bytes;
        let Some(c) = self.get_mut(id) else { return };
        let over = c.out.len() > max_pending;
        let peer = c.peer;
        if !c.dirty {
            c.dirty = true;
            self.actions.push_back(Action::Transmit(id));
        }
        if over {
            self.slow_closed += 1;
            if self.peer_log.allow(now) {
                warn!("{peer}: closing, more than {max_pending} bytes queued and not read");
            }
            self.close(id);
        }
    }

    /// Writes a positive HANDLE_RESOLUTION_RESPONSE with the PEs `refs` (at least one) straight
    /// from the handlespace into connection `id`'s buffer. A large pool may not fit one message:
    /// the list is halved until it does. `accept`: the A bit.
    pub(super) fn write_resolution(
        &mut self,
        id: ConnId,
        accept: bool,
        pool_handle: &PoolHandle,
        hs: &Handlespace,
        refs: &[PeRef],
        now: Instant,
    ) {
        let Some(&first) = refs.first() else { return };
        let Some(buf) = self.buffer(id) else { return };
        let policy = &hs.pe(first).element.policy;
        let mark = buf.len();
        let mut n = refs.len();
        buf.reserve(64 + 96 * n);
        loop {
            let pes = refs[..n].iter().map(|&r| &hs.pe(r).element);
            match AsapMessage::encode_resolution(buf, accept, pool_handle, Some(policy), pes) {
                Ok(()) => break,
                Err(EncodeError::TooLarge { .. }) if n > 1 => {
                    buf.truncate(mark);
                    n /= 2;
                }
                Err(e) => {
                    buf.truncate(mark);
                    warn!("cannot encode HANDLE_RESOLUTION_RESPONSE: {e}");
                    return;
                }
            }
        }
        self.written(id, now);
    }

    pub(super) fn send_asap(&mut self, id: ConnId, msg: &AsapMessage, now: Instant) {
        if let Some(error) = msg.operation_error() {
            self.count_causes(error);
        }
        let Some(out) = self.buffer(id) else { return };
        // Most answers are small: one allocation instead of a chain of doublings.
        out.reserve(64);
        if let Err(e) = msg.encode(out) {
            warn!("cannot encode {}: {e}", msg.name());
            return;
        }
        self.written(id, now);
    }

    pub(super) fn send_enrp(&mut self, id: ConnId, msg: &EnrpMessage, now: Instant) {
        if let EnrpBody::Error { error } = &msg.body {
            self.count_causes(error);
        }
        if self.is_sctp(id) {
            let mut m = msg.clone();
            rserpool_wire::sctp_life::convert_enrp(&mut m, rserpool_wire::sctp_life::to_sctp);
            return self.write_enrp(id, &m, now);
        }
        self.write_enrp(id, msg, now);
    }

    fn write_enrp(&mut self, id: ConnId, msg: &EnrpMessage, now: Instant) {
        let Some(out) = self.buffer(id) else { return };
        if let Err(e) = msg.encode(out) {
            warn!("cannot encode {}: {e}", msg.body.name());
            return;
        }
        self.written(id, now);
    }

    pub(super) fn tls_refused(&mut self, id: ConnId, why: &str, now: Instant) {
        self.tls_refused += 1;
        if self.peer_log.allow(now)
            && let Some(peer) = self.peer(id)
        {
            let what = if self.is_enrp(id) { "ENRP" } else { "ASAP" };
            warn!("{peer}: {what} TLS handshake refused: {why}");
        }
    }

    fn count_causes(&mut self, error: &OperationError) {
        for c in &error.causes {
            *self.errors_sent.entry(c.code.0).or_default() += 1;
        }
    }

    /// Queues bytes encoded once for several connections.
    pub(super) fn send_bytes(&mut self, id: ConnId, bytes: &[u8], now: Instant) {
        let Some(out) = self.buffer(id) else { return };
        out.extend_from_slice(bytes);
        self.written(id, now);
    }

    /// Counts, logs (rate-limited) and answers a malformed message with the RFC cause: an ASAP
    /// ERROR, or on a connection between registrars an ENRP ERROR (an ASAP message there would
    /// itself be malformed, and the two registrars would answer each other forever).
    pub(super) fn protocol_error(
        &mut self,
        id: ConnId,
        err: &DecodeError,
        cause: Option<ErrorCause>,
        now: Instant,
    ) {
        self.protocol_errors += 1;
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
            // The connection may be one we only read from; the peer reads every ENRP
            // connection, so it still arrives.
            let msg = EnrpMessage {
                sender: self.server_id,
                receiver: 0,
                body: EnrpBody::Error { error },
            };
            self.send_enrp(id, &msg, now);
        } else {
            self.send_asap(id, &AsapMessage::Error { error }, now);
        }
    }

    /// A message that could not be decoded: answered, and the connection closed if the
    /// framing is lost.
    pub(super) fn reject_malformed(&mut self, id: ConnId, err: &DecodeError, now: Instant) {
        self.protocol_error(id, err, err.cause.clone(), now);
        if err.loses_framing() {
            self.close(id);
        }
    }

    /// A SERVER_ANNOUNCE or PRESENCE datagram for the driver.
    pub(super) fn push(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    /// Asks the driver whether `id`'s output is still on its way (once until answered).
    pub(super) fn check_delivery(&mut self, id: ConnId) {
        if let Some(c) = self.get_mut(id)
            && !std::mem::replace(&mut c.delivery_asked, true)
        {
            self.actions.push_back(Action::CheckDelivery(id));
        }
    }

    /// The driver answered [`Action::CheckDelivery`]: `id`'s PEs, if it is still open.
    pub(super) fn delivery_answered(&mut self, id: ConnId) -> Option<Vec<PeRef>> {
        let c = self.get_mut(id)?;
        c.delivery_asked = false;
        Some(c.pes.clone())
    }

    /// Drops what was queued for `id` past its first `len` bytes (the answers to a replay,
    /// [`Registrar::adopt`](super::Registrar::adopt)).
    pub(super) fn truncate_output(&mut self, id: ConnId, len: usize) {
        if let Some(c) = self.get_mut(id) {
            c.out.truncate(len);
            if c.out.is_empty() {
                c.out = Vec::new();
                // The Transmit already queued finds nothing; the next output queues its own.
                c.dirty = false;
            }
        }
    }

    /// The ids of the live connections.
    pub(super) fn ids(&self) -> Vec<ConnId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, c)| c.as_ref().is_some_and(|c| !c.closing))
            .map(|(i, _)| ConnId::from_index(i))
            .collect()
    }

    pub(super) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub(super) fn output(&self, id: ConnId) -> &[u8] {
        self.get(id).map_or(&[], |c| &c.out)
    }

    pub(super) fn consume_output(&mut self, id: ConnId, n: usize) {
        let Some(c) = self.get_mut(id) else { return };
        if n >= c.out.len() {
            // Free the buffer: most connections are idle between messages.
            c.out = Vec::new();
            c.dirty = false;
        } else {
            c.out.drain(..n);
        }
    }

    /// The connection counters of `rserpool status`.
    pub(super) fn add_counters(&self, c: &mut Counters) {
        c.connections_refused = self.refused;
        c.slow_connections_closed = self.slow_closed;
        c.protocol_errors = self.protocol_errors;
        c.tls_refused = self.tls_refused;
        c.errors_sent = self
            .errors_sent
            .iter()
            .map(|(code, n)| (format!("0x{code:x}"), *n))
            .collect();
    }
}

/// What a source did that the registrar refused, for its log lines (each is said once a
/// minute per source, [`Conns::limit_log`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Offence {
    /// A registration or deregistration refused.
    Registration,
    /// Re-registrations beyond `max-rereg-rate`.
    Reregistration,
    /// Handle resolutions beyond `max-hr-rate`.
    Resolution,
    /// ENDPOINT_UNREACHABLE reports beyond `max-eu-rate`.
    Unreachable,
    /// An ENRP connection from a host that is not a configured peer.
    Stranger,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One line a minute per source and offence: a source refused for one thing is still
    /// said when it floods with another (a resolution flood 53 s after an unrelated refusal
    /// was logged nothing, found by an operator).
    #[test]
    fn each_offence_of_a_source_is_said_once_a_minute() {
        let mut c = Conns::new(Arc::new(Config::default()), 1);
        let ip = std::net::IpAddr::from([10, 0, 0, 66]);
        let t = |s: u64| Instant::from_millis(100_000 + s * 1000);
        assert!(c.once_a_minute(ip, Offence::Registration, t(0)));
        assert!(!c.once_a_minute(ip, Offence::Registration, t(30)));
        assert!(c.once_a_minute(ip, Offence::Resolution, t(53)));
        assert!(!c.once_a_minute(ip, Offence::Resolution, t(60)));
        assert!(c.once_a_minute(ip, Offence::Registration, t(61)));
        let other = std::net::IpAddr::from([10, 0, 0, 67]);
        assert!(c.once_a_minute(other, Offence::Resolution, t(61)));
    }
}
