//! The failover loop, one for every mode: a request (HTTP) or a connection (TCP, and HTTP
//! routes that pin theirs) is admitted at its pool, given a PE by the pool's policy, and
//! connected there; a PE that cannot be reached is reported to the registrar (ASAP
//! ENDPOINT_UNREACHABLE, RFC 5352 §3.5), left out, and the next one tried, until one answers
//! or the [`FailoverPolicy`] says to stop.
//!
//! Overload is not death. A connect refused, reset or unreachable means the PE is down: it is
//! reported and ejected (within the pool's ejection cap). A connect that times out means its
//! accept queue is full: it is busy, gets no new work for a while, and is neither reported nor
//! ejected, so that a burst does not eject the PEs one after the other and take the pool down.
//! When every PE was tried and some were only busy, the request goes to them again (within
//! the policy's tries): their queues drain while a connect waits, as HAProxy's `retries`
//! find a server again after its connect timed out. What happens after the connection (relaying,
//! whether a request that failed there may go out again) is the mode's own, but it records
//! what it did in the same [`Failover`], so the policy's limits hold across both.

use crate::balance::admit::NoPick;
use crate::balance::backend::Backend;
use crate::balance::pools::{Pool, Pools, RetryPermit};
use crate::balance::select::Affinity;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// When a request or connection stops moving on to other PEs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FailoverPolicy {
    /// PEs selected at most for one request or connection (connect failures and resends).
    pub(crate) max_tries: u32,
}

impl Default for FailoverPolicy {
    fn default() -> Self {
        Self { max_tries: 8 }
    }
}

/// What a request or connection has been through on its way to a PE.
#[derive(Default)]
pub(crate) struct Failover {
    policy: FailoverPolicy,
    /// PEs that failed it; they are not selected again (while others are left).
    tried: Vec<u32>,
    /// Of those, the ones that were only busy (their connect timed out): once every PE was
    /// tried, they are tried again, as their queues drain.
    busy: Vec<u32>,
    /// Selections so far.
    attempts: u32,
    /// The request went out again after a PE closed without answering.
    resent: bool,
    /// Its place in the pool's retry budget, once it is sent again; held until it ends.
    retry: Option<RetryPermit>,
    /// Its key for a hashing selection, and the PE its sticky cookie names.
    affinity: Affinity,
    /// How long to wait before the next attempt (a retry's jittered back-off).
    back_off: Option<std::time::Duration>,
}

/// Why no PE took a request or connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GiveUp {
    /// PEs were tried and none could be reached.
    NoneAnswered,
    /// None was picked (no PE, or none had room within the queue timeout).
    NoPick(NoPick),
}

impl GiveUp {
    /// The HTTP status and text for a client.
    pub(crate) fn answer(self) -> (u16, &'static str) {
        match self {
            Self::NoneAnswered => (502, "no pool element answered"),
            Self::NoPick(why) => (503, why.text()),
        }
    }
}

/// The PE one attempt went to, connected.
pub(crate) struct Attempt {
    pub(crate) pool: Arc<Pool>,
    pub(crate) pe: Arc<Backend>,
    /// The connection was kept alive from an earlier request.
    pub(crate) reused: bool,
    /// Requests in flight at the PE before this one.
    pub(crate) rif: u64,
    /// When the PE was picked (before the connect) and when the connection was ready.
    pub(crate) asked: Instant,
    pub(crate) sent: Instant,
    /// The pool's per-try timeout (`try-timeout-ms`), if it has one.
    pub(crate) try_timeout: Option<Duration>,
}

impl Attempt {
    /// How long this try waits for the PE's answer to begin: the per-try timeout, at most
    /// the request's.
    pub(crate) fn head_timeout(&self, request: Duration) -> Duration {
        self.try_timeout.map_or(request, |t| t.min(request))
    }

    /// Whether a timeout of this try was the per-try one (shorter than the request's).
    pub(crate) fn timed_out_early(&self, request: Duration) -> bool {
        self.try_timeout.is_some_and(|t| t < request)
    }
}

