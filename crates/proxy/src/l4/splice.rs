//! Forwarding both directions of a spliced connection (TCP mode, HTTP upgrades).
//!
//! On Linux the bytes go socket → pipe → socket with `splice(2)` and never enter user space;
//! where a pipe cannot be had, they are copied through a buffer. Either way a direction that
//! reaches end-of-file half-closes the other side, and the whole connection ends after the
//! idle timeout without traffic in either direction.

use rustix::pipe::{PipeFlags, SpliceFlags, fcntl_setpipe_size, pipe_with, splice};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Copy buffer size, and the default pipe size.
const CHUNK: usize = 64 * 1024;
/// A direction that has moved `GROW_AFTER` bytes is a bulk transfer: its pipe grows to
/// `PIPE_SIZE`, so that more is in flight per splice (over a link with queueing delay, 64 KiB
/// held back the transfer by about 10 %). Short connections keep the default size, because
/// pipe capacity counts against the per-user limit (`pipe-user-pages-soft`) for non-root.
const GROW_AFTER: u64 = 1 << 20;
const PIPE_SIZE: usize = 256 * 1024;

/// Bytes moved in each direction.
#[derive(Debug, Default, Clone, Copy)]
pub struct Moved {
    pub a_to_b: u64,
    pub b_to_a: u64,
}

/// Forwards `a` ⇄ `b` until both directions end, one fails, or nothing moves for `idle`.
pub async fn forward(
    a: &TcpStream,
    b: &TcpStream,
    idle: Duration,
    zero_copy: bool,
) -> io::Result<Moved> {
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let ab = pump(a, b, zero_copy, start, &last);
    let ba = pump(b, a, zero_copy, start, &last);
    until_idle(async { tokio::try_join!(ab, ba) }, start, &last, idle).await
}

/// [`forward`] for streams that are not plain sockets (a TLS client's), through buffers.
pub async fn forward_streams<A, B>(a: A, b: B, idle: Duration) -> io::Result<Moved>
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite,
{
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let ab = pump_stream(ar, bw, start, &last);
    let ba = pump_stream(br, aw, start, &last);
    until_idle(async { tokio::try_join!(ab, ba) }, start, &last, idle).await
}

/// One direction of [`forward_streams`]; returns the bytes moved.
async fn pump_stream(
    mut src: impl tokio::io::AsyncRead + Unpin,
    mut dst: impl tokio::io::AsyncWrite + Unpin,
    start: Instant,
    last: &AtomicU64,
) -> io::Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = src.read(&mut buf).await?;
        if n == 0 {
            let _ = dst.shutdown().await;
            return Ok(total);
        }
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        dst.write_all(&buf[..n]).await?;
        total += n as u64;
    }
}

/// Runs both directions until they end, or until nothing moved for `idle`.
async fn until_idle(
    both: impl std::future::Future<Output = io::Result<(u64, u64)>>,
    start: Instant,
    last: &AtomicU64,
    idle: Duration,
) -> io::Result<Moved> {
    let watchdog = async {
        loop {
            let quiet = start
                .elapsed()
                .saturating_sub(Duration::from_millis(last.load(Ordering::Relaxed)));
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    };
    tokio::select! {
        r = both => r.map(|(a_to_b, b_to_a)| Moved { a_to_b, b_to_a }),
        () = watchdog => Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout")),
    }
}

enum Buffer {
    /// A kernel pipe: (read end, write end, capacity).
    Pipe(OwnedFd, OwnedFd, usize),
    User(Box<[u8]>),
}

fn buffer(zero_copy: bool) -> Buffer {
    if zero_copy && let Ok((r, w)) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC) {
        return Buffer::Pipe(r, w, CHUNK);
    }
    Buffer::User(vec![0; CHUNK].into_boxed_slice())
}

/// One direction, `src` → `dst`; returns the bytes moved.
async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    zero_copy: bool,
    start: Instant,
    last: &AtomicU64,
) -> io::Result<u64> {
    let mut buf = buffer(zero_copy);
    let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
    let mut total = 0u64;
    loop {
        let n = loop {
            src.readable().await?;
            let r = match &mut buf {
                Buffer::Pipe(_, w, size) => src.try_io(Interest::READABLE, || {
                    Ok(splice(src, None, &*w, None, *size, flags)?)
                }),
                Buffer::User(b) => src.try_read(b),
            };
            match r {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            let _ = socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
            return Ok(total);
        }
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut done = 0;
        while done < n {
            dst.writable().await?;
            let r = match &buf {
                Buffer::Pipe(r, _, _) => dst.try_io(Interest::WRITABLE, || {
                    Ok(splice(r, None, dst, None, n - done, flags)?)
                }),
                Buffer::User(b) => dst.try_write(&b[done..n]),
            };
            match r {
                Ok(m) => done += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        total += n as u64;
        if let Buffer::Pipe(_, w, size) = &mut buf
            && *size < PIPE_SIZE
            && total >= GROW_AFTER
        {
            // The pipe is empty here; if the limit refuses, it stays as it is.
            *size = fcntl_setpipe_size(&*w, PIPE_SIZE).unwrap_or(*size);
        }
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}
