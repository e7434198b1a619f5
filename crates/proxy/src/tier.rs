//! The fault-tolerant proxy tier (issue 16; the TCP splice seed, §2–5): several proxies carry
//! the spliced connections of each other, so that one of them can die without breaking any.
//!
//! - **A pool.** Each proxy registers as a pool element of the tier's pool handle, its tier
//!   address as its transport and its free capacity (the workload factor) as its load, so
//!   the registrars know the tier and the distributor (`rserpool distributor`) finds it.
//! - **Replicated splice state.** Members find each other in that pool and keep a TCP link to
//!   every other member. A member sends each new splice (a hand-over's entries) to all the
//!   others at once; a member joining is sent every splice the others know. Once a second a
//!   member compares its flow table with the last pass and tells the others what only it can
//!   see: a FIN that passed (the pair then expires everywhere), a connection that ended (an
//!   RST, or expiry) and the connections it carried packets of (so that they do not idle out
//!   where they passed no packet).
//! - **Shared addresses.** The clients' address and the server-facing address are on every
//!   member; the router spreads packets over the members by a hash. A PE's packet for a
//!   connection that is not spliced yet may so reach a member without its socket: each member
//!   connects to PEs from its own range of ports, and the datapath forwards such a packet to
//!   the member whose range it is (`TierMember`).
//!
//! The protocol between members (TCP, on the tier address; heartbeats on UDP on the same
//! port) is described in docs/TIER.md. A partition: both sides go on carrying what they have;
//! splices made meanwhile reach the other side when the link is back (a member that connects
//! sends everything it knows).

use crate::config::TierConfig;
use crate::l4::kernel::KernelSplice;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use rserpool_asap::{PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_ksplice::Error as DatapathError;
use rserpool_ksplice::{Splice, SpliceState, TierMember};
use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// The pool the servers of split splices register in: the tier's, with `.split`.
pub(crate) fn split_pool(tier: &str) -> rserpool_wire::PoolHandle {
    rserpool_wire::PoolHandle::from(format!("{tier}.split").as_str())
}

/// Longest message between members.
const MAX_MESSAGE: usize = 1 << 20;
/// Messages queued towards one member; past that the link is dropped and, once it is back,
/// everything is sent again.
const QUEUE: usize = 65_536;
/// How often the flow table is compared with the last pass.
const PASS: Duration = Duration::from_secs(1);
/// Heartbeat datagrams start with this.
pub const HEARTBEAT_MAGIC: &[u8; 4] = b"RSPT";
/// The distributor's word that a member died, on the heartbeat socket: this magic, the dead
/// member's ID (4 bytes) and 1 if this member is to send the nudge's probes, else 0.
pub const DEAD_MAGIC: &[u8; 4] = b"RSPD";

mod msg {
    pub const HELLO: u8 = 1;
    pub const ADD: u8 = 2;
    pub const DEL: u8 = 3;
    pub const FIN: u8 = 4;
    pub const TOUCH: u8 = 5;
}

/// What a member says of itself in its HELLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    id: u32,
    mac: [u8; 6],
    shared: Ipv4Addr,
    lo: u16,
    hi: u16,
}

#[derive(Debug, Clone)]
enum Message {
    Hello(Member),
    Add(Splice),
    Del(Splice),
    Fin(SocketAddrV4, SocketAddrV4),
    Touch(Vec<(SocketAddrV4, SocketAddrV4)>),
}

fn put_addr(b: &mut BytesMut, a: SocketAddrV4) {
    b.put_slice(&a.ip().octets());
    b.put_u16(a.port());
}

fn get_addr(b: &mut Bytes) -> Option<SocketAddrV4> {
    if b.remaining() < 6 {
        return None;
    }
    let ip = Ipv4Addr::from(b.get_u32());
    Some(SocketAddrV4::new(ip, b.get_u16()))
}

fn put_splice(b: &mut BytesMut, s: &Splice) {
    for a in [s.client, s.front, s.back, s.server] {
        put_addr(b, a);
    }
    b.put_u32(s.client_seq_delta);
    b.put_u32(s.server_seq_delta);
    b.put_slice(&[
        s.client_wscale,
        s.front_wscale,
        s.server_wscale,
        s.back_wscale,
    ]);
    match s.timestamps {
        Some((c, v)) => {
            b.put_u8(1);
            b.put_u32(c);
            b.put_u32(v);
        }
        None => b.put_u8(0),
    }
}

