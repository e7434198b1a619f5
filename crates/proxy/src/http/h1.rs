//! HTTP/1.1 clients: the connection's requests one after another (keep-alive, pipelining,
//! timeouts, drain), each read, parsed, routed and classified, its body held when it is small
//! (`prepare`: up to `retry-buffer`, so that the request can be sent again), then handed to
//! the pipeline ([`crate::http::pipeline::forward`]), which answers it through the client's
//! side of [`crate::http::downstream`]. Also: HTTPS (the TLS handshake, then ALPN `h2` to the
//! HTTP/2 front), h2c with prior knowledge, and routes that pin their connection to a PE
//! (`splice = "kernel"`, carried on by [`crate::l4::tcp`]).
use crate::balance::pools::Pool;
use crate::ctx::{Ctx, until_set};
use crate::http::client_stream::{Client, ClientStream};
use crate::http::downstream::Downstream;
use crate::http::message::{Framing, Head, HeadError};
use crate::http::park::Parkable;
use crate::http::pipeline::{classify, forward, route};
use crate::http::request::{Outgoing, Request, parse};
use crate::http::upstream::h1::outgoing_head_with;
use bytes::{BufMut, Bytes, BytesMut};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Poll, ready};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::sync::OwnedSemaphorePermit;
use tracing::debug;

/// What became of one request.
pub(crate) enum Next {
    KeepAlive,
    Close,
    /// The client speaks HTTP/2 with prior knowledge; what it sent so far.
    H2c(Bytes),
}

/// Serves one client connection until it closes, errs, times out or the proxy drains;
/// `place` (its place among the listener's connections) is held to the end.
///
/// A plain function, and every layer below takes the connection's state by reference: each
/// `async fn` that takes an argument and awaits a future given it keeps its own copy beside
/// that future's, and an idle connection costs its task's size.
pub(crate) fn serve(
    stream: std::net::TcpStream,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    place: Option<OwnedSemaphorePermit>,
) -> impl Future<Output = ()> + Send + 'static {
    serve_stream(ClientStream::new(stream), peer, ctx, place, true)
}

/// The first line of the HTTP/2 preface, which an HTTP/1.1 parser refuses.
const H2C_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// Time for an HTTPS client's TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves an HTTPS client: the TLS handshake (the certificate by SNI), then as [`serve`].
pub(crate) async fn serve_tls(
    stream: std::net::TcpStream,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    tls: Arc<rserpool_tls::rustls::ServerConfig>,
) {
    let Ok(s) = tokio::net::TcpStream::from_std(stream) else {
        return;
    };
    let accept = rserpool_tls::tokio_rustls::TlsAcceptor::from(tls).accept(s);
    let limit = HANDSHAKE_TIMEOUT.min(ctx.request_timeout());
    let failed = match tokio::time::timeout(limit, accept).await {
        Ok(Ok(t)) if t.get_ref().1.alpn_protocol() == Some(b"h2") => {
            return Box::pin(crate::http::h2::front::serve(t, Bytes::new(), peer, ctx)).await;
        }
        Ok(Ok(t)) => return serve_stream(ClientStream::tls(t), peer, ctx, None, true).await,
        Ok(Err(e)) => format!("TLS handshake failed: {e}"),
        Err(_) => format!("no TLS handshake within {limit:?}"),
    };
    // Counted (`rserpool_proxy_tls_handshake_failures_total`); scanners make many of these.
    ctx.tls_failures.fetch_add(1, Ordering::Relaxed);
    debug!("client {peer}: {failed}");
}

