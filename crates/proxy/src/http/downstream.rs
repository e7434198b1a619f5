//! The client's side of one request, whatever HTTP version it speaks: what a relay to a PE
//! asks of it and where the response goes. One type over an HTTP/1.1 connection and an
//! HTTP/2 stream (as pingora's `Session`), so that there is one relay per PE protocol
//! (`crate::http::upstream`), not one per pair of protocols; and what an exchange with a PE
//! came to ([`Failure`], [`Relayed`]), for the pipeline to settle.
//!
//! The response goes out in pieces ([`Downstream::respond_head`], [`Downstream::respond_data`],
//! [`Downstream::respond_end`]): an HTTP/2 client gets frames, an HTTP/1.1 client a message
//! in its own framing (the PE's length, else chunked with the trailers in the chunked trailer
//! section, or to the close for HTTP/1.0). The relay to an HTTP/1.1 PE has a faster way for an
//! HTTP/1.1 client: the response as it came, its framing untouched (`upstream::h1`).

use crate::ctx::Ctx;
use crate::http::client_stream::Client;
use crate::http::h2::stream::{Body, Stream, send_data};
use crate::http::message::{Framing, frame_into};
use crate::http::request::{Outgoing, Request, forwarding};
use bytes::{BufMut, Bytes, BytesMut};
use h2::Reason;
use http::header::{EXPECT, FORWARDED, HOST, HeaderName, HeaderValue};
use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;
use tokio::io::AsyncWriteExt;

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
    /// The PE does not switch protocols for the client's upgrade (an extended CONNECT, RFC
    /// 8441): no tunnel there, which is no fault of the PE's.
    NotUpgraded,
}

/// The response as the client got it.
pub(crate) struct Relayed {
    pub(crate) code: u16,
    /// The client connection can carry another request.
    pub(crate) keep: bool,
    /// Bytes relayed to the client.
    pub(crate) bytes: u64,
}

/// The client's side of one request.
pub(crate) enum Downstream<'a> {
    /// An HTTP/1.1 client.
    H1(H1Client<'a>),
    /// An HTTP/2 client's stream.
    H2(&'a mut Stream),
}

/// An HTTP/1.1 client with its request as it goes out, and how its response is framed.
pub(crate) struct H1Client<'a> {
    pub(crate) c: &'a mut Client,
    pub(crate) out: &'a Outgoing,
    /// The response goes out in the chunked coding (the PE gave no length).
    chunked: bool,
    /// The connection can carry another request after this response.
    pub(crate) keep: bool,
    /// A `Set-Cookie` the proxy adds to the response (`sticky-cookie`).
    pub(crate) set_cookie: Option<HeaderValue>,
}

impl<'a> Downstream<'a> {
    pub(crate) fn h1(c: &'a mut Client, out: &'a Outgoing) -> Self {
        Self::H1(H1Client {
            c,
            out,
            chunked: false,
            keep: false,
            set_cookie: None,
        })
    }

    /// A `Set-Cookie` for the response, besides the PE's headers.
    pub(crate) fn set_cookie(&mut self, v: Option<HeaderValue>) {
        match self {
            Self::H1(h) => h.set_cookie = v,
            Self::H2(s) => s.set_cookie = v,
        }
    }

    pub(crate) fn peer(&self) -> SocketAddr {
        match self {
            Self::H1(h) => h.c.peer,
            Self::H2(s) => s.peer,
        }
    }

    /// The whole body, when it was held: then the request can be sent again.
    pub(crate) fn held(&self) -> Option<&Bytes> {
        match self {
            Self::H1(h) => h.out.held.as_ref(),
            Self::H2(s) => match &s.body {
                Body::Held(d) => Some(d),
                Body::Streamed { .. } => None,
            },
        }
    }

    /// The client's deadline (gRPC's `grpc-timeout`), if it gave one.
    pub(crate) fn deadline(&self) -> Option<tokio::time::Instant> {
        match self {
            Self::H1(_) => None,
            Self::H2(s) => s.deadline,
        }
    }

