//! What the HTTP fuzz targets check (`fuzz/fuzz_targets/http_head.rs` and `chunked.rs`), kept
//! in the library so that an ordinary `cargo test` replays the committed seed corpora through
//! the same code (`tests/seeds.rs`). A property fails by panicking, which is what libFuzzer
//! looks for. Not an API.
//!
//! A proxy goes wrong where it and the party behind it read one message two ways (request
//! smuggling), so the properties compare readings: the head parser with `httparse` called
//! directly; the body framing with RFC 9112 §6 restated here on its own; a head as the proxy
//! forwards it with the head it came from (same method, target, status, end-to-end headers and
//! framing); the chunk scanner with a reference decoder built on `httparse::parse_chunk_size`,
//! wherever the bytes are split.

use crate::http::message::{
    BodyDecoder, BodyState, Framing, Head, HeadError, MAX_HEADERS, Piece, framing, response_framing,
};
use crate::http::request::{parse, plain_host};
use crate::http::upstream::h1::{outgoing_head, response_head};
use bytes::BytesMut;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

/// The proxy's default `max-head`.
const MAX_HEAD: usize = 64 * 1024;
/// Headers a forwarded head may carry beyond those it passes on; a head with more than
/// `MAX_HEADERS` minus these could not be parsed again by the same parser.
const ADDED: usize = 4;
/// Clients as the forwarding headers name them.
const PEERS: [SocketAddr; 2] = [
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)), 1),
    SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)),
        1,
    ),
];

type Fields<'a> = Vec<(&'a [u8], &'a [u8])>;
type HeadParser = fn(&mut BytesMut, usize) -> Result<Option<Head>, HeadError>;

/// The `http_head` target: the bytes as a request head from a client and as a response head
/// from a PE.
pub fn http_head(data: &[u8]) {
    request(data);
    response(data);
}

fn request(data: &[u8]) {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut direct = httparse::Request::new(&mut hs);
    let status = direct.parse(data);
    let Some(head) = agree(data, status, Head::request) else {
        return;
    };
    assert_eq!(Some(head.method()), direct.method.map(str::as_bytes));
    assert_eq!(Some(head.target()), direct.path.map(str::as_bytes));
    assert_eq!(Some(head.minor), direct.version);
    assert_eq!(fields(&head), direct_fields(direct.headers));

    let decided = framing(&head, true);
    assert_eq!(decided.ok(), rfc_framing(&fields(&head), head.minor, true));
    let Ok(r) = parse(head, PEERS[0], Instant::now()) else {
        return;
    };
    if r.head.headers.len() + ADDED > MAX_HEADERS {
        return;
    }
    for peer in PEERS {
        let out = outgoing_head(&r, peer);
        let again = reparse(&out, Head::request);
        let h = &r.head;
        assert_eq!(again.method(), h.method());
        assert_eq!(again.target(), h.target());
        assert_eq!(again.minor, h.minor);
        assert_eq!(framing(&again, true), Ok(r.framing), "framing as forwarded");
        let forwarding = ["x-forwarded-for", "forwarded"];
        let added = ["x-forwarded-for", "forwarded", "connection", "upgrade"];
        assert_eq!(
            without(fields(&again), &added),
            without(passed(h), &forwarding)
        );
        assert_eq!(
            again.values("host").collect::<Vec<_>>(),
            h.values("host").collect::<Vec<_>>()
        );
        forwarding_headers(h, &again, &r.host, peer);
    }
}

/// X-Forwarded-For and Forwarded as forwarded: one each, holding the elements of the
/// client's (RFC 9110 §5.6.1: empty elements do not count) and then the client's address as
/// a well-formed element (RFC 7239 §4).
fn forwarding_headers(h: &Head, again: &Head, host: &[u8], peer: SocketAddr) {
    let ip = peer.ip().to_canonical();
    let elements = |fs: Fields<'_>, name: &str| -> Vec<Vec<u8>> {
        fs.into_iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .flat_map(|(_, v)| v.split(|&b| b == b','))
            .map(|e| e.trim_ascii().to_vec())
            .filter(|e| !e.is_empty())
            .collect()
    };
    let check = |name: &str, ours: Vec<u8>| {
        assert_eq!(again.values(name).count(), 1, "{name} headers as forwarded");
        let mut expected = elements(passed(h), name);
        expected.push(ours);
        assert_eq!(elements(fields(again), name), expected, "{name}");
    };
    check("x-forwarded-for", ip.to_string().into_bytes());
    let mut node = if ip.is_ipv6() {
        format!("for=\"[{ip}]\"")
    } else {
        format!("for={ip}")
    }
    .into_bytes();
    if plain_host(host) {
        node.extend_from_slice(b";host=\"");
        node.extend_from_slice(host);
        node.push(b'"');
    }
    node.extend_from_slice(b";proto=http");
    check("forwarded", node);
}

