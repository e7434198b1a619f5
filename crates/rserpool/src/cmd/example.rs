//! `rserpool example`: small TCP services that register themselves as pool elements through the
//! library, like rsplib's rspserver services. For adaptive policies each reports its load as
//! active connections / capacity whenever a connection opens or closes; with policy `credits`
//! it reports credits from its listening socket's accept queue and its work in flight
//! (requests for `http`, connections for the others).

use crate::{CreditOpts, PeOpts};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use rserpool_asap::level_gate::LevelGate;
use rserpool_asap::share::{Discipline, Domain};
use rserpool_asap::{CreditSource, InFlight, MetricSource, PoolElement};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    /// RFC 862: send back what arrives.
    Echo,
    /// RFC 863: read and drop.
    Discard,
    /// RFC 867: one line with the date and time, then close.
    Daytime,
    /// RFC 864: an endless rotating character pattern.
    Chargen,
    /// A small HTTP/1.1 server for trying the proxy: `GET /bytes/N` sends N bytes,
    /// `GET /work?us=T&bytes=N` works T µs (sleeps; at most a minute) and then sends N bytes,
    /// a PUT or POST is answered with the body's length and FNV-1a hash, anything else with
    /// the PE's identifier. Every response carries `X-Pe-Id`.
    Http,
    /// A stateful calculator whose sessions survive the failure of their PE (counts primes;
    /// state in cookies; the pool user is `rserpool session`).
    Calc,
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ExampleArgs {
    pub service: Service,
    /// Listening address of the service (port 0 = any free port); `sctp+udp://ADDR` or
    /// `sctp://ADDR` serves echo, discard or daytime over SCTP, as rsplib's `rspserver` does.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: rserpool_wire::Address,
    #[command(flatten)]
    pub shape: ServiceOpts,
    #[command(flatten)]
    pub pe: PeOpts,
    #[command(flatten)]
    pub credits: CreditOpts,
    #[command(flatten)]
    pub calc: super::calc::CalcOpts,
    #[command(flatten)]
    pub control: super::control::ControlOpts,
}

/// How much the service takes at once.
#[derive(Args, Debug, Clone, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ServiceOpts {
    /// Connections at which the reported load is 100%; with policy `credits`, the connections
    /// (requests for `http`) it takes at once [default: the workers, else 100].
    #[arg(long)]
    pub capacity: Option<usize>,
    /// Serve with this many workers, each taking one connection at a time from the listening
    /// socket and closing it after one request, like a pre-forking server without keep-alive;
    /// connections beyond them wait in the accept queue [default: a task per connection].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Length of the listening socket's accept queue (the kernel caps it at
    /// net.core.somaxconn).
    #[arg(long, default_value_t = 1024)]
    pub backlog: u32,
    /// `http`: serve requests by service level, levels 1 ..= N from the proxy's level header:
    /// the workers (`--workers`, else the capacity) go to the waiting requests' levels by
    /// lottery over their tickets, as the proxy's admission does [default: 0, first come
    /// first served].
    #[arg(long, default_value_t = 0)]
    pub levels: usize,
    /// The header that carries the level (the proxy's `[levels] header`).
    #[arg(long, default_value = "x-rserpool-level")]
    pub level_header: String,
}

impl Default for ServiceOpts {
    fn default() -> Self {
        Self {
            capacity: None,
            workers: None,
            backlog: 1024,
            levels: 0,
            level_header: "x-rserpool-level".into(),
        }
    }
}

impl ServiceOpts {
    fn capacity(&self) -> usize {
        self.capacity.or(self.workers).unwrap_or(100).max(1)
    }
}

pub fn run(args: ExampleArgs) -> Result<()> {
    if args.listen.scheme.is_sctp() {
        return super::example_sctp::run(args.service, args.listen, args.pe);
    }
    if args.service == Service::Calc {
        return super::calc::run_pe(args.listen.addr, args.pe, args.calc);
    }
    super::init_logging();
    super::runtime()?.block_on(async move {
        let ex = start(
            args.service,
            args.listen.addr,
            &args.shape,
            &args.pe,
            Some(&args.credits),
        )
        .await?;
        info!(
            "{:?} service at {} is PE {:#010x} of pool {}",
            args.service,
            ex.addr,
            ex.pe.id(),
            args.pe.pool
        );
        let pe = ex.pe.updater();
        args.control
            .listen(args.pe.registrars.tls()?, move |drained| {
                pe.set_active(!drained)
            })
            .await?;
        super::shutdown_signal().await;
        args.control.remove();
        drop(ex.credits);
        ex.pe.stop().await;
        super::sctp_settle().await;
        Ok(())
    })
}

