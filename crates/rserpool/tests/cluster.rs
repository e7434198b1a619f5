//! A registrar cluster (ENRP) over real sockets: three `rserpool registrar` processes, 100 pool
//! elements spread over them, pool users at each. One registrar fails (SIGKILL on loopback, or
//! its link cut in a network namespace); the survivors take over its PEs, which move without
//! registering again; restarted, it synchronises from a mentor.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop, free_port, registrar_status, wait_for};

use rserpool_asap::{PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_wire::{Policy, PoolHandle};
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::Duration;

const POOL: &str = "ClusterPool";
const PES: usize = 100;
// Short ENRP timers, so that a failure is handled within seconds.
const HEARTBEAT_MS: u64 = 200;
const LAST_HEARD_MS: u64 = 600;
const NO_RESPONSE_MS: u64 = 600;
const KEEP_ALIVE_MS: u64 = 500;

/// One registrar of the cluster: where it listens and, when run inside a namespace, which one.
struct Node {
    asap: SocketAddr,
    enrp: SocketAddr,
    status: SocketAddr,
    netns: Option<String>,
    proc: Option<KillOnDrop>,
}

struct Cluster {
    nodes: Vec<Node>,
}

impl Cluster {
    /// Three registrars on loopback, none started.
    fn on_loopback() -> Cluster {
        let nodes = (0..3)
            .map(|_| Node {
                asap: SocketAddr::from(([127, 0, 0, 1], free_port())),
                enrp: SocketAddr::from(([127, 0, 0, 1], free_port())),
                status: SocketAddr::from(([127, 0, 0, 1], free_port())),
                netns: None,
                proc: None,
            })
            .collect();
        Cluster { nodes }
    }

    fn start(&mut self, i: usize) {
        let n = &self.nodes[i];
        let mut args: Vec<String> = vec![
            "registrar".into(),
            "--asap".into(),
            n.asap.to_string(),
            "--enrp".into(),
            n.enrp.to_string(),
            "--status".into(),
            n.status.to_string(),
            "--peer-heartbeat-ms".into(),
            HEARTBEAT_MS.to_string(),
            "--max-time-last-heard-ms".into(),
            LAST_HEARD_MS.to_string(),
            "--max-time-no-response-ms".into(),
            NO_RESPONSE_MS.to_string(),
            "--mentor-discovery-ms".into(),
            "1000".into(),
            "--takeover-expiry-ms".into(),
            "2000".into(),
            "--keep-alive-interval-ms".into(),
            KEEP_ALIVE_MS.to_string(),
            "--keep-alive-timeout-ms".into(),
            KEEP_ALIVE_MS.to_string(),
        ];
        for (j, other) in self.nodes.iter().enumerate() {
            if j != i {
                args.push("--peer".into());
                args.push(other.enrp.to_string());
            }
        }
        let mut cmd = match &n.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, BIN]);
                c
            }
            None => Command::new(BIN),
        };
        let log = std::env::var("CLUSTER_LOG").is_ok();
        let child = cmd
            .args(&args)
            .env("RUST_LOG", if log { "info" } else { "warn" })
            .stdout(Stdio::null())
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .expect("spawn rserpool registrar");
        self.nodes[i].proc = Some(KillOnDrop(child));
    }

    /// Upgrades registrar `i`: a second process with the same flags takes it over; returns
    /// once the first has handed over and exited.
    async fn upgrade(&mut self, i: usize) {
        let mut old = self.nodes[i].proc.take().expect("running");
        self.start(i);
        let t0 = std::time::Instant::now();
        while old.0.try_wait().unwrap().is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the old registrar did not hand over"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self, i: usize) {
        let p = self.nodes[i].proc.take().expect("running");
        let ok = Command::new("sh")
            .args(["-c", &format!("kill -KILL {}", p.0.id())])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -KILL");
        drop(p);
    }
}

/// The PE IDs a pool user at `asap` gets for the pool (all of them: it asks for 1,000).
async fn resolve_ids(asap: SocketAddr) -> BTreeSet<u32> {
    let Ok(mut pu) = PoolUser::new(PoolUserConfig {
        registrars: vec![asap],
        items: Some(1000),
        ..PoolUserConfig::default()
    }) else {
        return BTreeSet::new();
    };
    match pu.resolve(&PoolHandle::from(POOL)).await {
        Ok(r) => r.pool_elements.iter().map(|p| p.id).collect(),
        Err(_) => BTreeSet::new(),
    }
}

