//! The access log: one line per HTTP request or TCP connection, written off the request path.
//!
//! A write to a file can block, which must not hold up a connection's task, so lines go
//! through a channel to a thread of their own, which writes whatever has queued up and flushes
//! once.

use std::io::Write;

/// The access log: lines go through a channel to a writer thread.
#[derive(Clone)]
pub(crate) struct AccessLog {
    tx: std::sync::mpsc::Sender<String>,
}

impl AccessLog {
    pub(crate) fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let out: Box<dyn Write + Send> = if path.as_os_str() == "-" {
            Box::new(std::io::stdout())
        } else {
            Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            )
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let mut w = std::io::BufWriter::new(out);
                while let Ok(line) = rx.recv() {
                    let _ = writeln!(w, "{line}");
                    while let Ok(line) = rx.try_recv() {
                        let _ = writeln!(w, "{line}");
                    }
                    let _ = w.flush();
                }
            })?;
        Ok(Self { tx })
    }

    pub(crate) fn write(&self, line: String) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let _ = self.tx.send(format!(
            "{}.{:03} {line}",
            now.as_secs(),
            now.subsec_millis()
        ));
    }
}
