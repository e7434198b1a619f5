//! HTTP/1.1 mode: each request is routed (Host, path prefix) to a pool and sent to a PE chosen
//! there, over a kept-alive connection from the PE's idle set when there is one.
//!
//! A request goes through named steps, each a function from one value to the next:
//! `parse` → `route` → `prepare` → `select` → `send` → `relay` → `finish` (see `request`); the
//! steps from select on repeat while the request fails over to another PE. A new concern
//! (admission before select, accounting at select and finish) is a step or a field of a
//! step's value, not a branch inside another step.
//!
//! Heads are parsed, bodies only delimited and streamed; a request body up to `retry-buffer`
//! is held so that the request can be sent again. A connect failure moves the request to the
//! next PE; a PE that closes or resets before any response byte gets the request once more on
//! another PE if the method is idempotent and the body was held. A stale kept-alive
//! connection that closes before answering costs no failure: the request goes out again on a
//! new connection.

use crate::backend::{Backend, BackendConn, PeStream};
use crate::client_stream::ClientStream;
use crate::ctx::{Ctx, until_set};
use crate::levels::RequestFacts;
use crate::message::{
    BodyState, Framing, Head, HeadError, error_response, error_response_with, framing,
    response_framing,
};
use crate::pools::{NoPick, Pool};
use crate::routes::Target;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

const READ_CHUNK: usize = 64 * 1024;
/// Responses up to this size (head and body) go to the client in one write.
const COALESCE: usize = 64 * 1024;

pub(crate) struct Client {
    pub(crate) stream: ClientStream,
    pub(crate) buf: BytesMut,
    pub(crate) peer: SocketAddr,
}

/// What became of one request.
pub(crate) enum Next {
    KeepAlive,
    Close,
}

/// Serves one client connection until it closes, errs, times out or the proxy drains.
pub(crate) async fn serve(stream: std::net::TcpStream, peer: SocketAddr, ctx: Ctx) {
    serve_stream(ClientStream::new(stream), peer, ctx).await;
}

/// The first line of the HTTP/2 preface, which an HTTP/1.1 parser refuses.
const H2C_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// Time for an HTTPS client's TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves an HTTPS client: the TLS handshake (the certificate by SNI), then as [`serve`].
pub(crate) async fn serve_tls(
    stream: std::net::TcpStream,
    peer: SocketAddr,
    ctx: Ctx,
    tls: Arc<rserpool_tls::rustls::ServerConfig>,
) {
    let Ok(s) = tokio::net::TcpStream::from_std(stream) else {
        return;
    };
    let accept = rserpool_tls::tokio_rustls::TlsAcceptor::from(tls).accept(s);
    let limit = HANDSHAKE_TIMEOUT.min(ctx.request_timeout());
    let failed = match tokio::time::timeout(limit, accept).await {
        Ok(Ok(t)) if t.get_ref().1.alpn_protocol() == Some(b"h2") => {
            return crate::http2::front::serve(t, Bytes::new(), peer, ctx).await;
        }
        Ok(Ok(t)) => return serve_stream(ClientStream::tls(t), peer, ctx).await,
        Ok(Err(e)) => format!("TLS handshake failed: {e}"),
        Err(_) => format!("no TLS handshake within {limit:?}"),
    };
    // Counted (`rserpool_proxy_tls_handshake_failures_total`); scanners make many of these.
    ctx.tls_failures.fetch_add(1, Ordering::Relaxed);
    debug!("client {peer}: {failed}");
}

async fn serve_stream(stream: ClientStream, peer: SocketAddr, ctx: Ctx) {
    let mut c = Client {
        stream,
        buf: BytesMut::with_capacity(16 * 1024),
        peer,
    };
    serve_requests(&mut c, &ctx).await;
    c.stream.close().await;
}

