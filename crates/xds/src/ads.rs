//! The aggregated discovery service (xDS v3) over gRPC: both protocols, on one port.
//!
//! - State of the world ([`crate::sotw`]): each stream subscribes per resource type (CDS,
//!   EDS, LDS, RDS by type URL) to resource names, or to all of them where the protocol
//!   allows a wildcard (CDS, LDS), and each response of a type carries every resource the
//!   subscription sees, again whenever one of them changes.
//! - Incremental ("delta", [`crate::delta`]): subscriptions change by names added and
//!   removed, and a response carries only the resources that changed and the names of those
//!   that went.
//!
//! The snapshot ([`Snapshot`]) is replaced by its source on each change of the handlespace;
//! each stream compares the versions of what its subscriptions see. A response carries a
//! nonce of its own; a request echoing the latest nonce ACKs it, or NACKs it with an
//! `error_detail` (logged and counted: the client keeps its previous resources). A request
//! echoing an older nonce is stale: its ACK or NACK is ignored.
//!
//! Limits ([`Limits`]): the number of open streams and of resource names a request may carry;
//! an unknown type URL is answered with nothing (and counted), as Envoy's own control planes
//! do.

pub use crate::limits::{Counters, Limits};
pub use crate::snapshot::Snapshot;
use crate::stream::{Protocol, Stream};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

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

    fn stream<P: Protocol>(
        &self,
        requests: Streaming<P::Request>,
        tx: mpsc::Sender<Result<P::Response, Status>>,
    ) -> Stream<P> {
        Stream {
            watches: Default::default(),
            requests,
            tx,
            snapshots: self.snapshots.clone(),
            limits: self.limits,
            counters: self.counters.clone(),
        }
    }

    /// A place for one more stream, or `RESOURCE_EXHAUSTED`.
    fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            self.counters
                .streams_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted("too many xDS streams"));
        };
        self.counters.streams_opened.fetch_add(1, Ordering::Relaxed);
        Ok(permit)
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let permit = self.admit()?;
        let (tx, rx) = mpsc::channel(8);
        let stream = self.stream::<crate::sotw::Sotw>(request.into_inner(), tx);
        tokio::spawn(async move {
            stream.run().await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let permit = self.admit()?;
        let (tx, rx) = mpsc::channel(8);
        let stream = self.stream::<crate::delta::Delta>(request.into_inner(), tx);
        tokio::spawn(async move {
            stream.run().await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
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
