//! A client connection that is registered with tokio's reactor only once it has to wait.
//!
//! HTTP clients send their request right after connecting, so it is usually there when the
//! connection is accepted, and a small response fits the socket buffer. A `Connection: close`
//! exchange then needs no readiness events at all: reading, answering and closing directly
//! saves the two `epoll_ctl` calls (add, delete) that registering costs per connection, as
//! HAProxy's speculative I/O does. The first read or write that would block registers the
//! socket; from then on it is an ordinary tokio stream.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream as StdStream};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// At most this much of a read buffer is offered to a read before registration (it has to be
/// zeroed first: safe code cannot hand uninitialised memory to `read`).
const SPECULATIVE_READ: usize = 16 * 1024;

pub(crate) enum ClientStream {
    /// Non-blocking, not known to the reactor.
    Unregistered(StdStream),
    Registered(TcpStream),
    /// Registration failed; every further operation fails.
    Lost,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl ClientStream {
    /// `s` must be in non-blocking mode.
    pub(crate) fn new(s: StdStream) -> Self {
        Self::Unregistered(s)
    }

    /// The tokio stream, registering the socket now if need be.
    pub(crate) fn registered(&mut self) -> io::Result<&mut TcpStream> {
        if let Self::Unregistered(_) = self
            && let Self::Unregistered(s) = std::mem::replace(self, Self::Lost)
        {
            *self = Self::Registered(TcpStream::from_std(s)?);
        }
        match self {
            Self::Registered(t) => Ok(t),
            _ => Err(io::Error::other("client socket could not be registered")),
        }
    }

    /// Writes the last bytes of the connection and ends its sending side. `MSG_MORE` holds
    /// the bytes back until the shutdown, which sends them with the FIN in one segment: one
    /// packet less per connection (as many as `Connection: close` requests).
    pub(crate) async fn write_last(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            match self.try_send_more(data) {
                Ok(n) => data = &data[n..],
                Err(e) if would_block(&e) => self.registered()?.writable().await?,
                Err(e) => return Err(e),
            }
        }
        self.shutdown_write()
    }

    fn try_send_more(&mut self, data: &[u8]) -> io::Result<usize> {
        let send = |s: socket2::SockRef<'_>| s.send_with_flags(data, libc::MSG_MORE);
        match self {
            Self::Unregistered(s) => send(socket2::SockRef::from(&*s)),
            Self::Registered(t) => t.try_io(tokio::io::Interest::WRITABLE, || {
                send(socket2::SockRef::from(&*t))
            }),
            Self::Lost => Err(io::Error::other("client socket lost")),
        }
    }

    fn shutdown_write(&self) -> io::Result<()> {
        match self {
            Self::Unregistered(s) => s.shutdown(Shutdown::Write),
            Self::Registered(t) => socket2::SockRef::from(t).shutdown(Shutdown::Write),
            Self::Lost => Ok(()),
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Self::Unregistered(s) = this {
            let want = buf.remaining().min(SPECULATIVE_READ);
            match s.read(buf.initialize_unfilled_to(want)) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if would_block(&e) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        match this.registered() {
            Ok(t) => Pin::new(t).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Self::Unregistered(s) = this {
            match s.write(data) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if would_block(&e) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        match this.registered() {
            Ok(t) => Pin::new(t).poll_write(cx, data),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Registered(t) => Pin::new(t).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.shutdown_write())
    }
}