async fn serve_requests(c: &mut Client, ctx: &Ctx) {
    let peer = c.peer;
    let mut first = true;
    let mut draining = ctx.draining.clone();
    loop {
        let wait = if first {
            ctx.request_timeout()
        } else {
            ctx.idle_timeout()
        };
        let idle = c.buf.is_empty();
        let head = tokio::select! {
            r = tokio::time::timeout(wait, read_head(c, ctx.cfg.max_head)) => r,
            () = until_set(&mut draining), if idle => return,
        };
        let head = match head {
            Ok(Ok(Some(h))) => h,
            Ok(Ok(None)) => return,
            Ok(Err(ReadHeadError::Io)) => return,
            Ok(Err(ReadHeadError::Head(HeadError::TooLarge))) => {
                let _ = reply(c, 431, "request head too large").await;
                return;
            }
            Ok(Err(ReadHeadError::Head(HeadError::Malformed)))
                if first && ctx.http2 && c.buf.starts_with(H2C_PREFACE) =>
            {
                // h2c with prior knowledge.
                let pre = c.buf.split().freeze();
                if let Ok(s) = c.stream.take_stream() {
                    crate::http2::front::serve(s, pre, peer, ctx.clone()).await;
                }
                return;
            }
            Ok(Err(ReadHeadError::Head(HeadError::Malformed))) => {
                debug!("client {peer}: malformed request");
                let _ = reply(c, 400, "malformed request").await;
                return;
            }
            Err(_) => {
                if !c.buf.is_empty() || first {
                    let _ = reply(c, 408, "request timeout").await;
                }
                return;
            }
        };
        first = false;
        match request(c, head, ctx).await {
            Next::KeepAlive if !*ctx.draining.borrow() => {}
            _ => return,
        }
    }
}

enum ReadHeadError {
    Io,
    Head(HeadError),
}

async fn read_head(c: &mut Client, max: usize) -> Result<Option<Head>, ReadHeadError> {
    loop {
        if !c.buf.is_empty() {
            if let Some(h) = Head::request(&mut c.buf, max).map_err(ReadHeadError::Head)? {
                return Ok(Some(h));
            }
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

/// A short error answer; the connection is closed after it.
async fn reply(c: &mut Client, code: u16, text: &str) -> io::Result<()> {
    c.stream.write_all(&error_response(code, text)).await
}

/// One request through the pipeline.
async fn request(c: &mut Client, head: Head, ctx: &Ctx) -> Next {
    let started = Instant::now();
    let mut r = match parse(head, c.peer, started) {
        Ok(r) => r,
        Err((code, why)) => {
            let _ = reply(c, code, why).await;
            return Next::Close;
        }
    };
    let Some(target) = route(&r, ctx) else {
        let _ = reply(c, 404, "no route").await;
        return Next::Close;
    };
    let pool = &target.pool;
    r.level = classify(&r, c.peer, ctx);
    if target.kernel && ctx.kernel.is_some() {
        return pin(c, r, pool, ctx).await;
    }
    if pool.protocol() == crate::config::PeProtocol::H2 {
        return crate::http2::from_h1::request(c, r, pool, ctx).await;
    }
    let Ok(out) = prepare(c, &mut r, ctx).await else {
        return Next::Close;
    };
    let mut failover = Failover::default();
    loop {
        let fresh_only = !r.idempotent;
        let connect = |pe: Arc<Backend>| async move { take_conn(&pe, ctx, fresh_only).await };
        let (attempt, mut conn) = match select(pool, r.level, &mut failover, ctx, connect).await {
            Ok(v) => v,
            Err((code, why)) => return give_up(c, &r, ctx, code, Some(why), None).await,
        };
        let outcome = match send(c, &mut conn, &r, &out, &attempt.pe, ctx).await {
            Ok(sent) => relay(c, conn, &r, sent, &attempt, ctx).await,
            Err(f) => Err(f),
        };
        // `None`: the request goes to a PE again.
        if let Some(next) = finish(c, &r, &out, &attempt, outcome, &mut failover, ctx).await {
            return next;
        }
    }
}

/// What the request says about itself: the value [`parse`] makes.
pub(crate) struct Request {
    pub(crate) head: Head,
    pub(crate) framing: Framing,
    pub(crate) host: Vec<u8>,
    pub(crate) path_end: usize,
    pub(crate) keep_alive: bool,
    pub(crate) expect_continue: bool,
    pub(crate) upgrade: bool,
    pub(crate) idempotent: bool,
    pub(crate) started: Instant,
    /// Service level (1 without `[levels]`).
    pub(crate) level: usize,
}

/// Step parse: the request analysed, or the status and text that refuse it.
pub(crate) fn parse(
    head: Head,
    peer: SocketAddr,
    started: Instant,
) -> Result<Request, (u16, &'static str)> {
    let r = analyse(head, started).map_err(|why| {
        debug!("client {peer}: {why}");
        (400, why)
    })?;
    if r.head.method() == b"CONNECT" {
        return Err((405, "CONNECT is not served"));
    }
    Ok(r)
}

fn idempotent(method: &[u8]) -> bool {
    matches!(
        method,
        b"GET" | b"HEAD" | b"PUT" | b"DELETE" | b"OPTIONS" | b"TRACE"
    )
}

fn analyse(head: Head, started: Instant) -> Result<Request, &'static str> {
    let framing = framing(&head, true).map_err(|_| "bad body framing")?;
    let host = {
        let mut hosts = head.values("host");
        match (hosts.next(), hosts.next()) {
            (Some(h), None) => h.to_vec(),
            (None, None) if head.minor == 0 => Vec::new(),
            _ => return Err("one Host header is required"),
        }
    };
    let target = head.target();
    if target.first() != Some(&b'/') && target != b"*" {
        return Err("only origin-form request targets are served");
    }
    let path_end = target
        .iter()
        .position(|&b| b == b'?')
        .unwrap_or(target.len());
    let keep_alive = head.wants_keep_alive();
    let expect_continue = head
        .get("expect")
        .is_some_and(|v| v.eq_ignore_ascii_case(b"100-continue"));
    let upgrade =
        head.minor == 1 && head.has_token("connection", "upgrade") && head.get("upgrade").is_some();
    let idempotent = idempotent(head.method());
    Ok(Request {
        head,
        framing,
        host,
        path_end,
        keep_alive,
        expect_continue,
        upgrade,
        idempotent,
        started,
        level: 1,
    })
}

/// Step classify: the request's service level by the `[levels]` rules.
pub(crate) fn classify(r: &Request, peer: SocketAddr, ctx: &Ctx) -> usize {
    let Some(levels) = &ctx.cfg.levels else {
        return 1;
    };
    let target = r.head.target();
    let header = |name: &str| r.head.get(name).and_then(|v| std::str::from_utf8(v).ok());
    levels.classify(&RequestFacts {
        source: peer.ip().to_canonical(),
        host: std::str::from_utf8(&r.host).ok(),
        path: std::str::from_utf8(&target[..r.path_end]).ok(),
        header: &header,
    })
}

/// Step route: the pool that serves the request.
pub(crate) fn route<'c>(r: &Request, ctx: &'c Ctx) -> Option<&'c Target> {
    ctx.routes.route(&r.host, &r.head.target()[..r.path_end])
}

