//! What a request says about itself, whatever HTTP version it came in: the value the pipeline
//! carries from parse to log ([`Request`]), and what its forwarding headers become on the way to
//! a PE ([`Forwarding`]). An HTTP/2 request is rewritten as an HTTP/1.1 head first
//! (`crate::http::h2`), so both versions are analysed here alike.

use crate::http::message::{Framing, Head, framing};
use bytes::{BufMut, Bytes, BytesMut};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use tracing::debug;

/// What the request says about itself: the value [`parse`] makes.
pub(crate) struct Request {
    pub(crate) head: Head,
    pub(crate) framing: Framing,
    pub(crate) host: Bytes,
    pub(crate) path_end: usize,
    pub(crate) keep_alive: bool,
    pub(crate) expect_continue: bool,
    pub(crate) upgrade: bool,
    pub(crate) idempotent: bool,
    pub(crate) started: Instant,
    /// Service level (1 without `[levels]`).
    pub(crate) level: usize,
}

/// A request refused by [`parse`]: its status, the text that says why, and its head's bytes
/// (for the access log's method and target).
pub(crate) type Refused = (u16, &'static str, Bytes);

/// Step parse: the request analysed, or why it is refused.
pub(crate) fn parse(head: Head, peer: SocketAddr, started: Instant) -> Result<Request, Refused> {
    let r = analyse(head, started).map_err(|(why, raw)| {
        debug!("client {peer}: {why}");
        (400, why, raw)
    })?;
    if r.head.method() == b"CONNECT" {
        return Err((405, "CONNECT is not served", r.head.raw));
    }
    Ok(r)
}

fn idempotent(method: &[u8]) -> bool {
    matches!(
        method,
        b"GET" | b"HEAD" | b"PUT" | b"DELETE" | b"OPTIONS" | b"TRACE"
    )
}

/// An absolute-form request (`GET http://host/path HTTP/1.1`) as the origin-form one it
/// stands for: its authority replaces any Host header (RFC 9112 §3.2.2, which a server must
/// accept), and the PE gets the path. `None` for any other form.
fn origin_form(head: &Head) -> Option<Result<Head, &'static str>> {
    let target = head.target();
    let scheme_end = target.windows(3).position(|w| w == b"://")?;
    let scheme = &target[..scheme_end];
    if !(scheme.eq_ignore_ascii_case(b"http") || scheme.eq_ignore_ascii_case(b"https")) {
        return Some(Err("only http and https request targets are served"));
    }
    let rest = &target[scheme_end + 3..];
    let path_start = rest
        .iter()
        .position(|&b| b == b'/' || b == b'?')
        .unwrap_or(rest.len());
    let (authority, path) = rest.split_at(path_start);
    if authority.is_empty() || authority.contains(&b'@') {
        return Some(Err("bad authority in the request target"));
    }
    let mut b = BytesMut::with_capacity(head.raw.len() + 16);
    b.put_slice(head.method());
    b.put_u8(b' ');
    if !path.starts_with(b"/") {
        b.put_u8(b'/');
    }
    b.put_slice(path);
    b.put_slice(if head.minor == 1 {
        b" HTTP/1.1\r\nHost: "
    } else {
        b" HTTP/1.0\r\nHost: "
    });
    b.put_slice(authority);
    b.put_slice(b"\r\n");
    for (n, v) in head.iter() {
        if n.eq_ignore_ascii_case(b"host") {
            continue;
        }
        b.put_slice(n);
        b.put_slice(b": ");
        b.put_slice(v);
        b.put_slice(b"\r\n");
    }
    b.put_slice(b"\r\n");
    let max = b.len() + 1;
    Some(match Head::request(&mut b, max) {
        Ok(Some(h)) => Ok(h),
        _ => Err("malformed absolute-form request"),
    })
}

/// The request, or why not with the head's bytes.
fn analyse(head: Head, started: Instant) -> Result<Request, (&'static str, Bytes)> {
    let head = match origin_form(&head) {
        Some(Ok(h)) => h,
        Some(Err(why)) => return Err((why, head.raw)),
        None => head,
    };
    let Ok(framing) = framing(&head, true) else {
        return Err(("bad body framing", head.raw));
    };
    let host = {
        let mut hosts = head.values("host");
        match (hosts.next(), hosts.next()) {
            (Some(h), None) => Some(head.raw.slice_ref(h)),
            (None, None) if head.minor == 0 => Some(Bytes::new()),
            _ => None,
        }
    };
    let Some(host) = host else {
        return Err(("one Host header is required", head.raw));
    };
    let target = head.target();
    if target.first() != Some(&b'/') && target != b"*" {
        return Err((
            "only origin-form and absolute-form request targets are served",
            head.raw,
        ));
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
    if let IpAddr::V4(v4) = ip {
        // Twice per request: `fmt` took 1.3 % of an HTTP/2 call's CPU in a profile.
        for (i, octet) in v4.octets().into_iter().enumerate() {
            if i > 0 {
                out.put_u8(b'.');
            }
            if octet >= 100 {
                out.put_u8(b'0' + octet / 100);
            }
            if octet >= 10 {
                out.put_u8(b'0' + octet / 10 % 10);
            }
            out.put_u8(b'0' + octet % 10);
        }
        return;
    }
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

/// An HTTP/1.1 client's request as it goes to an HTTP/1.1 PE: its head, made once, and its
/// body when it was held (the HTTP/1.1 front's `prepare` makes it).
pub(crate) struct Outgoing {
    pub(crate) head: BytesMut,
    /// The whole body, when it is small enough to be held: then the request can be sent
    /// again (and `Request::framing` says there is nothing left to stream).
    pub(crate) held: Option<Bytes>,
}

#[cfg(test)]
mod tests {
    use super::put_ip;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    #[test]
    fn an_address_is_written_as_display_writes_it() {
        let mut octets = vec![
            0u8, 1, 9, 10, 11, 99, 100, 101, 109, 110, 199, 200, 249, 250, 255,
        ];
        octets.extend(0..=255u8);
        for (i, &a) in octets.iter().enumerate() {
            let b = octets[(i * 7 + 3) % octets.len()];
            let ip = Ipv4Addr::new(a, b, 255 - a, b / 3);
            for addr in [IpAddr::V4(ip), IpAddr::V6(ip.to_ipv6_mapped())] {
                let mut out = Vec::new();
                put_ip(&mut out, SocketAddr::new(addr, 80), false);
                assert_eq!(out, ip.to_string().into_bytes(), "{addr}");
            }
        }
        let v6: IpAddr = "2001:db8::17"
            .parse()
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let mut out = Vec::new();
        put_ip(&mut out, SocketAddr::new(v6, 80), true);
        assert_eq!(out, b"\"[2001:db8::17]\"");
    }
}
