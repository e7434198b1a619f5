//! One member of the tier, sans IO: what it sends to whom, what its datapath must do, and
//! where the datapath forwards a packet it holds no entry for (docs/TIER.md, "Replicated
//! splice state" and "Before the splice is everywhere").
//!
//! A driver feeds it the pool's listing ([`MemberCore::set_listed`]), its outgoing links'
//! fate ([`MemberCore::link_up`], [`MemberCore::link_down`]), what other members send
//! ([`MemberCore::handle_message`]), the splices made here ([`MemberCore::splice_made`]), the
//! distributor's datagrams and the flow table when asked ([`MemberCore::compare`]); it polls
//! [`MemberCore::poll_transmit`] (messages for a link), [`MemberCore::poll_action`] (links
//! to open or close, datapath changes) and [`MemberCore::poll_timeout`].
//!
//! Each member keeps one outgoing link to every other listed member and applies what comes in
//! on the links others keep to it. A link that comes up carries HELLO first, then every splice
//! the member's flow table holds, including those of members that have since died: a member
//! that joins, or comes back after a partition, so learns all that the others know.
//! An empty TOUCH ends that table (a member of an older version ignores it as a TOUCH of
//! nothing).
//!
//! A member that (re)joins does not answer the distributor's heartbeats until every member the
//! tier pool lists has sent it its table, or [`SYNC_WAIT`] has passed: the distributor adds a
//! member to the router's group at its first answer, and the flows that then move to it must
//! find their splices there (a proxy restarted after its host died missed the splices made
//! meanwhile, and the clients of those met resets). A process that takes over from another
//! (an upgrade, [`MemberCore::taking_over`]) finds the table in the pinned maps and answers
//! at once; it leaves the datapath's forwarding as its predecessor set it until it has heard
//! from every listed member, since forwarding to nobody would send the packets of the
//! others' connections to a stack with no socket for them.

use crate::wire::{Datagram, Hello, Message, Splice};
use rserpool_wire::Instant;
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ops::RangeInclusive;
use std::time::Duration;
use tracing::{debug, info, warn};

/// How often the flow table is compared with the last pass.
pub const PASS: Duration = Duration::from_secs(1);
/// Longest a joining member waits, from the first listing that names it (when the others learn
/// of it and link to it), for the other members' tables before it answers the distributor's
/// heartbeats anyway (a member that never sends one: an older version, or one that is listed
/// but dead). Live members send theirs within milliseconds of the listing, or at their next
/// discovery round (1 s).
pub const SYNC_WAIT: Duration = Duration::from_millis(1200);
/// After a link to a listed member broke or failed to connect, when it is opened again (not
/// only at the next listing, up to a second away): a member upgraded hands its listener to
/// the process after it and closes its links, and that process forwards by port only to the
/// members that said HELLO to it.
pub const RELINK_AFTER: Duration = Duration::from_millis(100);
/// Most directions in one TOUCH.
pub const TOUCH_BATCH: usize = 4096;

/// A driver's name for one outgoing link (one connection attempt and what follows): events
/// of a link the core has replaced are told apart from the new one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinkId(pub u64);

/// A message for the other end of an outgoing link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    pub link: LinkId,
    /// The member at its other end.
    pub to: u32,
    pub message: Message,
}

/// Where the datapath sends a packet to the shared address with no flow entry: its
/// destination port is in `ports`, so the member `id` connected it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    pub id: u32,
    pub shared: Ipv4Addr,
    pub ports: RangeInclusive<u16>,
    /// That member's MAC, and this member's own (the frame's new source).
    pub mac: [u8; 6],
    pub src: [u8; 6],
}

/// One spliced connection of the flow table, as the once-a-second pass reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableEntry {
    pub splice: Splice,
    /// A FIN passed here, per direction (client → front, server → back).
    pub fin: [bool; 2],
    /// Packets carried here, per direction.
    pub packets: [u64; 2],
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Open an outgoing link to member `id`; report [`MemberCore::link_up`] or
    /// [`MemberCore::link_down`].
    Connect {
        link: LinkId,
        id: u32,
        addr: SocketAddr,
    },
    /// Close this link (its member left the pool or moved).
    Disconnect { link: LinkId, id: u32 },
    /// Install a splice another member made (one already installed stays as it is).
    Install(Splice),
    /// Remove a splice's entries.
    Remove(Splice),
    /// A FIN passed elsewhere in this direction.
    MarkFin(SocketAddrV4, SocketAddrV4),
    /// Packets passed elsewhere in these directions: they are not idle.
    Touch(Vec<(SocketAddrV4, SocketAddrV4)>),
    /// The members to forward to by port.
    SetTier(Vec<Forward>),
    /// The pass is due: read the flow table and give it to [`MemberCore::compare`].
    ReadTable,
    /// Another member died: nudge the TCP senders that lost packets to it (the prober also
    /// sends the probes); report [`MemberCore::nudge_done`].
    Nudge { dead: u32, prober: bool },
}