/// A request on a route that pins its connection (`splice = "kernel"`): it goes to a PE as
/// any request, and so does the rest of the connection, unchanged, through the kernel
/// splice once the sockets are quiet (or relayed here when it cannot be handed over).
async fn pin(c: &mut Client, r: Request, pool: &Arc<Pool>, ctx: &Ctx) -> Next {
    let Ok(client) = c.stream.registered() else {
        return Next::Close;
    };
    let pe = match crate::tcp::connect_pe(client, c.peer, pool, r.level, true, r.started, ctx).await
    {
        Ok(pe) => pe,
        Err(why) => {
            let _ = reply(c, 503, why).await;
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
    crate::tcp::carry(client, c.peer, pe, &first, r.started, ctx).await;
    Next::Close
}

/// The request as it goes to a PE: the value [`prepare`] makes.
pub(crate) struct Outgoing {
    head: BytesMut,
    /// The whole body, when it is small enough to be held: then the request can be sent
    /// again (and `Request::framing` says there is nothing left to stream).
    pub(crate) held: Option<Bytes>,
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

/// The request head as sent to a PE: hop-by-hop headers dropped, forwarding headers added,
/// a client's copies of the level header (the default name) dropped.
pub(crate) fn outgoing_head(r: &Request, peer: SocketAddr) -> BytesMut {
    outgoing_head_with(r, peer, crate::levels::DEFAULT_HEADER, false)
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

/// What a request's forwarding headers become on the way to a PE, whatever the HTTP version
/// towards it: the client's own X-Forwarded-For and Forwarded values (every one that holds an
/// element, RFC 9110 §5.6.1) go before the client's address.
pub(crate) struct Forwarding<'r> {
    host: &'r [u8],
    prior_xff: Vec<&'r [u8]>,
    prior_fwd: Vec<&'r [u8]>,
}

/// Goes through the request's end-to-end headers: those that pass unchanged go to `pass`, the
/// forwarding ones into the [`Forwarding`]; a client's copies of `level_header` are dropped.
/// Nothing is allocated unless the client sent forwarding headers of its own.
pub(crate) fn forwarding<'r>(
    r: &'r Request,
    level_header: &str,
    mut pass: impl FnMut(&'r [u8], &'r [u8]),
) -> Forwarding<'r> {
    let mut fw = Forwarding {
        host: &r.host,
        prior_xff: Vec::new(),
        prior_fwd: Vec::new(),
    };
    for (n, v) in r.head.end_to_end() {
        if n.eq_ignore_ascii_case(level_header.as_bytes()) {
            continue;
        }
        let prior = if n.eq_ignore_ascii_case(b"x-forwarded-for") {
            &mut fw.prior_xff
        } else if n.eq_ignore_ascii_case(b"forwarded") {
            &mut fw.prior_fwd
        } else {
            pass(n, v);
            continue;
        };
        if v.split(|&b| b == b',').any(|e| !e.trim_ascii().is_empty()) {
            prior.push(v);
        }
    }
    fw
}

impl Forwarding<'_> {
    /// X-Forwarded-For's value.
    pub(crate) fn x_forwarded_for(&self, out: &mut impl BufMut, peer: SocketAddr) {
        for v in &self.prior_xff {
            out.put_slice(v);
            out.put_slice(b", ");
        }
        put_ip(out, peer, false);
    }

    /// Forwarded's value.
    pub(crate) fn forwarded(&self, out: &mut impl BufMut, peer: SocketAddr) {
        for v in &self.prior_fwd {
            out.put_slice(v);
            out.put_slice(b", ");
        }
        out.put_slice(b"for=");
        put_ip(out, peer, true);
        if plain_host(self.host) {
            out.put_slice(b";host=\"");
            out.put_slice(self.host);
            out.put_u8(b'"');
        }
        out.put_slice(b";proto=http");
    }
}

