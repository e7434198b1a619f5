//! The relay to a PE that speaks HTTP/2 (`[pool.NAME] protocol = "h2"`), from HTTP/2 clients
//! (frames relayed as they come, trailers included: gRPC) and HTTP/1.1 clients (the body
//! taken out of its HTTP/1.1 framing; the response back as HTTP/1.1, chunked when the PE gave
//! no length, its trailers in the chunked trailer section).
//!
//! Connections: a few per PE, each
//! carrying as many streams at once as the PE allows (its SETTINGS_MAX_CONCURRENT_STREAMS);
//! a new connection is opened only when every open one is full, one at a time (a burst of
//! requests waits for the connection being opened instead of opening one each), and an idle
//! connection is closed when an earlier one has room.

use crate::balance::backend::Backend;
use crate::balance::conns::ConnSet;
use crate::ctx::Ctx;
use crate::http::client_stream::Client;
use crate::http::h2::stream::{Body, Stream, grpc_trailers, send_data};
use crate::http::message::{BodyDecoder, Framing, Piece, frame_into};
use crate::http::pipeline::{Attempt, Failure, Relayed};
use crate::http::request::Outgoing;
use crate::http::request::{Request, forwarding};
use bytes::{BufMut, Bytes, BytesMut};
use h2::client::SendRequest;
use h2::{Reason, RecvStream, SendStream};
use http::header::{HeaderName, HeaderValue};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

/// The HTTP/2 connections to one PE.
#[derive(Debug, Default)]
pub(crate) struct H2Conns {
    conns: Mutex<Vec<Arc<H2Conn>>>,
    /// Held while a connection is being opened.
    opening: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct H2Conn {
    send: SendRequest<Bytes>,
    /// Streams of this proxy open on the connection.
    streams: AtomicUsize,
    /// The connection ended (or sent GOAWAY): no new streams.
    dead: Arc<AtomicBool>,
}

/// A stream's place on a connection, given back when dropped.
pub(crate) struct Slot(Arc<H2Conn>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

impl H2Conns {
    /// A connection with room for one more stream, if one is open.
    fn take(&self) -> Option<(SendRequest<Bytes>, Slot)> {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let mut room: Option<Arc<H2Conn>> = None;
        // The first with room takes the stream; idle ones after it are closed (their
        // streams done, the last handle dropped).
        conns.retain(|c| {
            if c.dead.load(Ordering::Relaxed) {
                return false;
            }
            let n = c.streams.load(Ordering::Relaxed);
            if room.is_some() {
                return n > 0;
            }
            if n < c.send.current_max_send_streams() {
                room = Some(c.clone());
            }
            true
        });
        let c = room?;
        c.streams.fetch_add(1, Ordering::Relaxed);
        Some((c.send.clone(), Slot(c)))
    }

    fn add(&self, c: Arc<H2Conn>) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }

    /// Forgets every connection; their streams finish.
    fn clear(&self) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl ConnSet for H2Conns {
    /// A multiplexed connection is never idle beside a busy one (see [`H2Conns::take`]).
    fn drop_idle(&self) {}
    fn close(&self) {
        self.clear();
    }
}

/// A stream to the PE: on an open connection with room, else on a new one.
pub(crate) async fn stream(b: &Arc<Backend>, ctx: &Ctx) -> io::Result<(SendRequest<Bytes>, Slot)> {
    if let Some(open) = ready(b).await {
        return Ok(open);
    }
    let Some(conns) = b.conns.of::<H2Conns>() else {
        return Err(io::Error::other("no room for the PE's HTTP/2 connections"));
    };
    let _opening = conns.opening.lock().await;
    // Opened by another request while this one waited?
    if let Some(open) = ready(b).await {
        return Ok(open);
    }
    let io = super::connect_pe(b, ctx).await?;
    let h = &ctx.cfg.http2;
    let handshake = h2::client::Builder::new()
        .initial_window_size(h.stream_window)
        .initial_connection_window_size(h.connection_window)
        .max_header_list_size(ctx.cfg.max_head as u32 * 4)
        .handshake::<_, Bytes>(io);
    let (send, conn) = tokio::time::timeout(ctx.connect_timeout(), handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP/2 handshake timed out"))?
        .map_err(io::Error::other)?;
    let dead = Arc::new(AtomicBool::new(false));
    let (pool, id, gone) = (b.pool.clone(), b.id, dead.clone());
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!("pool {pool} PE {id:#010x}: HTTP/2 connection: {e}");
        }
        gone.store(true, Ordering::Relaxed);
    });
    let c = Arc::new(H2Conn {
        send: send.clone(),
        streams: AtomicUsize::new(1),
        dead,
    });
    conns.add(c.clone());
    let send = send.ready().await.map_err(io::Error::other)?;
    Ok((send, Slot(c)))
}