impl Failover {
    pub(crate) fn new(policy: FailoverPolicy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// With what ties it to a PE: the key a hashing selection (`maglev`, `ring-hash`) sends
    /// it by, the PE its sticky cookie names.
    pub(crate) fn tied(mut self, affinity: Affinity) -> Self {
        self.affinity = affinity;
        self
    }

    /// A PE and a connection to it (`connect`: a kept-alive one and whether it was, or a new
    /// one). A PE that cannot be reached is reported and the next one tried.
    pub(crate) async fn attempt<C, F>(
        &mut self,
        pool: &Arc<Pool>,
        pools: &Pools,
        level: usize,
        connect: impl Fn(Arc<Backend>) -> F,
    ) -> Result<(Attempt, C), GiveUp>
    where
        F: Future<Output = io::Result<(C, bool)>>,
    {
        loop {
            if self.attempts >= self.policy.max_tries {
                return Err(GiveUp::NoneAnswered);
            }
            self.attempts += 1;
            let pe = match pool.admit_keyed(level, &self.tried, self.affinity).await {
                Ok(pe) => pe,
                Err(NoPick::NoPe) if !self.busy.is_empty() => {
                    // Every PE left was tried, and some were only busy: to them again (within
                    // the policy's tries), as HAProxy retries a server whose connect timed out.
                    self.tried.retain(|id| !self.busy.contains(id));
                    self.busy.clear();
                    self.attempts -= 1;
                    continue;
                }
                Err(NoPick::NoPe) if !self.tried.is_empty() => return Err(GiveUp::NoneAnswered),
                Err(why) => return Err(GiveUp::NoPick(why)),
            };
            let asked = Instant::now();
            let conn = connect(pe.clone()).await;
            let rif = conn.as_ref().ok().map(|_| pe.start());
            pe.pick_done();
            match conn {
                Ok((conn, reused)) => {
                    let attempt = Attempt {
                        try_timeout: pool.try_timeout(),
                        pool: pool.clone(),
                        pe,
                        reused,
                        rif: rif.unwrap_or(0),
                        asked,
                        sent: Instant::now(),
                    };
                    return Ok((attempt, conn));
                }
                // A connect that times out meets a full accept queue (SYNs dropped): the PE
                // is busy, not dead. It gets no new work for a while and is not reported.
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    debug!("pool {} PE {:#010x}: busy: connect: {e}", pe.pool, pe.id);
                    pools.busy(&pe);
                    self.tried.push(pe.id);
                    self.busy.push(pe.id);
                    pool.released();
                }
                Err(e) => {
                    debug!("pool {} PE {:#010x}: connect: {e}", pe.pool, pe.id);
                    self.unreachable(pools, &pe);
                    pool.released();
                }
            }
        }
    }

    /// The PE failed it before answering: reported, and left out from now on.
    pub(crate) fn unreachable(&mut self, pools: &Pools, pe: &Backend) {
        pools.unreachable(pe);
        self.tried.push(pe.id);
    }

    /// The PE is not tried again for it (it was busy), though it is not reported.
    pub(crate) fn left_out(&mut self, pe: &Backend) {
        self.tried.push(pe.id);
    }

    /// Whether it may go to a PE once more (within the policy's tries).
    pub(crate) fn may_retry(&self) -> bool {
        self.attempts < self.policy.max_tries
    }

    /// Whether it may be sent again after a PE took it and failed: once per request.
    pub(crate) fn may_resend(&mut self) -> bool {
        !std::mem::replace(&mut self.resent, true)
    }

    /// A place in the pool's retry budget for sending it again after a PE took it (which may
    /// have done the work): `false` when the budget is spent. Moving on after a refused or
    /// timed-out connect, or a stale kept-alive connection, is no retry of the work and
    /// needs none.
    pub(crate) fn within_budget(&mut self, pool: &Pool) -> bool {
        if self.retry.is_none() {
            self.retry = pool.retry();
            if self.retry.is_some() {
                let max = Duration::from_millis(pool.config_value(|c| c.retry_backoff_ms));
                self.back_off = Some(jitter(max));
            }
        }
        self.retry.is_some()
    }

    /// Waits out a retry's back-off, if one is due before the next attempt.
    pub(crate) async fn back_off(&mut self) {
        if let Some(d) = self.back_off.take()
            && !d.is_zero()
        {
            tokio::time::sleep(d).await;
        }
    }
}

/// A random time up to `max` (full jitter): enough spread for back-off, no generator to keep.
fn jitter(max: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // The low bits of the clock vary from call to call; scrambled, they spread evenly.
    let x = u64::from(nanos).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    max.mul_f64(x as f64 / f64::from(1u32 << 24))
}
