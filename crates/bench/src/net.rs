//! Loopback addresses for the processes a benchmark starts, and a registrar's status as the
//! benchmarks read it to know when a setup is complete.

use anyhow::{Result, anyhow};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

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

/// A registrar's status, read synchronously (HTTP GET on its ASAP port).
pub fn registrar_status(addr: SocketAddr) -> Result<rserpool_registrar::Status> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"GET /status HTTP/1.0\r\n\r\n")?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)?;
    let at = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("not an HTTP answer"))?;
    Ok(serde_json::from_slice(&reply[at + 4..])?)
}