/// `fresh`: a new connection, not yet asked for a request (else one resumed from the
/// parker, its client's next request there to read).
async fn serve_stream(
    stream: ClientStream,
    peer: SocketAddr,
    mut ctx: Arc<Ctx>,
    place: Option<OwnedSemaphorePermit>,
    fresh: bool,
) {
    let mut c = Client {
        stream,
        buf: BytesMut::new(),
        peer,
    };
    if fresh {
        c.buf.reserve(16 * 1024);
    }
    // Between requests the task holds the connection and its wait for the next request,
    // little else (an idle kept-alive connection costs its task's size); a request's state is
    // boxed for as long as it is served.
    let mut first = fresh;
    // One per connection: a receiver cloned per request would touch the drain signal's
    // shared counts (atomics every thread writes) twice per request.
    let mut draining = ctx.draining.clone();
    // The first pass reads at once: a new connection's first request, a resumed one's next.
    let mut wait = false;
    loop {
        if wait {
            match wait_request(&mut c, &ctx, &mut draining).await {
                Waited::Request => {}
                Waited::Gone => break,
                Waited::Park(until) => {
                    // If it cannot be parked (the parker gone), it is closed as at the idle
                    // timeout, only sooner.
                    park(c, ctx, place, until);
                    return;
                }
            }
        }
        wait = true;
        match Box::pin(next_request(&mut c, &mut ctx, first, &mut draining)).await {
            Next::KeepAlive => first = false,
            Next::Close => break,
            Next::H2c(pre) => {
                // Served from the task itself, not from within the request's box.
                if let Ok(s) = c.stream.take_stream() {
                    Box::pin(crate::http::h2::front::serve(s, pre, peer, ctx)).await;
                }
                return;
            }
        }
    }
    c.stream.close().await;
}

/// The proxy's drain signal, as a connection watches it.
type Draining = tokio::sync::watch::Receiver<bool>;

/// How long an idle kept-alive connection of a draining proxy may still bring a request.
pub(crate) const DRAIN_IDLE_GRACE: std::time::Duration = std::time::Duration::from_millis(1000);

/// How long a kept-alive connection waits for its next request in its own task before it
/// moves to the parker (`crate::http::park`) to wait there, at a fraction of the memory.
const PARK_AFTER: Duration = Duration::from_millis(500);

/// What came of waiting for a kept-alive connection's next request.
enum Waited {
    /// Something arrived (read into the buffer; over TLS, waiting in rustls).
    Request,
    /// The client closed, or stayed quiet for the idle timeout (or, once the proxy drains,
    /// for [`DRAIN_IDLE_GRACE`]).
    Gone,
    /// Quiet for [`PARK_AFTER`]: to be parked until its idle timeout ends (then).
    Park(tokio::time::Instant),
}

/// Waits for a kept-alive connection's next request holding no read buffer. Readiness is
/// polled, not awaited as a future: this wait is what an idle connection is made of.
async fn wait_request(c: &mut Client, ctx: &Ctx, draining: &mut Draining) -> Waited {
    // Pipelined requests are there already.
    if !c.buf.is_empty() {
        return Waited::Request;
    }
    // An HTTPS connection is not parked (tokio-rustls cannot rebuild a stream from its parts).
    let tls = c.stream.is_tls();
    let (stream, buf) = (&mut c.stream, &mut c.buf);
    let now = tokio::time::Instant::now();
    let idle_until = now + ctx.idle_timeout();
    // A drain already under way completes `drain` at its first poll: nothing is parked then.
    let mut park_at =
        (!tls && ctx.park.is_some() && now + PARK_AFTER < idle_until).then(|| now + PARK_AFTER);
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(park_at.unwrap_or(idle_until)));
    let mut drain = std::pin::pin!(until_set(draining));
    let mut drained = false;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(came) = stream.poll_arrival(cx, buf) {
            return Poll::Ready(if came { Waited::Request } else { Waited::Gone });
        }
        if !drained && drain.as_mut().poll(cx).is_ready() {
            // Not parked any more: the grace is waited for here.
            drained = true;
            park_at = None;
            let grace = tokio::time::Instant::now() + DRAIN_IDLE_GRACE;
            sleep.as_mut().reset(grace.min(idle_until));
        }
        ready!(sleep.as_mut().poll(cx));
        Poll::Ready(match park_at {
            Some(_) => Waited::Park(idle_until),
            None => Waited::Gone,
        })
    })
    .await
}

/// A kept-alive connection parked (`crate::http::park`): what it needs to go on.
struct Parked {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    place: Option<OwnedSemaphorePermit>,
}

