//! The listening side's packets that no association claims (RFC 9260 §5.1, §8.4): an INIT is
//! answered with an INIT ACK carrying a signed state cookie, and nothing is kept; a COOKIE
//! ECHO whose cookie opens becomes an [`Association`]; anything else "out of the blue" gets
//! what §8.4 says (mostly an ABORT with the T bit, never an answer to an ABORT).

use crate::assoc::{Association, Config, listed_addresses};
use crate::chunk::{Chunk, Init, InitParam};
use crate::cookie::{CookieError, CookieState};
use crate::packet::Packet;
use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::net::SocketAddr;
use std::time::Instant;

/// What to do with a packet no association claimed.
pub enum Outcome {
    Ignore,
    Reply(Packet),
    /// A new association (its COOKIE ACK is queued in it).
    Accept(Box<Association>),
    /// A COOKIE ECHO whose cookie did not open.
    BadCookie(CookieError),
}

pub struct Endpoint {
    cfg: Config,
    local_port: u16,
    secret: [u8; 32],
    epoch: Instant,
    rng: Xoshiro256PlusPlus,
}

impl Endpoint {
    /// `secret` signs the cookies, `seed` draws the tags and initial TSNs: both must be
    /// random (from the operating system).
    pub fn new(cfg: Config, local_port: u16, secret: [u8; 32], seed: u64, now: Instant) -> Self {
        Self {
            cfg,
            local_port,
            secret,
            epoch: now,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    fn ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// A packet from `from` that no association claimed.
    pub fn handle(&mut self, p: Packet, from: SocketAddr, now: Instant) -> Outcome {
        if p.dst_port != self.local_port {
            return Outcome::Ignore;
        }
        let Some(first) = p.chunks.first() else {
            return Outcome::Ignore;
        };
        match first {
            Chunk::Init(i) if p.tag == 0 && i.initiate_tag != 0 => {
                let tag = loop {
                    let t = self.rng.next_u32();
                    if t != 0 {
                        break t;
                    }
                };
                let tsn = self.rng.next_u32();
                let state = CookieState {
                    local_tag: tag,
                    local_tsn: tsn,
                    peer_tag: i.initiate_tag,
                    peer_tsn: i.initial_tsn,
                    peer_rwnd: i.a_rwnd,
                    outbound: self.cfg.outbound_streams.min(i.inbound_streams),
                    inbound: i.outbound_streams.min(self.cfg.max_inbound_streams),
                    local_port: self.local_port,
                    peer_port: p.src_port,
                    created_ms: self.ms(now),
                    peer_addrs: listed_addresses(&i.params),
                };
                let mut params = self.cfg.address_params();
                params.push(InitParam::StateCookie(Bytes::from(
                    state.seal(&self.secret),
                )));
                let ack = Init {
                    initiate_tag: tag,
                    a_rwnd: self.cfg.window.min(u32::MAX as usize) as u32,
                    outbound_streams: self.cfg.outbound_streams,
                    inbound_streams: self.cfg.max_inbound_streams,
                    initial_tsn: tsn,
                    params,
                };
                Outcome::Reply(Packet::new(
                    self.local_port,
                    p.src_port,
                    i.initiate_tag,
                    vec![Chunk::InitAck(ack)],
                ))
            }
            Chunk::CookieEcho(cookie) => {
                let life = self.cfg.cookie_life.as_millis() as u64;
                match CookieState::open(cookie, &self.secret, self.ms(now), life) {
                    Ok(c) if c.local_tag == p.tag && c.peer_port == p.src_port => {
                        let mut a = Association::accept(self.cfg.clone(), &c, from, now);
                        // DATA bundled behind the COOKIE ECHO.
                        let rest =
                            Packet::new(p.src_port, p.dst_port, p.tag, p.chunks[1..].to_vec());
                        if !rest.chunks.is_empty() {
                            a.handle(rest, from, now);
                        }
                        Outcome::Accept(Box::new(a))
                    }
                    Ok(_) => Outcome::Ignore,
                    Err(e) => Outcome::BadCookie(e),
                }
            }
            Chunk::Init(_) => Outcome::Ignore,
            _ => out_of_the_blue(&p).map_or(Outcome::Ignore, Outcome::Reply),
        }
    }
}

/// The answer to a packet no association and no listener claims (RFC 9260 §8.4): SHUTDOWN
/// COMPLETE to a SHUTDOWN ACK, nothing to an ABORT, SHUTDOWN COMPLETE, COOKIE ACK or ERROR,
/// an ABORT to anything else (to an INIT with the INIT's tag, else reflecting the packet's).
pub fn out_of_the_blue(p: &Packet) -> Option<Packet> {
    let reply = |tag, chunk| Some(Packet::new(p.dst_port, p.src_port, tag, vec![chunk]));
    let abort = |reflected| Chunk::Abort {
        reflected,
        causes: Bytes::new(),
    };
    match p.chunks.first()? {
        Chunk::ShutdownAck => reply(p.tag, Chunk::ShutdownComplete { reflected: true }),
        Chunk::Abort { .. }
        | Chunk::ShutdownComplete { .. }
        | Chunk::CookieAck
        | Chunk::Error { .. } => None,
        Chunk::Init(i) => reply(i.initiate_tag, abort(false)),
        _ => reply(p.tag, abort(true)),
    }
}
