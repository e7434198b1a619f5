//! WebSocket (and any protocol a client names) over HTTP/2: RFC 8441's extended CONNECT. The
//! proxy offers `SETTINGS_ENABLE_CONNECT_PROTOCOL`; a stream that opens with `:method CONNECT`
//! and `:protocol` goes to an HTTP/1.1 PE as the Upgrade request it stands for (a GET with
//! `Connection: upgrade`, `Upgrade: PROTOCOL`, and for WebSocket a `Sec-WebSocket-Key` of the
//! proxy's, as RFC 8441 §5 leaves the key to the HTTP/1.1 side). When the PE switches
//! protocols (101), the client gets 200 and the stream carries the bytes both ways
//! ([`relay`], [`carry`]) until both sides end, one fails, or nothing moves either way for
//! `idle-timeout-ms`. The two directions go on independently: a side that stops reading holds
//! up only what goes to it.

use super::inflow::Inflow;
use super::stream::{Stream, send_data};
use bytes::Bytes;
use h2::Reason;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a tunnel carried: client to PE, PE to client.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Carried {
    pub(crate) up: u64,
    pub(crate) down: u64,
}

/// The value of a `Sec-WebSocket-Key`: 16 random bytes in base64 (RFC 6455 §4.1).
pub(crate) fn websocket_key() -> String {
    use std::hash::BuildHasher;
    let state = std::collections::hash_map::RandomState::new();
    let (a, b) = (state.hash_one(1u8), state.hash_one(2u8));
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&a.to_le_bytes());
    bytes[8..].copy_from_slice(&b.to_le_bytes());
    base64(&bytes)
}

/// Standard base64 with padding (a key is all it is needed for).
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Where a tunnel's bytes come from: one end's receiving half.
pub(crate) trait Source {
    /// The next bytes, or how the end stopped sending.
    async fn read(&mut self) -> Read;
}

/// Where a tunnel's bytes go: one end's sending half.
pub(crate) trait Sink {
    /// Sends `data`; false when this end no longer takes it.
    async fn write(&mut self, data: Bytes) -> bool;
    /// No more bytes for this end (a FIN, END_STREAM).
    async fn finish(&mut self);
    /// Ends it abruptly (an RST_STREAM; a dropped socket).
    fn abort(&mut self);
}

pub(crate) enum Read {
    Data(Bytes),
    /// Ended cleanly.
    End,
    Failed,
}

/// An HTTP/2 stream's receiving half as a tunnel's source: the client's (or an HTTP/2 PE's)
/// DATA frames, what has arrived of them read as one piece (a burst of small WebSocket
/// messages is one write).
pub(crate) struct StreamSource(Inflow);

/// An HTTP/2 stream's sending half as a tunnel's sink.
pub(crate) struct StreamSink(h2::SendStream<Bytes>);

/// An HTTP/2 stream as a tunnel's end: its two halves.
pub(crate) fn stream_end(
    recv: h2::RecvStream,
    send: h2::SendStream<Bytes>,
) -> (StreamSource, StreamSink) {
    (StreamSource(Inflow::new(recv)), StreamSink(send))
}

impl Source for StreamSource {
    async fn read(&mut self) -> Read {
        match self.0.next().await {
            Some(Ok(d)) => {
                self.0.written(d.len());
                Read::Data(d)
            }
            Some(Err(_)) => Read::Failed,
            None => Read::End,
        }
    }
}

impl Sink for StreamSink {
    async fn write(&mut self, data: Bytes) -> bool {
        send_data(&mut self.0, data, false).await.is_ok()
    }
    async fn finish(&mut self) {
        let _ = send_data(&mut self.0, Bytes::new(), true).await;
    }
    fn abort(&mut self) {
        self.0.send_reset(Reason::CANCEL);
    }
}

/// A byte stream's reading half (an HTTP/1.1 PE's connection after its 101) as a tunnel's
/// source.
pub(crate) struct IoSource<P> {
    rd: tokio::io::ReadHalf<P>,
    buf: Box<[u8]>,
}

/// A byte stream's writing half as a tunnel's sink.
pub(crate) struct IoSink<P>(tokio::io::WriteHalf<P>);