    /// Waits for `wait` (a PE's answer) unless the client gives the request up meanwhile: an
    /// HTTP/2 client resets its stream (a cancelled gRPC call), and `None` comes back; the
    /// caller then drops the PE's side, which cancels the request there too. An HTTP/1.1
    /// client's close is found when its answer is written: `wait` is awaited as it is, with
    /// nothing beside it on that path.
    pub(crate) async fn unless_gone<T>(&mut self, wait: impl Future<Output = T>) -> Option<T> {
        match self {
            Self::H2(s) => {
                let gone = std::future::poll_fn(|cx| s.respond.poll_reset(cx));
                tokio::select! {
                    biased;
                    v = wait => Some(v),
                    _ = gone => None,
                }
            }
            Self::H1(_) => Some(wait.await),
        }
    }

    pub(crate) fn expired(&self) -> bool {
        self.deadline()
            .is_some_and(|d| d <= tokio::time::Instant::now())
    }

    /// The request as it goes to an HTTP/2 PE: the client's headers (the connection's own
    /// dropped), the forwarding headers and the level, what is left of a gRPC deadline; a held
    /// body's length, whatever framing it came in.
    pub(crate) fn h2_request(&mut self, r: &Request, ctx: &Ctx) -> Option<http::Request<()>> {
        let mut req = match self {
            Self::H2(s) => {
                let headers = client_headers(&mut s.parts, s.tunnel.is_some(), r)?;
                upstream_request(&s.parts, headers, s.peer, s.deadline, r, ctx)?
            }
            Self::H1(h) => {
                let mut p = parts_of(r)?;
                let headers = std::mem::take(&mut p.headers);
                upstream_request(&p, headers, h.c.peer, None, r, ctx)?
            }
        };
        if let (Self::H1(_), Some(held)) = (&*self, self.held()) {
            req.headers_mut()
                .insert(http::header::CONTENT_LENGTH, held.len().into());
        }
        Some(req)
    }

    /// Sends the response head; `end`: the PE sends no body. The bytes written, as far as
    /// they are counted (an HTTP/1.1 head), and whether a body is to follow (not after `end`,
    /// nor for an HTTP/1.1 client's HEAD request or a 204 or 304).
    pub(crate) async fn respond_head(
        &mut self,
        mut head: http::response::Parts,
        end: bool,
        r: &Request,
        ctx: &Ctx,
    ) -> Result<(u64, bool), Failure> {
        let cookie = match self {
            Self::H1(h) => h.set_cookie.take(),
            Self::H2(s) => s.set_cookie.take(),
        };
        if let Some(v) = cookie {
            head.headers.append(http::header::SET_COOKIE, v);
        }
        match self {
            Self::H2(s) => {
                head.headers = detached(head.headers);
                match s
                    .respond
                    .send_response(http::Response::from_parts(head, ()), end)
                {
                    Ok(tx) => {
                        s.tx = Some(tx);
                        Ok((0, !end))
                    }
                    Err(_) => Err(Failure::Client),
                }
            }
            Self::H1(h) => {
                let code = head.status.as_u16();
                let no_body = r.head.method() == b"HEAD" || code == 204 || code == 304;
                let length = head
                    .headers
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                // Framing for the client: the PE's length; else chunked (HTTP/1.1) or to the
                // close (HTTP/1.0).
                h.chunked = !no_body && length.is_none() && r.head.minor == 1;
                let close_delimited = !no_body && length.is_none() && r.head.minor == 0;
                h.keep = r.keep_alive && !close_delimited && !*ctx.draining.borrow();
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
                if h.chunked {
                    w.put_slice(b"Transfer-Encoding: chunked\r\n");
                }
                if !h.keep {
                    w.put_slice(b"Connection: close\r\n");
                } else if r.head.minor == 0 {
                    w.put_slice(b"Connection: keep-alive\r\n");
                }
                w.put_slice(b"\r\n");
                let n = w.len() as u64;
                if no_body || end {
                    if h.chunked {
                        w.put_slice(b"0\r\n\r\n");
                    }
                    h.chunked = false;
                }
                h.c.stream
                    .write_all(&w)
                    .await
                    .map_err(|_| Failure::Client)?;
                Ok((n, !(no_body || end)))
            }
        }
    }

