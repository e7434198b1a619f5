//! The invariants, checked from outside: every registrar's status (`GET /status`), polled a few
//! times a second, against what the harness knows is alive.
//!
//! A registrar or PE is *live* while its process runs and its host's link is up. For every
//! pair of a live PE and a live registrar the [`Tracker`] measures how long the PE is missing
//! from that registrar's handlespace, counted from when both were live (or from the
//! registrar's previous answer, when the PE was there then): the longest such gap is the
//! soak's "longest time a live PE was missing", and a gap longer than the settle bound is a
//! lost PE. The system has *converged* when every registrar answers, holds exactly the PEs
//! there are, each homed at a live registrar, and agrees with every other registrar on the
//! checksums. Observations are stamped with the poll's start, so that an answer never counts
//! as newer than it is.

use crate::net::fetch_registrar_status;
use rserpool_registrar::Status;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the registrars' statuses are read.
pub const POLL: Duration = Duration::from_millis(200);
/// A status that takes longer counts as no answer (the registrar may be cut off).
const STATUS_TIMEOUT: Duration = Duration::from_secs(1);

/// Whose liveness changes.
#[derive(Clone, Copy, Debug)]
pub enum Who {
    Registrar(usize),
    Pe(usize),
}

/// One registrar or PE as far as liveness goes.
struct Node {
    host: usize,
    running: bool,
    live_since: Option<Instant>,
}

/// A time a live PE was missing from a live registrar.
#[derive(Clone, Debug)]
pub struct Gap {
    pub pe: usize,
    pub registrar: usize,
    /// Since the start of the soak.
    pub from: Duration,
    pub length: Duration,
    /// What was going on when it began.
    pub context: String,
}

struct Open {
    from: Instant,
    context: String,
    lost: bool,
}

pub struct Tracker {
    start: Instant,
    settle: Duration,
    pe_ids: Vec<u32>,
    registrars: Vec<Node>,
    pes: Vec<Node>,
    cut: Vec<bool>,
    /// Per registrar, when its last answer was asked for.
    last_answer: Vec<Option<Instant>>,
    missing: HashMap<(usize, usize), Open>,
    context: String,
    pub longest: Option<Gap>,
    /// Gaps longer than the settle bound.
    pub lost: Vec<Gap>,
    heal_mark: Option<Instant>,
    converged_after_mark: Option<Instant>,
    /// Why the latest observation was not converged.
    pub why_not: String,
}

impl Tracker {
    /// Registrar `r` runs on host `r`; PE `k` (identifier `pe_ids[k]`) on `pe_hosts[k]`.
    pub fn new(
        start: Instant,
        settle: Duration,
        pe_ids: Vec<u32>,
        pe_hosts: &[usize],
        hosts: usize,
    ) -> Tracker {
        let node = |host| Node {
            host,
            running: false,
            live_since: None,
        };
        Tracker {
            start,
            settle,
            registrars: (0..3).map(node).collect(),
            pes: pe_hosts.iter().map(|&h| node(h)).collect(),
            pe_ids,
            cut: vec![false; hosts],
            last_answer: vec![None; 3],
            missing: HashMap::new(),
            context: "setup".into(),
            longest: None,
            lost: Vec::new(),
            heal_mark: None,
            converged_after_mark: None,
            why_not: String::new(),
        }
    }

    /// What is going on, for the gaps that begin from now on.
    pub fn set_context(&mut self, c: String) {
        self.context = c;
    }

    pub fn context(&self) -> String {
        self.context.clone()
    }

    pub fn set_running(&mut self, who: Who, running: bool, now: Instant) {
        match who {
            Who::Registrar(r) => self.registrars[r].running = running,
            Who::Pe(k) => self.pes[k].running = running,
        }
        self.update(now);
    }

    pub fn set_cut(&mut self, host: usize, cut: bool, now: Instant) {
        self.cut[host] = cut;
        self.update(now);
    }

