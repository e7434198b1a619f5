//! Whether bytes written to a connection may still be on their way, from the kernel's TCP
//! state (`SIOCOUTQ` and `TCP_INFO`, tcp(7)).
//!
//! A keep-alive that times out over a lossy path has often not reached the PE at all: TCP is
//! still retransmitting it, with a timer that doubles each time. Taking the PE for gone then
//! removes a live PE from its pool; the core waits a little longer instead
//! ([`Registrar::handle_delivery`](crate::core::Registrar::handle_delivery)).

use std::io;
use std::os::fd::AsRawFd;

/// Looks at one connection's TCP state; remembers its retransmissions between looks.
#[derive(Debug, Default)]
pub(super) struct Delivery {
    retransmissions_seen: u32,
}

impl Delivery {
    /// True when what was written to `socket` may not have arrived yet: the other end has not
    /// acknowledged all of it (sent or not: a packet filter that drops it keeps it unsent),
    /// or this end retransmitted since the last look (then the path loses packets, the
    /// answer's way too). False when the state cannot be read.
    pub(super) fn on_its_way(&mut self, socket: &impl AsRawFd) -> bool {
        let Ok(info) = tcp_info(socket) else {
            return false;
        };
        let lately = info.tcpi_total_retrans > self.retransmissions_seen;
        self.retransmissions_seen = info.tcpi_total_retrans;
        lately || info.tcpi_retransmits > 0 || unacknowledged(socket).is_ok_and(|n| n > 0)
    }
}

/// Bytes in the send queue that the other end has not acknowledged (`SIOCOUTQ`).
fn unacknowledged(socket: &impl AsRawFd) -> io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: an open socket, and `v` outlives the call.
    #[allow(unsafe_code)]
    let r = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut v) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v.max(0) as u32)
}

fn tcp_info(socket: &impl AsRawFd) -> io::Result<libc::tcp_info> {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it.
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
    // tcpi_total_retrans is the last field used; kernels since 2.6 fill it.
    if (len as usize) < std::mem::offset_of!(libc::tcp_info, tcpi_total_retrans) + 4 {
        return Err(io::Error::other("TCP_INFO too short"));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes the other end's TCP acknowledged are not "on their way" (the lossy case is
    /// tested end to end with packet loss: tests/lossy_keep_alive.rs).
    #[test]
    fn acknowledged_bytes_are_delivered() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        use std::io::{Read, Write};
        client.write_all(b"keep-alive").unwrap();
        let mut buf = [0u8; 10];
        server.read_exact(&mut buf).unwrap();
        let mut d = Delivery::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while d.on_its_way(&client) {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
