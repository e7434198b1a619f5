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

/// A TCP port on 127.0.0.1 that was free a moment ago, for tests and benchmarks to give the
/// processes they start.
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`), one after the other from a
/// start that depends on the process: the kernel never hands those ports to outgoing
/// connections, and one test process never hands the same port out twice. A port from the
/// ephemeral range (bind to port 0) could be taken by any connection of a test running beside
/// this one before the process it was meant for binds it.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 10_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(FIRST);
    if span >= 1000 {
        let start = std::process::id().wrapping_mul(7919) % span;
        for _ in 0..1000 {
            let port = FIRST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let Ok(port) = u16::try_from(port) else { break };
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
