//! When the datapath removes a flow-table entry: one rule, asked by `rserpool_ksplice`'s
//! expiry pass for every entry of the kernel's table and by the simulation's model of that
//! table, so the two cannot drift apart. The rule is the datapath's: one entry per
//! direction, each judged with its reverse (the other direction's entry) when the table
//! still holds it, and the entries of a hand-over in progress too.

use crate::member::PASS;
use std::time::Duration;

/// The datapath's timeouts, and the rule ([`Expiry::expires`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    pub idle: Duration,
    pub closing: Duration,
}

/// One flow-table entry as [`Expiry`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// A FIN passed in its direction.
    pub fin: bool,
    /// Since its last packet (or touch).
    pub quiet: Duration,
}

/// Why an entry goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// A FIN each way, then `closing` without a packet either way: late retransmissions and
    /// the last ACK got through.
    Closed,
    /// No packet for longer than `idle`.
    Idle,
    /// Watched or held for a hand-over that never finished (its proxy died in the middle),
    /// quiet for `closing`.
    Stale,
}

impl Expiry {
    /// Whether `entry` goes, and why. `reverse` is the other direction's entry (`None`: gone
    /// already, which counts as closed and quiet); `handing_over`: the entry is watched or
    /// held, not yet a splice.
    pub fn expires(&self, entry: Seen, reverse: Option<Seen>, handing_over: bool) -> Option<Gone> {
        if handing_over {
            return (entry.quiet > self.closing).then_some(Gone::Stale);
        }
        if entry.quiet > self.idle {
            return Some(Gone::Idle);
        }
        let fin = entry.fin && reverse.is_none_or(|r| r.fin);
        let quiet = entry.quiet > self.closing && reverse.is_none_or(|r| r.quiet > self.closing);
        (fin && quiet).then_some(Gone::Closed)
    }

    /// How often the datapath looks.
    pub fn period(&self) -> Duration {
        PASS.min(self.closing / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_judges_each_entry_with_its_reverse() {
        let x = Expiry {
            idle: Duration::from_secs(10),
            closing: Duration::from_secs(2),
        };
        let seen = |fin, ms| Seen {
            fin,
            quiet: Duration::from_millis(ms),
        };
        // Idle: this entry alone, whatever its reverse does.
        assert_eq!(
            x.expires(seen(false, 10_000), Some(seen(false, 0)), false),
            None
        );
        assert_eq!(
            x.expires(seen(false, 10_001), Some(seen(false, 0)), false),
            Some(Gone::Idle)
        );
        // Closed: a FIN each way and both quiet for `closing`.
        assert_eq!(
            x.expires(seen(true, 3000), Some(seen(false, 3000)), false),
            None
        );
        assert_eq!(
            x.expires(seen(true, 3000), Some(seen(true, 2000)), false),
            None
        );
        assert_eq!(
            x.expires(seen(true, 2001), Some(seen(true, 2001)), false),
            Some(Gone::Closed)
        );
        // A reverse already gone counts as closed and quiet.
        assert_eq!(x.expires(seen(false, 3000), None, false), None);
        assert_eq!(x.expires(seen(true, 2001), None, false), Some(Gone::Closed));
        // A hand-over that never finished goes after `closing`, FIN or not.
        assert_eq!(x.expires(seen(false, 2000), None, true), None);
        assert_eq!(x.expires(seen(false, 2001), None, true), Some(Gone::Stale));
        assert_eq!(x.period(), Duration::from_secs(1));
    }
}
