//! The PE side of HTTP: one relay per protocol the PE speaks, HTTP/1.1 ([`h1`]) or HTTP/2
//! (`h2`, for a pool with `protocol = "h2"`), each taking requests from HTTP/1.1 and HTTP/2
//! clients; and the connection to a PE they share ([`connect_pe`]: TCP, TLS over it for a pool
//! with `[pool.NAME.tls]`).

pub(crate) mod h1;
pub(crate) mod h2;

use crate::balance::backend::Backend;
use crate::ctx::Ctx;
use std::io;
use tokio::net::TcpStream;

/// A new connection to the PE: TCP, and TLS over it for a pool with `[pool.NAME.tls]`.
pub(crate) async fn connect_pe(b: &Backend, ctx: &Ctx) -> io::Result<PeStream> {
    let s = b.connect(ctx.connect_timeout()).await?;
    let tls = (!ctx.pe_tls.is_empty())
        .then(|| ctx.pe_tls.get(&b.pool.to_string()))
        .flatten();
    let Some(tls) = tls else {
        return Ok(PeStream::Plain(s));
    };
    // TLS to the PE, its certificate checked for the address connected to.
    let ip = s.peer_addr()?.ip();
    let handshake = rserpool_tls::tokio_rustls::TlsConnector::from(tls.clone())
        .connect(rserpool_tls::Tls::server_name(ip), s);
    let t = tokio::time::timeout(ctx.connect_timeout(), handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
    Ok(PeStream::Tls(Box::new(t)))
}

/// The stream to a PE: TCP, or TLS over it (`[pool.NAME.tls]`).
#[derive(Debug)]
pub(crate) enum PeStream {
    Plain(TcpStream),
    Tls(Box<rserpool_tls::tokio_rustls::client::TlsStream<TcpStream>>),
}

impl PeStream {
    /// The socket, when nothing is layered over it (so it can be spliced).
    pub(crate) fn plain(&self) -> Option<&TcpStream> {
        match self {
            PeStream::Plain(s) => Some(s),
            PeStream::Tls(_) => None,
        }
    }
}

impl tokio::io::AsyncRead for PeStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeStream::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            PeStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for PeStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            PeStream::Plain(s) => std::pin::Pin::new(s).poll_write(cx, data),
            PeStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeStream::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            PeStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            PeStream::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            PeStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    // Passed on: both sockets write several pieces in one call (an HTTP/2 frame's head
    // and payload, `crate::http::h2::coalesce`).
    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            PeStream::Plain(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
            PeStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PeStream::Plain(s) => s.is_write_vectored(),
            PeStream::Tls(s) => s.is_write_vectored(),
        }
    }
}
