//! TCP mode's hand-over to the kernel splice (`splice = "kernel"`, crate `rserpool-ksplice`).
//!
//! The proxy connects to the PE from a socket bound beforehand, so that the datapath can
//! watch the PE's packets from its SYN-ACK on (a hand-over needs the PE's latest TCP
//! timestamp, which no socket option tells), with the MSS clamped to the client's. Whatever
//! either side sends first is relayed here until both sockets are quiet (nothing unread,
//! nothing unacknowledged); then the connection goes to the eBPF datapath and the proxy's
//! sockets close without a trace on the wire. A connection that stays busy (a download) is
//! held after `hold-after-ms`: the datapath drops its new data (the senders send it again,
//! through the splice) and lets ACKs through, so the sockets drain and go quiet. From then on the proxy can stop, crash or
//! restart: the connection does not notice. If the sockets do not go quiet within a second,
//! or the hand-over fails, the connection stays on the user-space path.
//!
//! [`expire_loop`] removes the entries of connections that ended or idle; the datapath
//! itself removes those an RST ended.

use crate::balance::backend::Backend;
use crate::config::KernelSpliceConfig;
use rserpool_ksplice::nudge::RawSender;
use rserpool_ksplice::{
    Datapath, Error, Expired, HandOverError, Splice, SpliceState, TierMember, clamp_mss, hand_over,
    pending, route_towards,
};
use serde::Serialize;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{debug, warn};

/// Ports tried for a connection to a PE before giving up (each one in use by a spliced
/// connection to the same PE).
const PORT_TRIES: usize = 64;
/// How long a route lookup is trusted, and how many are kept.
const ROUTE_FOR: Duration = Duration::from_secs(1);
const MAX_ROUTES: usize = 65_536;
/// How often ended and idle entries are looked for, at most (and twice per fin-timeout).
const EXPIRE_EVERY: Duration = Duration::from_secs(1);
/// How long a nudge waits for the ends' answers.
const NUDGE_FOR: Duration = Duration::from_millis(300);

/// The loaded datapath and what the proxy counts of it.
pub(crate) struct KernelSplice {
    dp: Mutex<Datapath>,
    idle: Duration,
    closing: Duration,
    /// A connection not quiet this long after it is connected (a stream, a download) is
    /// held: its new data dropped, to be sent again through the splice, while the proxy's
    /// sockets drain (`hold-after-ms`; `None`: never).
    hold_after: Option<Duration>,
    /// Longest drain under hold without progress (less pending on the sockets), and in all;
    /// then the connection stays in user space. A connection that streams both ways at once
    /// does not drain: the ACKs ride on the data that the hold drops.
    drain_stall: Duration,
    drain_within: Duration,
    handed_over: AtomicU64,
    user_space: AtomicU64,
    /// Of those, the ones relayed in user space now: they die with this process.
    user_space_now: AtomicU64,
    /// See [`Self::distrust_adopted`]: CLOCK_MONOTONIC ns, 0 for none.
    adopted_before: AtomicU64,
    held_to_drain: AtomicU64,
    table_full: AtomicU64,
    entries: AtomicUsize,
    /// Time spent in successful hand-overs (hold to entries complete), total and longest.
    handover_ns: AtomicU64,
    handover_max_ns: AtomicU64,
    closed: AtomicU64,
    idled: AtomicU64,
    stale: AtomicU64,
    /// Routes looked up lately: peer → (source address, interface, when).
    routes: Mutex<HashMap<Ipv4Addr, (Ipv4Addr, u32, Instant)>>,
    /// The connections this process handed over, by client address, with their PE: their
    /// bytes go to the PE's counters at each expiry pass.
    tracked: Mutex<HashMap<SocketAddrV4, Tracked>>,
    /// The proxy tier this proxy is a member of, if any: each hand-over is sent to the other
    /// members, and connections to PEs come from the tier's address and ports.
    tier: std::sync::OnceLock<Weak<dyn TierShare>>,
    /// Where the next search for a free tier port starts.
    next_port: AtomicUsize,
}

