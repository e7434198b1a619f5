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
use crate::balance::failover::Attempt;
use crate::ctx::Ctx;
use crate::http::client_stream::Client;
use crate::http::downstream::{Downstream, Failure, Relayed};
use crate::http::h2::coalesce::Coalesced;
use crate::http::h2::inflow::{Inflow, small_frame_budget};
use crate::http::h2::stream::{Body, grpc_trailers, send_data};
use crate::http::message::{BodyDecoder, Framing, Piece};
use crate::http::request::Request;
use crate::workers::PerWorker;
use bytes::Bytes;
use h2::client::SendRequest;
use h2::{Reason, RecvStream, SendStream};
use std::io;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, warn};

/// How long an extended CONNECT waits for a new connection's SETTINGS to say whether the PE
/// offers it.
const SETTINGS_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The HTTP/2 connections to one PE, kept apart per worker thread (each connection is driven
/// by the runtime that opened it: `crate::workers`).
#[derive(Debug, Default)]
pub(crate) struct H2Conns(PerWorker<WorkerConns>, Arc<AtomicBool>);

/// One worker's HTTP/2 connections to the PE.
#[derive(Debug, Default)]
struct WorkerConns {
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
    /// A response head came over it.
    answered: Arc<AtomicBool>,
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
        let mut conns = self
            .0
            .here()
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner());
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
        let conns = &self.0.here().conns;
        conns.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }

    /// Forgets every connection; their streams finish.
    fn clear(&self) {
        for w in self.0.all() {
            w.conns.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
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
    // Boxed: opening a connection (TCP, TLS, the HTTP/2 handshake) is a large future, and
    // every request's attempt would carry its size for a path taken once per connection.
    Box::pin(open(b, ctx)).await
}

/// A stream on a new connection to the PE (or on one another request opened meanwhile).
async fn open(b: &Arc<Backend>, ctx: &Ctx) -> io::Result<(SendRequest<Bytes>, Slot)> {
    let Some(conns) = b.conns.of::<H2Conns>() else {
        return Err(io::Error::other("no room for the PE's HTTP/2 connections"));
    };
    let _opening = conns.0.here().opening.lock().await;
    // Opened by another request while this one waited?
    if let Some(open) = ready(b).await {
        return Ok(open);
    }
    let io = super::connect_pe(b, ctx).await?;
    let h = &ctx.cfg.http2;
    let handshake = h2::client::Builder::new()
        .initial_window_size(h.stream_window)
        .initial_connection_window_size(h.connection_window)
        // A PE streams at will: a whole connection window of small frames may arrive at once.
        .data_frame_budget(small_frame_budget(h.connection_window))
        .max_header_list_size(ctx.cfg.max_head as u32 * 4)
        .handshake::<_, Bytes>(Coalesced::client(io));
    let (send, conn) = tokio::time::timeout(ctx.connect_timeout(), handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP/2 handshake timed out"))?
        .map_err(io::Error::other)?;
    let (dead, answered) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (pool, id, gone, said) = (b.pool.clone(), b.id, dead.clone(), conns.1.clone());
    let ever = answered.clone();
    tokio::spawn(async move {
        match conn.await {
            // Failed before any answer, the first time said: most likely the PE does not speak
            // HTTP/2 (an HTTP/1.1 server answers the preface with a 400 and closes), which the
            // clients only see as 502s.
            Err(e) if !ever.load(Ordering::Relaxed) && !said.swap(true, Ordering::Relaxed) => {
                warn!(
                    "pool {pool} PE {id:#010x}: its HTTP/2 connection failed before any answer: \
                     {e}; does it speak HTTP/2 (the pool has protocol = \"h2\": prior knowledge \
                     in cleartext, ALPN h2 over TLS)? (said once per PE)"
                );
            }
            Err(e) => debug!("pool {pool} PE {id:#010x}: HTTP/2 connection: {e}"),
            Ok(()) => {}
        }
        gone.store(true, Ordering::Relaxed);
    });
    let c = Arc::new(H2Conn {
        send: send.clone(),
        streams: AtomicUsize::new(1),
        dead,
        answered,
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

/// What an HTTP/2 PE's failure before its response head means for the request (`streamed`:
/// part of its body went, so it cannot go again).
pub(crate) fn no_response(e: h2::Error, streamed: bool) -> Failure {
    let unprocessed = e.is_go_away() || e.reason() == Some(Reason::REFUSED_STREAM);
    if e.is_reset() && !e.is_remote() && !e.is_library() {
        // Reset here: the client cancelled its upload (`pump`), no fault of the PE's.
        Failure::Client
    } else if unprocessed && !streamed {
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
    let Some(recv) = rest else {
        let _ = send_data(&mut up, prefix, true).await;
        return;
    };
    let mut recv = Inflow::new(recv);
    pe.stats
        .bytes_in
        .fetch_add(prefix.len() as u64, Ordering::Relaxed);
    if send_data(&mut up, prefix, false).await.is_err() {
        return;
    }
    while let Some(d) = recv.next().await {
        let Ok(d) = d else {
            up.send_reset(Reason::CANCEL);
            return;
        };
        let n = d.len();
        pe.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        // The client's last DATA frame ends the call on ours too: no empty DATA frame after
        // it (one more frame for the PE, and a small unfinished one counts against its
        // allowance: the `h2` crate ends a connection with many of them unread).
        let last = recv.is_end_stream();
        if recv
            .while_writing(send_data(&mut up, d, last))
            .await
            .is_err()
        {
            return;
        }
        recv.written(n);
        if last {
            return;
        }
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

/// One attempt at an HTTP/2 PE, for a client of either version. The body goes up while the
/// response may already come down (gRPC streams both ways); a gRPC deadline bounds the wait
/// and the relay.
pub(crate) async fn exchange(
    d: &mut Downstream<'_>,
    (mut send, slot): (SendRequest<Bytes>, Slot),
    r: &Request,
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    let b = &attempt.pe;
    let Some(req) = d.h2_request(r, ctx) else {
        return Err(Failure::BadRequest);
    };
    if let Downstream::H2(s) = d
        && s.tunnel.is_some()
    {
        // Boxed, as the HTTP/1.1 client's streamed body below: large futures every call would
        // carry for paths few take.
        return Box::pin(extended_connect(s, req, (send, slot), attempt, ctx)).await;
    }
    let no_body = d.held().is_some_and(Bytes::is_empty);
    let (resp, mut up) = match send.send_request(req, no_body) {
        Ok(v) => v,
        Err(e) => {
            slot.retire();
            return Err(no_response(e, false));
        }
    };
    let streamed = d.held().is_none();
    match d.held() {
        Some(body) if !body.is_empty() => {
            let body = body.clone();
            b.stats
                .bytes_in
                .fetch_add(body.len() as u64, Ordering::Relaxed);
            // Handed to `h2` whole, which sends it as the PE's windows open: a held body is
            // bounded by `retry-buffer` and held here anyway. (Capacity is never assigned
            // before the stream opens, so waiting for it meant a task per call.)
            let _ = up.send_data(body, true);
        }
        Some(_) => {}
        None => match d {
            // Read here, before the response: an HTTP/1.1 client sends nothing else meanwhile.
            Downstream::H1(h) => {
                if r.expect_continue {
                    // The PE cannot say it for itself over HTTP/2: the body is wanted.
                    h.c.stream
                        .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                        .await
                        .map_err(|_| Failure::Client)?;
                }
                Box::pin(send_body(h.c, &mut up, r.framing, b, ctx)).await?
            }
            Downstream::H2(s) => {
                if let Body::Streamed { prefix, rest } = &mut s.body {
                    let (prefix, rest) = (prefix.clone(), rest.take());
                    let pe = b.clone();
                    tokio::spawn(async move { pump(prefix, rest, up, &pe).await });
                }
            }
        },
    }
    let mut limit = tokio::time::Instant::now() + attempt.head_timeout(ctx.request_timeout());
    if let Some(deadline) = d.deadline() {
        limit = limit.min(deadline);
    }
    let Some(waited) = d.unless_gone(tokio::time::timeout_at(limit, resp)).await else {
        return Err(Failure::Client);
    };
    let resp = match waited {
        Err(_) if d.expired() => return Err(Failure::Deadline),
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(no_response(e, streamed)),
        Ok(Ok(resp)) => resp,
    };
    b.note_latency(attempt.rif, attempt.sent.elapsed());
    if !slot.0.answered.load(Ordering::Relaxed) {
        // Once per connection: no write to the shared flag on every call.
        slot.0.answered.store(true, Ordering::Relaxed);
    }
    let (parts, body) = resp.into_parts();
    let code = parts.status.as_u16();
    let end = body.is_end_stream();
    let (mut bytes, more) = d.respond_head(parts, end, r, ctx).await?;
    if more {
        let mut body = Inflow::new(body);
        let mut ended = false;
        loop {
            // A timer only where there is a deadline: one per DATA frame costs.
            let next = match d.deadline() {
                Some(until) => tokio::time::timeout_at(until, body.next()).await,
                None => Ok(body.next().await),
            };
            let data = match next {
                Err(_) => {
                    // The deadline passed mid-response: the PE's stream is reset (dropped)
                    // and the client told.
                    let _ = d
                        .respond_end(Some(grpc_trailers(4, "deadline exceeded")))
                        .await;
                    return Ok(Relayed {
                        code,
                        keep: d.keep(),
                        bytes,
                    });
                }
                Ok(None) => break,
                Ok(Some(Ok(data))) => data,
                Ok(Some(Err(_))) => return Err(Failure::Broken { relayed: true }),
            };
            let n = data.len();
            bytes += n as u64;
            // Ended without trailers: the end goes with the last bytes.
            let last = body.is_end_stream();
            body.while_writing(d.respond_data(data, last)).await?;
            body.written(n);
            if last {
                ended = true;
                break;
            }
        }
        if !ended {
            match body.trailers().await {
                Ok(t) => d.respond_end(t).await?,
                Err(_) => return Err(Failure::Broken { relayed: true }),
            }
        }
    }
    b.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    drop(slot);
    Ok(Relayed {
        code,
        keep: d.keep(),
        bytes,
    })
}

/// An extended CONNECT (RFC 8441) to a PE that offers it: the same CONNECT on a stream of its
/// own; when the PE answers 2xx, the client gets 200 and the two streams carry the tunnel
/// (`crate::http::h2::tunnel`). A PE that does not offer it fails the attempt.
async fn extended_connect(
    s: &mut crate::http::h2::stream::Stream,
    req: http::Request<()>,
    (mut send, slot): (SendRequest<Bytes>, Slot),
    attempt: &Attempt,
    ctx: &Ctx,
) -> Result<Relayed, Failure> {
    use crate::http::h2::tunnel::{accept, carry, stream_end};
    let b = &attempt.pe;
    // A connection just opened may not have the PE's SETTINGS yet.
    let settled = tokio::time::Instant::now() + SETTINGS_WAIT;
    while !send.is_extended_connect_protocol_enabled() {
        if tokio::time::Instant::now() >= settled {
            return Err(Failure::NotUpgraded);
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (resp, up) = match send.send_request(req, false) {
        Ok(v) => v,
        Err(e) => {
            slot.retire();
            return Err(no_response(e, false));
        }
    };
    let limit = attempt.head_timeout(ctx.request_timeout());
    let resp = match tokio::time::timeout(limit, resp).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(no_response(e, false)),
        Ok(Ok(resp)) => resp,
    };
    b.note_latency(attempt.rif, attempt.sent.elapsed());
    let code = resp.status().as_u16();
    if !resp.status().is_success() {
        // Refused by the PE: its status (without its body) goes to the client.
        let head = http::Response::builder().status(code).body(());
        if let Ok(h) = head {
            let _ = s.respond.send_response(h, true);
        }
        return Ok(Relayed {
            code,
            keep: false,
            bytes: 0,
        });
    }
    let Some(client) = accept(s) else {
        return Err(Failure::Client);
    };
    let pe = stream_end(resp.into_body(), up);
    let carried = carry(client, pe, ctx.idle_timeout()).await;
    b.stats.bytes_in.fetch_add(carried.up, Ordering::Relaxed);
    b.stats.bytes_out.fetch_add(carried.down, Ordering::Relaxed);
    drop(slot);
    Ok(Relayed {
        code: 200,
        keep: false,
        bytes: carried.down,
    })
}

/// Streams an HTTP/1.1 client's body (taken out of its framing) to the PE.
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
                // A body of known length ends with its last byte: END_STREAM goes with it.
                let last = dec.is_done();
                if send_data(up, d, last).await.is_err() || last {
                    // The PE stopped taking it (its answer tells why), or it has it all.
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
