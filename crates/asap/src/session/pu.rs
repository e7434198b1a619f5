//! The pool user's side of a session: one conversation with a pool that outlives the pool
//! element serving it.
//!
//! The session keeps the last COOKIE its PE sent and the last BUSINESS_CARD. When the PE fails
//! — its connection closes or breaks, or nothing is heard from it for the response timeout
//! although heartbeats went out — the session reports it to a registrar (ENDPOINT_UNREACHABLE),
//! connects to another PE (the business card's first, else one the registrar names by the
//! pool's policy), sends COOKIE_ECHO with the last cookie as the first message there, and
//! tells the application with [`SessionEvent::FailedOver`]. The application then knows that
//! the session's state is the last cookie's: messages sent after it may have been lost, and
//! without a cookie the new PE starts from nothing.

use super::channel::{Channel, Incoming};
use crate::{Error, PoolUser};
use bytes::Bytes;
use rserpool_wire::{AsapMessage, CauseCode, PoolElement, PoolHandle};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// How a session watches its PE and fails over.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub pool: PoolHandle,
    /// A HEARTBEAT goes out when nothing was heard from the PE for this long.
    pub heartbeat_interval: Duration,
    /// Fail over when nothing was heard from the PE for this long (no message, no heartbeat
    /// answer): a PE that hangs, or a path that silently broke.
    pub response_timeout: Duration,
    /// Give up when no PE could be reached for this long during a failover.
    pub failover_timeout: Duration,
    /// Wait between rounds of a failover that found no PE.
    pub retry_delay: Duration,
    /// The largest message accepted from a PE.
    pub max_message: usize,
}

impl SessionConfig {
    pub fn new(pool: impl Into<PoolHandle>) -> Self {
        Self {
            pool: pool.into(),
            heartbeat_interval: Duration::from_millis(500),
            response_timeout: Duration::from_secs(2),
            failover_timeout: Duration::from_secs(10),
            retry_delay: Duration::from_millis(100),
            max_message: 16 << 20,
        }
    }
}

/// Why a session left its PE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailoverCause {
    /// The connection closed or broke.
    ConnectionLost(String),
    /// Nothing heard for the response timeout.
    Timeout,
    /// The PE sent something that is not the protocol.
    ProtocolError(String),
    /// The application asked ([`Session::failover`]).
    Asked,
}

impl std::fmt::Display for FailoverCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectionLost(why) => write!(f, "connection lost ({why})"),
            Self::Timeout => f.write_str("no answer within the response timeout"),
            Self::ProtocolError(why) => write!(f, "protocol error ({why})"),
            Self::Asked => f.write_str("failover asked for"),
        }
    }
}

/// A completed failover.
#[derive(Debug, Clone)]
pub struct Failover {
    pub from: u32,
    pub to: u32,
    pub cause: FailoverCause,
    /// The last cookie went to the new PE: it restores the state from it.
    pub cookie_echoed: bool,
    /// When the failure was seen.
    pub detected: Instant,
    /// From then until the new PE was connected and the cookie echoed.
    pub took: Duration,
}

#[derive(Debug)]
pub enum SessionEvent {
    /// An application message from the PE.
    Message { ppid: u32, data: Bytes },
    /// The session moved to another PE; the state is the last cookie's.
    FailedOver(Failover),
}

/// Counters of a session.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionStats {
    pub failovers: u64,
    pub cookies: u64,
    pub cookie_bytes: u64,
    pub business_cards: u64,
}

/// A pool user's session with a pool ([`SessionConfig::pool`]).
pub struct Session {
    pu: PoolUser,
    cfg: SessionConfig,
    chan: Channel,
    pe: PoolElement,
    cookie: Option<Bytes>,
    card: Option<(PoolHandle, Vec<PoolElement>)>,
    events: VecDeque<SessionEvent>,
    last_heard: Instant,
    last_heartbeat: Instant,
    stats: SessionStats,
}