/// What the kernel splice needs of a proxy tier it is a member of: the tier's own
/// server-facing address and port range, and where to send each splice made here.
pub(crate) trait TierShare: Send + Sync {
    /// This member's range of ports towards the PEs.
    fn ports(&self) -> std::ops::RangeInclusive<u16>;
    /// The server-facing address all members share.
    fn server_address(&self) -> std::net::Ipv4Addr;
    /// A splice just made here, for the other members.
    fn spliced(&self, s: &Splice);
}

struct Tracked {
    splice: Splice,
    pe: Arc<Backend>,
    /// Bytes counted so far: client → PE, PE → client.
    counted: [u64; 2],
}

/// The status listener's view (`kernel_splice` in the proxy's stats).
#[derive(Debug, Serialize)]
struct Snapshot {
    /// Flow table entries at the last expiry pass (two per spliced connection).
    entries: usize,
    max_flows: u32,
    /// Connections handed to the kernel, and those that stayed in user space.
    handed_over: u64,
    user_space: u64,
    /// Connections relayed in user space now (not spliced: they die with this proxy).
    user_space_now: u64,
    /// Connections busy past `hold-after-ms`, held (new data dropped) to drain.
    held_to_drain: u64,
    /// Hand-overs refused because the flow table was full.
    table_full: u64,
    /// How long a hand-over takes (the connection's packets held meanwhile), µs.
    handover_mean_us: f64,
    handover_max_us: f64,
    /// Entries removed: both directions closed, idle, abandoned hand-overs.
    expired_closed: u64,
    expired_idle: u64,
    expired_stale: u64,
    /// The datapath's counters: spliced packets and bytes, FINs and RSTs seen.
    packets: u64,
    bytes: u64,
    fins: u64,
    rsts: u64,
}

impl KernelSplice {
    pub(crate) fn new(dp: Datapath, cfg: &KernelSpliceConfig) -> Self {
        Self {
            dp: Mutex::new(dp),
            idle: Duration::from_millis(cfg.idle_timeout_ms),
            closing: Duration::from_millis(cfg.fin_timeout_ms),
            hold_after: (cfg.hold_after_ms > 0).then(|| Duration::from_millis(cfg.hold_after_ms)),
            drain_stall: Duration::from_millis(cfg.drain_stall_ms.max(1)),
            drain_within: Duration::from_millis(cfg.drain_timeout_ms.max(1)),
            handed_over: AtomicU64::new(0),
            user_space: AtomicU64::new(0),
            user_space_now: AtomicU64::new(0),
            adopted_before: AtomicU64::new(0),
            held_to_drain: AtomicU64::new(0),
            table_full: AtomicU64::new(0),
            entries: AtomicUsize::new(0),
            handover_ns: AtomicU64::new(0),
            handover_max_ns: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            idled: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            routes: Mutex::new(HashMap::new()),
            tracked: Mutex::new(HashMap::new()),
            tier: std::sync::OnceLock::new(),
            next_port: AtomicUsize::new(0),
        }
    }

    /// Makes this datapath a member of `tier`.
    pub(crate) fn join(&self, tier: Weak<dyn TierShare>) {
        let _ = self.tier.set(tier);
    }

    fn tier(&self) -> Option<Arc<dyn TierShare>> {
        self.tier.get().and_then(Weak::upgrade)
    }

    /// Installs a splice another member of the tier made, with this host's interfaces towards
    /// both ends; one already here is left as it is.
    pub(crate) fn install_replica(&self, mut s: Splice) -> Result<(), String> {
        let (_, client_if) = self.route(*s.client.ip()).map_err(|e| e.to_string())?;
        let (_, server_if) = self.route(*s.server.ip()).map_err(|e| e.to_string())?;
        s.client_if = client_if;
        s.server_if = server_if;
        let mut dp = self.dp();
        if dp.contains(s.client, s.front) && dp.contains(s.server, s.back) {
            return Ok(());
        }
        dp.splice(&s).map_err(|e| e.to_string())
    }

    pub(crate) fn remove_replica(&self, s: &Splice) {
        let _ = self.dp().unsplice(s);
    }