/// Every registrar in `live` holds all `ids`, homed at live registrars, resolves all of them,
/// and agrees with every peer on checksums.
async fn consistent(cluster: &Cluster, live: &[usize], ids: &BTreeSet<u32>) -> Result<(), String> {
    let mut homes = BTreeSet::new();
    let mut statuses = Vec::new();
    for &i in live {
        let st = registrar_status(cluster.nodes[i].status)
            .await
            .ok_or(format!("registrar {i} does not answer"))?;
        homes.insert(st.server_id);
        statuses.push((i, st));
    }
    for (i, st) in &statuses {
        let pes: BTreeSet<u32> = st
            .pools
            .iter()
            .flat_map(|p| p.pes.iter().map(|e| e.id))
            .collect();
        if &pes != ids {
            return Err(format!(
                "registrar {i} holds {} of {} PEs",
                pes.len(),
                ids.len()
            ));
        }
        if let Some(pe) = st
            .pools
            .iter()
            .flat_map(|p| &p.pes)
            .find(|e| !homes.contains(&e.home_registrar))
        {
            return Err(format!(
                "registrar {i}: PE {:#x} homed at {:#x}, not a live registrar",
                pe.id, pe.home_registrar
            ));
        }
        let live_peers: Vec<_> = st.peers.iter().filter(|p| homes.contains(&p.id)).collect();
        if live_peers.len() + 1 != live.len() {
            return Err(format!(
                "registrar {i} sees {} live peers",
                live_peers.len()
            ));
        }
        if let Some(p) = live_peers.iter().find(|p| p.checksum_agrees != Some(true)) {
            return Err(format!("registrar {i}: checksum of {:#x} differs", p.id));
        }
        let resolved = resolve_ids(cluster.nodes[*i].asap).await;
        if &resolved != ids {
            return Err(format!("registrar {i} resolves {} PEs", resolved.len()));
        }
    }
    Ok(())
}

/// Registrations (new or repeated) the registrars in `live` have counted.
async fn registrations(cluster: &Cluster, live: &[usize]) -> u64 {
    let mut n = 0;
    for &i in live {
        let st = registrar_status(cluster.nodes[i].status)
            .await
            .expect("status");
        n += st.counters.registrations + st.counters.reregistrations;
    }
    n
}

/// Starts the PEs, each preferring registrar `k % 3` (the others are its fallbacks).
fn start_pes(cluster: &Cluster, takeover_ip: IpAddr) -> Vec<PoolElement> {
    (0..PES)
        .map(|k| {
            let mut cfg = PoolElementConfig::new(
                POOL,
                SocketAddr::from(([127, 0, 0, 1], 20_000 + k as u16)),
                Policy::RoundRobin,
            );
            let n = cluster.nodes.len();
            cfg.registrars = (0..n).map(|j| cluster.nodes[(k + j) % n].asap).collect();
            cfg.reregistration_interval = Duration::from_secs(120);
            cfg.backoff_min = Duration::from_millis(50);
            cfg.backoff_max = Duration::from_millis(500);
            cfg.takeover_listen = Some(SocketAddr::new(takeover_ip, 0));
            cfg.takeover_wait = Duration::from_secs(15);
            PoolElement::start(cfg).unwrap()
        })
        .collect()
}

/// Starts the three registrars, waits until they peer, then starts the PEs and waits until
/// every registrar holds them all.
async fn with_pes(cluster: &mut Cluster, takeover_ip: IpAddr) -> (Vec<PoolElement>, BTreeSet<u32>) {
    for i in 0..3 {
        cluster.start(i);
    }
    let all = [0, 1, 2];
    let none = BTreeSet::new();
    wait_for(Duration::from_secs(20), "three registrars peered", || {
        consistent(cluster, &all, &none)
    })
    .await;
    let pes = start_pes(cluster, takeover_ip);
    let ids: BTreeSet<u32> = pes.iter().map(PoolElement::id).collect();
    let t = wait_for(Duration::from_secs(30), "100 PEs everywhere", || {
        consistent(cluster, &all, &ids)
    })
    .await;
    eprintln!("{PES} PEs registered, replicated and resolvable at all 3 registrars in {t:?}");
    (pes, ids)
}