    /// Liveness from the running and cut flags; gaps of nodes that stop being live end now.
    fn update(&mut self, now: Instant) {
        let cut = &self.cut;
        let mut ended = Vec::new();
        for (i, n) in self
            .registrars
            .iter_mut()
            .chain(self.pes.iter_mut())
            .enumerate()
        {
            let live = n.running && !cut[n.host];
            match (live, n.live_since) {
                (true, None) => n.live_since = Some(now),
                (false, Some(_)) => {
                    n.live_since = None;
                    ended.push(i);
                }
                _ => {}
            }
        }
        for i in ended {
            let gone: Vec<(usize, usize)> = self
                .missing
                .keys()
                .filter(|&&(k, r)| if i < 3 { r == i } else { k == i - 3 })
                .copied()
                .collect();
            for key in gone {
                self.close(key, now);
            }
        }
    }

    fn close(&mut self, key: (usize, usize), now: Instant) {
        if let Some(open) = self.missing.remove(&key) {
            let gap = self.gap(key, &open, now);
            if self.longest.as_ref().is_none_or(|g| gap.length > g.length) {
                self.longest = Some(gap);
            }
        }
    }

    fn gap(&self, (pe, registrar): (usize, usize), open: &Open, now: Instant) -> Gap {
        Gap {
            pe,
            registrar,
            from: open.from.saturating_duration_since(self.start),
            length: now.saturating_duration_since(open.from),
            context: open.context.clone(),
        }
    }

    /// From now on, [`Tracker::converged_after_mark`] reports the first converged observation
    /// made at `t` or later.
    pub fn mark(&mut self, t: Instant) {
        self.heal_mark = Some(t);
        self.converged_after_mark = None;
    }

    pub fn converged_after_mark(&self) -> Option<Instant> {
        self.converged_after_mark
    }

    /// One poll, begun at `at`: each registrar's status, or `None` if it did not answer.
    pub fn observe(&mut self, at: Instant, statuses: &[Option<Status>]) {
        for (r, st) in statuses.iter().enumerate() {
            let (Some(st), Some(reg_since)) = (st, self.registrars[r].live_since) else {
                continue;
            };
            let present = watched(st);
            for k in 0..self.pes.len() {
                let Some(pe_since) = self.pes[k].live_since else {
                    continue;
                };
                let expected = pe_since.max(reg_since);
                if expected > at {
                    continue;
                }
                if present.contains(&self.pe_ids[k]) {
                    self.close((k, r), at);
                    continue;
                }
                let from = self.last_answer[r].map_or(expected, |t| t.max(expected));
                let context = self.context.clone();
                let open = self.missing.entry((k, r)).or_insert(Open {
                    from,
                    context,
                    lost: false,
                });
                if !open.lost && at.saturating_duration_since(open.from) > self.settle {
                    open.lost = true;
                    let open = Open {
                        from: open.from,
                        context: open.context.clone(),
                        lost: true,
                    };
                    let gap = self.gap((k, r), &open, at);
                    self.lost.push(gap);
                }
            }
            self.last_answer[r] = Some(at);
        }
        match self.converged(at, statuses) {
            Ok(()) => {
                if self.heal_mark.is_some_and(|m| at >= m) && self.converged_after_mark.is_none() {
                    self.converged_after_mark = Some(at);
                }
            }
            Err(why) => self.why_not = why,
        }
    }

