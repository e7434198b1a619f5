//! The request pipeline, the same for every HTTP version on either side: the steps a request
//! goes through between its front (HTTP/1.1 in `h1`, HTTP/2 in `h2`) and the relay to a PE
//! (`upstream`).
//!
//! `parse` (`request`) → [`route`] → [`classify`] → [`forward`]: a PE (admission, the
//! pool's policy, a connection; failover to the next PE) → the relay → [`settle`] (counters,
//! health, whether the request goes out again) → [`log`]. A front runs them in a loop: the steps
//! from select on repeat while the request fails over to another PE. A new concern is a step
//! or a field of a step's value, not a branch inside another step.
//!
//! A connect failure moves the request to the next PE; a PE that closes or resets before any
//! response byte gets the request once more on another PE if the method is idempotent and the
//! body was held. A stale kept-alive connection that closes before answering costs no failure:
//! the request goes out again on a new connection.

use crate::balance::backend::Backend;
use crate::balance::failover::{Attempt, Failover, GiveUp};
use crate::balance::keys::{key_of, key_of_source};
use crate::balance::levels::RequestFacts;
use crate::balance::pools::Pool;
use crate::balance::select::Affinity;
use crate::config::{HashKey, PeProtocol};
use crate::ctx::Ctx;
use crate::http::downstream::{Downstream, Failure, Relayed};
use crate::http::request::Request;
use crate::http::upstream::{h1 as up1, h2 as up2};
use crate::routes::Target;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tracing::debug;

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

/// Steps select → relay → settle, again while the request fails over to another PE, then the
/// answer of the proxy's own if no PE gave one, and the access log line. Whether the client
/// connection can carry another request.
pub(crate) async fn forward(
    d: &mut Downstream<'_>,
    r: &Request,
    pool: &Arc<Pool>,
    ctx: &Ctx,
) -> bool {
    if d.expired() {
        // Its deadline passed before it was sent (`grpc-timeout: 0m`, or while it queued): no
        // PE is asked for work nobody waits for.
        return Box::pin(give_up(
            d,
            r,
            504,
            Some("deadline exceeded"),
            (pool, None),
            ctx,
        ))
        .await;
    }
    let replayable = d.held().is_some();
    // A request that cannot be sent again only goes on a connection just made or just used.
    let fresh_only = !idempotent_here(r, pool);
    let key = pool.hash_key().map(|k| request_key(&k, r, d.peer()));
    let sticky = pool.sticky_cookie();
    let named = sticky.as_deref().and_then(|n| sticky_pe(r, n));
    let mut f = Failover::new(ctx.failover()).tied(Affinity { key, pe: named });
    // An attempt (admission, connecting) and its exchange are boxed, together (one
    // allocation), and so is the answer of the proxy's own: this future is as large as its
    // largest state, for the whole request, and lives inside every request's task (an
    // HTTP/2 stream held for minutes held 5.6 KB for states long over).
    loop {
        let tried: Result<_, GiveUp> = match pool.protocol() {
            PeProtocol::H2 => {
                // Never "reused": a broken HTTP/2 connection may have carried the request to
                // the PE, so only an idempotent one goes out again.
                let connect = |pe: Arc<Backend>| async move {
                    up2::stream(&pe, ctx).await.map(|v| (v, false))
                };
                Box::pin(async {
                    let (attempt, up) = f.attempt(pool, &ctx.pools, r.level, connect).await?;
                    d.set_cookie(sticky_cookie(sticky.as_deref(), named, &attempt));
                    let outcome = up2::exchange(d, up, r, &attempt, ctx).await;
                    Ok((attempt, outcome))
                })
                .await
            }
            PeProtocol::Http1 => {
                let connect =
                    |pe: Arc<Backend>| async move { up1::take_conn(&pe, ctx, fresh_only).await };
                Box::pin(async {
                    let (attempt, conn) = f.attempt(pool, &ctx.pools, r.level, connect).await?;
                    d.set_cookie(sticky_cookie(sticky.as_deref(), named, &attempt));
                    let outcome = up1::exchange(d, conn, r, &attempt, ctx).await;
                    Ok((attempt, outcome))
                })
                .await
            }
        };
        let (attempt, outcome) = match tried {
            Ok(v) => v,
            Err(g) => {
                let (code, why) = g.answer();
                pool.responded(code);
                return Box::pin(give_up(d, r, code, Some(why), (pool, None), ctx)).await;
            }
        };
        match settle(r, replayable, &attempt, outcome, &mut f, ctx) {
            Settled::Answered { code, keep, bytes } => {
                pool.responded(code);
                log(ctx, d.peer(), r, code, (pool, Some(&attempt.pe)), bytes);
                return keep;
            }
            Settled::Again => Box::pin(f.back_off()).await,
            Settled::Failed { code, why } => {
                pool.responded(code);
                return Box::pin(give_up(d, r, code, why, (pool, Some(&attempt.pe)), ctx)).await;
            }
        }
    }
}

