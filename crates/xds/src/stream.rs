//! One ADS stream, whichever protocol: reading requests, the checks every request gets (its
//! type, its size, whether it ACKs or NACKs the latest response or is stale), and sending
//! what the protocol answers, to a request or to a change of the snapshot.

use crate::limits::{Counters, Limits};
use crate::resources::Kind;
use crate::snapshot::Snapshot;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

/// What the common checks need of a request.
pub(crate) struct Head<'a> {
    pub type_url: &'a str,
    /// The nonce of the response it answers ("" for none).
    pub nonce: &'a str,
    /// A NACK's message.
    pub error: Option<&'a str>,
    pub node: Option<&'a str>,
    /// Resource names it carries, in all.
    pub names: usize,
}

/// What a protocol (state of the world, incremental) decides, for one type's subscription
/// on a stream (its `Watch`).
pub(crate) trait Protocol: Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    type Response: Send + 'static;
    type Watch: Default + Send;

    fn head(req: &Self::Request) -> Head<'_>;

    /// The nonce of the watch's latest response ("" before any).
    fn nonce(watch: &Self::Watch) -> &str;

    /// A request that is not a stale answer changes the subscription (`first`: the type's
    /// first request on the stream); `Some(force)` when it calls for a response (`force`: even
    /// one with nothing new).
    fn subscribe(
        watch: &mut Self::Watch,
        kind: Kind,
        req: Self::Request,
        first: bool,
    ) -> Option<bool>;

    /// The response the subscription calls for now, if any; `nonce` is the stream's counter.
    fn respond(
        watch: &mut Self::Watch,
        kind: Kind,
        snapshot: &Snapshot,
        nonce: &mut u64,
        force: bool,
    ) -> Option<Self::Response>;
}

pub(crate) struct Stream<P: Protocol> {
    pub watches: HashMap<Kind, P::Watch>,
    pub requests: Streaming<P::Request>,
    pub tx: mpsc::Sender<Result<P::Response, Status>>,
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    pub limits: Limits,
    pub counters: Arc<Counters>,
}

impl<P: Protocol> Stream<P> {
    pub(crate) async fn run(mut self) {
        let mut nonce = 0u64;
        // The client's node ID, for log lines.
        let mut node = String::new();
        loop {
            let out = tokio::select! {
                m = self.requests.message() => match m {
                    Ok(Some(req)) => match self.check(&req, &mut node) {
                        Ok(Some(kind)) => {
                            // Not `borrow_and_update`: a change that came meanwhile must
                            // still wake the other subscriptions.
                            let snapshot = self.snapshots.borrow().clone();
                            let first = !self.watches.contains_key(&kind);
                            let watch = self.watches.entry(kind).or_default();
                            // Not ready: the subscription is noted, and answered once it is.
                            P::subscribe(watch, kind, req, first)
                                .filter(|_| snapshot.ready)
                                .and_then(|force| P::respond(watch, kind, &snapshot, &mut nonce, force))
                                .into_iter()
                                .collect()
                        }
                        Ok(None) => Vec::new(),
                        Err(status) => {
                            let _ = self.tx.send(Err(status)).await;
                            return;
                        }
                    },
                    Ok(None) => return,
                    Err(e) => {
                        debug!("xDS stream of {node:?} ended: {e}");
                        return;
                    }
                },
                changed = self.snapshots.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let snapshot = self.snapshots.borrow_and_update().clone();
                    if !snapshot.ready {
                        continue;
                    }
                    self.watches
                        .iter_mut()
                        .filter_map(|(kind, w)| P::respond(w, *kind, &snapshot, &mut nonce, false))
                        .collect::<Vec<_>>()
                }
            };
            for response in out {
                self.counters.responses.fetch_add(1, Ordering::Relaxed);
                if self.tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        }
    }

    /// The request's type, or `None` for one to ignore (an unknown type, a stale answer); an
    /// error ends the stream.
    fn check(&self, req: &P::Request, node: &mut String) -> Result<Option<Kind>, Status> {
        let head = P::head(req);
        if let Some(n) = head.node
            && node.is_empty()
        {
            *node = n.to_string();
        }
        let Some(kind) = Kind::from_type_url(head.type_url) else {
            if self.counters.unknown_types.fetch_add(1, Ordering::Relaxed) == 0 {
                info!(
                    "xDS: {node:?} asked for type {:?}, which this server does not serve (logged once)",
                    head.type_url
                );
            }
            return Ok(None);
        };
        if head.names > self.limits.max_names {
            return Err(Status::invalid_argument(format!(
                "{} resource names in one request, more than {}",
                head.names, self.limits.max_names
            )));
        }
        if !head.nonce.is_empty() {
            if Some(head.nonce) != self.watches.get(&kind).map(P::nonce) {
                // Stale: an answer to a response superseded since.
                return Ok(None);
            }
            match head.error {
                Some(e) => {
                    let n = self.counters.nacks.fetch_add(1, Ordering::Relaxed) + 1;
                    if self.counters.may_log_nack() {
                        warn!(
                            "xDS: {node:?} rejected {}: {e} ({n} rejections in all, at most one logged a second)",
                            head.type_url
                        );
                    }
                }
                None => {
                    self.counters.acks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(Some(kind))
    }
}
