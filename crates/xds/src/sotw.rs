//! The state-of-the-world protocol: every response of a type carries every resource its
//! subscription sees, sent again when one of them changes (the protocol is described in
//! `ads.rs`).

use crate::resources::Kind;
use crate::snapshot::Snapshot;
use crate::stream::{Head, Protocol};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use std::collections::BTreeSet;

/// One type's subscription on a stream.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    /// The names asked for; empty (for a wildcard type) or `*`: every resource.
    names: BTreeSet<String>,
    /// The nonce of the latest response.
    nonce: String,
    /// What the latest response held: names and their versions.
    sent: Option<Vec<(String, u64)>>,
}

pub(crate) struct Sotw;

impl Protocol for Sotw {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    type Watch = Watch;

    fn head(req: &DiscoveryRequest) -> Head<'_> {
        Head {
            type_url: &req.type_url,
            nonce: &req.response_nonce,
            error: req.error_detail.as_ref().map(|e| e.message.as_str()),
            node: req.node.as_ref().map(|n| n.id.as_str()),
            names: req.resource_names.len(),
        }
    }

    fn nonce(watch: &Watch) -> &str {
        &watch.nonce
    }

    fn subscribe(watch: &mut Watch, _: Kind, req: DiscoveryRequest, first: bool) -> Option<bool> {
        let names: BTreeSet<String> = req.resource_names.into_iter().collect();
        if names == watch.names && !first {
            return None;
        }
        watch.names = names;
        Some(first)
    }

    /// `kind`'s resources if they changed since the last response (or always, with `force`).
    fn respond(
        watch: &mut Watch,
        kind: Kind,
        snapshot: &Snapshot,
        nonce: &mut u64,
        force: bool,
    ) -> Option<DiscoveryResponse> {
        let all = watch.names.is_empty() && kind.wildcard() || watch.names.contains("*");
        let held = snapshot.visible(kind, &watch.names, all);
        let fingerprint: Vec<(String, u64)> =
            held.iter().map(|(n, v, _)| ((*n).clone(), *v)).collect();
        if !force && watch.sent.as_ref() == Some(&fingerprint) {
            return None;
        }
        *nonce += 1;
        watch.nonce = nonce.to_string();
        watch.sent = Some(fingerprint);
        Some(DiscoveryResponse {
            version_info: snapshot.version.to_string(),
            resources: held.iter().map(|(_, _, r)| (*r).clone()).collect(),
            type_url: kind.type_url(),
            nonce: watch.nonce.clone(),
            ..Default::default()
        })
    }
}
