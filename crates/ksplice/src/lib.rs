//! The kernel splice (docs/KSPLICE.md): an eBPF datapath that carries a spliced TCP connection's
//! packets from one leg to the other inside the kernel, past the proxy's sockets.
//!
//! Why: the proxy's user-space path moves every byte through two TCP stacks and a process,
//! and a proxy crash breaks every connection. Once a connection is routed (the first request
//! read, the PE chosen and connected), its two legs differ only in addresses, ports and
//! initial sequence numbers; a TC program can translate each packet and forward it, and the
//! connection's state becomes two map entries (seed `fault-tolerant-tcp-splice`, §3–6).
//!
//! The datapath is C (`bpf/splice.c`), compiled with clang by `build.rs` and loaded with aya
//! (pure Rust: no C library to link, so the crate builds anywhere). Without clang the crate
//! builds anyway and [`unavailable`] says why. What the two share (the maps' names, the
//! layouts of their entries, the flags) is in `bpf/abi.h`, against which the build checks the
//! Rust side (`abi`).
//!
//! What is here: loading and attaching the program at TC ingress of the proxy's interfaces;
//! the flow table ([`Datapath::splice`]: both directions of a connection, with offsets for
//! sequence numbers, SACK blocks and timestamps, and window rescaling); the hand-over of the
//! proxy's live sockets ([`hand_over`]); and expiry of ended and idle entries
//! ([`Datapath::expire`]).

mod abi;
pub mod conncount;
mod handover;
pub mod nudge;
#[doc(hidden)]
pub mod testbed;
pub mod watch;

use abi::{
    COUNTERS_MAP, FLAG_FIN, FLAG_HOLD, FLAG_PROBE, FLAG_PROBED, FLAG_SAW_TS, FLAG_TS, FLAG_WATCH,
    FLOWS_MAP, TIER_MAP, TIER_REDIRECTS_MAP,
};
pub use handover::{
    HandOverError, clamp_mss, hand_over, pending, route_towards, save_syn, set_tcp_option,
};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::Duration;

/// Where the maps are pinned unless configured.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/rserpool";

/// Mounts bpffs at /sys/fs/bpf when `dir` is below it and nothing is mounted there yet.
#[cfg(ksplice_built)]
fn mount_bpffs(dir: &Path) -> Result<(), Error> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) {
        return Ok(());
    }
    let mounted = std::fs::read_to_string("/proc/self/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"))
        })
        .unwrap_or(false);
    if mounted {
        return Ok(());
    }
    rustix::mount::mount("bpf", root, "bpf", rustix::mount::MountFlags::empty(), None)
        .map_err(|err| Error::Ebpf(format!("mounting bpffs at /sys/fs/bpf: {err}")))
}

/// Flow table size unless configured.
pub const DEFAULT_MAX_FLOWS: u32 = abi::FLOWS_MAX;

/// Why the kernel splice cannot be used by this build, if it cannot.
pub fn unavailable() -> Option<&'static str> {
    #[cfg(ksplice_built)]
    {
        None
    }
    #[cfg(not(ksplice_built))]
    {
        Some(env!("KSPLICE_UNAVAILABLE"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kernel splice unavailable: {0}")]
    Unavailable(&'static str),
    #[error("eBPF: {0}")]
    Ebpf(String),
    #[error("no interface {0:?}")]
    NoInterface(String),
    #[error("the flow table is full ({0} entries)")]
    Full(u32),
}

/// A packet's 4-tuple as it arrives (addresses and ports in network byte order, as the
/// program reads them): `struct flow_key` of `bpf/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
}

/// What a packet of a flow becomes, and what the program saw of it: `struct flow_val` of
/// `bpf/abi.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlowVal {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    seq_delta: u32,
    ack_delta: u32,
    tsval_delta: u32,
    tsecr_delta: u32,
    ifindex: u32,
    wscale_in: u8,
    wscale_out: u8,
    flags: u16,
    ts_recent: u32,
    last_ns: u64,
    packets: u64,
    bytes: u64,
    probe_ack: u32,
    pad: u32,
}

impl FlowVal {
    /// The key of the other direction's entry (this entry's output, reversed).
    fn reverse_key(&self) -> FlowKey {
        FlowKey {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
        }
    }
}

#[cfg(ksplice_built)]
#[allow(unsafe_code)]
// SAFETY: plain `repr(C)` data without padding holes that matter to the kernel (the program
// reads the same layout), valid for any bit pattern.
unsafe impl aya::Pod for FlowKey {}
#[cfg(ksplice_built)]
#[allow(unsafe_code)]
// SAFETY: as for FlowKey.
unsafe impl aya::Pod for FlowVal {}

impl FlowKey {
    fn from(&self) -> SocketAddrV4 {
        SocketAddrV4::new(
            Ipv4Addr::from(self.saddr.to_ne_bytes()),
            u16::from_be_bytes(self.sport.to_ne_bytes()),
        )
    }

    fn to(&self) -> SocketAddrV4 {
        SocketAddrV4::new(
            Ipv4Addr::from(self.daddr.to_ne_bytes()),
            u16::from_be_bytes(self.dport.to_ne_bytes()),
        )
    }

    /// The packets from `src` to `dst`.
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4) -> Self {
        Self {
            saddr: u32::from_ne_bytes(src.ip().octets()),
            daddr: u32::from_ne_bytes(dst.ip().octets()),
            sport: u16::from_ne_bytes(src.port().to_be_bytes()),
            dport: u16::from_ne_bytes(dst.port().to_be_bytes()),
        }
    }
}

