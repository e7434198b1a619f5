//! The resources as Envoy's and xds's own .proto files describe them, decoded by another
//! protobuf implementation (Python's, with descriptors compiled by protoc from python3-grpc-tools)
//! from the .proto sources the envoy-types crate ships: every field the mapping
//! (docs/XDS.md) sets is where the protos say.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use prost::Message;
use rserpool_xds::resources::{Member, PoolResources};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

const REFLECT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/xds_reflect.py");

/// Where the envoy-types crate this one builds with keeps its .proto files.
fn proto_root() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--manifest-path",
            manifest,
        ])
        // Only this host's packages: all of them are here since the build.
        .args([
            "--filter-platform",
            &format!("{}-unknown-linux-gnu", std::env::consts::ARCH),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let path = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "envoy-types")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("envoy-types among the packages");
    PathBuf::from(path).parent().unwrap().join("proto")
}

#[test]
fn every_resource_decodes_as_the_protos_describe_it() {
    let members = [
        Member {
            id: 0x11,
            addr: SocketAddr::from(([10, 0, 0, 1], 50051)),
            weight: 1,
        },
        Member {
            id: 0x22,
            addr: "[2001:db8::2]:50052".parse().unwrap(),
            weight: 4,
        },
    ];
    let r = PoolResources::new("EchoGrpc", &members, true);
    let dir = std::env::temp_dir().join(format!("rserpool-xds-reflect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for (name, any) in [
        ("cluster", &r.cluster),
        ("endpoints", &r.endpoints),
        ("listener", &r.listener),
        ("route", &r.route),
    ] {
        let path = dir.join(name);
        // The Any itself, as it travels in a DiscoveryResponse.
        let any = envoy_types::pb::google::protobuf::Any {
            type_url: any.type_url.clone(),
            value: any.value.clone(),
        };
        std::fs::write(&path, any.encode_to_vec()).unwrap();
        files.push(path);
    }
    let out = Command::new("/usr/bin/python3")
        .arg(REFLECT)
        .arg(proto_root())
        .arg(&dir)
        .args(&files)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let decoded: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let [cluster, endpoints, listener, route] = decoded.as_slice() else {
        panic!("four resources: {decoded:?}");
    };

    assert_eq!(cluster["type"], "envoy.config.cluster.v3.Cluster");
    let c = &cluster["message"];
    assert_eq!(c["name"], "EchoGrpc");
    assert_eq!(c["type"], "EDS");
    assert_eq!(
        c["edsClusterConfig"]["edsConfig"]["ads"],
        serde_json::json!({})
    );
    assert_eq!(
        c["edsClusterConfig"]["edsConfig"]["resourceApiVersion"],
        "V3"
    );
    assert_eq!(c["connectTimeout"], "1s");
    // ROUND_ROBIN is the enum's zero: the JSON mapping leaves it out.
    assert!(c.get("lbPolicy").is_none(), "{c}");
    // For clients that read the typed list (Envoy): least request first (an adaptive pool).
    let policies = c["loadBalancingPolicy"]["policies"].as_array().unwrap();
    let types: Vec<&str> = policies
        .iter()
        .map(|p| {
            p["typedExtensionConfig"]["typedConfig"]["@type"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(
        types,
        [
            "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
            "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
        ]
    );

    assert_eq!(
        endpoints["type"],
        "envoy.config.endpoint.v3.ClusterLoadAssignment"
    );
    let e = &endpoints["message"];
    assert_eq!(e["clusterName"], "EchoGrpc");
    let localities = e["endpoints"].as_array().unwrap();
    assert_eq!(localities.len(), 2);
    assert_eq!(localities[1]["locality"]["subZone"], "0x00000022");
    assert_eq!(localities[1]["loadBalancingWeight"], 4);
    let lb = &localities[1]["lbEndpoints"][0];
    assert_eq!(lb["healthStatus"], "HEALTHY");
    assert_eq!(lb["loadBalancingWeight"], 4);
    let sa = &lb["endpoint"]["address"]["socketAddress"];
    assert_eq!(sa["address"], "2001:db8::2");
    assert_eq!(sa["portValue"], 50052);
    assert_eq!(
        localities[0]["lbEndpoints"][0]["endpoint"]["address"]["socketAddress"]["address"],
        "10.0.0.1"
    );

    assert_eq!(listener["type"], "envoy.config.listener.v3.Listener");
    let hcm = &listener["message"]["apiListener"]["apiListener"];
    assert_eq!(
        hcm["@type"],
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    );
    assert_eq!(hcm["rds"]["routeConfigName"], "EchoGrpc");
    assert_eq!(hcm["rds"]["configSource"]["ads"], serde_json::json!({}));
    assert_eq!(
        hcm["httpFilters"][0]["typedConfig"]["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
    );

    assert_eq!(route["type"], "envoy.config.route.v3.RouteConfiguration");
    let vh = &route["message"]["virtualHosts"][0];
    assert_eq!(vh["domains"], serde_json::json!(["*"]));
    assert_eq!(vh["routes"][0]["match"]["prefix"], "");
    assert_eq!(vh["routes"][0]["route"]["cluster"], "EchoGrpc");
}