fn get_splice(b: &mut Bytes) -> Option<Splice> {
    let (client, front, back, server) = (get_addr(b)?, get_addr(b)?, get_addr(b)?, get_addr(b)?);
    if b.remaining() < 13 {
        return None;
    }
    let (cs, ss) = (b.get_u32(), b.get_u32());
    let ws = [b.get_u8(), b.get_u8(), b.get_u8(), b.get_u8()];
    let timestamps = match b.get_u8() {
        0 => None,
        _ if b.remaining() >= 8 => Some((b.get_u32(), b.get_u32())),
        _ => return None,
    };
    Some(Splice {
        client,
        front,
        back,
        server,
        client_seq_delta: cs,
        server_seq_delta: ss,
        // Each member finds its own interfaces.
        client_if: 0,
        server_if: 0,
        client_wscale: ws[0],
        front_wscale: ws[1],
        server_wscale: ws[2],
        back_wscale: ws[3],
        timestamps,
    })
}

impl Message {
    /// The message with its length (u32) and type in front.
    fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(64);
        b.put_u32(0);
        match self {
            Self::Hello(m) => {
                b.put_u8(msg::HELLO);
                b.put_u32(m.id);
                b.put_slice(&m.mac);
                b.put_slice(&m.shared.octets());
                b.put_u16(m.lo);
                b.put_u16(m.hi);
            }
            Self::Add(s) => {
                b.put_u8(msg::ADD);
                put_splice(&mut b, s);
            }
            Self::Del(s) => {
                b.put_u8(msg::DEL);
                put_splice(&mut b, s);
            }
            Self::Fin(from, to) => {
                b.put_u8(msg::FIN);
                put_addr(&mut b, *from);
                put_addr(&mut b, *to);
            }
            Self::Touch(flows) => {
                b.put_u8(msg::TOUCH);
                for (from, to) in flows {
                    put_addr(&mut b, *from);
                    put_addr(&mut b, *to);
                }
            }
        }
        let len = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&len.to_be_bytes());
        b.freeze()
    }

    /// A message's body (after its length); `None` when it does not parse.
    fn decode(mut b: Bytes) -> Option<Self> {
        if !b.has_remaining() {
            return None;
        }
        Some(match b.get_u8() {
            msg::HELLO => {
                if b.remaining() < 18 {
                    return None;
                }
                let id = b.get_u32();
                let mut mac = [0u8; 6];
                b.copy_to_slice(&mut mac);
                let shared = Ipv4Addr::from(b.get_u32());
                Self::Hello(Member {
                    id,
                    mac,
                    shared,
                    lo: b.get_u16(),
                    hi: b.get_u16(),
                })
            }
            msg::ADD => Self::Add(get_splice(&mut b)?),
            msg::DEL => Self::Del(get_splice(&mut b)?),
            msg::FIN => Self::Fin(get_addr(&mut b)?, get_addr(&mut b)?),
            msg::TOUCH => {
                let mut flows = Vec::with_capacity(b.remaining() / 12);
                while b.has_remaining() {
                    flows.push((get_addr(&mut b)?, get_addr(&mut b)?));
                }
                Self::Touch(flows)
            }
            _ => return None,
        })
    }
}

/// Counters of the tier, in the proxy's status.
#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    splices_in: AtomicU64,
    links_dropped: AtomicU64,
    heartbeats: AtomicU64,
    nudges: AtomicU64,
    nudge_probes: AtomicU64,
    nudge_reverts: AtomicU64,
}

/// A link towards another member.
struct Link {
    addr: SocketAddr,
    tx: mpsc::Sender<Bytes>,
}

/// What a member does with the splices of the tier: a proxy carries them whole; a server of
/// a split splice carries the answers of its own connections ([`crate::split::ServerSide`]).
pub(crate) trait Side: Send + Sync {
    /// Installs a splice another member made.
    fn install(&self, s: Splice) -> Result<(), String>;
    fn remove(&self, s: &Splice);
    fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4);
    fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]);
    /// The other members to forward to by port (a proxy's datapath).
    fn set_tier(&self, _members: &[TierMember]) -> Result<(), DatapathError> {
        Ok(())
    }
    fn forwarded(&self) -> u64 {
        0
    }
    /// What the once-a-second pass compares, per connection: the splice, and what passed
    /// here in each direction.
    fn state(&self) -> Vec<SpliceState>;
    /// Sends splices to a member that links here (a proxy: all it knows).
    fn shares(&self) -> bool {
        true
    }
    /// After another member died: the probes and ICMP errors that end the backoff of the
    /// TCP senders whose packets it lost (a proxy's datapath; blocks for a moment).
    fn nudge(&self, _prober: bool) -> Result<(usize, usize), String> {
        Ok((0, 0))
    }
}