/// A stream on an open connection with room, if there is one.
async fn ready(b: &Backend) -> Option<(SendRequest<Bytes>, Slot)> {
    let (send, slot) = b.conns.of::<H2Conns>()?.take()?;
    match send.ready().await {
        Ok(send) => Some((send, slot)),
        Err(_) => {
            // The connection broke since it was looked at.
            slot.retire();
            None
        }
    }
}

impl Slot {
    /// The connection cannot take new streams (it failed one before the PE saw it).
    pub(crate) fn retire(&self) {
        self.0.dead.store(true, Ordering::Relaxed);
    }
}

/// The request as it goes to an HTTP/2 PE: the client's headers (the connection's own
/// dropped), the forwarding headers and the level, what is left of a gRPC deadline.
pub(crate) fn upstream_request(
    p: &http::request::Parts,
    peer: SocketAddr,
    deadline: Option<tokio::time::Instant>,
    r: &Request,
    ctx: &Ctx,
) -> Option<http::Request<()>> {
    let (level_header, send_level) = ctx.level_header();
    // The client's own headers pass as they came (`p.headers`): only the forwarding ones
    // are taken out of the request.
    let fw = forwarding(r, level_header, |_, _| {});
    let uri = if p.uri.scheme().is_some() && p.uri.authority().is_some() {
        p.uri.clone()
    } else {
        // No :authority (a Host header instead): the HTTP/2 PE needs one.
        let host = std::str::from_utf8(&r.host).ok().filter(|h| !h.is_empty());
        let target = std::str::from_utf8(r.head.target()).ok()?;
        format!("http://{}{target}", host.unwrap_or("localhost"))
            .parse()
            .ok()?
    };
    let mut headers = p.headers.clone();
    for name in [
        level_header,
        "x-forwarded-for",
        "forwarded",
        "host",
        "grpc-timeout",
    ] {
        headers.remove(name);
    }
    let mut v = Vec::with_capacity(64);
    fw.x_forwarded_for(&mut v, peer);
    headers.insert("x-forwarded-for", HeaderValue::from_bytes(&v).ok()?);
    v.clear();
    fw.forwarded(&mut v, peer);
    headers.insert("forwarded", HeaderValue::from_bytes(&v).ok()?);
    if send_level {
        headers.insert(
            HeaderName::from_bytes(level_header.as_bytes()).ok()?,
            HeaderValue::from(r.level as u64),
        );
    }
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(tokio::time::Instant::now());
        let ms = left.as_millis().clamp(1, 99_999_999);
        headers.insert(
            "grpc-timeout",
            HeaderValue::from_str(&format!("{ms}m")).ok()?,
        );
    }
    let mut req = http::Request::new(());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_2;
    *req.headers_mut() = headers;
    Some(req)
}

