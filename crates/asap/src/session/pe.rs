//! The pool element's side of a session: sessions accepted on the PE's data port, cookies
//! sent, state restored from a COOKIE_ECHO after another PE failed, business cards handed out.

use super::channel::{Channel, Incoming};
use super::cookie::{CookieError, CookieSealer};
use crate::Error;
use bytes::Bytes;
use rserpool_wire::{AsapMessage, CauseCode, ErrorCause, Policy, PoolElement, PoolHandle};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpStream;
use tracing::{debug, warn};

/// Accepts sessions for one pool: the cookie secret and the limits they share.
#[derive(Clone, Debug)]
pub struct SessionAcceptor {
    sealer: Arc<CookieSealer>,
    max_message: usize,
    refused: Arc<AtomicU64>,
}

impl SessionAcceptor {
    pub fn new(sealer: CookieSealer) -> Self {
        Self {
            sealer: Arc::new(sealer),
            max_message: 16 << 20,
            refused: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The largest message accepted from a PU (default 16 MiB).
    pub fn with_max_message(mut self, max: usize) -> Self {
        self.max_message = max;
        self
    }

    /// Starts a session on a connection accepted from a PU.
    pub fn accept(&self, stream: TcpStream) -> PeSession {
        PeSession {
            chan: Channel::start(stream, self.max_message),
            acceptor: self.clone(),
        }
    }

    /// Cookies refused so far (forged, altered, expired, unsealed).
    pub fn cookies_refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    pub fn sealer(&self) -> &CookieSealer {
        &self.sealer
    }
}

#[derive(Debug)]
pub enum PeSessionEvent {
    /// An application message from the PU.
    Message { ppid: u32, data: Bytes },
    /// The PU failed over to this PE: the state of its last cookie, checked. It comes before
    /// any message of the PU on this connection.
    Resume(Bytes),
}

/// One PU's session on this PE.
pub struct PeSession {
    chan: Channel,
    acceptor: SessionAcceptor,
}

impl PeSession {
    pub fn peer(&self) -> SocketAddr {
        self.chan.peer()
    }

    /// The next event; `Ok(None)` when the PU closed the session. A COOKIE_ECHO that does not
    /// open is answered with an ASAP ERROR (Rejected due to security considerations) and ends
    /// the session with [`Error::Cookie`].
    pub async fn recv(&mut self) -> Result<Option<PeSessionEvent>, Error> {
        loop {
            let incoming = match self.chan.recv().await {
                Ok(i) => i,
                Err(Error::Closed) => return Ok(None),
                Err(e) => return Err(e),
            };
            match incoming {
                Incoming::Data { ppid, data } => {
                    return Ok(Some(PeSessionEvent::Message { ppid, data }));
                }
                Incoming::HeartbeatAck => {}
                Incoming::Asap(AsapMessage::CookieEcho { cookie }) => {
                    match self.acceptor.sealer.open(&cookie) {
                        Ok(state) => return Ok(Some(PeSessionEvent::Resume(state))),
                        Err(e) => return Err(self.refuse_cookie(e).await),
                    }
                }
                Incoming::Asap(other) => debug!(
                    "session from {}: ignored {} on the data channel",
                    self.peer(),
                    other.name()
                ),
            }
        }
    }

    async fn refuse_cookie(&self, e: CookieError) -> Error {
        let n = self.acceptor.refused.fetch_add(1, Ordering::Relaxed) + 1;
        // Logged at 1, 2, 4, 8, ... refusals: a flood of forged cookies does not flood the log.
        if n.is_power_of_two() {
            warn!(
                "session from {}: COOKIE_ECHO refused: {e} ({n} refused so far)",
                self.peer()
            );
        }
        let mut cause = ErrorCause::new(CauseCode::REJECTED_SECURITY);
        cause.info = Bytes::from(e.to_string());
        let _ = self.chan.refuse(cause).await;
        Error::Cookie(e)
    }

    /// Sends an application message with PPID 0.
    pub async fn send(&self, data: &[u8]) -> Result<(), Error> {
        self.chan.send_data(0, data).await
    }

    pub async fn send_with_ppid(&self, ppid: u32, data: &[u8]) -> Result<(), Error> {
        self.chan.send_data(ppid, data).await
    }

    /// Seals `state` into a COOKIE and sends it; returns the cookie's length.
    pub async fn send_cookie(&self, state: &[u8]) -> Result<usize, Error> {
        let cookie = self.acceptor.sealer.seal(state);
        let len = cookie.len();
        self.chan.send_asap(&AsapMessage::Cookie { cookie }).await?;
        Ok(len)
    }

    /// Tells the PU where to fail over to: `pool_elements` of `pool` first (then the pool by
    /// its policy).
    pub async fn send_business_card(
        &self,
        pool: PoolHandle,
        policy: Option<Policy>,
        pool_elements: Vec<PoolElement>,
    ) -> Result<(), Error> {
        self.chan
            .send_asap(&AsapMessage::BusinessCard {
                pool_handle: pool,
                policy,
                pool_elements,
            })
            .await
    }
}
