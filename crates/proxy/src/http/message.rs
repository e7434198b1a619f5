//! HTTP/1.1 message heads, body framing and short error answers, as far as a proxy needs them.
//!
//! A proxy forwards most of a message untouched, so a head is kept as the bytes it arrived in
//! plus the positions of its parts (parsed by `httparse`); only hop-by-hop headers are dropped
//! and the forwarding headers added on the way out. Bodies are never parsed, only delimited:
//! by Content-Length, by the chunked coding (scanned, passed through as it is), or by the
//! connection's end (RFC 9112 §6).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::ops::Range;

pub const MAX_HEADERS: usize = 128;

/// A parsed head: the raw bytes and where its parts are.
#[derive(Debug, Clone)]
pub struct Head {
    pub raw: Bytes,
    /// Request: method and target; response: status code and reason.
    pub first: Range<usize>,
    pub second: Range<usize>,
    pub code: u16,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    pub headers: Vec<(Range<usize>, Range<usize>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadError {
    Malformed,
    /// Larger than allowed (431 for a request).
    TooLarge,
    /// The first line alone is larger than allowed (414 for a request).
    LineTooLong,
    /// A version other than HTTP/1.x (505 for a request; an HTTP/2 preface is one).
    Version,
}

fn span(base: &[u8], part: &[u8]) -> Range<usize> {
    let start = (part.as_ptr() as usize).saturating_sub(base.as_ptr() as usize);
    start..start + part.len()
}

/// The head's length from a parse result; `None` while it is incomplete.
fn parsed_len(
    r: Result<httparse::Status<usize>, httparse::Error>,
    have: &[u8],
    max: usize,
) -> Result<Option<usize>, HeadError> {
    match r {
        Ok(httparse::Status::Complete(n)) if n > max => Err(HeadError::TooLarge),
        Ok(httparse::Status::Complete(n)) => Ok(Some(n)),
        Ok(httparse::Status::Partial) if have.len() >= max => {
            Err(if have[..max].contains(&b'\n') {
                HeadError::TooLarge
            } else {
                HeadError::LineTooLong
            })
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(HeadError::TooLarge),
        Err(httparse::Error::Version) if other_http_version(have) => Err(HeadError::Version),
        Err(_) => Err(HeadError::Malformed),
    }
}

/// Whether the first line names an HTTP version other than 1.x (not just a third word that
/// is no version at all).
fn other_http_version(buf: &[u8]) -> bool {
    let line = buf.split(|&b| b == b'\n').next().unwrap_or(buf);
    line.windows(5).any(|w| w == b"HTTP/") && !line.windows(7).any(|w| w == b"HTTP/1.")
}

fn header_spans(base: &[u8], hs: &[httparse::Header<'_>]) -> Vec<(Range<usize>, Range<usize>)> {
    hs.iter()
        .map(|h| (span(base, h.name.as_bytes()), span(base, h.value)))
        .collect()
}

/// A request head written from parts that are valid already (an HTTP/2 request's), its spans
/// noted on the way: the `Head` a parse of the same bytes gives, without that parse.
pub(crate) struct HeadWriter {
    buf: BytesMut,
    first: Range<usize>,
    second: Range<usize>,
    headers: Vec<(Range<usize>, Range<usize>)>,
}

impl HeadWriter {
    /// The request line; `method` and `target` must be a token and a request target.
    pub(crate) fn request(method: &[u8], target: &[u8], headers: usize) -> Self {
        let mut buf = BytesMut::with_capacity(256);
        buf.put_slice(method);
        buf.put_u8(b' ');
        buf.put_slice(target);
        buf.put_slice(b" HTTP/1.1\r\n");
        let m = method.len();
        HeadWriter {
            buf,
            first: 0..m,
            second: m + 1..m + 1 + target.len(),
            headers: Vec::with_capacity(headers),
        }
    }

    /// A header; the value without line ends (as a `HeaderValue` is). Its span leaves out
    /// surrounding blanks, as a parse does.
    pub(crate) fn header(&mut self, name: &[u8], value: &[u8]) {
        let n = self.buf.len();
        self.buf.put_slice(name);
        self.buf.put_slice(b": ");
        let v = self.buf.len();
        self.buf.put_slice(value);
        self.buf.put_slice(b"\r\n");
        let trimmed = value.trim_ascii();
        let start = v + (trimmed.as_ptr() as usize - value.as_ptr() as usize);
        self.headers
            .push((n..n + name.len(), start..start + trimmed.len()));
    }

    /// The head, or `TooLarge` where a parse would find it too large.
    pub(crate) fn finish(mut self, max: usize) -> Result<Head, HeadError> {
        self.buf.put_slice(b"\r\n");
        if self.buf.len() > max || self.headers.len() > MAX_HEADERS {
            return Err(HeadError::TooLarge);
        }
        Ok(Head {
            raw: self.buf.freeze(),
            first: self.first,
            second: self.second,
            code: 0,
            minor: 1,
            headers: self.headers,
        })
    }
}

impl Head {
    /// Parses a request head at the start of `buf`; on success the head is split off `buf`.
    pub fn request(buf: &mut BytesMut, max: usize) -> Result<Option<Head>, HeadError> {
        let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut hs);
        let Some(len) = parsed_len(req.parse(buf), buf, max)? else {
            return Ok(None);
        };
        let base: &[u8] = buf;
        let (Some(m), Some(p), Some(v)) = (req.method, req.path, req.version) else {
            return Err(HeadError::Malformed);
        };
        let head = Head {
            first: span(base, m.as_bytes()),
            second: span(base, p.as_bytes()),
            code: 0,
            minor: v,
            headers: header_spans(base, req.headers),
            raw: Bytes::new(),
        };
        Ok(Some(Head {
            raw: buf.split_to(len).freeze(),
            ..head
        }))
    }

    /// Parses a response head at the start of `buf`; on success the head is split off `buf`.
    pub fn response(buf: &mut BytesMut, max: usize) -> Result<Option<Head>, HeadError> {
        let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut hs);
        let Some(len) = parsed_len(resp.parse(buf), buf, max)? else {
            return Ok(None);
        };
        let (Some(code), Some(v)) = (resp.code, resp.version) else {
            return Err(HeadError::Malformed);
        };
        // httparse skips empty lines before the status line; the status code's digits sit
        // right after "HTTP/1.x ", a reason (any bytes, httparse gives "" for obs-text) after
        // one more space, and the line ends in CRLF or LF.
        let code_at = buf
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n')
            .count()
            + 9;
        let reason_at = code_at + 3 + usize::from(buf.get(code_at + 3) == Some(&b' '));
        let reason_end = buf[reason_at..len]
            .iter()
            .position(|&b| b == b'\r' || b == b'\n')
            .map_or(reason_at, |i| reason_at + i);
        let head = Head {
            first: code_at..code_at + 3,
            second: reason_at..reason_end,
            code,
            minor: v,
            headers: header_spans(buf, resp.headers),
            raw: Bytes::new(),
        };
        Ok(Some(Head {
            raw: buf.split_to(len).freeze(),
            ..head
        }))
    }

    pub fn method(&self) -> &[u8] {
        &self.raw[self.first.clone()]
    }

    pub fn target(&self) -> &[u8] {
        &self.raw[self.second.clone()]
    }

    pub fn reason(&self) -> &[u8] {
        &self.raw[self.second.clone()]
    }

    /// A response's status line as it came, without its line end.
    pub fn status_line(&self) -> &[u8] {
        &self.raw[self.first.start.saturating_sub(9)..self.second.end]
    }

    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.headers
            .iter()
            .map(|(n, v)| (&self.raw[n.clone()], &self.raw[v.clone()]))
    }

    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    pub fn get<'a>(&'a self, name: &str) -> Option<&'a [u8]> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The comma-separated tokens of every `name` header, trimmed.
    pub fn tokens<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.values(name)
            .flat_map(|v| v.split(|&b| b == b','))
            .map(|t| t.trim_ascii())
            .filter(|t| !t.is_empty())
    }

    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.tokens(name)
            .any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
    }

    /// The headers a proxy passes on (RFC 9110 §7.6.1): not hop-by-hop, not named by
    /// Connection, except that no connection option takes away the headers that frame the
    /// message or name its host. Those are for every recipient; dropping them would have the
    /// next hop read the message otherwise than the proxy does (a smuggled request).
    pub fn end_to_end(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let named: Vec<&[u8]> = self.tokens("connection").collect();
        self.iter().filter(move |(n, _)| {
            !is_hop_by_hop(n)
                && (!named.iter().any(|t| t.eq_ignore_ascii_case(n))
                    || [&b"content-length"[..], b"transfer-encoding", b"host"]
                        .iter()
                        .any(|f| n.eq_ignore_ascii_case(f)))
        })
    }

    /// Whether the sender of this request wants the connection kept open afterwards:
    /// HTTP/1.1 unless it says `close`, HTTP/1.0 only if it says `keep-alive`.
    pub fn wants_keep_alive(&self) -> bool {
        !self.has_token("connection", "close")
            && (self.minor == 1 || self.has_token("connection", "keep-alive"))
    }
}