/// The client's address; an IPv6 one as Forwarded wants it (`"[…]"`) with `node`.
fn put_ip(out: &mut impl BufMut, peer: SocketAddr, node: bool) {
    use std::io::Write;
    let ip = peer.ip().to_canonical();
    // Formatted on the stack: no string per request.
    let mut buf = [0u8; 64];
    let mut c = std::io::Cursor::new(&mut buf[..]);
    let _ = if node && ip.is_ipv6() {
        write!(c, "\"[{ip}]\"")
    } else {
        write!(c, "{ip}")
    };
    let n = c.position() as usize;
    out.put_slice(&buf[..n]);
}

/// Whether a Host is a plain host[:port] (letters, digits, `-._~%`, an IP literal's `:[]`):
/// only such a host is named in Forwarded, where it needs no escaping in its quoted-string
/// (RFC 7239 §4) and no parser, however naive, finds a `,` `;` or `=` in it that would let
/// the client add an element of its own.
pub(crate) fn plain_host(host: &[u8]) -> bool {
    !host.is_empty()
        && host
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-._~%:[]".contains(&b))
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

/// What a request has been through on its way to a PE.
#[derive(Default)]
pub(crate) struct Failover {
    /// PEs that failed the request; they are not selected again.
    tried: Vec<u32>,
    /// Selections so far.
    attempts: u32,
    /// The request went out again after a PE closed without answering.
    resent: bool,
}

/// The PE one attempt goes to: the value [`select`] makes, with the connection.
pub(crate) struct Attempt {
    pub(crate) pool: Arc<Pool>,
    pub(crate) pe: Arc<Backend>,
    /// The connection was kept alive from an earlier request.
    pub(crate) reused: bool,
    /// Requests in flight at the PE before this one, and when it was sent: its latency.
    pub(crate) rif: u64,
    pub(crate) sent: Instant,
}

/// Step select: a PE by the pool's policy and a connection to it (`connect`: a kept-alive
/// one and whether it was, or a new one). A PE that cannot be reached is reported and the next
/// one tried; `Err` is the answer when none is left.
pub(crate) async fn select<C, F>(
    pool: &Arc<Pool>,
    level: usize,
    f: &mut Failover,
    ctx: &Ctx,
    connect: impl Fn(Arc<Backend>) -> F,
) -> Result<(Attempt, C), (u16, &'static str)>
where
    F: Future<Output = io::Result<(C, bool)>>,
{
    loop {
        f.attempts += 1;
        let pe = match pool.admit(level, &f.tried).await {
            Ok(pe) => pe,
            Err(NoPick::NoPe) if !f.tried.is_empty() => {
                return Err((502, "no pool element answered"));
            }
            Err(why) => return Err((503, why.text())),
        };
        let conn = connect(pe.clone()).await;
        let rif = conn.as_ref().ok().map(|_| pe.start());
        pe.pick_done();
        match conn {
            Ok((conn, reused)) => {
                let attempt = Attempt {
                    pool: pool.clone(),
                    pe,
                    reused,
                    rif: rif.unwrap_or(0),
                    sent: Instant::now(),
                };
                return Ok((attempt, conn));
            }
            Err(e) => {
                debug!("pool {} PE {:#010x}: connect: {e}", pe.pool, pe.id);
                ctx.pools.unreachable(&pe);
                pool.released();
                f.tried.push(pe.id);
            }
        }
    }
}

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
    if let Some(conn) = b.take_idle(max_age) {
        return Ok((conn, true));
    }
    Ok((BackendConn::new(connect_pe(b, ctx).await?), false))
}

/// A new connection to the PE: TCP, and TLS over it for a pool with `[pool.NAME.tls]`.
pub(crate) async fn connect_pe(b: &Backend, ctx: &Ctx) -> io::Result<PeStream> {
    let s = b.connect(ctx.connect_timeout()).await?;
    let tls = (!ctx.pe_tls.is_empty())
        .then(|| ctx.pe_tls.get(&b.pool.to_string()))
        .flatten();
    let Some(tls) = tls else {
        return Ok(PeStream::Plain(s));
    };
    // TLS to the PE, its certificate checked for the address connected to.
    let ip = s.peer_addr()?.ip();
    let handshake = rserpool_tls::tokio_rustls::TlsConnector::from(tls.clone())
        .connect(rserpool_tls::Tls::server_name(ip), s);
    let t = tokio::time::timeout(ctx.connect_timeout(), handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
    Ok(PeStream::Tls(Box::new(t)))
}

/// How far an exchange with a PE got before it failed.
pub(crate) enum Failure {
    /// Nothing of the response arrived; `body_sent` tells whether a streamed body was used.
    NoResponse { body_sent: bool, error: io::Error },
    /// The PE did not answer in time.
    Timeout,
    /// The PE answered garbage or broke off mid-response; the client connection is spoilt
    /// if anything was relayed.
    Broken { relayed: bool },
    /// The client went away.
    Client,
    /// The PE refused the request unprocessed (HTTP/2 REFUSED_STREAM, or a GOAWAY before it).
    Refused,
    /// The client's deadline (`grpc-timeout`) passed before the PE answered.
    Deadline,
    /// The request cannot be expressed towards the PE.
    BadRequest,
    /// The client's body broke the chunked coding.
    BadBody,
}

/// What [`send`] left to do with the request body.
struct Sent {
    /// Part of a streamed body went to the PE: the request cannot be sent again.
    body_sent: bool,
    /// Part of the body is still with the client (it waits for 100 Continue, or the PE
    /// stopped taking it).
    body_left: bool,
}

/// Step send: the head and a held body in one write, then a streamed body unless the client
/// waits for 100 Continue.
async fn send(
    c: &mut Client,
    bc: &mut BackendConn,
    r: &Request,
    out: &Outgoing,
    b: &Backend,
    ctx: &Ctx,
) -> Result<Sent, Failure> {
    let written = match &out.held {
        Some(body) if !body.is_empty() && out.head.len() + body.len() <= COALESCE => {
            let mut v = BytesMut::with_capacity(out.head.len() + body.len());
            v.put_slice(&out.head);
            v.put_slice(body);
            bc.stream.write_all(&v).await
        }
        Some(body) if !body.is_empty() => {
            let r = bc.stream.write_all(&out.head).await;
            match r {
                Ok(()) => bc.stream.write_all(body).await,
                e => e,
            }
        }
        _ => bc.stream.write_all(&out.head).await,
    };
    if let Err(error) = written {
        return Err(Failure::NoResponse {
            body_sent: false,
            error,
        });
    }
    if let Some(body) = &out.held {
        b.stats
            .bytes_in
            .fetch_add(body.len() as u64, Ordering::Relaxed);
    }
    let mut sent = Sent {
        body_sent: false,
        body_left: !matches!(r.framing, Framing::None),
    };
    if sent.body_left && !r.expect_continue {
        sent.body_sent = true;
        sent.body_left = !send_body(c, bc, r, b, ctx).await?;
    }
    Ok(sent)
}

/// Streams the client's request body to the PE. `Ok(false)` when the PE stopped taking it (it
/// may have answered early: the response is read next).
async fn send_body(
    c: &mut Client,
    bc: &mut BackendConn,
    r: &Request,
    b: &Backend,
    ctx: &Ctx,
) -> Result<bool, Failure> {
    let sent = stream_body(
        &mut c.stream,
        &mut c.buf,
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

/// The response as the client got it: the value [`relay`] makes.
pub(crate) struct Relayed {
    pub(crate) code: u16,
    /// The client connection can carry another request.
    pub(crate) keep: bool,
    /// Bytes relayed to the client.
    pub(crate) bytes: u64,
}

/// Step relay: the PE's response to the client, interim responses first (100 Continue
/// releases a waiting body; 101 turns the connection into a tunnel). A PE connection that
/// can carry another request goes back to the PE's idle set.
async fn relay(
    c: &mut Client,
    mut bc: BackendConn,
    r: &Request,
    mut sent: Sent,
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let b = &attempt.pe;
    let mut relayed = false;
    let mut bytes = 0u64;
    let resp = loop {
        let head = match read_response_head(&mut bc, ctx).await {
            Ok(h) => {
                if !relayed {
                    b.note_latency(attempt.rif, attempt.sent.elapsed());
                }
                h
            }
            Err(f) => {
                return Err(match f {
                    Failure::NoResponse { error, .. } => Failure::NoResponse {
                        body_sent: sent.body_sent,
                        error,
                    },
                    other => other,
                });
            }
        };
        match head.code {
            101 if r.upgrade => {
                c.stream
                    .write_all(&head.raw)
                    .await
                    .map_err(|_| Failure::Client)?;
                tunnel(c, bc, b, ctx).await;
                return Ok(Relayed {
                    code: 101,
                    keep: false,
                    bytes: head.raw.len() as u64,
                });
            }
            100..=199 if head.code != 101 => {
                // Interim responses go to HTTP/1.1 clients; 100 releases a waiting body.
                if r.head.minor == 1 {
                    c.stream
                        .write_all(&head.raw)
                        .await
                        .map_err(|_| Failure::Client)?;
                    relayed = true;
                }
                if head.code == 100 && sent.body_left {
                    sent.body_sent = true;
                    sent.body_left = !send_body(c, &mut bc, r, b, ctx).await?;
                }
                continue;
            }
            _ => break head,
        }
    };
    let code = resp.code;
    let Ok(framing) = response_framing(&resp, r.head.method() == b"HEAD") else {
        return Err(Failure::Broken { relayed });
    };
    if framing == Framing::Chunked && r.head.minor == 0 {
        // An HTTP/1.0 client cannot read it, and a PE must not send it (RFC 9112 §7.1).
        return Err(Failure::Broken { relayed });
    }
    // An HTTP/1.0 request's connection persists only if the PE says so (RFC 9112 §9.3).
    let backend_keep = framing != Framing::Close
        && !resp.has_token("connection", "close")
        && if r.head.minor == 1 {
            resp.minor == 1
        } else {
            resp.has_token("connection", "keep-alive")
        };
    let client_keep =
        r.keep_alive && framing != Framing::Close && !sent.body_left && !*ctx.draining.borrow();
    if sent.body_left {
        // The client may still be sending the body the PE did not take.
        c.stream.linger_on_close();
    }
    let mut out = BytesMut::with_capacity(resp.raw.len() + 64);
    response_head(&resp, &mut out, client_keep, r.head.minor);
    bytes += out.len() as u64;
    match stream_body(
        &mut bc.stream,
        &mut bc.buf,
        &mut c.stream,
        framing,
        out,
        ctx.idle_timeout(),
        !client_keep,
    )
    .await
    {
        Ok(n) => bytes += n,
        Err(RelayError::Dst) => return Err(Failure::Client),
        Err(_) => return Err(Failure::Broken { relayed: true }),
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    if backend_keep && bc.buf.is_empty() && !sent.body_left {
        b.put_idle(bc, ctx.pools.settings.max_idle_per_pe);
    }
    Ok(Relayed {
        code,
        keep: client_keep,
        bytes,
    })
}

pub(crate) async fn read_response_head(bc: &mut BackendConn, ctx: &Ctx) -> Result<Head, Failure> {
    let deadline = tokio::time::Instant::now() + ctx.request_timeout();
    loop {
        if !bc.buf.is_empty() {
            match Head::response(&mut bc.buf, ctx.cfg.max_head) {
                Ok(Some(h)) => return Ok(h),
                Ok(None) => {}
                Err(_) => return Err(Failure::Broken { relayed: false }),
            }
        }
        bc.buf.reserve(16 * 1024);
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

/// The response head for the client: the status line and end-to-end headers as they came,
/// the connection's own headers replaced by ours.
pub(crate) fn response_head(h: &Head, out: &mut BytesMut, keep: bool, client_minor: u8) {
    out.put_slice(h.status_line());
    out.put_slice(b"\r\n");
    for (n, v) in h.end_to_end() {
        out.put_slice(n);
        out.put_slice(b": ");
        out.put_slice(v);
        out.put_slice(b"\r\n");
    }
    if !keep {
        out.put_slice(b"Connection: close\r\n");
    } else if client_minor == 0 {
        out.put_slice(b"Connection: keep-alive\r\n");
    }
    out.put_slice(b"\r\n");
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
            crate::splice::forward(cs, pe, ctx.idle_timeout(), ctx.cfg.splice).await
        }
        // TLS on either side: through buffers.
        _ => {
            crate::splice::forward_streams(&mut c.stream, &mut bc.stream, ctx.idle_timeout()).await
        }
    };
    if let Ok(m) = moved {
        b.stats.bytes_in.fetch_add(m.a_to_b, Ordering::Relaxed);
        b.stats.bytes_out.fetch_add(m.b_to_a, Ordering::Relaxed);
    }
}

/// Step finish: settles an attempt with the PE ([`settle`]), logs the request and says what
/// comes next; `None` sends the request to a PE again (failover).
async fn finish(
    c: &mut Client,
    r: &Request,
    out: &Outgoing,
    attempt: &Attempt,
    outcome: Result<Relayed, Failure>,
    f: &mut Failover,
    ctx: &Ctx,
) -> Option<Next> {
    let b = &attempt.pe;
    match settle(r, out.held.is_some(), attempt, outcome, f, ctx) {
        Settled::Answered { code, keep, bytes } => {
            log(ctx, c.peer, r, code, Some(b), bytes);
            Some(if keep && r.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            })
        }
        Settled::Again => None,
        Settled::Failed { code, why } => Some(give_up(c, r, ctx, code, why, Some(b)).await),
    }
}

/// What [`settle`] makes of an attempt.
pub(crate) enum Settled {
    /// The PE's response went to the client.
    Answered { code: u16, keep: bool, bytes: u64 },
    /// The request goes to a PE again.
    Again,
    /// The request failed with `code`; `why` is for the client, unless it has part of a
    /// response already.
    Failed {
        code: u16,
        why: Option<&'static str>,
    },
}

/// Settles an attempt with the PE: counters, health, and whether the request may go out
/// again (`replayable`: its body was held, so it can be sent again).
pub(crate) fn settle(
    r: &Request,
    replayable: bool,
    attempt: &Attempt,
    outcome: Result<Relayed, Failure>,
    f: &mut Failover,
    ctx: &Ctx,
) -> Settled {
    let b = &attempt.pe;
    attempt.pool.finished(b, r.level, attempt.sent.elapsed());
    let (code, why) = match outcome {
        Ok(Relayed { code, keep, bytes }) => {
            b.succeeded();
            if code >= 500 {
                b.stats.responses_5xx.fetch_add(1, Ordering::Relaxed);
            }
            return Settled::Answered { code, keep, bytes };
        }
        Err(Failure::Refused) if replayable && f.attempts < 8 => {
            // The PE did not take the stream (REFUSED_STREAM, or past its GOAWAY): nothing
            // of it was processed, so it may go anywhere again, idempotent or not.
            return Settled::Again;
        }
        Err(Failure::Refused) => (502, Some("the pool element refused the request")),
        Err(Failure::NoResponse { body_sent, error }) => {
            let replayable = replayable && !body_sent;
            if attempt.reused && replayable && f.attempts < 8 {
                // A kept-alive connection the PE had closed: not the PE's fault, but its
                // other idle connections may be as stale.
                b.clear_idle();
                return Settled::Again;
            }
            debug!("pool {} PE {:#010x}: no response: {error}", b.pool, b.id);
            ctx.pools.unreachable(b);
            f.tried.push(b.id);
            if replayable && idempotent_here(r, &attempt.pool) && !f.resent {
                f.resent = true;
                return Settled::Again;
            }
            (502, Some("the pool element closed the connection"))
        }
        Err(Failure::Timeout) => {
            b.failed(&ctx.pools.settings.health);
            (504, Some("the pool element did not answer in time"))
        }
        Err(Failure::Broken { relayed }) => {
            b.failed(&ctx.pools.settings.health);
            (
                502,
                (!relayed).then_some("bad response from the pool element"),
            )
        }
        Err(Failure::BadBody) => (400, Some("malformed chunked body")),
        Err(Failure::BadRequest) => (400, Some("malformed request")),
        // The client's own deadline: no fault of the PE's.
        Err(Failure::Deadline) => (504, Some("deadline exceeded")),
        Err(Failure::Client) => (499, None),
    };
    Settled::Failed { code, why }
}

/// Whether the request may be sent to another PE after one failed it: an idempotent method,
/// or a path the pool lists as idempotent (`[pool.NAME] idempotent`, for gRPC methods).
pub(crate) fn idempotent_here(r: &Request, pool: &Pool) -> bool {
    if r.idempotent {
        return true;
    }
    pool.idempotent_path(&r.head.target()[..r.path_end])
}

/// Ends a request without a response from a PE: answers `code` with `why` (unless the client
/// has part of a response already, or is gone), logs it and closes.
pub(crate) async fn give_up(
    c: &mut Client,
    r: &Request,
    ctx: &Ctx,
    code: u16,
    why: Option<&str>,
    b: Option<&Arc<Backend>>,
) -> Next {
    if let Some(why) = why {
        let _ = if code == 503 {
            // No PE had room: say when to come back.
            let secs = ctx.cfg.levels.as_ref().map_or(1, |l| l.retry_after_s);
            let resp = error_response_with(code, why, &format!("Retry-After: {secs}\r\n"));
            c.stream.write_all(&resp).await
        } else {
            reply(c, code, why).await
        };
    }
    log(ctx, c.peer, r, code, b, 0);
    Next::Close
}

/// The access log line of a request.
pub(crate) fn log(
    ctx: &Ctx,
    peer: SocketAddr,
    r: &Request,
    code: u16,
    b: Option<&Arc<Backend>>,
    bytes: u64,
) {
    ctx.log(|| {
        format!(
            "{} {} {} {} {} {} {} {}",
            peer,
            String::from_utf8_lossy(r.head.method()),
            String::from_utf8_lossy(r.head.target()),
            code,
            b.map_or("-".into(), |b| b.pool.to_string()),
            b.map_or("-".into(), |b| format!("{:#010x}", b.id)),
            bytes,
            r.started.elapsed().as_micros()
        )
    });
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

#[cfg(test)]
mod tests {
    use super::*;

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
        response_head(&h, &mut out, keep, 1);
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
