//! The relay to a PE that speaks HTTP/1.1, over a kept-alive connection from the PE's idle set
//! when there is one: the head and a held body in one write, a streamed body in its framing,
//! interim responses (100 releases a waiting body; 101 turns the connection into a tunnel),
//! then the response to the client. Heads are parsed, bodies only delimited and streamed.
//! An HTTP/1.1 client gets the response as it came (the connection's own headers replaced); an
//! HTTP/2 client gets it taken apart into frames (the chunked coding and its trailers).

use super::PeStream;
use crate::balance::backend::Backend;
use crate::balance::conns::IdlePool;
use crate::balance::failover::Attempt;
use crate::ctx::Ctx;
use crate::http::client_stream::{Client, ClientStream};
use crate::http::downstream::{Downstream, Failure, H1Client, Relayed};
use crate::http::h2::inflow::Inflow;
use crate::http::h2::stream::Body;
use crate::http::message::{
    BodyDecoder, BodyState, Framing, Head, Piece, frame_into, response_framing,
};
use crate::http::request::{Request, forwarding};
use crate::http::upstream::connect_pe;
use bytes::{Buf, BufMut, BytesMut};
use http::header::{HeaderName, HeaderValue};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A connection to a PE with the bytes read from it but not used yet.
#[derive(Debug)]
pub(crate) struct BackendConn {
    pub(crate) stream: PeStream,
    pub(crate) buf: BytesMut,
}

impl BackendConn {
    pub(crate) fn new(stream: PeStream) -> Self {
        Self {
            stream,
            buf: BytesMut::with_capacity(16 * 1024),
        }
    }
}

const READ_CHUNK: usize = 64 * 1024;

/// Responses up to this size (head and body) go to the client in one write.
const COALESCE: usize = 64 * 1024;

/// Read room below which a PE connection's buffer is grown before reading a response head.
const MIN_HEAD_ROOM: usize = 4 * 1024;

/// An idle kept-alive connection to the PE, or a new one. Non-idempotent requests only reuse
/// connections idle for less than a second: the PE is unlikely to have closed those, and
/// such a request cannot be sent again if it did.
pub(crate) async fn take_conn(
    b: &Arc<Backend>,
    ctx: &Ctx,
    fresh_only: bool,
) -> io::Result<(BackendConn, bool)> {
    let max_age = if fresh_only {
        Duration::from_secs(1)
    } else {
        ctx.pools.settings.idle_timeout
    };
    if let Some(conn) = idle(b).and_then(|i| i.take(max_age)) {
        return Ok((conn, true));
    }
    // Boxed: connecting (TCP, TLS) is a large future, and every request's attempt would
    // carry its size for a path taken once per connection.
    Ok((BackendConn::new(Box::pin(connect_pe(b, ctx)).await?), false))
}

/// The request head as sent to a PE: hop-by-hop headers dropped, forwarding headers added,
/// a client's copies of the level header (the default name) dropped.
pub(crate) fn outgoing_head(r: &Request, peer: SocketAddr) -> BytesMut {
    outgoing_head_with(r, peer, crate::balance::levels::DEFAULT_HEADER, false)
}

/// [`outgoing_head`] with the level header named `level_header`: a client's own copies are
/// always dropped (a PE serving by level must not trust them, `[levels]` or not), and with
/// `send_level` the request's level goes in it.
pub(crate) fn outgoing_head_with(
    r: &Request,
    peer: SocketAddr,
    level_header: &str,
    send_level: bool,
) -> BytesMut {
    let h = &r.head;
    let mut out = BytesMut::with_capacity(h.raw.len() + 128);
    out.put_slice(h.method());
    out.put_u8(b' ');
    out.put_slice(h.target());
    out.put_slice(if h.minor == 1 {
        b" HTTP/1.1\r\n"
    } else {
        b" HTTP/1.0\r\n"
    });
    let fw = forwarding(r, level_header, |n, v| {
        out.put_slice(n);
        out.put_slice(b": ");
        out.put_slice(v);
        out.put_slice(b"\r\n");
    });
    out.put_slice(b"X-Forwarded-For: ");
    fw.x_forwarded_for(&mut out, peer);
    out.put_slice(b"\r\nForwarded: ");
    fw.forwarded(&mut out, peer);
    out.put_slice(b"\r\n");
    if send_level {
        out.put_slice(level_header.as_bytes());
        out.put_slice(b": ");
        out.put_slice(r.level.to_string().as_bytes());
        out.put_slice(b"\r\n");
    }
    if r.upgrade {
        out.put_slice(b"Connection: upgrade\r\nUpgrade: ");
        out.put_slice(h.get("upgrade").unwrap_or_default());
        out.put_slice(b"\r\n");
    } else if h.minor == 0 {
        // Asked for whatever the client wants, so that HTTP/1.0 clients (ab, old scripts)
        // also get kept-alive connections to the PEs.
        out.put_slice(b"Connection: keep-alive\r\n");
    }
    out.put_slice(b"\r\n");
    out
}

