//! The distributor's decisions, sans IO (docs/TIER.md, "`rserpool distributor`"): when to
//! send heartbeats, when a member is dead, each member's weight from its workload factor,
//! the group of live members the router should spread packets over, and whom to tell of a
//! death. The driver carries the datagrams, resolves the tier pool, reads the traffic watch
//! and changes the router's nexthop group.
//!
//! A member is dead after `misses` heartbeats in a row unanswered (each within `answer`), as
//! soon as it leaves the pool, or when the traffic watch says so; the first to find it wins.
//! It is alive again at its next answer. Once the group no longer has a dead member, every
//! live member hears of it, the first of them as the one that sends the nudge's probes.

use crate::wire::Datagram;
use rserpool_wire::Instant;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;
use tracing::{info, warn};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistributorConfig {
    pub heartbeat: Duration,
    /// A heartbeat not answered within this is missed.
    pub answer: Duration,
    /// Misses in a row that make a member dead.
    pub misses: u32,
    /// A weight is 1 + free capacity × (levels − 1), rounded; 1: equal weights.
    pub weight_levels: u32,
    /// The traffic watch: a member sent at least `silence_frames` frames that sent none for
    /// `silence` is dead.
    pub silence: Duration,
    pub silence_frames: u64,
}

impl DistributorConfig {
    /// The longest from a member's death to its leaving the group by heartbeats alone: the
    /// heartbeat in flight, `misses` more, and the last one's answer time.
    pub fn detection_bound(&self) -> Duration {
        self.heartbeat * (self.misses + 1) + self.answer
    }
}

/// Frames the router's traffic watch counted for one member: sent to it, received from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub to: u64,
    pub from: u64,
}

/// The group to install: each live member with its weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub members: Vec<(u32, SocketAddr, u32)>,
}

#[derive(Debug)]
struct Member {
    addr: SocketAddr,
    missed: u32,
    answered: bool,
    free: f64,
    weight: u32,
    /// In the group (or to be).
    live: bool,
    /// A heartbeat is out, not answered yet: by when its answer is due.
    waiting: Option<Instant>,
    /// Gone from the tier pool while it answered heartbeats: its registration failed (a
    /// registrar cut off, say), not necessarily the proxy. It stays while it answers; its
    /// first miss is its death.
    unlisted: bool,
    /// The watch's counts at the last look, when it last sent a frame, and the frames sent
    /// to it until then.
    seen: Traffic,
    heard_at: Instant,
    to_at_heard: u64,
}

#[derive(Debug)]
pub struct DistributorCore {
    cfg: DistributorConfig,
    members: BTreeMap<u32, Member>,
    seq: u32,
    next_beat: Instant,
    /// Members found dead whose peers have not heard of it yet.
    died: Vec<u32>,
    /// The group last installed, if any.
    applied: Option<Vec<(u32, u32)>>,
    transmits: VecDeque<(SocketAddr, Vec<u8>)>,
}