impl Session {
    /// Opens a session with a PE of the pool chosen by the registrar.
    pub async fn connect(mut pu: PoolUser, cfg: SessionConfig) -> Result<Self, Error> {
        let (stream, pe) = pu.connect(&cfg.pool).await?;
        let chan = Channel::start(stream, cfg.max_message);
        debug!(
            "session with pool {} on PE {:#010x} at {}",
            cfg.pool,
            pe.id,
            chan.peer()
        );
        let now = Instant::now();
        Ok(Self {
            pu,
            cfg,
            chan,
            pe,
            cookie: None,
            card: None,
            events: VecDeque::new(),
            last_heard: now,
            last_heartbeat: now,
            stats: SessionStats::default(),
        })
    }

    /// The PE serving the session now.
    pub fn pool_element(&self) -> &PoolElement {
        &self.pe
    }

    /// A cookie came: a failover now resumes from it.
    pub fn has_cookie(&self) -> bool {
        self.cookie.is_some()
    }

    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// The pool user underneath (for resolutions of its own).
    pub fn pool_user(&mut self) -> &mut PoolUser {
        &mut self.pu
    }

    /// Sends an application message with PPID 0.
    pub async fn send(&mut self, data: &[u8]) -> Result<(), Error> {
        self.send_with_ppid(0, data).await
    }

    /// Sends an application message. If the connection is gone, the session fails over (the
    /// next [`recv`](Self::recv) says so) and the message is dropped: after a failover the
    /// application sends again what the last cookie does not cover.
    pub async fn send_with_ppid(&mut self, ppid: u32, data: &[u8]) -> Result<(), Error> {
        if self.chan.send_data(ppid, data).await.is_err() {
            self.fail_over(FailoverCause::ConnectionLost("write failed".into()))
                .await?;
        }
        Ok(())
    }

    /// Leaves the PE now, e.g. when the application's own timeout ran out. The PE is reported
    /// unreachable. The next [`recv`](Self::recv) returns the failover.
    pub async fn failover(&mut self) -> Result<(), Error> {
        self.fail_over(FailoverCause::Asked).await
    }

    /// The next message from the PE, or a failover. Cancel-safe as long as no failover is
    /// under way. An error is final: no PE could be reached within the failover timeout, or a
    /// PE refused the session (an ASAP ERROR; `Refused(REJECTED_SECURITY)` for a cookie it did
    /// not accept).
    pub async fn recv(&mut self) -> Result<SessionEvent, Error> {
        loop {
            if let Some(e) = self.events.pop_front() {
                return Ok(e);
            }
            let dead_at = self.last_heard + self.cfg.response_timeout;
            let beat_at = self.last_heard.max(self.last_heartbeat) + self.cfg.heartbeat_interval;
            let got = tokio::select! {
                r = self.chan.recv() => r,
                () = tokio::time::sleep_until(beat_at) => {
                    self.last_heartbeat = Instant::now();
                    self.chan.heartbeat();
                    continue;
                }
                () = tokio::time::sleep_until(dead_at) => {
                    self.fail_over(FailoverCause::Timeout).await?;
                    continue;
                }
            };
            match got {
                Ok(incoming) => {
                    self.last_heard = Instant::now();
                    match incoming {
                        Incoming::Data { ppid, data } => {
                            return Ok(SessionEvent::Message { ppid, data });
                        }
                        Incoming::HeartbeatAck => {}
                        Incoming::Asap(m) => self.control(m)?,
                    }
                }
                Err(Error::Decode(e)) => {
                    self.fail_over(FailoverCause::ProtocolError(e.to_string()))
                        .await?
                }
                Err(Error::Closed) => {
                    self.fail_over(FailoverCause::ConnectionLost("closed by the PE".into()))
                        .await?
                }
                Err(e) => {
                    self.fail_over(FailoverCause::ConnectionLost(e.to_string()))
                        .await?
                }
            }
        }
    }