/// One spliced connection: the client leg (client ↔ the proxy's address it connected to)
/// and the server leg (the proxy's address towards the PE ↔ the PE).
#[derive(Debug, Clone, Copy)]
pub struct Splice {
    pub client: SocketAddrV4,
    pub front: SocketAddrV4,
    pub back: SocketAddrV4,
    pub server: SocketAddrV4,
    /// Added to the client's sequence numbers on their way to the server (the server leg's
    /// initial sequence number less the client's, as the server saw the proxy's).
    pub client_seq_delta: u32,
    /// Added to the server's sequence numbers on their way to the client.
    pub server_seq_delta: u32,
    /// Interfaces towards the client and towards the server.
    pub client_if: u32,
    pub server_if: u32,
    /// Window scale shifts: the client's (its windows' unit), the proxy's towards the client
    /// (the unit the client reads our windows in), the server's, and the proxy's towards the
    /// server. 0 where window scaling is off.
    pub client_wscale: u8,
    pub front_wscale: u8,
    pub server_wscale: u8,
    pub back_wscale: u8,
    /// Timestamp offsets when both legs use TCP timestamps: added to the client's TSvals on
    /// their way to the server, and to the server's on their way to the client. Each
    /// receiver's echoes (TSecr) move back by the other's.
    pub timestamps: Option<(u32, u32)>,
}

impl Splice {
    /// A connection's addresses, nothing translated yet (what [`Datapath::hold`] needs).
    fn between(
        client: SocketAddrV4,
        front: SocketAddrV4,
        back: SocketAddrV4,
        server: SocketAddrV4,
    ) -> Self {
        Self {
            client,
            front,
            back,
            server,
            client_seq_delta: 0,
            server_seq_delta: 0,
            client_if: 0,
            server_if: 0,
            client_wscale: 0,
            front_wscale: 0,
            server_wscale: 0,
            back_wscale: 0,
            timestamps: None,
        }
    }

    /// The two flow table entries: client → server and server → client.
    pub fn entries(&self) -> [(FlowKey, FlowVal); 2] {
        self.entries_with(0)
    }

    fn entries_with(&self, flags: u16) -> [(FlowKey, FlowVal); 2] {
        let (flags, (client_ts, server_ts)) = match self.timestamps {
            Some(d) => (flags | FLAG_TS, d),
            None => (flags, (0, 0)),
        };
        let now = monotonic_ns();
        let val = |from: SocketAddrV4,
                   to: SocketAddrV4,
                   delta: (u32, u32, u32, u32),
                   ifindex,
                   ws: (u8, u8)| {
            let k = FlowKey::new(from, to);
            FlowVal {
                saddr: k.saddr,
                daddr: k.daddr,
                sport: k.sport,
                dport: k.dport,
                seq_delta: delta.0,
                ack_delta: delta.1,
                tsval_delta: delta.2,
                tsecr_delta: delta.3,
                ifindex,
                wscale_in: ws.0,
                wscale_out: ws.1,
                flags,
                last_ns: now,
                ..FlowVal::default()
            }
        };
        [
            (
                FlowKey::new(self.client, self.front),
                val(
                    self.back,
                    self.server,
                    (
                        self.client_seq_delta,
                        self.server_seq_delta.wrapping_neg(),
                        client_ts,
                        server_ts.wrapping_neg(),
                    ),
                    self.server_if,
                    // The client's window, read by the server as the proxy's back socket's.
                    (self.client_wscale, self.back_wscale),
                ),
            ),
            (
                FlowKey::new(self.server, self.back),
                val(
                    self.front,
                    self.client,
                    (
                        self.server_seq_delta,
                        self.client_seq_delta.wrapping_neg(),
                        server_ts,
                        client_ts.wrapping_neg(),
                    ),
                    self.client_if,
                    (self.server_wscale, self.front_wscale),
                ),
            ),
        ]
    }
}

/// A spliced connection as the flow table holds it, with what the program saw of each
/// direction (client → server first).
#[derive(Debug, Clone, Copy)]
pub struct SpliceState {
    pub splice: Splice,
    /// A FIN passed in that direction.
    pub fin: [bool; 2],
    /// When the latest packet passed (CLOCK_MONOTONIC ns).
    pub last_ns: [u64; 2],
    /// Packets carried here.
    pub packets: [u64; 2],
}