    pub(crate) fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4) {
        let _ = self.dp().mark_fin(from, to);
    }

    pub(crate) fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]) {
        let mut dp = self.dp();
        for (from, to) in flows {
            let _ = dp.touch(*from, *to);
        }
    }

    pub(crate) fn set_tier(&self, members: &[TierMember]) -> Result<(), Error> {
        self.dp().set_tier(members)
    }

    pub(crate) fn tier_redirects(&self) -> u64 {
        self.dp().tier_redirects().unwrap_or(0)
    }

    /// After another member of the tier died (the distributor says so): asks both ends of
    /// every spliced connection for their receive point (`prober`: this member sends the
    /// probes; one member does) and sends each TCP sender that may be backing off on a
    /// packet the dead member lost the ICMP error that undoes the backoff
    /// (`rserpool_ksplice::nudge`). Blocks for [`NUDGE_FOR`]. Returns the probes and the
    /// errors sent.
    pub(crate) fn nudge(&self, prober: bool) -> Result<(usize, usize), String> {
        let raw = RawSender::new().map_err(|e| format!("a raw socket: {e}"))?;
        let probes = self.dp().arm_probes().map_err(|e| e.to_string())?;
        let mut probed = 0;
        if prober {
            // The other members arm their entries meanwhile.
            std::thread::sleep(Duration::from_millis(5));
            probed = probes
                .iter()
                .filter(|(from, to)| raw.probe(*from, *to).is_ok())
                .count();
        }
        let until = Instant::now() + NUDGE_FOR;
        let mut reverted = 0;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            let answers = self.dp().take_probed().map_err(|e| e.to_string())?;
            reverted += answers.iter().filter(|r| raw.revert(r).is_ok()).count();
        }
        self.dp().disarm_probes().map_err(|e| e.to_string())?;
        Ok((probed, reverted))
    }

    /// The spliced connections in the flow table (empty when it cannot be read).
    /// The spliced connections, as the tier shares them: without those adopted at a fresh
    /// start that carried no packet since ([`Self::distrust_adopted`]).
    pub(crate) fn splices(&self) -> Vec<SpliceState> {
        let all = self.dp().splices().unwrap_or_default();
        let since = self.adopted_before.load(Ordering::Relaxed);
        if since == 0 {
            return all;
        }
        all.into_iter()
            .filter(|s| s.last_ns.iter().any(|&t| t >= since))
            .collect()
    }

    /// This process started afresh (no predecessor handed it over) with a pinned flow table
    /// that may have stood still while its host was away: connections ended meanwhile, and the
    /// other members of the tier reused their ports. Sent to them, such an entry would take a
    /// live connection's place. So an entry from before now is kept (it may be carried here
    /// again) but not shared until it carries a packet; the others have every live one.
    pub(crate) fn distrust_adopted(&self) {
        self.adopted_before
            .store(rserpool_ksplice::monotonic_ns(), Ordering::Relaxed);
    }

    /// The source address and interface towards `peer`, from the kernel's routes (a route
    /// lookup costs a socket and an interface list: looked up once a second per peer).
    fn route(&self, peer: Ipv4Addr) -> std::io::Result<(Ipv4Addr, u32)> {
        let now = Instant::now();
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(src, i, at)) = routes.get(&peer)
            && now.duration_since(at) < ROUTE_FOR
        {
            return Ok((src, i));
        }
        let (src, i) = route_towards(peer)?;
        if routes.len() >= MAX_ROUTES {
            routes.clear();
        }
        routes.insert(peer, (src, i, now));
        Ok((src, i))
    }

    fn dp(&self) -> MutexGuard<'_, Datapath> {
        self.dp.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counts(&self) -> Snapshot {
        let dp = self.dp();
        let c = dp.counters().unwrap_or_default();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            entries: self.entries.load(Ordering::Relaxed),
            max_flows: dp.max_flows(),
            handed_over: n(&self.handed_over),
            user_space: n(&self.user_space),
            user_space_now: n(&self.user_space_now),
            held_to_drain: n(&self.held_to_drain),
            table_full: n(&self.table_full),
            handover_mean_us: n(&self.handover_ns) as f64
                / 1e3
                / n(&self.handed_over).max(1) as f64,
            handover_max_us: n(&self.handover_max_ns) as f64 / 1e3,
            expired_closed: n(&self.closed),
            expired_idle: n(&self.idled),
            expired_stale: n(&self.stale),
            packets: c.packets,
            bytes: c.bytes,
            fins: c.fins,
            rsts: c.rsts,
        }
    }

    pub(crate) fn snapshot(&self) -> serde_json::Value {
        serde_json::to_value(self.counts()).unwrap_or_default()
    }

    pub(crate) fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        let s = self.counts();
        m.gauge(
            "rserpool_proxy_kernel_splice_flows",
            "Flow table entries of the kernel splice (two per spliced connection).",
            &[],
            s.entries as f64,
        );
        m.gauge(
            "rserpool_proxy_kernel_splice_user_space_now",
            "Connections of spliced listeners relayed in user space now: not spliced, they die \
             with this proxy.",
            &[],
            s.user_space_now as f64,
        );
        let counters = [
            (
                "rserpool_proxy_kernel_splice_handed_over",
                "Connections handed to the kernel splice.",
                s.handed_over,
            ),
            (
                "rserpool_proxy_kernel_splice_user_space",
                "Connections that stayed in user space.",
                s.user_space,
            ),
            (
                "rserpool_proxy_kernel_splice_table_full",
                "Hand-overs refused because the flow table was full.",
                s.table_full,
            ),
            (
                "rserpool_proxy_kernel_splice_packets",
                "Packets spliced in the kernel.",
                s.packets,
            ),
            (
                "rserpool_proxy_kernel_splice_bytes",
                "Bytes spliced in the kernel.",
                s.bytes,
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
    }

    /// A socket to connect to the PE at `peer` from: bound to the route's source address and
    /// a port no spliced connection to `peer` uses, its MSS clamped to the client's, and the
    /// PE's packets to it watched from the first (the SYN-ACK's timestamp). Plain when any of
    /// that fails: the hand-over then says why.
    ///
    /// The port: a spliced connection's sockets are gone, so the kernel would give its port
    /// to a new connection, whose SYN would reach the PE's end of the spliced one (and the
    /// PE's challenge ACK would have the new socket reset it). The flow table knows them.
    pub(crate) fn socket_towards(
        &self,
        peer: SocketAddr,
        client: &TcpStream,
    ) -> std::io::Result<tokio::net::TcpSocket> {
        let SocketAddr::V4(peer4) = peer else {
            return crate::balance::backend::plain_socket(peer);
        };
        if let Some(tier) = self.tier() {
            return self.tier_socket(peer4, client, tier.as_ref());
        }
        let (source, _) = self.route(*peer4.ip())?;
        // Sockets on ports in use by spliced connections, kept until a free one is found so
        // that the kernel does not offer the same port again.
        let mut taken = Vec::new();
        let (sock, local) = loop {
            let sock = crate::balance::backend::plain_socket(peer)?;
            sock.bind(SocketAddr::from((source, 0)))?;
            let SocketAddr::V4(local) = sock.local_addr()? else {
                return Ok(sock);
            };
            if !self.dp().contains(peer4, local) {
                break (sock, local);
            }
            if taken.len() >= PORT_TRIES {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "no local port free of spliced connections to the PE",
                ));
            }
            taken.push(sock);
        };
        drop(taken);
        if let Err(e) = clamp_mss(&sock, client) {
            debug!("kernel splice: clamping the MSS: {e}");
        }
        if let Err(e) = self.dp().watch(peer4, local, None) {
            self.note(&e);
        }
        Ok(sock)
    }

    /// A member of a tier connects from the shared server-facing address and a port of its
    /// own range (so that a PE's answer reaching another member is forwarded here), one that
    /// no spliced connection to `peer` uses.
    fn tier_socket(
        &self,
        peer: SocketAddrV4,
        client: &TcpStream,
        tier: &dyn TierShare,
    ) -> std::io::Result<tokio::net::TcpSocket> {
        let ports = tier.ports();
        let span = usize::from(*ports.end() - *ports.start()) + 1;
        let start = self.next_port.fetch_add(1, Ordering::Relaxed);
        for i in 0..span {
            let port = *ports.start() + ((start + i) % span) as u16;
            let local = SocketAddrV4::new(tier.server_address(), port);
            if self.dp().contains(peer, local) {
                continue;
            }
            let sock = crate::balance::backend::plain_socket(SocketAddr::V4(peer))?;
            if sock.bind(SocketAddr::V4(local)).is_err() {
                continue;
            }
            self.next_port.store(start + i + 1, Ordering::Relaxed);
            if let Err(e) = clamp_mss(&sock, client) {
                debug!("kernel splice: clamping the MSS: {e}");
            }
            if let Err(e) = self.dp().watch(peer, local, None) {
                self.note(&e);
            }
            return Ok(sock);
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "no port of the tier's range is free",
        ))
    }

    fn note(&self, e: &Error) {
        if matches!(e, Error::Full(_)) {
            // Counted, and logged at most once per expiry pass (see expire_loop).
            self.table_full.fetch_add(1, Ordering::Relaxed);
        } else {
            debug!("kernel splice: {e}");
        }
    }

    /// Stops watching the packets of a connection that stays in user space (the PE's, and
    /// the client's too after a hand-over that did not happen).
    fn unwatch(&self, client: &TcpStream, backend: &TcpStream) {
        let mut dp = self.dp();
        for s in [client, backend] {
            if let (Ok(SocketAddr::V4(from)), Ok(SocketAddr::V4(to))) =
                (s.peer_addr(), s.local_addr())
            {
                let _ = dp.unwatch(from, to);
            }
        }
    }

    /// Counts a connection just handed over towards its PE's bytes from now on.
    pub(crate) fn track(&self, splice: Splice, pe: Arc<Backend>) {
        let mut tracked = self.tracked.lock().unwrap_or_else(|p| p.into_inner());
        tracked.insert(
            splice.client,
            Tracked {
                splice,
                pe,
                counted: [0; 2],
            },
        );
    }

    /// Adds what the datapath carried since the last pass to the PEs' byte counters, and
    /// forgets connections whose entries are gone (what an RST-ended one carried in its last
    /// second is lost).
    fn account(&self) {
        let mut tracked = self.tracked.lock().unwrap_or_else(|p| p.into_inner());
        let dp = self.dp();
        tracked.retain(|_, t| match dp.carried(&t.splice) {
            Some([(_, up), (_, down)]) => {
                let stats = &t.pe.stats;
                stats
                    .bytes_in
                    .fetch_add(up.saturating_sub(t.counted[0]), Ordering::Relaxed);
                stats
                    .bytes_out
                    .fetch_add(down.saturating_sub(t.counted[1]), Ordering::Relaxed);
                t.counted = [up, down];
                true
            }
            None => false,
        });
    }

    fn expire(&self) -> Result<Expired, Error> {
        self.account();
        let x = self.dp().expire(self.idle, self.closing)?;
        self.entries.store(x.entries, Ordering::Relaxed);
        self.closed.fetch_add(x.closed as u64, Ordering::Relaxed);
        self.idled.fetch_add(x.idle as u64, Ordering::Relaxed);
        self.stale.fetch_add(x.stale as u64, Ordering::Relaxed);
        Ok(x)
    }
}