/// A running example service and its registration.
pub struct Example {
    pub addr: SocketAddr,
    pub pe: PoolElement,
    pub task: tokio::task::JoinHandle<()>,
    /// Policy `credits`: the sampling task.
    pub credits: Option<CreditSource>,
}

/// Binds the service, starts its PE and its accept loop (on the current runtime).
pub async fn start(
    service: Service,
    listen: SocketAddr,
    shape: &ServiceOpts,
    opts: &PeOpts,
    credit_opts: Option<&CreditOpts>,
) -> Result<Example> {
    if service == Service::Calc {
        anyhow::bail!("calc is started by its own module (it serves sessions)");
    }
    let capacity = shape.capacity();
    let listener =
        bind(listen, shape.backlog).with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let mut cfg = super::pe_config(opts, addr)?;
    let cap = u32::try_from(capacity.max(1)).unwrap_or(u32::MAX);
    super::set_capacity(&mut cfg, cap);
    let pe = PoolElement::start(cfg)?;
    super::report_status(&pe, opts, addr);
    // Without credit options (as from `up`), no credits are reported.
    let credits = match credit_opts {
        Some(o) => super::credit_source(
            &pe,
            o,
            cap,
            MetricSource::Listener(listener.as_fd().try_clone_to_owned()?),
        )?,
        None => None,
    };
    let in_flight = credits.as_ref().map(CreditSource::in_flight);
    let adaptive = rserpool_wire::Policy::from_name(&opts.policy, opts.weight)
        .is_some_and(|p| p.is_adaptive());
    let load = Load {
        active: Arc::new(AtomicUsize::new(0)),
        capacity: capacity.max(1),
    };
    let reporter = pe_reporter(&pe, adaptive);
    let id = pe.id();
    let levels = (shape.levels > 0 && service == Service::Http).then(|| Levels {
        gate: LevelGate::new(
            shape.workers.unwrap_or(capacity),
            &(1..=shape.levels.min(64))
                .map(Domain::default_for)
                .collect::<Vec<_>>(),
            Discipline::Lottery,
            Duration::from_secs(1),
        ),
        header: shape.level_header.clone(),
    });
    let levels = levels.map(Arc::new);
    if let (Some(workers), None) = (shape.workers, &levels) {
        let listener = Arc::new(listener);
        let task = tokio::spawn(async move {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..workers.max(1) {
                let (listener, load, reporter, in_flight) = (
                    listener.clone(),
                    load.clone(),
                    reporter.clone(),
                    in_flight.clone(),
                );
                set.spawn(async move {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        load.change(1, &reporter);
                        let _ = serve(service, stream, id, in_flight.clone(), true, None).await;
                        load.change(-1, &reporter);
                    }
                });
            }
            while set.join_next().await.is_some() {}
        });
        return Ok(Example {
            addr,
            pe,
            task,
            credits,
        });
    }
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                continue;
            };
            debug!("{service:?}: connection from {peer}");
            let load = load.clone();
            let reporter = reporter.clone();
            let in_flight = in_flight.clone();
            let levels = levels.clone();
            tokio::spawn(async move {
                load.change(1, &reporter);
                let _ = serve(service, stream, id, in_flight, false, levels.as_deref()).await;
                load.change(-1, &reporter);
            });
        }
    });
    Ok(Example {
        addr,
        pe,
        task,
        credits,
    })
}

/// Sends load updates to the PE from connection tasks.
type Reporter = Option<tokio::sync::mpsc::UnboundedSender<f64>>;

fn pe_reporter(pe: &PoolElement, adaptive: bool) -> Reporter {
    if !adaptive {
        return None;
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<f64>();
    let updater = pe.updater();
    tokio::spawn(async move {
        while let Some(mut f) = rx.recv().await {
            while let Ok(newer) = rx.try_recv() {
                f = newer;
            }
            updater.update_load(f);
        }
    });
    Some(tx)
}

#[derive(Clone)]
struct Load {
    active: Arc<AtomicUsize>,
    capacity: usize,
}

impl Load {
    fn change(&self, delta: isize, reporter: &Reporter) {
        let n = if delta > 0 {
            self.active.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.active
                .fetch_sub(1, Ordering::Relaxed)
                .saturating_sub(1)
        };
        if let Some(tx) = reporter {
            let _ = tx.send((n as f64 / self.capacity as f64).min(1.0));
        }
    }
}

/// A listening socket with this accept queue length.
fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let sock = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(backlog.max(1))
}

