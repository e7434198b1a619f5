//! Hand-over: a running rserpool process gives its listening sockets (and whatever state it
//! wants to pass on) to the process that replaces it, so that an upgrade or a restart has no
//! moment in which nobody listens.
//!
//! Why it exists: stopping a server and starting the next one closes its listening sockets in
//! between, and every connection attempt in that gap is refused; binding the same address twice
//! (`SO_REUSEPORT`) drops the connections queued on the closing socket. Passing the very same
//! sockets over a Unix socket (`SCM_RIGHTS`, unix(7)) keeps one accept queue throughout, as
//! HAProxy's `expose-fd listeners` and nginx's binary upgrade do.
//!
//! The exchange, on a stream socket named by [`Address`] (a path, or an abstract name):
//! 1. the running process offers ([`Offer`]); a new one connects and sends [`TAKE`];
//! 2. the running one answers with its sockets and a state blob ([`Asker::give`]) and goes on
//!    accepting;
//! 3. the new one starts accepting on them and says [`READY`] ([`Taken::ready`]);
//! 4. the running one stops accepting, answers [`DONE`] and drains; the new one offers next.
//!
//! If the new process dies or gives up before step 3, the running one keeps everything and
//! offers again. Both sides check the other's credentials (`SO_PEERCRED`): only the same user
//! or root may take or give, so an abstract name (which has no file permissions) is safe too.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

/// What the new process sends first.
pub const TAKE: &[u8] = b"RSERPOOL-HANDOVER 1 TAKE\n";
/// What the new process sends once it accepts on the sockets it took.
pub const READY: &[u8] = b"READY\n";
/// What the old process answers once it stopped accepting.
pub const DONE: &[u8] = b"DONE\n";
/// The most descriptors one message carries (the kernel's `SCM_MAX_FD`); more go in several.
pub const FDS_PER_MESSAGE: usize = 253;
/// The most descriptors one hand-over carries.
pub const MAX_FDS: usize = 1 << 20;
/// The largest state blob accepted.
pub const MAX_STATE: usize = 256 << 20;
/// Time for each step of the exchange but the wait for [`READY`].
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("hand-over socket {0}: {1}")]
    Io(String, io::Error),
    #[error("hand-over socket {0}: the peer runs as user {1}, this process as {2}")]
    Foreign(String, u32, u32),
    #[error("hand-over socket {0}: {1}")]
    Protocol(String, String),
}

/// Where the hand-over socket is: a path (`/run/rserpool/proxy.sock`) or an abstract name
/// (`@rserpool-proxy`), which needs no file and lives in the network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

impl std::str::FromStr for Address {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.strip_prefix('@') {
            _ if s.is_empty() => Err("an empty hand-over socket name".into()),
            Some("") => Err("an empty abstract socket name".into()),
            Some(name) if name.len() > 100 => {
                Err("an abstract socket name of over 100 bytes".into())
            }
            Some(name) => Ok(Address::Abstract(name.as_bytes().to_vec())),
            None => Ok(Address::Path(PathBuf::from(s))),
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Path(p) => write!(f, "{}", p.display()),
            Address::Abstract(n) => write!(f, "@{}", String::from_utf8_lossy(n)),
        }
    }
}

impl Address {
    /// The abstract name `@PREFIX:KEY`, for a default made from what identifies a service (a
    /// configuration file's path, its addresses); a long KEY keeps its end.
    pub fn abstract_for(prefix: &str, key: &str) -> Address {
        let mut name = format!("{prefix}:{key}").into_bytes();
        if name.len() > 100 {
            name.drain(..name.len() - 100);
        }
        Address::Abstract(name)
    }

    fn socket_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Address::Path(p) => SocketAddr::from_pathname(p),
            Address::Abstract(n) => SocketAddr::from_abstract_name(n),
        }
    }
    fn err(&self, e: io::Error) -> Error {
        Error::Io(self.to_string(), e)
    }
    fn protocol(&self, what: impl Into<String>) -> Error {
        Error::Protocol(self.to_string(), what.into())
    }
}

/// Refuses a peer of another user (root may hand over to anyone and take from anyone).
fn check_peer(addr: &Address, s: &UnixStream) -> Result<u32, Error> {
    let cred = rustix::net::sockopt::socket_peercred(s).map_err(|e| addr.err(e.into()))?;
    let (theirs, ours) = (cred.uid.as_raw(), rustix::process::getuid().as_raw());
    if theirs != ours && theirs != 0 && ours != 0 {
        return Err(Error::Foreign(addr.to_string(), theirs, ours));
    }
    Ok(cred.pid.as_raw_nonzero().get().unsigned_abs())
}

/// A running process's offer to hand over.
pub struct Offer {
    listener: UnixListener,
    addr: Address,
}