fn response(data: &[u8]) {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut direct = httparse::Response::new(&mut hs);
    let status = direct.parse(data);
    let Some(head) = agree(data, status, Head::response) else {
        return;
    };
    assert_eq!(Some(head.code), direct.code);
    assert_eq!(Some(head.minor), direct.version);
    // httparse gives an empty reason when it holds obs-text; the head keeps the bytes.
    if let Some(reason) = direct.reason.filter(|r| !r.is_empty()) {
        assert_eq!(head.reason(), reason.as_bytes());
    }
    assert_eq!(fields(&head), direct_fields(direct.headers));

    for head_request in [false, true] {
        let decided = response_framing(&head, head_request);
        let bodiless = head_request || head.code < 200 || head.code == 204 || head.code == 304;
        let expected = if bodiless {
            Some(Framing::None)
        } else {
            rfc_framing(&fields(&head), head.minor, false)
        };
        assert_eq!(
            decided.ok(),
            expected,
            "framing (answer to HEAD: {head_request})"
        );
        let Ok(f) = decided else { continue };
        if head.headers.len() + ADDED > MAX_HEADERS {
            continue;
        }
        for client_minor in [0, 1] {
            if f == Framing::Chunked && client_minor == 0 {
                // The proxy refuses those.
                continue;
            }
            for keep in [false, true] {
                if keep && f == Framing::Close {
                    continue;
                }
                let mut out = BytesMut::new();
                response_head(&head, &mut out, keep, client_minor, None);
                let again = reparse(&out, Head::response);
                assert_eq!(again.code, head.code);
                assert_eq!(again.minor, head.minor);
                assert_eq!(again.reason(), head.reason());
                assert_eq!(without(fields(&again), &["connection"]), passed(&head));
                assert_eq!(response_framing(&again, head_request), Ok(f));
                assert_eq!(again.has_token("connection", "close"), !keep);
            }
        }
    }
}

/// The proxy's parse of `data` where httparse's is `status`: both accept the same head, wait
/// for more or refuse (too large, or malformed). The head when they accept, with a shorter
/// prefix of it still incomplete, as a head arriving in pieces is.
fn agree(
    data: &[u8],
    status: Result<httparse::Status<usize>, httparse::Error>,
    parse: HeadParser,
) -> Option<Head> {
    use httparse::Status::{Complete, Partial};
    let mut buf = BytesMut::from(data);
    match (status, parse(&mut buf, MAX_HEAD)) {
        (Ok(Complete(n)), Ok(Some(h))) => {
            assert!(n <= MAX_HEAD);
            assert_eq!(&h.raw[..], &data[..n]);
            assert_eq!(&buf[..], &data[n..]);
            for k in [n / 2, n - 1] {
                let prefix = parse(&mut BytesMut::from(&data[..k]), MAX_HEAD);
                assert!(
                    matches!(prefix, Ok(None)),
                    "{k} bytes of the head: {prefix:?}"
                );
            }
            Some(h)
        }
        (Ok(Complete(n)), Err(HeadError::TooLarge)) if n > MAX_HEAD => None,
        (Ok(Partial), Ok(None)) if data.len() < MAX_HEAD => None,
        (Ok(Partial), Err(HeadError::TooLarge | HeadError::LineTooLong))
            if data.len() >= MAX_HEAD =>
        {
            None
        }
        (Err(httparse::Error::TooManyHeaders), Err(HeadError::TooLarge)) => None,
        (Err(httparse::Error::Version), Err(HeadError::Version | HeadError::Malformed)) => None,
        (Err(e), Err(HeadError::Malformed)) if e != httparse::Error::TooManyHeaders => None,
        (s, g) => panic!("httparse: {s:?}, the proxy: {g:?}"),
    }
}

/// A head the proxy wrote, parsed again: all of it, as one head.
fn reparse(out: &[u8], parse: HeadParser) -> Head {
    let mut buf = BytesMut::from(out);
    match parse(&mut buf, usize::MAX) {
        Ok(Some(h)) if buf.is_empty() => h,
        other => panic!(
            "the head {:?} as forwarded parses as {other:?}, {} bytes left",
            String::from_utf8_lossy(out),
            buf.len()
        ),
    }
}

fn fields(h: &Head) -> Fields<'_> {
    h.iter().collect()
}

fn direct_fields<'a>(hs: &[httparse::Header<'a>]) -> Fields<'a> {
    hs.iter().map(|h| (h.name.as_bytes(), h.value)).collect()
}

fn without<'a>(fs: Fields<'a>, names: &[&str]) -> Fields<'a> {
    fs.into_iter()
        .filter(|(n, _)| !names.iter().any(|x| n.eq_ignore_ascii_case(x.as_bytes())))
        .collect()
}

