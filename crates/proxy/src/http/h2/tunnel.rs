//! WebSocket (and any protocol a client names) over HTTP/2: RFC 8441's extended CONNECT. The
//! proxy offers `SETTINGS_ENABLE_CONNECT_PROTOCOL`; a stream that opens with `:method CONNECT`
//! and `:protocol` goes to an HTTP/1.1 PE as the Upgrade request it stands for (a GET with
//! `Connection: upgrade`, `Upgrade: PROTOCOL`, and for WebSocket a `Sec-WebSocket-Key` of the
//! proxy's, as RFC 8441 §5 leaves the key to the HTTP/1.1 side). When the PE switches
//! protocols (101), the client gets 200 and the stream carries the bytes both ways
//! ([`relay`]) until either side ends or both are quiet for `idle-timeout-ms`.

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

/// The PE switched protocols: answers the client's CONNECT with 200 and carries the stream's
/// bytes to `pe` and back (`early`: what the PE sent after its 101 head). `None` when the
/// stream was no extended CONNECT or the client is gone.
pub(crate) async fn relay<P: AsyncRead + AsyncWrite + Unpin>(
    s: &mut Stream,
    pe: P,
    early: &[u8],
    idle: Duration,
) -> Option<Carried> {
    let mut recv = s.tunnel.take()?;
    let head = http::Response::builder().status(200).body(()).ok()?;
    let mut tx = s.respond.send_response(head, false).ok()?;
    let mut carried = Carried::default();
    if !early.is_empty() {
        send_data(&mut tx, Bytes::copy_from_slice(early), false)
            .await
            .ok()?;
        carried.down += early.len() as u64;
    }
    let (mut rd, mut wr) = tokio::io::split(pe);
    let mut buf = vec![0u8; 16 * 1024];
    let (mut up, mut down) = (true, true);
    while up || down {
        tokio::select! {
            d = recv.data(), if up => match d {
                Some(Ok(d)) => {
                    let n = d.len();
                    if wr.write_all(&d).await.is_err() {
                        tx.send_reset(Reason::CANCEL);
                        break;
                    }
                    let _ = recv.flow_control().release_capacity(n);
                    carried.up += n as u64;
                }
                // Reset by the client.
                Some(Err(_)) => break,
                None => {
                    let _ = wr.shutdown().await;
                    up = false;
                }
            },
            r = rd.read(&mut buf), if down => match r {
                Ok(0) => {
                    let _ = send_data(&mut tx, Bytes::new(), true).await;
                    down = false;
                }
                Ok(n) => {
                    if send_data(&mut tx, Bytes::copy_from_slice(&buf[..n]), false).await.is_err() {
                        break;
                    }
                    carried.down += n as u64;
                }
                Err(_) => {
                    tx.send_reset(Reason::CANCEL);
                    break;
                }
            },
            () = tokio::time::sleep(idle) => {
                tx.send_reset(Reason::CANCEL);
                break;
            }
        }
    }
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
