//! The access log: one line per HTTP request or TCP connection, written off the request path.
//!
//! A write to a file can block, which must not hold up a connection's task, so lines go
//! through a channel to a thread of their own, which writes whatever has queued up and flushes
//! once. The channel is bounded: a file that does not keep up (a full or hung disk, a pipe
//! nobody reads) loses lines, counted and warned about once, instead of holding every line
//! in memory until the proxy runs out of it.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Lines waiting for the writer at most (about 10 MB of lines of 150 bytes).
const QUEUE_LINES: usize = 65_536;

/// Lines dropped since the process started, across reloads (each opens the log anew).
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Lines the access log dropped because its file did not keep up.
pub(crate) fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// The access log: lines go through a channel to a writer thread.
#[derive(Clone)]
pub(crate) struct AccessLog {
    tx: std::sync::mpsc::SyncSender<String>,
    /// Whether this log said that it drops lines.
    warned: Arc<AtomicBool>,
}

impl AccessLog {
    pub(crate) fn open(path: &std::path::Path) -> std::io::Result<Self> {
        use std::os::unix::fs::FileTypeExt;
        let name = path.display().to_string();
        if path.as_os_str() == "-" {
            return Self::to_writer(|| Ok(Box::new(std::io::stdout())), name, QUEUE_LINES);
        }
        let append = |p: &std::path::Path| -> std::io::Result<Box<dyn Write + Send>> {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?;
            Ok(Box::new(f))
        };
        if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
            // Opening a FIFO for writing waits for a reader: the writer thread does, and lines
            // queue meanwhile (the proxy starts, serves, and stops when told to).
            let p = path.to_owned();
            return Self::to_writer(move || append(&p), name, QUEUE_LINES);
        }
        let f = append(path)?;
        Self::to_writer(move || Ok(f), name, QUEUE_LINES)
    }

    /// A log writing to what `open` opens (named `name` in warnings), up to `queue` lines
    /// waiting.
    fn to_writer(
        open: impl FnOnce() -> std::io::Result<Box<dyn Write + Send>> + Send + 'static,
        name: String,
        queue: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(queue);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let out = match open() {
                    Ok(o) => o,
                    Err(e) => {
                        return tracing::warn!("proxy: access log {name}: {e}; no access log");
                    }
                };
                let mut w = std::io::BufWriter::new(out);
                let mut failed = false;
                while let Ok(line) = rx.recv() {
                    let mut r = writeln!(w, "{line}");
                    while let Ok(line) = rx.try_recv() {
                        r = r.and_then(|()| writeln!(w, "{line}"));
                    }
                    match r.and_then(|()| w.flush()) {
                        Err(e) if !failed => {
                            tracing::warn!("proxy: access log {name}: {e}; lines are lost");
                            failed = true;
                        }
                        Err(_) => {}
                        Ok(()) if failed => {
                            tracing::info!("proxy: access log {name}: written again");
                            failed = false;
                        }
                        Ok(()) => {}
                    }
                }
            })?;
        Ok(Self {
            tx,
            warned: Arc::default(),
        })
    }

    pub(crate) fn write(&self, line: String) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let line = format!("{}.{:03} {line}", now.as_secs(), now.subsec_millis());
        if let Err(std::sync::mpsc::TrySendError::Full(_)) = self.tx.try_send(line) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "proxy: the access log does not keep up ({QUEUE_LINES} lines waiting): \
                     lines are dropped, counted in rserpool_proxy_access_log_dropped_lines_total"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// A file that takes nothing until it is opened, then keeps what it is given.
    #[derive(Clone, Default)]
    struct Gate {
        open: Arc<AtomicBool>,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Gate {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            while !self.open.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(5));
            }
            self.got.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A FIFO with no reader yet: opening it for writing would wait for one, and the proxy
    /// hung at start, before its listeners, deaf to SIGTERM (found by a user). The log opens
    /// at once; lines reach the reader once there is one.
    #[test]
    fn a_fifo_without_a_reader_does_not_hold_up_the_start() {
        let dir = std::env::temp_dir().join(format!("rserpool-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("access.log");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let t = Instant::now();
        let log = AccessLog::open(&fifo).unwrap();
        log.write("first".into());
        assert!(t.elapsed() < Duration::from_secs(1), "waited for a reader");
        let mut reader = std::io::BufReader::new(std::fs::File::open(&fifo).unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
        assert!(line.ends_with(" first\n"), "{line:?}");
        drop(log);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_file_that_does_not_keep_up_loses_lines_instead_of_holding_them() {
        let gate = Gate::default();
        let g = gate.clone();
        let log = AccessLog::to_writer(move || Ok(Box::new(g)), "gate".into(), 100).unwrap();
        let before = dropped();
        let t = Instant::now();
        for i in 0..10_000 {
            log.write(format!("line {i}"));
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "writing lines waited for the file"
        );
        // The writer holds at most one batch; the channel at most 100 lines.
        let lost = dropped() - before;
        assert!(
            (9_000..10_000).contains(&lost),
            "{lost} of 10,000 lines dropped with a queue of 100"
        );
        gate.open.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(5);
        let lines = loop {
            let n = gate
                .got
                .lock()
                .unwrap()
                .iter()
                .filter(|&&c| c == b'\n')
                .count();
            if n as u64 + lost == 10_000 || Instant::now() > deadline {
                break n;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(lines as u64 + lost, 10_000, "every line written or counted");
        // Once it keeps up again, lines go through.
        log.write("after".into());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !String::from_utf8_lossy(&gate.got.lock().unwrap()).contains(" after\n") {
            assert!(Instant::now() < deadline, "a line after the jam was lost");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
