//! HTTP/2 from clients: over TLS when ALPN chose `h2`, and in cleartext from a client that
//! starts with the HTTP/2 preface (h2c with prior knowledge).
//!
//! Every stream is one request through the same pipeline as an HTTP/1.1 request
//! ([`crate::http::pipeline`]): its head is rewritten as an HTTP/1.1 head and parsed as one, so
//! routing, service levels, admission, selection, failover and the access log are those of
//! HTTP/1.1. It then goes to a PE over HTTP/1.1 (the default) or over HTTP/2 for a pool with
//! `protocol = "h2"` (`crate::http::upstream`).
//!
//! A request body is held, so that the request can go to another PE, when it is complete on
//! arrival, announced by a Content-Length within `retry-buffer`, or (without a length) when
//! the request may be sent again anyway (an idempotent method, a path in the pool's
//! `idempotent` list): a streaming call is never waited for. gRPC deadlines (`grpc-timeout`)
//! bound the wait for the PE and the relay; the PE gets what is left of the deadline.

use super::coalesce::Coalesced;
use super::guard::{Flood, Guarded};
use super::inflow::{Gathered, small_frame_budget};
use super::stream::{Body, Stream};
use crate::ctx::{Ctx, until_set};
use crate::http::downstream::Downstream;
use crate::http::message::{Framing, Head, HeadWriter};
use crate::http::pipeline::{classify, forward, idempotent_here, log, route};
use crate::http::request::parse;
use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, HeaderValue};
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{debug, warn};

/// Longest wait for the client's SETTINGS, then for the GOAWAY of a flood to leave.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const GOAWAY_TIMEOUT: Duration = Duration::from_secs(1);

/// Connections ended for a flood; also what paces the warnings (1st, 2nd, 4th, …).
static FLOODS: AtomicU64 = AtomicU64::new(0);

/// HTTP/2 connections ended with GOAWAY ENHANCE_YOUR_CALM, for the metrics.
pub(crate) fn floods() -> u64 {
    FLOODS.load(Ordering::Relaxed)
}

fn note_flood(peer: SocketAddr, what: &str) {
    let n = FLOODS.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        warn!(
            "client {peer}: HTTP/2 {what}: GOAWAY ENHANCE_YOUR_CALM ({n} such connections so far)"
        );
    }
}

