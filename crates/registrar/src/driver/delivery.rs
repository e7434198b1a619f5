//! Whether bytes written to a connection may still be on their way, from the kernel's TCP
//! state (`SIOCOUTQ` and `TCP_INFO`, tcp(7)).
//!
//! A keep-alive that times out over a lossy path has often not reached the PE at all: TCP is
//! still retransmitting it, with a timer that doubles each time. Taking the PE for gone then
//! removes a live PE from its pool; the core waits a little longer instead
//! ([`Registrar::handle_delivery`](crate::core::Registrar::handle_delivery)).

use std::os::fd::AsRawFd;

/// Looks at one connection's TCP state; remembers its retransmissions between looks. (Tested
/// end to end with packet loss: `crates/rserpool/tests/lossy.rs`.)
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
        let Ok(info) = rserpool_tcpinfo::tcp_info(socket, rserpool_tcpinfo::UP_TO_TOTAL_RETRANS)
        else {
            return false;
        };
        let lately = info.tcpi_total_retrans > self.retransmissions_seen;
        self.retransmissions_seen = info.tcpi_total_retrans;
        lately
            || info.tcpi_retransmits > 0
            || rserpool_tcpinfo::unacknowledged(socket).is_ok_and(|n| n > 0)
    }
}