/// What the member counted, for its status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub sent: u64,
    pub received: u64,
    pub splices_in: u64,
    pub links_dropped: u64,
    pub heartbeats: u64,
    pub nudges: u64,
    pub nudge_probes: u64,
    pub nudge_reverts: u64,
}

#[derive(Debug, Clone)]
struct Link {
    id: LinkId,
    addr: SocketAddr,
    up: bool,
}

/// One member's state.
#[derive(Debug)]
pub struct MemberCore {
    me: Hello,
    /// A proxy sends its table on every new link; a server of a split splice does not.
    shares: bool,
    next_link: u64,
    /// Outgoing links, by the member at their other end.
    links: BTreeMap<u32, Link>,
    /// The other members as their HELLOs described them (a HELLO comes once per link).
    members: BTreeMap<u32, Hello>,
    /// The members the tier pool lists now.
    listed: BTreeMap<u32, SocketAddr>,
    forwarding: Option<Vec<Forward>>,
    /// The flow table at the last pass.
    last: BTreeMap<(SocketAddrV4, SocketAddrV4), TableEntry>,
    /// The splices the other members know of: sent by this member ([`Self::splice_made`])
    /// or received from one, as of the last pass.
    told: BTreeMap<(SocketAddrV4, SocketAddrV4), Splice>,
    next_pass: Option<Instant>,
    /// A member left: the next pass, run at once, sends the whole table to every link.
    resend: bool,
    /// Where the heartbeats come from: the only source of the word of a death.
    distributor: Option<SocketAddr>,
    nudging: bool,
    /// Heartbeats go unanswered until the tables arrive (or the wait from `first_listed` is
    /// over).
    sync_pending: bool,
    /// The datapath's forwarding is left as a predecessor set it (a process taking over).
    forwarding_held: bool,
    /// When the pool first listed this member.
    first_listed: Option<Instant>,
    /// When the listed members without a link are linked to again ([`RELINK_AFTER`]).
    relink: Option<Instant>,
    /// Gone from the pool while their link is up: their registration failed (a registrar cut
    /// off), not necessarily they. Linked to and forwarded to until the link breaks or the
    /// distributor says they died.
    unlisted: std::collections::BTreeSet<u32>,
    /// Members whose table arrived, and whether the pool was listed yet.
    tables: std::collections::BTreeSet<u32>,
    listing_seen: bool,
    transmits: VecDeque<Transmit>,
    actions: VecDeque<Action>,
    pub counters: Counters,
}

impl MemberCore {
    /// A member that says `me` of itself; `shares`: it sends its flow table to members that
    /// link to it (a proxy).
    pub fn new(me: Hello, shares: bool, now: Instant) -> Self {
        Self {
            me,
            shares,
            next_link: 0,
            links: BTreeMap::new(),
            members: BTreeMap::new(),
            listed: BTreeMap::new(),
            forwarding: None,
            last: BTreeMap::new(),
            told: BTreeMap::new(),
            relink: None,
            unlisted: std::collections::BTreeSet::new(),
            next_pass: Some(now + PASS),
            resend: false,
            distributor: None,
            nudging: false,
            sync_pending: true,
            forwarding_held: false,
            first_listed: None,
            tables: std::collections::BTreeSet::new(),
            listing_seen: false,
            transmits: VecDeque::new(),
            actions: VecDeque::new(),
            counters: Counters::default(),
        }
    }

    /// This member takes over from another process (an upgrade): its table is whole already
    /// (the pinned maps), so it answers heartbeats at once, and the forwarding its predecessor
    /// set stays until every listed member has said HELLO here (or the wait is over).
    pub fn taking_over(&mut self) {
        self.sync_pending = false;
        self.forwarding_held = true;
    }

    /// Whether the wait for the others, counted from the first listing that named this
    /// member, is over.
    fn waited(&self, now: Instant) -> bool {
        self.first_listed.is_some_and(|t| now >= t + SYNC_WAIT)
    }

    /// Whether heartbeats are answered: every listed member's table arrived, or the wait is
    /// over.
    fn synced(&mut self, now: Instant) -> bool {
        if !self.sync_pending {
            return true;
        }
        let me = self.me.id;
        let missing: Vec<u32> = self
            .listed
            .keys()
            .filter(|&&id| id != me && !self.tables.contains(&id))
            .copied()
            .collect();
        if self.listing_seen && missing.is_empty() {
            info!(
                "tier member {me:#010x}: the tables of the {} other members arrived; answering \
                 the distributor",
                self.tables.len()
            );
        } else if self.waited(now) {
            let missing: Vec<String> = missing.iter().map(|id| format!("{id:#010x}")).collect();
            warn!(
                "tier member {me:#010x}: answering the distributor without the tables of [{}] \
                 after {SYNC_WAIT:?}",
                missing.join(" ")
            );
        } else {
            return false;
        }
        self.sync_pending = false;
        true
    }
    pub fn me(&self) -> &Hello {
        &self.me
    }

