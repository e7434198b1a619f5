//! A client connection that is registered with tokio's reactor only once it has to wait.
//!
//! HTTP clients send their request right after connecting, so it is usually there when the
//! connection is accepted, and a small response fits the socket buffer. A `Connection: close`
//! exchange then needs no readiness events at all: reading, answering and closing directly
//! saves the two `epoll_ctl` calls (add, delete) that registering costs per connection, as
//! HAProxy's speculative I/O does. The first read or write that would block registers the
//! socket; from then on it is an ordinary tokio stream.
//!
//! An HTTPS client's connection is a TLS stream from the start (its handshake needed the
//! reactor anyway); it has no plain socket to splice or hand over.

use crate::ctx::Ctx;
use crate::http::message::{error_response, error_response_with};
use bytes::BytesMut;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream as StdStream};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a closing connection keeps reading what the client still sends.
const LINGER: Duration = Duration::from_secs(2);

/// At most this much of a read buffer is offered to a read before registration.
const SPECULATIVE_READ: usize = 16 * 1024;

pub(crate) struct ClientStream {
    socket: Socket,
    /// Our sending side is shut down (the FIN is out).
    write_shut: bool,
    /// The client is known to have more to send: [`ClientStream::close`] reads it off even if
    /// none has arrived yet.
    linger: bool,
    /// The client said it sends nothing after its request (`Connection: close`, RFC 9112
    /// §9.6): once the last response is written and nothing more has come, the socket can be
    /// closed at once.
    done: bool,
}

enum Socket {
    /// Non-blocking, not known to the reactor.
    Unregistered(StdStream),
    Registered(TcpStream),
    /// HTTPS, terminated here.
    Tls(Box<TlsStream>),
    /// No socket: registration failed, the stream was taken, or it was closed after its
    /// last write. Every further operation fails.
    Lost,
}

type TlsStream = rserpool_tls::tokio_rustls::server::TlsStream<TcpStream>;

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

