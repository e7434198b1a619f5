//! Many seeds at once: every simulation here runs its seeds on a few threads, each taking
//! every n-th seed into a part of its own, which the caller then merges.

/// Runs `one` for seeds `from..from + count` on `threads` threads, into one part per thread;
/// a thread that panicked gives `panicked()` instead.
pub fn on_threads<P: Default + Send>(
    from: u64,
    count: u64,
    threads: usize,
    one: impl Fn(u64, &mut P) + Sync,
    panicked: impl Fn() -> P,
) -> Vec<P> {
    let threads = threads.max(1) as u64;
    let one = &one;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut part = P::default();
                    for seed in (from..from + count).filter(|seed| seed % threads == t) {
                        one(seed, &mut part);
                    }
                    part
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panicked()))
            .collect()
    })
}