/// `http` by service level: the workers as a gate, and the header that names the level.
struct Levels {
    gate: LevelGate,
    header: String,
}

/// `in_flight`: with credits, what counts as work in flight (a request for `http`, the
/// connection for the others). `once`: `http` closes after one request.
async fn serve(
    service: Service,
    mut stream: TcpStream,
    id: u32,
    in_flight: Option<InFlight>,
    once: bool,
    levels: Option<&Levels>,
) -> std::io::Result<()> {
    if service == Service::Http {
        // A response is a head and a body written apart: without this, Nagle holds the body
        // back for the proxy's delayed ACK (40 ms) on a kept-alive connection.
        let _ = stream.set_nodelay(true);
        return serve_http(stream, id, in_flight, once, levels).await;
    }
    let _work = in_flight.as_ref().map(InFlight::enter);
    match service {
        Service::Http | Service::Calc => {}
        Service::Echo => {
            let (mut r, mut w) = stream.split();
            tokio::io::copy(&mut r, &mut w).await?;
        }
        Service::Discard => {
            let mut buf = vec![0u8; 16 * 1024];
            while stream.read(&mut buf).await? > 0 {}
        }
        Service::Daytime => {
            stream.write_all(daytime().as_bytes()).await?;
            stream.shutdown().await?;
        }
        Service::Chargen => {
            // Lines of 72 printable characters, each starting one further (RFC 864).
            let chars: Vec<u8> = (b' '..=b'~').collect();
            let mut start = 0usize;
            let mut block = Vec::with_capacity(74 * 64);
            loop {
                block.clear();
                for _ in 0..64 {
                    block.extend((0..72).map(|i| chars[(start + i) % chars.len()]));
                    block.extend_from_slice(b"\r\n");
                    start = (start + 1) % chars.len();
                }
                stream.write_all(&block).await?;
            }
        }
    }
    Ok(())
}

async fn serve_http(
    mut stream: TcpStream,
    id: u32,
    in_flight: Option<InFlight>,
    once: bool,
    levels: Option<&Levels>,
) -> std::io::Result<()> {
    use bytes::BytesMut;
    use rserpool_proxy::http::message::{BodyDecoder, Head, Piece, framing};
    let mut buf = BytesMut::with_capacity(16 * 1024);
    loop {
        let head = loop {
            match Head::request(&mut buf, 64 * 1024) {
                Ok(Some(h)) => break h,
                Ok(None) => {}
                Err(_) => return bad_request(&mut stream).await,
            }
            if stream.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        };
        let Ok(f) = framing(&head, true) else {
            return bad_request(&mut stream).await;
        };
        // From the request's head to the end of its response.
        let _work = in_flight.as_ref().map(InFlight::enter);
        if head
            .get("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"))
        {
            stream
                .write_all(
                    format!("HTTP/1.1 100 Continue\r\nX-Pe-Id: {id:#010x}\r\n\r\n").as_bytes(),
                )
                .await?;
        }
        // The payload is counted and hashed, whatever its framing.
        let mut body = BodyDecoder::new(f);
        let (mut len, mut hash) = (0u64, Fnv::new());
        loop {
            match body.next(&mut buf) {
                Err(_) => return bad_request(&mut stream).await,
                Ok(Piece::Data(d)) if !d.is_empty() => {
                    hash.update(&d);
                    len += d.len() as u64;
                }
                Ok(Piece::Data(_)) => {
                    if stream.read_buf(&mut buf).await? == 0 {
                        return Ok(());
                    }
                }
                Ok(Piece::Trailers(_) | Piece::End) => break,
            }
        }
        // `Upgrade: echo` switches the connection to an echo of everything that follows.
        if head.has_token("connection", "upgrade")
            && head
                .get("upgrade")
                .is_some_and(|v| v.eq_ignore_ascii_case(b"echo"))
        {
            stream
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
                .await?;
            stream.write_all(&buf).await?;
            let (mut r, mut w) = stream.split();
            tokio::io::copy(&mut r, &mut w).await?;
            return Ok(());
        }
        let keep = head.wants_keep_alive() && !once;
        let method = String::from_utf8_lossy(head.method()).into_owned();
        let target = String::from_utf8_lossy(head.target()).into_owned();
        let work = work_of(&target);
        // By level: a worker slot first, held while the work is done.
        let level: Option<usize> = levels.map(|l| {
            head.get(&l.header)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(1)
        });
        let _slot = match (levels, level) {
            (Some(l), Some(level)) => Some(l.gate.enter(level).await),
            _ => None,
        };
        if let Some(w) = work {
            if w.cpu_us > 0 {
                let _ = tokio::task::spawn_blocking(move || spin(Duration::from_micros(w.cpu_us)))
                    .await;
            }
            if w.us > 0 {
                tokio::time::sleep(Duration::from_micros(w.us)).await;
            }
        }
        drop(_slot);
        let download = target
            .strip_prefix("/bytes/")
            .and_then(|n| n.parse::<u64>().ok())
            .or(work.map(|w| w.bytes));
        let text = match (&*method, download) {
            (_, Some(_)) => String::new(),
            ("PUT" | "POST", _) => format!("received {len} bytes, fnv1a {:016x}\n", hash.0),
            _ => format!(
                "PE {id:#010x} {method} {target} for {}\n",
                String::from_utf8_lossy(head.get("x-forwarded-for").unwrap_or(b"-"))
            ),
        };
        let length = download.unwrap_or(text.len() as u64);
        let mut out = format!(
            "HTTP/1.1 200 OK\r\nX-Pe-Id: {id:#010x}\r\nContent-Type: text/plain\r\nContent-Length: {length}\r\n{}{}\r\n",
            level.map_or(String::new(), |l| format!("X-Level: {l}\r\n")),
            match (keep, head.minor) {
                (false, _) => "Connection: close\r\n",
                (true, 0) => "Connection: keep-alive\r\n",
                (true, _) => "",
            }
        )
        .into_bytes();
        if method != "HEAD" {
            out.extend_from_slice(text.as_bytes());
        }
        stream.write_all(&out).await?;
        if let (Some(n), false) = (download, method == "HEAD") {
            // A whole number of pattern periods, so every block starts the pattern afresh.
            let block: Vec<u8> = (0..251 * 261).map(pattern_byte).collect();
            let mut sent = 0u64;
            while sent < n {
                let k = (n - sent).min(block.len() as u64) as usize;
                stream.write_all(&block[..k]).await?;
                sent += k as u64;
            }
        }
        if !keep {
            return Ok(());
        }
    }
}

