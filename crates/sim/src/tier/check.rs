//! The tier's invariants (docs/TIER.md), judged after every step of the model:
//! - (a) once the tier has been calm for [`SETTLE_MS`], every live member holds both entries
//!   of every open connection some live member holds whole; no packet of such a connection
//!   meets a member that neither holds nor forwards it; and no open connection's entry is
//!   removed by a DEL (or expires, once calm has lasted an idle timeout more);
//! - (b) no entry outlives its connection by more than [`ENTRY_BOUND_MS`];
//! - (c) the distributor's group holds every member reachable and alive for
//!   [`JOIN_BOUND_MS`], and none dead or cut off from it for its detection bound.
//!
//! What only a moment shows (a packet that broke a connection, a DEL or an expiry that took
//! an open one) the model records as a [`Fact`] and this judges after the step. The model
//! carries packets and applies actions; whether that was allowed is a question of the
//! invariants, asked here. The state (tables, group) is looked at every
//! [`CHECK_EVERY_MS`].

use super::datapath::IDLE_MS;
use super::world::{
    CONNECT_TIMEOUT_MS, DISCOVERY_MS, Fact, HEARTBEAT_MS, LIST_LAG_MS, STEP_MS, TierWorld,
};
use crate::net::Ms;

/// Calm needed before (a) is checked: a listing lag, a discovery round, a connection attempt
/// that times out and the next one, the table's transfer.
pub const SETTLE_MS: Ms = LIST_LAG_MS + 2 * DISCOVERY_MS + CONNECT_TIMEOUT_MS + 1_000;
/// A new splice reaches every member within this (a link's delay, in calm).
const REPLICATION_MS: Ms = 200;
/// (b): an entry goes at most this long after its connection ended: idle at a member that
/// missed the end, plus a pass and the expiry's own period.
pub const ENTRY_BOUND_MS: Ms = IDLE_MS + 3_000;
/// (c): a member alive and reachable is in the group within this: listed, resolved, the other
/// members' tables received (or their wait over), answered.
pub const JOIN_BOUND_MS: Ms = LIST_LAG_MS
    + DISCOVERY_MS
    + rserpool_tier::member::SYNC_WAIT.as_millis() as Ms
    + 2 * HEARTBEAT_MS
    + 200;
/// How often the tables and the group are looked at.
const CHECK_EVERY_MS: Ms = 50;

/// The checks' own state over a run.
#[derive(Default)]
pub(super) struct Checks {
    violation: Option<String>,
    /// Connections that ended and that some member may still hold.
    ended: Vec<usize>,
}

fn settled(w: &TierWorld) -> bool {
    w.now >= w.disturbed_at + SETTLE_MS
}

impl Checks {
    /// After a step: its facts, then (every [`CHECK_EVERY_MS`]) the state. The first
    /// violation is the run's.
    pub(super) fn after_step(&mut self, w: &mut TierWorld) -> Result<(), String> {
        for fact in std::mem::take(&mut w.facts) {
            self.judge(w, fact);
        }
        if w.now.is_multiple_of(CHECK_EVERY_MS) {
            self.state(w);
        }
        self.violation.clone().map_or(Ok(()), Err)
    }

    fn fail(&mut self, w: &TierWorld, why: String) {
        if self.violation.is_none() {
            w.say(|| format!("VIOLATION: {why}"));
            self.violation = Some(format!("at {} ms: {why}", w.now));
        }
    }

    fn judge(&mut self, w: &mut TierWorld, fact: Fact) {
        let now = w.now;
        match fact {
            Fact::Broken {
                conn: c,
                at,
                why,
                held,
            } => {
                let conn = &w.conns[c];
                if !held {
                    w.counts.lost_connections += 1;
                } else if settled(w) && conn.created + REPLICATION_MS <= now {
                    let why = format!(
                        "(a) connection {} (made at member {}) broke at member {at}: {why}",
                        conn.splice.key().0,
                        conn.owner
                    );
                    self.fail(w, why);
                } else {
                    w.counts.broken_unsettled += 1;
                }
            }
            Fact::RemovedOpen { at, id, client } => self.fail(
                w,
                format!("(a) member {at} ({id:#010x}) removed open connection {client} on a DEL"),
            ),
            Fact::ExpiredOpen { at, id, client } => {
                if now >= w.disturbed_at + SETTLE_MS + IDLE_MS {
                    self.fail(
                        w,
                        format!(
                            "(a) member {at} ({id:#010x}) let open connection {client} idle out \
                             in calm"
                        ),
                    );
                }
            }
            Fact::Ended(c) => self.ended.push(c),
        }
    }