/// The response head for the client: the status line and end-to-end headers as they came,
/// the connection's own headers replaced by ours, and a `Set-Cookie` of the proxy's.
pub(crate) fn response_head(
    h: &Head,
    out: &mut BytesMut,
    keep: bool,
    client_minor: u8,
    set_cookie: Option<&HeaderValue>,
) {
    out.put_slice(h.status_line());
    out.put_slice(b"\r\n");
    for (n, v) in h.end_to_end() {
        out.put_slice(n);
        out.put_slice(b": ");
        out.put_slice(v);
        out.put_slice(b"\r\n");
    }
    if let Some(v) = set_cookie {
        out.put_slice(b"Set-Cookie: ");
        out.put_slice(v.as_bytes());
        out.put_slice(b"\r\n");
    }
    if !keep {
        out.put_slice(b"Connection: close\r\n");
    } else if client_minor == 0 {
        out.put_slice(b"Connection: keep-alive\r\n");
    }
    out.put_slice(b"\r\n");
}

pub(crate) async fn read_response_head(
    bc: &mut BackendConn,
    timeout: Duration,
    ctx: &Ctx,
) -> Result<Head, Failure> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if !bc.buf.is_empty() {
            match Head::response(&mut bc.buf, ctx.cfg.max_head) {
                Ok(Some(h)) => return Ok(h),
                Ok(None) => {}
                Err(_) => return Err(Failure::Broken { relayed: false }),
            }
        }
        // Room for a head, made only when short: a reserve that finds the buffer shared (the
        // last response's body may still be queued for an HTTP/2 client) allocates anew.
        if bc.buf.capacity() - bc.buf.len() < MIN_HEAD_ROOM {
            bc.buf.reserve(16 * 1024);
        }
        let had = bc.buf.len();
        match tokio::time::timeout_at(deadline, bc.stream.read_buf(&mut bc.buf)).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Ok(0)) if had == 0 => {
                return Err(Failure::NoResponse {
                    body_sent: false,
                    error: io::ErrorKind::UnexpectedEof.into(),
                });
            }
            Ok(Ok(0)) => return Err(Failure::Broken { relayed: false }),
            Ok(Ok(_)) => {}
            Ok(Err(error)) if had == 0 => {
                return Err(Failure::NoResponse {
                    body_sent: false,
                    error,
                });
            }
            Ok(Err(_)) => return Err(Failure::Broken { relayed: false }),
        }
    }
}

/// After 101 Switching Protocols: bytes both ways until either side ends.
async fn tunnel(c: &mut Client, mut bc: BackendConn, b: &Arc<Backend>, ctx: &Ctx) {
    if !bc.buf.is_empty() && c.stream.write_all(&bc.buf).await.is_err() {
        return;
    }
    if !c.buf.is_empty() && bc.stream.write_all(&c.buf).await.is_err() {
        return;
    }
    c.buf.clear();
    let moved = match (c.stream.is_tls(), bc.stream.plain()) {
        (false, Some(pe)) => {
            let Ok(cs) = c.stream.registered() else {
                return;
            };
            crate::l4::splice::forward(cs, pe, ctx.idle_timeout(), ctx.cfg.splice).await
        }
        // TLS on either side: through buffers.
        _ => {
            crate::l4::splice::forward_streams(&mut c.stream, &mut bc.stream, ctx.idle_timeout())
                .await
        }
    };
    if let Ok(m) = moved {
        b.stats.bytes_in.fetch_add(m.a_to_b, Ordering::Relaxed);
        b.stats.bytes_out.fetch_add(m.b_to_a, Ordering::Relaxed);
    }
}

