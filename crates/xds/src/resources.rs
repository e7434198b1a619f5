//! A pool as xDS resources: what Envoy and a proxyless gRPC client need to reach its PEs.
//!
//! | RSerPool | xDS |
//! |---|---|
//! | pool handle | a `Cluster` (EDS, over ADS) and its `ClusterLoadAssignment`, both named after the handle; for gRPC an API `Listener` and a `RouteConfiguration` of that name routing every call to the cluster |
//! | pool element | an endpoint of the assignment at its user transport address, in a locality of its own (`sub_zone` = its PE ID) |
//! | policy information | the endpoint's and its locality's `load_balancing_weight`: a weighted policy's weight, the free share of a load (1–101), the credits |
//! | pool policy | `lb_policy: ROUND_ROBIN` over those weights (the one policy every xDS client honours; gRPC picks a locality by weight, Envoy an endpoint by weight), and for clients that read the typed policy list (`load_balancing_policy`: Envoy) least request first where the policy adapts to load or credits, then round robin |
//!
//! A PE is in the assignment while the registrar holds it: the registrar's supervision
//! (keep-alives, ENDPOINT_UNREACHABLE) removes a dead one, so every endpoint sent is `HEALTHY`.

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster, LoadBalancingPolicy, cluster, load_balancing_policy,
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, HealthStatus, Locality,
    SocketAddress, TypedExtensionConfig, address, config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::load_balancing_policies::least_request::v3::LeastRequest;
use envoy_types::pb::envoy::extensions::load_balancing_policies::round_robin::v3::RoundRobin;
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use prost::{Message, Name};
use rserpool_wire::{Policy, PoolElement, UserTransport};
use std::net::SocketAddr;

/// The four resource types of xDS this server answers, by their type URLs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Cluster,
    Endpoints,
    Listener,
    Route,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Cluster, Kind::Endpoints, Kind::Listener, Kind::Route];

    pub fn type_url(self) -> String {
        match self {
            Kind::Cluster => Cluster::type_url(),
            Kind::Endpoints => ClusterLoadAssignment::type_url(),
            Kind::Listener => Listener::type_url(),
            Kind::Route => RouteConfiguration::type_url(),
        }
    }

    pub fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.type_url() == url)
    }

    /// Whether a request naming no resource asks for all of them (LDS and CDS, the xDS
    /// protocol's "wildcard" types); EDS and RDS ask by name.
    pub fn wildcard(self) -> bool {
        matches!(self, Kind::Cluster | Kind::Listener)
    }
}

/// One PE as an endpoint: where its users reach it, and its weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u32,
    pub addr: SocketAddr,
    pub weight: u32,
}

impl Member {
    /// The endpoint of a PE; `None` for a PE without a socket address (an opaque transport).
    pub fn of(pe: &PoolElement) -> Option<Member> {
        let UserTransport::Address(t) = &pe.user_transport else {
            return None;
        };
        let addr = t.socket_addrs().next()?;
        Some(Member {
            id: pe.id,
            addr,
            weight: weight(&pe.policy),
        })
    }
}

/// A PE's `load_balancing_weight` (xDS wants 1 or more).
pub fn weight(policy: &Policy) -> u32 {
    match *policy {
        Policy::WeightedRoundRobin { weight }
        | Policy::WeightedRandom { weight }
        | Policy::WeightedRandomDpf { weight, .. } => weight.max(1),
        Policy::Credits { credits, .. } => credits.max(1),
        _ => match policy.load() {
            // The free share of a load (0 = idle, u32::MAX = full) in percent, plus one.
            Some(load) => 1 + ((u64::from(u32::MAX - load) * 100) / u64::from(u32::MAX)) as u32,
            None => 1,
        },
    }
}

/// Whether a pool of this policy balances by what its PEs report (load, credits).
pub fn adaptive(policy: &Policy) -> bool {
    policy.is_adaptive() || matches!(policy, Policy::Credits { .. })
}

/// A pool's four resources, encoded once for every stream that asks.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolResources {
    pub cluster: Any,
    pub endpoints: Any,
    pub listener: Any,
    pub route: Any,
}

impl PoolResources {
    /// The resources of pool `handle` with `members` (sorted by PE ID, so that the same pool
    /// encodes the same bytes); `adaptive` when its policy follows load or credits.
    pub fn new(handle: &str, members: &[Member], adaptive: bool) -> PoolResources {
        PoolResources {
            cluster: any(&cluster(handle, adaptive)),
            endpoints: any(&assignment(handle, members)),
            listener: any(&listener(handle)),
            route: any(&route_config(handle)),
        }
    }

    pub fn get(&self, kind: Kind) -> &Any {
        match kind {
            Kind::Cluster => &self.cluster,
            Kind::Endpoints => &self.endpoints,
            Kind::Listener => &self.listener,
            Kind::Route => &self.route,
        }
    }
}