impl std::os::fd::AsFd for Parked {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

impl Parkable for Parked {
    fn resume(self: Box<Self>) {
        let p = *self;
        crate::workers::spawn(serve_stream(
            ClientStream::new(p.stream),
            p.peer,
            p.ctx,
            p.place,
            false,
        ));
    }
}

/// Hands an idle connection to the parker.
fn park(
    c: Client,
    ctx: Arc<Ctx>,
    place: Option<OwnedSemaphorePermit>,
    until: tokio::time::Instant,
) {
    let (Some(parker), Some(stream)) = (ctx.park.clone(), c.stream.into_std()) else {
        return;
    };
    let p = Box::new(Parked {
        stream,
        peer: c.peer,
        ctx,
        place,
    });
    let _ = parker.park(p, until);
}

/// One request: its head read (within the timeouts; a draining proxy gives a quiet client a
/// grace), then served.
pub(super) async fn next_request(
    c: &mut Client,
    ctx: &mut Arc<Ctx>,
    first: bool,
    draining: &mut Draining,
) -> Next {
    let peer = c.peer;
    // A kept-alive connection's wait, and a drain's grace in it, were `wait_request`'s.
    let idle = first && c.buf.is_empty();
    let head = tokio::select! {
        r = read_head_in_time(c, ctx) => r,
        () = until_set(draining), if idle => {
            // A busy client's next request may be on its way: it is served (with
            // `Connection: close`) rather than met with a close it cannot tell from a
            // failure. A client that stays quiet is closed after the grace.
            match tokio::time::timeout(DRAIN_IDLE_GRACE, read_head_in_time(c, ctx)).await {
                Ok(r) => r,
                Err(_) => return Next::Close,
            }
        }
    };
    let head = match head {
        Ok(Ok(Some(h))) => h,
        Ok(Ok(None)) => return Next::Close,
        Ok(Err(ReadHeadError::Io)) => return Next::Close,
        Ok(Err(ReadHeadError::Head(HeadError::TooLarge))) => {
            ctx.refused(peer, None, 431);
            let _ = c.reply(431, "request head too large", ctx).await;
            return Next::Close;
        }
        Ok(Err(ReadHeadError::Head(HeadError::LineTooLong))) => {
            ctx.refused(peer, None, 414);
            let _ = c.reply(414, "request line too long", ctx).await;
            return Next::Close;
        }
        Ok(Err(ReadHeadError::Head(HeadError::Malformed | HeadError::Version)))
            if first && ctx.http2 && c.buf.starts_with(H2C_PREFACE) =>
        {
            // h2c with prior knowledge.
            // Taken whole: the rest of the buffer's capacity would stay with the
            // connection for its life.
            return Next::H2c(std::mem::take(&mut c.buf).freeze());
        }
        Ok(Err(ReadHeadError::Head(HeadError::Version))) => {
            ctx.refused(peer, None, 505);
            let _ = c
                .reply(
                    505,
                    "only HTTP/1.x here (HTTP/2: with prior knowledge, or TLS and ALPN)",
                    ctx,
                )
                .await;
            return Next::Close;
        }
        Ok(Err(ReadHeadError::Head(HeadError::Malformed))) => {
            debug!("client {peer}: malformed request");
            ctx.refused(peer, None, 400);
            let _ = c.reply(400, "malformed request", ctx).await;
            return Next::Close;
        }
        Err(_) => {
            if !c.buf.is_empty() || first {
                // A connection that sent nothing is no request: answered, not logged (what
                // HAProxy's `option dontlognull` does; port probes would fill the log).
                if !c.buf.is_empty() {
                    ctx.refused(peer, None, 408);
                }
                let _ = c.reply(408, "request timeout", ctx).await;
            }
            return Next::Close;
        }
    };
    // After a reload, the next request takes the new routes, pools and levels.
    if let Some(newer) = ctx.newer() {
        *ctx = newer;
    }
    // A response that said keep-alive before a drain began is kept to: the client may
    // send its next request at once, and it is served (with `Connection: close`).
    request(c, head, ctx).await
}

enum ReadHeadError {
    Io,
    Head(HeadError),
}

/// The next request head within the header timeout (a kept-alive connection waited for its
/// first byte in `wait_request`). `Err` when the timeout passed.
async fn read_head_in_time(
    c: &mut Client,
    ctx: &Ctx,
) -> Result<Result<Option<Head>, ReadHeadError>, tokio::time::error::Elapsed> {
    tokio::time::timeout(ctx.header_timeout(), read_head(c, ctx.cfg.max_head)).await
}

async fn read_head(c: &mut Client, max: usize) -> Result<Option<Head>, ReadHeadError> {
    loop {
        if !c.buf.is_empty()
            && let Some(h) = Head::request(&mut c.buf, max).map_err(ReadHeadError::Head)?
        {
            return Ok(Some(h));
        }
        c.buf.reserve(16 * 1024);
        let n = c
            .stream
            .read_buf(&mut c.buf)
            .await
            .map_err(|_| ReadHeadError::Io)?;
        if n == 0 {
            return if c.buf.is_empty() {
                Ok(None)
            } else {
                Err(ReadHeadError::Head(HeadError::Malformed))
            };
        }
    }
}

/// One request through the pipeline.
async fn request(c: &mut Client, head: Head, ctx: &Ctx) -> Next {
    let started = Instant::now();
    let mut r = match parse(head, c.peer, started) {
        Ok(r) => r,
        Err((code, why, raw)) => {
            ctx.refused(c.peer, Some(&raw), code);
            let _ = c.reply(code, why, ctx).await;
            return Next::Close;
        }
    };
    let Some(target) = route(&r, ctx) else {
        ctx.refused(c.peer, Some(&r.head.raw), 404);
        let _ = c.reply(404, "no route", ctx).await;
        return Next::Close;
    };
    let pool = &target.pool;
    r.level = classify(&r, c.peer, ctx);
    if target.kernel && ctx.kernel.is_some() {
        // Boxed: connecting and the splice are a large future, and every request's would
        // carry its size.
        return Box::pin(pin(c, r, pool, ctx)).await;
    }
    let Ok(out) = prepare(c, &mut r, ctx).await else {
        return Next::Close;
    };
    let keep = forward(&mut Downstream::h1(c, &out), &r, pool, ctx).await;
    if keep && r.keep_alive {
        Next::KeepAlive
    } else {
        Next::Close
    }
}

/// A request on a route that pins its connection (`splice = "kernel"`): it goes to a PE as
/// any request, and so does the rest of the connection, unchanged, through the kernel
/// splice once the sockets are quiet (or relayed here when it cannot be handed over).
async fn pin(c: &mut Client, r: Request, pool: &Arc<Pool>, ctx: &Ctx) -> Next {
    let Ok(client) = c.stream.registered() else {
        return Next::Close;
    };
    let pe = match crate::l4::tcp::connect_pe(client, c.peer, pool, r.level, true, r.started, ctx)
        .await
    {
        Ok(pe) => pe,
        Err(why) => {
            let _ = c.reply(503, why, ctx).await;
            return Next::Close;
        }
    };
    let (level_header, send_level) = ctx.level_header();
    let mut first = outgoing_head_with(&r, c.peer, level_header, send_level);
    // The connection is the client's and the PE's alone from here: what the client says of
    // it (Connection: close, an Upgrade) goes through.
    if first.ends_with(b"\r\n\r\n") {
        first.truncate(first.len() - 2);
        for name in ["Connection", "Upgrade"] {
            if let Some(v) = r.head.get(name) {
                first.put_slice(name.as_bytes());
                first.put_slice(b": ");
                first.put_slice(v);
                first.put_slice(b"\r\n");
            }
        }
        first.put_slice(b"\r\n");
    }
    // What the client sent after the head (body, pipelined requests) follows it unchanged.
    first.extend_from_slice(&c.buf.split());
    let Ok(client) = c.stream.take_stream() else {
        return Next::Close;
    };
    crate::l4::tcp::carry(client, c.peer, pe, &first, r.started, ctx).await;
    Next::Close
}

/// Step prepare: the head for the PE, and the body read and held if it is small enough.
pub(crate) async fn prepare(c: &mut Client, r: &mut Request, ctx: &Ctx) -> io::Result<Outgoing> {
    let (level_header, send_level) = ctx.level_header();
    let head = outgoing_head_with(r, c.peer, level_header, send_level);
    let held = match r.framing {
        Framing::None => Some(Bytes::new()),
        Framing::Length(n) if !r.expect_continue && n <= ctx.cfg.retry_buffer as u64 => {
            Some(read_exact_body(c, n as usize, ctx.idle_timeout()).await?)
        }
        _ => None,
    };
    if held.is_some() {
        r.framing = Framing::None;
    }
    Ok(Outgoing { head, held })
}

async fn read_exact_body(c: &mut Client, n: usize, idle: Duration) -> io::Result<Bytes> {
    while c.buf.len() < n {
        c.buf.reserve(n - c.buf.len());
        let read = tokio::time::timeout(idle, c.stream.read_buf(&mut c.buf))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        if read == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(c.buf.split_to(n).freeze())
}