    /// Sends a piece of the response body; `last`: it ends the body, no trailers follow.
    pub(crate) async fn respond_data(&mut self, d: Bytes, last: bool) -> Result<(), Failure> {
        match self {
            Self::H2(s) => {
                let Some(tx) = &mut s.tx else {
                    return Err(Failure::Client);
                };
                send_data(tx, d, last).await.map_err(|_| Failure::Client)
            }
            Self::H1(h) if h.chunked => {
                let mut w = BytesMut::with_capacity(d.len() + 16);
                frame_into(&mut w, &d, true);
                if last {
                    w.put_slice(b"0\r\n\r\n");
                    h.chunked = false;
                }
                h.c.stream.write_all(&w).await.map_err(|_| Failure::Client)
            }
            Self::H1(h) => h.c.stream.write_all(&d).await.map_err(|_| Failure::Client),
        }
    }

    /// Ends the response body, with the PE's trailers if it sent any.
    pub(crate) async fn respond_end(
        &mut self,
        trailers: Option<http::HeaderMap>,
    ) -> Result<(), Failure> {
        match self {
            Self::H2(s) => {
                let Some(tx) = &mut s.tx else {
                    return Err(Failure::Client);
                };
                match trailers {
                    Some(t) => tx.send_trailers(detached(t)).map_err(|_| Failure::Client),
                    None => send_data(tx, Bytes::new(), true)
                        .await
                        .map_err(|_| Failure::Client),
                }
            }
            Self::H1(h) if h.chunked => {
                let mut w = BytesMut::with_capacity(64);
                w.put_slice(b"0\r\n");
                for (n, v) in trailers.iter().flatten() {
                    w.put_slice(n.as_str().as_bytes());
                    w.put_slice(b": ");
                    w.put_slice(v.as_bytes());
                    w.put_slice(b"\r\n");
                }
                w.put_slice(b"\r\n");
                h.chunked = false;
                h.c.stream.write_all(&w).await.map_err(|_| Failure::Client)
            }
            // A length or the close delimits it: nothing more to say.
            Self::H1(_) => Ok(()),
        }
    }

    /// Whether the client connection can carry another request (an HTTP/2 stream ends
    /// alone).
    pub(crate) fn keep(&self) -> bool {
        match self {
            Self::H1(h) => h.keep,
            Self::H2(_) => true,
        }
    }

    /// Ends a request no PE answered: `code` with `why` to the client, unless it has part of
    /// a response already (then an HTTP/2 stream is reset; an HTTP/1.1 connection closes).
    pub(crate) async fn fail(&mut self, code: u16, why: Option<&str>, ctx: &Ctx) {
        match self {
            Self::H1(h) => {
                if let Some(why) = why {
                    let _ = h.c.reply(code, why, ctx).await;
                }
            }
            Self::H2(s) => match why {
                Some(why) => s.reply(code, why, ctx),
                None => match &mut s.tx {
                    Some(tx) => tx.send_reset(Reason::INTERNAL_ERROR),
                    None => s.respond.send_reset(Reason::INTERNAL_ERROR),
                },
            },
        }
    }
}