fn any<M: Message + Name>(m: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

/// Where the cluster's endpoints and the listener's routes come from: this same ADS stream.
fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn cluster(handle: &str, adaptive: bool) -> Cluster {
    let policy = |name: &str, config: Any| load_balancing_policy::Policy {
        typed_extension_config: Some(TypedExtensionConfig {
            name: name.to_string(),
            typed_config: Some(config),
        }),
    };
    let mut policies = Vec::new();
    if adaptive {
        policies.push(policy(
            "envoy.load_balancing_policies.least_request",
            any(&LeastRequest::default()),
        ));
    }
    policies.push(policy(
        "envoy.load_balancing_policies.round_robin",
        any(&RoundRobin::default()),
    ));
    Cluster {
        name: handle.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        load_balancing_policy: Some(LoadBalancingPolicy { policies }),
        connect_timeout: Some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        ..Default::default()
    }
}

fn assignment(handle: &str, members: &[Member]) -> ClusterLoadAssignment {
    let endpoints = members
        .iter()
        .map(|m| {
            let weight = Some(UInt32Value { value: m.weight });
            LocalityLbEndpoints {
                locality: Some(Locality {
                    sub_zone: format!("{:#010x}", m.id),
                    ..Default::default()
                }),
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_address(m.addr)),
                        ..Default::default()
                    })),
                    health_status: HealthStatus::Healthy as i32,
                    load_balancing_weight: weight,
                    ..Default::default()
                }],
                load_balancing_weight: weight,
                ..Default::default()
            }
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: handle.to_string(),
        endpoints,
        ..Default::default()
    }
}

fn socket_address(a: SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            protocol: socket_address::Protocol::Tcp as i32,
            address: a.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                a.port(),
            ))),
            ..Default::default()
        })),
    }
}

/// For proxyless gRPC (target `xds:///HANDLE`): an API listener whose HTTP connection manager
/// takes its routes over ADS.
fn listener(handle: &str) -> Listener {
    let hcm = HttpConnectionManager {
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: handle.to_string(),
        })),
        http_filters: vec![HttpFilter {
            name: "router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(
                any(&Router::default()),
            )),
            ..Default::default()
        }],
        ..Default::default()
    };
    Listener {
        name: handle.to_string(),
        api_listener: Some(ApiListener {
            api_listener: Some(any(&hcm)),
        }),
        ..Default::default()
    }
}

/// Every call to the pool's cluster.
fn route_config(handle: &str) -> RouteConfiguration {
    RouteConfiguration {
        name: handle.to_string(),
        virtual_hosts: vec![VirtualHost {
            name: handle.to_string(),
            domains: vec!["*".to_string()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix(String::new())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                        handle.to_string(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode<M: Message + Default>(a: &Any) -> M {
        M::decode(a.value.as_slice()).unwrap_or_else(|e| panic!("{}: {e}", a.type_url))
    }

    #[test]
    fn a_pool_becomes_a_cluster_its_endpoints_a_listener_and_a_route() {
        let members = [
            Member {
                id: 1,
                addr: "10.0.0.1:50051".parse().unwrap(),
                weight: 1,
            },
            Member {
                id: 2,
                addr: "[::1]:50052".parse().unwrap(),
                weight: 4,
            },
        ];
        let r = PoolResources::new("EchoGrpc", &members, false);
        let c: Cluster = decode(&r.cluster);
        assert_eq!(c.name, "EchoGrpc");
        assert_eq!(r.cluster.type_url, Kind::Cluster.type_url());
        let cla: ClusterLoadAssignment = decode(&r.endpoints);
        assert_eq!(cla.cluster_name, "EchoGrpc");
        let weights: Vec<u32> = cla
            .endpoints
            .iter()
            .map(|l| l.load_balancing_weight.as_ref().unwrap().value)
            .collect();
        assert_eq!(weights, [1, 4]);
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) =
            &cla.endpoints[1].lb_endpoints[0].host_identifier
        else {
            panic!("no endpoint");
        };
        let Some(address::Address::SocketAddress(sa)) = &e.address.as_ref().unwrap().address else {
            panic!("no socket address");
        };
        assert_eq!(sa.address, "::1");
        let l: Listener = decode(&r.listener);
        let hcm: HttpConnectionManager =
            decode(l.api_listener.unwrap().api_listener.as_ref().unwrap());
        let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = hcm.route_specifier else {
            panic!("no RDS");
        };
        assert_eq!(rds.route_config_name, "EchoGrpc");
        let rc: RouteConfiguration = decode(&r.route);
        assert_eq!(rc.virtual_hosts[0].domains, ["*"]);
    }

    #[test]
    fn weights_follow_the_policy_information() {
        assert_eq!(weight(&Policy::WeightedRoundRobin { weight: 7 }), 7);
        assert_eq!(weight(&Policy::WeightedRoundRobin { weight: 0 }), 1);
        assert_eq!(weight(&Policy::RoundRobin), 1);
        assert_eq!(weight(&Policy::LeastUsed { load: 0 }), 101);
        assert_eq!(weight(&Policy::LeastUsed { load: u32::MAX }), 1);
        assert_eq!(
            weight(&Policy::Credits {
                credits: 12,
                capacity: 20
            }),
            12
        );
    }
}
