//! A runtime per worker thread, each serving its own client connections.
//!
//! tokio's work-stealing scheduler has one I/O driver for all its threads: one thread waits
//! in `epoll_wait` while the others sleep until it hands them tasks, so two threads do not
//! serve twice the connections (on two cores shared with the load, the machine stayed 4–10 %
//! idle where HAProxy's threads kept it busy: docs/PERFORMANCE.md). Here every worker thread
//! runs a single-threaded runtime of its own — its own `epoll` set, timers and run queue —
//! and a client connection lives on one of them from accept to close, as in HAProxy's or
//! nginx's event loops. The main thread's runtime accepts, keeps the proxy's own tasks (the
//! registrars, the status listener, reloads) and serves its share of connections too.
//!
//! A connection to a PE is used by the runtime that opened it (its readiness comes from that
//! runtime's reactor): the PE connection sets keep one slot per worker ([`index`]).

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::sync::OnceLock;
use tokio::runtime::Handle;

/// The extra workers' runtimes (the main thread's is not among them).
static WORKERS: OnceLock<Vec<Handle>> = OnceLock::new();

thread_local! {
    /// This thread's worker: 0 for the main thread and for any thread not started here.
    static INDEX: Cell<usize> = const { Cell::new(0) };
    /// The worker the next connection accepted on this thread goes to.
    static NEXT: Cell<usize> = const { Cell::new(0) };
}

/// Starts `extra` worker threads beside the main one, once per process, before the proxy
/// starts (the PE connection sets are sized by [`count`] when made).
pub fn start(extra: usize) -> io::Result<()> {
    if extra == 0 || WORKERS.get().is_some() {
        return Ok(());
    }
    let mut handles = Vec::with_capacity(extra);
    for i in 1..=extra {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("worker-{i}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let rt = match rt {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                INDEX.set(i);
                let _ = tx.send(Ok(rt.handle().clone()));
                // Serves what is spawned on it for the process's life.
                rt.block_on(std::future::pending::<()>());
            })?;
        let handle = rx
            .recv()
            .map_err(|_| io::Error::other("a worker thread ended before it started"))??;
        handles.push(handle);
    }
    WORKERS
        .set(handles)
        .map_err(|_| io::Error::other("the worker threads were started twice"))
}

/// Worker threads in all, the main one included (1 without [`start`]).
pub(crate) fn count() -> usize {
    WORKERS.get().map_or(1, |w| w.len() + 1)
}

/// This thread's worker, below [`count`].
pub(crate) fn index() -> usize {
    INDEX.get()
}

/// Spawns a client connection's task on the next worker in turn, this thread's among them
/// (on the current runtime when there are no workers).
pub(crate) fn spawn<F>(task: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let Some(workers) = WORKERS.get() else {
        tokio::spawn(task);
        return;
    };
    let n = NEXT.get();
    NEXT.set((n + 1) % (workers.len() + 1));
    match n.checked_sub(1).and_then(|i| workers.get(i)) {
        Some(w) => drop(w.spawn(task)),
        None => drop(tokio::spawn(task)),
    }
}

/// Per-worker slots of `T` (a PE's connections, say): each thread uses its own.
#[derive(Debug)]
pub(crate) struct PerWorker<T>(Box<[T]>);

impl<T: Default> Default for PerWorker<T> {
    fn default() -> Self {
        Self((0..count()).map(|_| T::default()).collect())
    }
}

impl<T> PerWorker<T> {
    /// This thread's slot.
    pub(crate) fn here(&self) -> &T {
        let i = index().min(self.0.len().saturating_sub(1));
        &self.0[i]
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &T> {
        self.0.iter()
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}
