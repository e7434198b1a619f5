//! Small helpers shared by the subcommands and the benchmarks (crates/bench).

use anyhow::{Context, Result};

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