/// One attempt at a PE over HTTP/2.
pub(crate) async fn to_h2(
    s: &mut Stream,
    (send, slot): (h2::client::SendRequest<Bytes>, Slot),
    r: &Request,
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let b = &attempt.pe;
    let Some(req) = upstream_request(&s.parts, s.peer, s.deadline, r, ctx) else {
        return Err(Failure::BadRequest);
    };
    let mut send = send;
    let no_body = matches!(&s.body, Body::Held(d) if d.is_empty());
    let (resp, mut up) = match send.send_request(req, no_body) {
        Ok(v) => v,
        Err(e) => {
            slot.retire();
            return Err(
                if e.is_go_away() || e.reason() == Some(Reason::REFUSED_STREAM) {
                    Failure::Refused
                } else {
                    Failure::NoResponse {
                        body_sent: false,
                        error: io::Error::other(e),
                    }
                },
            );
        }
    };
    // The body goes up while the response may already come down (gRPC streams both ways).
    let streamed = match &mut s.body {
        Body::Held(d) => {
            if !d.is_empty() {
                let d = d.clone();
                b.stats
                    .bytes_in
                    .fetch_add(d.len() as u64, Ordering::Relaxed);
                up.reserve_capacity(d.len());
                if up.capacity() >= d.len() {
                    // Within the window (a small call): sent at once, no task.
                    let _ = up.send_data(d, true);
                } else {
                    tokio::spawn(async move {
                        let _ = send_data(&mut up, d, true).await;
                    });
                }
            }
            false
        }
        Body::Streamed { prefix, rest } => {
            let (prefix, rest) = (prefix.clone(), rest.take());
            let pe = b.clone();
            tokio::spawn(async move { pump(prefix, rest, up, &pe).await });
            true
        }
    };
    let mut limit = tokio::time::Instant::now() + ctx.request_timeout();
    if let Some(d) = s.deadline {
        limit = limit.min(d);
    }
    let resp = match tokio::time::timeout_at(limit, resp).await {
        Err(_) if s.expired() => return Err(Failure::Deadline),
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(no_response(e, streamed)),
        Ok(Ok(resp)) => resp,
    };
    b.note_latency(attempt.rif, attempt.sent.elapsed());
    let (parts, mut body) = resp.into_parts();
    let code = parts.status.as_u16();
    let end = body.is_end_stream();
    let tx = match s
        .respond
        .send_response(http::Response::from_parts(parts, ()), end)
    {
        Ok(tx) => s.tx.insert(tx),
        Err(_) => return Err(Failure::Client),
    };
    let mut bytes = 0u64;
    if !end {
        let mut sent_end = false;
        loop {
            // A timer only where there is a deadline: one per DATA frame costs.
            let next = match s.deadline {
                Some(until) => tokio::time::timeout_at(until, body.data()).await,
                None => Ok(body.data().await),
            };
            let d = match next {
                Err(_) => {
                    // The deadline passed mid-response: the PE's stream is reset (dropped)
                    // and the client told.
                    let _ = tx.send_trailers(grpc_trailers(4, "deadline exceeded"));
                    return Ok(Relayed {
                        code,
                        keep: true,
                        bytes,
                    });
                }
                Ok(None) => break,
                Ok(Some(Ok(d))) => d,
                Ok(Some(Err(_))) => return Err(Failure::Broken { relayed: true }),
            };
            let n = d.len();
            bytes += n as u64;
            // Ended without trailers: END_STREAM on the last bytes.
            let last = body.is_end_stream();
            send_data(tx, d, last).await.map_err(|_| Failure::Client)?;
            let _ = body.flow_control().release_capacity(n);
            if last {
                sent_end = true;
                break;
            }
        }
        if !sent_end {
            match body.trailers().await {
                Ok(Some(t)) => tx.send_trailers(t).map_err(|_| Failure::Client)?,
                Ok(None) => send_data(tx, Bytes::new(), true)
                    .await
                    .map_err(|_| Failure::Client)?,
                Err(_) => return Err(Failure::Broken { relayed: true }),
            }
        }
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    drop(slot);
    Ok(Relayed {
        code,
        keep: true,
        bytes,
    })
}

/// What an HTTP/2 PE's failure before its response head means for the request (`streamed`:
/// part of its body went, so it cannot go again).
pub(crate) fn no_response(e: h2::Error, streamed: bool) -> Failure {
    let unprocessed = e.is_go_away() || e.reason() == Some(Reason::REFUSED_STREAM);
    if unprocessed && !streamed {
        Failure::Refused
    } else {
        Failure::NoResponse {
            body_sent: streamed,
            error: io::Error::other(e),
        }
    }
}

/// Copies a streamed request body (and its trailers) from the client to an HTTP/2 PE.
async fn pump(prefix: Bytes, rest: Option<RecvStream>, mut up: SendStream<Bytes>, pe: &Backend) {
    let Some(mut recv) = rest else {
        let _ = send_data(&mut up, prefix, true).await;
        return;
    };
    pe.stats
        .bytes_in
        .fetch_add(prefix.len() as u64, Ordering::Relaxed);
    if send_data(&mut up, prefix, false).await.is_err() {
        return;
    }
    while let Some(d) = recv.data().await {
        let Ok(d) = d else {
            up.send_reset(Reason::CANCEL);
            return;
        };
        let n = d.len();
        pe.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        if send_data(&mut up, d, false).await.is_err() {
            return;
        }
        let _ = recv.flow_control().release_capacity(n);
    }
    match recv.trailers().await {
        Ok(Some(t)) => {
            let _ = up.send_trailers(t);
        }
        Ok(None) => {
            let _ = send_data(&mut up, Bytes::new(), true).await;
        }
        Err(_) => up.send_reset(Reason::CANCEL),
    }
}

/// The request's method, target (with its Host as authority) and end-to-end headers, as the
/// parts of an HTTP/2 request.
pub(crate) fn parts_of(r: &Request) -> Option<http::request::Parts> {
    let host = std::str::from_utf8(&r.host).ok().filter(|h| !h.is_empty());
    let target = std::str::from_utf8(r.head.target()).ok()?;
    let uri: http::Uri = format!("http://{}{target}", host.unwrap_or("localhost"))
        .parse()
        .ok()?;
    let mut req = http::Request::builder()
        .method(http::Method::from_bytes(r.head.method()).ok()?)
        .uri(uri);
    for (n, v) in r.head.end_to_end() {
        let skip: [&[u8]; 4] = [b"host", b"transfer-encoding", b"content-length", b"expect"];
        if skip.iter().any(|s| n.eq_ignore_ascii_case(s)) {
            continue;
        }
        req = req.header(n, v);
    }
    if let Framing::Length(n) = r.framing {
        req = req.header(http::header::CONTENT_LENGTH, n);
    }
    if r.head.has_token("te", "trailers") {
        req = req.header(http::header::TE, "trailers");
    }
    Some(req.body(()).ok()?.into_parts().0)
}

/// One attempt at an HTTP/2 PE.
pub(crate) async fn exchange(
    c: &mut Client,
    (mut send, slot): (h2::client::SendRequest<Bytes>, Slot),
    r: &Request,
    parts: &http::request::Parts,
    out: &Outgoing,
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let b = &attempt.pe;
    let Some(mut req) = upstream_request(parts, c.peer, None, r, ctx) else {
        return Err(Failure::BadRequest);
    };
    if let Some(held) = &out.held {
        // The held body's length, whatever framing it came in.
        req.headers_mut()
            .insert(http::header::CONTENT_LENGTH, held.len().into());
    }
    let no_body = out.held.as_ref().is_some_and(Bytes::is_empty);
    let (resp, mut up) = match send.send_request(req, no_body) {
        Ok(v) => v,
        Err(e) => {
            slot.retire();
            return Err(no_response(e, false));
        }
    };
    let streamed = out.held.is_none();
    match &out.held {
        Some(d) if !d.is_empty() => {
            b.stats
                .bytes_in
                .fetch_add(d.len() as u64, Ordering::Relaxed);
            if send_data(&mut up, d.clone(), true).await.is_err() {
                // The PE's answer (or its reset) tells what happened.
            }
        }
        Some(_) => {}
        None => send_body(c, &mut up, r.framing, b, ctx).await?,
    }
    let limit = tokio::time::Instant::now() + ctx.request_timeout();
    let resp = match tokio::time::timeout_at(limit, resp).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(no_response(e, streamed)),
        Ok(Ok(resp)) => resp,
    };
    b.note_latency(attempt.rif, attempt.sent.elapsed());
    let (head, mut body) = resp.into_parts();
    let code = head.status.as_u16();
    let no_response_body = r.head.method() == b"HEAD" || code == 204 || code == 304;
    let length = head
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    // Framing for the client: the PE's length; else chunked (HTTP/1.1) or to the close.
    let chunked = !no_response_body && length.is_none() && r.head.minor == 1;
    let close_delimited = !no_response_body && length.is_none() && r.head.minor == 0;
    let keep = r.keep_alive && !close_delimited && !*ctx.draining.borrow();
    let mut w = BytesMut::with_capacity(256);
    w.put_slice(
        format!(
            "HTTP/1.{} {code} {}\r\n",
            r.head.minor,
            head.status.canonical_reason().unwrap_or("")
        )
        .as_bytes(),
    );
    for (n, v) in &head.headers {
        w.put_slice(n.as_str().as_bytes());
        w.put_slice(b": ");
        w.put_slice(v.as_bytes());
        w.put_slice(b"\r\n");
    }
    if chunked {
        w.put_slice(b"Transfer-Encoding: chunked\r\n");
    }
    if !keep {
        w.put_slice(b"Connection: close\r\n");
    } else if r.head.minor == 0 {
        w.put_slice(b"Connection: keep-alive\r\n");
    }
    w.put_slice(b"\r\n");
    let mut bytes = w.len() as u64;
    if no_response_body || body.is_end_stream() {
        if chunked {
            w.put_slice(b"0\r\n\r\n");
        }
        c.stream.write_all(&w).await.map_err(|_| Failure::Client)?;
        return Ok(Relayed { code, keep, bytes });
    }
    c.stream.write_all(&w).await.map_err(|_| Failure::Client)?;
    while let Some(d) = body.data().await {
        let Ok(d) = d else {
            return Err(Failure::Broken { relayed: true });
        };
        let n = d.len();
        w.clear();
        if chunked {
            frame_into(&mut w, &d, true);
            c.stream.write_all(&w).await
        } else {
            c.stream.write_all(&d).await
        }
        .map_err(|_| Failure::Client)?;
        let _ = body.flow_control().release_capacity(n);
        bytes += n as u64;
    }
    let trailers = body
        .trailers()
        .await
        .map_err(|_| Failure::Broken { relayed: true })?;
    if chunked {
        w.clear();
        w.put_slice(b"0\r\n");
        for (n, v) in trailers.iter().flatten() {
            w.put_slice(n.as_str().as_bytes());
            w.put_slice(b": ");
            w.put_slice(v.as_bytes());
            w.put_slice(b"\r\n");
        }
        w.put_slice(b"\r\n");
        c.stream.write_all(&w).await.map_err(|_| Failure::Client)?;
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    drop(slot);
    Ok(Relayed { code, keep, bytes })
}

/// Streams the client's body (taken out of its framing) to the PE.
async fn send_body(
    c: &mut Client,
    up: &mut SendStream<Bytes>,
    framing: Framing,
    b: &Backend,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let mut dec = BodyDecoder::new(framing);
    loop {
        match dec.next(&mut c.buf).map_err(|_| Failure::BadBody)? {
            Piece::Data(d) if !d.is_empty() => {
                b.stats
                    .bytes_in
                    .fetch_add(d.len() as u64, Ordering::Relaxed);
                if send_data(up, d, false).await.is_err() {
                    // The PE stopped taking it; its answer tells why.
                    return Ok(());
                }
            }
            Piece::Data(_) => {
                c.buf.reserve(64 * 1024);
                let read = tokio::time::timeout(ctx.idle_timeout(), c.stream.read_buf(&mut c.buf));
                match read.await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return Err(Failure::Client),
                }
            }
            // A client's trailers are not passed on.
            Piece::Trailers(_) | Piece::End => {
                let _ = send_data(up, Bytes::new(), true).await;
                return Ok(());
            }
        }
    }
}
