//! The proxy tier's clients in the soak: long downloads and requests on kept-alive connections
//! through the tier's address, from the tier's client namespace ([`super::tier`]). A spliced
//! connection is carried by the kernel, so no proxy can retry anything on it: a download that
//! does not arrive whole and byte-exact, or a request that gets no whole `200`, is a broken
//! connection. Only the connection attempt may be repeated (as any client repeats a SYN or a
//! refused connect), for a few seconds, and those are counted apart.

use super::tier::{FRONT_PORT, VIP};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Concurrent downloads, each of [`DOWNLOAD`] bytes read at about 3 MB/s (about 5 s).
pub(super) const DOWNLOADERS: usize = 4;
pub(super) const DOWNLOAD: usize = 16 << 20;
const PACE: Duration = Duration::from_millis(20);
/// Kept-alive connections, each sending [`PER_CONNECTION`] GETs [`GAP`] apart.
pub(super) const KEEPERS: usize = 2;
const PER_CONNECTION: usize = 100;
const GAP: Duration = Duration::from_millis(50);
/// How long a client keeps trying to connect, and waits for a byte once connected.
const CONNECT_FOR: Duration = Duration::from_secs(10);
const READ_TIMEOUT: Duration = Duration::from_secs(20);
/// Findings kept word for word; the counts have them all.
const KEEP: usize = 50;
/// A client pauses this long after a failure, so that one outage is not counted thousands of
/// times over.
const AFTER_FAILURE: Duration = Duration::from_millis(500);

/// What the tier's clients did.
#[derive(Default)]
pub struct TierTraffic {
    pub downloads: AtomicU64,
    pub bytes: AtomicU64,
    pub broken: AtomicU64,
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    /// Connection attempts repeated before one succeeded.
    pub connects_retried: AtomicU64,
    pub findings: Mutex<Vec<String>>,
}

impl TierTraffic {
    pub fn finding(&self, what: String) {
        let mut v = self.findings.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < KEEP {
            v.push(what);
        }
    }
}

/// What a client needs to say when something broke: the soak's clock and what was going on.
#[derive(Clone)]
pub struct Context {
    pub start: Instant,
    pub now: Arc<dyn Fn() -> String + Send + Sync>,
}

impl Context {
    fn say(&self, what: &str) -> String {
        format!(
            "{what} at {:.1} s, during {}",
            self.start.elapsed().as_secs_f64(),
            (self.now)()
        )
    }
}

/// Starts the clients in namespace `ns`; they run until `stop`.
pub fn start(
    ns: &str,
    cx: Context,
    stop: Arc<AtomicBool>,
    traffic: Arc<TierTraffic>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    for _ in 0..DOWNLOADERS {
        let (cx, stop, t) = (cx.clone(), stop.clone(), traffic.clone());
        threads.push(rserpool_ksplice::testbed::in_ns(ns, move || {
            while !stop.load(Ordering::Relaxed) {
                download(&cx, &stop, &t);
            }
        }));
    }
    for _ in 0..KEEPERS {
        let (cx, stop, t) = (cx.clone(), stop.clone(), traffic.clone());
        threads.push(rserpool_ksplice::testbed::in_ns(ns, move || {
            while !stop.load(Ordering::Relaxed) {
                keep_alive(&cx, &stop, &t);
            }
        }));
    }
    threads
}

