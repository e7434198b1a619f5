//! TCP mode: each client connection is forwarded to one PE of the pool, chosen by the pool's
//! policy; a PE that refuses the connection is reported and ejected, and the next is tried
//! (the failover loop of [`crate::balance::failover`], shared with HTTP).
//! Bytes then move with splice(2) (see [`crate::l4::splice`]), or the connection goes to the
//! kernel splice ([`crate::l4::kernel`]). HTTP routes that pin a connection to its PE end here too.

use crate::balance::backend::Backend;
use crate::balance::failover::Failover;
use crate::balance::keys::key_of_source;
use crate::balance::levels::RequestFacts;
use crate::balance::pools::Pool;
use crate::balance::select::Affinity;
use crate::ctx::Ctx;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::net::TcpStream;
use tracing::debug;

pub(crate) async fn serve(client: TcpStream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let started = Instant::now();
    let Some(pool) = ctx.routes.default_pool().cloned() else {
        return;
    };
    // A connection shows only its source to the `[levels]` rules.
    let level = ctx.cfg.levels.as_ref().map_or(1, |levels| {
        levels.classify(&RequestFacts {
            source: peer.ip().to_canonical(),
            host: None,
            path: None,
            header: &|_| None,
        })
    });
    let kernel = ctx.kernel.is_some();
    let Ok(pe) = connect_pe(&client, peer, &pool, level, kernel, started, &ctx).await else {
        return;
    };
    carry(client, peer, pe, &[], started, &ctx).await;
}

/// A connection's PE, connected: the PE, the socket, when it was asked.
pub(crate) struct Connected {
    b: Arc<Backend>,
    pool: Arc<Pool>,
    level: usize,
    backend: TcpStream,
    since: Instant,
    kernel: bool,
}

/// Admits a connection at `pool` (service level `level`) and connects it to a PE, trying
/// others when one refuses; from a socket the kernel splice watches when `kernel` (and the
/// splice is loaded). Logs a connection that gets none. Shared by TCP mode and HTTP routes
/// that pin a connection to a PE.
pub(crate) async fn connect_pe(
    client: &TcpStream,
    peer: SocketAddr,
    pool: &Arc<Pool>,
    level: usize,
    kernel: bool,
    started: Instant,
    ctx: &Ctx,
) -> Result<Connected, &'static str> {
    let ks = ctx.kernel.as_ref().filter(|_| kernel);
    let connect = |b: Arc<Backend>| async move {
        let s = match ks {
            Some(ks) => {
                let socket = |pe| ks.socket_towards(pe, client);
                b.connect_with(ctx.connect_timeout(), &socket).await
            }
            None => b.connect(ctx.connect_timeout()).await,
        };
        s.map(|s| (s, false))
    };
    // A connection shows a hashing selection only its source.
    let key = pool.hash_key().map(|_| key_of_source(peer.ip()));
    let mut failover = Failover::new(ctx.failover()).tied(Affinity { key, pe: None });
    match failover.attempt(pool, &ctx.pools, level, connect).await {
        Ok((attempt, backend)) => {
            let b = attempt.pe;
            // A connection's latency is its connect.
            b.note_latency(attempt.rif, attempt.asked.elapsed());
            b.succeeded();
            Ok(Connected {
                b,
                pool: pool.clone(),
                level,
                backend,
                since: attempt.asked,
                kernel: ks.is_some(),
            })
        }
        Err(why) => {
            let (_, text) = why.answer();
            debug!("client {peer}: pool {}: {text}", pool.handle);
            ctx.log(|| {
                format!(
                    "{peer} tcp - {} - 0 {}",
                    pool.handle,
                    started.elapsed().as_micros()
                )
            });
            Err(text)
        }
    }
}

/// Sends the PE `first` (what the proxy read of the connection already) and carries the
/// connection to its end: handed to the kernel splice when it was connected for it, else
/// relayed here. Logs it.
pub(crate) async fn carry(
    client: TcpStream,
    peer: SocketAddr,
    pe: Connected,
    first: &[u8],
    started: Instant,
    ctx: &Ctx,
) {
    let Connected {
        b,
        pool,
        level,
        mut backend,
        since,
        kernel,
    } = pe;
    if !first.is_empty() {
        use tokio::io::AsyncWriteExt;
        if let Err(e) = backend.write_all(first).await {
            debug!("pool {} PE {:#010x}: {e}", b.pool, b.id);
            pool.finished(&b, level, since.elapsed());
            return;
        }
        b.stats
            .bytes_in
            .fetch_add(first.len() as u64, Ordering::Relaxed);
    }
    // Counted while it is relayed here, its hand-over given up.
    let mut relaying = None;
    let (client, backend) = match ctx.kernel.as_ref().filter(|_| kernel) {
        Some(ks) => {
            match crate::l4::kernel::try_hand_over(client, backend, !first.is_empty(), &b, ks).await
            {
                crate::l4::kernel::Handed::Kernel(splice) => {
                    if let Some(s) = splice {
                        ks.track(s, b.clone());
                    }
                    pool.finished(&b, level, since.elapsed());
                    ctx.log(|| {
                        format!(
                            "{peer} tcp {} {} {:#010x} 0 {} kernel",
                            first.len(),
                            b.pool,
                            b.id,
                            started.elapsed().as_micros()
                        )
                    });
                    return;
                }
                crate::l4::kernel::Handed::Back(c, s) => {
                    relaying = Some(ks.relaying());
                    (c, s)
                }
            }
        }
        None => (client, backend),
    };
    let moved =
        crate::l4::splice::forward(&client, &backend, ctx.idle_timeout(), ctx.cfg.splice).await;
    drop(relaying);
    pool.finished(&b, level, since.elapsed());
    let (up, down) = match &moved {
        Ok(m) => (m.a_to_b, m.b_to_a),
        Err(e) => {
            debug!("client {peer}: {e}");
            (0, 0)
        }
    };
    b.stats.bytes_in.fetch_add(up, Ordering::Relaxed);
    b.stats.bytes_out.fetch_add(down, Ordering::Relaxed);
    let up = up + first.len() as u64;
    ctx.log(|| {
        format!(
            "{peer} tcp {up} {} {:#010x} {down} {}",
            b.pool,
            b.id,
            started.elapsed().as_micros()
        )
    });
}