impl crate::l4::kernel::TierShare for Tier {
    fn ports(&self) -> std::ops::RangeInclusive<u16> {
        self.me.lo..=self.me.hi
    }

    fn server_address(&self) -> Ipv4Addr {
        self.me.shared
    }

    /// Sends a splice just made here to every other member.
    fn spliced(&self, s: &Splice) {
        self.broadcast(&Message::Add(*s));
    }
}

impl Side for KernelSplice {
    fn install(&self, s: Splice) -> Result<(), String> {
        self.install_replica(s)
    }
    fn remove(&self, s: &Splice) {
        self.remove_replica(s);
    }
    fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4) {
        KernelSplice::mark_fin(self, from, to);
    }
    fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]) {
        KernelSplice::touch(self, flows);
    }
    fn set_tier(&self, members: &[TierMember]) -> Result<(), DatapathError> {
        KernelSplice::set_tier(self, members)
    }
    fn forwarded(&self) -> u64 {
        self.tier_redirects()
    }
    fn state(&self) -> Vec<SpliceState> {
        self.splices()
    }
    fn nudge(&self, prober: bool) -> Result<(usize, usize), String> {
        KernelSplice::nudge(self, prober)
    }
}

/// A running tier membership.
pub(crate) struct Tier {
    cfg: TierConfig,
    me: Member,
    side: Arc<dyn Side>,
    links: Mutex<HashMap<u32, Link>>,
    /// The other members as their HELLOs described them (kept: a HELLO comes once per link).
    members: Mutex<HashMap<u32, Member>>,
    /// The members the tier pool lists now. The datapath forwards to those listed that said
    /// HELLO, whichever came first.
    listed: Mutex<HashSet<u32>>,
    counters: Counters,
    /// A nudge is running.
    nudging: AtomicBool,
    /// The free fraction of this proxy's capacity (the workload factor), 0..=1.
    free: Box<dyn Fn() -> f64 + Send + Sync>,
}

/// How a member reaches the registrars: their addresses, and TLS when they run it.
#[derive(Clone, Debug)]
pub(crate) struct RegistrarAccess {
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) tls: Option<Arc<rserpool_tls::Tls>>,
}

impl Tier {
    /// Joins the tier: registers in its pool, listens for members and heartbeats, links to
    /// the members the pool names and starts the comparison passes.
    pub(crate) async fn start(
        cfg: TierConfig,
        registrars: RegistrarAccess,
        ks: Arc<KernelSplice>,
        interface: &str,
        free: Box<dyn Fn() -> f64 + Send + Sync>,
    ) -> Result<Arc<Tier>, String> {
        let ports = cfg.port_range()?;
        let pool = cfg.pool.clone();
        Self::start_as(cfg, pool, registrars, ks, interface, Some(ports), free).await
    }