    /// Outgoing links, open or opening.
    pub fn links(&self) -> usize {
        self.links.len()
    }

    /// Members forwarded to: listed, and their HELLO received.
    pub fn members_known(&self) -> usize {
        self.members
            .keys()
            .filter(|id| self.listed.contains_key(id))
            .count()
    }

    /// Listed other members whose whole table arrived here (their link's first empty TOUCH).
    pub fn tables_received(&self) -> usize {
        self.listed
            .keys()
            .filter(|&&id| id != self.me.id && self.tables.contains(&id))
            .count()
    }

    /// Whether this member answers the distributor's heartbeats (its start-up wait for the
    /// others' tables is over).
    pub fn answering(&self) -> bool {
        !self.sync_pending
    }

    /// The members the tier pool lists now (this one may be among them).
    pub fn set_listed(&mut self, listed: BTreeMap<u32, SocketAddr>, now: Instant) {
        self.listing_seen = true;
        if self.first_listed.is_none() && listed.contains_key(&self.me.id) {
            self.first_listed = Some(now);
        }
        let gone: Vec<u32> = self
            .listed
            .keys()
            .filter(|id| !listed.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if self.links.get(&id).is_some_and(|l| l.up) {
                if self.unlisted.insert(id) {
                    info!(
                        "tier member {id:#010x} left the pool but its link is up: kept until \
                         the link breaks or the distributor says it died"
                    );
                }
            } else {
                self.member_lost(id, now);
            }
        }
        self.unlisted.retain(|id| !listed.contains_key(id));
        for (id, addr) in listed {
            self.member_found(id, addr, now);
        }
    }

    /// Member `id` is listed at `addr`: linked to, unless a link to that address is open.
    pub fn member_found(&mut self, id: u32, addr: SocketAddr, _now: Instant) {
        if id == self.me.id {
            return;
        }
        let relisted = self.listed.insert(id, addr) != Some(addr);
        if self.links.get(&id).is_some_and(|l| l.addr != addr) {
            self.close(id);
        }
        if !self.links.contains_key(&id) {
            let link = LinkId(self.next_link);
            self.next_link += 1;
            self.links.insert(
                id,
                Link {
                    id: link,
                    addr,
                    up: false,
                },
            );
            self.actions.push_back(Action::Connect { link, id, addr });
        }
        if relisted {
            self.update_forwarding();
        }
    }

    /// Member `id` left the pool: no link to it, nothing forwarded to it. What it made and
    /// could not deliver before it died may have reached only some of the others: each
    /// member sends its whole table to every other once more, at once.
    pub fn member_lost(&mut self, id: u32, now: Instant) {
        self.unlisted.remove(&id);
        if self.listed.remove(&id).is_some() {
            info!("tier member {id:#010x} left the pool");
            self.close(id);
            self.update_forwarding();
            if self.shares {
                self.resend = true;
                if self.next_pass.is_some() {
                    self.next_pass = Some(now);
                }
            }
        }
    }

    fn close(&mut self, id: u32) {
        if let Some(l) = self.links.remove(&id) {
            self.actions
                .push_back(Action::Disconnect { link: l.id, id });
        }
    }

    /// Link `link` is connected: what it carries first (HELLO, then every splice of
    /// `table`, when this member shares), before what [`Self::poll_transmit`] gives for it.
    pub fn link_up(
        &mut self,
        link: LinkId,
        table: impl IntoIterator<Item = Splice>,
        _now: Instant,
    ) -> Vec<Message> {
        if let Some(l) = self.links.values_mut().find(|l| l.id == link) {
            l.up = true;
        }
        let mut first = vec![Message::Hello(self.me)];
        if self.shares {
            first.extend(table.into_iter().map(Message::Add));
        }
        first.push(Message::Touch(Vec::new()));
        first
    }

    /// Link `link` failed to connect or broke (`fell_behind`: its queue was full). It is
    /// opened again after [`RELINK_AFTER`] (or at the next listing), and then carries
    /// everything again.
    pub fn link_down(&mut self, link: LinkId, fell_behind: bool, now: Instant) {
        let Some((&id, _)) = self.links.iter().find(|(_, l)| l.id == link) else {
            return;
        };
        self.links.remove(&id);
        if fell_behind {
            self.counters.links_dropped += 1;
        }
        if self.unlisted.contains(&id) {
            // Gone from the pool, and now unreachable: gone.
            self.member_lost(id, now);
        } else if self.listed.contains_key(&id) && self.relink.is_none() {
            self.relink = Some(now + RELINK_AFTER);
        }
    }

    /// Whether `link` is one the core keeps now.
    pub fn has_link(&self, link: LinkId) -> bool {
        self.links.values().any(|l| l.id == link)
    }