/// The request's method, target (with its Host as authority) and end-to-end headers, as the
/// parts of an HTTP/2 request.
fn parts_of(r: &Request) -> Option<http::request::Parts> {
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

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// An HTTP/2 client's headers for an attempt at a PE. The first attempt takes them as they
/// came (no copy); one after it (another PE) makes them again from the request's head, their
/// copy in HTTP/1.1 form, less what writing it added (`Host` from `:authority`,
/// `Transfer-Encoding` for a body of unknown length). Taken, the headers are empty, and so
/// are they made again from a request that had none. A tunnel's request keeps its own: its
/// head has the HTTP/1.1 upgrade written into it.
pub(crate) fn client_headers(
    p: &mut http::request::Parts,
    tunnel: bool,
    r: &Request,
) -> Option<http::HeaderMap> {
    if tunnel {
        return Some(p.headers.clone());
    }
    if !p.headers.is_empty() {
        return Some(std::mem::take(&mut p.headers));
    }
    let mut h = http::HeaderMap::with_capacity(r.head.headers.len());
    for (n, v) in r.head.iter() {
        if n.eq_ignore_ascii_case(b"host") || n.eq_ignore_ascii_case(b"transfer-encoding") {
            continue;
        }
        h.append(
            HeaderName::from_bytes(n).ok()?,
            HeaderValue::from_bytes(v).ok()?,
        );
    }
    Some(h)
}

/// The request as it goes to an HTTP/2 PE, from the parts of an HTTP/2 request and its
/// end-to-end `headers`.
fn upstream_request(
    p: &http::request::Parts,
    mut headers: http::HeaderMap,
    peer: SocketAddr,
    deadline: Option<tokio::time::Instant>,
    r: &Request,
    ctx: &Ctx,
) -> Option<http::Request<()>> {
    let (level_header, send_level) = ctx.level_header();
    // The client's own headers pass as they came: only the forwarding ones are taken out of
    // the request.
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
    headers.remove(level_header);
    // The proxy answers `Expect` itself: the body comes anyway.
    for name in [&X_FORWARDED_FOR, &FORWARDED, &HOST, &GRPC_TIMEOUT, &EXPECT] {
        headers.remove(name);
    }
    // The values the proxy writes share one buffer.
    let mut v = BytesMut::with_capacity(96);
    fw.x_forwarded_for(&mut v, peer);
    headers.insert(
        X_FORWARDED_FOR,
        HeaderValue::from_maybe_shared(v.split().freeze()).ok()?,
    );
    fw.forwarded(&mut v, peer);
    headers.insert(
        FORWARDED,
        HeaderValue::from_maybe_shared(v.split().freeze()).ok()?,
    );
    if send_level {
        headers.insert(
            HeaderName::from_bytes(level_header.as_bytes()).ok()?,
            HeaderValue::from(r.level as u64),
        );
    }
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(tokio::time::Instant::now());
        let ms = left.as_millis().clamp(1, 99_999_999);
        write!(v, "{ms}m").ok()?;
        headers.insert(
            GRPC_TIMEOUT,
            HeaderValue::from_maybe_shared(v.split().freeze()).ok()?,
        );
    }
    let mut req = http::Request::new(());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_2;
    *req.headers_mut() = headers;
    // An extended CONNECT (RFC 8441) keeps its `:protocol`.
    if let Some(protocol) = p.extensions.get::<h2::ext::Protocol>() {
        req.extensions_mut().insert(protocol.clone());
    }
    Some(req)
}

