//! The status listener's HTTP: one small HTTP/1.1 layer for the operator surface of every
//! rserpool process (the registrar's handlespace, the proxy's counters; metrics and a dashboard
//! next), served on a listener of its own (`--status ADDR`), apart from the protocol ports.
//!
//! Why it exists: the registrar's event loop is mio, not tokio, and the proxy is tokio; both need
//! the same few things from HTTP — read a request head within limits, route a GET or HEAD by
//! path, answer with a body and close. So the core here is sans-IO ([`parse_request`],
//! [`respond`]), and the `tokio` feature adds the async [`serve`] loop and the [`get`] client
//! used by the command line and the tests. Every answer closes the connection: status requests
//! are rare, and a closed connection is a connection that holds nothing. Limits: a head of at
//! most [`MAX_HEAD`] bytes within [`IO_TIMEOUT`], at most [`MAX_CONNS`] connections at once.

use std::fmt::Write as _;

/// The longest request head read; a longer one is answered with 431.
pub const MAX_HEAD: usize = 8192;
/// Time allowed for a request to arrive in full, and for each part of its answer to be taken
/// (a large status goes out as long as the client keeps taking it).
pub const IO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// After the answer, time for the client to close its side; what it sends meanwhile is read
/// and dropped, so that the close does not reset the connection under the answer.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(1);
/// Status connections served at once; more are closed at once.
pub const MAX_CONNS: usize = 64;
/// The dashboard's path: the page itself (HTML, CSS and script in one, embedded in the binary).
pub const DASHBOARD_PATH: &str = "/";
/// The path of the live stream (server-sent events) of what `/status` gives.
pub const EVENTS_PATH: &str = "/events";
/// How often the stream sends the status.
pub const EVENT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// The dashboard: one page that renders whichever status document it finds at `/status` (a
/// registrar's or a proxy's) and follows [`EVENTS_PATH`].
const DASHBOARD: &str = include_str!("dashboard.html");

/// A request head, as far as a status listener cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// HEAD: the answer has no body.
    pub head_only: bool,
    /// GET or HEAD; anything else is answered with 405.
    pub allowed: bool,
    /// The path without the query.
    pub path: String,
    /// The query (after `?`), if any.
    pub query: Option<String>,
    /// The `Accept` header, if any: what a scrape of the metrics is encoded as
    /// ([`metrics::Format::negotiate`]).
    pub accept: Option<String>,
}

/// What the bytes read so far amount to.
#[derive(Debug)]
pub enum Parse {
    /// Read more (the head is not complete and not too long yet).
    Incomplete,
    Complete(Request),
    /// Not HTTP, or too long: send these bytes and close.
    Invalid(Vec<u8>),
}

/// Parses a request head from the bytes read so far.
pub fn parse_request(buf: &[u8]) -> Parse {
    // A head is judged by its first MAX_HEAD bytes, however many arrived in one read.
    let buf = &buf[..buf.len().min(MAX_HEAD)];
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {
            let method = req.method.unwrap_or_default();
            let target = req.path.unwrap_or_default();
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p, Some(q.to_owned())),
                None => (target, None),
            };
            let accept = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("accept"))
                .map(|h| String::from_utf8_lossy(h.value).into_owned());
            Parse::Complete(Request {
                head_only: method == "HEAD",
                allowed: method == "GET" || method == "HEAD",
                path: path.to_owned(),
                query,
                accept,
            })
        }
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => Parse::Incomplete,
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
            Parse::Invalid(Reply::text(431, "request head too large").encode(false))
        }
        Err(e) => {
            Parse::Invalid(Reply::text(400, &format!("malformed request: {e}")).encode(false))
        }
    }
}

/// An answer: status code, content type and body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    /// A scrape's metrics: encoded (in place of `body`) in the format the request asks for.
    metrics: Option<metrics::Exposition>,
}

impl Reply {
    /// `value` as pretty JSON (a 500 if it cannot be serialised).
    pub fn json(value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec_pretty(value) {
            Ok(mut body) => {
                body.push(b'\n');
                Self {
                    status: 200,
                    content_type: "application/json",
                    body,
                    metrics: None,
                }
            }
            Err(e) => Self::text(500, &format!("cannot serialise the status: {e}")),
        }
    }

    /// A scrape's answer, in the format the request asks for ([`Reply::encode_for`]).
    pub fn metrics(m: metrics::Exposition) -> Self {
        Self {
            status: 200,
            content_type: metrics::Format::Text.content_type(),
            body: Vec::new(),
            metrics: Some(m),
        }
    }

