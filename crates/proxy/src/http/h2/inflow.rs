//! A stream's DATA frames taken out of `h2` as they come, also while the proxy is still
//! writing the ones before them on to the other side.
//!
//! `h2` keeps the frames of a stream that its reader has not taken, and counts the small ones
//! against an allowance (from 0.4.20: half the connection window, at least 25,600 bytes, each
//! frame under 256 bytes costing what it lacks of 256). A relay that reads the next frame only
//! once the last one is written leaves them there whenever its own side is slower: a gRPC
//! stream of small messages to a slow client, or from a client to a slow PE, runs the
//! allowance out and `h2` ends the whole connection with ENHANCE_YOUR_CALM — every other call
//! on it too. Here the frames that come meanwhile are moved into one buffer of bytes instead.
//! Flow control is unchanged: their window is given back to the sender only once they are
//! written on, so the buffer holds no more than the stream's window.
//!
//! That is not all: `h2` counts a frame when its connection task reads it, and a burst of
//! them is read before the stream's task runs to take them. The allowance is therefore raised
//! too ([`small_frame_budget`]), to what a burst of gRPC messages can need.

use bytes::{Bytes, BytesMut};
use h2::RecvStream;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::{Context, Poll};

/// How much `next` gathers of what `h2` has read already before handing it out.
const GATHER: usize = 64 * 1024;

/// The allowance for small frames waiting in `h2` on a connection whose bursts are bounded by
/// `window` (a PE's: its connection window; a client's: one stream's window): a full window
/// of 10-byte frames (a gRPC message: its 5-byte prefix and 5 bytes of protobuf), each costing the 246 bytes it lacks of 256. At most `window` / 10 such frames can
/// wait, as the window lets the sender have in flight anyway; `h2`'s own allowance (half the
/// connection window) is about one fiftieth of that.
pub fn small_frame_budget(window: u32) -> usize {
    window as usize / 10 * 246
}

enum State {
    Open,
    /// The sender's DATA has all been taken (trailers may still come).
    Done,
    /// The stream failed; said once by `next`.
    Failed(h2::Error),
}

/// Pieces of a body as one: the first is kept as it came (a unary call's body, a lone frame:
/// no copy); those after it are gathered behind it in one buffer (copied once: they are the
/// small ones that would otherwise pile up).
#[derive(Default)]
pub(crate) struct Gathered {
    one: Bytes,
    joined: BytesMut,
}