impl Offer {
    /// Listens on `addr`: a path gets mode 0600, and a file left by a process that is gone is
    /// replaced; a name in use by a live process is `AddrInUse`.
    pub fn bind(addr: &Address) -> Result<Offer, Error> {
        let sa = addr.socket_addr().map_err(|e| addr.err(e))?;
        let listener = match UnixListener::bind_addr(&sa) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => match addr {
                Address::Path(p) if UnixStream::connect(p).is_err() => {
                    std::fs::remove_file(p).map_err(|e| addr.err(e))?;
                    UnixListener::bind_addr(&sa)
                }
                _ => Err(e),
            },
            r => r,
        }
        .map_err(|e| addr.err(e))?;
        if let Address::Path(p) = addr {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| addr.err(e))?;
        }
        listener.set_nonblocking(true).map_err(|e| addr.err(e))?;
        Ok(Offer {
            listener,
            addr: addr.clone(),
        })
    }

    /// The listening socket, non-blocking, for an event loop to wait on.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    pub fn address(&self) -> &Address {
        &self.addr
    }

    /// A process that asks to take over, if one is waiting (`None` when none is).
    pub fn accept(&self) -> Result<Option<Asker>, Error> {
        match self.listener.accept() {
            Ok((s, _)) => Asker::new(&self.addr, s).map(Some),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(self.addr.err(e)),
        }
    }
}

impl Drop for Offer {
    fn drop(&mut self) {
        if let Address::Path(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A new process that asked to take over (it sent [`TAKE`]).
pub struct Asker {
    stream: UnixStream,
    addr: Address,
    /// Its process id.
    pub pid: u32,
}

impl Asker {
    /// Checks who connected and reads its request (blocking, within [`STEP_TIMEOUT`]).
    pub fn new(addr: &Address, stream: UnixStream) -> Result<Asker, Error> {
        let pid = check_peer(addr, &stream)?;
        stream.set_nonblocking(false).map_err(|e| addr.err(e))?;
        set_timeouts(&stream, STEP_TIMEOUT).map_err(|e| addr.err(e))?;
        let mut asked = [0u8; TAKE.len()];
        (&stream).read_exact(&mut asked).map_err(|e| addr.err(e))?;
        if asked != TAKE {
            return Err(addr.protocol("not a hand-over request"));
        }
        Ok(Asker {
            stream,
            addr: addr.clone(),
            pid,
        })
    }

    /// Sends `fds` and `state` (blocking). The sockets stay open here too: this process goes on
    /// accepting until [`Giving::wait_ready`] returns.
    pub fn give(self, state: &[u8], fds: &[BorrowedFd<'_>]) -> Result<Giving, Error> {
        let a = &self.addr;
        if fds.len() > MAX_FDS {
            return Err(a.protocol(format!("{} sockets, at most {MAX_FDS}", fds.len())));
        }
        let (n, len) = (fds.len() as u32, state.len() as u64);
        let mut head = [0u8; 12];
        head[..4].copy_from_slice(&n.to_be_bytes());
        head[4..].copy_from_slice(&len.to_be_bytes());
        (&self.stream).write_all(&head).map_err(|e| a.err(e))?;
        // The descriptors, at most `FDS_PER_MESSAGE` with each byte of a run of `+`.
        for chunk in fds.chunks(FDS_PER_MESSAGE) {
            let mut space =
                vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(chunk.len()))];
            let mut cmsg = rustix::net::SendAncillaryBuffer::new(&mut space);
            if !cmsg.push(rustix::net::SendAncillaryMessage::ScmRights(chunk)) {
                return Err(a.protocol("the descriptors do not fit"));
            }
            let sent = rustix::net::sendmsg(
                &self.stream,
                &[IoSlice::new(b"+")],
                &mut cmsg,
                rustix::net::SendFlags::NOSIGNAL,
            )
            .map_err(|e| a.err(e.into()))?;
            if sent != 1 {
                return Err(a.protocol("a descriptor message was not sent"));
            }
        }
        (&self.stream).write_all(state).map_err(|e| a.err(e))?;
        Ok(Giving {
            stream: self.stream,
            addr: self.addr,
        })
    }
}

/// Sockets given away, waiting for the new process to take them up.
pub struct Giving {
    stream: UnixStream,
    addr: Address,
}

impl Giving {
    /// Returns once the new process accepts on the sockets ([`READY`]): now this one stops
    /// accepting and calls [`Giving::done`]. An error (the new process died, gave up or took
    /// longer than `limit`): this one keeps serving, and may offer again.
    pub fn wait_ready(&self, limit: Duration) -> Result<(), Error> {
        set_timeouts(&self.stream, limit).map_err(|e| self.addr.err(e))?;
        let mut said = [0u8; READY.len()];
        (&self.stream)
            .read_exact(&mut said)
            .map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => self
                    .addr
                    .protocol("the new process ended before it was ready (see its log)"),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self
                    .addr
                    .protocol(format!("the new process was not ready within {limit:?}")),
                _ => self.addr.err(e),
            })?;
        if said != READY {
            return Err(self
                .addr
                .protocol("the new process did not say it was ready"));
        }
        Ok(())
    }

