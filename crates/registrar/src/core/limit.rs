//! Rate limits against misbehaving peers: a token bucket for requests per connection, and a
//! limiter for log lines so that a flood of bad input does not become a flood of log.

use super::Instant;
use tracing::warn;

/// Refills at `rate` tokens per second up to a burst of `rate`; 0 = unlimited.
#[derive(Debug, Clone, Copy)]
pub(super) struct TokenBucket {
    milli_tokens: u64,
    last: Instant,
}

impl TokenBucket {
    pub(super) fn full(rate: u32, now: Instant) -> Self {
        Self {
            milli_tokens: u64::from(rate) * 1000,
            last: now,
        }
    }

    pub(super) fn take(&mut self, rate: u32, now: Instant) -> bool {
        if rate == 0 {
            return true;
        }
        let cap = u64::from(rate) * 1000;
        let refill = now
            .as_millis()
            .saturating_sub(self.last.as_millis())
            .saturating_mul(u64::from(rate));
        self.milli_tokens = self.milli_tokens.saturating_add(refill).min(cap);
        self.last = now;
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            true
        } else {
            false
        }
    }
}

/// At most [`LogLimiter::LINES`] lines per window, then one line saying how many were dropped:
/// a misbehaving peer must not flood the log.
#[derive(Debug, Default)]
pub(super) struct LogLimiter {
    window_start: Instant,
    lines: u32,
    suppressed: u64,
}

impl LogLimiter {
    const WINDOW_MS: u64 = 10_000;
    const LINES: u32 = 20;

    pub(super) fn allow(&mut self, now: Instant) -> bool {
        if now
            .as_millis()
            .saturating_sub(self.window_start.as_millis())
            >= Self::WINDOW_MS
        {
            if self.suppressed > 0 {
                warn!(
                    "{} similar log lines suppressed in the last {} s",
                    self.suppressed,
                    Self::WINDOW_MS / 1000
                );
            }
            self.window_start = now;
            self.lines = 0;
            self.suppressed = 0;
        }
        if self.lines < Self::LINES {
            self.lines += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}