    /// Sends `m` on every link, open or opening.
    fn broadcast(&mut self, m: &Message) {
        for (&to, l) in &self.links {
            self.counters.sent += 1;
            self.transmits.push_back(Transmit {
                link: l.id,
                to,
                message: m.clone(),
            });
        }
    }

    /// A splice was just made here (a hand-over): every other member gets it at once.
    pub fn splice_made(&mut self, s: Splice) {
        // Debug lines trace a splice from its making to every replica (`rserpool_tier=debug`).
        debug!(
            "tier member {:#010x}: splice {} ↔ {} made, sent to {} link(s)",
            self.me.id,
            s.client,
            s.server,
            self.links.len()
        );
        self.told.insert(s.key(), s);
        self.broadcast(&Message::Add(s));
    }

    /// What another member sent.
    pub fn handle_message(&mut self, m: Message, now: Instant) {
        self.handle_message_from(None, m, now);
    }

    /// [`handle_message`](Self::handle_message) from member `from` (the HELLO of its link
    /// named it): an empty TOUCH from it ends its table.
    pub fn handle_message_from(&mut self, from: Option<u32>, m: Message, _now: Instant) {
        self.counters.received += 1;
        if let (Some(id), Message::Touch(flows)) = (from, &m)
            && flows.is_empty()
        {
            self.tables.insert(id);
            return;
        }
        match m {
            Message::Hello(member) => {
                if member.id == self.me.id {
                    return;
                }
                if member.overlaps(&self.me) {
                    warn!(
                        "tier member {:#010x} uses ports {}-{}, which overlap ours ({}-{}): \
                         not forwarding to it; give each member its own range",
                        member.id, member.lo, member.hi, self.me.lo, self.me.hi
                    );
                    return;
                }
                self.members.insert(member.id, member);
                self.update_forwarding();
            }
            Message::Add(s) => {
                debug!(
                    "tier member {:#010x}: splice {} ↔ {} from {}",
                    self.me.id,
                    s.client,
                    s.server,
                    from.map_or_else(|| "a member".into(), |f| format!("{f:#010x}"))
                );
                self.counters.splices_in += 1;
                self.told.insert(s.key(), s);
                self.actions.push_back(Action::Install(s));
            }
            Message::Del(s) => self.actions.push_back(Action::Remove(s)),
            Message::Fin(a, b) => self.actions.push_back(Action::MarkFin(a, b)),
            Message::Touch(flows) => self.actions.push_back(Action::Touch(flows)),
        }
    }

    /// The members to forward to: listed, their HELLO received, with ports (a server of a
    /// split splice has none: nothing is forwarded to it).
    pub fn forwarding(&self) -> Vec<Forward> {
        self.members
            .values()
            .filter(|m| self.listed.contains_key(&m.id) && m.hi > 0)
            .map(|m| Forward {
                id: m.id,
                shared: m.shared,
                ports: m.lo..=m.hi,
                mac: m.mac,
                src: self.me.mac,
            })
            .collect()
    }

    fn update_forwarding(&mut self) {
        if self.forwarding_held {
            let me = self.me.id;
            let heard_all = self.listing_seen
                && self
                    .listed
                    .keys()
                    .all(|id| *id == me || self.members.contains_key(id));
            if !heard_all {
                return;
            }
            self.forwarding_held = false;
        }
        let now = self.forwarding();
        if self.forwarding.as_ref() != Some(&now) {
            self.forwarding = Some(now.clone());
            self.actions.push_back(Action::SetTier(now));
        }
    }

    /// Runs the timers due at `now`.
    pub fn tick(&mut self, now: Instant) {
        if self.forwarding_held && self.waited(now) {
            warn!(
                "tier member {:#010x}: not every listed member said HELLO within {SYNC_WAIT:?} \
                 of the take-over; forwarding to those that did",
                self.me.id
            );
            self.forwarding_held = false;
            self.update_forwarding();
        }
        if self.next_pass.is_some_and(|t| t <= now) {
            self.next_pass = None;
            self.actions.push_back(Action::ReadTable);
        }
        if self.relink.is_some_and(|t| t <= now) {
            self.relink = None;
            for (id, addr) in self.listed.clone() {
                self.member_found(id, addr, now);
            }
        }
    }