/// How a body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
    /// Until the connection closes (responses only).
    Close,
}

/// Body framing from Transfer-Encoding and Content-Length. A message with both, with either
/// present but empty, with a transfer coding that does not end in chunked (requests) or with
/// conflicting lengths is refused: those are the request-smuggling shapes.
pub fn framing(head: &Head, request: bool) -> Result<Framing, HeadError> {
    let empty = |name| head.get(name).is_some() && head.tokens(name).next().is_none();
    if empty("transfer-encoding") || empty("content-length") {
        return Err(HeadError::Malformed);
    }
    let te: Vec<&[u8]> = head.tokens("transfer-encoding").collect();
    let has_cl = head.get("content-length").is_some();
    if !te.is_empty() {
        if has_cl || head.minor == 0 {
            return Err(HeadError::Malformed);
        }
        let chunked_last = te
            .last()
            .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"));
        if te[..te.len() - 1]
            .iter()
            .any(|t| t.eq_ignore_ascii_case(b"chunked"))
        {
            return Err(HeadError::Malformed);
        }
        return match (chunked_last, request) {
            (true, _) => Ok(Framing::Chunked),
            (false, true) => Err(HeadError::Malformed),
            (false, false) => Ok(Framing::Close),
        };
    }
    let mut len: Option<u64> = None;
    for v in head.tokens("content-length") {
        let n = parse_decimal(v).ok_or(HeadError::Malformed)?;
        if len.is_some_and(|l| l != n) {
            return Err(HeadError::Malformed);
        }
        len = Some(n);
    }
    Ok(match len {
        Some(0) => Framing::None,
        Some(n) => Framing::Length(n),
        None if request => Framing::None,
        None => Framing::Close,
    })
}