/// Serves one HTTP/2 client connection; `pre` is what was read of it already.
pub(crate) async fn serve<T>(io: T, pre: Bytes, peer: SocketAddr, mut ctx: Arc<Ctx>)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let h = &ctx.cfg.http2;
    let (io, tripped) = Guarded::new(io, pre, h.max_resets_per_s, h.max_control_frames_per_s);
    let mut b = h2::server::Builder::new();
    // WebSocket over HTTP/2 (RFC 8441; `super::tunnel`).
    b.enable_connect_protocol();
    b.max_concurrent_streams(h.max_concurrent_streams)
        .initial_window_size(h.stream_window)
        .initial_connection_window_size(h.connection_window)
        // A burst of small messages on one stream is read before the stream takes it.
        .data_frame_budget(small_frame_budget(h.stream_window))
        .max_header_list_size(
            h.max_header_list_size
                .unwrap_or(u32::try_from(ctx.cfg.max_head).unwrap_or(u32::MAX)),
        );
    // Boxed: the handshake is a large future the connection's task would carry for its life.
    let handshake = Box::pin(tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        b.handshake::<_, Bytes>(Coalesced::server(io)),
    ));
    let mut conn = match handshake.await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return debug!("client {peer}: HTTP/2 handshake: {e}"),
        Err(_) => return debug!("client {peer}: no HTTP/2 handshake in time"),
    };
    let mut draining = ctx.draining.clone();
    let idle = ctx.idle_timeout();
    // The waits that last the connection's life are made once, not at every stream: each one
    // made anew registers again (a timer in the wheel, a waiter in a lock-guarded list) and
    // the one it replaces deregisters.
    let mut last_stream = tokio::time::Instant::now();
    // When the last stream to end ended, in ms after `last_stream`'s first value: the idle
    // time runs from there (a stream may end just before the timer, long after it began).
    let epoch = last_stream;
    let last_end = Arc::new(AtomicU64::new(0));
    let idle_timer = tokio::time::sleep_until(last_stream + idle);
    let flood = tripped.wait();
    let drain = until_set(&mut draining);
    tokio::pin!(idle_timer, flood, drain);
    // Closing: a GOAWAY sent; drained: by the proxy's drain, which bounds it.
    let (mut closing, mut drained) = (false, false);
    loop {
        // In this order: a stream that came in while the task was held up (a loaded machine)
        // is taken before the idle timer that fired meanwhile looks for streams; the flood and
        // the drain are looked at first, so a stream at every poll cannot starve them.
        tokio::select! {
            biased;
            f = &mut flood => {
                note_flood(peer, match f {
                    Flood::Resets => "reset flood",
                    Flood::Control => "control frame flood",
                });
                conn.abrupt_shutdown(Reason::ENHANCE_YOUR_CALM);
                let _ = tokio::time::timeout(GOAWAY_TIMEOUT, poll_fn(|cx| conn.poll_closed(cx))).await;
                return;
            }
            () = &mut drain, if !closing => {
                conn.graceful_shutdown();
                (closing, drained) = (true, true);
            }
            s = conn.accept() => match s {
                Some(Ok((req, respond))) => {
                    // One reading of the clock for the idle timer and the request's start.
                    let started = Instant::now();
                    last_stream = tokio::time::Instant::from_std(started);
                    // After a reload, a new stream takes the new routes, pools and levels.
                    if let Some(newer) = ctx.newer() {
                        ctx = newer;
                    }
                    // Boxed: the task holds a pointer, not the whole call's state, which would be
                    // copied on every move.
                    let stream = call(req, respond, peer, ctx.clone(), started);
                    let last_end = last_end.clone();
                    tokio::spawn(Box::pin(async move {
                        stream.await;
                        let ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
                        last_end.fetch_max(ms, Ordering::Relaxed);
                    }));
                }
                Some(Err(e)) => {
                    if e.reason() == Some(Reason::ENHANCE_YOUR_CALM) && e.is_library() {
                        note_flood(peer, "abuse (headers, CONTINUATION or resets)");
                    } else {
                        debug!("client {peer}: HTTP/2: {e}");
                    }
                    return;
                }
                None => return,
            },
            () = &mut idle_timer, if !drained => {
                let now = tokio::time::Instant::now();
                if conn.has_streams() {
                    idle_timer.as_mut().reset(now + idle);
                } else if closing {
                    // `h2` closes after the client acknowledges the PING sent with the
                    // GOAWAY; one that never does would keep the connection for ever.
                    return debug!("client {peer}: no close in time after the idle GOAWAY");
                } else {
                    let since = idle_since(last_stream, epoch, &last_end);
                    if since + idle > now {
                        idle_timer.as_mut().reset(since + idle);
                    } else {
                        conn.graceful_shutdown();
                        closing = true;
                        idle_timer.as_mut().reset(now + GOAWAY_TIMEOUT);
                    }
                }
            }
        }
    }
}

/// Since when an HTTP/2 connection without open streams has been idle: the later of its last
/// stream's start and the end of the last stream to end (`last_end`, ms after `epoch`).
fn idle_since(
    last_start: tokio::time::Instant,
    epoch: tokio::time::Instant,
    last_end: &AtomicU64,
) -> tokio::time::Instant {
    last_start.max(epoch + Duration::from_millis(last_end.load(Ordering::Relaxed)))
}