/// Removes ended and idle entries every second while the proxy lives; a full flow table is
/// reported here, once per pass, not once per refused connection.
pub(crate) async fn expire_loop(ks: Weak<KernelSplice>) {
    let mut full_seen = 0;
    loop {
        let every = match ks.upgrade() {
            Some(ks) => EXPIRE_EVERY.min(ks.closing / 2),
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(ks) = ks.upgrade() else {
            return;
        };
        let pass = tokio::task::spawn_blocking({
            let ks = ks.clone();
            move || ks.expire()
        })
        .await;
        match pass {
            Ok(Ok(x)) => debug!("kernel splice: {x:?}"),
            Ok(Err(e)) => warn!("kernel splice: expiring entries: {e}"),
            Err(_) => return,
        }
        let full = ks.table_full.load(Ordering::Relaxed);
        if full > full_seen {
            warn!(
                "kernel splice: the flow table is full ({} entries): {} connections stayed in \
                 user space; raise [kernel-splice] max-flows",
                ks.dp().max_flows(),
                full - full_seen
            );
            full_seen = full;
        }
    }
}

/// Holds let go for not draining before a connection stays in user space for good, and the
/// relaying between two.
const HOLD_RETRIES: u32 = 3;
const HOLD_AGAIN_AFTER: Duration = Duration::from_millis(500);
/// What the proxy's sockets may hold (the client's send buffer, the PE's receive buffer; the
/// kernel doubles it) while a connection waits for its hand-over. All of it must drain, at the
/// client's pace, before the kernel takes over, and until then the connection dies with its
/// proxy: with buffers the kernel grew to megabytes, a client reading 3 MB/s spent a second
/// there.
const BUFFER_BEFORE_HANDOVER: usize = 64 * 1024;

pub(crate) enum Handed {
    /// The kernel carries the connection now (its entries, if the hand-over got that far).
    Kernel(Option<Splice>),
    /// It stays here: the sockets, unchanged.
    Back(TcpStream, TcpStream),
}

/// Hands the connection to the kernel at its first quiet moment. `asked`: the proxy has just
/// sent the PE something (a request) that it will answer.
pub(crate) async fn try_hand_over(
    client: TcpStream,
    backend: TcpStream,
    asked: bool,
    pe: &Backend,
    ks: &Arc<KernelSplice>,
) -> Handed {
    bound_buffers(&client, &backend);
    let handed = hand_over_when_quiet(client, backend, asked, pe, ks).await;
    match &handed {
        Handed::Kernel(_) => ks.handed_over.fetch_add(1, Ordering::Relaxed),
        Handed::Back(client, backend) => {
            ks.unwatch(client, backend);
            ks.user_space.fetch_add(1, Ordering::Relaxed)
        }
    };
    handed
}

impl KernelSplice {
    /// A connection [`try_hand_over`] gave back is relayed in user space while this lives.
    pub(crate) fn relaying(&self) -> Relaying<'_> {
        self.user_space_now.fetch_add(1, Ordering::Relaxed);
        Relaying(self)
    }
}

