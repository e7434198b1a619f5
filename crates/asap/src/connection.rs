//! One ASAP association with a registrar: a TCP stream (or TLS over one) with message framing,
//! or an SCTP association (each message an SCTP message), for tests and tools.

use crate::Error;
use crate::core::MAX_MESSAGE;
use rserpool_wire::Message;
use rserpool_wire::{AsapMessage, Framer};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// What an association runs over: a TCP stream, or TLS over one.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

enum Transport {
    Stream(Box<dyn Io>),
    Sctp(crate::sctp::Association),
}

pub struct AsapConnection {
    transport: Transport,
    framer: Framer,
    wbuf: Vec<u8>,
    peer: SocketAddr,
}

impl AsapConnection {
    /// Connects to a registrar's ASAP port.
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, Error> {
        let stream = match tokio::time::timeout(timeout, connect_stream(addr)).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::Timeout),
        };
        Ok(Self::from_io(stream, addr))
    }

    /// Connects to a registrar's ASAP address over the transport it names (`tcp://`,
    /// `sctp+udp://`, `sctp://`).
    pub async fn connect_to(
        addr: &rserpool_wire::Address,
        timeout: Duration,
    ) -> Result<Self, Error> {
        if !addr.scheme.is_sctp() {
            return Self::connect(addr.addr, timeout).await;
        }
        let assoc = match tokio::time::timeout(timeout, crate::sctp::connect(addr)).await {
            Ok(r) => r?,
            Err(_) => return Err(Error::Timeout),
        };
        Ok(Self {
            transport: Transport::Sctp(assoc),
            framer: Framer::new(MAX_MESSAGE),
            wbuf: Vec::with_capacity(256),
            peer: addr.addr,
        })
    }

    /// Wraps an already connected stream (e.g. one bound to a chosen source address).
    pub fn from_stream(stream: TcpStream, peer: SocketAddr) -> Self {
        stream.set_nodelay(true).ok();
        Self::from_io(stream, peer)
    }

    /// Wraps an association's stream that is ready to carry ASAP (a TLS stream whose
    /// handshake is done, say).
    pub fn from_io(stream: impl Io + 'static, peer: SocketAddr) -> Self {
        Self {
            transport: Transport::Stream(Box::new(stream)),
            framer: Framer::new(MAX_MESSAGE),
            wbuf: Vec::with_capacity(256),
            peer,
        }
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    pub async fn send(&mut self, msg: &AsapMessage) -> Result<(), Error> {
        self.wbuf.clear();
        msg.encode(&mut self.wbuf)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        match &mut self.transport {
            Transport::Stream(s) => s.write_all(&self.wbuf).await?,
            Transport::Sctp(a) => a.send(
                0,
                rserpool_wire::ASAP_PPID,
                crate::sctp::for_sctp(&self.wbuf),
            )?,
        }
        Ok(())
    }

    /// The next message. Cancel-safe: bytes read stay buffered for the next call.
    pub async fn recv(&mut self) -> Result<AsapMessage, Error> {
        loop {
            let stream = match &mut self.transport {
                Transport::Stream(s) => s,
                Transport::Sctp(a) => loop {
                    match a.recv().await {
                        Some(m) if m.ppid == rserpool_wire::ASAP_PPID => {
                            return Ok(AsapMessage::decode(&m.data)?);
                        }
                        Some(_) => {}
                        None => return Err(Error::Closed),
                    }
                },
            };
            if let Some(m) = self.framer.next_message()? {
                return Ok(AsapMessage::decode(&m)?);
            }
            let n = stream.read_buf(self.framer.buffer_mut()).await?;
            if n == 0 {
                return Err(Error::Closed);
            }
        }
    }
}

/// A TCP connection to a registrar (no delay on small writes).
pub(crate) async fn connect_stream(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect(addr).await?;
    // With nothing listening on a port in the ephemeral range, Linux may connect a socket to
    // itself (simultaneous open) and hold the port the registrar wants to restart on.
    if stream.local_addr().ok() == stream.peer_addr().ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connected to itself: nothing listens there",
        ));
    }
    stream.set_nodelay(true).ok();
    Ok(stream)
}