/// The scenario: sync, a failure of registrar 2 by `fail`, takeover, restart by `revive`.
async fn fail_and_recover(
    mut cluster: Cluster,
    takeover_ip: IpAddr,
    fail: impl FnOnce(&mut Cluster),
    revive: impl FnOnce(&mut Cluster),
) {
    let all = [0, 1, 2];
    let (pes, ids) = with_pes(&mut cluster, takeover_ip).await;
    let victim = registrar_status(cluster.nodes[2].status).await.unwrap();
    let owned = victim
        .pools
        .iter()
        .flat_map(|p| &p.pes)
        .filter(|e| e.home_registrar == victim.server_id)
        .count();
    assert!(owned > 0, "registrar 2 is home for some PEs");
    let before = registrations(&cluster, &[0, 1]).await;

    fail(&mut cluster);
    // The bound: max-time-last-heard + max-time-no-response + one keep-alive cycle
    // (plus the takeover round trip and polling slack).
    let bound = Duration::from_millis(LAST_HEARD_MS + NO_RESPONSE_MS + KEEP_ALIVE_MS + 1500);
    let t = wait_for(bound, "the survivors to take over", || {
        consistent(&cluster, &[0, 1], &ids)
    })
    .await;
    eprintln!(
        "registrar 2 failed: its {owned} PEs taken over and resolvable at both survivors in {t:?}"
    );
    let after = registrations(&cluster, &[0, 1]).await;
    assert_eq!(before, after, "no PE registered again");
    for pe in &pes {
        match pe.state() {
            rserpool_asap::PeState::Registered { home, .. } => {
                assert_ne!(
                    home,
                    victim.server_id,
                    "PE {:#x} follows its new home",
                    pe.id()
                );
            }
            other => panic!("PE {:#x} is {other:?}", pe.id()),
        }
    }

    revive(&mut cluster);
    let t = wait_for(
        Duration::from_secs(20),
        "the restarted registrar to sync",
        || consistent(&cluster, &all, &ids),
    )
    .await;
    eprintln!("registrar 2 restarted and synchronised the full handlespace in {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_registrars_pes_are_taken_over_and_it_resyncs_after_restart() {
    fail_and_recover(
        Cluster::on_loopback(),
        IpAddr::from([127, 0, 0, 1]),
        |c| c.kill(2),
        |c| c.start(2),
    )
    .await;
}

/// Network namespaces r1..r3 on a bridge in this (the test's) namespace, which runs the PEs.
struct Netns {
    names: Vec<String>,
    bridge: String,
    links: Vec<String>,
}

fn sh(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", cmd])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn must(cmd: &str) {
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    fn create(tag: u32) -> Self {
        let bridge = format!("rspbr{tag}");
        let names: Vec<String> = (1..=3).map(|i| format!("rsp{tag}r{i}")).collect();
        let links: Vec<String> = (1..=3).map(|i| format!("rsp{tag}v{i}")).collect();
        let me = Self {
            names,
            bridge,
            links,
        };
        must(&format!("ip link add {} type bridge", me.bridge));
        must(&format!("ip addr add 10.77.0.254/24 dev {}", me.bridge));
        must(&format!("ip link set {} up", me.bridge));
        for (i, (ns, link)) in me.names.iter().zip(&me.links).enumerate() {
            must(&format!("ip netns add {ns}"));
            must(&format!(
                "ip link add {link} type veth peer name eth0 netns {ns}"
            ));
            must(&format!("ip link set {link} master {} up", me.bridge));
            must(&format!(
                "ip -n {ns} addr add 10.77.0.{}/24 dev eth0",
                i + 1
            ));
            must(&format!("ip -n {ns} link set eth0 up"));
            must(&format!("ip -n {ns} link set lo up"));
        }
        me
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.names {
            sh(&format!("ip netns del {ns}"));
        }
        for l in &self.links {
            sh(&format!("ip link del {l}"));
        }
        sh(&format!("ip link del {}", self.bridge));
    }
}

/// Whether network namespaces can be made here. CI runs as root with iproute2 (.ci/run
/// installs it): there, not being able to is a failure.
fn namespaces_usable() -> bool {
    (sh("ip netns list") && sh("test \"$(id -u)\" = 0"))
        || !rserpool_ksplice::testbed::skip("network namespaces need root and iproute2")
}

/// The three registrars, one in each namespace of `net`.
fn in_namespaces(net: &Netns) -> Cluster {
    let nodes = (0..3)
        .map(|i| {
            let ip = IpAddr::from([10, 77, 0, i as u8 + 1]);
            Node {
                asap: SocketAddr::new(ip, 3863),
                enrp: SocketAddr::new(ip, 9901),
                status: SocketAddr::new(ip, rserpool_registrar::DEFAULT_STATUS.port()),
                netns: Some(net.names[i].clone()),
                proc: None,
            }
        })
        .collect();
    Cluster { nodes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_cut_off_in_a_namespace_is_taken_over() {
    if !namespaces_usable() {
        return;
    }
    let net = Netns::create(std::process::id() % 10_000);
    let link = net.links[2].clone();
    let link2 = link.clone();
    fail_and_recover(
        in_namespaces(&net),
        IpAddr::from([10, 77, 0, 254]),
        move |_| must(&format!("ip link set {link} down")),
        move |c| {
            // Back on the network, as a new registrar (a restart after the outage).
            c.kill(2);
            must(&format!("ip link set {link2} up"));
            c.start(2);
        },
    )
    .await;
    drop(net);
}

/// A registrar's link is cut for longer than a takeover takes, then comes back, with no
/// restart (docs/RELIABILITY.md, "What earlier runs found"). Its peers take its PEs over and at
/// no look (every 50 ms) does either lose one. Cut off, it hears neither peers nor PEs, so it
/// takes over no one; back, it claims for a while the PEs that moved, and nothing of that
/// reaches the others as news. Then all three agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_back_from_a_cut_takes_nothing_from_the_others() {
    if !namespaces_usable() {
        return;
    }
    let net = Netns::create((std::process::id() + 5_000) % 10_000);
    let mut cluster = in_namespaces(&net);
    let (_pes, ids) = with_pes(&mut cluster, IpAddr::from([10, 77, 0, 254])).await;
    let holds_all = |cluster: &Cluster, phase: &'static str, all: bool| {
        let mut asaps: Vec<(usize, SocketAddr)> =
            (0..2).map(|i| (i, cluster.nodes[i].asap)).collect();
        if all {
            asaps.push((2, cluster.nodes[2].asap));
        }
        let ids = &ids;
        async move {
            for (i, asap) in asaps {
                let got = resolve_ids(asap).await;
                assert_eq!(
                    &got,
                    ids,
                    "registrar {i} resolves {} PEs {phase}",
                    got.len()
                );
            }
        }
    };
    let link = &net.links[2];
    must(&format!("ip link set {link} down"));
    // Past a takeover: last heard, no response, the takeover's round trip.
    let cut = Duration::from_millis(LAST_HEARD_MS + NO_RESPONSE_MS + 1_300);
    let t0 = std::time::Instant::now();
    while t0.elapsed() < cut {
        holds_all(&cluster, "while registrar 2 is cut off", false).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    must(&format!("ip link set {link} up"));
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(4) {
        // Registrar 2 too: the PEs that moved while it was cut off close their associations
        // with it, and it keeps them as their new home's.
        holds_all(&cluster, "after registrar 2 came back", true).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t = wait_for(Duration::from_secs(20), "all three agree", || {
        consistent(&cluster, &[0, 1, 2], &ids)
    })
    .await;
    eprintln!("registrar 2 back from a {cut:?} cut; all three agree {t:?} later");
    let st = registrar_status(cluster.nodes[2].status).await.unwrap();
    assert_eq!(st.enrp.takeovers, 0, "cut off, it took over no one");
    assert!(st.enrp.takeovers_deferred > 0, "{:?}", st.enrp);
    drop(cluster);
    drop(net);
}

/// A registrar of the cluster upgraded (a second process started with the same flags takes it
/// over, docs/OPERATIONS.md): past the time a takeover would need, its peers took over none of
/// its PEs, every PE kept its home and registered nowhere again, and all three registrars agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_registrar_keeps_its_pes_in_the_cluster() {
    let mut cluster = Cluster::on_loopback();
    let all = [0, 1, 2];
    let (pes, ids) = with_pes(&mut cluster, IpAddr::from([127, 0, 0, 1])).await;
    // Each PE's home, as registrar 0 holds it.
    let homes = |st: rserpool_registrar::Status| -> std::collections::BTreeMap<u32, u32> {
        st.pools
            .iter()
            .flat_map(|p| &p.pes)
            .map(|e| (e.id, e.home_registrar))
            .collect()
    };
    let homes_before = homes(registrar_status(cluster.nodes[0].status).await.unwrap());
    let upgraded = registrar_status(cluster.nodes[2].status).await.unwrap();
    let owned = homes_before
        .values()
        .filter(|h| **h == upgraded.server_id)
        .count();
    assert!(owned > 0, "registrar 2 is home for some PEs");
    // A PE that goes back to registering lost its association.
    let lost = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    for pe in &pes {
        let mut state = pe.watch_state();
        let lost = lost.clone();
        tokio::spawn(async move {
            while state.changed().await.is_ok() {
                if matches!(*state.borrow(), rserpool_asap::PeState::Registering) {
                    lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
    }

    // A pool user of the upgraded registrar resolves all along: every answer holds all PEs,
    // those of the other registrars too.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resolving = tokio::spawn({
        let (stop, asap, ids) = (stop.clone(), cluster.nodes[2].asap, ids.clone());
        async move {
            let mut pu = PoolUser::new(PoolUserConfig {
                registrars: vec![asap],
                ..PoolUserConfig::default()
            })
            .unwrap();
            let (mut whole, mut partial) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match pu.pool_elements(&PoolHandle::from(POOL)).await {
                    Ok((_, pes)) if pes.iter().map(|p| p.id).collect::<BTreeSet<_>>() == ids => {
                        whole += 1
                    }
                    Ok((_, pes)) => partial.push(pes.len().to_string()),
                    Err(e) => partial.push(e.to_string()),
                }
                // Within the registrar's resolution rate limit for one association.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (whole, partial)
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.upgrade(2).await;
    // Longer than a peer would wait before taking the PEs over.
    tokio::time::sleep(Duration::from_millis(
        LAST_HEARD_MS + NO_RESPONSE_MS + KEEP_ALIVE_MS + 1000,
    ))
    .await;
    wait_for(Duration::from_secs(10), "the cluster consistent", || {
        consistent(&cluster, &all, &ids)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (whole, partial) = resolving.await.unwrap();
    assert!(
        partial.is_empty() && whole > 10,
        "{whole} whole answers; not whole: {partial:?}"
    );
    let st = registrar_status(cluster.nodes[2].status).await.unwrap();
    assert_eq!(
        st.server_id, upgraded.server_id,
        "the Server Identifier stays"
    );
    for i in all {
        let st = registrar_status(cluster.nodes[i].status).await.unwrap();
        assert_eq!(st.enrp.takeovers, 0, "registrar {i} took PEs over");
    }
    assert_eq!(
        homes(registrar_status(cluster.nodes[0].status).await.unwrap()),
        homes_before,
        "every PE kept its home"
    );
    assert_eq!(
        lost.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no PE lost its association"
    );
}

/// A registrar that took PEs over (its associations with them are the connections it opened to
/// their takeover addresses) is upgraded: the successor takes those associations too, so every
/// PE stays at every live registrar, bound to a live association; and when the successor dies
/// in turn, the last registrar takes every PE over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_registrar_keeps_the_pes_it_took_over() {
    let mut cluster = Cluster::on_loopback();
    let (_pes, ids) = with_pes(&mut cluster, IpAddr::from([127, 0, 0, 1])).await;
    cluster.kill(2);
    let bound = Duration::from_millis(LAST_HEARD_MS + NO_RESPONSE_MS + KEEP_ALIVE_MS + 1500);
    wait_for(bound, "the survivors to take over", || {
        consistent(&cluster, &[0, 1], &ids)
    })
    .await;
    // The survivor that took registrar 2's PEs over.
    let homes = |st: &rserpool_registrar::Status| -> BTreeSet<u32> {
        st.pools
            .iter()
            .flat_map(|p| &p.pes)
            .filter(|e| e.home_registrar == st.server_id)
            .map(|e| e.id)
            .collect()
    };
    let mut taker = None;
    for i in [0, 1] {
        let st = registrar_status(cluster.nodes[i].status).await.unwrap();
        if st.enrp.takeovers > 0 {
            taker = Some((i, homes(&st)));
        }
    }
    let (i, homed) = taker.expect("a survivor took registrar 2's PEs over");
    assert!(homed.len() > PES / 3, "{} PEs homed at {i}", homed.len());
    cluster.upgrade(i).await;
    // Without those associations the successor would lack the PEs until they registered
    // again (after their takeover wait, 15 s).
    wait_for(
        Duration::from_secs(5),
        "both survivors holding every PE",
        || consistent(&cluster, &[0, 1], &ids),
    )
    .await;
    // Keep-alives over the associations handed over are answered.
    tokio::time::sleep(Duration::from_millis(3 * KEEP_ALIVE_MS)).await;
    let st = registrar_status(cluster.nodes[i].status).await.unwrap();
    assert_eq!(homes(&st), homed, "the successor is home for the same PEs");
    let stale: Vec<u32> = st
        .pools
        .iter()
        .flat_map(|p| &p.pes)
        .filter(|e| homed.contains(&e.id) && e.ms_since_heard > 2 * KEEP_ALIVE_MS)
        .map(|e| e.id)
        .collect();
    assert!(stale.is_empty(), "not heard from: {stale:x?}");
    // The successor knows where each PE listens for a takeover: when it dies, the last
    // registrar takes them all over in the usual time.
    cluster.kill(i);
    let last = [1 - i];
    wait_for(bound, "the last registrar to take everything over", || {
        consistent(&cluster, &last, &ids)
    })
    .await;
    let st = registrar_status(cluster.nodes[last[0]].status)
        .await
        .unwrap();
    assert_eq!(homes(&st), ids, "the last registrar is home for every PE");
}
