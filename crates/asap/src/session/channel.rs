//! One data channel (a TCP connection between a PU and a PE) in the chunks of
//! [`rserpool_wire::mapping`]: application messages and ASAP session messages (PPID 11) both
//! ways, heartbeats answered on their own.
//!
//! Writes go through a task of the channel's own, so that answering a HEARTBEAT from inside
//! [`Channel::recv`] and every send stay cancel-safe: a `select!` that drops a call never
//! leaves half a chunk on the wire.

use crate::Error;
use bytes::{Bytes, BytesMut};
use rserpool_wire::mapping::{self, Chunk, ChunkReader, Reassembly};
use rserpool_wire::{ASAP_PPID, AsapMessage, ErrorCause, Message, OperationError};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::mpsc;

/// Chunks queued for the writer before a send waits.
const QUEUE: usize = 64;

/// What arrived.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// An application message (whole, reassembled).
    Data { ppid: u32, data: Bytes },
    /// An ASAP message (PPID 11).
    Asap(AsapMessage),
    /// A HEARTBEAT ACK: the peer is alive.
    HeartbeatAck,
}

pub(crate) struct Channel {
    reader: OwnedReadHalf,
    chunks: ChunkReader,
    reassembly: Reassembly,
    out: mpsc::Sender<Bytes>,
    peer: SocketAddr,
}

impl Channel {
    /// Starts the channel on a connected stream: our INIT goes out first.
    pub fn start(stream: TcpStream, max_message: usize) -> Self {
        stream.set_nodelay(true).ok();
        let peer = stream
            .peer_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let (reader, mut writer) = stream.into_split();
        let (out, mut queue) = mpsc::channel::<Bytes>(QUEUE);
        let mut init = BytesMut::new();
        mapping::put_init(&mut init);
        let _ = out.try_send(init.freeze());
        tokio::spawn(async move {
            while let Some(b) = queue.recv().await {
                if writer.write_all(&b).await.is_err() {
                    return;
                }
            }
            let _ = writer.shutdown().await;
        });
        Self {
            reader,
            chunks: ChunkReader::new(),
            reassembly: Reassembly::new(max_message),
            out,
            peer,
        }
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Queues an application message.
    pub async fn send_data(&self, ppid: u32, data: &[u8]) -> Result<(), Error> {
        let mut b = BytesMut::with_capacity(data.len() + mapping::DATA_HEADER + 4);
        mapping::put_data(&mut b, ppid, data);
        self.queue(b.freeze()).await
    }

    /// Queues an ASAP message (PPID 11).
    pub async fn send_asap(&self, msg: &AsapMessage) -> Result<(), Error> {
        let mut m = Vec::with_capacity(64);
        msg.encode(&mut m)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        self.send_data(ASAP_PPID, &m).await
    }

    /// Queues a HEARTBEAT unless the queue is full (then data is on its way anyway).
    pub fn heartbeat(&self) {
        let mut b = BytesMut::new();
        mapping::put_heartbeat(&mut b, false, b"rserpool");
        let _ = self.out.try_send(b.freeze());
    }

    async fn queue(&self, b: Bytes) -> Result<(), Error> {
        self.out.send(b).await.map_err(|_| Error::Closed)
    }

    /// The next message or heartbeat answer. Cancel-safe. A stream that cannot be framed or an
    /// ASAP message that cannot be decoded is an error; for the latter an ASAP ERROR with the
    /// RFC cause goes back first.
    pub async fn recv(&mut self) -> Result<Incoming, Error> {
        loop {
            while let Some(chunk) = self.chunks.next_chunk()? {
                match chunk {
                    Chunk::Data {
                        flags,
                        ppid,
                        payload,
                    } => {
                        let Some((ppid, data)) = self.reassembly.push(flags, ppid, payload)? else {
                            continue;
                        };
                        if ppid != ASAP_PPID {
                            return Ok(Incoming::Data { ppid, data });
                        }
                        match AsapMessage::decode(&data) {
                            Ok(m) => return Ok(Incoming::Asap(m)),
                            Err(e) => {
                                let cause = e.cause.clone().unwrap_or_else(|| {
                                    ErrorCause::new(rserpool_wire::CauseCode::INVALID_VALUES)
                                });
                                let _ = self.refuse(cause).await;
                                return Err(Error::Decode(e));
                            }
                        }
                    }
                    Chunk::Heartbeat { info } => {
                        let mut b = BytesMut::new();
                        mapping::put_heartbeat(&mut b, true, &info);
                        let _ = self.out.try_send(b.freeze());
                    }
                    Chunk::HeartbeatAck { .. } => return Ok(Incoming::HeartbeatAck),
                    Chunk::Init { .. } | Chunk::Ack | Chunk::Unknown { .. } => {}
                }
            }
            let n = self.reader.read_buf(self.chunks.buffer_mut()).await?;
            if n == 0 {
                return Err(Error::Closed);
            }
        }
    }

    /// Sends an ASAP ERROR with `cause`; the caller then drops the channel, which closes it
    /// once the ERROR is written.
    pub async fn refuse(&self, cause: ErrorCause) -> Result<(), Error> {
        self.send_asap(&AsapMessage::Error {
            error: OperationError::single(cause),
        })
        .await
    }
}