enum RelayError {
    Src,
    Dst,
    Timeout,
    Malformed,
}

/// Streams a body of `framing` from `src` (the bytes already in `buf` first) to `dst`, after
/// `prefix` (a head). The prefix and the first body bytes go out in one write where they fit,
/// so a small response costs one write. Bytes after the body stay in `buf`.
/// With `last`, the write that ends the body also ends `dst`'s sending side (see
/// [`Sink::write_last`]).
async fn stream_body(
    src: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    dst: &mut impl Sink,
    framing: Framing,
    mut prefix: BytesMut,
    idle: Duration,
    last: bool,
) -> Result<u64, RelayError> {
    let mut state = BodyState::new(framing);
    let mut total = 0u64;
    loop {
        if !buf.is_empty() && !state.is_done() {
            let n = state.take(buf).map_err(|_| RelayError::Malformed)?;
            if !prefix.is_empty() && prefix.len() + n <= COALESCE {
                prefix.put_slice(&buf[..n]);
            } else {
                if !prefix.is_empty() {
                    dst.write_all(&prefix).await.map_err(|_| RelayError::Dst)?;
                    prefix.clear();
                }
                write(dst, &buf[..n], last && state.is_done()).await?;
            }
            buf.advance(n);
            total += n as u64;
        }
        if !prefix.is_empty() {
            write(dst, &prefix, last && state.is_done()).await?;
            prefix.clear();
        }
        if state.is_done() {
            return Ok(total);
        }
        buf.reserve(READ_CHUNK);
        match tokio::time::timeout(idle, src.read_buf(buf)).await {
            Err(_) => return Err(RelayError::Timeout),
            Ok(Ok(0)) if matches!(state, BodyState::Close) => return Ok(total),
            Ok(Ok(0)) | Ok(Err(_)) => return Err(RelayError::Src),
            Ok(Ok(_)) => {}
        }
    }
}

async fn write(dst: &mut impl Sink, data: &[u8], last: bool) -> Result<(), RelayError> {
    let r = if last {
        dst.write_last(data).await
    } else {
        dst.write_all(data).await
    };
    r.map_err(|_| RelayError::Dst)
}

/// Where a relayed body goes: the client, or a PE.
trait Sink: AsyncWrite + Unpin {
    /// Writes the last bytes of the connection and ends its sending side.
    async fn write_last(&mut self, data: &[u8]) -> io::Result<()>;
}

impl Sink for ClientStream {
    async fn write_last(&mut self, data: &[u8]) -> io::Result<()> {
        ClientStream::write_last(self, data).await
    }
}

impl Sink for PeStream {
    async fn write_last(&mut self, data: &[u8]) -> io::Result<()> {
        self.write_all(data).await?;
        self.shutdown().await
    }
}

/// What [`send`] left to do with the request body.
struct Sent {
    /// Part of a streamed body went to the PE: the request cannot be sent again.
    body_sent: bool,
    /// Part of the body is still with the client (it waits for 100 Continue, or the PE
    /// stopped taking it).
    body_left: bool,
}

