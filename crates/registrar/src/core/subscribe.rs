//! Subscriptions (RFC 5352 §2.2.5, the S bit of HANDLE_RESOLUTION): a pool user asks to be
//! told of its pool's changes for the life of its association, and the registrar pushes the
//! whole pool again (a HANDLE_RESOLUTION_RESPONSE with the A bit) whenever it changes in a way
//! the pool user can see — a PE joins or leaves, or its policy information changes.
//!
//! This is the push path of credits (docs/CREDITS.md): a PE's new credits reach every proxy
//! using the pool one registrar hop after they reach its home (or two, through an ENRP peer),
//! without waiting for the proxy's next refresh. Pushes are coalesced: after each input the
//! registrar handles (a read, a timer), each subscribed pool that changed is sent once, as it
//! is then. A pool that no longer exists is pushed as a negative response (UNKNOWN_POOL_HANDLE,
//! A bit set): the pool is empty now.

use super::Instant;
use super::conns::{ConnId, Conns};
use rserpool_handlespace::{Handlespace, PeRef};
use rserpool_wire::{AsapMessage, CauseCode, ErrorCause, OperationError, PoolHandle};

/// Subscriptions one association may hold; more are answered without the A bit.
pub(super) const MAX_PER_CONNECTION: usize = 64;

#[derive(Debug)]
struct Subscription {
    conn: ConnId,
    handle: PoolHandle,
    /// The pool version last sent ([`Handlespace::pool_version`]); `None`: no pool.
    sent: Option<u64>,
}

/// Every subscription of the registrar.
#[derive(Debug, Default)]
pub(super) struct Subscriptions {
    subs: Vec<Subscription>,
    pushes: u64,
    /// [`Handlespace::changes`] when the subscriptions were last looked over.
    looked: u64,
}

impl Subscriptions {
    /// Subscribes `conn` to `handle`, whose version the answer just sent carries; false when
    /// the association holds too many already. Subscribing again changes nothing.
    pub(super) fn add(&mut self, conn: ConnId, handle: &PoolHandle, sent: Option<u64>) -> bool {
        let mut held = 0;
        for s in &mut self.subs {
            if s.conn == conn {
                if s.handle == *handle {
                    s.sent = sent;
                    return true;
                }
                held += 1;
            }
        }
        if held >= MAX_PER_CONNECTION {
            return false;
        }
        self.subs.push(Subscription {
            conn,
            handle: handle.clone(),
            sent,
        });
        true
    }

    /// The pools `conn` subscribed to.
    pub(super) fn of(&self, conn: ConnId) -> Vec<PoolHandle> {
        self.subs
            .iter()
            .filter(|s| s.conn == conn)
            .map(|s| s.handle.clone())
            .collect()
    }

    /// The association ended: its subscriptions with it.
    pub(super) fn closed(&mut self, conn: ConnId) {
        self.subs.retain(|s| s.conn != conn);
    }

    /// Pushes sent so far.
    pub(super) fn pushes(&self) -> u64 {
        self.pushes
    }

    /// How many subscriptions there are.
    pub(super) fn len(&self) -> usize {
        self.subs.len()
    }

    /// Sends each subscribed pool that changed since it was last sent.
    pub(super) fn push(
        &mut self,
        hs: &Handlespace,
        max_items: usize,
        scratch: &mut Vec<PeRef>,
        out: &mut Conns,
        now: Instant,
    ) {
        // Most inputs change no pool (keep-alive answers, resolutions): nothing to look at.
        if self.subs.is_empty() || hs.changes() == self.looked {
            return;
        }
        self.looked = hs.changes();
        for s in &mut self.subs {
            let version = hs.pool_version(s.handle.as_bytes());
            if version == s.sent {
                continue;
            }
            s.sent = version;
            self.pushes += 1;
            if version.is_none() {
                let msg = AsapMessage::HandleResolutionResponse {
                    accept: true,
                    pool_handle: s.handle.clone(),
                    policy: None,
                    pool_elements: Vec::new(),
                    error: Some(OperationError::single(ErrorCause::new(
                        CauseCode::UNKNOWN_POOL_HANDLE,
                    ))),
                };
                out.send_asap(s.conn, &msg, now);
                continue;
            }
            scratch.clear();
            scratch.extend(hs.members(s.handle.as_bytes()).take(max_items));
            out.write_resolution(s.conn, true, &s.handle, hs, scratch, now);
        }
    }
}