    /// The tables and the group.
    fn state(&mut self, w: &TierWorld) {
        let now = w.now;
        // (a) In calm, every live member holds both entries of every open connection a live
        // member holds whole.
        if settled(w) {
            for &c in &w.open {
                let conn = &w.conns[c];
                if conn.ended.is_some() || conn.created + REPLICATION_MS > now {
                    continue;
                }
                let key = conn.splice.key();
                // Per member: not alive, or whether it holds the connection whole.
                let whole: Vec<Option<bool>> = w
                    .members
                    .iter()
                    .map(|m| m.proc.as_ref().map(|p| p.dp.whole(&conn.splice)))
                    .collect();
                if let Some(k) = whole.iter().position(|&h| h == Some(false))
                    && whole.contains(&Some(true))
                {
                    let why = format!(
                        "(a) member {k} does not hold open connection {} whole (made at member \
                         {}, {} ms ago) after {} ms of calm",
                        key.0,
                        conn.owner,
                        now - conn.created,
                        now - w.disturbed_at
                    );
                    self.fail(w, why);
                    return;
                }
            }
        }
        // (b) No entry outlives its connection by more than the bound. A connection no
        // member holds any more past the bound is not looked at again.
        self.ended.retain(|&c| {
            w.conns[c].ended.is_some_and(|e| now <= e + ENTRY_BOUND_MS)
                || w.held(&w.conns[c].splice)
        });
        for i in 0..self.ended.len() {
            let c = self.ended[i];
            let Some(ended) = w.conns[c].ended else {
                continue;
            };
            if now <= ended + ENTRY_BOUND_MS {
                continue;
            }
            let key = w.conns[c].splice.key();
            // Counted from the end, or from the entry's installation when a table sent
            // after the end revived it.
            if let Some(k) = (0..w.members.len()).find(|&k| {
                w.members[k].proc.as_ref().is_some_and(|p| {
                    p.dp.installed(&w.conns[c].splice)
                        .is_some_and(|installed| now > installed.max(ended) + ENTRY_BOUND_MS)
                })
            }) {
                self.fail(
                    w,
                    format!(
                        "(b) member {k} still holds connection {} {} ms after it ended",
                        key.0,
                        now - ended
                    ),
                );
                return;
            }
        }
        // (c) The group is the live members, within the bounds.
        let bound = w.dist.config().detection_bound().as_millis() as Ms + 2 * STEP_MS;
        // With no member alive the group stays as it was: dead members leave it once one
        // has been alive long enough to join.
        let any_up = w.members.iter().any(|m| {
            m.healthy_since
                .is_some_and(|s| now >= s.max(w.loss.1) + JOIN_BOUND_MS)
        });
        for (k, m) in w.members.iter().enumerate() {
            let id = m.proc.as_ref().map(|p| p.id);
            let in_group = id.is_some_and(|id| w.group.contains(&id));
            if let Some(since) = m.healthy_since
                && now >= since.max(w.loss.1) + JOIN_BOUND_MS
                && !in_group
            {
                self.fail(
                    w,
                    format!(
                        "(c) member {k} alive and reachable for {} ms is not in the group",
                        now - since
                    ),
                );
                return;
            }
            if let Some(since) = m.down_since
                && any_up
                && now >= since + bound
                && in_group
            {
                self.fail(
                    w,
                    format!(
                        "(c) member {k}, dead or cut off for {} ms, is still in the group",
                        now - since
                    ),
                );
                return;
            }
        }
    }
}

/// At the end, once no connection is open: no entry is left.
pub(super) fn at_end(w: &TierWorld, after_ms: Ms) -> Result<(), String> {
    let open = w.conns.iter().filter(|c| c.ended.is_none()).count();
    let held: usize = w
        .members
        .iter()
        .filter_map(|m| m.proc.as_ref())
        .map(|p| p.dp.len())
        .sum();
    if held > 0 && open == 0 {
        return Err(format!(
            "(b) {held} entries left {after_ms} ms after the last connection ended"
        ));
    }
    Ok(())
}
