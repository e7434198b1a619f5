//! WebSocket (and any protocol a client names) over HTTP/2: RFC 8441's extended CONNECT. The
//! proxy offers `SETTINGS_ENABLE_CONNECT_PROTOCOL`; a stream that opens with `:method CONNECT`
//! and `:protocol` goes to an HTTP/1.1 PE as the Upgrade request it stands for (a GET with
//! `Connection: upgrade`, `Upgrade: PROTOCOL`, and for WebSocket a `Sec-WebSocket-Key` of the
//! proxy's, as RFC 8441 §5 leaves the key to the HTTP/1.1 side). When the PE switches
//! protocols (101), the client gets 200 and the stream carries the bytes both ways
//! ([`relay`]) until either side ends or both are quiet for `idle-timeout-ms`.

use super::inflow::Inflow;
use super::stream::{Stream, send_data};
use bytes::Bytes;
use h2::Reason;
use std::time::Duration;
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

/// One end of a tunnel: bytes come from it and go to it.
pub(crate) trait End {
    /// The next bytes, or how the end stopped sending.
    async fn read(&mut self) -> Read;
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

/// An HTTP/2 stream as a tunnel's end: the client's (or an HTTP/2 PE's) DATA frames, what
/// has arrived of them read as one piece (a burst of small WebSocket messages is one write).
pub(crate) struct StreamEnd {
    recv: Inflow,
    send: h2::SendStream<Bytes>,
}

impl StreamEnd {
    pub(crate) fn new(recv: h2::RecvStream, send: h2::SendStream<Bytes>) -> Self {
        Self {
            recv: Inflow::new(recv),
            send,
        }
    }
}

impl End for StreamEnd {
    async fn read(&mut self) -> Read {
        match self.recv.next().await {
            Some(Ok(d)) => {
                self.recv.written(d.len());
                Read::Data(d)
            }
            Some(Err(_)) => Read::Failed,
            None => Read::End,
        }
    }
    async fn write(&mut self, data: Bytes) -> bool {
        send_data(&mut self.send, data, false).await.is_ok()
    }
    async fn finish(&mut self) {
        let _ = send_data(&mut self.send, Bytes::new(), true).await;
    }
    fn abort(&mut self) {
        self.send.send_reset(Reason::CANCEL);
    }
}

/// A byte stream (an HTTP/1.1 PE's connection after its 101) as a tunnel's end.
pub(crate) struct IoEnd<P> {
    rd: tokio::io::ReadHalf<P>,
    wr: tokio::io::WriteHalf<P>,
    buf: Box<[u8]>,
}

impl<P: AsyncRead + AsyncWrite> IoEnd<P> {
    pub(crate) fn new(io: P) -> Self {
        let (rd, wr) = tokio::io::split(io);
        Self {
            rd,
            wr,
            buf: vec![0; 16 * 1024].into_boxed_slice(),
        }
    }
}

impl<P: AsyncRead + AsyncWrite + Unpin> End for IoEnd<P> {
    async fn read(&mut self) -> Read {
        match self.rd.read(&mut self.buf).await {
            Ok(0) => Read::End,
            Ok(n) => Read::Data(Bytes::copy_from_slice(&self.buf[..n])),
            Err(_) => Read::Failed,
        }
    }
    async fn write(&mut self, data: Bytes) -> bool {
        self.wr.write_all(&data).await.is_ok()
    }
    async fn finish(&mut self) {
        let _ = self.wr.shutdown().await;
    }
    fn abort(&mut self) {}
}

/// Carries bytes between the client's end and the PE's until both ended, one failed, or both
/// were quiet for `idle`.
pub(crate) async fn carry(client: &mut impl End, pe: &mut impl End, idle: Duration) -> Carried {
    let mut carried = Carried::default();
    let (mut up, mut down) = (true, true);
    while up || down {
        tokio::select! {
            r = client.read(), if up => match r {
                Read::Data(d) => {
                    carried.up += d.len() as u64;
                    if !pe.write(d).await {
                        client.abort();
                        break;
                    }
                }
                Read::End => {
                    pe.finish().await;
                    up = false;
                }
                Read::Failed => {
                    pe.abort();
                    break;
                }
            },
            r = pe.read(), if down => match r {
                Read::Data(d) => {
                    carried.down += d.len() as u64;
                    if !client.write(d).await {
                        pe.abort();
                        break;
                    }
                }
                Read::End => {
                    client.finish().await;
                    down = false;
                }
                Read::Failed => {
                    client.abort();
                    break;
                }
            },
            () = tokio::time::sleep(idle) => {
                client.abort();
                pe.abort();
                break;
            }
        }
    }
    carried
}

/// Answers the client's extended CONNECT with 200: its end of the tunnel. `None` when the
/// stream was none or the client is gone.
pub(crate) fn accept(s: &mut Stream) -> Option<StreamEnd> {
    let recv = s.tunnel.take()?;
    let head = http::Response::builder().status(200).body(()).ok()?;
    let send = s.respond.send_response(head, false).ok()?;
    Some(StreamEnd::new(recv, send))
}

/// The HTTP/1.1 PE switched protocols: the client gets 200 and the tunnel carries the bytes
/// both ways (`early`: what the PE sent after its 101 head).
pub(crate) async fn relay<P: AsyncRead + AsyncWrite + Unpin>(
    s: &mut Stream,
    pe: P,
    early: &[u8],
    idle: Duration,
) -> Option<Carried> {
    let mut client = accept(s)?;
    let mut carried = Carried::default();
    if !early.is_empty() {
        if !client.write(Bytes::copy_from_slice(early)).await {
            return None;
        }
        carried.down += early.len() as u64;
    }
    let c = carry(&mut client, &mut IoEnd::new(pe), idle).await;
    carried.up += c.up;
    carried.down += c.down;
    Some(carried)
}

#[cfg(test)]
mod tests {
    use super::*;

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