/// A response's body framing; `head_request` when it answers a HEAD request. 1xx, 204 and
/// 304 answers and answers to HEAD have no body whatever their headers say (RFC 9112 §6.3).
pub fn response_framing(resp: &Head, head_request: bool) -> Result<Framing, HeadError> {
    if head_request || resp.code < 200 || resp.code == 204 || resp.code == 304 {
        Ok(Framing::None)
    } else {
        framing(resp, false)
    }
}

fn parse_decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')))
}

/// Finds the end of a chunked body in the bytes as they pass (RFC 9112 §7.1), accepting bare
/// LF line ends as many servers send them, except after a chunk extension. Chunk sizes have
/// at most 15 hex digits.
#[derive(Debug, Clone, Default)]
pub struct ChunkScanner {
    state: Chunk,
    size: u64,
    digits: u8,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Chunk {
    #[default]
    Size,
    /// Whitespace after the size: an extension or the line end comes next.
    SizeWs,
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// In the trailer section; `true` at the start of a line.
    Trailer(bool),
    /// After a CR in the trailer section; `true` if it ends an empty line.
    TrailerLf(bool),
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkError;

impl ChunkScanner {
    pub fn is_done(&self) -> bool {
        self.state == Chunk::Done
    }

    /// Consumes bytes of the body; returns how many belong to it (all of `buf` unless the body
    /// ends inside it).
    pub fn scan(&mut self, buf: &[u8]) -> Result<usize, ChunkError> {
        let mut i = 0;
        while i < buf.len() {
            let b = buf[i];
            match self.state {
                Chunk::Data => {
                    let take =
                        (buf.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                    self.size -= take as u64;
                    i += take;
                    if self.size == 0 {
                        self.state = Chunk::DataCr;
                    }
                    continue;
                }
                Chunk::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        if self.digits >= 15 {
                            return Err(ChunkError);
                        }
                        let d = (b as char).to_digit(16).unwrap_or(0);
                        self.size = self.size * 16 + u64::from(d);
                        self.digits += 1;
                    }
                    b';' if self.digits > 0 => self.state = Chunk::Ext,
                    b' ' | b'\t' if self.digits > 0 => self.state = Chunk::SizeWs,
                    b'\r' if self.digits > 0 => self.state = Chunk::SizeLf,
                    b'\n' if self.digits > 0 => self.end_size_line(),
                    _ => return Err(ChunkError),
                },
                Chunk::SizeWs => match b {
                    b' ' | b'\t' => {}
                    b';' => self.state = Chunk::Ext,
                    b'\r' => self.state = Chunk::SizeLf,
                    b'\n' => self.end_size_line(),
                    _ => return Err(ChunkError),
                },
                // Whether an LF alone ends the line or belongs to the extension (httparse)
                // is a question two parsers can answer apart: it is refused.
                Chunk::Ext => match b {
                    b'\r' => self.state = Chunk::SizeLf,
                    b'\n' => return Err(ChunkError),
                    _ => {}
                },
                Chunk::SizeLf => {
                    if b != b'\n' {
                        return Err(ChunkError);
                    }
                    self.end_size_line();
                }
                Chunk::DataCr => match b {
                    b'\r' => self.state = Chunk::DataLf,
                    b'\n' => self.state = Chunk::Size,
                    _ => return Err(ChunkError),
                },
                Chunk::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkError);
                    }
                    self.state = Chunk::Size;
                }
                Chunk::Trailer(start) => {
                    self.state = match (start, b) {
                        (_, b'\r') => Chunk::TrailerLf(start),
                        (true, b'\n') => Chunk::Done,
                        (false, b'\n') => Chunk::Trailer(true),
                        _ => Chunk::Trailer(false),
                    }
                }
                Chunk::TrailerLf(empty) => {
                    self.state = match (b, empty) {
                        (b'\n', true) => Chunk::Done,
                        (b'\n', false) => Chunk::Trailer(true),
                        _ => return Err(ChunkError),
                    }
                }
                Chunk::Done => return Ok(i),
            }
            i += 1;
            if self.state == Chunk::Done {
                return Ok(i);
            }
        }
        Ok(i)
    }

    fn end_size_line(&mut self) {
        self.state = if self.size == 0 {
            Chunk::Trailer(true)
        } else {
            Chunk::Data
        };
        self.digits = 0;
    }
}