/// One request (stream), from its head to the end of its response. Not an `async fn`: one
/// holds each argument twice for its whole life (as the argument and as the local it is
/// moved into); here the stream is made first and an `async` block uses what it captured in
/// place.
fn call(
    req: http::Request<RecvStream>,
    respond: SendResponse<Bytes>,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    started: Instant,
) -> impl Future<Output = ()> + Send {
    let (parts, recv) = req.into_parts();
    let grpc = parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let deadline = parts
        .headers
        .get("grpc-timeout")
        .and_then(|v| grpc_timeout(v.as_bytes()))
        .map(|t| tokio::time::Instant::from_std(started) + t);
    let mut s = Stream {
        respond,
        tx: None,
        peer,
        grpc,
        deadline,
        parts,
        body: Body::Held(Bytes::new()),
        set_cookie: None,
        tunnel: None,
    };
    async move {
        let (ctx, peer) = (&ctx, s.peer);
        let ended = recv.is_end_stream();
        // An extended CONNECT (RFC 8441): the Upgrade request it stands for.
        let upgrade = (s.parts.method == http::Method::CONNECT)
            .then(|| s.parts.extensions.get::<h2::ext::Protocol>())
            .flatten()
            .map(|p| p.as_str().to_owned());
        let head = match head_of(&s.parts, ended, upgrade.as_deref(), ctx.cfg.max_head * 2) {
            Some(h) => h,
            None => {
                ctx.refused(peer, None, 400);
                return s.reply(400, "malformed request", ctx);
            }
        };
        let mut r = match parse(head, peer, started) {
            Ok(r) => r,
            Err((code, why, raw)) => {
                ctx.refused(peer, Some(&raw), code);
                return s.reply(code, why, ctx);
            }
        };
        let Some(target) = route(&r, ctx) else {
            ctx.refused(peer, Some(&r.head.raw), 404);
            return s.reply(404, "no route", ctx);
        };
        let pool = target.pool.clone();
        r.level = classify(&r, peer, ctx);
        let length = match r.framing {
            Framing::Length(n) => Some(n),
            _ => None,
        };
        let repeatable = idempotent_here(&r, &pool);
        let limit = ctx.cfg.retry_buffer;
        let hold =
            ended || length.is_some_and(|n| n <= limit as u64) || (length.is_none() && repeatable);
        let expects = s
            .parts
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if expects && !ended {
            // The body is wanted at once (the PE's own 100 Continue would come too late).
            if let Ok(h) = http::Response::builder().status(100).body(()) {
                let _ = s.respond.send_informational(h);
            }
        }
        s.body = if upgrade.is_some() {
            // No body: the stream is the tunnel, once the PE switches protocols.
            s.tunnel = Some(recv);
            Body::Held(Bytes::new())
        } else if hold {
            match gather(recv, ended, limit, ctx.idle_timeout()).await {
                Ok(b) => b,
                Err(()) => return log(ctx, peer, &r, 499, (&pool, None), 0),
            }
        } else {
            Body::Streamed {
                prefix: Bytes::new(),
                rest: Some(recv),
            }
        };
        forward(&mut Downstream::H2(&mut s), &r, &pool, ctx).await;
    }
}

const CONNECTION_SPECIFIC: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// The request head as HTTP/1.1 (`Host` from `:authority`); a body of unknown length is
/// announced as chunked. An extended CONNECT for `upgrade` (its `:protocol`) becomes the
/// Upgrade request it stands for. Written with its spans, not parsed again: `h2` let through
/// only valid names and values, and what it does not check (the target, `:protocol`) is
/// checked here as a parse would.
pub(crate) fn head_of(
    parts: &http::request::Parts,
    ended: bool,
    upgrade: Option<&str>,
    max: usize,
) -> Option<Head> {
    let method = if upgrade.is_some() {
        "GET"
    } else {
        parts.method.as_str()
    };
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    if !target.bytes().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let mut w = HeadWriter::request(
        method.as_bytes(),
        target.as_bytes(),
        parts.headers.len() + 3,
    );
    let authority = parts
        .uri
        .authority()
        .map(|a| a.as_str().as_bytes())
        .or_else(|| parts.headers.get(HOST).map(HeaderValue::as_bytes));
    if let Some(a) = authority {
        w.header(b"host", a);
    }
    for (n, v) in &parts.headers {
        // HTTP/2 has no 100 Continue to wait for: the body comes anyway.
        if n == HOST || n == http::header::EXPECT {
            continue;
        }
        // Connection-specific fields make an HTTP/2 request malformed (RFC 9113 §8.2.2);
        // passed on to an HTTP/1.1 PE, Transfer-Encoding would smuggle a second request.
        if CONNECTION_SPECIFIC.contains(&n.as_str()) {
            return None;
        }
        w.header(n.as_str().as_bytes(), v.as_bytes());
    }
    if let Some(protocol) = upgrade {
        HeaderValue::from_str(protocol).ok()?;
        w.header(b"connection", b"upgrade");
        w.header(b"upgrade", protocol.as_bytes());
        if protocol.eq_ignore_ascii_case("websocket")
            && !parts.headers.contains_key("sec-websocket-key")
        {
            w.header(
                b"sec-websocket-key",
                super::tunnel::websocket_key().as_bytes(),
            );
        }
    } else if !ended && !parts.headers.contains_key(CONTENT_LENGTH) {
        w.header(b"transfer-encoding", b"chunked");
    }
    w.finish(max).ok()
}