    /// The pass: the flow table now, against the last pass. What only this member saw goes
    /// to the others: a splice nobody told them of, a FIN that passed, a connection that
    /// ended here (an RST, or expiry), and the directions it carried packets of.
    ///
    /// A splice nobody told them of is one the process before this one made as it handed
    /// over (an upgrade): it shares the pinned flow table, but no longer the links.
    pub fn compare(&mut self, table: Vec<TableEntry>, now: Instant) {
        self.next_pass = Some(now + PASS);
        let table: BTreeMap<_, _> = table.into_iter().map(|e| (e.splice.key(), e)).collect();
        let mut touched = Vec::new();
        let mut out = Vec::new();
        if std::mem::take(&mut self.resend) {
            out.extend(table.values().map(|e| Message::Add(e.splice)));
        } else if self.shares {
            out.extend(
                table
                    .iter()
                    .filter(|(k, e)| self.told.get(*k) != Some(&e.splice))
                    .map(|(_, e)| Message::Add(e.splice)),
            );
        }
        self.told = table.iter().map(|(k, e)| (*k, e.splice)).collect();
        for (k, e) in &table {
            let before = self.last.get(k);
            for (i, (from, to)) in e.splice.directions().into_iter().enumerate() {
                if e.fin[i] && !before.is_some_and(|b| b.fin[i]) {
                    out.push(Message::Fin(from, to));
                }
                if e.packets[i] > before.map_or(0, |b| b.packets[i]) {
                    touched.push((from, to));
                }
            }
        }
        for (k, e) in &self.last {
            if !table.contains_key(k) {
                out.push(Message::Del(e.splice));
            }
        }
        for batch in touched.chunks(TOUCH_BATCH) {
            out.push(Message::Touch(batch.to_vec()));
        }
        for m in &out {
            self.broadcast(m);
        }
        self.last = table;
    }

    /// A datagram on the tier address from `from`; `free` is this member's free capacity
    /// (0..=1) for a heartbeat's answer. Returns the answer to send back.
    pub fn handle_datagram(
        &mut self,
        from: SocketAddr,
        bytes: &[u8],
        free: f64,
        now: Instant,
    ) -> Option<Vec<u8>> {
        match Datagram::decode_at_member(bytes)? {
            Datagram::Heartbeat { seq } => {
                self.distributor = Some(from);
                if !self.synced(now) {
                    return None;
                }
                self.counters.heartbeats += 1;
                let free = (free.clamp(0.0, 1.0) * 1e6) as u32;
                Some(
                    Datagram::Answer {
                        seq,
                        id: self.me.id,
                        free,
                    }
                    .encode(),
                )
            }
            // Only the distributor that sends the heartbeats is listened to, and one nudge
            // runs at a time (each costs two probes per spliced connection).
            Datagram::Dead { dead, prober } => {
                if self.distributor == Some(from) && self.unlisted.contains(&dead) {
                    self.member_lost(dead, now);
                }
                if self.distributor == Some(from) && dead != self.me.id && !self.nudging {
                    self.nudging = true;
                    self.counters.nudges += 1;
                    self.actions.push_back(Action::Nudge { dead, prober });
                }
                None
            }
            Datagram::Answer { .. } => None,
        }
    }