    fn converged(&self, at: Instant, statuses: &[Option<Status>]) -> Result<(), String> {
        let since = |n: &Node| n.live_since.is_some_and(|t| t <= at);
        if let Some(k) = self.pes.iter().position(|n| !since(n)) {
            return Err(format!("PE {} is not live", self.pe_ids[k]));
        }
        let mut live = Vec::new();
        for (r, st) in statuses.iter().enumerate() {
            match st {
                Some(st) if since(&self.registrars[r]) => live.push((r, st)),
                _ => return Err(format!("registrar r{} does not answer", r + 1)),
            }
        }
        let ids: BTreeSet<u32> = live.iter().map(|(_, st)| st.server_id).collect();
        let all: BTreeSet<u32> = self.pe_ids.iter().copied().collect();
        for (r, st) in &live {
            let held = watched(st);
            if held != all {
                let missing: Vec<String> =
                    all.difference(&held).map(|id| format!("{id:#x}")).collect();
                let extra: Vec<String> =
                    held.difference(&all).map(|id| format!("{id:#x}")).collect();
                return Err(format!(
                    "registrar r{} lacks [{}], has extra [{}]",
                    r + 1,
                    missing.join(" "),
                    extra.join(" ")
                ));
            }
            if let Some(pe) = st
                .pools
                .iter()
                .flat_map(|p| &p.pes)
                .find(|e| !ids.contains(&e.home_registrar))
            {
                return Err(format!(
                    "registrar r{}: PE {:#x} homed at {:#x}, not a live registrar",
                    r + 1,
                    pe.id,
                    pe.home_registrar
                ));
            }
            for (o, other) in &live {
                if o == r {
                    continue;
                }
                match st.peers.iter().find(|p| p.id == other.server_id) {
                    None => {
                        return Err(format!("registrar r{} does not know r{}", r + 1, o + 1));
                    }
                    Some(p) if p.checksum_agrees != Some(true) => {
                        return Err(format!(
                            "registrar r{}: checksum of r{} differs",
                            r + 1,
                            o + 1
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// Ends the gaps still open (the soak is over).
    pub fn finish(&mut self, now: Instant) {
        let keys: Vec<_> = self.missing.keys().copied().collect();
        for key in keys {
            self.close(key, now);
        }
    }
}

/// Reads every registrar's status each [`POLL`] into the tracker until `stop` is set.
pub async fn poll(status: Vec<SocketAddr>, tracker: Arc<Mutex<Tracker>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        let answers = statuses(&status).await;
        tracker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(at, &answers);
        tokio::time::sleep_until((at + POLL).into()).await;
    }
}

/// The PEs of a registrar's status whose fate the soak follows: all but the proxy tier's
/// (its servers are never killed, and its proxies come back under new identifiers).
fn watched(st: &Status) -> BTreeSet<u32> {
    st.pools
        .iter()
        .filter(|p| p.handle != super::tier::SERVER_POOL && p.handle != super::tier::PROXY_POOL)
        .flat_map(|p| p.pes.iter().map(|e| e.id))
        .collect()
}

/// Every registrar's status, asked for at once.
async fn statuses(status: &[SocketAddr]) -> Vec<Option<Status>> {
    let tasks: Vec<_> = status
        .iter()
        .map(|&a| {
            tokio::spawn(async move {
                tokio::time::timeout(STATUS_TIMEOUT, fetch_registrar_status(a))
                    .await
                    .ok()
                    .and_then(Result::ok)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.ok().flatten());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rserpool_registrar::status::{Counters, EnrpCounters, PeStatus, PeerStatus, PoolStatus};

    const SETTLE: Duration = Duration::from_secs(5);

    /// A registrar's status holding `pes` (homed at the first registrar), with agreeing
    /// checksums for `peers`.
    fn status(id: u32, pes: &[u32], peers: &[u32]) -> Status {
        Status {
            server_id: id,
            uptime_ms: 0,
            connections: 0,
            pool_elements: pes.len(),
            pools: vec![PoolStatus {
                handle: "P".into(),
                policy: "rr".into(),
                pes: pes
                    .iter()
                    .map(|&id| PeStatus {
                        id,
                        transport: String::new(),
                        policy: "rr".into(),
                        home_registrar: 1,
                        registration_life: 15,
                        ms_since_heard: 0,
                        unreachable_reports: 0,
                        asap_transport: None,
                    })
                    .collect(),
            }],
            counters: Counters::default(),
            peers: peers
                .iter()
                .map(|&p| PeerStatus {
                    id: p,
                    address: String::new(),
                    ms_since_heard: 0,
                    state: "up".into(),
                    connected: true,
                    checksum: Some(0),
                    checksum_agrees: Some(true),
                    pes_owned: 0,
                })
                .collect(),
            enrp: EnrpCounters::default(),
            xds: None,
        }
    }

    /// Three registrars (ids 1, 2, 3, each on its own host) holding `held[r]`; two PEs (ids
    /// 10, 11) on host 3.
    fn poll_of(held: [&[u32]; 3]) -> Vec<Option<Status>> {
        (0..3)
            .map(|r| {
                let peers: Vec<u32> = (1..=3).filter(|&p| p != r as u32 + 1).collect();
                Some(status(r as u32 + 1, held[r], &peers))
            })
            .collect()
    }

    fn all_live(t0: Instant) -> Tracker {
        let mut t = Tracker::new(t0, SETTLE, vec![10, 11], &[3, 3], 4);
        for r in 0..3 {
            t.set_running(Who::Registrar(r), true, t0);
        }
        for k in 0..2 {
            t.set_running(Who::Pe(k), true, t0);
        }
        t
    }

    const BOTH: &[u32] = &[10, 11];

    #[test]
    fn a_pe_missing_for_a_while_is_the_longest_gap_and_not_lost() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut t = all_live(t0);
        t.mark(t0);
        t.observe(s(100), &poll_of([BOTH, BOTH, BOTH]));
        assert_eq!(t.converged_after_mark(), Some(s(100)));
        t.set_context("fault".into());
        // PE 11 drops out of r2 between the polls at 200 and 300, and is back at 1300.
        t.observe(s(200), &poll_of([BOTH, BOTH, BOTH]));
        t.observe(s(300), &poll_of([BOTH, &[10], BOTH]));
        t.mark(s(250));
        t.observe(s(800), &poll_of([BOTH, &[10], BOTH]));
        assert_eq!(t.converged_after_mark(), None);
        assert!(t.why_not.contains("r2 lacks [0xb]"), "{}", t.why_not);
        t.observe(s(1300), &poll_of([BOTH, BOTH, BOTH]));
        assert_eq!(t.converged_after_mark(), Some(s(1300)));
        let g = t.longest.clone().unwrap();
        assert_eq!((g.pe, g.registrar), (1, 1));
        // Counted from the last answer in which it was there.
        assert_eq!(g.length, Duration::from_millis(1100));
        assert_eq!(g.context, "fault");
        assert!(t.lost.is_empty());
    }

    #[test]
    fn a_pe_missing_beyond_the_settle_bound_is_lost_once() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut t = all_live(t0);
        t.observe(s(0), &poll_of([BOTH, BOTH, BOTH]));
        for ms in (200..8000).step_by(200) {
            t.observe(s(ms), &poll_of([BOTH, BOTH, &[11]]));
        }
        assert_eq!(t.lost.len(), 1);
        assert_eq!((t.lost[0].pe, t.lost[0].registrar), (0, 2));
        t.finish(s(8000));
        assert_eq!(t.longest.unwrap().length, Duration::from_millis(8000));
    }

    #[test]
    fn what_is_not_live_is_not_expected_and_a_restart_counts_from_the_start() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut t = all_live(t0);
        t.observe(s(0), &poll_of([BOTH, BOTH, BOTH]));
        // PE 10 killed: gone everywhere, no gap; the host of r3 cut: r3 does not answer.
        t.set_running(Who::Pe(0), false, s(50));
        t.set_cut(2, true, s(50));
        let mut p = poll_of([&[11], &[11], &[11]]);
        p[2] = None;
        for ms in (200..10_000).step_by(200) {
            t.observe(s(ms), &p);
        }
        assert!(t.longest.is_none() && t.lost.is_empty());
        assert!(t.why_not.contains("PE 10 is not live"), "{}", t.why_not);
        // Back: PE 10 restarted at 10,000, registered by 10,400; r3 lacks it until 10,600.
        t.set_running(Who::Pe(0), true, s(10_000));
        t.set_cut(2, false, s(10_000));
        t.observe(s(10_200), &poll_of([&[11], &[11], &[11]]));
        t.observe(s(10_400), &poll_of([BOTH, BOTH, &[11]]));
        t.observe(s(10_600), &poll_of([BOTH, BOTH, BOTH]));
        assert_eq!(t.longest.unwrap().length, Duration::from_millis(600));
    }

    #[test]
    fn converged_needs_agreeing_checksums_and_live_homes() {
        let t0 = Instant::now();
        let mut t = all_live(t0);
        let mut p = poll_of([BOTH, BOTH, BOTH]);
        if let Some(st) = p[1].as_mut() {
            st.peers[0].checksum_agrees = Some(false);
        }
        t.mark(t0);
        t.observe(t0, &p);
        assert_eq!(t.converged_after_mark(), None);
        assert!(t.why_not.contains("checksum"), "{}", t.why_not);
        let mut p = poll_of([BOTH, BOTH, BOTH]);
        if let Some(st) = p[0].as_mut() {
            st.pools[0].pes[0].home_registrar = 9;
        }
        t.observe(t0, &p);
        assert!(t.why_not.contains("homed at 0x9"), "{}", t.why_not);
    }
}