/// Tracks where a body ends as its bytes pass.
#[derive(Debug, Clone)]
pub enum BodyState {
    Length(u64),
    Chunked(ChunkScanner),
    Close,
    Done,
}

impl BodyState {
    pub fn new(f: Framing) -> Self {
        match f {
            Framing::None | Framing::Length(0) => BodyState::Done,
            Framing::Length(n) => BodyState::Length(n),
            Framing::Chunked => BodyState::Chunked(ChunkScanner::default()),
            Framing::Close => BodyState::Close,
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self, BodyState::Done)
    }

    /// How many of `buf`'s bytes belong to the body.
    pub fn take(&mut self, buf: &[u8]) -> Result<usize, ChunkError> {
        let n = match self {
            BodyState::Length(left) => {
                let n = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                *left -= n as u64;
                if *left == 0 {
                    *self = BodyState::Done;
                }
                n
            }
            BodyState::Chunked(s) => {
                let n = s.scan(buf)?;
                if s.is_done() {
                    *self = BodyState::Done;
                }
                n
            }
            BodyState::Close => buf.len(),
            BodyState::Done => 0,
        };
        Ok(n)
    }
}

/// A piece of a body as [`BodyDecoder`] takes it apart.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Payload (empty: more bytes are needed).
    Data(bytes::Bytes),
    /// The trailer fields of a chunked body, which ends with them.
    Trailers(Vec<(Vec<u8>, Vec<u8>)>),
    /// The body ended.
    End,
}