impl DistributorCore {
    pub fn new(cfg: DistributorConfig, now: Instant) -> Self {
        Self {
            cfg,
            members: BTreeMap::new(),
            seq: 0,
            next_beat: now,
            died: Vec::new(),
            applied: None,
            transmits: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &DistributorConfig {
        &self.cfg
    }

    /// The members the tier pool lists now; new ones are live at their first answer. A live
    /// one gone from the pool is asked at once (a heartbeat out of turn): dead if it does not
    /// answer in time, as a killed proxy's registration goes with it; kept while it answers,
    /// as a proxy whose registrar was cut off is still a proxy with connections.
    pub fn set_listed(&mut self, listed: &BTreeMap<u32, SocketAddr>, now: Instant) {
        for (id, m) in &mut self.members {
            let here = listed.get(id) == Some(&m.addr);
            if m.live && !here && !m.unlisted {
                warn!(
                    "distributor: proxy {id:#010x} at {} left the tier pool; dead unless it \
                     answers at once",
                    m.addr
                );
                m.unlisted = true;
                m.waiting = Some(now + self.cfg.answer.min(self.cfg.heartbeat));
                let hb = Datagram::Heartbeat { seq: self.seq }.encode();
                self.transmits.push_back((m.addr, hb));
            } else if here && m.unlisted {
                info!(
                    "distributor: proxy {id:#010x} at {} back in the tier pool",
                    m.addr
                );
                m.unlisted = false;
            }
        }
        self.members
            .retain(|id, m| listed.get(id) == Some(&m.addr) || (m.live && m.unlisted));
        for (&id, &addr) in listed {
            self.members.entry(id).or_insert_with(|| {
                info!("distributor: proxy {id:#010x} at {addr} in the tier pool");
                Member {
                    addr,
                    missed: 0,
                    answered: false,
                    free: 1.0,
                    weight: 1,
                    live: false,
                    waiting: None,
                    unlisted: false,
                    seen: Traffic::default(),
                    heard_at: now,
                    to_at_heard: 0,
                }
            });
        }
    }

    /// The members known, with their tier addresses.
    pub fn members(&self) -> impl Iterator<Item = (u32, SocketAddr)> + '_ {
        self.members.iter().map(|(id, m)| (*id, m.addr))
    }

    /// The members taken for alive now.
    pub fn live(&self) -> Vec<u32> {
        self.members
            .iter()
            .filter(|(_, m)| m.live)
            .map(|(id, _)| *id)
            .collect()
    }

    /// A datagram from `from` (an answer to a heartbeat).
    pub fn handle_datagram(&mut self, from: SocketAddr, bytes: &[u8], now: Instant) {
        let Some(Datagram::Answer { id, free, .. }) = Datagram::decode_at_distributor(bytes) else {
            return;
        };
        let Some(m) = self.members.get_mut(&id).filter(|m| m.addr == from) else {
            return;
        };
        m.missed = 0;
        m.waiting = None;
        m.free = f64::from(free.min(1_000_000)) / 1e6;
        if !m.answered || !m.live {
            info!("distributor: proxy {id:#010x} at {} is alive", m.addr);
            m.heard_at = now;
            m.to_at_heard = m.seen.to;
        }
        m.answered = true;
        m.live = true;
    }

    /// The traffic watch's counts, by member: one that was sent frames and sent none for the
    /// silence is dead.
    pub fn traffic(&mut self, counts: &BTreeMap<u32, Traffic>, now: Instant) {
        for (id, m) in &mut self.members {
            let Some(t) = counts.get(id) else { continue };
            if t.from > m.seen.from || t.to < m.seen.to {
                m.heard_at = now;
                m.to_at_heard = t.to;
            }
            m.seen = *t;
            let unanswered = t.to.saturating_sub(m.to_at_heard);
            let quiet = now.saturating_duration_since(m.heard_at);
            if m.live && quiet >= self.cfg.silence && unanswered >= self.cfg.silence_frames {
                warn!(
                    "distributor: proxy {id:#010x} at {} is dead: it was sent {unanswered} \
                     frames in {} ms and sent none",
                    m.addr,
                    quiet.as_millis()
                );
                m.live = false;
                self.died.push(*id);
            }
        }
    }

    /// Runs the timers due at `now`: answers due, a round of heartbeats.
    pub fn tick(&mut self, now: Instant) {
        for (id, m) in &mut self.members {
            if m.waiting.is_none_or(|t| t > now) {
                continue;
            }
            m.waiting = None;
            m.missed += 1;
            if m.live && (m.missed >= self.cfg.misses || m.unlisted) {
                warn!(
                    "distributor: proxy {id:#010x} at {} is dead: {} heartbeats without an \
                     answer{}",
                    m.addr,
                    m.missed,
                    if m.unlisted {
                        ", gone from the tier pool"
                    } else {
                        ""
                    }
                );
                m.live = false;
                self.died.push(*id);
            }
        }
        self.members.retain(|_, m| m.live || !m.unlisted);
        if self.next_beat <= now {
            self.seq = self.seq.wrapping_add(1);
            let hb = Datagram::Heartbeat { seq: self.seq }.encode();
            let due = now + self.cfg.answer.min(self.cfg.heartbeat);
            for m in self.members.values_mut() {
                self.transmits.push_back((m.addr, hb.clone()));
                m.waiting = Some(m.waiting.map_or(due, |w| w.min(due)));
            }
            self.next_beat = self.next_beat + self.cfg.heartbeat;
            if self.next_beat <= now {
                self.next_beat = now + self.cfg.heartbeat;
            }
        }
    }

    pub fn poll_timeout(&self) -> Instant {
        self.members
            .values()
            .filter_map(|m| m.waiting)
            .fold(self.next_beat, Instant::min)
    }

    pub fn poll_transmit(&mut self) -> Option<(SocketAddr, Vec<u8>)> {
        self.transmits.pop_front()
    }

    /// The group the live members make, when it differs from the one installed. Weights
    /// move only by 2 or more. An empty group is never installed: the group stays as it
    /// was. Call [`Self::group_applied`] once it is installed.
    pub fn poll_group(&mut self) -> Option<Group> {
        let levels = self.cfg.weight_levels.max(1);
        for m in self.members.values_mut() {
            let w = 1 + (m.free * f64::from(levels - 1)).round() as u32;
            if w.abs_diff(m.weight) >= 2 || levels == 1 {
                m.weight = w;
            }
        }
        let want: Vec<(u32, u32)> = self
            .members
            .iter()
            .filter(|(_, m)| m.live)
            .map(|(id, m)| (*id, if levels == 1 { 1 } else { m.weight }))
            .collect();
        if self.applied.as_ref() == Some(&want) {
            return None;
        }
        if want.is_empty() {
            warn!("distributor: no proxy of the tier is alive; the group stays as it was");
            self.applied = Some(want);
            return None;
        }
        Some(Group {
            members: want
                .iter()
                .filter_map(|&(id, w)| Some((id, self.members.get(&id)?.addr, w)))
                .collect(),
        })
    }

    /// `g` is installed: the live members hear of the deaths since the last group.
    pub fn group_applied(&mut self, g: &Group) {
        self.applied = Some(g.members.iter().map(|&(id, _, w)| (id, w)).collect());
        for dead in std::mem::take(&mut self.died) {
            let mut first = true;
            for m in self.members.values().filter(|m| m.live) {
                let d = Datagram::Dead {
                    dead,
                    prober: first,
                };
                first = false;
                self.transmits.push_back((m.addr, d.encode()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn t(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn addr(id: u32) -> SocketAddr {
        SocketAddr::from(([10, 0, 1, id as u8], 9950))
    }

    fn cfg() -> DistributorConfig {
        DistributorConfig {
            heartbeat: Duration::from_millis(200),
            answer: Duration::from_millis(40),
            misses: 3,
            weight_levels: 8,
            silence: Duration::from_millis(20),
            silence_frames: 32,
        }
    }

    fn answer(d: &mut DistributorCore, id: u32, free: u32, now: Instant) {
        let b = Datagram::Answer { seq: 1, id, free }.encode();
        d.handle_datagram(addr(id), &b, now);
    }

    /// Runs heartbeat rounds from `from` to `to`, `alive` answering each.
    fn rounds(d: &mut DistributorCore, from: u64, to: u64, alive: &[u32]) -> u64 {
        let mut now = from;
        while now < to {
            d.tick(t(now));
            while let Some((a, b)) = d.poll_transmit() {
                if let Some(Datagram::Heartbeat { .. }) = Datagram::decode_at_member(&b) {
                    let id = u32::from(
                        a.ip()
                            .to_string()
                            .rsplit('.')
                            .next()
                            .unwrap()
                            .parse::<u8>()
                            .unwrap(),
                    );
                    if alive.contains(&id) {
                        answer(d, id, 1_000_000, t(now + 1));
                    }
                }
            }
            now = d.poll_timeout().as_millis();
        }
        now
    }

    #[test]
    fn members_live_by_answers_and_die_by_misses() {
        let mut d = DistributorCore::new(cfg(), t(0));
        d.set_listed(&[(1, addr(1)), (2, addr(2))].into(), t(0));
        assert!(d.poll_group().is_none() && d.live().is_empty());
        let now = rounds(&mut d, 0, 250, &[1, 2]);
        assert_eq!(d.live(), vec![1, 2]);
        let g = d.poll_group().unwrap();
        assert_eq!(g.members, vec![(1, addr(1), 8), (2, addr(2), 8)]);
        d.group_applied(&g);
        assert!(d.poll_group().is_none());
        // Member 2 stops answering: dead within the bound.
        let died = now;
        let mut now = now;
        while d.live().len() == 2 {
            now = rounds(&mut d, now, now + 1, &[1]);
        }
        assert!(now - died <= cfg().detection_bound().as_millis() as u64);
        let g = d.poll_group().unwrap();
        assert_eq!(g.members, vec![(1, addr(1), 8)]);
        d.group_applied(&g);
        // Member 1 hears of it, as the prober.
        let told: Vec<_> = std::iter::from_fn(|| d.poll_transmit()).collect();
        assert_eq!(
            told,
            vec![(
                addr(1),
                Datagram::Dead {
                    dead: 2,
                    prober: true
                }
                .encode()
            )]
        );
        // Back at its next answer.
        rounds(&mut d, now, now + 250, &[1, 2]);
        assert_eq!(d.live(), vec![1, 2]);
    }

    /// A member gone from the pool is asked at once: one that does not answer (a killed
    /// proxy, whose registration went with it) is dead within the answer time, and no group
    /// is ever empty.
    #[test]
    fn leaving_the_pool_unanswered_is_death_and_no_group_is_empty() {
        let mut d = DistributorCore::new(cfg(), t(0));
        d.set_listed(&[(1, addr(1))].into(), t(0));
        rounds(&mut d, 0, 100, &[1]);
        let g = d.poll_group().unwrap();
        d.group_applied(&g);
        d.set_listed(&BTreeMap::new(), t(100));
        let asked: Vec<_> = std::iter::from_fn(|| d.poll_transmit()).collect();
        assert!(matches!(
            Datagram::decode_at_member(&asked[0].1),
            Some(Datagram::Heartbeat { .. })
        ));
        assert_eq!(d.poll_timeout(), t(140));
        d.tick(t(140));
        assert!(d.live().is_empty());
        assert!(d.poll_group().is_none());
    }

    /// A member gone from the pool that still answers (its registrar was cut off, the
    /// proxy was not) stays in the group; back in the pool, it is as before; gone again and
    /// then silent, it is dead at its first miss.
    #[test]
    fn a_member_that_answers_stays_when_its_registration_fails() {
        let mut d = DistributorCore::new(cfg(), t(0));
        d.set_listed(&[(1, addr(1)), (2, addr(2))].into(), t(0));
        rounds(&mut d, 0, 100, &[1, 2]);
        let g = d.poll_group().unwrap();
        d.group_applied(&g);
        d.set_listed(&[(1, addr(1))].into(), t(100));
        answer(&mut d, 2, 1_000_000, t(101));
        let now = rounds(&mut d, 101, 1000, &[1, 2]);
        assert_eq!(d.live(), vec![1, 2]);
        assert!(d.poll_group().is_none(), "the group is unchanged");
        d.set_listed(&[(1, addr(1)), (2, addr(2))].into(), t(now));
        let now = rounds(&mut d, now, now + 500, &[1, 2]);
        assert_eq!(d.live(), vec![1, 2]);
        d.set_listed(&[(1, addr(1))].into(), t(now));
        let now = rounds(&mut d, now, now + 50, &[1]);
        assert_eq!(d.live(), vec![1], "dead at its first miss once unlisted");
        rounds(&mut d, now, now + 500, &[1, 2]);
        assert_eq!(
            d.live(),
            vec![1],
            "and forgotten: it comes back by the pool"
        );
    }

    #[test]
    fn weights_follow_free_capacity_by_steps_of_two() {
        let mut d = DistributorCore::new(cfg(), t(0));
        d.set_listed(&[(1, addr(1))].into(), t(0));
        answer(&mut d, 1, 1_000_000, t(0));
        assert_eq!(d.poll_group().unwrap().members[0].2, 8);
        answer(&mut d, 1, 900_000, t(1));
        // 1 + 0.9 × 7 = 7.3 → 7: less than 2 away, kept.
        assert_eq!(d.poll_group().unwrap().members[0].2, 8);
        answer(&mut d, 1, 500_000, t(2));
        assert_eq!(d.poll_group().unwrap().members[0].2, 5);
    }

    #[test]
    fn the_watch_finds_a_silent_member() {
        let mut d = DistributorCore::new(cfg(), t(0));
        d.set_listed(&[(1, addr(1))].into(), t(0));
        answer(&mut d, 1, 1_000_000, t(0));
        let c = |to, from| BTreeMap::from([(1, Traffic { to, from })]);
        d.traffic(&c(10, 10), t(5));
        d.traffic(&c(50, 10), t(20));
        assert_eq!(d.live(), vec![1]);
        d.traffic(&c(60, 10), t(26));
        assert!(d.live().is_empty());
    }
}