/// One attempt at an HTTP/1.1 PE, for a client of either version: the request, interim
/// responses, the response; the PE connection back to its idle set if it can carry another.
pub(crate) async fn exchange(
    d: &mut Downstream<'_>,
    mut bc: BackendConn,
    r: &Request,
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let b = &attempt.pe;
    let mut sent = send(d, &mut bc, r, b, ctx).await?;
    let mut relayed = false;
    let resp = loop {
        let timeout = attempt.head_timeout(ctx.request_timeout());
        // The client gone: dropping the PE's connection cancels the request there.
        let Some(waited) = d
            .unless_gone(read_response_head(&mut bc, timeout, ctx))
            .await
        else {
            return Err(Failure::Client);
        };
        let head = match waited {
            Ok(h) => h,
            Err(Failure::NoResponse { error, .. }) => {
                return Err(Failure::NoResponse {
                    body_sent: sent.body_sent,
                    error,
                });
            }
            Err(other) => return Err(other),
        };
        if !relayed {
            b.note_latency(attempt.rif, attempt.sent.elapsed());
        }
        match (head.code, &mut *d) {
            (101, Downstream::H1(h)) if r.upgrade => {
                h.c.stream
                    .write_all(&head.raw)
                    .await
                    .map_err(|_| Failure::Client)?;
                // Boxed (as the HTTP/2 client's tunnel below): a tunnel's future is large,
                // and every request's exchange would carry its size.
                Box::pin(tunnel(h.c, bc, b, ctx)).await;
                return Ok(Relayed {
                    code: 101,
                    keep: false,
                    bytes: head.raw.len() as u64,
                });
            }
            // An extended CONNECT (RFC 8441): the stream becomes the tunnel.
            (101, Downstream::H2(s)) if r.upgrade => {
                let early = std::mem::take(&mut bc.buf);
                let relay =
                    crate::http::h2::tunnel::relay(s, bc.stream, &early, ctx.idle_timeout());
                let Some(carried) = Box::pin(relay).await else {
                    return Err(Failure::Client);
                };
                b.stats.bytes_in.fetch_add(carried.up, Ordering::Relaxed);
                b.stats.bytes_out.fetch_add(carried.down, Ordering::Relaxed);
                return Ok(Relayed {
                    code: 200,
                    keep: false,
                    bytes: carried.down,
                });
            }
            // Any other stream cannot become a tunnel.
            (101, Downstream::H2(_)) => return Err(Failure::Broken { relayed: false }),
            // An upgrade answered without switching: a 2xx would open the client's tunnel
            // (RFC 8441), and its body would be read as WebSocket frames.
            (200..=299, Downstream::H2(s)) if r.upgrade && s.tunnel.is_some() => {
                return Err(Failure::NotUpgraded);
            }
            (100..=199, _) if head.code != 101 => {
                // Interim responses go to HTTP/1.1 clients; 100 releases a waiting body.
                if let Downstream::H1(h) = d
                    && r.head.minor == 1
                {
                    h.c.stream
                        .write_all(&head.raw)
                        .await
                        .map_err(|_| Failure::Client)?;
                    relayed = true;
                }
                if head.code == 100 && sent.body_left {
                    sent.body_sent = true;
                    sent.body_left = !send_body(d, &mut bc, r, b, ctx).await?;
                }
            }
            _ => break head,
        }
    };
    let Ok(framing) = response_framing(&resp, r.head.method() == b"HEAD") else {
        return Err(Failure::Broken { relayed });
    };
    // An HTTP/1.0 request's connection persists only if the PE says so (RFC 9112 §9.3).
    let backend_keep = framing != Framing::Close
        && !resp.has_token("connection", "close")
        && if r.head.minor == 1 {
            resp.minor == 1
        } else {
            resp.has_token("connection", "keep-alive")
        };
    let answered = match d {
        Downstream::H1(h) => pass(h, &mut bc, &resp, framing, &sent, relayed, r, b, ctx).await?,
        Downstream::H2(_) => pieces(d, &mut bc, &resp, framing, r, b, ctx).await?,
    };
    if backend_keep
        && bc.buf.is_empty()
        && !sent.body_left
        && let Some(i) = idle(b)
    {
        // A kept connection holds no read buffer (16 KiB each, up to `max-idle-per-pe` per
        // PE); the next response's read gets one.
        bc.buf = BytesMut::new();
        i.put(bc, ctx.pools.settings.max_idle_per_pe);
    }
    Ok(answered)
}

