//! TCP mode: each client connection is forwarded to one PE of the pool, chosen by the pool's
//! policy; a PE that refuses the connection is reported and ejected, and the next is tried.
//! Bytes then move with splice(2) (see [`crate::splice`]).

use crate::ctx::Ctx;
use crate::levels::RequestFacts;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::net::TcpStream;
use tracing::debug;

/// Tries at most this many PEs for one connection.
const MAX_TRIES: usize = 8;

pub(crate) async fn serve(client: TcpStream, peer: SocketAddr, ctx: Ctx) {
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
    let mut tried = Vec::new();
    let (b, backend, since) = loop {
        let Ok(b) = pool.admit(level, &tried).await.map_err(|why| {
            debug!("client {peer}: pool {}: {}", pool.handle, why.text());
        }) else {
            ctx.log(|| {
                format!(
                    "{peer} tcp - {} - 0 {}",
                    pool.handle,
                    started.elapsed().as_micros()
                )
            });
            return;
        };
        let asked = Instant::now();
        let connected = match &ctx.kernel {
            Some(ks) => {
                let socket = |peer| ks.socket_towards(peer, &client);
                b.connect_with(ctx.connect_timeout(), &socket).await
            }
            None => b.connect(ctx.connect_timeout()).await,
        };
        if connected.is_ok() {
            let rif = b.start();
            b.note_latency(rif, asked.elapsed());
        }
        b.pick_done();
        match connected {
            Ok(s) => {
                b.succeeded();
                break (b, s, asked);
            }
            Err(e) => {
                debug!("pool {} PE {:#010x}: connect: {e}", b.pool, b.id);
                ctx.pools.unreachable(&b);
                pool.released();
                tried.push(b.id);
                if tried.len() >= MAX_TRIES {
                    return;
                }
            }
        }
    };
    let (client, backend) = match &ctx.kernel {
        Some(ks) => match crate::kernel::try_hand_over(client, backend, ks).await {
            crate::kernel::Handed::Kernel => {
                pool.finished(&b, level, since.elapsed());
                ctx.log(|| {
                    format!(
                        "{peer} tcp 0 {} {:#010x} 0 {} kernel",
                        b.pool,
                        b.id,
                        started.elapsed().as_micros()
                    )
                });
                return;
            }
            crate::kernel::Handed::Back(c, s) => (c, s),
        },
        None => (client, backend),
    };
    let moved = crate::splice::forward(&client, &backend, ctx.idle_timeout(), ctx.cfg.splice).await;
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
    ctx.log(|| {
        format!(
            "{peer} tcp {up} {} {:#010x} {down} {}",
            b.pool,
            b.id,
            started.elapsed().as_micros()
        )
    });
}
