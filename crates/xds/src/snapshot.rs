//! What the xDS server serves: every pool's resources as the registrar holds them now, and
//! which of them a subscription sees. Both protocols (state of the world in `sotw.rs`,
//! incremental in `delta.rs`) answer from it.

use crate::resources::{Kind, PoolResources};
use envoy_types::pb::google::protobuf::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Every pool as the registrar holds it now.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The registrar serves this handlespace: until then (it synchronises from a mentor at
    /// start, and may lack pools) nothing is sent, lest clients drop what they have.
    pub ready: bool,
    /// Grows with every change; the `version_info` of the responses.
    pub version: u64,
    /// By pool handle: the version at which the pool last changed, and its resources.
    pub pools: BTreeMap<String, (u64, Arc<PoolResources>)>,
}

impl Snapshot {
    /// The resources of `kind` a subscription to `names` sees (`wildcard`: all of them), each
    /// with its version: a pool's endpoints change with it; its cluster, listener and route
    /// depend on its name alone.
    pub fn visible<'a>(
        &'a self,
        kind: Kind,
        names: &BTreeSet<String>,
        wildcard: bool,
    ) -> Vec<(&'a String, u64, &'a Any)> {
        let entry = |(name, (v, r)): (&'a String, &'a (u64, Arc<PoolResources>))| {
            let version = if kind == Kind::Endpoints { *v } else { 0 };
            (name, version, r.get(kind))
        };
        if wildcard {
            self.pools.iter().map(entry).collect()
        } else {
            names
                .iter()
                .filter_map(|n| self.pools.get_key_value(n))
                .map(entry)
                .collect()
        }
    }
}