    /// An ASAP message on the data channel.
    fn control(&mut self, m: AsapMessage) -> Result<(), Error> {
        match m {
            AsapMessage::Cookie { cookie } => {
                self.stats.cookies += 1;
                self.stats.cookie_bytes += cookie.len() as u64;
                self.cookie = Some(cookie);
            }
            AsapMessage::BusinessCard {
                pool_handle,
                pool_elements,
                ..
            } => {
                self.stats.business_cards += 1;
                debug!(
                    "business card from PE {:#010x}: pool {pool_handle}, {} PEs",
                    self.pe.id,
                    pool_elements.len()
                );
                self.card = Some((pool_handle, pool_elements));
            }
            AsapMessage::Error { error } => {
                let code = error
                    .causes
                    .first()
                    .map_or(CauseCode::UNSPECIFIED, |c| c.code);
                warn!(
                    "PE {:#010x} of pool {} refused the session: {code}",
                    self.pe.id, self.cfg.pool
                );
                return Err(Error::Refused(code));
            }
            other => debug!(
                "ignored {} from PE {:#010x} on the data channel",
                other.name(),
                self.pe.id
            ),
        }
        Ok(())
    }

    /// Reports the PE, connects to another and echoes the last cookie there.
    async fn fail_over(&mut self, cause: FailoverCause) -> Result<(), Error> {
        let detected = Instant::now();
        let from = self.pe.id;
        info!(
            "session with pool {}: PE {from:#010x} failed: {cause}",
            self.cfg.pool
        );
        let pool = self.cfg.pool.clone();
        // A registrar that does not answer must not hold the failover up.
        let report = self.pu.report_unreachable(&pool, from);
        let _ = tokio::time::timeout(Duration::from_millis(500), report).await;
        let deadline = detected + self.cfg.failover_timeout;
        let (stream, pe) = loop {
            if let Some(found) = self.connect_elsewhere(from).await {
                break found;
            }
            if Instant::now() >= deadline {
                return Err(Error::NoPoolElement(pool.to_string()));
            }
            tokio::time::sleep(self.cfg.retry_delay).await;
        };
        self.chan = Channel::start(stream, self.cfg.max_message);
        self.pe = pe;
        let cookie_echoed = match &self.cookie {
            Some(cookie) => {
                let echo = AsapMessage::CookieEcho {
                    cookie: cookie.clone(),
                };
                self.chan.send_asap(&echo).await.is_ok()
            }
            None => false,
        };
        let now = Instant::now();
        self.last_heard = now;
        self.last_heartbeat = now;
        self.stats.failovers += 1;
        let f = Failover {
            from,
            to: self.pe.id,
            cause,
            cookie_echoed,
            detected,
            took: now - detected,
        };
        info!(
            "session with pool {} failed over from PE {from:#010x} to PE {:#010x} in {:.1} ms{}",
            self.cfg.pool,
            f.to,
            f.took.as_secs_f64() * 1e3,
            if cookie_echoed {
                ", cookie echoed"
            } else {
                ", no cookie yet"
            }
        );
        self.events.push_back(SessionEvent::FailedOver(f));
        Ok(())
    }

    /// A connection to a PE other than `failed`: the business card's PEs in order, then its
    /// pool (or the session's) by the registrar.
    async fn connect_elsewhere(
        &mut self,
        failed: u32,
    ) -> Option<(tokio::net::TcpStream, PoolElement)> {
        let pool = match &self.card {
            Some((handle, pes)) => {
                for pe in pes.iter().filter(|pe| pe.id != failed) {
                    if let Some(s) = self.pu.connect_to(pe).await {
                        return Some((s, pe.clone()));
                    }
                    debug!("business card's PE {:#010x} unreachable", pe.id);
                }
                handle.clone()
            }
            None => self.cfg.pool.clone(),
        };
        match self.pu.connect_avoiding(&pool, &[failed]).await {
            Ok(found) => Some(found),
            Err(e) => {
                debug!("failover to pool {pool}: {e}");
                None
            }
        }
    }
}
