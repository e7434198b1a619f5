//! A raw-socket watch for connection attempts: the failover run's view from outside every
//! proxy, independent of what the proxy's own counters say.

use anyhow::{Context, Result, anyhow};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Timestamps of connection attempts (SYN without ACK) to 127.0.0.1:`port`, from a raw
/// socket whose BPF filter passes nothing else (so a loaded loopback costs it nothing).
pub(super) struct SynWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<std::io::Result<Vec<Instant>>>>,
}

pub(super) fn raw_socket() -> Result<socket2::Socket> {
    use socket2::{Domain, Protocol, Socket, Type};
    Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::TCP))
        .context("the failover run needs a raw socket (run as root, or leave out --parts failover)")
}

impl SynWatch {
    pub(super) fn start(port: u16) -> Result<SynWatch> {
        let s = raw_socket()?;
        s.attach_filter(&syn_filter(port))?;
        s.set_read_timeout(Some(Duration::from_millis(20)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::spawn(move || {
            use std::io::Read;
            let mut seen = Vec::new();
            let mut buf = [0u8; 128];
            while !st.load(Ordering::Relaxed) {
                match (&s).read(&mut buf) {
                    Ok(_) => seen.push(Instant::now()),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(seen)
        });
        Ok(SynWatch {
            stop,
            thread: Some(thread),
        })
    }

    pub(super) fn finish(mut self) -> Result<Vec<Instant>> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self
            .thread
            .take()
            .ok_or_else(|| anyhow!("finished twice"))?;
        thread
            .join()
            .map_err(|_| anyhow!("the SYN watcher panicked"))?
            .context("reading the raw socket")
    }
}

impl Drop for SynWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Classic BPF over an IPv4 packet: destination 127.0.0.1, TCP destination `port`, flags
/// SYN without ACK.
fn syn_filter(port: u16) -> Vec<libc::sock_filter> {
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    vec![
        op(0x20, 0, 0, 16),              // ld [16]          (IP destination)
        op(0x15, 0, 7, 0x7f00_0001),     // jeq 127.0.0.1
        op(0xb1, 0, 0, 0),               // ldxb 4*([0]&0xf) (IP header length)
        op(0x48, 0, 0, 2),               // ldh [x+2]        (TCP destination port)
        op(0x15, 0, 4, u32::from(port)), // jeq port
        op(0x50, 0, 0, 13),              // ldb [x+13]       (TCP flags)
        op(0x54, 0, 0, 0x12),            // and SYN|ACK
        op(0x15, 0, 1, 0x02),            // jeq SYN
        op(0x06, 0, 0, 0xffff),          // accept
        op(0x06, 0, 0, 0),               // drop
    ]
}
