//! Limits on what an HTTP/2 client may make the proxy do for nothing.
//!
//! The h2 crate bounds what it keeps (header lists, CONTINUATION frames, streams reset before
//! they are accepted) and answers PING and SETTINGS one at a time, reading no further until
//! the answer is written; but a client that reads its answers can still send PINGs,
//! SETTINGS, PRIORITY or empty frames, or open and reset streams (rapid reset,
//! CVE-2023-44487), as fast as the link allows, each costing the proxy work and no request.
//! This reader watches the frame headers as the bytes pass (they are not changed) and trips
//! when a client exceeds its budget of resets or of control frames per second; the
//! connection then ends with GOAWAY ENHANCE_YOUR_CALM.

use super::frames::{FrameHead, Frames, PREFACE};
use bytes::Bytes;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// Which budget a client exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flood {
    Resets,
    Control,
}

/// Set once when the client exceeds a budget; the connection's task waits on it.
#[derive(Default)]
pub(crate) struct Tripped {
    what: AtomicU8,
    notify: Notify,
}

impl Tripped {
    pub(crate) fn get(&self) -> Option<Flood> {
        match self.what.load(Ordering::Relaxed) {
            1 => Some(Flood::Resets),
            2 => Some(Flood::Control),
            _ => None,
        }
    }

    pub(crate) async fn wait(&self) -> Flood {
        loop {
            let notified = self.notify.notified();
            if let Some(f) = self.get() {
                return f;
            }
            notified.await;
        }
    }

    fn trip(&self, f: Flood) {
        let v = match f {
            Flood::Resets => 1,
            Flood::Control => 2,
        };
        if self
            .what
            .compare_exchange(0, v, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.notify.notify_waiters();
        }
    }
}

/// A token bucket: `rate` a second, as many at once.
struct Budget {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl Budget {
    fn new(rate: u32, now: Instant) -> Self {
        Self {
            rate: f64::from(rate),
            tokens: f64::from(rate),
            at: now,
        }
    }

    fn spend(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// The client's side of an HTTP/2 connection: `pre` (bytes already read) first, then `io`,
/// every frame counted against the budgets.
pub(crate) struct Guarded<T> {
    io: T,
    pre: Bytes,
    frames: Frames,
    resets: Budget,
    control: Budget,
    tripped: Arc<Tripped>,
}

impl<T> Guarded<T> {
    pub(crate) fn new(
        io: T,
        pre: Bytes,
        resets_per_s: u32,
        control_per_s: u32,
    ) -> (Self, Arc<Tripped>) {
        let tripped = Arc::new(Tripped::default());
        let now = Instant::now();
        let g = Self {
            io,
            pre,
            frames: Frames::after(PREFACE.len()),
            resets: Budget::new(resets_per_s, now),
            control: Budget::new(control_per_s, now),
            tripped: tripped.clone(),
        };
        (g, tripped)
    }

    /// Counts the frames whose headers are in `data`.
    fn watch(&mut self, data: &[u8]) {
        let now = Instant::now();
        let (resets, control, tripped) = (&mut self.resets, &mut self.control, &self.tripped);
        self.frames.pass(data, |FrameHead { len, kind, flags }| {
            let flood = match kind {
                // RST_STREAM
                3 => (!resets.spend(now)).then_some(Flood::Resets),
                // PRIORITY; PING and SETTINGS but their ACKs
                2 => (!control.spend(now)).then_some(Flood::Control),
                4 | 6 if flags & 1 == 0 => (!control.spend(now)).then_some(Flood::Control),
                // DATA without payload or END_STREAM; HEADERS or CONTINUATION without a
                // header block fragment or END_HEADERS (END_STREAM ends a request)
                0 | 1 | 9 if len == 0 && flags & (if kind == 0 { 1 } else { 4 }) == 0 => {
                    (!control.spend(now)).then_some(Flood::Control)
                }
                _ => None,
            };
            if let Some(f) = flood {
                tripped.trip(f);
            }
        });
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.tripped.get().is_some() {
            // Nothing more is read from a flooding client; its GOAWAY is on the way.
            return Poll::Pending;
        }
        if !me.pre.is_empty() {
            let n = me.pre.len().min(buf.remaining());
            let pre = me.pre.split_to(n);
            me.watch(&pre);
            buf.put_slice(&pre);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut me.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            me.watch(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, len: usize) -> Vec<u8> {
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.resize(9 + len, 0);
        f
    }

    #[test]
    fn frames_are_counted_wherever_the_reads_split_them() {
        let (mut g, tripped) = Guarded::new((), Bytes::new(), 3, 1000);
        let mut bytes = PREFACE.to_vec();
        for _ in 0..3 {
            bytes.extend(frame(0, 0, 100)); // DATA: free
            bytes.extend(frame(3, 0, 4)); // RST_STREAM
        }
        for chunk in bytes.chunks(7) {
            g.watch(chunk);
        }
        assert_eq!(tripped.get(), None, "three resets are within the budget");
        g.watch(&frame(3, 0, 4));
        assert_eq!(tripped.get(), Some(Flood::Resets));
    }

    #[test]
    fn acks_and_frames_with_payload_are_free() {
        let (mut g, tripped) = Guarded::new((), Bytes::new(), 1000, 2);
        g.watch(PREFACE);
        for _ in 0..100 {
            g.watch(&frame(6, 1, 8)); // PING ACK
            g.watch(&frame(4, 1, 0)); // SETTINGS ACK
            g.watch(&frame(0, 1, 0)); // empty DATA with END_STREAM
            g.watch(&frame(1, 4, 10)); // HEADERS
        }
        assert_eq!(tripped.get(), None);
        for _ in 0..3 {
            g.watch(&frame(6, 0, 8)); // PING
        }
        assert_eq!(tripped.get(), Some(Flood::Control));
    }
}