    /// A member of the tier `cfg.pool` registered in `register_in`: with `ports`, a proxy;
    /// without, a server of a split splice.
    pub(crate) async fn start_as(
        cfg: TierConfig,
        register_in: String,
        registrars: RegistrarAccess,
        side: Arc<dyn Side>,
        interface: &str,
        ports: Option<std::ops::RangeInclusive<u16>>,
        free: Box<dyn Fn() -> f64 + Send + Sync>,
    ) -> Result<Arc<Tier>, String> {
        let mac = mac_of(interface)?;
        let tcp = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("[tier] listen {}: {e}", cfg.listen))?;
        let udp = UdpSocket::bind(cfg.listen)
            .await
            .map_err(|e| format!("[tier] listen {} (UDP): {e}", cfg.listen))?;
        let mut pe_cfg = PoolElementConfig::new(
            register_in.as_str(),
            cfg.listen,
            rserpool_wire::Policy::LeastUsed { load: 0 },
        );
        pe_cfg.registrars = registrars.addrs.clone();
        pe_cfg.tls = registrars.tls.clone();
        let pe = PoolElement::start(pe_cfg).map_err(|e| format!("[tier] registering: {e}"))?;
        let me = Member {
            id: pe.id(),
            mac,
            shared: cfg.server_address,
            lo: ports.as_ref().map_or(0, |p| *p.start()),
            hi: ports.as_ref().map_or(0, |p| *p.end()),
        };
        info!(
            "proxy: tier {}: member {:#010x} at {}, ports {}-{} on {}",
            cfg.pool, me.id, cfg.listen, me.lo, me.hi, me.shared
        );
        let tier = Arc::new(Tier {
            cfg,
            me,
            side,
            links: Mutex::new(HashMap::new()),
            members: Mutex::new(HashMap::new()),
            listed: Mutex::new(HashSet::new()),
            counters: Counters::default(),
            nudging: AtomicBool::new(false),
            free,
        });
        tokio::spawn(accept_loop(Arc::downgrade(&tier), tcp));
        if ports.is_some() {
            tokio::spawn(heartbeat_loop(Arc::downgrade(&tier), udp));
        }
        tokio::spawn(discovery_loop(Arc::downgrade(&tier), registrars, pe));
        tokio::spawn(pass_loop(Arc::downgrade(&tier)));
        Ok(tier)
    }

    /// This member's source ports towards PEs.
    fn broadcast(&self, m: &Message) {
        let bytes = m.encode();
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|id, l| match l.tx.try_send(bytes.clone()) {
            Ok(()) => {
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(_) => {
                // Full or gone: dropped, and connected again (with everything) by discovery.
                warn!(
                    "proxy: tier link to member {id:#010x} at {} fell behind; linking again",
                    l.addr
                );
                self.counters.links_dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        });
    }

    /// Applies what another member sent.
    fn apply(&self, m: Message, from: SocketAddr) {
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        match m {
            Message::Hello(member) => {
                if member.id == self.me.id {
                    return;
                }
                if member.shared == self.me.shared
                    && member.lo <= self.me.hi
                    && self.me.lo <= member.hi
                {
                    warn!(
                        "proxy: tier member {:#010x} at {from} uses ports {}-{}, which overlap \
                         ours ({}-{}): not forwarding to it; give each member its own range",
                        member.id, member.lo, member.hi, self.me.lo, self.me.hi
                    );
                    return;
                }
                self.members
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(member.id, member);
                self.update_datapath();
            }
            Message::Add(s) => {
                self.counters.splices_in.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.side.install(s) {
                    debug!("proxy: tier: a splice from {from}: {e}");
                }
            }
            Message::Del(s) => self.side.remove(&s),
            Message::Fin(a, b) => self.side.mark_fin(a, b),
            Message::Touch(flows) => self.side.touch(&flows),
        }
    }

    /// The datapath forwards to the members listed now that said HELLO.
    fn update_datapath(&self) {
        let listed = self
            .listed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let members: Vec<TierMember> = self
            .members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            // A server of a split splice has no ports: nothing is forwarded to it.
            .filter(|m| listed.contains(&m.id) && m.hi > 0)
            .map(|m| TierMember {
                shared: m.shared,
                ports: m.lo..=m.hi,
                mac: m.mac,
                src: self.me.mac,
            })
            .collect();
        if let Err(e) = self.side.set_tier(&members) {
            warn!("proxy: tier: {e}");
        }
    }

    /// The members the pool lists now: forwarding follows.
    fn set_listed(&self, now: HashSet<u32>) {
        let old = std::mem::replace(
            &mut *self.listed.lock().unwrap_or_else(|p| p.into_inner()),
            now.clone(),
        );
        if old != now {
            for gone in old.difference(&now) {
                info!("proxy: tier member {gone:#010x} left the pool");
            }
            self.update_datapath();
        }
    }

    pub(crate) fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner()).len();
        m.gauge(
            "rserpool_proxy_tier_links",
            "Links to other members of the proxy tier.",
            &[],
            links as f64,
        );
        let counters = [
            (
                "rserpool_proxy_tier_messages_sent",
                "Messages sent to other members of the tier.",
                n(&self.counters.sent),
            ),
            (
                "rserpool_proxy_tier_messages_received",
                "Messages received from other members of the tier.",
                n(&self.counters.received),
            ),
            (
                "rserpool_proxy_tier_splices_received",
                "Splices installed from other members of the tier.",
                n(&self.counters.splices_in),
            ),
            (
                "rserpool_proxy_tier_links_dropped",
                "Links to other members dropped.",
                n(&self.counters.links_dropped),
            ),
            (
                "rserpool_proxy_tier_nudges",
                "Nudges after another member of the tier died.",
                n(&self.counters.nudges),
            ),
            (
                "rserpool_proxy_tier_nudge_probes",
                "SYN probes sent by nudges (to both ends of every spliced connection).",
                n(&self.counters.nudge_probes),
            ),
            (
                "rserpool_proxy_tier_nudge_reverts",
                "ICMP errors sent by nudges to end a TCP sender's backoff.",
                n(&self.counters.nudge_reverts),
            ),
            (
                "rserpool_proxy_tier_forwarded_packets",
                "Packets forwarded to the member owning their port range.",
                self.side.forwarded(),
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
    }

    pub(crate) fn snapshot(&self) -> serde_json::Value {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner()).len();
        // Members forwarded to: listed in the pool, and their HELLO received.
        let listed = self
            .listed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let members = self
            .members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .filter(|id| listed.contains(id))
            .count();
        serde_json::json!({
            "pool": self.cfg.pool,
            "member": format!("{:#010x}", self.me.id),
            "links": links,
            "members_known": members,
            "messages_sent": n(&self.counters.sent),
            "messages_received": n(&self.counters.received),
            "splices_received": n(&self.counters.splices_in),
            "links_dropped": n(&self.counters.links_dropped),
            "heartbeats": n(&self.counters.heartbeats),
            "nudges": n(&self.counters.nudges),
            "nudge_probes": n(&self.counters.nudge_probes),
            "nudge_reverts": n(&self.counters.nudge_reverts),
            "forwarded_packets": self.side.forwarded(),
        })
    }
}