/// A byte stream as a tunnel's end: its two halves.
pub(crate) fn io_end<P: AsyncRead + AsyncWrite>(io: P) -> (IoSource<P>, IoSink<P>) {
    let (rd, wr) = tokio::io::split(io);
    let buf = vec![0; 16 * 1024].into_boxed_slice();
    (IoSource { rd, buf }, IoSink(wr))
}

impl<P: AsyncRead + AsyncWrite + Unpin> Source for IoSource<P> {
    async fn read(&mut self) -> Read {
        match self.rd.read(&mut self.buf).await {
            Ok(0) => Read::End,
            Ok(n) => Read::Data(Bytes::copy_from_slice(&self.buf[..n])),
            Err(_) => Read::Failed,
        }
    }
}

impl<P: AsyncRead + AsyncWrite + Unpin> Sink for IoSink<P> {
    async fn write(&mut self, data: Bytes) -> bool {
        self.0.write_all(&data).await.is_ok()
    }
    async fn finish(&mut self) {
        let _ = self.0.shutdown().await;
    }
    fn abort(&mut self) {}
}

/// How one direction of a tunnel ended.
enum Piped {
    /// Its source ended and its sink was told.
    Ended,
    /// A read or a write failed.
    Failed,
}

/// When a tunnel last moved bytes, either way (shared by its two directions, which run in
/// one task: atomic only to be `Sync`).
struct Activity {
    since: Instant,
    last_ns: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            last_ns: AtomicU64::new(0),
        }
    }
    fn touch(&self) {
        let ns = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_ns.store(ns, Ordering::Relaxed);
    }
    fn last(&self) -> Instant {
        self.since + Duration::from_nanos(self.last_ns.load(Ordering::Relaxed))
    }
}

/// Copies one direction until its source ends (the sink is then finished) or either side
/// fails, adding what it wrote to `moved`; every read and every write done counts as
/// activity.
async fn pipe(
    from: &mut impl Source,
    to: &mut impl Sink,
    moved: &AtomicU64,
    active: &Activity,
) -> Piped {
    loop {
        match from.read().await {
            Read::Data(d) => {
                active.touch();
                let n = d.len() as u64;
                if !to.write(d).await {
                    return Piped::Failed;
                }
                moved.fetch_add(n, Ordering::Relaxed);
                active.touch();
            }
            Read::End => {
                to.finish().await;
                return Piped::Ended;
            }
            Read::Failed => return Piped::Failed,
        }
    }
}

/// Carries bytes between the client's end and the PE's until both ended, one failed, or
/// nothing moved either way for `idle`. The two directions go on independently: a side that
/// does not read holds up only what goes to it (a write waiting on it counts as quiet, so a
/// side that never reads again ends the tunnel after `idle`). After a failure or the idle
/// timeout both sides are ended abruptly.
pub(crate) async fn carry(
    client: (impl Source, impl Sink),
    pe: (impl Source, impl Sink),
    idle: Duration,
) -> Carried {
    let ((mut client_in, mut client_out), (mut pe_in, mut pe_out)) = (client, pe);
    let active = Activity::new();
    let (moved_up, moved_down) = (AtomicU64::new(0), AtomicU64::new(0));
    let clean = {
        let up = pipe(&mut client_in, &mut pe_out, &moved_up, &active);
        let down = pipe(&mut pe_in, &mut client_out, &moved_down, &active);
        tokio::pin!(up, down);
        let (mut up_open, mut down_open) = (true, true);
        loop {
            let quiet_until = tokio::time::Instant::from_std(active.last() + idle);
            tokio::select! {
                p = &mut up, if up_open => {
                    up_open = false;
                    if let Piped::Failed = p {
                        break false;
                    }
                }
                p = &mut down, if down_open => {
                    down_open = false;
                    if let Piped::Failed = p {
                        break false;
                    }
                }
                () = tokio::time::sleep_until(quiet_until) => {
                    if active.last().elapsed() >= idle {
                        break false;
                    }
                }
            }
            if !up_open && !down_open {
                break true;
            }
        }
    };
    if !clean {
        client_out.abort();
        pe_out.abort();
    }
    Carried {
        up: moved_up.into_inner(),
        down: moved_down.into_inner(),
    }
}

/// Answers the client's extended CONNECT with 200: its end of the tunnel. `None` when the
/// stream was none or the client is gone.
pub(crate) fn accept(s: &mut Stream) -> Option<(StreamSource, StreamSink)> {
    let recv = s.tunnel.take()?;
    let head = http::Response::builder().status(200).body(()).ok()?;
    let send = s.respond.send_response(head, false).ok()?;
    Some(stream_end(recv, send))
}

