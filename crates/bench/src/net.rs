//! Loopback addresses for the processes a benchmark starts, and a registrar's status as the
//! benchmarks read it to know when a setup is complete.

use anyhow::{Result, anyhow};
use std::net::{Ipv4Addr, SocketAddr};

/// A TCP port on 127.0.0.1 that was free a moment ago (someone may take it before it is used).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// 127.0.0.1:`port`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// A registrar's status, read synchronously from its status listener.
pub fn registrar_status(status: SocketAddr) -> Result<rserpool_registrar::Status> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(fetch_registrar_status(status))
}

/// A registrar's status from its status listener.
pub async fn fetch_registrar_status(status: SocketAddr) -> Result<rserpool_registrar::Status> {
    match rserpool_status::get(status, "/status").await? {
        (200, body) => Ok(serde_json::from_slice(&body)?),
        (code, _) => Err(anyhow!("status listener {status} answered HTTP {code}")),
    }
}
