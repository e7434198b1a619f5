//! Small helpers shared by the subcommands, the benchmarks (crates/bench) and the integration
//! tests.

use anyhow::{Context, Result, bail};
use rserpool_registrar::Status;
use std::net::SocketAddr;

/// The UTC date now: (year, month, day, seconds since midnight).
pub fn utc_now() -> (i64, u32, u32, u64) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, secs % 86_400)
}

/// A single-threaded tokio runtime: every command here is I/O bound and small.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")
}

/// SIGTERM and SIGINT, caught from the moment this is created: before that, such a signal
/// kills the process instead of draining it.
pub struct Shutdown {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Shutdown {
    pub fn watch() -> Result<Shutdown> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Shutdown {
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
        })
    }

    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// A registrar's status from the first of `addrs` (status listeners) that answers.
pub async fn registrar_status(addrs: &[SocketAddr]) -> Result<Status> {
    let mut errors = Vec::new();
    for &addr in addrs {
        match rserpool_status::get(addr, "/status").await {
            Ok((200, body)) => {
                return serde_json::from_slice(&body)
                    .with_context(|| format!("{addr}: not a registrar status"));
            }
            Ok((code, _)) => errors.push(format!("{addr}: HTTP {code}")),
            Err(e) => errors.push(format!("{addr}: {e}")),
        }
    }
    bail!(
        "no registrar status listener answered ({})",
        errors.join("; ")
    )
}

/// A TCP port on 127.0.0.1 that was free a moment ago (someone may take it before it is used).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