/// See [`KernelSplice::relaying`].
pub(crate) struct Relaying<'a>(&'a KernelSplice);

impl Drop for Relaying<'_> {
    fn drop(&mut self) {
        self.0.user_space_now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Bounds the buffers a connection fills before its hand-over ([`BUFFER_BEFORE_HANDOVER`]).
/// Set by hand, the kernel no longer grows them: a connection that stays in user space keeps
/// them.
fn bound_buffers(client: &TcpStream, backend: &TcpStream) {
    let _ = socket2::SockRef::from(client).set_send_buffer_size(BUFFER_BEFORE_HANDOVER);
    let _ = socket2::SockRef::from(backend).set_recv_buffer_size(BUFFER_BEFORE_HANDOVER);
}

async fn hand_over_when_quiet(
    mut client: TcpStream,
    mut backend: TcpStream,
    mut asked: bool,
    pe: &Backend,
    ks: &KernelSplice,
) -> Handed {
    // The interfaces towards both ends, looked up when first needed: not before the first
    // response is relayed.
    let mut interfaces: Option<(u32, u32)> = None;
    let started = tokio::time::Instant::now();
    let mut hold_at = ks.hold_after.map(|d| started + d);
    let mut holds_let_go = 0;
    let mut deadline = hold_at.unwrap_or(started) + ks.drain_within;
    // The hold that drains a busy connection, once it is on.
    let mut held: Option<Splice> = None;
    let unhold = |held: &Option<Splice>| {
        if let Some(s) = held {
            let _ = ks.dp().unsplice(s);
        }
    };
    let mut buf = vec![0u8; 64 * 1024];
    // Under hold: the least pending seen, and until when it may take to go lower.
    let mut least = u32::MAX;
    let mut stall = deadline;
    loop {
        let busy = pending(&client).unwrap_or(1) + pending(&backend).unwrap_or(1);
        let now = tokio::time::Instant::now();
        if held.is_some() && busy < least {
            least = busy;
            stall = now + ks.drain_stall;
        }
        // Between a request and its answer is no time to hand over: the answer would come
        // while the connection is held, be dropped and wait for its sender's retransmission.
        // (Unless the connection is held already: it is busy one way, as with an upload.)
        let quiet = busy == 0 && (!asked || held.is_some());
        if quiet && interfaces.is_none() {
            let towards = |a: std::io::Result<SocketAddr>| match a.map(|a| a.ip().to_canonical()) {
                Ok(IpAddr::V4(ip)) => ks.route(ip).ok().map(|(_, i)| i),
                _ => None,
            };
            let (Some(c), Some(s)) = (towards(client.peer_addr()), towards(backend.peer_addr()))
            else {
                debug!(
                    "kernel splice: no IPv4 interface towards both ends; relaying in user space"
                );
                unhold(&held);
                return Handed::Back(client, backend);
            };
            interfaces = Some((c, s));
        }
        if let (true, Some((client_if, server_if))) = (quiet, interfaces) {
            let (Ok(a), Ok(b)) = (client.into_std(), backend.into_std()) else {
                // into_std only fails to deregister from the reactor: both are gone.
                return Handed::Kernel(None);
            };
            let t0 = std::time::Instant::now();
            let handed = hand_over(&mut ks.dp(), a, b, client_if, server_if);
            let (e, a, b) = match handed {
                Ok(s) => {
                    if let Some(tier) = ks.tier() {
                        tier.spliced(&s);
                    }
                    let ns = t0.elapsed().as_nanos() as u64;
                    ks.handover_ns.fetch_add(ns, Ordering::Relaxed);
                    ks.handover_max_ns.fetch_max(ns, Ordering::Relaxed);
                    debug!("kernel splice: {} ↔ {} handed over", s.client, s.server);
                    return Handed::Kernel(Some(s));
                }
                Err(v) => v,
            };
            match (TcpStream::from_std(a), TcpStream::from_std(b)) {
                (Ok(a), Ok(b)) => (client, backend) = (a, b),
                _ => return Handed::Kernel(None),
            }
            // Bytes arrived between the look and the hand-over: relay them and look again.
            match e {
                HandOverError::NotQuiet(_) => {
                    // The failed hand-over let go of the hold; it goes on.
                    if let Some(s) = &held {
                        let _ = ks.dp().hold(s, None);
                    }
                }
                HandOverError::Datapath(e) => {
                    ks.note(&e);
                    unhold(&held);
                    return Handed::Back(client, backend);
                }
                e => {
                    debug!("kernel splice: {e}; relaying in user space");
                    unhold(&held);
                    return Handed::Back(client, backend);
                }
            }
        }
        if held.is_some() && now >= stall && holds_let_go < HOLD_RETRIES {
            // The hold did not drain (busy both ways for a moment, or a peer that did not
            // read): let it go, relay a while and hold again. A connection left in user space
            // dies with its proxy, so in a tier patience pays.
            unhold(&held);
            held = None;
            least = u32::MAX;
            holds_let_go += 1;
            hold_at = Some(now + HOLD_AGAIN_AFTER);
            deadline = now + HOLD_AGAIN_AFTER + ks.drain_within;
            stall = deadline;
        }
        if now >= deadline || (held.is_some() && now >= stall) {
            debug!("kernel splice: the sockets did not go quiet; relaying in user space");
            unhold(&held);
            return Handed::Back(client, backend);
        }
        if held.is_none() && hold_at.is_some_and(|at| now >= at) {
            // Busy all along (a stream, a download): hold new data back until the sockets
            // have drained what they have.
            if let Ok(s) = Splice::of(&client, &backend) {
                match ks.dp().hold(&s, None) {
                    Ok(()) => {
                        held = Some(s);
                        deadline = now + ks.drain_within;
                        ks.held_to_drain.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => ks.note(&e),
                }
            }
        }
        let (Some(up), Some(down)) = (
            relay(&client, &mut backend, &mut buf).await,
            relay(&backend, &mut client, &mut buf).await,
        ) else {
            unhold(&held);
            return Handed::Back(client, backend);
        };
        pe.stats.bytes_in.fetch_add(up as u64, Ordering::Relaxed);
        pe.stats.bytes_out.fetch_add(down as u64, Ordering::Relaxed);
        if down > 0 {
            asked = false;
        }
        if up > 0 {
            asked = true;
        }
        // Data is relayed as soon as it comes (the first response must not wait); the ACKs
        // that make the sockets quiet have no readiness event: look again in a millisecond.
        tokio::select! {
            _ = client.readable() => {}
            _ = backend.readable() => {}
            () = tokio::time::sleep(Duration::from_millis(1)) => {}
        }
    }
}

/// Relays what `from` has received to `to`: the bytes moved, `None` when a side has closed or
/// failed (the connection then stays in user space, which sees it).
async fn relay(from: &TcpStream, to: &mut TcpStream, buf: &mut [u8]) -> Option<usize> {
    match from.try_read(buf) {
        Ok(0) => None,
        Ok(n) => to.write_all(&buf[..n]).await.ok().map(|()| n),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Some(0),
        Err(_) => None,
    }
}
