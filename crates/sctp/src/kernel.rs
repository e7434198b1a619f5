//! The kernel's SCTP, where the host has it: one-to-one sockets (RFC 6458 §4,
//! `SOCK_STREAM` with protocol 132), each an association, messages sent with their stream
//! and payload protocol identifier in an `SCTP_SNDINFO` control message and received with
//! theirs in `SCTP_RCVINFO` (§5.3.4, §5.3.5).
//!
//! Why: on a host whose kernel has SCTP, our raw-IP stack cannot run (the kernel answers
//! every association it sees with an ABORT), and rsplib as Linux distributions ship it runs
//! on the kernel's SCTP. `sctp://` addresses use this module there; elsewhere the user-space
//! stack on a raw socket, chosen at run time ([`available`]).
//!
//! This project's machines have no kernel SCTP, so this path is not run by its tests: only
//! its message layout is (docs/SCTP.md says so).

use socket2::{Domain, MaybeUninitSlice, MsgHdr, MsgHdrMut, Protocol, SockAddr, Socket, Type};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::net::SocketAddr;

const IPPROTO_SCTP: i32 = 132;
/// `SOL_SCTP`: the socket option and control message level.
const SOL_SCTP: i32 = 132;
/// Control message types and a socket option of <linux/sctp.h>.
const SCTP_SNDINFO: i32 = 2;
const SCTP_RCVINFO: i32 = 3;
const SCTP_RECVRCVINFO: i32 = 32;

/// Whether this host's kernel has SCTP for `family` (a socket of protocol 132 opens).
pub fn available(ipv4: bool) -> bool {
    let domain = if ipv4 { Domain::IPV4 } else { Domain::IPV6 };
    Socket::new(domain, Type::STREAM, Some(Protocol::from(IPPROTO_SCTP))).is_ok()
}

/// A non-blocking one-to-one SCTP socket for `family`, delivering each message's stream and
/// PPID.
fn socket(ipv4: bool) -> io::Result<Socket> {
    let domain = if ipv4 { Domain::IPV4 } else { Domain::IPV6 };
    let s = Socket::new(domain, Type::STREAM, Some(Protocol::from(IPPROTO_SCTP)))?;
    s.set_nonblocking(true)?;
    // A listener and the associations of a pool element share its port (a registrar taking
    // over reaches the PE at the port of its registrar association).
    s.set_reuse_address(true)?;
    receive_info(&s)?;
    Ok(s)
}

/// A one-to-one socket connecting from `from` (port 0: one the kernel picks) to `peer`
/// (non-blocking: writable once up, or failed).
pub fn connect(from: SocketAddr, peer: SocketAddr) -> io::Result<Socket> {
    let s = socket(peer.is_ipv4())?;
    if from.port() != 0 || !from.ip().is_unspecified() {
        match s.bind(&SockAddr::from(from)) {
            Ok(()) => {}
            // A one-to-one socket cannot share a port with a listening one: the kernel
            // picks another (a peer that wants our listening port as the source, as rsplib
            // for a PRESENCE, would need one-to-many sockets).
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && from.port() != 0 => {
                s.bind(&SockAddr::from(SocketAddr::new(from.ip(), 0)))?;
            }
            Err(e) => return Err(e),
        }
    }
    match s.connect(&SockAddr::from(peer)) {
        Ok(()) => Ok(s),
        Err(e) if e.raw_os_error() == Some(115) || e.kind() == io::ErrorKind::WouldBlock => {
            // EINPROGRESS
            Ok(s)
        }
        Err(e) => Err(e),
    }
}

/// A one-to-one socket listening on `at`.
pub fn listen(at: SocketAddr) -> io::Result<Socket> {
    let s = socket(at.is_ipv4())?;
    s.bind(&SockAddr::from(at))?;
    s.listen(128)?;
    Ok(s)
}

/// An accepted association, made like ours.
pub fn accepted(s: Socket) -> io::Result<Socket> {
    s.set_nonblocking(true)?;
    receive_info(&s)?;
    Ok(s)
}