/// Reads the body while it fits in `limit`: all of it, or what was read and the rest.
async fn gather(
    mut recv: RecvStream,
    ended: bool,
    limit: usize,
    idle: Duration,
) -> Result<Body, ()> {
    if ended {
        return Ok(Body::Held(Bytes::new()));
    }
    let mut body = Gathered::default();
    loop {
        // A body that came with its head is there at once: a timer (and a reading of the
        // clock) only for a read that has to wait.
        let next = {
            let mut data = std::pin::pin!(recv.data());
            match poll_fn(|cx| Poll::Ready(data.as_mut().poll(cx))).await {
                Poll::Ready(d) => Ok(d),
                Poll::Pending => tokio::time::timeout(idle, data).await,
            }
        };
        match next {
            Err(_) | Ok(Some(Err(_))) => return Err(()),
            Ok(None) => return Ok(Body::Held(body.take())),
            Ok(Some(Ok(d))) => {
                let _ = recv.flow_control().release_capacity(d.len());
                body.push(d);
                if body.len() > limit {
                    return Ok(Body::Streamed {
                        prefix: body.take(),
                        rest: Some(recv),
                    });
                }
            }
        }
    }
}

/// `grpc-timeout`: up to 8 digits and a unit (H, M, S, m, u, n).
fn grpc_timeout(v: &[u8]) -> Option<Duration> {
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        assert_eq!(grpc_timeout(b"100m"), Some(Duration::from_millis(100)));
        assert_eq!(grpc_timeout(b"2S"), Some(Duration::from_secs(2)));
        assert_eq!(grpc_timeout(b"1H"), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout(b"5u"), Some(Duration::from_micros(5)));
        for bad in [&b""[..], b"m", b"123456789m", b"10x", b"-1S", b"1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_h2_request_reads_as_http1_with_its_authority_as_host() {
        let req = http::Request::builder()
            .method("POST")
            .uri("https://api.example:8443/v1/x?q=1")
            .header("content-type", "application/grpc")
            .header("expect", "100-continue")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let h = head_of(&parts, false, None, 4096).unwrap();
        assert_eq!(h.method(), b"POST");
        assert_eq!(h.target(), b"/v1/x?q=1");
        assert_eq!(h.get("host"), Some(&b"api.example:8443"[..]));
        assert_eq!(h.get("transfer-encoding"), Some(&b"chunked"[..]));
        assert_eq!(h.get("expect"), None);
        let (parts, ()) = http::Request::get("http://a/")
            .body(())
            .unwrap()
            .into_parts();
        let h = head_of(&parts, true, None, 4096).unwrap();
        assert_eq!(h.get("transfer-encoding"), None);
        // h2-to-h1 request smuggling: a client's own framing is refused.
        let (parts, ()) = http::Request::post("http://a/")
            .header("transfer-encoding", "chunked")
            .body(())
            .unwrap()
            .into_parts();
        assert!(head_of(&parts, false, None, 4096).is_none());
    }

    /// What a parse would refuse is refused: a `:protocol` that would end its header line.
    #[test]
    fn a_protocol_that_is_no_header_value_is_refused() {
        let (parts, ()) = http::Request::connect("http://chat.example/ws")
            .body(())
            .unwrap()
            .into_parts();
        assert!(head_of(&parts, false, Some("websocket\r\nx-evil: 1"), 4096).is_none());
        assert!(head_of(&parts, false, Some("websocket"), 4096).is_some());
        assert!(head_of(&parts, false, Some("websocket"), 60).is_none());
    }

    /// An extended CONNECT (RFC 8441) reads as the HTTP/1.1 Upgrade request it stands for,
    /// with a WebSocket key of the proxy's and no body framing.
    #[test]
    fn an_extended_connect_reads_as_an_upgrade() {
        let (parts, ()) = http::Request::connect("http://chat.example/ws?room=1")
            .header("sec-websocket-version", "13")
            .header("sec-websocket-protocol", "chat")
            .body(())
            .unwrap()
            .into_parts();
        let h = head_of(&parts, false, Some("websocket"), 4096).unwrap();
        assert_eq!(h.method(), b"GET");
        assert_eq!(h.target(), b"/ws?room=1");
        assert_eq!(h.get("host"), Some(&b"chat.example"[..]));
        assert!(h.has_token("connection", "upgrade"));
        assert_eq!(h.get("upgrade"), Some(&b"websocket"[..]));
        assert_eq!(h.get("sec-websocket-key").map(<[u8]>::len), Some(24));
        assert_eq!(h.get("sec-websocket-protocol"), Some(&b"chat"[..]));
        assert_eq!(h.get("transfer-encoding"), None);
        let r = crate::http::request::parse(h, "127.0.0.1:1".parse().unwrap(), Instant::now());
        assert!(r.is_ok_and(|r| r.upgrade));
    }
}