/// The headers a proxy passes on; the properties check what that leaves (framing, host).
fn passed(h: &Head) -> Fields<'_> {
    h.end_to_end().collect()
}

/// RFC 9112 §6.1–6.3 as the proxy applies it, written apart from `message::framing`. `None`
/// for the shapes it refuses: Transfer-Encoding with Content-Length, in HTTP/1.0, without a
/// coding, with chunked other than once and last (a request's must be chunked); a
/// Content-Length other than one decimal number (of at most 18 digits) however often repeated.
fn rfc_framing(fs: &Fields<'_>, minor: u8, request: bool) -> Option<Framing> {
    let has = |name: &[u8]| fs.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    let list = |name: &[u8]| -> Vec<&[u8]> {
        fs.iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .flat_map(|(_, v)| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|t| !t.is_empty())
            .collect()
    };
    let chunked = |t: &[u8]| t.eq_ignore_ascii_case(b"chunked");
    if has(b"transfer-encoding") {
        let codings = list(b"transfer-encoding");
        let n = codings.iter().filter(|t| chunked(t)).count();
        let last = codings.last().is_some_and(|t| chunked(t));
        return match () {
            () if has(b"content-length") || minor == 0 || codings.is_empty() => None,
            () if n == 1 && last => Some(Framing::Chunked),
            () if n == 0 && !request => Some(Framing::Close),
            () => None,
        };
    }
    let lengths = list(b"content-length");
    if has(b"content-length") && lengths.is_empty() {
        return None;
    }
    let mut len = None;
    for t in lengths {
        if t.len() > 18 || !t.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = t.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if len.is_some_and(|l| l != n) {
            return None;
        }
        len = Some(n);
    }
    Some(match len {
        Some(0) => Framing::None,
        Some(n) => Framing::Length(n),
        None if request => Framing::None,
        None => Framing::Close,
    })
}

/// The `chunked` target: the bytes as a chunked body, fed to the proxy's scanner whole, a byte
/// at a time and in 7-byte pieces. It must read them as [`reference`] does with bare LF line
/// ends allowed, which reads as `httparse` does where the line ends are CRLF; and a body it
/// decodes, encoded again, must decode to the same chunks and trailers.
pub fn chunked(data: &[u8]) {
    let whole = scan(data, data.len().max(1));
    assert_eq!(scan(data, 1), whole, "fed a byte at a time");
    assert_eq!(scan(data, 7), whole, "fed 7 bytes at a time");
    let lenient = reference(data, true);
    let strict = reference(data, false);
    match (&lenient, whole) {
        (Decoded::Body { end, .. }, Scan::Done(n)) => assert_eq!(n, *end, "end of the body"),
        (Decoded::Partial, Scan::More) | (Decoded::Bad, Scan::Bad) => {}
        (d, s) => panic!("the reference decoder: {d:?}, the proxy's scanner: {s:?}"),
    }
    match (&strict, &lenient) {
        (
            Decoded::Body {
                ambiguous: true, ..
            },
            Decoded::Bad,
        ) => {}
        (Decoded::Body { end, .. }, Decoded::Body { end: e, .. }) => assert_eq!(end, e),
        (Decoded::Body { .. }, d) => panic!("strictly a body, with bare LF allowed {d:?}"),
        _ => {}
    }
    // The payload as an HTTP/2 client gets it (the body decoder), wherever the bytes split:
    // whatever it makes of a body, it is the reference's payload.
    if let Decoded::Body { chunks, .. } = &lenient {
        let want = chunks.concat();
        for step in [1, 7, data.len().max(1)] {
            if let Some(got) = payload(data, step) {
                assert_eq!(
                    got, want,
                    "the body decoder's payload, fed {step} at a time"
                );
            }
        }
    }
    if let Decoded::Body {
        chunks, trailers, ..
    } = &lenient
    {
        let mut again = Vec::new();
        for c in chunks {
            again.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            again.extend_from_slice(c);
            again.extend_from_slice(b"\r\n");
        }
        again.extend_from_slice(b"0\r\n");
        for t in trailers {
            again.extend_from_slice(t);
            again.extend_from_slice(b"\r\n");
        }
        again.extend_from_slice(b"\r\n");
        match reference(&again, false) {
            Decoded::Body {
                chunks: c,
                trailers: t,
                end,
                ..
            } => {
                assert_eq!((&c, &t, end), (chunks, trailers, again.len()));
            }
            d => panic!("encoded again: {d:?}"),
        }
        assert_eq!(scan(&again, again.len()), Scan::Done(again.len()));
    }
}

/// What the proxy's scanner made of a body: its end, or it needs more, or it is malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    Done(usize),
    More,
    Bad,
}