/// The HTTP/1.1 PE switched protocols: the client gets 200 and the tunnel carries the bytes
/// both ways (`early`: what the PE sent after its 101 head).
pub(crate) async fn relay<P: AsyncRead + AsyncWrite + Unpin>(
    s: &mut Stream,
    pe: P,
    early: &[u8],
    idle: Duration,
) -> Option<Carried> {
    let (client_in, mut client_out) = accept(s)?;
    let mut carried = Carried::default();
    if !early.is_empty() {
        if !client_out.write(Bytes::copy_from_slice(early)).await {
            return None;
        }
        carried.down += early.len() as u64;
    }
    let c = carry((client_in, client_out), io_end(pe), idle).await;
    carried.up += c.up;
    carried.down += c.down;
    Some(carried)
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex, split};

    /// A side that does not read holds up only what goes to it: the PE's message reaches the
    /// client while the client's upload waits on the PE.
    #[tokio::test]
    async fn a_side_that_does_not_read_holds_up_only_what_goes_to_it() {
        let (client, proxy_client) = duplex(4096);
        let (proxy_pe, mut pe) = duplex(4096);
        let tunnel = tokio::spawn(carry(
            io_end(proxy_client),
            io_end(proxy_pe),
            Duration::from_secs(30),
        ));
        let (mut client_rd, mut client_wr) = split(client);
        // Far more than the buffers between hold; the PE reads none of it yet.
        let upload = tokio::spawn(async move {
            let _ = client_wr.write_all(&vec![7u8; 1 << 20]).await;
            client_wr
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        pe.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        tokio::time::timeout(Duration::from_secs(2), client_rd.read_exact(&mut got))
            .await
            .expect("the PE's message is not held up by the client's upload")
            .unwrap();
        assert_eq!(&got, b"hello");
        // The PE reads the upload after all: every byte arrives.
        let mut n = 0;
        let mut buf = vec![0u8; 64 * 1024];
        while n < 1 << 20 {
            n += pe.read(&mut buf).await.unwrap();
        }
        assert_eq!(n, 1 << 20);
        drop(upload.await.unwrap());
        drop((pe, client_rd));
        let carried = tunnel.await.unwrap();
        assert_eq!((carried.up, carried.down), (1 << 20, 5));
    }

    /// A side that never reads again ends the tunnel after `idle`, though a write to it is
    /// still waiting.
    #[tokio::test]
    async fn a_side_that_never_reads_again_ends_the_tunnel_after_idle() {
        let (client, proxy_client) = duplex(4096);
        let (proxy_pe, pe) = duplex(4096);
        let (_client_rd, mut client_wr) = split(client);
        tokio::spawn(async move {
            let _ = client_wr.write_all(&vec![0u8; 1 << 20]).await;
        });
        let t = Instant::now();
        let idle = Duration::from_millis(300);
        let carried = tokio::time::timeout(
            Duration::from_secs(5),
            carry(io_end(proxy_client), io_end(proxy_pe), idle),
        )
        .await
        .expect("the tunnel ends");
        assert!(t.elapsed() >= idle, "{:?}", t.elapsed());
        assert!(carried.up > 0);
        drop(pe);
    }

    /// Both sides end cleanly: each is told (a FIN here), and the tunnel counts what it
    /// carried each way.
    #[tokio::test]
    async fn a_tunnel_ends_when_both_sides_have_ended() {
        let (mut client, proxy_client) = duplex(4096);
        let (proxy_pe, mut pe) = duplex(4096);
        let tunnel = tokio::spawn(carry(
            io_end(proxy_client),
            io_end(proxy_pe),
            Duration::from_secs(30),
        ));
        client.write_all(b"abc").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        pe.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"abc");
        pe.write_all(b"wxyz").await.unwrap();
        pe.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"wxyz");
        let carried = tokio::time::timeout(Duration::from_secs(2), tunnel)
            .await
            .expect("the tunnel ends")
            .unwrap();
        assert_eq!((carried.up, carried.down), (3, 4));
    }

    #[test]
    fn base64_pads_as_rfc_4648_says() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(websocket_key().len(), 24);
        assert!(websocket_key().ends_with("=="));
    }
}
