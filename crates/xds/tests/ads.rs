//! The ADS server over a real socket, against the generated xDS client: subscriptions, pushes on
//! change, ACK and NACK, the wildcard types, and what it refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use rserpool_xds::ads::{Ads, Limits, Snapshot};
use rserpool_xds::resources::{Kind, Member, PoolResources};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tonic::Streaming;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

fn member(id: u32, port: u16, weight: u32) -> Member {
    Member {
        id,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        weight,
    }
}

fn snapshot(version: u64, pools: &[(&str, &[Member])]) -> Arc<Snapshot> {
    let pools: BTreeMap<String, (u64, Arc<PoolResources>)> = pools
        .iter()
        .map(|(h, m)| {
            (
                h.to_string(),
                (version, Arc::new(PoolResources::new(h, m, false))),
            )
        })
        .collect();
    Arc::new(Snapshot {
        ready: true,
        version,
        pools,
    })
}

/// A server on a free port, the sender of its snapshots, and the service (for its counters).
async fn server(
    first: Arc<Snapshot>,
    limits: Limits,
) -> (SocketAddr, watch::Sender<Arc<Snapshot>>, Ads) {
    let (tx, rx) = watch::channel(first);
    let ads = Ads::new(rx, limits);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = ads.clone().into_server();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .serve_with_incoming(svc, tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    (addr, tx, ads)
}

struct Client {
    requests: mpsc::Sender<DiscoveryRequest>,
    responses: Streaming<DiscoveryResponse>,
}

impl Client {
    async fn open(addr: SocketAddr) -> Client {
        let mut c = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (requests, rx) = mpsc::channel(16);
        let responses = c
            .stream_aggregated_resources(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Client {
            requests,
            responses,
        }
    }

    async fn ask(&self, kind: Kind, names: &[&str], ack: Option<&DiscoveryResponse>) {
        self.requests
            .send(DiscoveryRequest {
                type_url: kind.type_url(),
                resource_names: names.iter().map(|n| n.to_string()).collect(),
                version_info: ack.map_or(String::new(), |r| r.version_info.clone()),
                response_nonce: ack.map_or(String::new(), |r| r.nonce.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn next(&mut self) -> DiscoveryResponse {
        tokio::time::timeout(Duration::from_secs(2), self.responses.message())
            .await
            .expect("a response within 2 s")
            .unwrap()
            .expect("the stream is open")
    }

    async fn quiet(&mut self) -> bool {
        tokio::time::timeout(Duration::from_millis(200), self.responses.message())
            .await
            .is_err()
    }
}

#[tokio::test]
async fn clusters_and_endpoints_follow_the_pools() {
    let two = [member(1, 50051, 1), member(2, 50052, 2)];
    let (addr, snapshots, ads) =
        server(snapshot(1, &[("EchoGrpc", &two)]), Limits::default()).await;
    let mut c = Client::open(addr).await;

    // CDS is a wildcard type: no names, every cluster.
    c.ask(Kind::Cluster, &[], None).await;
    let cds = c.next().await;
    assert_eq!(cds.type_url, Kind::Cluster.type_url());
    assert_eq!(cds.version_info, "1");
    let names: Vec<String> = cds
        .resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).unwrap().name)
        .collect();
    assert_eq!(names, ["EchoGrpc"]);
    c.ask(Kind::Cluster, &[], Some(&cds)).await;

    // EDS by name.
    c.ask(Kind::Endpoints, &["EchoGrpc"], None).await;
    let eds = c.next().await;
    let cla = ClusterLoadAssignment::decode(eds.resources[0].value.as_slice()).unwrap();
    assert_eq!(cla.endpoints.len(), 2);
    c.ask(Kind::Endpoints, &["EchoGrpc"], Some(&eds)).await;
    assert!(c.quiet().await, "nothing more until something changes");

    // A PE joins: only the endpoints are pushed again, at once.
    let three = [
        member(1, 50051, 1),
        member(2, 50052, 2),
        member(3, 50053, 4),
    ];
    snapshots
        .send(snapshot(2, &[("EchoGrpc", &three)]))
        .unwrap();
    let pushed = c.next().await;
    assert_eq!(pushed.type_url, Kind::Endpoints.type_url());
    assert_eq!(pushed.version_info, "2");
    let cla = ClusterLoadAssignment::decode(pushed.resources[0].value.as_slice()).unwrap();
    assert_eq!(cla.endpoints.len(), 3);
    assert!(c.quiet().await, "the cluster itself did not change");

    // A NACK is counted, and the stream goes on.
    c.requests
        .send(DiscoveryRequest {
            type_url: Kind::Endpoints.type_url(),
            resource_names: vec!["EchoGrpc".into()],
            version_info: "1".into(),
            response_nonce: pushed.nonce.clone(),
            error_detail: Some(RpcStatus {
                code: 3,
                message: "not for me".into(),
                details: Vec::new(),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    // An unknown type gets no answer.
    c.requests
        .send(DiscoveryRequest {
            type_url: "type.googleapis.com/no.such.Type".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let counters = ads.counters();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while counters.unknown_types.load(Ordering::Relaxed) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "requests not handled"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(counters.nacks.load(Ordering::Relaxed), 1);
    // A new pool appears in CDS.
    snapshots
        .send(snapshot(3, &[("EchoGrpc", &three), ("Other", &two)]))
        .unwrap();
    let mut kinds = Vec::new();
    for _ in 0..2 {
        kinds.push(c.next().await);
    }
    let cds = kinds
        .iter()
        .find(|r| r.type_url == Kind::Cluster.type_url())
        .expect("CDS pushed");
    assert_eq!(cds.resources.len(), 2);
    assert_eq!(counters.unknown_types.load(Ordering::Relaxed), 1);
    assert!(counters.acks.load(Ordering::Relaxed) >= 2);
}

#[tokio::test]
async fn too_many_names_or_streams_are_refused() {
    let (addr, _snapshots, ads) = server(
        snapshot(1, &[]),
        Limits {
            max_streams: 2,
            max_names: 3,
        },
    )
    .await;
    let mut c = Client::open(addr).await;
    c.ask(Kind::Endpoints, &["a", "b", "c", "d"], None).await;
    let e = tokio::time::timeout(Duration::from_secs(2), c.responses.message())
        .await
        .unwrap()
        .expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // Two streams are held open; the third is refused.
    let a = Client::open(addr).await;
    let b = Client::open(addr).await;
    a.ask(Kind::Cluster, &[], None).await;
    b.ask(Kind::Cluster, &[], None).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ads.open_streams(), 2);
    let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (_tx, rx) = mpsc::channel::<DiscoveryRequest>(1);
    let third = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect_err("a third stream is refused");
    assert_eq!(third.code(), tonic::Code::ResourceExhausted);
}

/// The incremental protocol: only what changed, and the names of what went.
#[tokio::test]
async fn delta_sends_changes_and_removals_only() {
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    };
    let two = [member(1, 50051, 1), member(2, 50052, 2)];
    let (addr, snapshots, _ads) =
        server(snapshot(1, &[("A", &two), ("B", &two)]), Limits::default()).await;
    let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(8);
    let mut responses = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut step = 0;
    let mut next = async || -> DeltaDiscoveryResponse {
        step += 1;
        tokio::time::timeout(Duration::from_secs(2), responses.message())
            .await
            .unwrap_or_else(|_| panic!("no response {step} within 2 s"))
            .unwrap()
            .expect("the stream is open")
    };
    let names = |r: &DeltaDiscoveryResponse| -> Vec<String> {
        r.resources.iter().map(|r| r.name.clone()).collect()
    };
    let ack = |r: &DeltaDiscoveryResponse| DeltaDiscoveryRequest {
        type_url: r.type_url.clone(),
        response_nonce: r.nonce.clone(),
        ..Default::default()
    };

    // EDS by name: A is there, Nope is not (told as removed).
    tx.send(DeltaDiscoveryRequest {
        type_url: Kind::Endpoints.type_url(),
        resource_names_subscribe: vec!["A".into(), "Nope".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let r = next().await;
    assert_eq!(names(&r), ["A"]);
    assert_eq!(r.removed_resources, ["Nope"]);
    tx.send(ack(&r)).await.unwrap();

    // B changes: nothing for this stream. A changes: A alone.
    snapshots
        .send(Arc::new(Snapshot {
            ready: true,
            version: 2,
            pools: [
                (
                    "A".to_string(),
                    (1, Arc::new(PoolResources::new("A", &two, false))),
                ),
                (
                    "B".to_string(),
                    (2, Arc::new(PoolResources::new("B", &two[..1], false))),
                ),
            ]
            .into(),
        }))
        .unwrap();
    snapshots
        .send(Arc::new(Snapshot {
            ready: true,
            version: 3,
            pools: [
                (
                    "A".to_string(),
                    (3, Arc::new(PoolResources::new("A", &two[..1], false))),
                ),
                (
                    "B".to_string(),
                    (2, Arc::new(PoolResources::new("B", &two[..1], false))),
                ),
            ]
            .into(),
        }))
        .unwrap();
    let r = next().await;
    assert_eq!(names(&r), ["A"]);
    assert!(r.removed_resources.is_empty());
    let cla =
        ClusterLoadAssignment::decode(r.resources[0].resource.as_ref().unwrap().value.as_slice())
            .unwrap();
    assert_eq!(cla.endpoints.len(), 1);
    tx.send(ack(&r)).await.unwrap();

    // A goes: its name comes back as removed.
    snapshots.send(snapshot(4, &[("B", &two[..1])])).unwrap();
    let r = next().await;
    assert!(r.resources.is_empty());
    assert_eq!(r.removed_resources, ["A"]);
    tx.send(ack(&r)).await.unwrap();

    // CDS, a wildcard type: every cluster at first, then only a new one.
    tx.send(DeltaDiscoveryRequest {
        type_url: Kind::Cluster.type_url(),
        ..Default::default()
    })
    .await
    .unwrap();
    let r = next().await;
    assert_eq!(names(&r), ["B"]);
    tx.send(ack(&r)).await.unwrap();
    snapshots
        .send(snapshot(5, &[("B", &two[..1]), ("C", &two)]))
        .unwrap();
    // (The endpoints subscription, to A and Nope, sees no change.)
    let cds = next().await;
    assert_eq!(cds.type_url, Kind::Cluster.type_url());
    assert_eq!(names(&cds), ["C"], "only the new cluster");
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Thousands of idle streams and a client that rejects everything, thousands of times: the
/// others are still served, and an idle stream costs little.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_and_a_nack_storm_leave_the_others_served() {
    let two = [member(1, 50051, 1), member(2, 50052, 2)];
    let (addr, snapshots, ads) = server(snapshot(1, &[("A", &two)]), Limits::default()).await;
    let before = rss_kb();
    const IDLE: usize = 2_000;
    let mut idle = Vec::new();
    for _ in 0..IDLE / 100 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        for _ in 0..100 {
            let mut c = AggregatedDiscoveryServiceClient::new(channel.clone());
            let (tx, rx) = mpsc::channel(1);
            tx.send(DiscoveryRequest {
                type_url: Kind::Cluster.type_url(),
                ..Default::default()
            })
            .await
            .unwrap();
            let responses = c
                .stream_aggregated_resources(ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            idle.push((tx, responses));
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ads.open_streams() < IDLE {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} streams",
            ads.open_streams()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let per_stream = (rss_kb().saturating_sub(before)) * 1024 / IDLE as u64;
    eprintln!("{IDLE} idle streams: {per_stream} bytes each (client and server)");
    assert!(per_stream < 64 << 10, "{per_stream} bytes per idle stream");

    // A client NACKs the same response a thousand times.
    let mut storm = Client::open(addr).await;
    storm.ask(Kind::Endpoints, &["A"], None).await;
    let r = storm.next().await;
    for _ in 0..1_000 {
        storm
            .requests
            .send(DiscoveryRequest {
                type_url: Kind::Endpoints.type_url(),
                resource_names: vec!["A".into()],
                response_nonce: r.nonce.clone(),
                error_detail: Some(RpcStatus {
                    code: 3,
                    message: "no".into(),
                    details: Vec::new(),
                }),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    // Another client is served meanwhile, and a change still reaches it.
    let mut c = Client::open(addr).await;
    c.ask(Kind::Endpoints, &["A"], None).await;
    let first = c.next().await;
    assert_eq!(first.resources.len(), 1);
    c.ask(Kind::Endpoints, &["A"], Some(&first)).await;
    // Every NACK is read and counted. (Only then the change: it gives the storm a new nonce,
    // and a NACK still unread would be stale and rightly not counted.)
    let counters = ads.counters();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while counters.nacks.load(Ordering::Relaxed) < 1_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "NACKs not all read: {}",
            counters.nacks.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    snapshots.send(snapshot(2, &[("A", &two[..1])])).unwrap();
    let pushed = c.next().await;
    assert_eq!(pushed.version_info, "2");
    drop(idle);
}

/// While the registrar synchronises at start (its handlespace may lack pools) a subscription
/// gets nothing; once it serves, the subscription is answered.
#[tokio::test]
async fn nothing_is_sent_before_the_registrar_serves() {
    let two = [member(1, 50051, 1), member(2, 50052, 2)];
    let (addr, snapshots, _ads) = server(Arc::new(Snapshot::default()), Limits::default()).await;
    let mut c = Client::open(addr).await;
    c.ask(Kind::Cluster, &[], None).await;
    assert!(c.quiet().await, "no answer before the registrar serves");
    snapshots.send(snapshot(1, &[("A", &two)])).unwrap();
    let cds = c.next().await;
    assert_eq!(cds.resources.len(), 1);
}