/// The MAC address of `interface`.
fn mac_of(interface: &str) -> Result<[u8; 6], String> {
    let path = format!("/sys/class/net/{interface}/address");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("[tier] interface {interface}: {e}"))?;
    let mut mac = [0u8; 6];
    let mut parts = text.trim().split(':');
    for b in &mut mac {
        *b = parts
            .next()
            .and_then(|p| u8::from_str_radix(p, 16).ok())
            .ok_or_else(|| format!("[tier] interface {interface}: no MAC address in {path}"))?;
    }
    Ok(mac)
}

/// Reads one message (length, then body) from a member.
async fn read_message(s: &mut TcpStream) -> std::io::Result<Option<Bytes>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a tier message of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Ok(Some(Bytes::from(body)))
}

/// Takes links from other members: what they send is applied here.
async fn accept_loop(tier: std::sync::Weak<Tier>, l: TcpListener) {
    loop {
        let Ok((mut s, from)) = l.accept().await else {
            continue;
        };
        let tier = tier.clone();
        tokio::spawn(async move {
            s.set_nodelay(true).ok();
            loop {
                let body = match read_message(&mut s).await {
                    Ok(Some(b)) => b,
                    Ok(None) => return,
                    Err(e) => {
                        debug!("proxy: tier link from {from}: {e}");
                        return;
                    }
                };
                let Some(tier) = tier.upgrade() else { return };
                match Message::decode(body) {
                    Some(m) => tier.apply(m, from),
                    None => {
                        warn!(
                            "proxy: tier link from {from}: a message that does not parse; closing it"
                        );
                        return;
                    }
                }
            }
        });
    }
}

/// Answers the distributor's heartbeats with this member's workload factor.
async fn heartbeat_loop(tier: std::sync::Weak<Tier>, udp: UdpSocket) {
    let mut buf = [0u8; 64];
    let mut distributor: Option<SocketAddr> = None;
    loop {
        let Ok((n, from)) = udp.recv_from(&mut buf).await else {
            continue;
        };
        let Some(tier) = tier.upgrade() else { return };
        // Only the distributor that sends the heartbeats is listened to, and one nudge runs
        // at a time (each costs two probes per spliced connection).
        if n >= 9 && &buf[..4] == DEAD_MAGIC && distributor == Some(from) {
            let dead = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
            let prober = buf[8] == 1;
            if dead == tier.me.id || tier.nudging.swap(true, Ordering::AcqRel) {
                continue;
            }
            tier.counters.nudges.fetch_add(1, Ordering::Relaxed);
            let t = tier.clone();
            tokio::task::spawn_blocking(move || {
                match t.side.nudge(prober) {
                    Ok((probes, reverts)) => {
                        let c = &t.counters;
                        c.nudge_probes.fetch_add(probes as u64, Ordering::Relaxed);
                        c.nudge_reverts.fetch_add(reverts as u64, Ordering::Relaxed);
                        info!(
                            "tier: member {dead:#010x} died; nudged: {probes} probes, \
                             {reverts} ICMP errors"
                        );
                    }
                    Err(e) => warn!("tier: member {dead:#010x} died; the nudge failed: {e}"),
                }
                t.nudging.store(false, Ordering::Release);
            });
            continue;
        }
        if n < 8 || &buf[..4] != HEARTBEAT_MAGIC {
            continue;
        }
        distributor = Some(from);
        tier.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        let free = ((tier.free)().clamp(0.0, 1.0) * 1e6) as u32;
        let mut reply = [0u8; 16];
        reply[..8].copy_from_slice(&buf[..8]);
        reply[8..12].copy_from_slice(&tier.me.id.to_be_bytes());
        reply[12..16].copy_from_slice(&free.to_be_bytes());
        let _ = udp.send_to(&reply, from).await;
    }
}