fn scan(data: &[u8], piece: usize) -> Scan {
    let mut body = BodyState::new(Framing::Chunked);
    let mut taken = 0;
    for p in data.chunks(piece) {
        let Ok(n) = body.take(p) else {
            return Scan::Bad;
        };
        taken += n;
        if body.is_done() {
            assert!(n <= p.len());
            return Scan::Done(taken);
        }
        assert_eq!(n, p.len(), "a body not yet ended takes all it is given");
    }
    Scan::More
}

/// The payload a [`BodyDecoder`] takes out of the chunked body at the start of `data`, fed
/// `step` bytes at a time; `None` if it refuses it or it does not end.
fn payload(data: &[u8], step: usize) -> Option<Vec<u8>> {
    let mut d = BodyDecoder::new(Framing::Chunked);
    let (mut buf, mut out) = (BytesMut::new(), Vec::new());
    let mut pieces = data.chunks(step);
    loop {
        match d.next(&mut buf).ok()? {
            Piece::Data(b) if !b.is_empty() => out.extend_from_slice(&b),
            Piece::Data(_) => buf.extend_from_slice(pieces.next()?),
            Piece::Trailers(_) | Piece::End => return Some(out),
        }
    }
}

#[derive(Debug)]
enum Decoded<'a> {
    Body {
        chunks: Vec<&'a [u8]>,
        trailers: Vec<&'a [u8]>,
        end: usize,
        /// A chunk-size line held a bare LF (in its extension, where httparse skips it).
        ambiguous: bool,
    },
    Partial,
    Bad,
}

/// A chunked body decoded by RFC 9112 §7.1, chunk-size lines by `httparse::parse_chunk_size`
/// (with the grammar's one hex digit at least, and the proxy's limit of 15 where httparse
/// allows 16: no chunk is 2^60 bytes long). Trailer lines are any bytes but CR and LF:
/// the proxy passes them on unread. With `bare_lf`, an LF alone also ends a line, except a
/// chunk-size line with an extension: whether such an LF ends the line or belongs to the
/// extension (httparse) is the ambiguity a smuggler needs, so that is malformed.
fn reference(buf: &[u8], bare_lf: bool) -> Decoded<'_> {
    let mut at = 0;
    let mut chunks = Vec::new();
    let mut ambiguous = false;
    loop {
        let rest = &buf[at..];
        match rest.first() {
            None => return Decoded::Partial,
            Some(b) if !b.is_ascii_hexdigit() => return Decoded::Bad,
            Some(_) => {}
        }
        if rest.iter().take_while(|b| b.is_ascii_hexdigit()).count() > 15 {
            return Decoded::Bad;
        }
        let size_line = match rest.iter().position(|&b| b == b'\n') {
            Some(lf) if bare_lf && (lf == 0 || rest[lf - 1] != b'\r') => {
                let mut line = rest[..lf].to_vec();
                if line.contains(&b';') {
                    return Decoded::Bad;
                }
                line.extend_from_slice(b"\r\n");
                match httparse::parse_chunk_size(&line) {
                    Ok(httparse::Status::Complete((n, size))) if n == line.len() => (lf + 1, size),
                    _ => return Decoded::Bad,
                }
            }
            _ => match httparse::parse_chunk_size(rest) {
                Ok(httparse::Status::Complete(v)) => v,
                Ok(httparse::Status::Partial) => return Decoded::Partial,
                Err(_) => return Decoded::Bad,
            },
        };
        let (len, size) = size_line;
        ambiguous |= rest[..len - 1].contains(&b'\n');
        at += len;
        if size == 0 {
            break;
        }
        let rest = &buf[at..];
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if rest.len() <= size {
            return Decoded::Partial;
        }
        chunks.push(&rest[..size]);
        at += size;
        match line_end(&buf[at..], bare_lf) {
            Some(Ok(n)) => at += n,
            Some(Err(())) => return Decoded::Bad,
            None => return Decoded::Partial,
        }
    }
    let mut trailers = Vec::new();
    loop {
        let rest = &buf[at..];
        let Some(i) = rest.iter().position(|&b| b == b'\r' || b == b'\n') else {
            return Decoded::Partial;
        };
        match line_end(&rest[i..], bare_lf) {
            Some(Ok(n)) if i == 0 => {
                return Decoded::Body {
                    chunks,
                    trailers,
                    end: at + n,
                    ambiguous,
                };
            }
            Some(Ok(n)) => {
                trailers.push(&rest[..i]);
                at += i + n;
            }
            Some(Err(())) => return Decoded::Bad,
            None => return Decoded::Partial,
        }
    }
}

/// The length of the line end at the start of `buf`; `None` if it may still come.
fn line_end(buf: &[u8], bare_lf: bool) -> Option<Result<usize, ()>> {
    match buf {
        [b'\r', b'\n', ..] => Some(Ok(2)),
        [b'\n', ..] if bare_lf => Some(Ok(1)),
        [] | [b'\r'] => None,
        _ => Some(Err(())),
    }
}
