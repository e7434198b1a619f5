//! One write for many HTTP/2 frames.
//!
//! The `h2` crate gathers the frames it sends in a buffer and writes them out when it has
//! nothing more to send, except DATA: on a connection that takes vectored writes, a DATA
//! payload of 256 bytes or more is not copied into the buffer but written beside it, and the
//! buffer cannot take the next frame until that write is done. Ten answers of half a kilobyte
//! ready at once thus went to the client in ten writes, where HAProxy gathers them. Each write
//! on TCP is a system call and a segment to send (on loopback, the receiver's work too).
//!
//! This layer tells `h2` that vectored writes are not worth it, so payloads under a kilobyte
//! are copied into its buffer and leave together. A larger payload still goes beside the
//! buffer, now as two writes (the buffer, then the payload); this layer holds the first, which
//! ends in the middle of a frame, and sends both in one vectored write. Nothing is held past a
//! flush or across a frame's end, so a frame never waits.

use super::frames::{Frames, PREFACE};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most that is held for the rest of its frame (`h2`'s buffer is 16 KiB).
const HOLD_MAX: usize = 64 * 1024;

/// An HTTP/2 connection's transport, writes coalesced as above; reads pass.
pub(crate) struct Coalesced<T> {
    io: T,
    /// Written by `h2`, not yet to `io`: a piece that ends within a frame.
    held: Vec<u8>,
    /// Where the bytes accepted from `h2` so far end.
    frames: Frames,
}

impl<T> Coalesced<T> {
    /// The server's side: its first bytes are a frame.
    pub(crate) fn server(io: T) -> Self {
        Self::after(io, 0)
    }

    /// The client's side: its first bytes are the connection preface.
    pub(crate) fn client(io: T) -> Self {
        Self::after(io, PREFACE.len())
    }

    fn after(io: T, preface: usize) -> Self {
        Self {
            io,
            held: Vec::new(),
            frames: Frames::after(preface),
        }
    }

    /// `n` bytes of what is held were written.
    fn wrote_held(&mut self, n: usize) {
        if n >= self.held.len() {
            // Freed, not kept: an idle connection holds no buffer.
            self.held = Vec::new();
        } else {
            self.held.drain(..n);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesced<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesced<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let mut after = me.frames;
        after.pass(data, |_| {});
        // Held only where the transport can take it with the next piece in one write.
        if !after.at_boundary()
            && me.io.is_write_vectored()
            && me.held.len() + data.len() <= HOLD_MAX
        {
            me.held.extend_from_slice(data);
            me.frames = after;
            return Poll::Ready(Ok(data.len()));
        }
        loop {
            if me.held.is_empty() {
                let n = ready!(Pin::new(&mut me.io).poll_write(cx, data))?;
                if n == data.len() {
                    me.frames = after;
                } else {
                    me.frames.pass(&data[..n], |_| {});
                }
                return Poll::Ready(Ok(n));
            }
            let both = [IoSlice::new(&me.held), IoSlice::new(data)];
            let n = ready!(Pin::new(&mut me.io).poll_write_vectored(cx, &both))?;
            if n == 0 {
                return Poll::Ready(Ok(0));
            }
            let of_data = n.saturating_sub(me.held.len());
            me.wrote_held(n);
            if of_data > 0 {
                me.frames.pass(&data[..of_data], |_| {});
                return Poll::Ready(Ok(of_data));
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        while !me.held.is_empty() {
            let n = ready!(Pin::new(&mut me.io).poll_write(cx, &me.held))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            me.wrote_held(n);
        }
        Pin::new(&mut me.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    /// A transport that records its writes (all slices of one, as `writev` takes them), takes
    /// at most `limit` bytes of each, and passes them on to `peer` when there is one (which
    /// it reads from too).
    #[derive(Default)]
    struct Wire {
        writes: Writes,
        limit: Option<usize>,
        peer: Option<tokio::io::DuplexStream>,
        /// Says it takes no vectored writes.
        plain: bool,
    }

    #[derive(Clone, Default)]
    struct Writes(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Writes {
        fn all(&self) -> Vec<Vec<u8>> {
            self.0.lock().map(|w| w.clone()).unwrap_or_default()
        }
    }

    impl Wire {
        fn to(peer: tokio::io::DuplexStream) -> Self {
            Self {
                peer: Some(peer),
                ..Self::default()
            }
        }
    }

    impl AsyncRead for Wire {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            match &mut self.get_mut().peer {
                Some(p) => Pin::new(p).poll_read(cx, buf),
                None => Poll::Ready(Ok(())),
            }
        }
    }

    impl AsyncWrite for Wire {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.poll_write_vectored(cx, &[IoSlice::new(data)])
        }
        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let mut all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            all.truncate(self.limit.unwrap_or(usize::MAX));
            let me = self.get_mut();
            let n = match &mut me.peer {
                Some(p) => ready!(Pin::new(p).poll_write(cx, &all))?,
                None => all.len(),
            };
            all.truncate(n);
            if let Ok(mut w) = me.writes.0.lock() {
                w.push(all);
            }
            Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            !self.plain
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn frame(len: usize, fill: u8) -> Vec<u8> {
        let mut f = vec![0, (len >> 8) as u8, len as u8, 0, 0, 0, 0, 0, 1];
        f.resize(9 + len, fill);
        f
    }

    #[tokio::test]
    async fn a_piece_ending_within_a_frame_leaves_with_the_rest_of_it() {
        let wire = Wire::default();
        let rec = wire.writes.clone();
        let mut c = Coalesced::server(wire);
        // Two whole frames and the start of a third, then the third's rest (h2's buffer, then
        // a payload beside it).
        let (a, b, big) = (frame(10, 1), frame(0, 2), frame(3000, 3));
        let first = [a.as_slice(), b.as_slice(), &big[..1033]].concat();
        c.write_all(&first).await.unwrap();
        assert!(rec.all().is_empty(), "a piece within a frame is held");
        c.write_all(&big[1033..]).await.unwrap();
        assert_eq!(rec.all(), [[first.as_slice(), &big[1033..]].concat()]);
        // Whole frames go at once, and so does what is held at a flush.
        c.write_all(&a).await.unwrap();
        c.write_all(&big[..100]).await.unwrap();
        c.flush().await.unwrap();
        assert_eq!(rec.all()[1..], [a.clone(), big[..100].to_vec()]);
        assert!(c.held.capacity() == 0, "nothing is kept once written");
    }

    #[tokio::test]
    async fn nothing_is_held_for_a_transport_that_cannot_write_it_with_the_rest() {
        let wire = Wire {
            plain: true,
            ..Wire::default()
        };
        let rec = wire.writes.clone();
        let mut c = Coalesced::server(wire);
        let big = frame(3000, 3);
        c.write_all(&big[..1033]).await.unwrap();
        assert_eq!(rec.all(), [big[..1033].to_vec()]);
    }

    #[tokio::test]
    async fn short_writes_lose_and_repeat_nothing() {
        let wire = Wire {
            limit: Some(700),
            ..Wire::default()
        };
        let rec = wire.writes.clone();
        let mut c = Coalesced::client(wire);
        let mut sent = PREFACE.to_vec();
        for len in [5000, 10, 2000, 0, 300] {
            sent.extend(frame(len, len as u8));
        }
        for piece in sent.chunks(1500) {
            c.write_all(piece).await.unwrap();
        }
        c.flush().await.unwrap();
        assert_eq!(rec.all().concat(), sent);
        assert!(c.frames.at_boundary());
    }

    /// An `h2` server on `io` that answers ten requests at once, with 600 bytes each: the
    /// writes it took.
    async fn answer_ten<T>(io: T, writes: Writes) -> usize
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        let mut conn = h2::server::handshake(io).await.unwrap();
        let mut answers = Vec::new();
        while answers.len() < 10 {
            answers.push(conn.accept().await.unwrap().unwrap().1);
        }
        // All ten answered before the connection is polled again.
        let before = writes.all().len();
        for mut respond in answers {
            let mut tx = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            tx.send_data(Bytes::from(vec![b'x'; 600]), true).unwrap();
        }
        let _ = tokio::time::timeout(Duration::from_millis(300), conn.accept()).await;
        writes.all().len() - before
    }

    /// Writes of that server, its transport coalesced or not.
    async fn writes_for_ten_answers(coalesce: bool) -> usize {
        let (c, s) = tokio::io::duplex(1 << 20);
        let s = Wire::to(s);
        let writes = s.writes.clone();
        let server = tokio::spawn(async move {
            if coalesce {
                answer_ten(Coalesced::server(s), writes).await
            } else {
                answer_ten(s, writes).await
            }
        });
        let (send, conn) = h2::client::handshake(c).await.unwrap();
        tokio::spawn(conn);
        let mut calls = Vec::new();
        for _ in 0..10 {
            let mut send = send.clone().ready().await.unwrap();
            let get = http::Request::get("http://x/").body(()).unwrap();
            calls.push(send.send_request(get, true).unwrap().0);
        }
        let n = server.await.unwrap();
        for resp in calls {
            let mut body = resp.await.unwrap().into_body();
            let mut got = 0;
            while let Some(d) = body.data().await {
                got += d.unwrap().len();
            }
            assert_eq!(got, 600);
        }
        n
    }

    #[tokio::test]
    async fn answers_ready_together_leave_in_one_write() {
        let plain = writes_for_ten_answers(false).await;
        assert!(plain >= 10, "h2 alone writes each answer: {plain}");
        let coalesced = writes_for_ten_answers(true).await;
        assert!(coalesced <= 2, "ten answers in {coalesced} writes");
    }
}