/// A request's key for a hashing selection: its source address, path, a header's value or a
/// cookie's (the source when the request has no such header or cookie).
fn request_key(k: &HashKey, r: &Request, peer: SocketAddr) -> u64 {
    let by = |v: Option<&[u8]>| v.map_or_else(|| key_of_source(peer.ip()), key_of);
    match k {
        HashKey::Source => key_of_source(peer.ip()),
        HashKey::Path => key_of(&r.head.target()[..r.path_end]),
        HashKey::Header(name) => by(r.head.get(name)),
        HashKey::Cookie(name) => by(cookie(r, name)),
    }
}

/// The value of the request's cookie `name`, if it has one.
fn cookie<'r>(r: &'r Request, name: &str) -> Option<&'r [u8]> {
    r.head.values("cookie").find_map(|v| {
        v.split(|&b| b == b';').find_map(|c| {
            let c = c.trim_ascii();
            let (n, v) = c.split_at(c.iter().position(|&b| b == b'=')?);
            (n == name.as_bytes()).then(|| &v[1..])
        })
    })
}

/// The PE the request's sticky cookie `name` names (its identifier in hex).
fn sticky_pe(r: &Request, name: &str) -> Option<u32> {
    let v = std::str::from_utf8(cookie(r, name)?).ok()?;
    u32::from_str_radix(v.trim_matches('"'), 16).ok()
}

/// The sticky cookie for the response, when the PE that serves differs from the one the
/// request named (or it named none).
fn sticky_cookie(
    name: Option<&str>,
    named: Option<u32>,
    attempt: &Attempt,
) -> Option<http::HeaderValue> {
    let name = name?;
    if named == Some(attempt.pe.id) {
        return None;
    }
    let v = format!("{name}={:08x}; Path=/; HttpOnly", attempt.pe.id);
    http::HeaderValue::from_str(&v).ok()
}

