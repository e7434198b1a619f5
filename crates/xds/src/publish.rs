//! From the registrar's handlespace to the xDS server's snapshots.
//!
//! The registrar calls [`Publisher::update`] after each turn of its loop in which the
//! handlespace changed (the same change count its pool subscriptions follow). Only the pools
//! whose version moved are encoded again; the new snapshot goes to every ADS stream at once
//! (a `watch` channel), and each stream sends what its subscriptions see changed.

use crate::resources::{Member, PoolResources};
use crate::snapshot::Snapshot;
use rserpool_handlespace::Handlespace;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

pub struct Publisher {
    tx: watch::Sender<Arc<Snapshot>>,
    /// The handlespace's change count at the last update.
    seen: Option<u64>,
    version: u64,
    /// Each pool's handlespace version when it was last encoded.
    pool_versions: BTreeMap<String, u64>,
    pools: BTreeMap<String, (u64, Arc<PoolResources>)>,
}

impl Publisher {
    /// A publisher and the receiving end for [`Ads`](crate::ads::Ads).
    pub fn channel() -> (Publisher, watch::Receiver<Arc<Snapshot>>) {
        let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
        (
            Publisher {
                tx,
                seen: None,
                version: 0,
                pool_versions: BTreeMap::new(),
                pools: BTreeMap::new(),
            },
            rx,
        )
    }

    /// Publishes the pools of `hs` if it changed since the last call, once `serving` (the
    /// registrar is past its start-up synchronisation).
    pub fn update(&mut self, hs: &Handlespace, serving: bool) {
        if !serving || self.seen == Some(hs.changes()) {
            return;
        }
        let first = self.seen.is_none();
        self.seen = Some(hs.changes());
        let mut changed = false;
        let mut live: BTreeMap<String, u64> = BTreeMap::new();
        for (handle, _, _) in hs.pools() {
            let Some(v) = hs.pool_version(handle.as_bytes()) else {
                continue;
            };
            let name = handle.to_string();
            live.insert(name.clone(), v);
            if self.pool_versions.get(&name) == Some(&v) {
                continue;
            }
            let mut members: Vec<Member> = hs
                .members(handle.as_bytes())
                .filter_map(|r| Member::of(&hs.pe(r).element))
                .collect();
            members.sort_by_key(|m| m.id);
            if !changed {
                changed = true;
                self.version += 1;
            }
            let adaptive = hs
                .members(handle.as_bytes())
                .next()
                .is_some_and(|r| crate::resources::adaptive(&hs.pe(r).element.policy));
            let resources = Arc::new(PoolResources::new(&name, &members, adaptive));
            self.pools.insert(name.clone(), (self.version, resources));
            self.pool_versions.insert(name, v);
        }
        let before = self.pools.len();
        self.pools.retain(|name, _| live.contains_key(name));
        self.pool_versions.retain(|name, _| live.contains_key(name));
        if self.pools.len() != before && !changed {
            changed = true;
            self.version += 1;
        }
        if changed || first {
            self.tx.send_replace(Arc::new(Snapshot {
                ready: true,
                version: self.version,
                pools: self.pools.clone(),
            }));
        }
    }
}
