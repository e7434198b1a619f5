//! Established connections per listening port, counted in the kernel (`bpf/conncount.c`), for
//! the `serve` sidecar's credits (docs/CREDITS.md, docs/PERFORMANCE.md).
//!
//! Why: a sidecar learns how busy an unmodified server is from the server's sockets, which
//! belong to another process. sock_diag can tell, but a dump of the established sockets of
//! one port walks every bucket of the host's TCP hash table (262,144 on a 24 GiB machine)
//! whatever the filter: sampled every 5 ms that cost a sidecar more than half a core with
//! no traffic at all. A sock_ops program on the root cgroup instead counts each connection
//! of the watched ports as it becomes established and as it leaves that state: a cost
//! proportional to the connections, and a read is one map lookup.
//!
//! The count starts when a port is added; the connections established before are not in it
//! (the caller adds them from one sock_diag dump, see [`ConnCounter::read`]).

use crate::Error;
use std::net::SocketAddr;

/// The most ports one counter counts.
pub const CONNCOUNT_MAX: usize = crate::abi::CONNCOUNT_MAX as usize;

#[cfg(ksplice_built)]
static CONNCOUNT_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("KSPLICE_CONNCOUNT_OBJECT"));

/// The map's key: a port in a network namespace (`struct conn_port` of `bpf/abi.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnPort {
    pub(crate) netns: u64,
    pub(crate) port: u32,
    pub(crate) zero: u32,
}

/// A port's count (`struct conn_count` of `bpf/abi.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnCount {
    /// Connections established since the port was added, less those that left the state
    /// (among them some established before, if another loader had asked for their events).
    pub established: i64,
    /// Events counted, both ways.
    pub changes: u64,
}

#[allow(unsafe_code)]
// SAFETY: plain `repr(C)` integers without padding, as the program reads and writes them.
unsafe impl aya::Pod for ConnPort {}
#[allow(unsafe_code)]
// SAFETY: as above.
unsafe impl aya::Pod for ConnCount {}

/// The program, attached to the root cgroup for as long as the value lives.
pub struct ConnCounter {
    netns: u64,
    /// Only `attach` makes one, and only where the program was built.
    ebpf: aya::Ebpf,
}

impl ConnCounter {
    /// Loads the program and attaches it to the cgroup v2 hierarchy's root (every process's
    /// sockets; beside other programs there). Needs root (CAP_BPF and CAP_NET_ADMIN) and a
    /// mounted cgroup2 file system. Counts in the calling thread's network namespace.
    pub fn attach() -> Result<Self, Error> {
        let netns = netns_cookie()
            .map_err(|e| Error::Ebpf(format!("this network namespace's cookie: {e}")))?;
        #[cfg(not(ksplice_built))]
        {
            let _ = netns;
            Err(Error::Unavailable(env!("KSPLICE_UNAVAILABLE")))
        }
        #[cfg(ksplice_built)]
        {
            use aya::programs::{CgroupAttachMode, SockOps};
            let e = |what: &str, err: &dyn std::fmt::Display| Error::Ebpf(format!("{what}: {err}"));
            let root = cgroup2_root()
                .ok_or_else(|| Error::Ebpf("no cgroup2 file system is mounted".into()))?;
            let cgroup = std::fs::File::open(&root)
                .map_err(|err| e(&format!("opening {}", root.display()), &err))?;
            let mut ebpf = aya::Ebpf::load(CONNCOUNT_OBJECT).map_err(|err| e("loading", &err))?;
            let prog: &mut SockOps = ebpf
                .program_mut("conncount")
                .ok_or_else(|| Error::Ebpf("no program conncount".into()))?
                .try_into()
                .map_err(|err| e("program type", &err))?;
            prog.load()
                .map_err(|err| e("the verifier refused it", &err))?;
            // As a link (kernel 5.7 and later), which is always one among many: the kernel
            // refuses the ALLOW_MULTI flag there.
            prog.attach(&cgroup, CgroupAttachMode::Single)
                .map_err(|err| e(&format!("attaching to {}", root.display()), &chain(&err)))?;
            Ok(Self { netns, ebpf })
        }
    }

    /// Starts counting the connections `addr.port()` accepts (from zero; at most
    /// [`CONNCOUNT_MAX`] ports).
    pub fn watch(&mut self, addr: SocketAddr) -> Result<(), Error> {
        let key = self.key(addr);
        self.map()?
            .insert(key, ConnCount::default(), 0)
            .map_err(|err| Error::Ebpf(format!("conncount map: {err}")))
    }

    /// The count of `addr.port()` since [`watch`](Self::watch).
    pub fn read(&mut self, addr: SocketAddr) -> Result<ConnCount, Error> {
        let key = self.key(addr);
        self.map()?
            .get(&key, 0)
            .map_err(|err| Error::Ebpf(format!("conncount map: {err}")))
    }

    fn key(&self, addr: SocketAddr) -> ConnPort {
        ConnPort {
            netns: self.netns,
            port: u32::from(addr.port()),
            zero: 0,
        }
    }

    fn map(
        &mut self,
    ) -> Result<aya::maps::HashMap<&mut aya::maps::MapData, ConnPort, ConnCount>, Error> {
        let map = self
            .ebpf
            .map_mut(crate::abi::CONNCOUNT_MAP)
            .ok_or_else(|| Error::Ebpf(format!("no map {}", crate::abi::CONNCOUNT_MAP)))?;
        aya::maps::HashMap::try_from(map)
            .map_err(|err| Error::Ebpf(format!("conncount map: {err}")))
    }
}

/// An error with its sources (aya's say only which call failed, their source says why).
#[cfg(ksplice_built)]
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// Where the cgroup2 file system is mounted (the unified hierarchy's root as this process
/// sees it).
#[cfg(ksplice_built)]
fn cgroup2_root() -> Option<std::path::PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, dir, fs) = (f.next()?, f.next()?, f.next()?);
        (fs == "cgroup2").then(|| dir.into())
    })
}

/// The calling thread's network namespace's cookie (what `bpf_get_netns_cookie` returns).
#[allow(unsafe_code)]
fn netns_cookie() -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let sock =
        std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"))?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` outlive the call, and `len` is `cookie`'s size.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}
