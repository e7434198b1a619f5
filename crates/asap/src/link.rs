//! What a connection's task and the driver of its core tell each other: the same for a TCP
//! connection (`driver.rs`) and an SCTP association (`sctp.rs`).

use crate::core::ConnId;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// What a connection's task reports.
pub(crate) enum ConnEvent {
    Connected(ConnId),
    Data(ConnId, Vec<u8>),
    /// Closed by the peer or an error.
    Closed(ConnId),
    ConnectFailed(ConnId, std::io::Error),
}

/// What a connection's task is told.
pub(crate) enum Out {
    Bytes(Vec<u8>),
    /// Close after the bytes before it.
    Close,
    /// Stop after the bytes before it and give the connection back (plain TCP).
    Release(oneshot::Sender<TcpStream>),
}