/// Asks for `SCTP_RCVINFO` with every message (`SCTP_RECVRCVINFO`), so that its stream and
/// PPID are known.
#[allow(unsafe_code)]
fn receive_info(s: &Socket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: `on` is a live c_int for the call's duration and its size is passed; the
    // descriptor is owned by `s`.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            SOL_SCTP,
            SCTP_RECVRCVINFO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `struct cmsghdr`'s size, which is also where its data starts (`CMSG_LEN(0)` on Linux).
const CMSG_HEADER: usize = std::mem::size_of::<usize>() + 8;
/// `struct sctp_sndinfo`: sid, flags, ppid, context, assoc_id.
const SNDINFO: usize = 16;
/// `struct sctp_rcvinfo`: sid, ssn, flags, (pad), ppid, tsn, cumtsn, context, assoc_id.
const RCVINFO: usize = 28;

/// The control message that sends a message on `stream` with `ppid`: a `cmsghdr` and an
/// `sctp_sndinfo`, in this host's byte order but the PPID, which travels as it is written
/// (network order, as every SCTP application writes it).
pub fn sndinfo(stream: u16, ppid: u32) -> [u8; CMSG_HEADER + SNDINFO] {
    let mut b = [0u8; CMSG_HEADER + SNDINFO];
    let w = std::mem::size_of::<usize>();
    b[..w].copy_from_slice(&(CMSG_HEADER + SNDINFO).to_ne_bytes()[..w]);
    b[w..w + 4].copy_from_slice(&SOL_SCTP.to_ne_bytes());
    b[w + 4..w + 8].copy_from_slice(&SCTP_SNDINFO.to_ne_bytes());
    let d = &mut b[CMSG_HEADER..];
    d[0..2].copy_from_slice(&stream.to_ne_bytes());
    d[4..8].copy_from_slice(&ppid.to_be_bytes());
    b
}

/// The stream and PPID of an `SCTP_RCVINFO` among the control messages `control`.
pub fn rcvinfo(control: &[u8]) -> Option<(u16, u32)> {
    let w = std::mem::size_of::<usize>();
    let mut rest = control;
    while rest.len() >= CMSG_HEADER {
        let mut len = [0u8; std::mem::size_of::<usize>()];
        len.copy_from_slice(&rest[..w]);
        let len = usize::from_ne_bytes(len);
        let level = i32::from_ne_bytes([rest[w], rest[w + 1], rest[w + 2], rest[w + 3]]);
        let ty = i32::from_ne_bytes([rest[w + 4], rest[w + 5], rest[w + 6], rest[w + 7]]);
        if len < CMSG_HEADER || len > rest.len() {
            return None;
        }
        if level == SOL_SCTP && ty == SCTP_RCVINFO && len >= CMSG_HEADER + RCVINFO {
            let d = &rest[CMSG_HEADER..];
            let sid = u16::from_ne_bytes([d[0], d[1]]);
            let ppid = u32::from_be_bytes([d[8], d[9], d[10], d[11]]);
            return Some((sid, ppid));
        }
        // The next one starts at the length rounded up to the word.
        rest = rest.get(len.next_multiple_of(w)..)?;
    }
    None
}

/// Sends one whole message (the socket takes all of it or none: `WouldBlock`).
pub fn send(s: &Socket, stream: u16, ppid: u32, data: &[u8]) -> io::Result<()> {
    let control = sndinfo(stream, ppid);
    let iov = [IoSlice::new(data)];
    let msg = MsgHdr::new().with_buffers(&iov).with_control(&control);
    s.sendmsg(&msg, libc::MSG_NOSIGNAL)?;
    Ok(())
}

/// What one `recvmsg` gave: bytes of a message, whether they end it, and its stream and PPID
/// when the kernel said.
pub struct Piece {
    pub len: usize,
    pub end: bool,
    pub info: Option<(u16, u32)>,
}

/// Receives the next piece of a message into `buf` (0 bytes: the peer closed).
pub fn recv(s: &Socket, buf: &mut [u8]) -> io::Result<Piece> {
    let mut control = [0u8; 128];
    let mut bufs = [MaybeUninitSlice::new(as_uninit(buf))];
    let mut msg = MsgHdrMut::new()
        .with_buffers(&mut bufs)
        .with_control(as_uninit(&mut control));
    let n = s.recvmsg(&mut msg, 0)?;
    let end = msg.flags().is_end_of_record() || n == 0;
    let control_len = msg.control_len();
    let info = control.get(..control_len).and_then(rcvinfo);
    Ok(Piece { len: n, end, info })
}

/// Initialised bytes seen as possibly uninitialised ones, for the kernel to write into.
#[allow(unsafe_code)]
fn as_uninit(b: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and nothing writes an uninitialised
    // byte through the result (the kernel writes received bytes), so `b` stays initialised.
    unsafe { &mut *(b as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sndinfo_is_a_cmsghdr_with_stream_and_ppid_in_place() {
        let b = sndinfo(3, 11);
        let w = std::mem::size_of::<usize>();
        assert_eq!(b.len(), w + 8 + 16);
        assert_eq!(b[..w], (w + 24).to_ne_bytes()[..w]);
        assert_eq!(b[w..w + 4], 132i32.to_ne_bytes());
        assert_eq!(b[w + 4..w + 8], 2i32.to_ne_bytes());
        assert_eq!(b[w + 8..w + 10], 3u16.to_ne_bytes());
        assert_eq!(b[w + 12..w + 16], [0, 0, 0, 11]);
    }

    #[test]
    fn rcvinfo_is_found_among_control_messages_and_bad_lengths_are_not_trusted() {
        let w = std::mem::size_of::<usize>();
        let cmsg = |level: i32, ty: i32, data: &[u8]| {
            let mut c = Vec::new();
            c.extend_from_slice(&(w + 8 + data.len()).to_ne_bytes());
            c.extend_from_slice(&level.to_ne_bytes());
            c.extend_from_slice(&ty.to_ne_bytes());
            c.extend_from_slice(data);
            while c.len() % w != 0 {
                c.push(0);
            }
            c
        };
        let mut info = vec![0u8; 28];
        info[0..2].copy_from_slice(&5u16.to_ne_bytes());
        info[8..12].copy_from_slice(&12u32.to_be_bytes());
        let mut control = cmsg(0, 1, &[1, 2, 3]);
        control.extend(cmsg(132, 3, &info));
        assert_eq!(rcvinfo(&control), Some((5, 12)));
        // Cut inside its data (not just its padding).
        assert_eq!(rcvinfo(&control[..control.len() - 5]), None);
        assert_eq!(rcvinfo(&cmsg(132, 2, &info)), None);
        let mut bad = cmsg(132, 3, &info);
        bad[..w].copy_from_slice(&1usize.to_ne_bytes());
        assert_eq!(rcvinfo(&bad), None);
        assert_eq!(rcvinfo(&[]), None);
    }

    #[test]
    fn where_the_kernel_has_no_sctp_nothing_opens() {
        if !available(true) {
            let any = "0.0.0.0:0".parse().unwrap();
            assert!(connect(any, "127.0.0.1:9".parse().unwrap()).is_err());
            assert!(listen("127.0.0.1:0".parse().unwrap()).is_err());
        }
    }
}
