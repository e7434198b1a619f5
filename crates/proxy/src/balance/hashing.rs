//! The table a hashing selection (`select = "maglev"` or `"ring-hash"`) looks a request's key
//! up in (the keys are in `keys.rs`), and how many keys move when a PE leaves.

use crate::balance::keys::mix;
use crate::balance::maglev::Maglev;
use crate::balance::ring::RingHash;
use crate::config::Select;

/// Which table a hashing selection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Maglev,
    Ring,
}

/// A hashing selection's table over the pool's PEs.
#[derive(Debug, Clone)]
pub(crate) enum Table {
    Maglev(Maglev),
    Ring(RingHash),
}

impl Kind {
    /// The table of a hashing selection, if `select` is one.
    pub(crate) fn of(select: Select) -> Option<Self> {
        match select {
            Select::Maglev => Some(Self::Maglev),
            Select::RingHash => Some(Self::Ring),
            _ => None,
        }
    }
}

impl Table {
    pub(crate) fn new(kind: Kind, ids: &[u32]) -> Self {
        match kind {
            Kind::Maglev => Self::Maglev(Maglev::new(ids)),
            Kind::Ring => Self::Ring(RingHash::new(ids)),
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        match self {
            Self::Maglev(_) => Kind::Maglev,
            Self::Ring(_) => Kind::Ring,
        }
    }

    /// The PEs for `key`, its own first, then where it goes while that one cannot take it.
    pub(crate) fn lookup(&self, key: u64) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Self::Maglev(t) => Box::new(t.lookup(key)),
            Self::Ring(t) => Box::new(t.lookup(key)),
        }
    }
}

/// The share of `keys` keys whose PE changes when one of `pes` PEs leaves, for the hashing
/// selection `select` (`None` if it is not one): the mean and the largest over which PE
/// leaves. For the trace benchmark's disruption table.
#[doc(hidden)]
pub fn key_movement(select: Select, pes: u32, keys: u64) -> Option<(f64, f64)> {
    let kind = Kind::of(select)?;
    // Identifiers as registrars hand them out: arbitrary 32-bit numbers.
    let ids: Vec<u32> = (1..=u64::from(pes)).map(|i| mix(i) as u32).collect();
    let owner = |t: &Table, k: u64| t.lookup(mix(k ^ 0x6b65_7973)).next();
    let all = Table::new(kind, &ids);
    let before: Vec<Option<u32>> = (0..keys).map(|k| owner(&all, k)).collect();
    let mut shares = Vec::new();
    for gone in &ids {
        let rest: Vec<u32> = ids.iter().copied().filter(|i| i != gone).collect();
        let t = Table::new(kind, &rest);
        let moved = (0..keys)
            .filter(|&k| owner(&t, k) != before[k as usize])
            .count();
        shares.push(moved as f64 / keys.max(1) as f64);
    }
    let mean = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
    Some((mean, shares.iter().copied().fold(0.0, f64::max)))
}