/// The head and what the client gave of the body at once (a held body, or what an HTTP/2
/// client sent before the rest), in one write where it fits; then the rest of a streamed body,
/// unless the client waits for 100 Continue.
async fn send(
    d: &mut Downstream<'_>,
    bc: &mut BackendConn,
    r: &Request,
    b: &Backend,
    ctx: &Ctx,
) -> Result<Sent, Failure> {
    let chunked = r.framing == Framing::Chunked;
    // An HTTP/1.1 client's head was made once for all attempts; an HTTP/2 client's is made here.
    let made;
    let (head, first, complete): (&[u8], _, _) = match &*d {
        Downstream::H1(h) => (&h.out.head, h.out.held.as_ref(), true),
        Downstream::H2(s) => {
            let (level_header, send_level) = ctx.level_header();
            made = outgoing_head_with(r, s.peer, level_header, send_level);
            match &s.body {
                Body::Held(d) => (&made, Some(d), true),
                Body::Streamed { prefix, .. } => (&made, Some(prefix), false),
            }
        }
    };
    let first = first.filter(|f| !f.is_empty() || (chunked && complete));
    let written = match first {
        // A body in the chunked coding (from an HTTP/2 client without a length) is framed.
        Some(body) if chunked => {
            let mut v = BytesMut::with_capacity(head.len() + body.len() + 32);
            v.put_slice(head);
            frame_into(&mut v, body, true);
            if complete {
                v.put_slice(b"0\r\n\r\n");
            }
            bc.stream.write_all(&v).await
        }
        Some(body) if head.len() + body.len() <= COALESCE => {
            let mut v = BytesMut::with_capacity(head.len() + body.len());
            v.put_slice(head);
            v.put_slice(body);
            bc.stream.write_all(&v).await
        }
        Some(body) => match bc.stream.write_all(head).await {
            Ok(()) => bc.stream.write_all(body).await,
            e => e,
        },
        None => bc.stream.write_all(head).await,
    };
    if let Err(error) = written {
        return Err(Failure::NoResponse {
            body_sent: false,
            error,
        });
    }
    if let Some(body) = first {
        b.stats
            .bytes_in
            .fetch_add(body.len() as u64, Ordering::Relaxed);
    }
    let mut sent = Sent {
        body_sent: false,
        body_left: d.held().is_none(),
    };
    if sent.body_left && !r.expect_continue {
        sent.body_sent = true;
        sent.body_left = !send_body(d, bc, r, b, ctx).await?;
    }
    Ok(sent)
}

/// Streams the rest of the client's request body to the PE in the request's framing: an
/// HTTP/1.1 client's as it comes, an HTTP/2 client's DATA frames in the chunked coding when the
/// request had no length. `Ok(false)` when the PE stopped taking it (it may have answered
/// early: the response is read next).
async fn send_body(
    d: &mut Downstream<'_>,
    bc: &mut BackendConn,
    r: &Request,
    b: &Backend,
    ctx: &Ctx,
) -> Result<bool, Failure> {
    match d {
        Downstream::H1(h) => {
            let sent = stream_body(
                &mut h.c.stream,
                &mut h.c.buf,
                &mut bc.stream,
                r.framing,
                BytesMut::new(),
                ctx.idle_timeout(),
                false,
            )
            .await;
            match sent {
                Ok(n) => {
                    b.stats.bytes_in.fetch_add(n, Ordering::Relaxed);
                    Ok(true)
                }
                Err(RelayError::Src) => Err(Failure::Client),
                Err(RelayError::Malformed) => Err(Failure::BadBody),
                Err(RelayError::Dst | RelayError::Timeout) => Ok(false),
            }
        }
        Downstream::H2(s) => {
            let Body::Streamed { rest, .. } = &mut s.body else {
                return Ok(true);
            };
            let Some(recv) = rest.take() else {
                return Ok(true);
            };
            let mut recv = Inflow::new(recv);
            let chunked = r.framing == Framing::Chunked;
            let mut out = BytesMut::new();
            let mut complete = true;
            loop {
                let d = match tokio::time::timeout(ctx.idle_timeout(), recv.next()).await {
                    Ok(None) => break,
                    Ok(Some(Ok(d))) => d,
                    _ => return Err(Failure::Client),
                };
                let n = d.len();
                b.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                let written = if chunked {
                    out.clear();
                    frame_into(&mut out, &d, true);
                    recv.while_writing(bc.stream.write_all(&out)).await
                } else {
                    recv.while_writing(bc.stream.write_all(&d)).await
                };
                if written.is_err() {
                    // The PE stopped taking the body; it may have answered.
                    complete = false;
                    break;
                }
                recv.written(n);
            }
            if chunked && complete && bc.stream.write_all(b"0\r\n\r\n").await.is_err() {
                complete = false;
            }
            Ok(complete)
        }
    }
}

