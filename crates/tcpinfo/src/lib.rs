//! The kernel's view of one TCP socket (tcp(7)): `TCP_INFO`, and the bytes the other end has
//! not acknowledged yet (`SIOCOUTQ`).
//!
//! Why it exists: two parts of rserpool decide by it, and the unsafe system calls belong in
//! one place. A PE's credits come from its listening socket's accept queue
//! (`rserpool_asap::metric`); a registrar waits longer for a keep-alive's answer while TCP
//! still carries the keep-alive over a lossy path (`rserpool_registrar`'s driver).

use std::io;
use std::os::fd::AsRawFd;

/// The socket's `struct tcp_info` (fields the running kernel does not fill stay zero); an
/// error if the kernel filled less than `needed` bytes of it.
pub fn tcp_info(socket: &impl AsRawFd, needed: usize) -> io::Result<libc::tcp_info> {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it and
    // reports how many it wrote.
    #[allow(unsafe_code)]
    let (info, len) = unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast::<libc::c_void>(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        (info, len)
    };
    if (len as usize) < needed {
        return Err(io::Error::other("TCP_INFO too short"));
    }
    Ok(info)
}

/// How many bytes of `tcp_info` hold the fields up to and including `tcpi_total_retrans`.
pub const UP_TO_TOTAL_RETRANS: usize = std::mem::offset_of!(libc::tcp_info, tcpi_total_retrans) + 4;

/// Bytes in the send queue that the other end has not acknowledged, sent or not (`SIOCOUTQ`).
pub fn unacknowledged(socket: &impl AsRawFd) -> io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: an open socket, and `v` outlives the call.
    #[allow(unsafe_code)]
    let r = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut v) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v.max(0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn bytes_the_other_end_read_are_acknowledged() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(b"keep-alive").unwrap();
        let mut buf = [0u8; 10];
        server.read_exact(&mut buf).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while unacknowledged(&client).unwrap() > 0 {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let info = tcp_info(&client, UP_TO_TOTAL_RETRANS).unwrap();
        assert_eq!(info.tcpi_state, 1, "established");
        assert_eq!(info.tcpi_unacked, 0);
    }
}