/// The header values of a response (or its trailers) for an HTTP/2 client, in one copy of
/// their own. A PE's values are slices of its connection's buffers (an HTTP/1.1 PE's read
/// buffer, `h2`'s decoding buffers for an HTTP/2 PE), and the client connection's HPACK
/// table keeps the values it indexed for that connection's life: a slice kept the whole
/// buffer, for every idle client (16 KiB each). One copy for all the values, not one each.
pub(crate) fn detached(mut headers: http::HeaderMap) -> http::HeaderMap {
    let len = headers.values().map(HeaderValue::len).sum();
    let mut all = BytesMut::with_capacity(len);
    for v in headers.values() {
        all.extend_from_slice(v.as_bytes());
    }
    let all = all.freeze();
    let mut at = 0;
    for v in headers.values_mut() {
        let n = v.len();
        if let Ok(mut own) = HeaderValue::from_maybe_shared(all.slice(at..at + n)) {
            own.set_sensitive(v.is_sensitive());
            *v = own;
        }
        at += n;
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;
    use crate::http::testbed;
    use std::time::Duration;

    /// What the proxy writes into a request to an HTTP/2 PE: its forwarding headers (a
    /// client's own replaced, the chain kept), what is left of the deadline, no Host; the
    /// client's other headers as they came.
    #[tokio::test]
    async fn an_http2_pe_gets_the_forwarding_headers_and_the_deadline_left() {
        let (ctx, _pool, _reports) = testbed::ctx(&[], ProxyConfig::default());
        let peer: SocketAddr = "192.0.2.7:4000".parse().unwrap();
        let (r, _) = testbed::request(
            "POST /pkg.Svc/Call HTTP/1.1\r\nhost: api.example\r\nx-forwarded-for: 198.51.100.1\r\n\r\n",
            "",
            peer,
        );
        let (mut p, ()) = http::Request::post("http://api.example/pkg.Svc/Call")
            .header("content-type", "application/grpc")
            .header("x-forwarded-for", "198.51.100.1")
            .header("forwarded", "for=203.0.113.9")
            .header("grpc-timeout", "10S")
            .header("x-custom", "kept")
            .body(())
            .unwrap()
            .into_parts();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
        let headers = std::mem::take(&mut p.headers);
        let req = upstream_request(&p, headers, peer, Some(deadline), &r, &ctx).unwrap();
        let h = req.headers();
        let get = |n: &str| h.get(n).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(
            get("x-forwarded-for").as_deref(),
            Some("198.51.100.1, 192.0.2.7")
        );
        assert!(get("forwarded").unwrap().contains("for=192.0.2.7"), "{h:?}");
        let left = get("grpc-timeout").unwrap();
        let ms: u64 = left.strip_suffix('m').unwrap().parse().unwrap();
        assert!((1..=1500).contains(&ms), "{left}");
        assert_eq!(get("x-custom").as_deref(), Some("kept"));
        assert_eq!(get("content-type").as_deref(), Some("application/grpc"));
        assert_eq!(h.get_all("grpc-timeout").iter().count(), 1);
        assert!(h.get(HOST).is_none());
        assert_eq!(req.uri().authority().unwrap().as_str(), "api.example");
    }

    /// An attempt after the first (another PE) sends the same request: the client's headers
    /// made again from the request's head are those the first attempt took, repeated names,
    /// order and all.
    #[tokio::test]
    async fn a_second_attempt_sends_the_headers_the_first_did() {
        let (ctx, _pool, _reports) = testbed::ctx(&[], ProxyConfig::default());
        let peer: SocketAddr = "192.0.2.7:4000".parse().unwrap();
        let (mut p, ()) = http::Request::post("https://api.example/pkg.Svc/Call?x=1")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-multi", "one")
            .header("user-agent", "grpc-test/1.0")
            .header("x-multi", "two")
            .header("expect", "100-continue")
            .header("x-forwarded-for", "198.51.100.1")
            .header("grpc-accept-encoding", "identity,deflate,gzip")
            .body(())
            .unwrap()
            .into_parts();
        let head = crate::http::h2::front::head_of(&p, false, None, 1 << 16).unwrap();
        let r = crate::http::request::parse(head, peer, std::time::Instant::now()).unwrap();
        let pairs = |req: &http::Request<()>| {
            req.headers()
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect::<Vec<_>>()
        };
        let headers = client_headers(&mut p, false, &r).unwrap();
        assert!(p.headers.is_empty(), "taken, not copied");
        let first = upstream_request(&p, headers, peer, None, &r, &ctx).unwrap();
        let headers = client_headers(&mut p, false, &r).unwrap();
        let again = upstream_request(&p, headers, peer, None, &r, &ctx).unwrap();
        assert_eq!(pairs(&first), pairs(&again));
        assert_eq!(first.uri(), again.uri());
        assert_eq!(first.uri().scheme_str(), Some("https"));
        let multi: Vec<_> = first.headers().get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"]);
        assert!(
            first.headers().get(EXPECT).is_none(),
            "the proxy answers Expect"
        );
        assert_eq!(first.headers().get("te").unwrap(), "trailers");
    }

    /// Values taken out of a PE connection's buffer keep none of it: each is a piece of one
    /// copy, equal to what it was, repeated names and sensitivity kept.
    #[test]
    fn detached_values_hold_none_of_the_pe_connections_buffer() {
        let buffer = Bytes::from(vec![b'x'; 16 * 1024]);
        let mut text = buffer.to_vec();
        text[..30].copy_from_slice(b"application/grpc0ok-1ok-2token");
        let buffer = Bytes::from(text);
        let part =
            |r: std::ops::Range<usize>| HeaderValue::from_maybe_shared(buffer.slice(r)).unwrap();
        let mut h = http::HeaderMap::new();
        h.insert("content-type", part(0..16));
        h.insert("grpc-status", part(16..17));
        h.append("x-multi", part(17..21));
        h.append("x-multi", part(21..25));
        let mut secret = part(25..30);
        secret.set_sensitive(true);
        h.insert("authorization", secret);
        let d = detached(h);
        assert_eq!(d.get("content-type").unwrap(), "application/grpc");
        assert_eq!(d.get("grpc-status").unwrap(), "0");
        let multi: Vec<_> = d.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["ok-1", "ok-2"]);
        assert_eq!(d.get("authorization").unwrap(), "token");
        assert!(d.get("authorization").unwrap().is_sensitive());
        let whole = buffer.as_ptr() as usize..buffer.as_ptr() as usize + buffer.len();
        for v in d.values() {
            let at = v.as_bytes().as_ptr() as usize;
            assert!(!whole.contains(&at), "{v:?} is a slice of the PE's buffer");
        }
    }
}