impl Splice {
    /// The connection whose two entries these are, if they are one spliced connection's.
    #[cfg_attr(not(ksplice_built), allow(dead_code))]
    fn from_entries(e1: (&FlowKey, &FlowVal), e2: (&FlowKey, &FlowVal)) -> Option<Self> {
        let ((k1, v1), (k2, v2)) = (e1, e2);
        if v1.reverse_key() != *k2 || v2.reverse_key() != *k1 {
            return None;
        }
        let ts = v1.flags & FLAG_TS != 0;
        Some(Self {
            client: k1.from(),
            front: k1.to(),
            back: k2.to(),
            server: k2.from(),
            client_seq_delta: v1.seq_delta,
            server_seq_delta: v2.seq_delta,
            client_if: v2.ifindex,
            server_if: v1.ifindex,
            client_wscale: v1.wscale_in,
            front_wscale: v2.wscale_out,
            server_wscale: v2.wscale_in,
            back_wscale: v1.wscale_out,
            timestamps: ts.then_some((v1.tsval_delta, v2.tsval_delta)),
        })
    }
}

/// A member of a proxy tier, as the datapath forwards to it: packets to `shared` with a
/// destination port in `ports` and no flow entry go to `mac`, from `src` (this proxy's MAC on
/// the same segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierMember {
    pub shared: Ipv4Addr,
    pub ports: std::ops::RangeInclusive<u16>,
    pub mac: [u8; 6],
    pub src: [u8; 6],
}

/// Most other members a tier's datapath forwards to.
pub const TIER_MAX: usize = abi::TIER_MAX as usize;

/// `struct tier_member` of `bpf/abi.h`.
#[cfg_attr(not(ksplice_built), allow(dead_code))]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawTierMember {
    addr: u32,
    port_lo: u16,
    port_hi: u16,
    mac: [u8; 6],
    src: [u8; 6],
}

#[cfg(ksplice_built)]
#[allow(unsafe_code)]
// SAFETY: plain `repr(C)` data of 20 bytes without padding, as the program reads it.
unsafe impl aya::Pod for RawTierMember {}

/// CLOCK_MONOTONIC in nanoseconds: the clock of the program's bpf_ktime_get_ns (and of
/// [`SpliceState::last_ns`]).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// What one [`Datapath::expire`] pass found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    /// Entries left (two per spliced connection, one per watched or held direction).
    pub entries: usize,
    /// Entries removed: connections closed by FIN in both directions and quiet since.
    pub closed: usize,
    /// Entries removed for idling longer than the idle timeout.
    pub idle: usize,
    /// Watch and hold entries removed because their hand-over never finished (a proxy that
    /// died in the middle of one).
    pub stale: usize,
}

/// The datapath's per-CPU counters, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
    pub fins: u64,
    pub rsts: u64,
}

/// `struct counters` of `bpf/abi.h`.
#[cfg_attr(not(ksplice_built), allow(dead_code))]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawCounters {
    packets: u64,
    bytes: u64,
    fins: u64,
    rsts: u64,
}

#[cfg(ksplice_built)]
#[allow(unsafe_code)]
// SAFETY: plain `repr(C)` u64s.
unsafe impl aya::Pod for RawCounters {}

/// The interface index of `name` in the calling thread's network namespace.
pub fn ifindex(name: &str) -> Result<u32, Error> {
    let c = std::ffi::CString::new(name).map_err(|_| Error::NoInterface(name.into()))?;
    // SAFETY: a valid NUL-terminated string.
    #[allow(unsafe_code)]
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    match i {
        0 => Err(Error::NoInterface(name.into())),
        i => Ok(i),
    }
}

/// Where the program sees packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// As they arrive (a proxy).
    Ingress,
    /// As they leave (a server answering the clients of a split splice directly).
    Egress,
}

/// The loaded program, attached at TC ingress of some interfaces, and its flow table. Dropping
/// it detaches the program.
pub struct Datapath {
    #[cfg(ksplice_built)]
    ebpf: aya::Ebpf,
    max_flows: u32,
}

/// Where the datapath's TC filter sits on each interface, so that a later load replaces it in
/// place.
#[cfg(ksplice_built)]
const FILTER_PRIORITY: u16 = 49_152;
#[cfg(ksplice_built)]
const FILTER_HANDLE: u32 = 0x5253;

#[cfg(ksplice_built)]
static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("KSPLICE_OBJECT"));

/// Whether a flow table is pinned in `pin_dir`: what a process taking over from another (an
/// upgrade) finds there when both see the same bpffs.
pub fn has_flow_table(pin_dir: &Path) -> bool {
    pin_dir.join(FLOWS_MAP).exists()
}

impl Datapath {
    /// Loads the program with a flow table of `max_flows` entries and attaches it at TC
    /// ingress of each of `interfaces` (in the calling thread's network namespace). Needs
    /// root (CAP_BPF and CAP_NET_ADMIN).
    ///
    /// The spliced connections must outlive the process that spliced them (a proxy that
    /// crashes or restarts): the maps are pinned by name in `pin_dir` (on bpffs, mounted at
    /// /sys/fs/bpf if it is not), so a later load finds the same flow table, and the program
    /// is attached as a classic TC filter, which stays when the process goes. A load replaces
    /// the filter an earlier one left on the same interface in one step (same priority and
    /// handle), so spliced connections see no moment without it. [`Datapath::remove_all`] undoes
    /// everything.
    pub fn load(interfaces: &[&str], max_flows: u32, pin_dir: &Path) -> Result<Self, Error> {
        Self::load_at(interfaces, max_flows, pin_dir, Hook::Ingress)
    }