/// Ready once rustls has plaintext for the reader, or the client closed: TLS records are read
/// into rustls's own buffer as they come (readiness of the socket need not mean application
/// data: a record may come in pieces, or carry a key update).
fn poll_tls_ready(t: &mut TlsStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    /// The socket as `std::io::Read` for rustls, through tokio's `poll_read` (which also
    /// clears readiness after a short read, sparing the read that would block): `WouldBlock`
    /// when the socket is not ready, the task woken when it is.
    struct Socket<'a, 'b>(&'a mut TcpStream, &'a mut Context<'b>);
    impl Read for Socket<'_, '_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let mut rb = ReadBuf::new(buf);
            match Pin::new(&mut *self.0).poll_read(self.1, &mut rb) {
                Poll::Ready(Ok(())) => Ok(rb.filled().len()),
                Poll::Ready(Err(e)) => Err(e),
                Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
            }
        }
    }
    let (io, conn) = t.get_mut();
    loop {
        // Records read before (a pipelined request) may hold plaintext already.
        let state = conn.process_new_packets().map_err(io::Error::other)?;
        if state.plaintext_bytes_to_read() > 0 || state.peer_has_closed() {
            return Poll::Ready(Ok(()));
        }
        match conn.read_tls(&mut Socket(io, cx)) {
            // The client closed: the read finds out.
            Ok(0) => return Poll::Ready(Ok(())),
            Ok(_) => {}
            Err(e) if would_block(&e) => return Poll::Pending,
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

fn lost() -> io::Error {
    io::Error::other("client socket closed, taken or not registered")
}

impl ClientStream {
    /// `s` must be in non-blocking mode.
    pub(crate) fn new(s: StdStream) -> Self {
        Self {
            socket: Socket::Unregistered(s),
            write_shut: false,
            linger: false,
            done: false,
        }
    }

    /// An HTTPS client, its handshake done.
    pub(crate) fn tls(s: TlsStream) -> Self {
        Self {
            socket: Socket::Tls(Box::new(s)),
            write_shut: false,
            linger: false,
            done: false,
        }
    }

    /// Ready once the client of a kept-alive connection has sent something (`true`: a plain
    /// socket's bytes read into `buf`, a TLS stream's plaintext left in rustls for the next
    /// read) or closed or failed (`false`). While it waits it holds no buffer of ours: `buf`
    /// is released when nothing came.
    pub(crate) fn poll_arrival(&mut self, cx: &mut Context<'_>, buf: &mut BytesMut) -> Poll<bool> {
        if let Socket::Tls(t) = &mut self.socket {
            let r = poll_tls_ready(t, cx);
            if r.is_pending() && buf.capacity() > 0 {
                *buf = BytesMut::new();
            }
            return r.map(|r| r.is_ok());
        }
        let Ok(s) = self.registered() else {
            return Poll::Ready(false);
        };
        // Readiness first, so that a buffer is taken only when the socket may have data; then
        // tokio's read, which clears readiness after a short read (the next wait then costs no
        // read that would block) and, when readiness was left over, registers the task.
        let read = match s.poll_read_ready(cx) {
            Poll::Ready(Err(_)) => return Poll::Ready(false),
            Poll::Ready(Ok(())) => {
                buf.reserve(16 * 1024);
                std::pin::pin!(s.read_buf(buf)).poll(cx)
            }
            Poll::Pending => Poll::Pending,
        };
        match read {
            Poll::Ready(r) => Poll::Ready(r.is_ok_and(|n| n > 0)),
            Poll::Pending => {
                if buf.capacity() > 0 {
                    *buf = BytesMut::new();
                }
                Poll::Pending
            }
        }
    }

    pub(crate) fn is_tls(&self) -> bool {
        matches!(self.socket, Socket::Tls(_))
    }

    /// The tokio stream, registering the socket now if need be.
    pub(crate) fn registered(&mut self) -> io::Result<&mut TcpStream> {
        if let Socket::Unregistered(_) = self.socket
            && let Socket::Unregistered(s) = std::mem::replace(&mut self.socket, Socket::Lost)
        {
            self.socket = Socket::Registered(TcpStream::from_std(s)?);
        }
        match &mut self.socket {
            Socket::Registered(t) => Ok(t),
            _ => Err(lost()),
        }
    }

    /// The plain socket, out of tokio's reactor (none for a TLS stream), for a connection
    /// parked without a task.
    pub(crate) fn into_std(mut self) -> Option<StdStream> {
        match std::mem::replace(&mut self.socket, Socket::Lost) {
            Socket::Unregistered(s) => Some(s),
            Socket::Registered(t) => t.into_std().ok(),
            _ => None,
        }
    }

    /// Takes the tokio stream out (registering it if need be): the connection leaves HTTP
    /// (pinned to a PE); this value is then spent, and closing it does nothing.
    pub(crate) fn take_stream(&mut self) -> io::Result<TcpStream> {
        self.registered()?;
        match std::mem::replace(&mut self.socket, Socket::Lost) {
            Socket::Registered(t) => Ok(t),
            _ => Err(lost()),
        }
    }

    /// Writes the last bytes of the connection and ends its sending side. `MSG_MORE` holds
    /// the bytes back until the FIN, which takes them in one segment: one packet less per
    /// connection (as many as `Connection: close` requests). When the client said it would
    /// send no more ([`ClientStream::client_done`]) and has not, the socket is closed right
    /// here (the close sends the FIN, as a shutdown would, and [`ClientStream::close`] then
    /// has nothing left to do: one system call less). Else only the sending side ends, at
    /// once, and the close reads off what the client still sends: a client that meant to
    /// keep the connection may send its next request any moment, and a close with it unread
    /// would reset the connection, the response unsent.
    pub(crate) async fn write_last(&mut self, mut data: &[u8]) -> io::Result<()> {
        if let Socket::Tls(t) = &mut self.socket {
            use tokio::io::AsyncWriteExt;
            t.write_all(data).await?;
            self.write_shut = true;
            return t.shutdown().await;
        }
        while !data.is_empty() {
            match self.try_send_more(data) {
                Ok(n) => data = &data[n..],
                Err(e) if would_block(&e) => self.registered()?.writable().await?,
                Err(e) => return Err(e),
            }
        }
        if self.done && !self.linger {
            match self.read_pending() {
                Some(Ok(0)) => return self.close_now(),
                Some(Err(e)) if would_block(&e) => return self.close_now(),
                // More came (a pipelined request, a late body): read it off before closing.
                Some(Ok(_)) => self.linger = true,
                _ => {}
            }
        }
        self.shutdown_write()
    }

    /// Closes a plain socket at once: the bytes held by `MSG_MORE` leave with the FIN.
    fn close_now(&mut self) -> io::Result<()> {
        self.socket = Socket::Lost;
        self.write_shut = true;
        Ok(())
    }

    fn try_send_more(&mut self, data: &[u8]) -> io::Result<usize> {
        // MSG_NOSIGNAL: a vanished client is an error here, not a SIGPIPE for whoever embeds
        // the proxy.
        let flags = libc::MSG_MORE | libc::MSG_NOSIGNAL;
        let send = |s: socket2::SockRef<'_>| s.send_with_flags(data, flags);
        match &self.socket {
            Socket::Unregistered(s) => send(socket2::SockRef::from(s)),
            Socket::Registered(t) => t.try_io(tokio::io::Interest::WRITABLE, || {
                send(socket2::SockRef::from(t))
            }),
            Socket::Tls(_) | Socket::Lost => Err(lost()),
        }
    }

    fn shutdown_write(&mut self) -> io::Result<()> {
        let r = match &self.socket {
            Socket::Unregistered(s) => s.shutdown(Shutdown::Write),
            Socket::Registered(t) => socket2::SockRef::from(t).shutdown(Shutdown::Write),
            // TLS ends with its close_notify, in `poll_shutdown` and `close`.
            Socket::Tls(_) | Socket::Lost => Ok(()),
        };
        self.write_shut = true;
        r
    }

    pub(crate) fn linger_on_close(&mut self) {
        self.linger = true;
    }

    /// The client sends nothing after its current request (see [`ClientStream::write_last`]).
    pub(crate) fn client_done(&mut self) {
        self.done = true;
    }

    /// Closes the connection without cutting off what was sent to it. A close with unread
    /// bytes in the receive queue makes Linux answer with a RST, and the RST destroys the
    /// response at the client if it has not read it yet. So if the client has sent more (a
    /// pipelined request, the rest of an upload the PE answered early), or is known to have
    /// more, that is read and dropped until the client closes, for at most [`LINGER`]. The
    /// usual case costs one `recv` that finds nothing (here, or in
    /// [`ClientStream::write_last`], which may have closed the socket already).
    /// Over TLS the same holds beneath the records: the close_notify and the FIN go first
    /// (`poll_shutdown`), then what the client still sends is read off as raw bytes.
    pub(crate) async fn close(mut self) {
        let deadline = tokio::time::Instant::now() + LINGER;
        if let Socket::Tls(t) = &mut self.socket {
            use tokio::io::AsyncWriteExt;
            if !self.write_shut
                && !matches!(
                    tokio::time::timeout_at(deadline, t.shutdown()).await,
                    Ok(Ok(()))
                )
            {
                return;
            }
        } else if !self.write_shut && self.shutdown_write().is_err() {
            return;
        }
        match self.read_pending() {
            Some(Ok(n)) if n > 0 => {}
            Some(Err(e)) if would_block(&e) && self.linger => {}
            _ => return,
        }
        let t = match &mut self.socket {
            Socket::Tls(t) => &mut t.get_mut().0,
            _ => match self.registered() {
                Ok(t) => t,
                Err(_) => return,
            },
        };
        // On the heap: a buffer held across the awaits below would be in every connection's
        // task, idle or not, for the usual close that never gets here.
        let mut scratch = vec![0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, t.read(&mut scratch)).await {
            if n == 0 {
                break;
            }
        }
    }
}

impl ClientStream {
    /// Reads (and drops) what the client sent without waiting: bytes read, or the error
    /// (`WouldBlock`: nothing there); `None` for a lost stream. A TLS stream's socket is read
    /// beneath rustls: only when the connection ends.
    fn read_pending(&self) -> Option<io::Result<usize>> {
        let mut scratch = [0u8; 4096];
        // Directly: tokio may not have seen the readiness yet.
        let recv = |t: &TcpStream, scratch: &mut [u8]| {
            rustix::net::recv(t, scratch, rustix::net::RecvFlags::DONTWAIT)
                .map(|(n, _)| n)
                .map_err(io::Error::from)
        };
        Some(match &self.socket {
            Socket::Unregistered(s) => (&*s).read(&mut scratch),
            Socket::Registered(t) => recv(t, &mut scratch),
            Socket::Tls(t) => recv(t.get_ref().0, &mut scratch),
            Socket::Lost => return None,
        })
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Socket::Tls(t) = &mut this.socket {
            return Pin::new(t.as_mut()).poll_read(cx, buf);
        }
        if let Socket::Unregistered(s) = &mut this.socket {
            let want = buf.remaining().min(SPECULATIVE_READ);
            // Into the buffer as it is, not zeroed first: zeroing touched all 16 KiB of every
            // connection's first read buffer, and those pages stayed resident in whatever took
            // the buffer's place next (an HTTP/2 connection's 16 KiB write buffer, for its life).
            #[allow(unsafe_code)]
            // SAFETY: `recv` only writes into the slice it gets, never de-initialises it.
            let unfilled = unsafe { &mut buf.unfilled_mut()[..want] };
            match socket2::SockRef::from(&*s).recv(unfilled) {
                Ok(n) => {
                    #[allow(unsafe_code)]
                    // SAFETY: the kernel wrote the first `n` bytes.
                    unsafe {
                        buf.assume_init(n)
                    };
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
        if let Socket::Tls(t) = &mut this.socket {
            return Pin::new(t.as_mut()).poll_write(cx, data);
        }
        if let Socket::Unregistered(s) = &mut this.socket {
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
        match &mut self.get_mut().socket {
            Socket::Registered(t) => Pin::new(t).poll_flush(cx),
            Socket::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Socket::Tls(t) = &mut this.socket {
            this.write_shut = true;
            return Pin::new(t.as_mut()).poll_shutdown(cx);
        }
        Poll::Ready(this.shutdown_write())
    }
}
/// An HTTP/1.1 client: its connection, what was read of it and not used yet, its address.
pub(crate) struct Client {
    pub(crate) stream: ClientStream,
    pub(crate) buf: BytesMut,
    pub(crate) peer: SocketAddr,
}
impl Client {
    /// A short answer of the proxy's own (the connection is closed after it); a 503 says when
    /// to come back.
    pub(crate) async fn reply(&mut self, code: u16, why: &str, ctx: &Ctx) -> io::Result<()> {
        use tokio::io::AsyncWriteExt;
        let resp = if code == 503 {
            let secs = ctx.cfg.levels.as_ref().map_or(1, |l| l.retry_after_s);
            error_response_with(code, why, &format!("Retry-After: {secs}\r\n"))
        } else {
            error_response(code, why)
        };
        self.stream.write_all(&resp).await
    }
}