/// Takes the payload out of a body of a given framing, chunk sizes and line ends removed:
/// for a receiver that frames it otherwise (an HTTP/2 client).
#[derive(Debug)]
pub enum BodyDecoder {
    Length(u64),
    /// In the chunked coding: the bytes left of the current chunk's data, and whether its
    /// line end is still to come.
    Chunked {
        left: u64,
        crlf: bool,
    },
    Close,
    /// The trailer section of a chunked body.
    Trailers,
    Done,
}

/// Largest trailer section of a chunked body.
const MAX_TRAILERS: usize = 16 * 1024;

impl BodyDecoder {
    pub fn new(f: Framing) -> Self {
        match f {
            Framing::None | Framing::Length(0) => Self::Done,
            Framing::Length(n) => Self::Length(n),
            Framing::Chunked => Self::Chunked {
                left: 0,
                crlf: false,
            },
            Framing::Close => Self::Close,
        }
    }

    /// The body ended (a known length taken whole; a chunked body's end is only known with
    /// its last piece, [`Piece::Trailers`] or [`Piece::End`]).
    pub fn is_done(&self) -> bool {
        matches!(self, Self::Done)
    }

    /// The next piece from the bytes in `buf` (consumed as far as they go). At the end of
    /// the input, [`Piece::Data`] empty means the body was cut short, unless it is `Close`.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Piece, ChunkError> {
        loop {
            match self {
                Self::Done => return Ok(Piece::End),
                Self::Close => return Ok(Piece::Data(buf.split().freeze())),
                Self::Length(left) => {
                    let n = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                    *left -= n as u64;
                    if *left == 0 {
                        *self = Self::Done;
                    }
                    return Ok(Piece::Data(buf.split_to(n).freeze()));
                }
                Self::Chunked { left, crlf } if *left > 0 => {
                    let n = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                    *left -= n as u64;
                    *crlf = true;
                    return Ok(Piece::Data(buf.split_to(n).freeze()));
                }
                Self::Chunked { crlf, .. } if *crlf => {
                    let end = match buf.first() {
                        None => return Ok(Piece::Data(Bytes::new())),
                        Some(b'\n') => 1,
                        Some(b'\r') if buf.len() < 2 => {
                            return Ok(Piece::Data(Bytes::new()));
                        }
                        Some(b'\r') if buf[1] == b'\n' => 2,
                        Some(_) => return Err(ChunkError),
                    };
                    buf.advance(end);
                    *crlf = false;
                }
                Self::Chunked { left, .. } => {
                    // The size line, to its LF (a bare LF is taken, as the scanner does).
                    let Some(lf) = buf.iter().take(1024).position(|&b| b == b'\n') else {
                        if buf.len() >= 1024 {
                            return Err(ChunkError);
                        }
                        return Ok(Piece::Data(Bytes::new()));
                    };
                    let line = buf[..lf].strip_suffix(b"\r").unwrap_or(&buf[..lf]);
                    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
                    let after = &line[digits..];
                    if digits == 0
                        || digits > 15
                        || !(after.is_empty()
                            || after[0] == b';'
                            || after[0] == b' '
                            || after[0] == b'\t')
                    {
                        return Err(ChunkError);
                    }
                    let size = line[..digits].iter().fold(0u64, |n, &d| {
                        n * 16 + u64::from(char::from(d).to_digit(16).unwrap_or(0))
                    });
                    buf.advance(lf + 1);
                    if size == 0 {
                        *self = Self::Trailers;
                    } else {
                        *left = size;
                    }
                }
                Self::Trailers => {
                    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    return match httparse::parse_headers(buf, &mut hs) {
                        Ok(httparse::Status::Complete((used, hs))) => {
                            let t = hs
                                .iter()
                                .filter(|h| !is_hop_by_hop(h.name.as_bytes()))
                                .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
                                .collect::<Vec<_>>();
                            buf.advance(used);
                            *self = Self::Done;
                            Ok(if t.is_empty() {
                                Piece::End
                            } else {
                                Piece::Trailers(t)
                            })
                        }
                        Ok(httparse::Status::Partial) if buf.len() > MAX_TRAILERS => {
                            Err(ChunkError)
                        }
                        Ok(httparse::Status::Partial) => Ok(Piece::Data(Bytes::new())),
                        Err(_) => Err(ChunkError),
                    };
                }
            }
        }
    }
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1); never forwarded.
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    const HOP: [&[u8]; 8] = [
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"trailer",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// A short error answer, after which the connection is closed.
pub(crate) fn error_response(code: u16, text: &str) -> Vec<u8> {
    error_response_with(code, text, "")
}

/// [`error_response`] with `extra` header lines (each ending in CRLF).
pub(crate) fn error_response_with(code: u16, text: &str, extra: &str) -> Vec<u8> {
    let reason = match code {
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        505 => "HTTP Version Not Supported",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    };
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{text}\n",
        text.len() + 1
    )
    .into_bytes()
}