/// Ends a request without a response from a PE: `code` with `why` to the client (unless it
/// has part of a response already, or is gone), and the log line. The connection closes.
async fn give_up(
    d: &mut Downstream<'_>,
    r: &Request,
    code: u16,
    why: Option<&str>,
    at: (&Pool, Option<&Arc<Backend>>),
    ctx: &Ctx,
) -> bool {
    d.fail(code, why, ctx).await;
    log(ctx, d.peer(), r, code, at, 0);
    false
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
            ctx.pools.answered(&attempt.pool, b, code);
            if code >= 500 {
                b.stats.responses_5xx.fetch_add(1, Ordering::Relaxed);
            }
            if code == 503 {
                // The PE says it is busy: less new work for it, no ejection.
                ctx.pools.busy(b);
            }
            return Settled::Answered { code, keep, bytes };
        }
        Err(Failure::Refused) if replayable && f.may_retry() => {
            // The PE did not take the stream (REFUSED_STREAM, or past its GOAWAY): nothing
            // of it was processed, so it may go anywhere again, idempotent or not.
            return Settled::Again;
        }
        Err(Failure::Refused) => (502, Some("the pool element refused the request")),
        Err(Failure::NoResponse { body_sent, error }) => {
            let replayable = replayable && !body_sent;
            if attempt.reused && replayable && f.may_retry() {
                // A kept-alive connection the PE had closed: not the PE's fault, but its
                // other idle connections may be as stale.
                b.conns.drop_idle();
                return Settled::Again;
            }
            debug!("pool {} PE {:#010x}: no response: {error}", b.pool, b.id);
            f.unreachable(&ctx.pools, b);
            if let Some(again) = resend(r, replayable, attempt, f) {
                return again;
            }
            (502, Some("the pool element closed the connection"))
        }
        Err(Failure::Timeout) if attempt.timed_out_early(ctx.request_timeout()) => {
            // Slower than the per-try timeout: busy, not dead; another PE may be quicker.
            ctx.pools.busy(b);
            f.left_out(b);
            if let Some(again) = resend(r, replayable, attempt, f) {
                return again;
            }
            (504, Some("the pool element did not answer in time"))
        }
        Err(Failure::Timeout) => {
            // Not within `request-timeout-ms` (a long poll, a slow call, a handler that
            // hangs): busy, not dead, as a per-try timeout. No single request ejects the PE
            // (a client could do that at will); the success-rate rule counts it.
            ctx.pools.busy(b);
            b.answers.note(None);
            (504, Some("the pool element did not answer in time"))
        }
        Err(Failure::Broken { relayed }) => {
            ctx.pools.failed(b);
            (
                502,
                (!relayed).then_some("bad response from the pool element"),
            )
        }
        Err(Failure::BadBody) => (400, Some("malformed chunked body")),
        Err(Failure::NotUpgraded) => (502, Some("the pool element did not switch protocols")),
        Err(Failure::BadRequest) => (400, Some("malformed request")),
        // The client's own deadline: no fault of the PE's.
        Err(Failure::Deadline) => (504, Some("deadline exceeded")),
        Err(Failure::Client) => (499, None),
    };
    Settled::Failed { code, why }
}

/// A request a PE took and failed goes once more to another PE if it can (body held,
/// idempotent, not sent again yet) and the pool's retry budget has room; else `None`.
fn resend(r: &Request, replayable: bool, attempt: &Attempt, f: &mut Failover) -> Option<Settled> {
    if !(replayable && idempotent_here(r, &attempt.pool) && f.may_resend()) {
        return None;
    }
    Some(if f.within_budget(&attempt.pool) {
        Settled::Again
    } else {
        Settled::Failed {
            code: 503,
            why: Some("the pool's retry budget is spent"),
        }
    })
}

/// Whether the request may be sent to another PE after one failed it: an idempotent method,
/// or a path the pool lists as idempotent (`[pool.NAME] idempotent`, for gRPC methods).
pub(crate) fn idempotent_here(r: &Request, pool: &Pool) -> bool {
    if r.idempotent {
        return true;
    }
    pool.idempotent_path(&r.head.target()[..r.path_end])
}

/// The access log line of a request routed to `pool` (`b`: the PE of its last attempt).
pub(crate) fn log(
    ctx: &Ctx,
    peer: SocketAddr,
    r: &Request,
    code: u16,
    (pool, b): (&Pool, Option<&Arc<Backend>>),
    bytes: u64,
) {
    ctx.log(|| {
        format!(
            "{} {} {} {} {} {} {} {}",
            peer,
            String::from_utf8_lossy(r.head.method()),
            String::from_utf8_lossy(r.head.target()),
            code,
            pool.handle,
            b.map_or("-".into(), |b| format!("{:#010x}", b.id)),
            bytes,
            r.started.elapsed().as_micros()
        )
    });
}