    /// [`load`](Self::load), attached at `hook`: at egress on a server of a split splice
    /// (its answers leave rewritten for the client).
    pub fn load_at(
        interfaces: &[&str],
        max_flows: u32,
        pin_dir: &Path,
        hook: Hook,
    ) -> Result<Self, Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = (interfaces, max_flows, pin_dir, hook);
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            use aya::programs::tc::{NlOptions, TcAttachOptions};
            use aya::programs::{SchedClassifier, TcAttachType, tc};
            let e = |what: &str, err: &dyn std::fmt::Display| Error::Ebpf(format!("{what}: {err}"));
            mount_bpffs(pin_dir)?;
            std::fs::create_dir_all(pin_dir)
                .map_err(|err| e(&format!("creating {}", pin_dir.display()), &err))?;
            let mut ebpf = aya::EbpfLoader::new()
                .set_max_entries(FLOWS_MAP, max_flows.max(1))
                .map_pin_path(pin_dir)
                .load(OBJECT)
                .map_err(|err| e("loading the object", &err))?;
            let prog: &mut SchedClassifier = ebpf
                .program_mut("splice_tc")
                .ok_or_else(|| Error::Ebpf("no program splice_tc in the object".into()))?
                .try_into()
                .map_err(|err| e("program type", &err))?;
            prog.load()
                .map_err(|err| e("the verifier refused it", &err))?;
            let at = match hook {
                Hook::Ingress => TcAttachType::Ingress,
                Hook::Egress => TcAttachType::Egress,
            };
            for name in interfaces {
                ifindex(name)?;
                let _ = tc::qdisc_add_clsact(name);
                // A filter an earlier load left (a proxy restarted or upgraded, its spliced
                // connections still flowing) is replaced in one step: detaching first would
                // leave a moment in which their packets reach a stack with no socket for
                // them, which answers with a reset.
                let replaced = aya::programs::tc::SchedClassifierLink::attached(
                    name,
                    at,
                    FILTER_PRIORITY,
                    FILTER_HANDLE,
                )
                .ok()
                .and_then(|old| prog.attach_to_link(old).ok());
                let id = match replaced {
                    Some(id) => id,
                    None => {
                        // None of ours at that place: one attached elsewhere goes first.
                        let _ = tc::qdisc_detach_program(name, at, "splice_tc");
                        let options = NlOptions {
                            priority: FILTER_PRIORITY,
                            handle: FILTER_HANDLE,
                        };
                        prog.attach_with_options(name, at, TcAttachOptions::Netlink(options))
                            .map_err(|err| e(&format!("attaching to {name}"), &err))?
                    }
                };
                // Not detached when this value goes: the filter outlives the process.
                let link = prog
                    .take_link(id)
                    .map_err(|err| e("taking the link", &err))?;
                std::mem::forget(link);
            }
            Ok(Self {
                ebpf,
                max_flows: max_flows.max(1),
            })
        }
    }

    /// The loaded program, to run it on packets of one's own (`BPF_PROG_TEST_RUN`: the
    /// crate's `tests/prog_run.rs`). Loaded with no interfaces, it is attached nowhere.
    #[doc(hidden)]
    pub fn program_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            use std::os::fd::AsFd;
            let prog: &aya::programs::SchedClassifier = self
                .ebpf
                .program("splice_tc")
                .ok_or_else(|| Error::Ebpf("no program splice_tc in the object".into()))?
                .try_into()
                .map_err(|err| Error::Ebpf(format!("program type: {err}")))?;
            let fd = prog
                .fd()
                .map_err(|err| Error::Ebpf(format!("the program's fd: {err}")))?;
            Ok(fd.as_fd())
        }
    }

    /// Detaches the program from `interfaces` and removes the pinned maps in `pin_dir`:
    /// every spliced connection through them ends.
    pub fn remove_all(interfaces: &[&str], pin_dir: &Path) -> Result<(), Error> {
        #[cfg(ksplice_built)]
        for name in interfaces {
            use aya::programs::{TcAttachType, tc};
            let _ = tc::qdisc_detach_program(name, TcAttachType::Ingress, "splice_tc");
            let _ = tc::qdisc_detach_program(name, TcAttachType::Egress, "splice_tc");
        }
        #[cfg(not(ksplice_built))]
        let _ = interfaces;
        for map in [FLOWS_MAP, COUNTERS_MAP, TIER_MAP, TIER_REDIRECTS_MAP] {
            match std::fs::remove_file(pin_dir.join(map)) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(Error::Ebpf(format!("removing the pinned {map}: {err}"))),
            }
        }
        let _ = std::fs::remove_dir(pin_dir);
        Ok(())
    }

    /// Installs both directions of a spliced connection.
    pub fn splice(&mut self, s: &Splice) -> Result<(), Error> {
        for (k, v) in s.entries() {
            self.insert(k, v)?;
        }
        Ok(())
    }

    /// Holds the connection until [`splice`](Self::splice) completes its entries: its
    /// packets that carry data (or SYN or FIN) are dropped in both directions, to be sent
    /// again by their senders through the splice; pure ACKs still reach the proxy's sockets,
    /// which can so drain what they sent. Only the addresses of `s` matter. The timestamps
    /// seen while watched are kept, or set to `seen` (the client's and the server's latest)
    /// when given.
    pub fn hold(&mut self, s: &Splice, seen: Option<(u32, u32)>) -> Result<(), Error> {
        let seen = seen.map(|(c, v)| [c, v]);
        for (i, (k, mut v)) in s.entries_with(FLAG_HOLD).into_iter().enumerate() {
            let ts = match seen {
                Some(ts) => Some(ts[i]),
                None => self
                    .get(&k)
                    .filter(|o| o.flags & FLAG_SAW_TS != 0)
                    .map(|o| o.ts_recent),
            };
            if let Some(ts) = ts {
                v.ts_recent = ts;
                v.flags |= FLAG_SAW_TS;
            }
            self.insert(k, v)?;
        }
        Ok(())
    }

    /// Ends a [`hold`](Self::hold) that did not lead to a splice: back to watching, with the
    /// timestamps seen kept.
    pub fn release(&mut self, s: &Splice) -> Result<(), Error> {
        let [(k1, _), (k2, _)] = s.entries();
        let seen = |k: &FlowKey| {
            self.get(k)
                .filter(|v| v.flags & FLAG_SAW_TS != 0)
                .map(|v| v.ts_recent)
        };
        let (c, v) = (seen(&k1), seen(&k2));
        self.watch(s.client, s.front, c)?;
        self.watch(s.server, s.back, v)
    }

    /// The server's half of a split splice: the server's packets to `back` leave as the
    /// proxy's to the client, straight from the server (`client_if`: the server's interface
    /// towards the client).
    pub fn splice_server_side(&mut self, s: &Splice) -> Result<(), Error> {
        let [_, (k, v)] = s.entries();
        self.insert(k, v)
    }

    /// Directions in the flow table that are not watched or held, with their FIN mark and
    /// packet count: what a split splice's server reports to the proxies.
    pub fn directions(&mut self) -> Result<Vec<(SocketAddrV4, SocketAddrV4, bool, u64)>, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            Ok(self
                .flows_where(|v| v.flags & (FLAG_WATCH | FLAG_HOLD) == 0)?
                .into_iter()
                .map(|(k, v)| (k.from(), k.to(), v.flags & FLAG_FIN != 0, v.packets))
                .collect())
        }
    }

    /// Arms every spliced entry to record the acknowledgement number of the next ACK it
    /// carries (the tier's nudge after a member died: see [`nudge`]). Returns the probes to
    /// send: each entry's output 4-tuple, whose receiver answers a SYN with a challenge ACK
    /// that comes back through the entry of the other direction.
    pub fn arm_probes(&mut self) -> Result<Vec<(SocketAddrV4, SocketAddrV4)>, Error> {
        let armed = self.set_probe_flags(FLAG_PROBE, FLAG_PROBED)?;
        Ok(armed
            .iter()
            .map(|v| {
                let out = v.reverse_key();
                (out.to(), out.from())
            })
            .collect())
    }

    /// The entries that carried an ACK since they were armed, each as the ICMP error to send
    /// ([`nudge::Revert`]); their mark is cleared.
    pub fn take_probed(&mut self) -> Result<Vec<nudge::Revert>, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let probed = self.flows_where(|v| v.flags & FLAG_PROBED != 0)?;
            let mut out = Vec::with_capacity(probed.len());
            for (k, mut v) in probed {
                // The ACK left as (saddr → daddr); its receiver sends from daddr to saddr,
                // and its oldest unacknowledged byte is the ACK's number.
                let back = v.reverse_key();
                out.push(nudge::Revert {
                    from: back.from(),
                    to: back.to(),
                    seq: v.probe_ack,
                });
                v.flags &= !FLAG_PROBED;
                self.update_existing(k, v)?;
            }
            Ok(out)
        }
    }

    /// Clears what [`Datapath::arm_probes`] set.
    pub fn disarm_probes(&mut self) -> Result<(), Error> {
        self.set_probe_flags(0, FLAG_PROBE | FLAG_PROBED)
            .map(|_| ())
    }

    /// Sets `set` and clears `clear` in the flags of every spliced entry; returns them. The
    /// entry is read and written whole: what the program wrote in between (a packet count, a
    /// FIN mark) is lost. That is rare and costs little (a FIN missed here expires the pair
    /// as idle, later), against a second map the program would look up for every packet.
    fn set_probe_flags(&mut self, set: u16, clear: u16) -> Result<Vec<FlowVal>, Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = (set, clear);
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let spliced = self.flows_where(|v| v.flags & (FLAG_WATCH | FLAG_HOLD) == 0)?;
            let mut out = Vec::with_capacity(spliced.len());
            for (k, mut v) in spliced {
                v.flags = (v.flags & !clear) | set;
                self.update_existing(k, v)?;
                out.push(v);
            }
            Ok(out)
        }
    }

    /// The entries for which `keep` holds.
    #[cfg(ksplice_built)]
    fn flows_where(
        &mut self,
        keep: impl Fn(&FlowVal) -> bool,
    ) -> Result<Vec<(FlowKey, FlowVal)>, Error> {
        Ok(self
            .flows()?
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, v)| keep(v))
            .collect())
    }

    /// Writes an entry only if it still exists: the program may have removed it meanwhile
    /// (an RST), and it must not come back.
    #[cfg(ksplice_built)]
    fn update_existing(&mut self, k: FlowKey, v: FlowVal) -> Result<(), Error> {
        const BPF_EXIST: u64 = 2;
        match self.flows()?.insert(k, v, BPF_EXIST) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::SyscallError(s))
                if s.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(err) => Err(Error::Ebpf(format!("updating a flow: {err}"))),
        }
    }

    /// Removes both directions of a spliced connection (entries already gone are fine).
    pub fn unsplice(&mut self, s: &Splice) -> Result<(), Error> {
        for (k, _) in s.entries() {
            self.remove(&k)?;
        }
        Ok(())
    }

    /// Watches the packets from `from` to `to` (they still reach the proxy's socket): the
    /// program records the sender's latest timestamp, which a hand-over needs. `seen` presets
    /// it (a watch restored after a hand-over that did not happen).
    pub fn watch(
        &mut self,
        from: SocketAddrV4,
        to: SocketAddrV4,
        seen: Option<u32>,
    ) -> Result<(), Error> {
        let v = FlowVal {
            flags: FLAG_WATCH | if seen.is_some() { FLAG_SAW_TS } else { 0 },
            ts_recent: seen.unwrap_or(0),
            last_ns: monotonic_ns(),
            ..FlowVal::default()
        };
        self.insert(FlowKey::new(from, to), v)
    }

    /// The latest TSval seen from `from` to `to` while watched or held, if any.
    pub fn seen_tsval(&self, from: SocketAddrV4, to: SocketAddrV4) -> Option<u32> {
        let v = self.get(&FlowKey::new(from, to))?;
        (v.flags & FLAG_SAW_TS != 0).then_some(v.ts_recent)
    }

    /// Whether the flow table has an entry for the packets from `from` to `to`: a spliced
    /// connection's, which lives on in the kernel while no socket holds its ports.
    pub fn contains(&self, from: SocketAddrV4, to: SocketAddrV4) -> bool {
        self.get(&FlowKey::new(from, to)).is_some()
    }

    /// Stops watching the packets from `from` to `to`.
    pub fn unwatch(&mut self, from: SocketAddrV4, to: SocketAddrV4) -> Result<(), Error> {
        self.remove(&FlowKey::new(from, to))
    }

    /// Packets and payload bytes the program carried for `s`: (client → server, server →
    /// client), or `None` once its entries are gone.
    pub fn carried(&self, s: &Splice) -> Option<[(u64, u64); 2]> {
        let [(k1, _), (k2, _)] = s.entries();
        let (a, b) = (self.get(&k1)?, self.get(&k2)?);
        Some([(a.packets, a.bytes), (b.packets, b.bytes)])
    }

    /// Removes the entries that the tier's expiry rule ([`rserpool_tier::Expiry`]) says are
    /// gone: of connections that ended (a FIN each way, then `closing` without a packet),
    /// idle longer than `idle`, and watch or hold entries older than `closing` (their
    /// hand-over never finished). An RST has the program remove its entries at once.
    pub fn expire(&mut self, idle: Duration, closing: Duration) -> Result<Expired, Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = (idle, closing);
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            use rserpool_tier::{Expiry, Gone, Seen};
            let rule = Expiry { idle, closing };
            let now = monotonic_ns();
            let seen = |v: &FlowVal| Seen {
                fin: v.flags & FLAG_FIN != 0,
                quiet: Duration::from_nanos(now.saturating_sub(v.last_ns)),
            };
            let entries: Vec<(FlowKey, FlowVal)> = {
                let flows = self.flows()?;
                flows.iter().filter_map(Result::ok).collect()
            };
            let by_key: std::collections::HashMap<FlowKey, FlowVal> =
                entries.iter().copied().collect();
            let mut out = Expired::default();
            for (k, v) in &entries {
                let reverse = by_key.get(&v.reverse_key()).map(seen);
                let handing_over = v.flags & (FLAG_WATCH | FLAG_HOLD) != 0;
                let counter = match rule.expires(seen(v), reverse, handing_over) {
                    Some(Gone::Closed) => &mut out.closed,
                    Some(Gone::Idle) => &mut out.idle,
                    Some(Gone::Stale) => &mut out.stale,
                    None => {
                        out.entries += 1;
                        continue;
                    }
                };
                self.remove(k)?;
                *counter += 1;
            }
            Ok(out)
        }
    }

    /// Every spliced connection in the flow table (not the watched or held ones): what a proxy
    /// joining a tier is sent.
    pub fn splices(&mut self) -> Result<Vec<SpliceState>, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let entries: std::collections::HashMap<FlowKey, FlowVal> = {
                let flows = self.flows()?;
                flows.iter().filter_map(Result::ok).collect()
            };
            let mut out = Vec::new();
            for (k, v) in &entries {
                if v.flags & (FLAG_WATCH | FLAG_HOLD) != 0 {
                    continue;
                }
                let rk = v.reverse_key();
                let Some(rv) = entries.get(&rk) else { continue };
                // Each connection once, from the entry whose key sorts first. Which one is the
                // client's is not recorded, and need not be: a splice read backwards (its
                // server as the client) installs the same two entries.
                if (k.saddr, k.sport, k.daddr, k.dport) > (rk.saddr, rk.sport, rk.daddr, rk.dport) {
                    continue;
                }
                if let Some(splice) = Splice::from_entries((k, v), (&rk, rv)) {
                    out.push(SpliceState {
                        splice,
                        fin: [v.flags & FLAG_FIN != 0, rv.flags & FLAG_FIN != 0],
                        last_ns: [v.last_ns, rv.last_ns],
                        packets: [v.packets, rv.packets],
                    });
                }
            }
            Ok(out)
        }
    }

    /// Marks the direction from `from` to `to` as closed by a FIN (one another member of a
    /// tier saw), so that the pair expires here too.
    pub fn mark_fin(&mut self, from: SocketAddrV4, to: SocketAddrV4) -> Result<(), Error> {
        let k = FlowKey::new(from, to);
        match self.get(&k) {
            Some(mut v) if v.flags & FLAG_FIN == 0 => {
                v.flags |= FLAG_FIN;
                self.insert(k, v)
            }
            _ => Ok(()),
        }
    }

    /// Counts the direction from `from` to `to` as active now (another member of a tier
    /// carried it), so that it does not idle out here.
    pub fn touch(&mut self, from: SocketAddrV4, to: SocketAddrV4) -> Result<(), Error> {
        let k = FlowKey::new(from, to);
        match self.get(&k) {
            Some(mut v) => {
                v.last_ns = v.last_ns.max(monotonic_ns());
                self.insert(k, v)
            }
            None => Ok(()),
        }
    }

    /// The other members of this proxy's tier (at most [`TIER_MAX`]).
    pub fn set_tier(&mut self, members: &[TierMember]) -> Result<(), Error> {
        if members.len() > TIER_MAX {
            return Err(Error::Ebpf(format!(
                "a tier of more than {} other members",
                TIER_MAX
            )));
        }
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let map = self
                .ebpf
                .map_mut(TIER_MAP)
                .ok_or_else(|| Error::Ebpf(format!("no map {TIER_MAP}")))?;
            let mut arr: aya::maps::Array<&mut aya::maps::MapData, RawTierMember> =
                aya::maps::Array::try_from(map)
                    .map_err(|err| Error::Ebpf(format!("tier map: {err}")))?;
            for i in 0..TIER_MAX {
                let raw = members
                    .get(i)
                    .map_or_else(RawTierMember::default, |m| RawTierMember {
                        addr: u32::from_ne_bytes(m.shared.octets()),
                        port_lo: *m.ports.start(),
                        port_hi: *m.ports.end(),
                        mac: m.mac,
                        src: m.src,
                    });
                arr.set(i as u32, raw, 0)
                    .map_err(|err| Error::Ebpf(format!("writing the tier map: {err}")))?;
            }
            Ok(())
        }
    }

    /// Packets sent on to another member of the tier (summed over the CPUs).
    pub fn tier_redirects(&self) -> Result<u64, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            Ok(self.per_cpu::<u64>(TIER_REDIRECTS_MAP)?.iter().sum())
        }
    }

    /// Index 0 of the per-CPU array `name`, one value per CPU.
    #[cfg(ksplice_built)]
    fn per_cpu<T: aya::Pod>(&self, name: &str) -> Result<Vec<T>, Error> {
        let map = self
            .ebpf
            .map(name)
            .ok_or_else(|| Error::Ebpf(format!("no map {name}")))?;
        let arr: aya::maps::PerCpuArray<&aya::maps::MapData, T> =
            aya::maps::PerCpuArray::try_from(map)
                .map_err(|err| Error::Ebpf(format!("{name}: {err}")))?;
        let values = arr
            .get(&0, 0)
            .map_err(|err| Error::Ebpf(format!("reading {name}: {err}")))?;
        Ok(values.iter().copied().collect())
    }

    fn get(&self, k: &FlowKey) -> Option<FlowVal> {
        #[cfg(not(ksplice_built))]
        {
            let _ = k;
            None
        }
        #[cfg(ksplice_built)]
        {
            let map = self.ebpf.map(FLOWS_MAP)?;
            let flows: aya::maps::HashMap<&aya::maps::MapData, FlowKey, FlowVal> =
                aya::maps::HashMap::try_from(map).ok()?;
            flows.get(k, 0).ok()
        }
    }

    fn insert(&mut self, k: FlowKey, v: FlowVal) -> Result<(), Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = (k, v);
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let mut flows = self.flows()?;
            flows.insert(k, v, 0).map_err(|err| match err {
                aya::maps::MapError::SyscallError(s)
                    if s.io_error.raw_os_error() == Some(libc::E2BIG) =>
                {
                    Error::Full(self.max_flows)
                }
                other => Error::Ebpf(format!("inserting a flow: {other}")),
            })
        }
    }

    fn remove(&mut self, k: &FlowKey) -> Result<(), Error> {
        #[cfg(not(ksplice_built))]
        {
            let _ = k;
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let mut flows = self.flows()?;
            match flows.remove(k) {
                Ok(()) => Ok(()),
                Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(aya::maps::MapError::SyscallError(s))
                    if s.io_error.raw_os_error() == Some(libc::ENOENT) =>
                {
                    Ok(())
                }
                Err(other) => Err(Error::Ebpf(format!("removing a flow: {other}"))),
            }
        }
    }

    #[cfg(ksplice_built)]
    fn flows(
        &mut self,
    ) -> Result<aya::maps::HashMap<&mut aya::maps::MapData, FlowKey, FlowVal>, Error> {
        let map = self
            .ebpf
            .map_mut(FLOWS_MAP)
            .ok_or_else(|| Error::Ebpf(format!("no map {FLOWS_MAP}")))?;
        aya::maps::HashMap::try_from(map).map_err(|err| Error::Ebpf(format!("flow map: {err}")))
    }

    /// The flow table's size.
    pub fn max_flows(&self) -> u32 {
        self.max_flows
    }

    /// Packets and bytes carried, FINs and RSTs seen, summed over the CPUs.
    pub fn counters(&self) -> Result<Counters, Error> {
        #[cfg(not(ksplice_built))]
        {
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            let per_cpu = self.per_cpu::<RawCounters>(COUNTERS_MAP)?;
            Ok(per_cpu.iter().fold(Counters::default(), |a, c| Counters {
                packets: a.packets + c.packets,
                bytes: a.bytes + c.bytes,
                fins: a.fins + c.fins,
                rsts: a.rsts + c.rsts,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A splice with every field set, the offsets wrapping.
    fn sample() -> Splice {
        Splice {
            client: "10.0.1.2:40000".parse().unwrap(),
            front: "10.0.1.1:8080".parse().unwrap(),
            back: "10.0.2.1:40001".parse().unwrap(),
            server: "10.0.2.2:9000".parse().unwrap(),
            client_seq_delta: 0x8000_0001,
            server_seq_delta: 7,
            client_if: 2,
            server_if: 3,
            client_wscale: 7,
            front_wscale: 9,
            server_wscale: 2,
            back_wscale: 5,
            timestamps: Some((1000, 0xffff_ff00)),
        }
    }

    #[test]
    fn a_splice_is_read_back_from_its_entries_either_way_round() {
        let s = Splice {
            client_seq_delta: 17,
            server_seq_delta: 0xffff_0000,
            ..sample()
        };
        // The entries but for when they were made.
        let timeless = |s: &Splice| s.entries().map(|(k, v)| (k, FlowVal { last_ns: 0, ..v }));
        let [(k1, v1), (k2, v2)] = s.entries();
        let read = Splice::from_entries((&k1, &v1), (&k2, &v2)).unwrap();
        assert_eq!(timeless(&read), timeless(&s));
        let backwards = Splice::from_entries((&k2, &v2), (&k1, &v1)).unwrap();
        let [a, b] = timeless(&backwards);
        assert_eq!([b, a], timeless(&s));
        // Not a pair.
        assert!(Splice::from_entries((&k1, &v1), (&k1, &v1)).is_none());
    }

    #[test]
    fn the_two_directions_undo_each_others_offsets() {
        let s = sample();
        let [(k1, v1), (k2, v2)] = s.entries();
        assert_eq!(k1, FlowKey::new(s.client, s.front));
        assert_eq!(k2, FlowKey::new(s.server, s.back));
        // What the client sends arrives at the server as from `back`, and back again.
        assert_eq!((v1.saddr, v1.daddr), (k2.daddr, k2.saddr));
        assert_eq!((v2.saddr, v2.daddr), (k1.daddr, k1.saddr));
        assert_eq!((v1.sport, v1.dport), (k2.dport, k2.sport));
        // A client byte numbered n reaches the server as n + d; the server's ACK of it comes
        // back as n + d, and reaches the client as n.
        let n: u32 = 0xffff_fff0;
        let at_server = n.wrapping_add(v1.seq_delta);
        assert_eq!(at_server.wrapping_add(v2.ack_delta), n);
        let m: u32 = 12345;
        assert_eq!(m.wrapping_add(v2.seq_delta).wrapping_add(v1.ack_delta), m);
        assert_eq!((v1.ifindex, v2.ifindex), (3, 2));
        assert_eq!((v1.wscale_in, v1.wscale_out), (7, 5));
        assert_eq!((v2.wscale_in, v2.wscale_out), (2, 9));
        // A client TSval t reaches the server as t + 1000; the server's echo of it comes back
        // to the client as t. Likewise for the server's clock.
        let t: u32 = 5;
        assert_eq!(
            t.wrapping_add(v1.tsval_delta).wrapping_add(v2.tsecr_delta),
            t
        );
        assert_eq!(
            t.wrapping_add(v2.tsval_delta).wrapping_add(v1.tsecr_delta),
            t
        );
        assert_ne!(v1.flags & FLAG_TS, 0);
        // Ports in network byte order, as the program compares them.
        assert_eq!(k1.dport.to_ne_bytes(), 8080u16.to_be_bytes());
    }
}
