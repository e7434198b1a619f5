//! Whether a PE is still believed alive: its one timer (keep-alive or lifetime expiry, paper
//! §3.3) and the signs of life and unreachability reports the registrar records.
//!
//! Why it exists: the [`timer::Wheel`](crate::timer::Wheel) knows only indexes, deadlines and
//! tags; this is where they become PEs and [`TimerKind`]s. The handlespace never acts on a
//! timer itself: [`Handlespace::expire_timers`] hands the due ones to the caller, which sends a
//! keep-alive, or removes the PE.

use crate::{Handlespace, PeRef};

/// The one timer a PE has at any time (paper §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimerKind {
    /// Home registrar: time to send the next ENDPOINT_KEEP_ALIVE.
    KeepAliveTransmission,
    /// Home registrar: the ENDPOINT_KEEP_ALIVE_ACK is overdue at this time.
    KeepAliveTimeout,
    /// Other registrars: the registration life runs out.
    LifetimeExpiry,
}

impl TimerKind {
    fn tag(self) -> u8 {
        self as u8
    }

    fn from_tag(t: u8) -> Self {
        match t {
            0 => Self::KeepAliveTransmission,
            1 => Self::KeepAliveTimeout,
            _ => Self::LifetimeExpiry,
        }
    }
}

impl Handlespace {
    /// Schedules the PE's one timer (replacing any other it had).
    pub fn schedule_timer(&mut self, r: PeRef, kind: TimerKind, deadline: u64) {
        self.timers.schedule(r.0, deadline, kind.tag());
    }

    pub fn cancel_timer(&mut self, r: PeRef) -> bool {
        self.timers.cancel(r.0)
    }

    pub fn timer(&self, r: PeRef) -> Option<(TimerKind, u64)> {
        self.timers
            .get(r.0)
            .map(|(d, t)| (TimerKind::from_tag(t), d))
    }

    /// When to call [`expire_timers`](Self::expire_timers) next: exact for timers due within
    /// the current 64 ms, a lower bound otherwise (see [`timer::Wheel`](crate::timer::Wheel)).
    pub fn next_timer(&self) -> Option<u64> {
        self.timers.next_deadline()
    }

    /// Unschedules and returns every timer due at `now`. The PEs stay; the caller acts.
    pub fn expire_timers(&mut self, now: u64, out: &mut Vec<(PeRef, TimerKind)>) {
        let mut fired = std::mem::take(&mut self.fired);
        fired.clear();
        self.timers.expire(now, &mut fired);
        out.extend(
            fired
                .iter()
                .map(|&(i, t)| (PeRef(i), TimerKind::from_tag(t))),
        );
        self.fired = fired;
    }

    /// Records a sign of life of a PE (e.g. a keep-alive ACK): resets its unreachable reports.
    pub fn touch(&mut self, r: PeRef, now: u64) {
        let e = &mut self.pes[r.0 as usize];
        e.last_heard = now;
        e.unreachable_reports = 0;
    }

    /// Records a keep-alive ACK: the PE's registrar association is alive, but that says nothing
    /// about its reachability from pool users, so the unreachable reports stay.
    pub fn heard(&mut self, r: PeRef, now: u64) {
        self.pes[r.0 as usize].last_heard = now;
    }

    /// Counts an ENDPOINT_UNREACHABLE report; returns the count since the last sign of life.
    pub fn report_unreachable(&mut self, r: PeRef) -> u32 {
        let e = &mut self.pes[r.0 as usize];
        e.unreachable_reports = e.unreachable_reports.saturating_add(1);
        e.unreachable_reports
    }
}
