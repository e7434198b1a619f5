//! The registrar's Component Status reports (`rserpool_wire::csp`) to an rsplib monitor
//! (`--csp ADDR`): every `csp-interval-ms`, from the event loop, what rsplib's registrar says of
//! itself — its PEs (those it is home for in brackets), pools and peers, and an association
//! per ENRP peer — so that `cspmonitor` lists it beside rsplib's registrars.

use crate::core::Instant;
use crate::status::MetricsView;
use rserpool_wire::csp::{Association, Component, PPID_ENRP, PROTOCOL_TCP, Report};
use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use tracing::{info, warn};

pub(super) struct CspReporter {
    socket: UdpSocket,
    monitor: SocketAddr,
    interval: Duration,
    location: String,
    /// When the first report went (uptime counts from it, as rsplib's does).
    first: Option<Instant>,
    next: Instant,
    failed: bool,
}

impl CspReporter {
    pub(super) fn new(
        monitor: SocketAddr,
        interval: Duration,
        asap: SocketAddr,
        now: Instant,
    ) -> std::io::Result<Self> {
        let socket = UdpSocket::bind(rserpool_wire::csp::local_for(monitor))?;
        socket.set_nonblocking(true)?;
        info!("registrar: component status reports to {monitor} every {interval:?}");
        Ok(Self {
            socket,
            monitor,
            interval: interval.max(Duration::from_millis(100)),
            location: rserpool_wire::csp::location(&rserpool_wire::csp::host_name(), &[asap]),
            first: None,
            next: now,
            failed: false,
        })
    }

    /// When the next report is due.
    pub(super) fn next(&self) -> Instant {
        self.next
    }

    /// Sends a report of `view` if one is due (`last`: the registrar stops; always sent).
    pub(super) fn report(&mut self, view: &MetricsView, now: Instant, last: bool) {
        if now < self.next && !last {
            return;
        }
        self.next = now + self.interval;
        let first = *self.first.get_or_insert(now);
        let pes: usize = view.pool_sizes.iter().map(|(_, n)| n).sum();
        let pools = view.pool_sizes.len();
        let peers = view.peers.len();
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let sender = Component::Registrar.id(u64::from(view.server_id));
        let uptime_us = now.saturating_duration_since(first).as_micros() as u64;
        let interval_us = self.interval.as_micros().min(u128::from(u32::MAX)) as u32;
        let report = if last {
            Report::last(sender, uptime_us, interval_us)
        } else {
            Report {
                sender,
                uptime_us,
                interval_us,
                location: self.location.clone(),
                status: format!(
                    "{pes}[{}] PEs in {pools} Pool{}, {peers} Peer{}",
                    view.home_pes,
                    plural(pools),
                    plural(peers)
                ),
                workload: None,
                associations: view
                    .peers
                    .iter()
                    .filter(|p| p.connected)
                    .map(|p| Association {
                        peer: Component::Registrar.id(u64::from(p.id)),
                        duration_us: None,
                        protocol: PROTOCOL_TCP,
                        ppid: PPID_ENRP,
                    })
                    .collect(),
                last: false,
            }
        };
        match self.socket.send_to(&report.encode(), self.monitor) {
            Ok(_) => self.failed = false,
            Err(e) if !self.failed => {
                // Once per run of failures: a monitor that is not there yet is no error.
                warn!(
                    "registrar: component status report to {}: {e}",
                    self.monitor
                );
                self.failed = true;
            }
            Err(_) => {}
        }
    }
}