    /// The nudge asked for ended: its probes and ICMP errors, if it worked.
    pub fn nudge_done(&mut self, sent: Option<(usize, usize)>) {
        self.nudging = false;
        if let Some((probes, reverts)) = sent {
            self.counters.nudge_probes += probes as u64;
            self.counters.nudge_reverts += reverts as u64;
        }
    }

    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Self::tick`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let held = self
            .first_listed
            .filter(|_| self.forwarding_held)
            .map(|t| t + SYNC_WAIT);
        [self.next_pass, held, self.relink]
            .into_iter()
            .flatten()
            .min()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::wire::tests::splice;

    fn hello(id: u32, lo: u16) -> Hello {
        Hello {
            id,
            mac: [2, 0, 0, 0, 0, id as u8],
            shared: Ipv4Addr::new(10, 9, 0, 2),
            lo,
            hi: lo + 999,
        }
    }

    fn addr(id: u32) -> SocketAddr {
        SocketAddr::from(([10, 0, 1, id as u8], 9950))
    }

    fn t(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn actions(c: &mut MemberCore) -> Vec<Action> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    fn transmits(c: &mut MemberCore) -> Vec<Transmit> {
        std::iter::from_fn(|| c.poll_transmit()).collect()
    }

    #[test]
    fn links_follow_the_listing_and_a_new_link_carries_everything() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.set_listed([(1, addr(1)), (2, addr(2))].into(), t(0));
        let a = actions(&mut c);
        let Some(Action::Connect { link, id: 2, .. }) = a.first().cloned() else {
            panic!("{a:?}")
        };
        // Nothing to forward to before a HELLO.
        assert!(a.contains(&Action::SetTier(Vec::new())));
        // A splice made while the link opens waits for it.
        c.splice_made(splice());
        let first = c.link_up(link, [splice()], t(5));
        assert_eq!(
            first,
            vec![
                Message::Hello(hello(1, 20000)),
                Message::Add(splice()),
                Message::Touch(Vec::new())
            ]
        );
        assert_eq!(transmits(&mut c).len(), 1);
        // A broken link is opened again soon (or at the next listing, if sooner).
        c.link_down(link, true, t(10));
        assert_eq!(c.links(), 0);
        let again = t(10) + RELINK_AFTER;
        assert!(c.poll_timeout().is_some_and(|t| t <= again));
        c.tick(t(10 + RELINK_AFTER.as_millis() as u64 - 1));
        assert_eq!(c.links(), 0);
        c.tick(again);
        let connect = actions(&mut c);
        assert!(matches!(connect[..], [Action::Connect { id: 2, .. }]));
        let Action::Connect { link: second, .. } = connect[0] else {
            panic!()
        };
        // One that fails to connect is tried again after the same wait.
        c.link_down(second, false, t(200));
        c.tick(t(200) + RELINK_AFTER);
        assert!(matches!(
            actions(&mut c)[..],
            [Action::Connect { id: 2, .. }]
        ));
        c.set_listed([(2, addr(2))].into(), t(1000));
        assert!(actions(&mut c).is_empty(), "linked already");
        // An event of the old link changes nothing.
        c.link_down(link, false, t(1001));
        assert_eq!(c.links(), 1);
        // Gone from the pool: closed.
        c.set_listed(BTreeMap::new(), t(2000));
        assert!(matches!(
            actions(&mut c)[..],
            [Action::Disconnect { id: 2, .. }, ..]
        ));
        assert_eq!(c.counters.links_dropped, 1);
    }

    #[test]
    fn a_split_server_sends_no_table() {
        let mut c = MemberCore::new(hello(1, 0), false, t(0));
        c.member_found(2, addr(2), t(0));
        let Some(Action::Connect { link, .. }) = c.poll_action() else {
            panic!()
        };
        assert_eq!(
            c.link_up(link, [splice()], t(1)),
            vec![Message::Hello(hello(1, 0)), Message::Touch(Vec::new())]
        );
    }

    /// A joining member answers the distributor once every listed member's table arrived
    /// (an empty TOUCH on its link ends it), or after [`SYNC_WAIT`]; one that took over from
    /// another process at once.
    #[test]
    fn a_joining_member_answers_heartbeats_once_it_has_every_table() {
        let d: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let hb = Datagram::Heartbeat { seq: 1 }.encode();
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        assert_eq!(
            c.handle_datagram(d, &hb, 1.0, t(10)),
            None,
            "not listed yet"
        );
        c.set_listed([(1, addr(1)), (2, addr(2)), (3, addr(3))].into(), t(20));
        for (from, m) in [
            (2, Message::Hello(hello(2, 21000))),
            (2, Message::Add(splice())),
            (2, Message::Touch(Vec::new())),
            (3, Message::Hello(hello(3, 22000))),
        ] {
            c.handle_message_from(Some(from), m, t(30));
        }
        assert_eq!(
            c.handle_datagram(d, &hb, 1.0, t(40)),
            None,
            "3's table is not in"
        );
        c.handle_message_from(Some(3), Message::Touch(Vec::new()), t(50));
        assert!(c.handle_datagram(d, &hb, 1.0, t(60)).is_some());
        // A member that hears from nobody answers after the wait, counted from the first
        // listing that names it.
        let mut lone = MemberCore::new(hello(1, 20000), true, t(0));
        lone.set_listed([(2, addr(2))].into(), t(0));
        lone.set_listed([(1, addr(1)), (2, addr(2))].into(), t(100));
        let wait = SYNC_WAIT.as_millis() as u64;
        assert_eq!(lone.handle_datagram(d, &hb, 1.0, t(wait + 99)), None);
        assert!(lone.handle_datagram(d, &hb, 1.0, t(wait + 100)).is_some());
        // Alone in the pool: at once.
        let mut first = MemberCore::new(hello(1, 20000), true, t(0));
        first.set_listed([(1, addr(1))].into(), t(0));
        assert!(first.handle_datagram(d, &hb, 1.0, t(1)).is_some());
        // Taking over from another process: at once.
        let mut next = MemberCore::new(hello(1, 20000), true, t(0));
        next.taking_over();
        assert!(next.handle_datagram(d, &hb, 1.0, t(0)).is_some());
    }

    /// A member gone from the pool whose link is up (its registrar was cut off, not it) is
    /// still linked to and forwarded to; the distributor's word of its death, or its link
    /// breaking, ends that.
    #[test]
    fn a_member_gone_from_the_pool_with_its_link_up_stays_until_it_dies() {
        let d: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let dead = |id| {
            Datagram::Dead {
                dead: id,
                prober: false,
            }
            .encode()
        };
        for by_link in [false, true] {
            let mut c = MemberCore::new(hello(1, 20000), true, t(0));
            c.handle_datagram(d, &Datagram::Heartbeat { seq: 1 }.encode(), 1.0, t(0));
            c.set_listed([(1, addr(1)), (2, addr(2))].into(), t(0));
            let Some(Action::Connect { link, .. }) = actions(&mut c)
                .into_iter()
                .find(|a| matches!(a, Action::Connect { .. }))
            else {
                panic!("no link to 2")
            };
            let _ = c.link_up(link, [], t(1));
            c.handle_message_from(Some(2), Message::Hello(hello(2, 21000)), t(2));
            let _ = actions(&mut c);
            c.set_listed([(1, addr(1))].into(), t(10));
            assert_eq!(c.forwarding().len(), 1, "still forwarded to");
            assert!(
                !actions(&mut c)
                    .iter()
                    .any(|a| matches!(a, Action::Disconnect { .. })),
                "still linked"
            );
            if by_link {
                c.link_down(link, false, t(20));
            } else {
                c.handle_datagram(d, &dead(2), 1.0, t(20));
            }
            assert!(c.forwarding().is_empty(), "by_link {by_link}");
            assert!(actions(&mut c).contains(&Action::SetTier(Vec::new())));
        }
    }

    /// A process taking over leaves the forwarding its predecessor set until every listed
    /// member has said HELLO to it (they link again once the predecessor's links close).
    #[test]
    fn a_member_taking_over_keeps_the_forwarding_until_it_has_heard_everyone() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.taking_over();
        c.set_listed([(1, addr(1)), (2, addr(2)), (3, addr(3))].into(), t(0));
        c.handle_message_from(Some(2), Message::Hello(hello(2, 21000)), t(10));
        let set = |c: &mut MemberCore| {
            actions(c)
                .into_iter()
                .filter_map(|a| match a {
                    Action::SetTier(f) => Some(f.len()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(set(&mut c), Vec::<usize>::new(), "3 has not said HELLO");
        c.handle_message_from(Some(3), Message::Hello(hello(3, 22000)), t(20));
        assert_eq!(set(&mut c), vec![2]);
        // One that never says HELLO holds it for the wait only.
        let mut d = MemberCore::new(hello(1, 20000), true, t(0));
        d.taking_over();
        d.set_listed([(1, addr(1)), (2, addr(2)), (3, addr(3))].into(), t(0));
        d.handle_message_from(Some(2), Message::Hello(hello(2, 21000)), t(10));
        assert!(d.poll_timeout() <= Some(t(SYNC_WAIT.as_millis() as u64)));
        d.tick(t(SYNC_WAIT.as_millis() as u64));
        assert_eq!(set(&mut d), vec![1]);
    }

    #[test]
    fn forwarding_is_to_listed_members_that_said_hello_with_ports() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.handle_message(Message::Hello(hello(2, 21000)), t(0));
        c.handle_message(
            Message::Hello(Hello {
                lo: 0,
                hi: 0,
                ..hello(4, 0)
            }),
            t(0),
        );
        // Overlapping ports: not forwarded to.
        c.handle_message(Message::Hello(hello(5, 20500)), t(0));
        assert!(c.forwarding().is_empty());
        c.set_listed([(2, addr(2)), (4, addr(4)), (5, addr(5))].into(), t(1));
        let f = c.forwarding();
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].id, f[0].ports.clone()), (2, 21000..=21999));
        assert_eq!((f[0].mac, f[0].src), (hello(2, 0).mac, hello(1, 0).mac));
        assert!(actions(&mut c).contains(&Action::SetTier(f)));
        c.set_listed([(4, addr(4))].into(), t(2));
        assert!(actions(&mut c).contains(&Action::SetTier(Vec::new())));
    }

    #[test]
    fn the_pass_sends_fins_ends_and_activity() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.member_found(2, addr(2), t(0));
        let _ = actions(&mut c);
        assert_eq!(c.poll_timeout(), Some(t(1000)));
        c.tick(t(1000));
        assert_eq!(actions(&mut c), vec![Action::ReadTable]);
        assert_eq!(c.poll_timeout(), None);
        let s = splice();
        c.splice_made(s);
        let _ = transmits(&mut c);
        let e = TableEntry {
            splice: s,
            fin: [false, false],
            packets: [3, 0],
        };
        c.compare(vec![e], t(1001));
        assert_eq!(
            transmits(&mut c)
                .into_iter()
                .map(|x| x.message)
                .collect::<Vec<_>>(),
            vec![Message::Touch(vec![(s.client, s.front)])]
        );
        // Nothing new: nothing sent.
        c.compare(vec![e], t(2001));
        assert!(transmits(&mut c).is_empty());
        c.compare(
            vec![TableEntry {
                fin: [false, true],
                packets: [3, 1],
                ..e
            }],
            t(3001),
        );
        let m: Vec<Message> = transmits(&mut c).into_iter().map(|x| x.message).collect();
        assert_eq!(
            m,
            vec![
                Message::Fin(s.server, s.back),
                Message::Touch(vec![(s.server, s.back)])
            ]
        );
        c.compare(Vec::new(), t(4001));
        let m: Vec<Message> = transmits(&mut c).into_iter().map(|x| x.message).collect();
        assert_eq!(m, vec![Message::Del(s)]);
        assert_eq!(c.poll_timeout(), Some(t(5001)));
    }

    /// A splice in the table that no member was told of (the process before this one made
    /// it while handing over) goes to the others at the next pass, once; one received from
    /// another member does not go back.
    #[test]
    fn the_pass_sends_a_splice_nobody_was_told_of() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.member_found(2, addr(2), t(0));
        let _ = actions(&mut c);
        let mine = splice();
        let theirs = Splice {
            client: "10.0.9.9:4000".parse().unwrap(),
            ..mine
        };
        c.handle_message(Message::Add(theirs), t(0));
        let entry = |s| TableEntry {
            splice: s,
            fin: [false; 2],
            packets: [0; 2],
        };
        c.compare(vec![entry(mine), entry(theirs)], t(1000));
        let m: Vec<Message> = transmits(&mut c).into_iter().map(|x| x.message).collect();
        assert_eq!(m, vec![Message::Add(mine)]);
        c.compare(vec![entry(mine), entry(theirs)], t(2000));
        assert!(transmits(&mut c).is_empty());
        // The same addresses, another connection (its translation differs): sent again.
        let again = Splice {
            client_seq_delta: mine.client_seq_delta.wrapping_add(1),
            ..mine
        };
        c.compare(vec![entry(again), entry(theirs)], t(3000));
        let m: Vec<Message> = transmits(&mut c).into_iter().map(|x| x.message).collect();
        assert_eq!(m, vec![Message::Add(again)]);
        // A member that does not share (a server of a split splice) sends none.
        let mut quiet = MemberCore::new(hello(3, 0), false, t(0));
        quiet.member_found(2, addr(2), t(0));
        quiet.compare(vec![entry(mine)], t(1000));
        assert!(transmits(&mut quiet).is_empty());
    }

    #[test]
    fn a_member_that_leaves_makes_the_next_pass_resend_the_table_at_once() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        c.set_listed([(2, addr(2)), (3, addr(3))].into(), t(0));
        let _ = actions(&mut c);
        c.set_listed([(2, addr(2))].into(), t(300));
        assert_eq!(c.poll_timeout(), Some(t(300)));
        c.tick(t(300));
        assert!(actions(&mut c).contains(&Action::ReadTable));
        let e = TableEntry {
            splice: splice(),
            fin: [false; 2],
            packets: [0; 2],
        };
        c.compare(vec![e], t(301));
        let m: Vec<Message> = transmits(&mut c).into_iter().map(|x| x.message).collect();
        assert_eq!(m, vec![Message::Add(splice())]);
        c.compare(vec![e], t(1301));
        assert!(transmits(&mut c).is_empty());
    }

    #[test]
    fn messages_become_datapath_actions() {
        let mut c = MemberCore::new(hello(1, 20000), true, t(0));
        let s = splice();
        c.handle_message(Message::Add(s), t(0));
        c.handle_message(Message::Del(s), t(0));
        c.handle_message(Message::Fin(s.client, s.front), t(0));
        c.handle_message(Message::Touch(vec![(s.client, s.front)]), t(0));
        assert_eq!(
            actions(&mut c),
            vec![
                Action::Install(s),
                Action::Remove(s),
                Action::MarkFin(s.client, s.front),
                Action::Touch(vec![(s.client, s.front)])
            ]
        );
        assert_eq!((c.counters.received, c.counters.splices_in), (4, 1));
    }

    #[test]
    fn heartbeats_are_answered_and_only_their_sender_tells_a_death() {
        let mut c = MemberCore::new(hello(7, 20000), true, t(0));
        c.set_listed(BTreeMap::new(), t(0));
        let d: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let dead = Datagram::Dead {
            dead: 9,
            prober: true,
        }
        .encode();
        assert_eq!(c.handle_datagram(d, &dead, 1.0, t(0)), None);
        assert_eq!(c.poll_action(), None);
        let answer = c
            .handle_datagram(d, &Datagram::Heartbeat { seq: 3 }.encode(), 0.25, t(0))
            .unwrap();
        assert_eq!(
            Datagram::decode_at_distributor(&answer),
            Some(Datagram::Answer {
                seq: 3,
                id: 7,
                free: 250_000
            })
        );
        c.handle_datagram(d, &dead, 1.0, t(1));
        c.handle_datagram(d, &dead, 1.0, t(1));
        assert_eq!(
            actions(&mut c),
            vec![Action::Nudge {
                dead: 9,
                prober: true
            }]
        );
        c.nudge_done(Some((4, 2)));
        let own = Datagram::Dead {
            dead: 7,
            prober: true,
        }
        .encode();
        c.handle_datagram(d, &own, 1.0, t(2));
        assert_eq!(c.poll_action(), None);
        assert_eq!((c.counters.nudges, c.counters.nudge_probes), (1, 4));
    }
}