/// Keeps a link to every other member of the tier pool, and this member's load in it.
async fn discovery_loop(tier: std::sync::Weak<Tier>, registrars: RegistrarAccess, pe: PoolElement) {
    let Ok(mut pu) = PoolUser::new(PoolUserConfig {
        registrars: registrars.addrs,
        tls: registrars.tls,
        subscribe: true,
        ..PoolUserConfig::default()
    }) else {
        warn!("proxy: tier: cannot start the pool user");
        return;
    };
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        let Some(t) = tier.upgrade() else {
            pe.stop().await;
            return;
        };
        pe.update_load(1.0 - (t.free)().clamp(0.0, 1.0));
        let handle = rserpool_wire::PoolHandle::from(t.cfg.pool.as_str());
        // A proxy also links to the servers of split splices, which register apart.
        let split = (t.me.hi > 0).then(|| split_pool(&t.cfg.pool));
        drop(t);
        let mut listed = match pu.pool_elements(&handle).await {
            Ok((_, pes)) => pes,
            Err(e) => {
                debug!("proxy: tier: resolving the tier pool: {e}");
                every.tick().await;
                continue;
            }
        };
        if let Some(split) = split
            && let Ok((_, pes)) = pu.pool_elements(&split).await
        {
            listed.extend(pes);
        }
        let Some(t) = tier.upgrade() else {
            pe.stop().await;
            return;
        };
        let mut now: HashMap<u32, SocketAddr> = HashMap::new();
        for p in &listed {
            if p.id == t.me.id {
                continue;
            }
            if let rserpool_wire::UserTransport::Address(a) = &p.user_transport
                && let Some(addr) = a.socket_addrs().next()
            {
                now.insert(p.id, addr);
            }
        }
        {
            let mut links = t.links.lock().unwrap_or_else(|p| p.into_inner());
            links.retain(|id, l| now.get(id) == Some(&l.addr) && !l.tx.is_closed());
            for (id, addr) in &now {
                if links.contains_key(id) {
                    continue;
                }
                let (tx, rx) = mpsc::channel(QUEUE);
                links.insert(*id, Link { addr: *addr, tx });
                tokio::spawn(link(tier.clone(), *id, *addr, rx));
            }
        }
        t.set_listed(now.keys().copied().collect());
        drop(t);
        // A push (a member came or went) or the next second, whichever is first.
        tokio::select! {
            _ = pu.next_push() => {}
            _ = every.tick() => {}
        }
    }
}

/// One link to member `id`: HELLO, every splice known here, then what is broadcast.
async fn link(
    tier: std::sync::Weak<Tier>,
    id: u32,
    addr: SocketAddr,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let connected = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await;
    let mut s = match connected {
        Ok(Ok(s)) => s,
        other => {
            debug!("proxy: tier member {id:#010x} at {addr}: cannot connect ({other:?})");
            // Dropping `rx` closes the link; discovery tries again.
            return;
        }
    };
    s.set_nodelay(true).ok();
    let Some(t) = tier.upgrade() else { return };
    let mut first = BytesMut::new();
    first.extend_from_slice(&Message::Hello(t.me).encode());
    let known = if t.side.shares() {
        t.side.state()
    } else {
        Vec::new()
    };
    for st in &known {
        first.extend_from_slice(&Message::Add(st.splice).encode());
    }
    info!(
        "proxy: tier link to member {id:#010x} at {addr}: {} splices sent",
        known.len()
    );
    drop(t);
    if s.write_all(&first).await.is_err() {
        return;
    }
    while let Some(b) = rx.recv().await {
        if s.write_all(&b).await.is_err() {
            debug!("proxy: tier link to member {id:#010x} at {addr} broke");
            return;
        }
    }
}