/// The response to an HTTP/1.1 client as it came: the status line and end-to-end headers,
/// the connection's own replaced, the body in its own framing (a small response in one
/// write).
#[allow(clippy::too_many_arguments)]
async fn pass(
    h: &mut H1Client<'_>,
    bc: &mut BackendConn,
    resp: &Head,
    framing: Framing,
    sent: &Sent,
    relayed: bool,
    r: &Request,
    b: &Backend,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    if framing == Framing::Chunked && r.head.minor == 0 {
        // An HTTP/1.0 client cannot read it, and a PE must not send it (RFC 9112 §7.1).
        return Err(Failure::Broken { relayed });
    }
    let keep =
        r.keep_alive && framing != Framing::Close && !sent.body_left && !*ctx.draining.borrow();
    h.keep = keep;
    if sent.body_left {
        // The client may still be sending the body the PE did not take.
        h.c.stream.linger_on_close();
    } else if !r.keep_alive {
        h.c.stream.client_done();
    }
    let mut out = BytesMut::with_capacity(resp.raw.len() + 64);
    response_head(resp, &mut out, keep, r.head.minor, h.set_cookie.as_ref());
    let mut bytes = out.len() as u64;
    match stream_body(
        &mut bc.stream,
        &mut bc.buf,
        &mut h.c.stream,
        framing,
        out,
        ctx.idle_timeout(),
        !keep,
    )
    .await
    {
        Ok(n) => bytes += n,
        Err(RelayError::Dst) => return Err(Failure::Client),
        Err(_) => return Err(Failure::Broken { relayed: true }),
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    Ok(Relayed {
        code: resp.code,
        keep,
        bytes,
    })
}

/// The PE's end-to-end response headers (its framing left out) as a header map. A value
/// shares the head's bytes: no copy, no allocation per header (an HTTP/2 client's get their
/// own copy, `Downstream::respond_head`).
fn response_headers(resp: &Head) -> http::HeaderMap {
    let mut headers = http::HeaderMap::with_capacity(resp.headers.len());
    for (n, v) in resp.end_to_end() {
        if n.eq_ignore_ascii_case(b"transfer-encoding") {
            continue;
        }
        let v = HeaderValue::from_maybe_shared(resp.raw.slice_ref(v));
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n), v) {
            headers.append(n, v);
        }
    }
    headers
}

