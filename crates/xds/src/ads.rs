//! The aggregated discovery service (xDS v3, state of the world) over gRPC.
//!
//! Each stream subscribes per resource type (CDS, EDS, LDS, RDS by type URL) to resource names,
//! or to all of them where the protocol allows a wildcard (CDS, LDS). The server answers each
//! subscription with every resource it names, then again whenever one of them changes: the
//! snapshot ([`Snapshot`]) is replaced by its source on each change of the handlespace, and
//! each stream compares the versions of the pools it watches. A response carries the
//! snapshot's version and a nonce of its own; a request echoing the latest nonce ACKs it, or
//! NACKs it with an `error_detail` (logged and counted: the client keeps its previous
//! resources). A request echoing an older nonce is stale and ignored, as the protocol says.
//!
//! Limits: the number of open streams and of resource names a request may carry; an unknown
//! type URL is answered with nothing (and counted), as Envoy's own control planes do.

use crate::resources::{Kind, PoolResources};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Semaphore, mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

/// Every pool as the registrar holds it now.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Grows with every change; the `version_info` of the responses.
    pub version: u64,
    /// By pool handle: the version at which the pool last changed, and its resources.
    pub pools: BTreeMap<String, (u64, Arc<PoolResources>)>,
}

/// How much one server takes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_streams: usize,
    /// Resource names one request may name.
    pub max_names: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_streams: 10_000,
            max_names: 10_000,
        }
    }
}

/// What the server did, for the registrar's status and metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub streams_opened: AtomicU64,
    pub streams_refused: AtomicU64,
    pub responses: AtomicU64,
    pub acks: AtomicU64,
    pub nacks: AtomicU64,
    pub unknown_types: AtomicU64,
}

/// The service: clone it into a tonic server with [`Ads::into_server`].
#[derive(Clone)]
pub struct Ads {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    limits: Limits,
    streams: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl Ads {
    pub fn new(snapshots: watch::Receiver<Arc<Snapshot>>, limits: Limits) -> Ads {
        Ads {
            snapshots,
            streams: Arc::new(Semaphore::new(limits.max_streams)),
            limits,
            counters: Arc::default(),
        }
    }

    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.limits.max_streams - self.streams.available_permits()
    }

    pub fn into_server(self) -> AggregatedDiscoveryServiceServer<Ads> {
        AggregatedDiscoveryServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            self.counters
                .streams_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted("too many xDS streams"));
        };
        self.counters.streams_opened.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(8);
        let stream = StreamState {
            requests: request.into_inner(),
            tx,
            snapshots: self.snapshots.clone(),
            limits: self.limits,
            counters: self.counters.clone(),
            watches: HashMap::new(),
            nonce: 0,
            node: String::new(),
        };
        tokio::spawn(async move {
            stream.run().await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "incremental xDS is not served yet: use the state-of-the-world protocol",
        ))
    }
}

/// One type's subscription on a stream.
#[derive(Debug, Default)]
struct Watch {
    /// The names asked for; empty (for a wildcard type) or `*`: every resource.
    names: BTreeSet<String>,
    /// The nonce of the latest response.
    nonce: String,
    /// What the latest response held: names and their pools' versions.
    sent: Option<Vec<(String, u64)>>,
}

struct StreamState {
    requests: Streaming<DiscoveryRequest>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    limits: Limits,
    counters: Arc<Counters>,
    watches: HashMap<Kind, Watch>,
    nonce: u64,
    /// The client's node ID, for log lines.
    node: String,
}

impl StreamState {
    async fn run(mut self) {
        loop {
            tokio::select! {
                m = self.requests.message() => match m {
                    Ok(Some(req)) => {
                        if let Err(status) = self.on_request(req).await {
                            let _ = self.tx.send(Err(status)).await;
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        debug!("xDS stream of {:?} ended: {e}", self.node);
                        return;
                    }
                },
                changed = self.snapshots.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let kinds: Vec<Kind> = self.watches.keys().copied().collect();
                    for kind in kinds {
                        if self.respond(kind, false).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }

    async fn on_request(&mut self, req: DiscoveryRequest) -> Result<(), Status> {
        if let Some(node) = &req.node
            && self.node.is_empty()
        {
            self.node = node.id.clone();
        }
        let Some(kind) = Kind::from_type_url(&req.type_url) else {
            if self.counters.unknown_types.fetch_add(1, Ordering::Relaxed) == 0 {
                info!(
                    "xDS: {:?} asked for type {:?}, which this server does not serve (logged once)",
                    self.node, req.type_url
                );
            }
            return Ok(());
        };
        if req.resource_names.len() > self.limits.max_names {
            return Err(Status::invalid_argument(format!(
                "{} resource names in one request, more than {}",
                req.resource_names.len(),
                self.limits.max_names
            )));
        }
        let watch = self.watches.entry(kind).or_default();
        if !req.response_nonce.is_empty() {
            if req.response_nonce != watch.nonce {
                // Stale: an answer to a response superseded since.
                return Ok(());
            }
            match &req.error_detail {
                Some(e) => {
                    self.counters.nacks.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        "xDS: {:?} rejected {} version {}: {}",
                        self.node, req.type_url, req.version_info, e.message
                    );
                }
                None => {
                    self.counters.acks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let names: BTreeSet<String> = req.resource_names.into_iter().collect();
        let first = watch.sent.is_none();
        if names != watch.names || first {
            watch.names = names;
            self.respond(kind, first).await?;
        }
        Ok(())
    }

    /// Sends `kind`'s resources if they changed since the last response (or always, with
    /// `force`).
    async fn respond(&mut self, kind: Kind, force: bool) -> Result<(), Status> {
        let snapshot = self.snapshots.borrow_and_update().clone();
        let Some(watch) = self.watches.get_mut(&kind) else {
            return Ok(());
        };
        let all = watch.names.is_empty() && kind.wildcard() || watch.names.contains("*");
        let held: Vec<(&String, &(u64, Arc<PoolResources>))> = if all {
            snapshot.pools.iter().collect()
        } else {
            watch
                .names
                .iter()
                .filter_map(|n| snapshot.pools.get_key_value(n))
                .collect()
        };
        // Only a pool's endpoints change with it; its cluster, listener and route depend on
        // its name alone.
        let fingerprint: Vec<(String, u64)> = held
            .iter()
            .map(|(n, (v, _))| ((*n).clone(), if kind == Kind::Endpoints { *v } else { 0 }))
            .collect();
        if !force && watch.sent.as_ref() == Some(&fingerprint) {
            return Ok(());
        }
        self.nonce += 1;
        watch.nonce = self.nonce.to_string();
        watch.sent = Some(fingerprint);
        let response = DiscoveryResponse {
            version_info: snapshot.version.to_string(),
            resources: held.iter().map(|(_, (_, r))| r.get(kind).clone()).collect(),
            type_url: kind.type_url(),
            nonce: watch.nonce.clone(),
            ..Default::default()
        };
        self.counters.responses.fetch_add(1, Ordering::Relaxed);
        self.tx
            .send(Ok(response))
            .await
            .map_err(|_| Status::cancelled("the client went away"))
    }
}

/// Serves ADS on `listener` until the snapshots' sender is gone or the server fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    ads: Ads,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .serve_with_incoming(
            ads.into_server(),
            tonic::transport::server::TcpIncoming::from(listener),
        )
        .await
}
