//! Loopback addresses for the processes a benchmark starts, and a registrar's status as the
//! benchmarks read it to know when a setup is complete.

use anyhow::Result;
use std::net::{Ipv4Addr, SocketAddr};

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(rserpool::util::free_port()?)
}

/// 127.0.0.1:`port`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// A registrar's status, read synchronously from its status listener.
pub fn registrar_status(status: SocketAddr) -> Result<rserpool_registrar::Status> {
    rserpool::util::runtime()?.block_on(fetch_registrar_status(status))
}

/// A registrar's status from its status listener.
pub async fn fetch_registrar_status(status: SocketAddr) -> Result<rserpool_registrar::Status> {
    rserpool::util::registrar_status(&[status]).await
}
