//! One ADS stream in the incremental ("delta") protocol: a subscription grows and shrinks by
//! names, and a response carries only the resources that changed since the client last had
//! them, and the names of those that went (`removed_resources`).
//!
//! Per type the stream remembers what the client holds (name → version, from the responses it
//! sent and the `initial_resource_versions` a reconnecting client names). A subscribed name
//! with no resource is listed as removed once, so that the client stops waiting for it. CDS
//! and LDS subscribe to everything when the first request names nothing (or `*`).

use crate::resources::Kind;
use crate::snapshot::Snapshot;
use crate::stream::{Head, Protocol};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use std::collections::{BTreeMap, BTreeSet};

/// One type's subscription.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    names: BTreeSet<String>,
    wildcard: bool,
    /// What the client holds: name → version.
    held: BTreeMap<String, String>,
    /// Subscribed names already told to be absent.
    told_absent: BTreeSet<String>,
    /// The nonce of the latest response.
    nonce: String,
}

pub(crate) struct Delta;

impl Protocol for Delta {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    type Watch = Watch;

    fn head(req: &DeltaDiscoveryRequest) -> Head<'_> {
        Head {
            type_url: &req.type_url,
            nonce: &req.response_nonce,
            error: req.error_detail.as_ref().map(|e| e.message.as_str()),
            node: req.node.as_ref().map(|n| n.id.as_str()),
            names: req.resource_names_subscribe.len()
                + req.resource_names_unsubscribe.len()
                + req.initial_resource_versions.len(),
        }
    }

    fn nonce(watch: &Watch) -> &str {
        &watch.nonce
    }

    fn subscribe(
        watch: &mut Watch,
        kind: Kind,
        req: DeltaDiscoveryRequest,
        first: bool,
    ) -> Option<bool> {
        if first {
            watch.held = req.initial_resource_versions.into_iter().collect();
            watch.wildcard = kind.wildcard() && req.resource_names_subscribe.is_empty();
        }
        let mut changed = first;
        for name in req.resource_names_subscribe {
            if name == "*" {
                changed |= !std::mem::replace(&mut watch.wildcard, true);
            } else {
                changed |= watch.names.insert(name);
            }
        }
        for name in req.resource_names_unsubscribe {
            if name == "*" {
                watch.wildcard = false;
            }
            watch.names.remove(&name);
            watch.held.remove(&name);
            watch.told_absent.remove(&name);
        }
        changed.then_some(first)
    }

    /// `kind`'s changes since what the client holds (always, with `force`, even if none).
    fn respond(
        watch: &mut Watch,
        kind: Kind,
        snapshot: &Snapshot,
        nonce: &mut u64,
        force: bool,
    ) -> Option<DeltaDiscoveryResponse> {
        let visible = snapshot.visible(kind, &watch.names, watch.wildcard);
        let mut resources = Vec::new();
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        for (name, version, any) in &visible {
            seen.insert(name.as_str());
            let version = version.to_string();
            if watch.held.get(*name) != Some(&version) {
                watch.held.insert((*name).clone(), version.clone());
                resources.push(Resource {
                    name: (*name).clone(),
                    version,
                    resource: Some((*any).clone()),
                    ..Default::default()
                });
            }
        }
        let mut removed: Vec<String> = watch
            .held
            .keys()
            .filter(|n| !seen.contains(n.as_str()))
            .cloned()
            .collect();
        for name in &removed {
            watch.held.remove(name);
            if watch.names.contains(name) {
                watch.told_absent.insert(name.clone());
            }
        }
        for name in &watch.names {
            if !seen.contains(name.as_str())
                && !removed.contains(name)
                && watch.told_absent.insert(name.clone())
            {
                removed.push(name.clone());
            }
        }
        watch.told_absent.retain(|n| !seen.contains(n.as_str()));
        if resources.is_empty() && removed.is_empty() && !force {
            return None;
        }
        *nonce += 1;
        watch.nonce = nonce.to_string();
        Some(DeltaDiscoveryResponse {
            system_version_info: snapshot.version.to_string(),
            resources,
            type_url: kind.type_url(),
            removed_resources: removed,
            nonce: watch.nonce.clone(),
            ..Default::default()
        })
    }
}
