//! Connections kept for reuse, per pool element, whatever protocol they carry.
//!
//! Reusing a connection saves a connect (and its round trip) per request. The PE's state
//! (`Backend`, in the `backend` module) owns one [`Conns`] each, so that sets of different
//! PEs never share a lock and an ejected or departed PE can drop its own at once. What a set
//! holds is the business of the protocol that speaks to the PE (kept-alive HTTP/1.1
//! connections in an [`IdlePool`], multiplexed HTTP/2 connections): balancing names none.

use crate::workers::PerWorker;
use std::any::Any;
use std::fmt::Debug;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The idle connections to one PE, newest last, kept apart per worker thread (a connection
/// is used by the runtime that opened it: `crate::workers`).
#[derive(Debug)]
pub(crate) struct IdlePool<C> {
    idle: PerWorker<Mutex<Vec<(Instant, C)>>>,
    /// Set when the PE left the pool: nothing is kept any more.
    closed: AtomicBool,
}

impl<C> IdlePool<C> {
    pub(crate) fn new() -> Self {
        Self {
            idle: PerWorker::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// This worker's idle connections.
    fn lock(&self) -> MutexGuard<'_, Vec<(Instant, C)>> {
        self.idle.here().lock().unwrap_or_else(|p| p.into_inner())
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

    /// Keeps a connection, unless `max` are kept already (this worker's share of them) or the
    /// set is closed.
    pub(crate) fn put(&self, conn: C, max: usize) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let max = max.div_ceil(self.idle.len());
        let mut idle = self.lock();
        if idle.len() < max {
            idle.push((Instant::now(), conn));
        }
    }

    /// Drops every idle connection.
    pub(crate) fn clear(&self) {
        for idle in self.idle.all() {
            idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Drops every idle connection and keeps none from now on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.clear();
    }
}

/// A set of connections to one PE, as the PE's state sees it.
pub(crate) trait ConnSet: Any + Send + Sync + Debug {
    /// The PE closed a connection or failed: drops the idle ones, which may be as stale.
    fn drop_idle(&self);
    /// The PE left the pool: drops every connection and keeps none from now on.
    fn close(&self);
}

impl<C: Debug + Send + 'static> ConnSet for IdlePool<C> {
    fn drop_idle(&self) {
        self.clear();
    }
    fn close(&self) {
        IdlePool::close(self);
    }
}

impl<C> Default for IdlePool<C> {
    fn default() -> Self {
        Self::new()
    }
}

/// A PE's connection sets, one per kind asked for (a pool's protocol may change on a reload).
#[derive(Debug, Default)]
pub(crate) struct Conns {
    kinds: [OnceLock<Box<dyn ConnSet>>; 2],
}

impl Conns {
    /// The set of kind `T`, made on first use; `None` only if more kinds than there are slots
    /// were asked for (then the caller connects afresh).
    pub(crate) fn of<T: ConnSet + Default>(&self) -> Option<&T> {
        self.kinds.iter().find_map(|slot| {
            let set: &dyn Any = slot.get_or_init(|| Box::new(T::default())).as_ref();
            set.downcast_ref::<T>()
        })
    }

    /// See [`ConnSet::drop_idle`].
    pub(crate) fn drop_idle(&self) {
        self.kinds
            .iter()
            .filter_map(OnceLock::get)
            .for_each(|s| s.drop_idle());
    }

    /// See [`ConnSet::close`].
    pub(crate) fn close(&self) {
        self.kinds
            .iter()
            .filter_map(OnceLock::get)
            .for_each(|s| s.close());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct Other(std::sync::atomic::AtomicBool);
    impl ConnSet for Other {
        fn drop_idle(&self) {}
        fn close(&self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    #[test]
    fn each_kind_has_its_own_set_and_closing_reaches_all() {
        let c = Conns::default();
        let idle = || c.of::<IdlePool<u32>>().unwrap();
        idle().put(7, 4);
        assert!(c.of::<Other>().is_some());
        assert_eq!(
            c.of::<IdlePool<u32>>()
                .and_then(|p| p.take(Duration::from_secs(1))),
            Some(7)
        );
        idle().put(8, 4);
        c.close();
        assert!(c.of::<Other>().is_some_and(|o| o.0.load(Ordering::Relaxed)));
        assert_eq!(
            c.of::<IdlePool<u32>>()
                .and_then(|p| p.take(Duration::from_secs(1))),
            None
        );
        // A third kind finds no slot.
        assert!(c.of::<IdlePool<u64>>().is_none());
    }
}
