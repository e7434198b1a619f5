//! Idle connections kept for reuse, one set per pool element.
//!
//! Reusing a kept-alive connection saves a connect (and its round trip) per request. The set
//! knows nothing of what the connections carry: HTTP mode keeps its PE connections here, and
//! the PE's state ([`crate::backend::Backend`]) owns one set each, so that sets of different
//! PEs never share a lock and an ejected or departed PE can drop its own at once.

use std::sync::Mutex;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The idle connections to one PE, newest last.
#[derive(Debug)]
pub(crate) struct IdlePool<C> {
    idle: Mutex<Vec<(Instant, C)>>,
    /// Set when the PE left the pool: nothing is kept any more.
    closed: AtomicBool,
}

impl<C> IdlePool<C> {
    pub(crate) fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(Instant, C)>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The newest connection idle for less than `max_age`; older ones met on the way are
    /// dropped.
    pub(crate) fn take(&self, max_age: Duration) -> Option<C> {
        let mut idle = self.lock();
        while let Some((at, c)) = idle.pop() {
            if at.elapsed() < max_age {
                return Some(c);
            }
        }
        None
    }

    /// Keeps a connection, unless `max` are kept already or the set is closed.
    pub(crate) fn put(&self, conn: C, max: usize) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let mut idle = self.lock();
        if idle.len() < max {
            idle.push((Instant::now(), conn));
        }
    }

    /// Drops every idle connection.
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    /// Drops every idle connection and keeps none from now on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.clear();
    }
}
