//! HTTP/1.1 clients of a pool whose PEs speak HTTP/2 (`protocol = "h2"`): the request goes out
//! as an HTTP/2 stream (its body taken out of its HTTP/1.1 framing), the response comes back
//! as HTTP/1.1 (chunked when the PE gave no length, its trailers in the chunked trailer
//! section). Selection, failover and accounting are those of every request ([`settle`]).

use super::front::{frame_into, no_response, send_data, upstream_request};
use super::upstream;
use crate::backend::Backend;
use crate::ctx::Ctx;
use crate::http::{
    Attempt, Client, Failover, Failure, Next, Outgoing, Relayed, Request, Settled, give_up, log,
    prepare, select, settle,
};
use crate::message::{BodyDecoder, Framing, Piece};
use crate::pools::Pool;
use bytes::{BufMut, Bytes, BytesMut};
use h2::SendStream;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One HTTP/1.1 request to an HTTP/2 pool, from its body to the end of its response.
pub(crate) async fn request(c: &mut Client, mut r: Request, pool: &Arc<Pool>, ctx: &Ctx) -> Next {
    let Ok(out) = prepare(c, &mut r, ctx).await else {
        return Next::Close;
    };
    let Some(parts) = parts_of(&r) else {
        return give_up(c, &r, ctx, 400, Some("malformed request"), None).await;
    };
    if out.held.is_none() && r.expect_continue {
        // The PE cannot say it for itself over HTTP/2: the body is wanted.
        if c.stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
        {
            return Next::Close;
        }
    }
    let mut f = Failover::default();
    loop {
        let connect =
            |pe: Arc<Backend>| async move { upstream::stream(&pe, ctx).await.map(|v| (v, false)) };
        let (attempt, up) = match select(pool, r.level, &mut f, ctx, connect).await {
            Ok(v) => v,
            Err((code, why)) => return give_up(c, &r, ctx, code, Some(why), None).await,
        };
        let outcome = Box::pin(exchange(c, up, &r, &parts, &out, &attempt, ctx)).await;
        match settle(&r, out.held.is_some(), &attempt, outcome, &mut f, ctx) {
            Settled::Answered { code, keep, bytes } => {
                log(ctx, c.peer, &r, code, Some(&attempt.pe), bytes);
                return if keep && r.keep_alive && !*ctx.draining.borrow() {
                    Next::KeepAlive
                } else {
                    Next::Close
                };
            }
            Settled::Again => {}
            Settled::Failed { code, why } => {
                return give_up(c, &r, ctx, code, why, Some(&attempt.pe)).await;
            }
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

/// One attempt at an HTTP/2 PE.
async fn exchange(
    c: &mut Client,
    (mut send, slot): (h2::client::SendRequest<Bytes>, upstream::Slot),
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
