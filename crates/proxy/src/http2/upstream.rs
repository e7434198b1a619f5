//! HTTP/2 to a pool's PEs (`[pool.NAME] protocol = "h2"`): a few connections per PE, each
//! carrying as many streams at once as the PE allows (its SETTINGS_MAX_CONCURRENT_STREAMS);
//! a new connection is opened only when every open one is full, one at a time (a burst of
//! requests waits for the connection being opened instead of opening one each), and an idle
//! connection is closed when an earlier one has room.

use crate::backend::Backend;
use crate::ctx::Ctx;
use bytes::Bytes;
use h2::client::SendRequest;
use std::io;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tracing::debug;

/// The HTTP/2 connections to one PE.
#[derive(Debug, Default)]
pub(crate) struct H2Conns {
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
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
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
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }

    /// Forgets every connection (the PE left the pool); their streams finish.
    pub(crate) fn clear(&self) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// A stream to the PE: on an open connection with room, else on a new one.
pub(crate) async fn stream(b: &Arc<Backend>, ctx: &Ctx) -> io::Result<(SendRequest<Bytes>, Slot)> {
    if let Some(open) = ready(b).await {
        return Ok(open);
    }
    let _opening = b.h2.opening.lock().await;
    // Opened by another request while this one waited?
    if let Some(open) = ready(b).await {
        return Ok(open);
    }
    let io = crate::http::connect_pe(b, ctx).await?;
    let h = &ctx.cfg.http2;
    let handshake = h2::client::Builder::new()
        .initial_window_size(h.stream_window)
        .initial_connection_window_size(h.connection_window)
        .max_header_list_size(ctx.cfg.max_head as u32 * 4)
        .handshake::<_, Bytes>(io);
    let (send, conn) = tokio::time::timeout(ctx.connect_timeout(), handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP/2 handshake timed out"))?
        .map_err(io::Error::other)?;
    let dead = Arc::new(AtomicBool::new(false));
    let (pool, id, gone) = (b.pool.clone(), b.id, dead.clone());
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!("pool {pool} PE {id:#010x}: HTTP/2 connection: {e}");
        }
        gone.store(true, Ordering::Relaxed);
    });
    let c = Arc::new(H2Conn {
        send: send.clone(),
        streams: AtomicUsize::new(1),
        dead,
    });
    b.h2.add(c.clone());
    let send = send.ready().await.map_err(io::Error::other)?;
    Ok((send, Slot(c)))
}

/// A stream on an open connection with room, if there is one.
async fn ready(b: &Backend) -> Option<(SendRequest<Bytes>, Slot)> {
    let (send, slot) = b.h2.take()?;
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