impl Gathered {
    pub(crate) fn push(&mut self, d: Bytes) {
        if self.joined.is_empty() && self.one.is_empty() {
            self.one = d;
            return;
        }
        if self.joined.is_empty() {
            let first = std::mem::take(&mut self.one);
            self.joined.reserve(first.len() + d.len());
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(&d);
    }

    pub(crate) fn len(&self) -> usize {
        self.one.len() + self.joined.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All of it, as one piece; it is empty after.
    pub(crate) fn take(&mut self) -> Bytes {
        if self.joined.is_empty() {
            std::mem::take(&mut self.one)
        } else {
            std::mem::take(&mut self.joined).freeze()
        }
    }
}

pub(crate) struct Inflow {
    recv: RecvStream,
    /// Taken out of `recv` while earlier bytes were being written on.
    held: Gathered,
    state: State,
}

impl Inflow {
    pub(crate) fn new(recv: RecvStream) -> Self {
        Self {
            recv,
            held: Gathered::default(),
            state: State::Open,
        }
    }

    /// The next bytes to write on: all that was taken while the last ones were written and
    /// every frame `h2` has already read (up to [`GATHER`]), else the next frame when it comes;
    /// `None` once the DATA is over. Cancel-safe. A burst of small frames goes on as one.
    pub(crate) async fn next(&mut self) -> Option<Result<Bytes, h2::Error>> {
        poll_fn(|cx| {
            self.gather(cx, GATHER);
            if !self.held.is_empty() {
                return Poll::Ready(Some(Ok(self.held.take())));
            }
            match std::mem::replace(&mut self.state, State::Done) {
                State::Open => {
                    self.state = State::Open;
                    Poll::Pending
                }
                State::Done => Poll::Ready(None),
                State::Failed(e) => Poll::Ready(Some(Err(e))),
            }
        })
        .await
    }

    /// Whether the sender ended the stream with its DATA and all of it was handed out: the
    /// bytes from the last `next` are the last (no trailers to come).
    pub(crate) fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.recv.is_end_stream()
    }

    /// Runs `write` (of bytes from `next`), taking the frames that come meanwhile.
    pub(crate) async fn while_writing<F: Future>(&mut self, write: F) -> F::Output {
        let mut write = pin!(write);
        poll_fn(|cx| {
            if let Poll::Ready(out) = write.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            // Bounded by the window: nothing taken is given back before it is written on.
            self.gather(cx, usize::MAX);
            Poll::Pending
        })
        .await
    }

    /// Takes the frames `h2` has read, while the stream is open and fewer than `limit` bytes
    /// are held; `cx` is woken for the next one.
    fn gather(&mut self, cx: &mut Context<'_>, limit: usize) {
        while matches!(self.state, State::Open) && self.held.len() < limit {
            match self.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(d))) => self.held.push(d),
                Poll::Ready(Some(Err(e))) => self.state = State::Failed(e),
                Poll::Ready(None) => self.state = State::Done,
                Poll::Pending => break,
            }
        }
    }

    /// `n` bytes from `next` were written on: the sender may send as many more.
    pub(crate) fn written(&mut self, n: usize) {
        let _ = self.recv.flow_control().release_capacity(n);
    }

    pub(crate) async fn trailers(&mut self) -> Result<Option<http::HeaderMap>, h2::Error> {
        self.recv.trailers().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_in_one_piece_is_kept_as_it_came_and_pieces_are_joined() {
        let mut g = Gathered::default();
        let one = Bytes::from_static(b"hello");
        g.push(Bytes::new());
        g.push(one.clone());
        assert_eq!(g.len(), 5);
        let taken = g.take();
        assert_eq!(taken.as_ptr(), one.as_ptr(), "not copied");
        assert_eq!(g.len(), 0);
        for piece in ["ab", "", "cd", "e"] {
            g.push(Bytes::from(piece));
        }
        assert_eq!(g.len(), 5);
        assert_eq!(g.take(), "abcde");
        assert_eq!(g.take(), "");
    }
    use std::time::Duration;

    /// A request over an in-memory connection: the server's side of its body and the
    /// client's side that sends it.
    async fn stream() -> (RecvStream, h2::SendStream<Bytes>) {
        let (c, s) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::Builder::new()
                .initial_window_size(1 << 20)
                .initial_connection_window_size(1 << 20)
                .data_frame_budget(small_frame_budget(1 << 20))
                .handshake::<_, Bytes>(s)
                .await
                .unwrap();
            let (req, _respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            req.into_body()
        });
        let (send, conn) = h2::client::handshake(c).await.unwrap();
        tokio::spawn(conn);
        let mut send = send.ready().await.unwrap();
        let (_resp, tx) = send
            .send_request(http::Request::post("http://x/").body(()).unwrap(), false)
            .unwrap();
        (server.await.unwrap(), tx)
    }

    fn send_frames(tx: &mut h2::SendStream<Bytes>, n: usize, end: bool) {
        for i in 0..n {
            tx.send_data(Bytes::from_static(b"0123456789"), end && i + 1 == n)
                .unwrap();
        }
    }

    #[tokio::test]
    async fn a_burst_of_small_frames_comes_out_in_a_few_pieces() {
        let (recv, mut tx) = stream().await;
        send_frames(&mut tx, 2000, false);
        tx.send_trailers(http::HeaderMap::new()).unwrap();
        // Every frame read by the server's connection before the body is taken.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut inflow = Inflow::new(recv);
        let (mut bytes, mut pieces) = (0, 0);
        while let Some(d) = inflow.next().await {
            let d = d.unwrap();
            assert!(!inflow.is_end_stream(), "trailers still to come");
            bytes += d.len();
            pieces += 1;
            inflow.written(d.len());
        }
        assert_eq!(bytes, 20_000);
        assert!(pieces <= 4, "{pieces} pieces for 2,000 frames");
        assert!(inflow.trailers().await.unwrap().is_some());
    }

    #[tokio::test]
    async fn frames_that_come_while_writing_are_held_and_the_end_is_known() {
        let (recv, mut tx) = stream().await;
        send_frames(&mut tx, 1, false);
        let mut inflow = Inflow::new(recv);
        let first = inflow.next().await.unwrap().unwrap();
        assert_eq!(first.len(), 10);
        // A write that takes a while: the other 499 frames arrive meanwhile.
        send_frames(&mut tx, 499, true);
        inflow
            .while_writing(tokio::time::sleep(Duration::from_millis(200)))
            .await;
        assert_eq!(inflow.held.len(), 4_990, "taken meanwhile");
        inflow.written(first.len());
        let rest = inflow.next().await.unwrap().unwrap();
        assert_eq!(rest.len(), 4_990);
        assert!(inflow.is_end_stream(), "the last bytes carry the end");
        inflow.written(rest.len());
        assert!(inflow.next().await.is_none());
    }
}