/// What `GET /work?…` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Work {
    /// `us`: wait this long (a worker held, no CPU).
    us: u64,
    /// `cpu_us`: spin the CPU this long.
    cpu_us: u64,
    /// `bytes`: the response body's length.
    bytes: u64,
}

/// `/work?us=T&cpu_us=C&bytes=N`; T and C capped at a minute, N at 64 MiB.
fn work_of(target: &str) -> Option<Work> {
    let query = target.strip_prefix("/work?")?;
    let (mut us, mut cpu_us, mut bytes) = (0u64, 0u64, 0u64);
    for kv in query.split('&') {
        match kv.split_once('=') {
            Some(("us", v)) => us = v.parse().ok()?,
            Some(("cpu_us", v)) => cpu_us = v.parse().ok()?,
            Some(("bytes", v)) => bytes = v.parse().ok()?,
            _ => {}
        }
    }
    Some(Work {
        us: us.min(60_000_000),
        cpu_us: cpu_us.min(60_000_000),
        bytes: bytes.min(64 << 20),
    })
}

/// Keeps a CPU busy for `d` of this thread's CPU time (wall time if that cannot be read).
fn spin(d: Duration) {
    let cpu = || rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    let start = cpu();
    let wall = std::time::Instant::now();
    let mut x = 0u64;
    loop {
        for _ in 0..1000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let now = cpu();
        let used = i128::from(now.tv_sec - start.tv_sec) * 1_000_000_000
            + i128::from(now.tv_nsec - start.tv_nsec);
        if used >= d.as_nanos() as i128 || wall.elapsed() >= d * 50 {
            return;
        }
    }
}

/// Byte `i` of a `GET /bytes/N` download.
pub fn pattern_byte(i: u64) -> u8 {
    (i % 251) as u8
}

async fn bad_request(stream: &mut TcpStream) -> std::io::Result<()> {
    stream
        .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        .await
}

/// FNV-1a, 64 bit: a checksum the tests can compute too.
pub struct Fnv(pub u64);

impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// "2026-11-21 14:03:07 UTC\r\n" from the system clock.
pub(super) fn daytime() -> String {
    let (y, m, d, secs) = rserpool::util::utc_now();
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC\r\n",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}