    /// Tells the new process that this one no longer accepts.
    pub fn done(self) -> Result<(), Error> {
        set_timeouts(&self.stream, STEP_TIMEOUT).map_err(|e| self.addr.err(e))?;
        (&self.stream).write_all(DONE).map_err(|e| self.addr.err(e))
    }
}

/// What a new process took over from the running one.
pub struct Taken {
    stream: UnixStream,
    addr: Address,
    /// The sockets, in the order the running process gave them.
    pub fds: Vec<OwnedFd>,
    /// The state it passed on.
    pub state: Vec<u8>,
    /// The running process's id.
    pub pid: u32,
}

/// Asks the process offering at `addr` for its sockets and state (blocking, each step within
/// [`STEP_TIMEOUT`]). `Ok(None)`: nobody offers (no process runs, or one that does not
/// hand over).
pub fn take(addr: &Address) -> Result<Option<Taken>, Error> {
    let sa = addr.socket_addr().map_err(|e| addr.err(e))?;
    let stream = match UnixStream::connect_addr(&sa) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(addr.err(e)),
    };
    let pid = check_peer(addr, &stream)?;
    set_timeouts(&stream, STEP_TIMEOUT).map_err(|e| addr.err(e))?;
    (&stream).write_all(TAKE).map_err(|e| addr.err(e))?;
    let mut head = [0u8; 12];
    match (&stream).read_exact(&mut head) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(addr.protocol("the running process closed without handing over"));
        }
        r => r.map_err(|e| addr.err(e))?,
    }
    let n = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&head[4..]);
    let len = u64::from_be_bytes(len8);
    if n > MAX_FDS {
        return Err(addr.protocol(format!("{n} sockets announced, at most {MAX_FDS}")));
    }
    let mut fds = Vec::with_capacity(n);
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    while fds.len() < n {
        let mut cmsg = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let mut plus = [0u8; 1];
        let got = rustix::net::recvmsg(
            &stream,
            &mut [IoSliceMut::new(&mut plus)],
            &mut cmsg,
            rustix::net::RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(|e| addr.err(e.into()))?;
        if got.bytes != 1 || plus != *b"+" {
            return Err(addr.protocol(format!("{} of {n} sockets came", fds.len())));
        }
        if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(addr.protocol("more descriptors than can be taken"));
        }
        for m in cmsg.drain() {
            if let rustix::net::RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
    }
    if n != fds.len() {
        return Err(addr.protocol(format!("{} sockets announced, {} came", n, fds.len())));
    }
    let len = usize::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_STATE)
        .ok_or_else(|| addr.protocol(format!("a state of {len} bytes")))?;
    let mut state = vec![0u8; len];
    (&stream).read_exact(&mut state).map_err(|e| addr.err(e))?;
    Ok(Some(Taken {
        stream,
        addr: addr.clone(),
        fds,
        state,
        pid,
    }))
}

impl Taken {
    /// Tells the old process that this one accepts now, and returns once it stopped accepting
    /// (or closed, or `limit` passed: it stops anyway when it reads [`READY`]).
    pub fn ready(self, limit: Duration) -> Result<(), Error> {
        let a = &self.addr;
        (&self.stream).write_all(READY).map_err(|e| a.err(e))?;
        set_timeouts(&self.stream, limit).map_err(|e| a.err(e))?;
        let mut said = [0u8; DONE.len()];
        match (&self.stream).read_exact(&mut said) {
            Ok(()) if said == DONE => Ok(()),
            Ok(()) => Err(a.protocol("an unknown answer to READY")),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(()),
            Err(e) => Err(a.err(e)),
        }
    }
}

fn set_timeouts(s: &UnixStream, t: Duration) -> io::Result<()> {
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))
}

/// A descriptor as what it is, when it is a listening TCP socket; `what` names it in the error.
pub fn tcp_listener(fd: OwnedFd, what: &str) -> io::Result<std::net::TcpListener> {
    let listening = rustix::net::sockopt::socket_acceptconn(&fd)?;
    let kind = rustix::net::sockopt::socket_type(&fd)?;
    if !listening || kind != rustix::net::SocketType::STREAM {
        return Err(io::Error::other(format!(
            "{what}: the descriptor handed over is not a listening TCP socket"
        )));
    }
    let l = std::net::TcpListener::from(fd);
    l.local_addr()?;
    Ok(l)
}

/// Another descriptor for `fd` (for sockets a process keeps while it hands them over).
pub fn dup(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    fd.try_clone_to_owned()
}

/// Borrows each of `fds`, for [`Asker::give`].
pub fn borrow<T: AsFd>(fds: &[T]) -> Vec<BorrowedFd<'_>> {
    fds.iter().map(AsFd::as_fd).collect()
}