    /// A one-line plain-text answer.
    pub fn text(status: u16, text: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{text}\n").into_bytes(),
            metrics: None,
        }
    }

    /// The bytes on the wire: an HTTP/1.1 response that closes the connection.
    pub fn encode(&self, head_only: bool) -> Vec<u8> {
        self.encode_for(head_only, None)
    }

    /// [`Reply::encode`] for a request whose `Accept` header is `accept`: metrics go out in
    /// the format it asks for.
    pub fn encode_for(&self, head_only: bool, accept: Option<&str>) -> Vec<u8> {
        let scraped;
        let (content_type, body) = match &self.metrics {
            Some(m) => {
                let format = metrics::Format::negotiate(accept);
                scraped = m.encode_as(format).into_bytes();
                (format.content_type(), &scraped)
            }
            None => (self.content_type, &self.body),
        };
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            content_type,
            body.len()
        );
        if self.status == 405 {
            head.push_str("Allow: GET, HEAD\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        if !head_only {
            out.extend_from_slice(body);
        }
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Answers `req`: `paths` are the paths this listener serves, and `handler` is called with one
/// of them (never with another path, nor for a method other than GET or HEAD). The dashboard
/// ([`DASHBOARD_PATH`]) is answered here when `paths` has it.
pub fn respond(req: &Request, paths: &[&str], handler: impl FnOnce(&str) -> Reply) -> Vec<u8> {
    let reply = if !req.allowed {
        Reply::text(405, "only GET and HEAD")
    } else if req.path == DASHBOARD_PATH && paths.contains(&DASHBOARD_PATH) {
        Reply {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: DASHBOARD.as_bytes().to_vec(),
            metrics: None,
        }
    } else if let Some(path) = paths.iter().find(|p| **p == req.path) {
        handler(path)
    } else {
        let mut hint = String::from("not found; try");
        for p in paths {
            let _ = write!(hint, " GET {p}");
        }
        Reply::text(404, &hint)
    };
    reply.encode_for(req.head_only, req.accept.as_deref())
}

pub mod metrics;

/// Whether `req` asks for the event stream (and this listener, by `paths`, offers it): then the
/// answer is [`event_stream_head`] and, every [`EVENT_INTERVAL`], an [`event`] of the status.
pub fn is_event_stream(req: &Request, paths: &[&str]) -> bool {
    req.allowed && !req.head_only && req.path == EVENTS_PATH && paths.contains(&EVENTS_PATH)
}

/// The head of an event stream: no length, the connection stays open.
pub fn event_stream_head() -> Vec<u8> {
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
        .to_vec()
}

/// One server-sent event carrying `data` (each of its lines a `data:` line).
pub fn event(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 16);
    for line in data.split(|b| *b == b'\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
        out.push(b'\n');
    }
    out.push(b'\n');
    out
}

#[cfg(feature = "tokio")]
mod net;
#[cfg(feature = "tokio")]
pub use net::{get, get_accepting, serve};

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(buf: &[u8]) -> Request {
        match parse_request(buf) {
            Parse::Complete(r) => r,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    #[test]
    fn a_get_is_routed_by_its_path_without_the_query() {
        let req = complete(b"GET /status?x=1 HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(req.path, "/status");
        assert_eq!(req.query.as_deref(), Some("x=1"));
        let out = respond(&req, &["/status"], |p| Reply::text(200, p));
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n/status\n"), "{text}");
        assert!(text.contains("Content-Length: 8\r\n"), "{text}");
    }

    #[test]
    fn head_has_no_body_but_the_length() {
        let req = complete(b"HEAD /status HTTP/1.0\r\n\r\n");
        let out = respond(&req, &["/status"], |_| Reply::text(200, "hello"));
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("Content-Length: 6\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n"), "{text}");
    }

    #[test]
    fn the_dashboard_is_answered_here_and_the_event_stream_is_recognised() {
        let req = complete(b"GET / HTTP/1.1\r\n\r\n");
        let out = respond(&req, &["/status", "/"], |_| unreachable!());
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("Content-Type: text/html"), "{text}");
        assert!(text.contains("EventSource"), "{text}");
        let ev = complete(b"GET /events HTTP/1.1\r\n\r\n");
        assert!(is_event_stream(&ev, &["/events"]));
        assert!(!is_event_stream(&ev, &["/status"]));
        assert_eq!(
            event(b"{\n\"a\": 1\n}"),
            b"data: {\ndata: \"a\": 1\ndata: }\n\n"
        );
    }

    #[test]
    fn unknown_paths_and_methods_are_refused_without_calling_the_handler() {
        let req = complete(b"GET /nope HTTP/1.1\r\n\r\n");
        let out = respond(&req, &["/status", "/"], |_| unreachable!());
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 404"), "{text}");
        assert!(text.contains("try GET /status GET /"), "{text}");
        let req = complete(b"POST /status HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        let out = respond(&req, &["/status"], |_| unreachable!());
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 405"), "{text}");
        assert!(text.contains("Allow: GET, HEAD\r\n"), "{text}");
    }

    #[test]
    fn partial_garbage_and_oversized_heads() {
        assert!(matches!(parse_request(b"GET /sta"), Parse::Incomplete));
        let Parse::Invalid(out) = parse_request(b"\x01\x00\x00\x08garbage\r\n\r\n") else {
            panic!("garbage accepted");
        };
        assert!(out.starts_with(b"HTTP/1.1 400"));
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD + 10, b'a');
        let Parse::Invalid(out) = parse_request(&big) else {
            panic!("oversized head not refused");
        };
        assert!(out.starts_with(b"HTTP/1.1 431"));
        // Also when the whole of it arrived at once.
        big.extend_from_slice(b"\r\n\r\n");
        let Parse::Invalid(out) = parse_request(&big) else {
            panic!("oversized complete head not refused");
        };
        assert!(out.starts_with(b"HTTP/1.1 431"));
    }
}
