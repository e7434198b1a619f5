//! Sending rsplib's Component Status reports (`rserpool_wire::csp`) from a tokio task: what a
//! pool element of this library and the proxy use to show up in rsplib's `cspmonitor`.

use rserpool_wire::csp::Report;
use std::net::SocketAddr;
use std::time::Duration;
use tracing::warn;

/// Sends the report `next` makes to `monitor` at once and then every `interval` (at least
/// 100 ms), from a task of its own, until one says it is the last. `next` is given the time
/// since the first report and the interval, in µs, as the report carries them. `who` names
/// the sender in the one log line a run of failed sends gets.
pub fn spawn_reports<F>(monitor: SocketAddr, interval: Duration, who: String, mut next: F)
where
    F: FnMut(u64, u32) -> Report + Send + 'static,
{
    let interval = interval.max(Duration::from_millis(100));
    let interval_us = interval.as_micros().min(u128::from(u32::MAX)) as u32;
    tokio::spawn(async move {
        let socket = match tokio::net::UdpSocket::bind(rserpool_wire::csp::local_for(monitor)).await
        {
            Ok(s) => s,
            Err(e) => return warn!("{who}: no component status reports: {e}"),
        };
        let first = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(interval);
        let mut failed = false;
        loop {
            tick.tick().await;
            let report = next(first.elapsed().as_micros() as u64, interval_us);
            match socket.send_to(&report.encode(), monitor).await {
                Ok(_) => failed = false,
                Err(e) if !failed => {
                    // Once per run of failures: a monitor that is not there yet is no error.
                    warn!("{who}: component status report to {monitor}: {e}");
                    failed = true;
                }
                Err(_) => {}
            }
            if report.last {
                return;
            }
        }
    });
}
