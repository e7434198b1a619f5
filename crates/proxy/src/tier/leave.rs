//! A member leaving the tier on purpose (its proxy stops: SIGTERM). It deregisters from the
//! tier pool and stops answering the distributor's heartbeats, so the distributor takes it out
//! of the router's group as it takes out a dead member — at once, as it left the pool and does
//! not answer the heartbeat sent out of turn — while the member still accepts and serves what
//! the router sends it meanwhile. Its listeners close only once the heartbeats have stopped
//! coming (the distributor forgot it: no new connection comes any more). Closing them first,
//! with the member still in the group, refused every new connection the router sent it until
//! its drain ended. Its tier listener and heartbeat socket close then too, and it links to no
//! new member, so that a proxy started in its place at once (a restart) binds the same
//! addresses while this one drains (it waits for them meanwhile, see `listener::when_free`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Whether the member is leaving, and when heartbeats came.
#[derive(Default)]
pub(crate) struct Leaving {
    on: AtomicBool,
    beats: Mutex<Beats>,
}

#[derive(Default)]
struct Beats {
    last: Option<Instant>,
    /// The usual time between two heartbeats (a moving average).
    interval: Duration,
}

/// Heartbeats are taken as stopped after this many usual intervals without one.
const STOPPED_AFTER: u32 = 3;
/// ... and at least this long.
const STOPPED_AT_LEAST: Duration = Duration::from_millis(100);

impl Leaving {
    /// A heartbeat came: whether to answer it (not once leaving).
    pub(crate) fn heartbeat(&self) -> bool {
        let now = Instant::now();
        let mut b = self.beats.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = b.last {
            let gap = now.saturating_duration_since(last);
            b.interval = if b.interval.is_zero() {
                gap
            } else {
                (b.interval * 3 + gap) / 4
            };
        }
        b.last = Some(now);
        !self.on()
    }

    /// Whether the member is leaving.
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// Waits until the heartbeats have stopped (none for three usual intervals), at most
    /// `limit`; whether they stopped. A member that never got one (no distributor) waits not.
    pub(crate) async fn heartbeats_stopped(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let quiet_at = {
                let b = self.beats.lock().unwrap_or_else(|p| p.into_inner());
                let Some(last) = b.last else { return true };
                last + (b.interval * STOPPED_AFTER).max(STOPPED_AT_LEAST)
            };
            let now = Instant::now();
            if now >= quiet_at {
                return true;
            }
            if now >= deadline {
                return false;
            }
            tokio::time::sleep(quiet_at.min(deadline) - now).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn heartbeats_stop_three_intervals_after_the_last() {
        let l = Leaving::default();
        assert!(
            l.heartbeats_stopped(Duration::ZERO).await,
            "no distributor: no wait"
        );
        for _ in 0..3 {
            assert!(l.heartbeat());
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        l.start();
        assert!(!l.heartbeat(), "not answered once leaving");
        let t = Instant::now();
        assert!(l.heartbeats_stopped(Duration::from_secs(2)).await);
        assert!(t.elapsed() >= Duration::from_millis(100));
        // Still coming: not stopped within the limit.
        l.heartbeat();
        let beating = async {
            loop {
                l.heartbeat();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            stopped = l.heartbeats_stopped(Duration::from_millis(300)) => assert!(!stopped),
            () = beating => {}
        }
    }
}