/// Once a second: what this member saw that the others cannot — FINs, connections that
/// ended here, connections it carried packets of.
async fn pass_loop(tier: std::sync::Weak<Tier>) {
    let mut last: HashMap<(SocketAddrV4, SocketAddrV4), SpliceState> = HashMap::new();
    loop {
        tokio::time::sleep(PASS).await;
        let Some(t) = tier.upgrade() else { return };
        let side = t.side.clone();
        let Ok(now) = tokio::task::spawn_blocking(move || side.state()).await else {
            return;
        };
        let now: HashMap<_, _> = now
            .into_iter()
            .map(|s| ((s.splice.client, s.splice.front), s))
            .collect();
        let mut touched = Vec::new();
        for (k, s) in &now {
            let before = last.get(k);
            let dirs = [
                (s.splice.client, s.splice.front),
                (s.splice.server, s.splice.back),
            ];
            for (i, (from, to)) in dirs.into_iter().enumerate() {
                if s.fin[i] && !before.is_some_and(|b| b.fin[i]) {
                    t.broadcast(&Message::Fin(from, to));
                }
                if s.packets[i] > before.map_or(0, |b| b.packets[i]) {
                    touched.push((from, to));
                }
            }
        }
        let ended: HashSet<_> = last.keys().filter(|k| !now.contains_key(k)).collect();
        for k in ended {
            if let Some(s) = last.get(k) {
                t.broadcast(&Message::Del(s.splice));
            }
        }
        for batch in touched.chunks(4096) {
            t.broadcast(&Message::Touch(batch.to_vec()));
        }
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splice() -> Splice {
        Splice {
            client: "10.0.0.2:40000".parse().unwrap(),
            front: "10.9.0.1:7000".parse().unwrap(),
            back: "10.9.0.2:20001".parse().unwrap(),
            server: "10.0.3.2:8080".parse().unwrap(),
            client_seq_delta: 0xdead_beef,
            server_seq_delta: 12,
            client_if: 7,
            server_if: 7,
            client_wscale: 7,
            front_wscale: 9,
            server_wscale: 2,
            back_wscale: 5,
            timestamps: Some((1, 0xffff_fff0)),
        }
    }

    #[test]
    fn messages_round_trip_and_garbage_does_not_parse() {
        let me = Member {
            id: 0x1234,
            mac: [2, 0, 0, 0, 0, 1],
            shared: Ipv4Addr::new(10, 9, 0, 2),
            lo: 20000,
            hi: 29999,
        };
        let s = splice();
        let msgs = [
            Message::Hello(me),
            Message::Add(Splice {
                client_if: 0,
                server_if: 0,
                ..s
            }),
            Message::Fin(s.client, s.front),
            Message::Touch(vec![(s.client, s.front), (s.server, s.back)]),
        ];
        for m in msgs {
            let b = m.encode();
            let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            assert_eq!(len, b.len() - 4);
            let back = Message::decode(b.slice(4..)).unwrap();
            // Splices travel without interfaces.
            let expect = match &m {
                Message::Add(x) => Message::Add(Splice {
                    client_if: 0,
                    server_if: 0,
                    ..*x
                }),
                other => other.clone(),
            };
            assert_eq!(format!("{back:?}"), format!("{expect:?}"));
            for cut in 0..b.len() - 4 {
                let _ = Message::decode(b.slice(4..4 + cut));
            }
        }
        assert!(Message::decode(Bytes::from_static(&[99, 1, 2])).is_none());
        assert!(Message::decode(Bytes::new()).is_none());
    }

    #[test]
    fn port_ranges_parse() {
        let mut c = TierConfig {
            pool: "T".into(),
            listen: "127.0.0.1:9950".parse().unwrap(),
            server_address: Ipv4Addr::new(10, 9, 0, 2),
            ports: "20000-29999".into(),
            interface: None,
        };
        assert_eq!(c.port_range().unwrap(), 20000..=29999);
        for bad in ["", "20000", "3-2", "0-5", "a-b", "1-70000"] {
            c.ports = bad.into();
            assert!(c.port_range().is_err(), "{bad}");
        }
    }
}