/// The response taken apart: the head, the body out of its framing, the chunked coding's
/// trailers, each sent as the client's version wants.
async fn pieces(
    d: &mut Downstream<'_>,
    bc: &mut BackendConn,
    resp: &Head,
    framing: Framing,
    r: &Request,
    b: &Backend,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let Ok(status) = http::StatusCode::from_u16(resp.code) else {
        return Err(Failure::Broken { relayed: false });
    };
    let (mut head, ()) = http::Response::new(()).into_parts();
    head.status = status;
    head.headers = response_headers(resp);
    let (mut bytes, mut more) = d
        .respond_head(head, framing == Framing::None, r, ctx)
        .await?;
    let mut dec = BodyDecoder::new(framing);
    while more {
        let piece = dec
            .next(&mut bc.buf)
            .map_err(|_| Failure::Broken { relayed: true })?;
        match piece {
            Piece::Data(data) if !data.is_empty() => {
                bytes += data.len() as u64;
                // A body of known length ends with its last bytes.
                more = !dec.is_done();
                d.respond_data(data, !more).await?;
            }
            Piece::Data(_) => {
                bc.buf.reserve(READ_CHUNK);
                match tokio::time::timeout(ctx.idle_timeout(), bc.stream.read_buf(&mut bc.buf))
                    .await
                {
                    Ok(Ok(0)) if framing == Framing::Close => {
                        d.respond_end(None).await?;
                        more = false;
                    }
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return Err(Failure::Broken { relayed: true }),
                }
            }
            Piece::Trailers(t) => {
                let mut map = http::HeaderMap::new();
                for (n, v) in t {
                    if let (Ok(n), Ok(v)) =
                        (HeaderName::from_bytes(&n), HeaderValue::from_bytes(&v))
                    {
                        map.append(n, v);
                    }
                }
                d.respond_end(Some(map)).await?;
                more = false;
            }
            Piece::End => {
                d.respond_end(None).await?;
                more = false;
            }
        }
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    Ok(Relayed {
        code: resp.code,
        keep: d.keep(),
        bytes,
    })
}

/// The PE's idle kept-alive connections.
fn idle(b: &Backend) -> Option<&IdlePool<BackendConn>> {
    b.conns.of::<IdlePool<BackendConn>>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::parse;
    use std::time::Instant;

    /// An HTTP/1.1 PE's headers as an HTTP/2 client gets them hold no part of the PE
    /// connection's read buffer (an HPACK table would keep it for the client connection's
    /// life): the values are their own copy, the framing is left out, repeated names stay.
    #[test]
    fn response_headers_hold_none_of_the_pe_connections_buffer() {
        let mut buf = BytesMut::with_capacity(16 * 1024);
        buf.extend_from_slice(
            b"HTTP/1.1 200 OK\r\nServer: nginx\r\nTransfer-Encoding: chunked\r\n\
              Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nETag: \"x\"\r\n\r\n0\r\n\r\n",
        );
        let whole = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.capacity();
        let resp = Head::response(&mut buf, 1 << 16).unwrap().unwrap();
        let h = crate::http::downstream::detached(response_headers(&resp));
        assert_eq!(h.get("server").unwrap(), "nginx");
        assert_eq!(h.get("etag").unwrap(), "\"x\"");
        let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert!(h.get("transfer-encoding").is_none());
        for v in h.values() {
            let at = v.as_bytes().as_ptr() as usize;
            assert!(!whole.contains(&at), "{v:?} is a slice of the read buffer");
        }
    }

    fn forwarded_request(text: &str) -> BytesMut {
        let h = Head::request(&mut BytesMut::from(text), 1024)
            .unwrap()
            .unwrap();
        let r = parse(h, "192.0.2.1:1".parse().unwrap(), Instant::now()).unwrap();
        outgoing_head(&r, "192.0.2.1:1".parse().unwrap())
    }

    #[test]
    fn a_clients_level_header_never_reaches_the_pe() {
        let text = "GET / HTTP/1.1\r\nHost: x\r\nX-Rserpool-Level: 9\r\nx-tier: 1\r\n\
                    x-rserpool-level: 8\r\nX-Tier: 2\r\n\r\n";
        let h = Head::request(&mut BytesMut::from(text), 1024)
            .unwrap()
            .unwrap();
        let mut r = parse(h, "192.0.2.1:1".parse().unwrap(), Instant::now()).unwrap();
        r.level = 3;
        let peer = "192.0.2.1:1".parse().unwrap();
        let values = |out: BytesMut, name: &str| {
            let h = Head::request(&mut BytesMut::from(&out[..]), 4096)
                .unwrap()
                .unwrap();
            h.values(name).map(<[u8]>::to_vec).collect::<Vec<_>>()
        };
        // Without [levels]: dropped, and nothing in its place.
        assert!(values(outgoing_head(&r, peer), "x-rserpool-level").is_empty());
        // With a configured header: the client's copies go, the proxy's level comes.
        let out = outgoing_head_with(&r, peer, "x-tier", true);
        assert_eq!(values(out.clone(), "x-tier"), [b"3".to_vec()]);
        assert_eq!(
            values(out, "x-rserpool-level").len(),
            2,
            "other headers pass"
        );
    }

    #[test]
    fn every_forwarding_header_of_the_client_goes_before_its_address() {
        // Found by fuzzing: an empty value made an empty first element; and only the last
        // of several headers was kept.
        let out = forwarded_request(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.0.0.1\r\nForwarded: \r\n\
             X-Forwarded-For: ,\r\nX-Forwarded-For: 10.0.0.2, 10.0.0.3\r\n\r\n",
        );
        let h = Head::request(&mut BytesMut::from(&out[..]), 4096)
            .unwrap()
            .unwrap();
        let all = |name| h.values(name).collect::<Vec<_>>();
        assert_eq!(
            all("x-forwarded-for"),
            [&b"10.0.0.1, 10.0.0.2, 10.0.0.3, 192.0.2.1"[..]]
        );
        assert_eq!(
            all("forwarded"),
            [&b"for=192.0.2.1;host=\"x\";proto=http"[..]]
        );
    }

    #[test]
    fn a_connection_option_cannot_take_away_the_framing_or_the_host() {
        // Found by fuzzing: the proxy read the body by its Content-Length and then sent the
        // head without it, so the PE took the body for a request of its own.
        let out = forwarded_request(
            "POST / HTTP/1.1\r\nHost: x\r\nConnection: content-length, host, x-a\r\n\
             X-A: 1\r\nContent-Length: 5\r\n\r\n",
        );
        let h = Head::request(&mut BytesMut::from(&out[..]), 4096)
            .unwrap()
            .unwrap();
        assert_eq!(h.get("content-length"), Some(&b"5"[..]));
        assert_eq!(h.get("host"), Some(&b"x"[..]));
        assert_eq!(h.get("x-a"), None);
        let resp = forwarded_response(
            "HTTP/1.1 200 OK\r\nConnection: transfer-encoding\r\n\
             Transfer-Encoding: chunked\r\n\r\n",
            true,
        );
        assert_eq!(
            &resp[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
    }

    #[test]
    fn an_ipv6_client_is_quoted_in_forwarded_and_bare_in_x_forwarded_for() {
        let h = Head::request(
            &mut BytesMut::from("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            1024,
        )
        .unwrap()
        .unwrap();
        let peer: SocketAddr = "[2001:db8::1]:5".parse().unwrap();
        let r = parse(h, peer, Instant::now()).unwrap();
        let out = outgoing_head(&r, peer);
        let h = Head::request(&mut BytesMut::from(&out[..]), 4096)
            .unwrap()
            .unwrap();
        assert_eq!(h.get("x-forwarded-for"), Some(&b"2001:db8::1"[..]));
        assert_eq!(
            h.get("forwarded"),
            Some(&b"for=\"[2001:db8::1]\";host=\"x\";proto=http"[..])
        );
        // An IPv4 client on a dual-stack socket is written as IPv4.
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:5".parse().unwrap();
        let out = outgoing_head(&r, mapped);
        assert!(
            out.windows(20).any(|w| w == b"X-Forwarded-For: 192"),
            "{out:?}"
        );
    }

    #[test]
    fn the_host_goes_into_forwarded_only_where_it_needs_no_escaping() {
        let fwd = |host: &str| {
            let out = forwarded_request(&format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n"));
            let h = Head::request(&mut BytesMut::from(&out[..]), 4096)
                .unwrap()
                .unwrap();
            String::from_utf8(h.get("forwarded").unwrap().to_vec()).unwrap()
        };
        assert_eq!(fwd("a:80"), "for=192.0.2.1;host=\"a:80\";proto=http");
        assert_eq!(
            fwd("[::1]:8080"),
            "for=192.0.2.1;host=\"[::1]:8080\";proto=http"
        );
        // Found by fuzzing: a backslash escaped the closing quote; a comma split the element
        // for parsers that ignore quoting.
        for odd in ["a\\", "a\"", "a,for=192.0.2.9", "a;proto=https"] {
            assert_eq!(fwd(odd), "for=192.0.2.1;proto=http", "{odd}");
        }
    }

    fn forwarded_response(text: &str, keep: bool) -> BytesMut {
        let h = Head::response(&mut BytesMut::from(text), 1024)
            .unwrap()
            .unwrap();
        let mut out = BytesMut::new();
        response_head(&h, &mut out, keep, 1, None);
        out
    }

    #[test]
    fn a_response_head_goes_to_the_client_with_crlf_line_ends() {
        // Found by fuzzing: a status line ending in a bare LF went out with the whole head
        // after it, so the headers reached the client twice, the second time as body.
        assert_eq!(
            &forwarded_response("HTTP/1.1 200\n\n", true)[..],
            b"HTTP/1.1 200\r\n\r\n"
        );
        assert_eq!(
            &forwarded_response("\r\nHTTP/1.1 200 OK\nA: 1\n\n", false)[..],
            b"HTTP/1.1 200 OK\r\nA: 1\r\nConnection: close\r\n\r\n"
        );
    }
}