/// Appends `data` to `out` in the request's framing (a chunk of the chunked coding).
pub(crate) fn frame_into(out: &mut BytesMut, data: &[u8], chunked: bool) {
    if !chunked {
        out.put_slice(data);
    } else if !data.is_empty() {
        out.put_slice(format!("{:x}\r\n", data.len()).as_bytes());
        out.put_slice(data);
        out.put_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A written head is the head a parse of its bytes gives, spans and all.
    #[test]
    fn a_written_head_is_what_its_parse_gives() {
        let values: [&[u8]; 6] = [b"x", b" padded\t", b"", b"a, b;q=0.5", b"\xe9t\xe9", b"\t"];
        for count in [0usize, 1, 5, MAX_HEADERS] {
            let mut w = HeadWriter::request(b"PATCH", b"/a/b?c=d&e", count);
            for i in 0..count {
                let name = format!("x-h{i}");
                w.header(name.as_bytes(), values[i % values.len()]);
            }
            let written = w.finish(1 << 20).unwrap();
            let mut raw = BytesMut::from(&written.raw[..]);
            let parsed = Head::request(&mut raw, 1 << 20).unwrap().unwrap();
            assert!(raw.is_empty());
            assert_eq!(written.raw, parsed.raw);
            assert_eq!(
                (written.first.clone(), written.second.clone(), written.minor),
                (parsed.first.clone(), parsed.second.clone(), parsed.minor)
            );
            assert_eq!(written.headers, parsed.headers, "{count} headers");
        }
        let mut w = HeadWriter::request(b"GET", b"/", 0);
        for i in 0..=MAX_HEADERS {
            w.header(format!("x-{i}").as_bytes(), b"1");
        }
        assert_eq!(w.finish(1 << 20).err(), Some(HeadError::TooLarge));
        let mut w = HeadWriter::request(b"GET", b"/", 1);
        w.header(b"x-big", &[b'a'; 100]);
        assert_eq!(w.finish(100).err(), Some(HeadError::TooLarge));
    }

    fn req(s: &str) -> Result<Option<Head>, HeadError> {
        Head::request(&mut BytesMut::from(s), 65536)
    }

    #[test]
    fn request_heads_are_split_off_with_their_parts() {
        let mut b = BytesMut::from(
            "GET /a?b HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Foo\r\n\r\nrest",
        );
        let h = Head::request(&mut b, 1024).unwrap().unwrap();
        assert_eq!(h.method(), b"GET");
        assert_eq!(h.target(), b"/a?b");
        assert_eq!(h.get("HOST"), Some(&b"x"[..]));
        assert!(h.has_token("connection", "foo"));
        assert_eq!(&b[..], b"rest");
        assert!(req("GET / HTTP/1.1\r\nHost: x\r\n").unwrap().is_none());
        assert_eq!(
            req("GET / HTTP/1.1\r\nHo st: x\r\n\r\n").unwrap_err(),
            HeadError::Malformed
        );
        assert_eq!(req("GARBAGE\r\n\r\n").unwrap_err(), HeadError::Malformed);
        assert_eq!(
            req("GET / HTTP/2.0\r\n\r\n").unwrap_err(),
            HeadError::Version
        );
        assert_eq!(
            req("NOT A REQUEST\r\n\r\n").unwrap_err(),
            HeadError::Malformed
        );
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(70_000));
        assert_eq!(req(&long).unwrap_err(), HeadError::LineTooLong);
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\n", "a".repeat(70_000));
        assert_eq!(req(&big).unwrap_err(), HeadError::TooLarge);
    }

    #[test]
    fn response_heads_know_their_status_line_whatever_the_line_ends() {
        // Found by fuzzing: a bare LF after the status line, and empty lines before it.
        for (text, line, reason) in [
            ("HTTP/1.1 200\n\n", "HTTP/1.1 200", ""),
            (
                "\r\n\nHTTP/1.1 404 Not Found\nA: b\r\n\n",
                "HTTP/1.1 404 Not Found",
                "Not Found",
            ),
            ("HTTP/1.0 200 \r\n\r\n", "HTTP/1.0 200 ", ""),
            (
                "HTTP/1.1 200 \u{dc}berall\r\n\r\n",
                "HTTP/1.1 200 \u{dc}berall",
                "\u{dc}berall",
            ),
        ] {
            let h = Head::response(&mut BytesMut::from(text), 1024)
                .unwrap()
                .unwrap();
            assert_eq!(h.status_line(), line.as_bytes(), "{text:?}");
            assert_eq!(h.reason(), reason.as_bytes(), "{text:?}");
            assert_eq!(&h.raw[h.first.clone()], &line.as_bytes()[9..12]);
        }
    }

    #[test]
    fn framing_refuses_the_smuggling_shapes() {
        let f = |s: &str| framing(&req(s).unwrap().unwrap(), true);
        assert_eq!(
            f("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n"),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            f("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            Ok(Framing::Chunked)
        );
        assert!(
            f("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n")
                .is_err()
        );
        assert!(f("POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n").is_err());
        assert!(f("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n").is_err());
        assert!(f("POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n").is_err());
        // Found by fuzzing: a framing header without a value was as good as none.
        assert!(f("POST / HTTP/1.1\r\nTransfer-Encoding: \r\nContent-Length: 5\r\n\r\n").is_err());
        assert!(f("POST / HTTP/1.1\r\nTransfer-Encoding: ,\r\n\r\n").is_err());
        assert!(f("POST / HTTP/1.1\r\nContent-Length:\r\n\r\n").is_err());
        assert_eq!(f("GET / HTTP/1.1\r\n\r\n"), Ok(Framing::None));
    }

    /// Everything a decoder takes out of `input` fed in pieces of `step` bytes.
    fn decode(f: Framing, input: &[u8], step: usize) -> Result<(Vec<u8>, Vec<Piece>), ChunkError> {
        let mut d = BodyDecoder::new(f);
        let (mut buf, mut data, mut rest) = (BytesMut::new(), Vec::new(), Vec::new());
        let mut chunks = input.chunks(step.max(1));
        loop {
            match d.next(&mut buf)? {
                Piece::Data(b) if !b.is_empty() => data.extend_from_slice(&b),
                Piece::Data(_) => match chunks.next() {
                    Some(c) => buf.extend_from_slice(c),
                    None => return Ok((data, rest)),
                },
                other => {
                    rest.push(other);
                    return Ok((data, rest));
                }
            }
        }
    }

    #[test]
    fn the_body_decoder_takes_the_payload_out_wherever_the_bytes_split() {
        let body =
            b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\ngrpc-status: 0\r\nconnection: x\r\n\r\n";
        for step in 1..body.len() {
            let (data, rest) = decode(Framing::Chunked, body, step).unwrap();
            assert_eq!(data, b"hello world", "step {step}");
            let want = vec![(b"grpc-status".to_vec(), b"0".to_vec())];
            assert_eq!(
                rest,
                [Piece::Trailers(want)],
                "step {step}: hop-by-hop dropped"
            );
        }
        // Bare LF line ends; no trailers.
        let (data, rest) = decode(Framing::Chunked, b"3\nabc\n0\n\n", 2).unwrap();
        assert_eq!(
            (data.as_slice(), rest.as_slice()),
            (&b"abc"[..], &[Piece::End][..])
        );
        let (data, rest) = decode(Framing::Length(4), b"abcdEXTRA", 3).unwrap();
        assert_eq!(
            (data.as_slice(), rest.as_slice()),
            (&b"abcd"[..], &[Piece::End][..])
        );
        // Cut short: no end.
        let (data, rest) = decode(Framing::Chunked, b"5\r\nhel", 4).unwrap();
        assert_eq!((data.as_slice(), rest.len()), (&b"hel"[..], 0));
        for bad in [&b"zz\r\n"[..], b"3\r\nabcX\r\n", b"3\r\nabc\rX"] {
            assert!(decode(Framing::Chunked, bad, 1).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_chunk_scanner_finds_the_end_wherever_the_bytes_split() {
        let body =
            b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nTrailer: x\r\n\r\nNEXT";
        let end = body.len() - 4;
        for split in 0..body.len() {
            let mut s = ChunkScanner::default();
            let a = s.scan(&body[..split]).unwrap();
            let b = s.scan(&body[split..]).unwrap();
            assert_eq!(a + b, end, "split at {split}");
            assert!(s.is_done());
        }
        let mut s = ChunkScanner::default();
        assert_eq!(s.scan(b"0\n\nX"), Ok(3));
        assert_eq!(ChunkScanner::default().scan(b"0 \t; x\r\n\r\n"), Ok(10));
        // Found by fuzzing: anything after the size and a space; a CR alone in a trailer line
        // or in an extension and, in the same state, an LF alone after an extension.
        let found: [&[u8]; 4] = [
            b"10 0\r\n",
            b"0\r\nA: b\rc\r\n\r\n",
            b"0;a\rb\r\n\r\n",
            b"5;a\nxxxxx\r\n0\r\n\r\n",
        ];
        for bad in [&b"zz\r\n"[..], b"ffffffffffffffff\r\n"]
            .iter()
            .chain(&found)
        {
            let text = String::from_utf8_lossy(bad);
            assert!(ChunkScanner::default().scan(bad).is_err(), "{text:?}");
        }
    }
}
