//! Time as the sans-IO cores see it: an opaque instant, so that no bare number of milliseconds
//! can be taken for a duration or a deadline by mistake.
//!
//! The cores (the registrar's, the pool element's and the pool user's) read no clock: every
//! entry point takes the current [`Instant`]. A socket driver converts from `std::time::Instant`
//! (milliseconds since it started, [`Instant::since`]); a simulation counts its own. Inside, an
//! instant is a count of milliseconds, like the handlespace's timer wheel, so timer arithmetic
//! stays one addition.
//!
//! It lives here, in the codec, because this is the one crate every core already depends on,
//! and it depends on nothing: the registrar and the ASAP library share the type without
//! depending on each other, and one simulation can drive them all on one clock.

use std::ops::Add;
use std::time::Duration;

/// A point in time, in milliseconds from an origin the driver chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// Later than any other instant: a deadline that never comes.
    pub const MAX: Self = Self(u64::MAX);

    /// The instant `ms` milliseconds after the origin.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the origin (the handlespace keeps its timers in these).
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// The instant `t` of a driver whose origin is `epoch` (zero before it).
    pub fn since(epoch: std::time::Instant, t: std::time::Instant) -> Self {
        let ms = t.saturating_duration_since(epoch).as_millis();
        Self(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// The same instant on the clock of a driver whose origin is `epoch`; `None` when it is
    /// too far away to be represented (a deadline that never comes).
    pub fn to_std(self, epoch: std::time::Instant) -> Option<std::time::Instant> {
        epoch.checked_add(Duration::from_millis(self.0))
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Self) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

/// Saturates at [`Instant::MAX`]; sub-millisecond parts are dropped.
impl Add<Duration> for Instant {
    type Output = Self;

    fn add(self, d: Duration) -> Self {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_millis(1_000);
        assert_eq!(t + Duration::from_millis(500), Instant::from_millis(1_500));
        assert_eq!(Instant::MAX + Duration::from_secs(1), Instant::MAX);
        assert_eq!(t + Duration::MAX, Instant::MAX);
        assert_eq!(
            t.saturating_duration_since(Instant::from_millis(400)),
            Duration::from_millis(600)
        );
        assert_eq!(t.saturating_duration_since(Instant::MAX), Duration::ZERO);
    }
}