/// A connection to the tier, trying for [`CONNECT_FOR`].
fn connect(cx: &Context, t: &TierTraffic) -> Option<TcpStream> {
    let addr = SocketAddr::from((VIP, FRONT_PORT));
    let t0 = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(3)) {
            Ok(s) => {
                s.set_read_timeout(Some(READ_TIMEOUT)).ok()?;
                return Some(s);
            }
            Err(e) if t0.elapsed() >= CONNECT_FOR => {
                t.broken.fetch_add(1, Ordering::Relaxed);
                t.finding(cx.say(&format!("no connection to the tier within 10 s: {e}")));
                std::thread::sleep(AFTER_FAILURE);
                return None;
            }
            Err(_) => {
                t.connects_retried.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// One download of [`DOWNLOAD`] bytes, checked byte for byte (`example http`'s `/bytes/N`).
fn download(cx: &Context, stop: &AtomicBool, t: &TierTraffic) {
    let Some(s) = connect(cx, t) else { return };
    let local = s
        .local_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let mut r = BufReader::new(s);
    let mut last = Instant::now();
    let mut got = 0usize;
    let result = (|| -> std::io::Result<Option<String>> {
        let req =
            format!("GET /bytes/{DOWNLOAD} HTTP/1.1\r\nHost: tier\r\nConnection: close\r\n\r\n");
        r.get_mut().write_all(req.as_bytes())?;
        let len = match head(&mut r)? {
            Ok(len) if len == DOWNLOAD => len,
            Ok(len) => return Ok(Some(format!("a length of {len}"))),
            Err(why) => return Ok(Some(why)),
        };
        let mut buf = vec![0u8; 64 << 10];
        let mut at = 0usize;
        while at < len {
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let n = r.read(&mut buf[..(len - at).min(64 << 10)])?;
            if n == 0 {
                return Ok(Some(format!("closed after {at} of {len} bytes")));
            }
            if let Some(k) = (0..n).find(|&k| buf[k] != ((at + k) % 251) as u8) {
                return Ok(Some(format!("byte {} differs", at + k)));
            }
            at += n;
            got = at;
            last = Instant::now();
            t.bytes.fetch_add(n as u64, Ordering::Relaxed);
            std::thread::sleep(PACE);
        }
        t.downloads.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    })();
    let broken = match result {
        Ok(None) => return,
        Ok(Some(why)) => why,
        Err(e) => e.to_string(),
    };
    t.broken.fetch_add(1, Ordering::Relaxed);
    let quiet = last.elapsed().as_secs_f64();
    t.finding(cx.say(&format!(
        "download from {local} broken after {got} bytes, {quiet:.1} s after the last: {broken}"
    )));
    std::thread::sleep(AFTER_FAILURE);
}

/// One kept-alive connection: [`PER_CONNECTION`] GETs, each answered whole with `200`.
fn keep_alive(cx: &Context, stop: &AtomicBool, t: &TierTraffic) {
    let Some(s) = connect(cx, t) else { return };
    let local = s
        .local_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let mut r = BufReader::new(s);
    for n in 0..PER_CONNECTION {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        t.requests.fetch_add(1, Ordering::Relaxed);
        let answered = (|| -> std::io::Result<Result<(), String>> {
            r.get_mut()
                .write_all(b"GET / HTTP/1.1\r\nHost: tier\r\n\r\n")?;
            let len = match head(&mut r)? {
                Ok(len) => len,
                Err(why) => return Ok(Err(why)),
            };
            let mut body = vec![0u8; len];
            r.read_exact(&mut body)?;
            Ok(Ok(()))
        })();
        let why = match answered {
            Ok(Ok(())) => {
                std::thread::sleep(GAP);
                continue;
            }
            Ok(Err(why)) => why,
            Err(e) => e.to_string(),
        };
        t.failed.fetch_add(1, Ordering::Relaxed);
        t.finding(cx.say(&format!(
            "request {} on kept-alive connection {local} failed: {why}",
            n + 1
        )));
        std::thread::sleep(AFTER_FAILURE);
        return;
    }
}

/// Reads a response's head: `Ok(Ok(length))` for a `200` with a Content-Length, else what
/// came instead.
fn head(r: &mut BufReader<TcpStream>) -> std::io::Result<Result<usize, String>> {
    let mut line = String::new();
    let mut status = None;
    let mut length = None;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Ok(Err("closed before the answer".into()));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if status.is_none() {
            status = Some(l.to_string());
        } else if let Some((name, value)) = l.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse::<usize>().ok();
        }
    }
    let status = status.unwrap_or_default();
    if !status.starts_with("HTTP/1.1 200") {
        return Ok(Err(format!("answered {status:?}")));
    }
    Ok(length.ok_or_else(|| "no Content-Length".to_string()))
}

/// Whether one GET through the tier is answered, from namespace `ns`.
pub fn reachable(ns: &str) -> bool {
    rserpool_ksplice::testbed::in_ns(ns, || {
        let addr = SocketAddr::from((VIP, FRONT_PORT));
        let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
            return false;
        };
        if s.set_read_timeout(Some(Duration::from_secs(2))).is_err() {
            return false;
        }
        let mut r = BufReader::new(s);
        r.get_mut()
            .write_all(b"GET / HTTP/1.1\r\nHost: tier\r\nConnection: close\r\n\r\n")
            .is_ok()
            && head(&mut r).is_ok_and(|h| h.is_ok())
    })
    .join()
    .unwrap_or(false)
}
