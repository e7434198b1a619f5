//! The tokio side of [credits](crate::credits): a task samples a pool element's metric every
//! few milliseconds — the accept queue of its listening socket ([`crate::metric`]) and the work
//! in flight that the service counts with [`InFlight`], or for a sidecar the accept queue and
//! established connections of the target's port — and re-registers with the credits the
//! reporter lets through (policy [`Policy::Credits`]).
//!
//! An application with a figure of its own (a queue of jobs, say) counts it with
//! [`InFlight::set`] instead of the guards.

use crate::PeUpdater;
use crate::core::Instant;
use crate::credits::{CreditConfig, CreditReporter, Metric};
use crate::metric::listen_queue;
use crate::port_sampler::PortSampler;
use rserpool_wire::Policy;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use tracing::{debug, warn};

/// The work in flight at a pool element: connections or requests being served.
#[derive(Clone, Debug, Default)]
pub struct InFlight(Arc<AtomicU32>);

impl InFlight {
    pub fn new() -> Self {
        Self::default()
    }

    /// One more piece of work, until the guard is dropped.
    pub fn enter(&self) -> InFlightGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        InFlightGuard(self.0.clone())
    }

    /// Sets the figure directly (for an application that counts its own work).
    pub fn set(&self, n: u32) {
        self.0.store(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counts one piece of work in flight while it lives.
#[derive(Debug)]
pub struct InFlightGuard(Arc<AtomicU32>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        // Never below zero, even if `set` lowered the figure meanwhile.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
    }
}

/// Where the accept queue comes from.
#[derive(Debug)]
pub enum MetricSource {
    /// The service's own listening socket (a duplicate is fine); the work in flight is what
    /// the service counts in [`CreditSource::in_flight`].
    Listener(OwnedFd),
    /// Another process's listening port (a sidecar's target): its accept queue, and its
    /// established connections as the work in flight.
    Port(Box<PortSampler>),
    /// No socket: only the work counted in [`CreditSource::in_flight`].
    InFlightOnly,
}

/// The credits of the latest sample (reported or not), for whoever else wants them (HAProxy's
/// agent-check in `serve`).
#[derive(Clone, Debug)]
pub struct CreditGauge {
    credits: Arc<AtomicU32>,
    capacity: u32,
    reports: Arc<AtomicU64>,
}

impl CreditGauge {
    pub fn credits(&self) -> u32 {
        self.credits.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Credit reports sent so far (re-registrations).
    pub fn reports(&self) -> u64 {
        self.reports.load(Ordering::Relaxed)
    }
}

/// A running credit source; dropping it stops the sampling.
pub struct CreditSource {
    in_flight: InFlight,
    reports: Arc<AtomicU64>,
    gauge: CreditGauge,
    task: tokio::task::JoinHandle<()>,
}

impl CreditSource {
    /// Starts sampling every `period` on the current tokio runtime.
    pub fn start(
        updater: PeUpdater,
        source: MetricSource,
        cfg: CreditConfig,
        period: Duration,
    ) -> Self {
        let in_flight = InFlight::new();
        let reports = Arc::new(AtomicU64::new(0));
        let gauge = CreditGauge {
            credits: Arc::new(AtomicU32::new(cfg.capacity)),
            capacity: cfg.capacity,
            reports: reports.clone(),
        };
        let task = tokio::spawn(sample_task(
            updater,
            source,
            cfg,
            period.max(Duration::from_millis(1)),
            in_flight.clone(),
            reports.clone(),
            gauge.credits.clone(),
        ));
        Self {
            in_flight,
            reports,
            gauge,
            task,
        }
    }

    /// The credits of the latest sample.
    pub fn gauge(&self) -> CreditGauge {
        self.gauge.clone()
    }

    /// The counter the service keeps its work in flight in.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }

    /// Credit reports sent so far (re-registrations).
    pub fn reports(&self) -> u64 {
        self.reports.load(Ordering::Relaxed)
    }
}

impl Drop for CreditSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn sample_task(
    updater: PeUpdater,
    mut source: MetricSource,
    cfg: CreditConfig,
    period: Duration,
    in_flight: InFlight,
    reports: Arc<AtomicU64>,
    latest: Arc<AtomicU32>,
) {
    let start = tokio::time::Instant::now();
    let now = || Instant::from_millis(start.elapsed().as_millis() as u64);
    let mut reporter = CreditReporter::new(cfg);
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut warned = false;
    let send = |c: u32| {
        updater.update_policy(Policy::Credits {
            credits: c,
            capacity: cfg.capacity,
        });
        reports.fetch_add(1, Ordering::Relaxed);
        debug!("credits: {c} of {}", cfg.capacity);
    };
    loop {
        ticker.tick().await;
        let t = now();
        if let Some(c) = reporter.handle_timeout(t) {
            send(c);
        }
        let counted = in_flight.get();
        let sampled = match &mut source {
            MetricSource::Listener(fd) => listen_queue(fd.as_fd()).map(|q| Metric {
                accept_queue: q.waiting,
                in_flight: counted,
            }),
            MetricSource::Port(sampler) => sampler.sample().map(|l| {
                let l = l.unwrap_or_default();
                Metric {
                    accept_queue: l.backlog,
                    in_flight: l.established.max(counted),
                }
            }),
            MetricSource::InFlightOnly => Ok(Metric {
                accept_queue: 0,
                in_flight: counted,
            }),
        };
        let m = sampled.unwrap_or_else(|e| {
            if !warned {
                warn!("credits: cannot read the accept queue ({e}): counting work in flight only");
                warned = true;
            }
            Metric {
                accept_queue: 0,
                in_flight: counted,
            }
        });
        latest.store(crate::credits::credits(cfg.capacity, m), Ordering::Relaxed);
        if let Some(c) = reporter.sample(m, t) {
            send(c);
        }
    }
}
